"""Structured-config schemas of the ``lightning-par-train`` Hydra app.

Every YAML file under ``conf/<group>/`` starts from one of these dataclasses (``defaults: [<name>_schema]``),
so OmegaConf checks the keys and types when the config is composed: ``strategy.comm_hok=fp16`` or
``trainer.max_steps=ten`` fails right there, naming the key, before anything is launched.

Adding a strategy (the same for a model or a data set) takes two steps:

1. write its schema dataclass below: ``_target_`` = the class (or a factory), then one typed field per
   constructor argument, each with the constructor's default;
2. add one line ``"<option>": <Schema>,`` to :data:`STRATEGY_SCHEMAS`, and a file
   ``conf/strategy/<option>.yaml`` whose defaults list names ``<option>_schema``.

``tests/unit/test_configs.py`` then composes and instantiates the new option automatically.

[Note: fields that YAML cannot express]
OmegaConf 2.3 has no ``Union`` or ``Literal`` types: arguments such as ``devices`` (int, list or "auto")
are typed ``Any`` here and checked by :func:`lightning_par.train.build_trainer_kwargs`, and enumerations
(``precision``, ``comm_hook``) are plain strings the constructors themselves validate with a
``ValueError`` naming the choices. Durations are seconds (``timeout: float``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# --------------------------------------------------------------------------------------------- strategy


@dataclass
class SingleStrategyConfig:
    """One device, Lightning's own default strategy (``strategy="auto"``, ``trainer.devices=1``)."""

    _target_: str = "lightning_par.config.single_device_strategy"


@dataclass
class DataParallelStrategyConfig:
    """:class:`lightning_par.DataParallelStrategy` (torch DDP; gloo on CPU, NCCL on CUDA)."""

    _target_: str = "lightning_par.strategies.data_parallel.DataParallelStrategy"
    comm_hook: Optional[str] = None  # null | fp16 | bf16 | powersgd
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000
    zero_stage: int = 0  # 0 | 1 | 2 | 3 (optimizer state, + gradients, + parameters sharded)
    lr_scaling: str = "none"  # none | linear | sqrt
    reference_batch_size: Optional[int] = None
    weights: Optional[str] = None  # null | a safetensors file / HF directory / state dict / .ckpt / DCP directory
    weights_prefix: str = ""  # what the module's names have before the file's (e.g. "net.")
    start_method: str = "popen"  # popen | spawn | fork | forkserver
    timeout: float = 1800.0  # seconds, for every collective
    nonfinite: str = "error"  # error (stop, naming the value) | skip (skip that optimizer step on every rank)
    find_unused_parameters: bool = False
    bucket_cap_mb: Optional[float] = None  # null: DDP's default (25 MiB)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    process_group_backend: Optional[str] = None  # null: gloo on CPU, nccl on CUDA
    fault_tolerance: Optional[str] = None  # null | torchft (one torchrun per replica group, see README)
    min_replicas: int = 1  # torchft: the fewest live replica groups a step commits with
    ft_timeout: float = 60.0  # torchft: seconds to wait for a quorum, a peer's all-reduce or its state
    save_distributed_checkpoint: bool = False  # true: sharded torch.distributed.checkpoint directories
    async_save: bool = False  # true: checkpoints written in the background


@dataclass
class PipelineStrategyConfig:
    """:class:`lightning_par.PipelineParallelStrategy` (block stack split into stages; GPipe, 1F1B, interleaved, zero bubble)."""

    _target_: str = "lightning_par.strategies.pipeline_parallel.PipelineParallelStrategy"
    pipeline_parallel_size: Any = "auto"  # int | auto (every device not taken by data_parallel_size)
    data_parallel_size: Any = "auto"  # int | auto (world / pipeline_parallel_size)
    microbatches: Optional[int] = None  # null: 2 × pipeline_parallel_size, bounded by the batch
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    stages_per_rank: int = 1
    blocks: Optional[str] = None  # null: the longest ModuleList/Sequential of same-class blocks
    balance: Any = "params"  # uniform | params | time | [blocks per stage]
    strict_batch_semantics: bool = False  # true: refuse a loss that micro-batching changes (else warn)
    zero_stage: int = 0  # 0 | 1 | 2 | 3 on the replicas (the dp axis), as DataParallelStrategy's
    weights: Optional[str] = None  # null | a safetensors file / HF directory / state dict / .ckpt / DCP directory
    weights_prefix: str = ""  # what the module's names have before the file's (e.g. "net.")
    save_distributed_checkpoint: bool = False  # true: sharded torch.distributed.checkpoint directories
    async_save: bool = False  # true: checkpoints written in the background
    start_method: str = "popen"  # popen | spawn | fork | forkserver
    timeout: float = 1800.0  # seconds, for every collective and point-to-point transfer
    nonfinite: str = "error"  # error | skip: a NaN / inf loss or gradient stops training or skips the step
    fault_tolerance: Optional[str] = None  # null | torchft: each torchrun job one replica group (see README)
    min_replicas: int = 1  # torchft: the fewest live replica groups a step commits with
    ft_timeout: float = 60.0  # torchft: seconds to wait for a quorum, a peer's all-reduce or its state
    process_group_backend: Optional[str] = None  # null: gloo on CPU, nccl on CUDA


@dataclass
class TensorStrategyConfig:
    """:class:`lightning_par.TensorParallelStrategy` (DTensor, Megatron plan found by inspecting the module)."""

    _target_: str = "lightning_par.strategies.tensor_parallel.TensorParallelStrategy"
    tensor_parallel_size: Any = "auto"  # int | auto (every device not taken by data_parallel_size)
    data_parallel_size: Any = "auto"  # int | auto (world / tensor_parallel_size)
    plan: Any = "auto"  # auto | {module_glob: colwise | rowwise | sequence | replicate}
    sequence_parallel: bool = False
    loss_parallel: bool = False
    zero_stage: int = 0  # 0 | 1 | 2 | 3 on the replicas (the dp axis), as DataParallelStrategy's
    weights: Optional[str] = None  # null | a safetensors file / HF directory / state dict / .ckpt / DCP directory
    weights_prefix: str = ""  # what the module's names have before the file's (e.g. "net.")
    save_distributed_checkpoint: bool = False  # true: sharded torch.distributed.checkpoint directories
    async_save: bool = False  # true: checkpoints written in the background
    start_method: str = "popen"  # popen | spawn | fork | forkserver
    timeout: float = 1800.0  # seconds, for every collective
    nonfinite: str = "error"  # error | skip: a NaN / inf loss or gradient stops training or skips the step
    fault_tolerance: Optional[str] = None  # null | torchft: each torchrun job one replica group (see README)
    min_replicas: int = 1  # torchft: the fewest live replica groups a step commits with
    ft_timeout: float = 60.0  # torchft: seconds to wait for a quorum, a peer's all-reduce or its state
    process_group_backend: Optional[str] = None  # null: gloo on CPU, nccl on CUDA


@dataclass
class HybridStrategyConfig:
    """:class:`lightning_par.HybridParallelStrategy` (data × pipeline × tensor parallel on one mesh)."""

    _target_: str = "lightning_par.strategies.hybrid_parallel.HybridParallelStrategy"
    data_parallel_size: Any = "auto"  # int | auto (world / (pipeline_parallel_size × tensor_parallel_size))
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    zero_stage: int = 0
    mesh_order: str = "pp_dp_tp"  # pp_dp_tp (pipelines span nodes) | dp_pp_tp (replicas span nodes)
    microbatches: Optional[int] = None  # null: 2 × pipeline_parallel_size; ignored with one stage
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    stages_per_rank: int = 1
    blocks: Optional[str] = None
    balance: Any = "params"  # uniform | params | time | [blocks per stage]
    strict_batch_semantics: bool = False  # true: refuse a loss that micro-batching changes (else warn)
    plan: Any = "auto"  # auto | {module_glob: colwise | rowwise | sequence | replicate}
    sequence_parallel: bool = False  # several stages too: each tp rank sends its sequence chunk
    loss_parallel: bool = False  # several stages too: the last stage shards the vocabulary
    weights: Optional[str] = None  # null | a safetensors file / HF directory / state dict / .ckpt / DCP directory
    weights_prefix: str = ""  # what the module's names have before the file's (e.g. "net.")
    nonfinite: str = "error"  # error | skip
    save_distributed_checkpoint: bool = False  # true: sharded torch.distributed.checkpoint directories
    async_save: bool = False  # true: checkpoints written in the background
    start_method: str = "popen"  # popen | spawn | fork | forkserver
    timeout: float = 1800.0  # seconds, for every collective and point-to-point transfer
    fault_tolerance: Optional[str] = None  # null | torchft: each torchrun job one replica group (see README)
    min_replicas: int = 1  # torchft: the fewest live replica groups a step commits with
    ft_timeout: float = 60.0  # torchft: seconds to wait for a quorum, a peer's all-reduce or its state
    process_group_backend: Optional[str] = None  # null: gloo on CPU, nccl on CUDA


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


MODEL_SCHEMAS: dict[str, type] = {"gpt": GPTConfig, "mlp": MLPConfig}

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
}

# ---------------------------------------------------------------------------------------------- trainer

@dataclass
class TrainerConfig:
    """The ``lightning.Trainer`` arguments the app exposes (loggers, callbacks and plugins are built in code)."""

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


def check_keys(cfg: Any) -> None:
    """Refuse keys a schema does not declare (added with Hydra's ``+key=value``), naming the key.

    A plain misspelled override (``strategy.comm_hok=fp16``) already fails at composition; ``+`` forces
    the key in, and it would otherwise surface later as a constructor's ``TypeError``.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"{', '.join(missing)} must be given (the config leaves it `???`), e.g. "
            f"`{missing[0]}=<value>` on the command line."
        )
    for group in GROUPS:
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        if schema is None or schema is dict:
            continue
        known = set(schema.__dataclass_fields__)
        for key in node:
            if key not in known:
                valid = ", ".join(sorted(k for k in known if not k.startswith("_"))) or "none"
                raise ValueError(
                    f"`{group}.{key}` is not a setting of {group} ({schema.__name__}); valid keys: {valid}. "
                    f"Fix the spelling or drop it."
                )


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
