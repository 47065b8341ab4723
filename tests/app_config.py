"""The Hydra app's config as a test composes it: conf/ with this package's structured configs registered."""
from hydra import compose, initialize_config_dir

from lightning_par import config as schemas
from lightning_par.paths import conf_dir


def compose_app(*overrides: str):
    """``config.yaml`` composed with ``overrides``, as ``lightning-par-train`` would before it runs."""
    schemas.register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return compose("config", overrides=list(overrides))
