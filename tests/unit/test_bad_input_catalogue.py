"""The bad-input catalogue: what a user can get wrong, each refused before any process group or collective
exists, with a message that names the value, what it must be and the fix (the test asserts the message).

Cases that need a running layout (a plan glob that matches nothing at setup, tp not dividing the heads,
more stages than blocks, automatic optimization off, a checkpoint of another model) are here as the pure
checks the strategies call before any collective; the distributed tests run them end to end too
(test_hybrid_bad_input.py, test_tensor_bad_input.py, test_pipeline_errors.py, test_checkpoint_layouts.py).
"""
from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_par import DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.dp import fsdp
from lightning_par.models import GPT
from lightning_par.pipeline.microbatch import check_microbatches
from lightning_par.pipeline.options import check_layout
from lightning_par.pipeline.partition import partition_blocks
from lightning_par.tensor.boundary import check_sequence_stack
from lightning_par.tensor.plan import build_plan
from lightning_par.topology import Topology


def gpt(**kw):
    return GPT(**{**dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16), **kw})


CASES = {
    # sizes and layout
    "pp size 0": (lambda: HybridParallelStrategy(pipeline_parallel_size=0),
                  r"`pipeline_parallel_size=0` must be a positive integer or 'auto'"),
    "tp size negative": (lambda: TensorParallelStrategy(tensor_parallel_size=-1),
                         r"`tensor_parallel_size=-1` must be a positive integer or 'auto'"),
    "dp size a word": (lambda: PipelineParallelStrategy(data_parallel_size="many"),
                       r"`data_parallel_size='many'` must be a positive integer or 'auto'"),
    "sizes not the world": (lambda: Topology.resolve(4, data_parallel_size=1, pipeline_parallel_size=2,
                                                     tensor_parallel_size=3),
                            r"multiplied \(6\) should equal the world size \(4\)\. Change the sizes or the number "
                            r"of devices"),
    "mesh order": (lambda: HybridParallelStrategy(mesh_order="tp_dp_pp"),
                   r"`mesh_order='tp_dp_pp'` must be one of \['dp_pp_tp', 'pp_dp_tp'\]"),
    # schedules and micro-batches
    "unknown schedule": (lambda: PipelineParallelStrategy(schedule="bogus"),
                         r"`schedule='bogus'` is not a pipeline schedule; choose one of"),
    "interleaved, one chunk": (lambda: PipelineParallelStrategy(schedule="interleaved_1f1b"),
                               r"needs `stages_per_rank` >= 2 \(got 1\).*Use stages_per_rank=2 or schedule='1f1b'"),
    "chunks without interleaving": (lambda: HybridParallelStrategy(pipeline_parallel_size=2, stages_per_rank=2),
                                    r"`stages_per_rank=2` needs `schedule='interleaved_1f1b'`"),
    "zero micro-batches": (lambda: PipelineParallelStrategy(microbatches=0),
                           r"`microbatches=0` must be a positive integer or None"),
    "boolean micro-batches": (lambda: PipelineParallelStrategy(microbatches=True),
                              r"`microbatches=True` must be a positive integer or None"),
    "interleaved micro-batches": (lambda: check_layout(schedule="interleaved_1f1b", microbatches=3,
                                                       pipeline_parallel_size=2),
                                  r"`microbatches=3` must be a multiple of it"),
    "micro-batches vs batch": (lambda: check_microbatches(5, 12),
                               r"`microbatches=5` must divide the per-device batch size \(12\)\. Choose a divisor"),
    # balance and blocks
    "unknown balance": (lambda: PipelineParallelStrategy(balance="random"),
                        r"`balance='random'` must be one of \('uniform', 'params', 'time'\) or a list"),
    "balance with a zero": (lambda: PipelineParallelStrategy(balance=[2, 0]),
                            r"`balance=\[2, 0\]` must list positive block counts, one per stage"),
    "balance not summing": (lambda: partition_blocks(4, 2, balance=[1, 2]),
                            r"`balance=\[1, 2\]` must list 2 positive block counts .* summing to the 4 blocks"),
    "more stages than blocks": (lambda: partition_blocks(2, 4),
                                r"4 pipeline stages need at least 4 blocks, but the block stack has 2\. Use fewer "
                                r"stages"),
    "empty blocks name": (lambda: PipelineParallelStrategy(blocks=""),
                          r"`blocks=''` must be the dotted name of the block container, e\.g\. 'model\.layers'"),
    "blocks not a name": (lambda: HybridParallelStrategy(blocks=3), r"`blocks=3` must be the dotted name"),
    # tensor plans
    "unknown plan style": (lambda: TensorParallelStrategy(plan={"blocks.*.mlp.fc": "diagonal"}), r"diagonal"),
    "plan glob matching nothing": (lambda: build_plan(gpt(), 2, {"nothing.*": "colwise"}),
                                   r"nothing\.\*"),
    "tp not dividing heads": (lambda: build_plan(gpt(n_head=3, n_embd=24), 2),
                              r"not divisible by tensor_parallel_size=2.*Choose a tensor_parallel_size that divides"),
    "sequence_parallel not a flag": (lambda: TensorParallelStrategy(sequence_parallel="yes"),
                                     r"`sequence_parallel='yes'` must be True or False"),
    "loss_parallel not a flag": (lambda: HybridParallelStrategy(loss_parallel=1),
                                 r"`loss_parallel=1` must be True or False"),
    # precisions and zero stages
    "zero 3 with 16-mixed": (lambda: fsdp.check_precision("16-mixed", 3), r"16-mixed"),
    "unknown zero stage": (lambda: DataParallelStrategy(zero_stage=5),
                           r"`zero_stage=5` is not a ZeRO stage\. Choose 0 \(replicas"),
    "zero 2 on a pipeline with 16-mixed": (
        lambda: pl.Trainer(accelerator="cpu", devices=4, logger=False,  # fp16 AMP itself: Lightning makes CPU's bf16
                           plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
                           strategy=PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=2)),
        r"`precision='16-mixed'` with `zero_stage=2` is not supported: its GradScaler.*bf16-mixed"),
    "zero 2 with a comm hook": (lambda: DataParallelStrategy(zero_stage=2, comm_hook="fp16"), r"comm_hook"),
    # DDP hooks and scaling
    "unknown comm hook": (lambda: DataParallelStrategy(comm_hook="int8"),
                          r"`comm_hook='int8'` is not a known DDP communication hook"),
    "PowerSGD rank 0": (lambda: DataParallelStrategy(comm_hook="powersgd", powersgd_rank=0),
                        r"`powersgd_rank=0` must be an integer >= 1"),
    "unknown lr scaling": (lambda: DataParallelStrategy(lr_scaling="cubic"),
                           r"`lr_scaling='cubic'` is not a known rule"),
    # timeouts and launchers
    "zero timeout": (lambda: PipelineParallelStrategy(timeout=0),
                     r"`timeout=0` must be a finite positive number of seconds.*default is 1800\.0"),
    "infinite timeout": (lambda: DataParallelStrategy(timeout=math.inf),
                         r"`timeout=inf` must be a finite positive number of seconds"),
    "negative timeout": (lambda: TensorParallelStrategy(timeout=-5), r"`timeout=-5` must be a finite positive number"),
    "unknown start method": (lambda: HybridParallelStrategy(start_method="thread"),
                             r"`start_method='thread'` must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
    # non-finite values
    "unknown nonfinite": (lambda: TensorParallelStrategy(nonfinite="ignore"),
                          r"`nonfinite='ignore'` must be 'error'"),
    # weights
    "weights not a path": (lambda: PipelineParallelStrategy(weights=42), r"`weights=42` must be a path"),
    "weights prefix not a string": (lambda: HybridParallelStrategy(weights_prefix=1),
                                    r"`weights_prefix=1` must be a string"),
    # fault tolerance
    "unknown fault tolerance": (lambda: DataParallelStrategy(fault_tolerance="elastic"),
                                r"`fault_tolerance='elastic'` must be None \(off\) or 'torchft'"),
    "no replicas": (lambda: DataParallelStrategy(fault_tolerance="torchft", min_replicas=0),
                    r"`min_replicas=0` must be an integer >= 1"),
    "fault tolerance with zero": (lambda: DataParallelStrategy(fault_tolerance="torchft", zero_stage=1),
                                  r"`fault_tolerance='torchft'` does not support `zero_stage=1`"),
    "fault tolerance on the core with zero": (
        lambda: HybridParallelStrategy(fault_tolerance="torchft", pipeline_parallel_size=2, zero_stage=1),
        r"`fault_tolerance='torchft'` does not support `zero_stage=1` on the hybrid core: ZeRO shards over the "
        r"data-parallel axis, which under torchft is the set of live replica groups"),
    "fault tolerance with replicas inside a job": (
        lambda: PipelineParallelStrategy(fault_tolerance="torchft", data_parallel_size=2),
        r"`fault_tolerance='torchft'` makes each torchrun job one replica group holding the whole pipeline x "
        r"tensor-parallel model, so `data_parallel_size` inside a job must be 1 \(got 2\)"),
    "fault tolerance with skipped steps on the core": (
        lambda: HybridParallelStrategy(fault_tolerance="torchft", nonfinite="skip"),
        r"`fault_tolerance='torchft'` does not support `nonfinite='skip'` on the hybrid core"),
    "fault tolerance timeout on the core": (lambda: TensorParallelStrategy(fault_tolerance="torchft", ft_timeout=0),
                                            r"`ft_timeout=0` must be a finite positive number of seconds"),
    # sequence parallelism over a pipelined stack whose blocks hold no attention / MLP pair (blocks="norms")
    "sequence parallel stages without pairs": (
        lambda: check_sequence_stack(build_plan(torch.nn.ModuleDict(
            {"lm": gpt(), "norms": torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(2))}), 2,
            sequence_parallel=True), "norms", 2, 2),
        r"sequence_parallel=True with several pipeline stages: the pipelined blocks 'norms.0', 'norms.1' hold no "
        r"attention / MLP pair.*Pass `blocks=`.*or use sequence_parallel=False"),
    "sequence parallel stages, odd sequence": (
        lambda: check_sequence_stack(build_plan(gpt(), 2, sequence_parallel=True), "blocks", 2, 2, (4, 15, 16)),
        r"sequence_parallel=True: `blocks.0` \(in the step traced at setup\) got a sequence of length 15, not "
        r"divisible by tensor_parallel_size=2. Use a sequence length divisible by 2, or sequence_parallel=False"),
    # checkpoint flags
    "distributed checkpoint not a flag": (lambda: TensorParallelStrategy(save_distributed_checkpoint="no"),
                                          r"`save_distributed_checkpoint='no'` must be True or False"),
    "async save not a flag": (lambda: DataParallelStrategy(async_save=1), r"`async_save=1` must be True or False"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_the_value_and_the_fix(case):
    make, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        make()


def test_the_catalogue_has_at_least_40_cases():
    from test_cli_errors import CONSOLE_MISTAKES  # the command line's cases, through the console scripts

    assert len(CASES) + len(FILE_CASES) + len(CONSOLE_MISTAKES) >= 40


# -- checkpoint and data paths ------------------------------------------------------------------------------
def _garbage(tmp_path):
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(b"not a checkpoint at all" * 10)
    return path


def _no_state_dict(tmp_path):
    path = tmp_path / "weights.ckpt"
    torch.save({"epoch": 0}, path)
    return path


FILE_CASES = {
    "garbage checkpoint": (_garbage, r"The checkpoint .*garbage\.ckpt cannot be read \(truncated or not a checkpoint"),
    "checkpoint without state_dict": (_no_state_dict, r"The file .*weights\.ckpt is not a Lightning checkpoint: it "
                                                      r"has no `state_dict` entry"),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_a_bad_checkpoint_file_is_refused_naming_the_path(tmp_path, case):
    make, message = FILE_CASES[case]
    with pytest.raises(ValueError, match=message):
        PipelineParallelStrategy().load_checkpoint(make(tmp_path))


def test_a_weights_file_with_missing_extra_and_misshaped_keys_lists_them(tmp_path):
    from safetensors.torch import save_file

    from lightning_par.materialize import open_module_weights

    model = gpt()
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "ln_f.bias"}
    state["extra.weight"] = torch.zeros(2)
    state["ln_f.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)ln_f\.bias.*extra\.weight.*ln_f\.weight"):
        open_module_weights(str(tmp_path / "w.safetensors"), model)


# the command line's messages (a bad strategy option, an unknown config option or key): the console scripts'
# tests in tests/unit/test_cli_errors.py
