"""Every config in conf/ composes and instantiates; bad keys and types fail at composition, naming the key."""
from __future__ import annotations

import dataclasses
import inspect
import typing
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import get_object
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from app_config import compose_app
from lightning_par import config as schemas
from lightning_par import train
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT
from lightning_par.paths import conf_dir

CONF = conf_dir()
GROUP_OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))
# the data a model option is meant to be composed with
DATA_FOR_MODEL = {"gpt": "synthetic", "mlp": "classification", "hf": "synthetic", "custom": "synthetic"}
MODEL_FOR_DATA = {"synthetic": "gpt", "text": "gpt", "classification": "mlp", "custom": "gpt"}
TINY_LLAMA = ("{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2, "
              "num_attention_heads: 2, num_key_value_heads: 1}")
# what an option needs besides its name (the `_target_` of a custom one and its arguments)
OPTION_ARGS = {
    ("model", "custom"): ["model._target_=lightning_par.models.GPT", "+model.vocab_size=64", "+model.block_size=64",
                          "+model.n_layer=1"],
    ("model", "hf"): [f"model.config={TINY_LLAMA}"],
    ("data", "custom"): ["data._target_=lightning_par.data.SyntheticCorpus", "+data.train_sequences=64"],
}


def _error_text(exc: BaseException) -> str:
    """The message and its causes, as Hydra prints them to the user."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


@pytest.fixture()
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(32, 127)) * 400)
    return path


def _overrides_for(group: str, option: str, text_file: Path) -> list[str]:
    ov = [f"{group}={option}", *OPTION_ARGS.get((group, option), [])]
    if group == "model":
        ov.append(f"data={DATA_FOR_MODEL[option]}")
    if group == "data":
        ov.append(f"model={MODEL_FOR_DATA[option]}")
        if option == "text":
            ov.append(f"data.path={text_file}")
    if group == "strategy":
        ov.append("data.train_sequences=64")
    return ov


def test_conf_groups_are_the_expected_ones():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert groups == {"strategy", "model", "data", "trainer"}
    assert {("strategy", "single"), ("strategy", "ddp"), ("model", "gpt"), ("model", "mlp"),
            ("data", "synthetic"), ("data", "text"), ("data", "classification"),
            ("trainer", "default")} <= set(GROUP_OPTIONS)


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_composes_typed_and_instantiates(group, option, text_file):
    cfg = compose_app(*_overrides_for(group, option, text_file))
    node = cfg[group]
    schema = OmegaConf.get_type(node)
    assert dataclasses.is_dataclass(schema), f"conf/{group}/{option}.yaml must start from a schema"
    assert schema is schemas.GROUPS[group][option]
    schemas.check_keys(cfg)
    # every YAML key is a schema field (a YAML key outside the schema would fail composition anyway)
    assert set(OmegaConf.load(CONF / group / f"{option}.yaml")) - {"defaults", "trainer"} <= set(
        f.name for f in dataclasses.fields(schema))

    kw = train.build_trainer_kwargs(cfg, "unused-run-dir")
    datamodule = train.build_datamodule(cfg.data)
    model = train.build_model(cfg.model, datamodule)
    assert isinstance(datamodule, pl.LightningDataModule) and isinstance(model, pl.LightningModule)
    if "start_method" in cfg.strategy:
        cfg.strategy.start_method = "fork"  # instantiate only: no process is launched
    strategy = train.build_strategy(cfg.strategy)
    if isinstance(strategy, str):
        assert strategy == "auto" and option == "single"
    else:
        assert isinstance(strategy, pl.strategies.Strategy)
    # the whole Trainer accepts what the app builds (nothing runs: no fit)
    pl.Trainer(strategy=strategy, **{**kw, "accelerator": "cpu", "logger": False, "callbacks": []})


def test_default_run_is_gpt_on_the_markov_corpus_with_ddp_on_two_devices():
    cfg = compose_app()
    assert OmegaConf.get_type(cfg.strategy) is schemas.DataParallelStrategyConfig
    assert OmegaConf.get_type(cfg.model) is schemas.GPTConfig
    assert OmegaConf.get_type(cfg.data) is schemas.SyntheticCorpusConfig
    assert cfg.trainer.devices == 2 and cfg.trainer.enable_progress_bar and cfg.trainer.precision == "32-true"
    assert cfg.strategy.start_method == "popen"
    model = train.build_model(cfg.model, train.build_datamodule(cfg.data))
    assert model.hparams.vocab_size == cfg.data.vocab_size and model.hparams.block_size == cfg.data.seq_len


def test_strategy_single_is_one_device_unless_overridden():
    assert compose_app("strategy=single").trainer.devices == 1
    assert compose_app("strategy=single", "trainer.devices=3").trainer.devices == 3
    assert train.build_strategy(compose_app("strategy=single").strategy) == "auto"


STRATEGY_CLASSES = [(name, s) for name, s in schemas.STRATEGY_SCHEMAS.items() if inspect.isclass(get_object(s._target_))]


@pytest.mark.parametrize("option, schema", STRATEGY_CLASSES, ids=[n for n, _ in STRATEGY_CLASSES])
def test_strategy_schema_is_the_strategy_signature(option, schema):
    """Every keyword argument of the strategy is settable from the command line, with its default and type."""
    cls = get_object(schema._target_)
    hints = typing.get_type_hints(cls.__init__)
    params = {n: (p.default, schemas.yaml_type(hints[n])) for n, p in inspect.signature(cls.__init__).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in schemas.PLUMBING}
    fields = {f.name: (f.default, f.type) for f in dataclasses.fields(schema) if f.name != "_target_"}
    assert fields == params
    assert list(fields) == list(params)  # in the constructor's order
    assert {"timeout", "start_method", "weights"} <= set(fields)


def test_a_keyword_added_to_a_constructor_is_in_the_schema_with_no_second_edit():
    from lightning_par import PipelineParallelStrategy

    class Extended(PipelineParallelStrategy):
        def __init__(self, *, strict_batch_semantics: bool = False, share: float | None = None, **kw):
            super().__init__(**kw)

    schema = schemas.strategy_schema("ExtendedConfig", Extended)
    fields = {f.name: (f.type, f.default) for f in dataclasses.fields(schema)}
    assert fields["strict_batch_semantics"] == (bool, False) and fields["share"] == (typing.Optional[float], None)
    node = OmegaConf.structured(schema)
    with pytest.raises(Exception, match="could not be converted to Bool|is not a valid bool"):
        node.strict_batch_semantics = "maybe"


@pytest.mark.parametrize("annotation, expected", [
    (int, int), (typing.Optional[int], typing.Optional[int]), ("float | None", typing.Optional[float]),
    (typing.Union[float, timedelta], float), (typing.Union[float, int, timedelta], float),
    (typing.Literal["a", "b"], str), (typing.Optional[typing.Literal["torchft"]], typing.Optional[str]),
    (typing.Union[int, typing.Literal["auto"]], typing.Any), (typing.Union[str, typing.Sequence[int]], typing.Any),
    (typing.Mapping[str, str], typing.Any),
])
def test_yaml_types_of_annotations(annotation, expected):
    if isinstance(annotation, str):
        annotation = eval(annotation)  # noqa: S307 - a PEP 604 union written as text for older parsers
    assert schemas.yaml_type(annotation) == expected


@pytest.mark.parametrize("schema", [s for g in schemas.GROUPS.values() for s in g.values()
                                    if getattr(s, "_target_", "???") != "???"])
def test_schema_fields_are_constructor_arguments(schema):
    sig = inspect.signature(get_object(schema._target_))
    accepted = set(sig.parameters)
    fields = {f.name for f in dataclasses.fields(schema)} - {"_target_"}
    assert fields <= accepted, f"{schema.__name__} has keys {fields - accepted} that {schema._target_} does not take"
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override, key, why", [
    ("strategy.comm_hok=fp16", "comm_hok", "not in 'DataParallelStrategyConfig'"),
    ("model.n_layr=2", "n_layr", "not in 'GPTConfig'"),
    ("trainer.max_step=5", "max_step", "not in 'TrainerConfig'"),
    ("trainer.max_steps=ten", "trainer.max_steps", "could not be converted to Integer"),
    ("strategy.zero_stage=one", "strategy.zero_stage", "could not be converted to Integer"),
    ("model.dropout=lots", "model.dropout", "could not be converted to Float"),
    ("trainer.enable_progress_bar=maybe", "trainer.enable_progress_bar", "is not a valid bool"),
])
def test_misspelled_or_mistyped_key_fails_at_composition_naming_it(override, key, why):
    with pytest.raises(ConfigCompositionException) as info:
        compose_app(override)
    text = _error_text(info.value)
    assert key in text and why in text


def test_forced_unknown_key_is_refused_before_anything_runs():
    cfg = compose_app("+strategy.comm_hok=fp16")  # `+` forces a key into the schema's node
    with pytest.raises(ValueError, match=r"`strategy.comm_hok` is not a setting of strategy .*valid keys: .*comm_hook, "):
        schemas.check_keys(cfg)


def test_missing_required_value_is_named():
    cfg = compose_app("data=text")
    with pytest.raises(ValueError, match=r"data.path must be given .*`data.path=<value>`"):
        schemas.check_keys(cfg)


def test_model_size_that_the_data_cannot_supply_is_named():
    cfg = compose_app("model=gpt", "data=classification")
    with pytest.raises(ValueError, match=r"model.vocab_size is null, .*SyntheticClassification has no `vocab_size`.*model.vocab_size=<int>"):
        train.build_model(cfg.model, train.build_datamodule(cfg.data))


@pytest.mark.parametrize("devices", [0, "two", 1.5])
def test_bad_devices_are_refused(devices):
    cfg = compose_app()
    cfg.trainer.devices = devices
    with pytest.raises(ValueError, match=r"trainer.devices=.* must be a positive int"):
        train.build_trainer_kwargs(cfg, "run")


def test_multirun_under_the_popen_launcher_is_refused():
    with pytest.raises(ValueError, match=r"multirun .*strategy.start_method=popen.*strategy.start_method=spawn"):
        train.check_multirun(compose_app(), multirun=True)
    train.check_multirun(compose_app(), multirun=False)
    train.check_multirun(compose_app("strategy.start_method=spawn"), multirun=True)
    train.check_multirun(compose_app("strategy=single"), multirun=True)


def test_training_forever_is_refused():
    cfg = compose_app("trainer.max_steps=-1")
    with pytest.raises(ValueError, match="train forever"):
        train.build_trainer_kwargs(cfg, "run")


# ------------------------------------------------------------------------------------- app callbacks


class _CountValidations(pl.Callback):
    def __init__(self):
        self.at_steps: list[int] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.at_steps.append(trainer.global_step)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_validate_at_last_step_validates_the_final_weights_once(accumulate):
    torch.manual_seed(0)
    data = SyntheticCorpus(vocab_size=16, seq_len=8, batch_size=4, train_sequences=64, val_sequences=8)
    model = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    counter = _CountValidations()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[train.ValidateAtLastStep(), counter])
    trainer.fit(model, datamodule=data)  # 16 batches per epoch: 3 optimizer steps end mid-epoch
    assert trainer.global_step == 3 and counter.at_steps == [3]
    assert "val_loss" in trainer.callback_metrics


def test_fault_tolerance_from_the_command_line():
    strategy = train.build_strategy(compose_app("strategy.fault_tolerance=torchft", "strategy.min_replicas=2").strategy)
    assert strategy.fault_tolerance == "torchft" and strategy._ft.min_replicas == 2
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="`fault_tolerance='torchft'` does not support `zero_stage=1`"):
        train.build_strategy(compose_app("strategy.fault_tolerance=torchft", "strategy.zero_stage=1").strategy)
    for group in ("hybrid", "pipeline", "tensor"):  # the replica axis of the core (one whole model per torchrun job)
        strategy = train.build_strategy(compose_app(f"strategy={group}", "strategy.fault_tolerance=torchft",
                                                 "strategy.ft_timeout=5").strategy)
        assert strategy.fault_tolerance == "torchft" and strategy._ft.ft_timeout == 5


# ------------------------------------------------------------------------------ Trainer pass-through


def test_any_trainer_argument_passes_through(tmp_path):
    cfg = compose_app("+trainer.profiler=simple", "+trainer.max_time=00:00:01:00", "+trainer.fast_dev_run=true",
                   "+trainer.detect_anomaly=true", "trainer.accelerator=cpu")
    schemas.check_keys(cfg)
    kw = train.build_trainer_kwargs(cfg, tmp_path)
    assert kw["profiler"] == "simple" and kw["max_time"] == "00:00:01:00" and kw["fast_dev_run"] is True
    trainer = pl.Trainer(**{**kw, "devices": 1})
    assert trainer.fast_dev_run is True and trainer.profiler.__class__.__name__ == "SimpleProfiler"
    assert any(type(c).__name__ == "Timer" for c in trainer.callbacks)  # max_time became Lightning's Timer


def test_loggers_and_callbacks_by_target(tmp_path):
    cfg = compose_app("+trainer.logger._target_=lightning.pytorch.loggers.CSVLogger",
                   f"+trainer.logger.save_dir={tmp_path / 'mine'}",
                   "+trainer.callbacks=[{_target_: lightning.pytorch.callbacks.LearningRateMonitor}]",
                   "trainer.accelerator=cpu")
    schemas.check_keys(cfg)
    kw = train.build_trainer_kwargs(cfg, tmp_path)
    assert isinstance(kw["logger"], CSVLogger) and kw["logger"].save_dir == str(tmp_path / "mine")
    names = [type(c).__name__ for c in kw["callbacks"]]
    assert names[0] == "LearningRateMonitor" and "ModelCheckpoint" in names  # the user's beside the app's
    pl.Trainer(**{**kw, "devices": 1})


def test_trainer_logger_false_turns_logging_off(tmp_path):
    kw = train.build_trainer_kwargs(compose_app("+trainer.logger=false"), tmp_path)
    assert kw["logger"] is False


def test_unknown_trainer_argument_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`trainer.profilr` is not a setting of trainer \(lightning.Trainer\); "
                                         r"did you mean `profiler`\?"):
        schemas.check_keys(compose_app("+trainer.profilr=simple"))


def test_custom_model_and_data_by_target():
    cfg = compose_app("model=custom", "model._target_=lightning_par.models.MLPClassifier", "+model.in_features=8",
                   "+model.num_classes=3", "data=custom", "data._target_=lightning_par.data.SyntheticClassification",
                   "+data.in_features=8", "+data.num_classes=3", "+data.train_samples=64")
    schemas.check_keys(cfg)
    datamodule = train.build_datamodule(cfg.data)
    model = train.build_model(cfg.model, datamodule)
    assert model.hparams.in_features == 8 and datamodule.num_classes == 3


def test_hf_model_from_a_config_dict():
    cfg = compose_app("model=hf", f"model.config={TINY_LLAMA}")
    model = train.build_model(cfg.model, train.build_datamodule(cfg.data))
    assert model.model.config.model_type == "llama" and model.model.config.vocab_size == cfg.data.vocab_size
    batch = next(iter(train.build_datamodule(cfg.data).train_dataloader()))
    assert model.training_step(batch, 0).ndim == 0
    from hydra.errors import InstantiationException

    small = r"vocabulary \(8, from model.config\) is smaller than the data's \(64\)"
    with pytest.raises(InstantiationException, match=small):
        train.build_model(compose_app("model=hf", f"model.config={TINY_LLAMA[:-1]}, vocab_size: 8}}").model,
                          train.build_datamodule(cfg.data))


def _llama_file(tmp_path, vocab_size: int = 64) -> tuple[Path, dict]:
    """A tiny Llama's weights as a Hugging Face safetensors file (its own names), and the tensors."""
    from safetensors.torch import save_model

    from lightning_par.models import HFCausalLM

    torch.manual_seed(7)
    source = HFCausalLM(config=OmegaConf.to_container(OmegaConf.create(TINY_LLAMA)), vocab_size=vocab_size).model
    path = tmp_path / "model.safetensors"
    save_model(source, str(path))
    return path, {k: v.clone() for k, v in source.state_dict().items()}


def test_hf_weights_read_by_the_module_where_the_strategy_takes_none(tmp_path):
    path, tensors = _llama_file(tmp_path)
    cfg = compose_app("strategy=single", "model=hf", f"model.config={TINY_LLAMA}", f"model.weights={path}")
    assert not train.streamed_weights(cfg)
    model = train.build_model(cfg.model, train.build_datamodule(cfg.data))
    for name, value in model.model.state_dict().items():
        torch.testing.assert_close(value, tensors[name], rtol=0, atol=0)


def test_hf_weights_go_to_the_strategys_weights_where_it_takes_them(tmp_path):
    path, _ = _llama_file(tmp_path)
    cfg = compose_app("strategy=pipeline", "model=hf", f"model.config={TINY_LLAMA}", f"model.weights={path}")
    assert train.streamed_weights(cfg)
    assert cfg.strategy.weights == str(path) and cfg.strategy.weights_prefix == "model." and cfg.model.weights is None
