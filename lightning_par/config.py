"""Structured-config schemas of the ``lightning-par-train`` Hydra app.

Every YAML file under ``conf/<group>/`` starts from one of these dataclasses (``defaults: [<name>_schema]``),
so OmegaConf checks the keys and types when the config is composed: ``strategy.comm_hok=fp16`` or
``trainer.max_steps=ten`` fails right there, naming the key, before anything is launched.

The strategies' schemas are generated from their constructors ([Note: strategy schemas are generated]);
the model and data schemas are written out below (their ``null`` sizes mean "from the data"). Adding an
option to a group takes one line in its ``*_SCHEMAS`` dict (a strategy: ``strategy_schema(name, cls)``)
and a file ``conf/<group>/<option>.yaml`` whose defaults list names ``<option>_schema``;
``tests/unit/test_configs.py`` then composes and instantiates it automatically.

[Note: fields that YAML cannot express]
OmegaConf 2.3 has no ``Union`` or ``Literal`` types: arguments such as ``devices`` (int, list or "auto")
are typed ``Any`` here and checked by :func:`lightning_par.train.build_trainer_kwargs` or the constructor, and
enumerations (``precision``, ``comm_hook``: a ``Literal``) are plain strings the constructors themselves
validate with a ``ValueError`` naming the choices. Durations are seconds (``timeout: float``, the
``timedelta`` a constructor also takes left out).
"""
from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import os
from dataclasses import dataclass, field, make_dataclass
from datetime import datetime, timedelta
from functools import cache
from types import UnionType
from typing import Any, Literal, Optional, Sequence, Union, get_args, get_origin, get_type_hints  # noqa: F401

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lightning_par.strategies import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                                      TensorParallelStrategy)

# --------------------------------------------------------------------------------------------- strategy


@dataclass
class SingleStrategyConfig:
    """One device, Lightning's own default strategy (``strategy="auto"``, ``trainer.devices=1``)."""

    _target_: str = "lightning_par.config.single_device_strategy"


# Lightning plumbing a strategy accepts but a config never sets (the Trainer passes them)
PLUMBING = frozenset({"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"})
_YAML_TYPES = (bool, int, float, str)


def yaml_type(annotation: Any) -> Any:
    """The type OmegaConf checks for a constructor argument annotated ``annotation`` ([Note: fields that YAML
    cannot express]): a plain ``bool`` / ``int`` / ``float`` / ``str``, ``Optional`` of one, else ``Any``.

    Example::

        >>> yaml_type(Union[float, timedelta]), yaml_type(Optional[Literal["fp16", "bf16"]])
        (<class 'float'>, typing.Optional[str])
        >>> yaml_type(Union[int, Literal["auto"]]), yaml_type(Union[str, Sequence[int]])
        (typing.Any, typing.Any)
    """
    if annotation in _YAML_TYPES:
        return annotation
    if get_origin(annotation) is Literal:
        kinds = {type(a) for a in get_args(annotation)}
        return kinds.pop() if len(kinds) == 1 and kinds <= set(_YAML_TYPES) else Any
    if get_origin(annotation) not in (Union, UnionType):
        return Any
    members = [a for a in get_args(annotation) if a is not type(None) and a is not timedelta]  # seconds only
    kinds = {yaml_type(a) for a in members}
    if kinds == {int, float}:
        kinds = {float}  # an int is a float to OmegaConf
    if len(kinds) != 1 or Any in kinds or get_origin(next(iter(kinds))) is Union:
        return Any
    (kind,) = kinds
    return Optional[kind] if type(None) in get_args(annotation) else kind


def strategy_schema(name: str, cls: type) -> type:
    """The structured config of strategy ``cls``: ``_target_`` plus one field per keyword of its constructor
    (Lightning's plumbing aside), with the constructor's default and :func:`yaml_type` of its annotation.

    [Note: strategy schemas are generated]
    A keyword added to a strategy's constructor is settable from the command line with no second edit:
    the schema is read off the signature when this module is imported, so its keys, defaults and
    checkable types are the constructor's by construction (``tests/unit/test_configs.py`` checks it). Our
    strategies' keywords are in turn the fields of their frozen option groups ([Note: flat keywords, grouped
    options] in :mod:`lightning_par.options`; ``tests/unit/test_options.py`` checks the schemas against them).
    """
    hints = get_type_hints(cls.__init__)
    fields = [("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY or param.name in PLUMBING:
            continue
        default = MISSING if param.default is param.empty else param.default  # a required keyword: `???`
        value = field(default_factory=lambda d=default: copy.deepcopy(d)) if isinstance(default, (list, dict)) \
            else field(default=default)
        fields.append((param.name, yaml_type(hints.get(param.name, Any)), value))
    schema = make_dataclass(name, fields)
    schema.__module__ = __name__
    schema.__doc__ = f":class:`{cls.__module__}.{cls.__qualname__}`, its keywords read off its signature."
    return schema


DataParallelStrategyConfig = strategy_schema("DataParallelStrategyConfig", DataParallelStrategy)
PipelineStrategyConfig = strategy_schema("PipelineStrategyConfig", PipelineParallelStrategy)
TensorStrategyConfig = strategy_schema("TensorStrategyConfig", TensorParallelStrategy)
HybridStrategyConfig = strategy_schema("HybridStrategyConfig", HybridParallelStrategy)

STRATEGY_SCHEMAS: dict[str, type] = {
    "single": SingleStrategyConfig,
    "ddp": DataParallelStrategyConfig,
    "pipeline": PipelineStrategyConfig,
    "tensor": TensorStrategyConfig,
    "hybrid": HybridStrategyConfig,
}


def single_device_strategy() -> str:
    """The ``strategy=single`` target: Lightning picks its single-device strategy for ``devices=1``."""
    return "auto"


# ------------------------------------------------------------------------------------------------ model


@dataclass
class GPTConfig:
    """:class:`lightning_par.models.GPT`; ``null`` sizes are taken from the data (vocabulary, sequence length)."""

    _target_: str = "lightning_par.models.GPT"
    vocab_size: Optional[int] = None  # null: data's vocab_size
    block_size: Optional[int] = None  # null: data's seq_len
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 10
    lr_decay_steps: Optional[int] = None  # null: the trainer's estimated stepping batches
    min_lr_ratio: float = 0.1


@dataclass
class MLPConfig:
    """:class:`lightning_par.models.MLPClassifier`; ``null`` sizes are taken from the data."""

    _target_: str = "lightning_par.models.MLPClassifier"
    in_features: Optional[int] = None  # null: data's in_features
    num_classes: Optional[int] = None  # null: data's num_classes
    width: int = 64
    depth: int = 4
    dropout: float = 0.0
    lr: float = 1e-2


@dataclass
class HFCausalLMConfig:
    """:class:`lightning_par.models.HFCausalLM`: any Hugging Face causal LM built from its config."""

    _target_: str = "lightning_par.models.HFCausalLM"
    config: Any = MISSING  # a model name, a local folder, or {model_type: llama, hidden_size: 64, ...}
    weights: Optional[str] = None  # null | a local weights file / folder (safetensors, state dict, .ckpt, DCP)
    vocab_size: Optional[int] = None  # null: the config's, or data's vocab_size when the config has none
    lr: float = 3e-4
    weight_decay: float = 0.0


@dataclass
class CustomModelConfig:
    """``model=custom``: any importable LightningModule (``model._target_=my_pkg.MyModule +model.hidden=512``)."""

    _target_: str = MISSING


@dataclass
class CustomDataConfig:
    """``data=custom``: any importable LightningDataModule (``data._target_=my_pkg.MyData +data.batch_size=8``)."""

    _target_: str = MISSING


MODEL_SCHEMAS: dict[str, type] = {"gpt": GPTConfig, "mlp": MLPConfig, "hf": HFCausalLMConfig,
                                  "custom": CustomModelConfig}
CUSTOM = {"model": CustomModelConfig, "data": CustomDataConfig}  # keys checked against the target's signature

# ------------------------------------------------------------------------------------------------- data


@dataclass
class SyntheticCorpusConfig:
    """:class:`lightning_par.data.SyntheticCorpus`: a Markov source with a known loss floor."""

    _target_: str = "lightning_par.data.SyntheticCorpus"
    vocab_size: int = 64
    seq_len: int = 64
    batch_size: int = 16  # per device
    train_sequences: int = 2048
    val_sequences: int = 256
    sharpness: float = 2.0
    seed: int = 0  # the corpus itself (its loss floor); the run's `seed` initialises the model
    num_workers: int = 0


@dataclass
class TextFileConfig:
    """:class:`lightning_par.data.TextFile`: bytes of a text file (``data=text data.path=notes.txt``)."""

    _target_: str = "lightning_par.data.TextFile"
    path: str = MISSING
    seq_len: int = 64
    batch_size: int = 16  # per device
    val_fraction: float = 0.1
    num_workers: int = 0


@dataclass
class ClassificationConfig:
    """:class:`lightning_par.data.SyntheticClassification`: Gaussian clusters."""

    _target_: str = "lightning_par.data.SyntheticClassification"
    in_features: int = 32
    num_classes: int = 10
    batch_size: int = 32  # per device
    train_samples: int = 2048
    val_samples: int = 256
    noise: float = 1.0
    seed: int = 0
    num_workers: int = 0


DATA_SCHEMAS: dict[str, type] = {
    "synthetic": SyntheticCorpusConfig,
    "text": TextFileConfig,
    "classification": ClassificationConfig,
    "custom": CustomDataConfig,
}

# ---------------------------------------------------------------------------------------------- trainer

@dataclass
class TrainerConfig:
    """The app's defaults of ``lightning.Trainer`` arguments; ``+trainer.KEY=`` adds any other (:func:`check_keys`)."""

    accelerator: str = "auto"  # auto | cpu | cuda | ...
    devices: Any = 2  # int, list of ids or "auto"; under torchrun: the processes per node
    num_nodes: int = 1
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed | bf16-true
    max_steps: int = 300
    max_epochs: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: Any = None  # null: once per epoch; int: every N batches; float: fraction of an epoch
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Any = None  # int: batches; float: fraction
    limit_val_batches: Any = None
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False
    benchmark: Optional[bool] = None


# ------------------------------------------------------------------------------------------------- root


@dataclass
class Config:
    """The whole run: one option of each group plus the run's own settings."""

    strategy: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 1234  # model initialisation and everything else `seed_everything` seeds
    validate_at_end: bool = True  # validate the final weights (inside fit) before the summary
    metrics: bool = True  # ParallelMetrics: throughput, memory, communication, bubble (perf/* logs + a table)
    ckpt_path: Optional[str] = None  # resume from this checkpoint ("last" = the run dir's last one)
    save_last: bool = True  # keep `checkpoints/last.ckpt`


GROUPS: dict[str, dict[str, type]] = {
    "strategy": STRATEGY_SCHEMAS,
    "model": MODEL_SCHEMAS,
    "data": DATA_SCHEMAS,
    "trainer": {"default": TrainerConfig},
}


def unknown_key(group: str, key: str, owner: str, known) -> ValueError:
    """``group.key`` is not an argument of ``owner`` (a schema, a class): its valid keys, or the nearest of many."""
    names = sorted(k for k in known if not k.startswith("_"))
    near = " or ".join(f"`{n}`" for n in difflib.get_close_matches(key, names, n=3))
    hint = f"valid keys: {', '.join(names)}." if len(names) <= 30 else f"did you mean {near}?" if near else ""
    return ValueError(f"`{group}.{key}` is not a setting of {group} ({owner}); {hint} Fix the spelling or drop it.")


def check_keys(cfg: Any) -> None:
    """Refuse keys a schema does not declare (added with Hydra's ``+key=value``), naming the key.

    A plain misspelled override (``strategy.comm_hok=fp16``) already fails at composition; ``+`` forces
    the key in, and it would otherwise surface later as a constructor's ``TypeError``. ``+trainer.KEY``
    may be any argument of ``lightning.Trainer``; ``model=custom`` / ``data=custom`` keys are the target's.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"{', '.join(missing)} must be given (the config leaves it `???`), e.g. "
            f"`{missing[0]}=<value>` on the command line."
        )
    for key in set(cfg) - set(Config.__dataclass_fields__):
        raise ValueError(f"`{key}` is not a setting of the run; its settings: {', '.join(Config.__dataclass_fields__)}"
                         f" and the groups' keys (`strategy.KEY`, ...). Fix the spelling or drop it.")
    for group in GROUPS:
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        if schema is None or schema is dict:
            continue
        if group == "trainer":
            known, owner = trainer_arguments(), "lightning.Trainer"
        elif schema is CUSTOM.get(group):
            known, owner = target_arguments(group, node._target_), node._target_
        else:
            known, owner = set(schema.__dataclass_fields__), schema.__name__
        for key in node:
            if known is not None and key not in known and key != "_target_":
                raise unknown_key(group, key, owner, known)
    if "strategy" in cfg.trainer:
        raise ValueError(f"`trainer.strategy={cfg.trainer.strategy}` is chosen by the strategy group: drop it and "
                         f"use `strategy=<{'|'.join(STRATEGY_SCHEMAS)}>` and `strategy.KEY=` overrides.")


@cache
def trainer_arguments() -> frozenset:
    """The keyword arguments of ``lightning.Trainer`` (what ``+trainer.KEY=`` may set)."""
    from lightning.pytorch import Trainer

    return frozenset(n for n in inspect.signature(Trainer.__init__).parameters if n != "self")


def target_arguments(group: str, target: str) -> Optional[frozenset]:
    """The constructor arguments of a ``model=custom`` / ``data=custom`` target (None: it takes ``**kwargs``);
    a target that is not importable, or not a LightningModule / LightningDataModule, is refused by name."""
    import lightning.pytorch as pl
    base = {"model": pl.LightningModule, "data": pl.LightningDataModule}[group]
    cls = import_target(group, target, base.__name__)
    if not issubclass(cls, base):
        raise ValueError(f"`{group}._target_={target}` is a {cls.__mro__[1].__name__} subclass, not a "
                         f"{base.__name__}: {group}=custom takes a {base.__name__}.")
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL)


def import_target(group: str, target: str, kind: str) -> Any:
    """The object at dotted path ``target`` (the current directory importable, as under ``python -m``)."""
    parts, reason = target.split("."), "not a dotted path"
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as err:
            reason = str(err)
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
            return obj
        except AttributeError as err:
            reason = str(err)
            break
    raise ValueError(f"`{group}._target_={target}` cannot be imported ({reason}): give the dotted path of a "
                     f"{kind} importable from the current directory or PYTHONPATH.")


def composition_message(err: BaseException) -> str:
    """One line for a Hydra composition error (a misspelled key, a mistyped value, a missing option).

    A key no schema declares is named with the valid keys, as :func:`check_keys` names a forced one.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = err.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key and "." in str(cause.full_key):
        group, key = str(cause.full_key).split(".", 1)
        node = cause.object_type
        if group in GROUPS and node is not None and hasattr(node, "__dataclass_fields__"):
            takes = trainer_arguments() if group == "trainer" else set(node.__dataclass_fields__)
            if key in takes - set(node.__dataclass_fields__) or node in CUSTOM.values():
                return (f"`{group}.{key}` is not in the defaults of {group}: add it with `+{group}.{key}=...` "
                        f"(a `+` adds a key).")
            return str(unknown_key(group, key, node.__name__, takes))
    text, options = [], []
    for line in str(err).splitlines() + str(cause or "").splitlines()[:1]:
        if line.startswith("\t"):  # Hydra's list of the options of a group (and of its search path after it)
            options += [] if line.endswith("_schema") else [line.strip()]
        elif options:
            break
        elif line.strip():
            text.append(line.strip() if line.strip().endswith((".", ":")) else line.strip() + ".")
    return " ".join(text) + (f" {', '.join(options)}." if options else "")


@cache
def _launch_time() -> str:
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def run_dir(root: str = "outputs") -> str:
    """Hydra's run dir, the same in every process of one launch (the ``${lightning_par.run_dir:}`` resolver).

    [Note: one run dir per launch]
    Lightning's own launcher passes the first process's ``hydra.run.dir`` to the others, but torchrun
    and SLURM start every process themselves, and timestamps taken by each could differ by a second.
    So under torchrun the dir is named by the rendezvous id (``--rdzv-id``; ``torchrun --standalone``
    draws one), under an ``srun`` of several tasks by the job and step id (each ``srun`` is a new
    step), and only otherwise by the launch time.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"{root}/torchrun-{run_id}"
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # tasks of one srun
        return f"{root}/slurm-{os.environ.get('SLURM_JOB_ID', 'job')}-{os.environ['SLURM_STEP_ID']}"
    return f"{root}/{_launch_time()}"


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore as ``<group>/<option>_schema`` and the root as
    ``config_schema``, and register the ``lightning_par.run_dir`` resolver.

    Idempotent; call it before composing (``lightning_par.train`` does).
    """
    if not OmegaConf.has_resolver("lightning_par.run_dir"):
        OmegaConf.register_new_resolver("lightning_par.run_dir", run_dir)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schemas in GROUPS.items():
        for option, schema in schemas.items():
            cs.store(group=group, name=f"{option}_schema", node=schema)
