"""ZeRO stages 2 and 3 on the data axis: torch FSDP2 (``fully_shard``) over a 1-D mesh of data-parallel ranks.

    units = shard_module(module, mesh, zero_stage=3, precision="bf16-mixed")   # every rank of the mesh
    ...train...                                         # checkpoints: lightning_par.checkpoint (DTensor shards)

It knows no Lightning: the strategy passes the precision as a string and calls these from its hooks.

[Note: what stages 2 and 3 keep and shard]
Both stages hold, between steps, a 1/N dim-0 shard of every parameter (a ``DTensor`` with ``Shard(0)``),
of its gradient and of its optimizer state: the optimizer is built after sharding, on the shards, so
Adam's moments are born sharded. Gradients are reduce-scattered (averaged) in backward, one collective
per unit, as soon as a unit's gradients are complete; under gradient accumulation every micro-batch
reduce-scatters and the shards accumulate, so gradients stay sharded throughout (the alternative,
``set_requires_gradient_sync(False)`` until the last micro-batch, would hold whole gradients between
micro-batches: ZeRO-1's memory).
- stage 3 (``reshard_after_forward=True``): each unit's parameters are all-gathered before its forward,
  freed after it, gathered again before its backward and freed after it. The peak holds the whole
  parameters of about one unit (plus a prefetched one). The root unit keeps its parameters through the
  step (FSDP2's default for the root, whose parameters the backward needs first): they are gathered once.
- stage 2 (``reshard_after_forward=False``): each unit is gathered once, before its forward, and stays
  whole until its gradients have been reduce-scattered in backward. The peak holds all whole parameters
  during forward and backward (as DeepSpeed's ZeRO-2, which keeps them always); the wire carries one
  all-gather and one reduce-scatter of the parameters, the bytes of DDP's all-reduce. Unlike DeepSpeed's
  ZeRO-2, the whole parameters are freed after backward, so at rest (optimizer step, checkpoints) stage 2
  stores what stage 3 stores.
After forward-only passes (validation) the strategy calls :func:`reshard`, so the whole parameters a
stage-2 (or root) unit kept after its forward are freed and the next checkpoint sees shards.

[Note: FSDP units]
One unit per block of the model's repeated block stack (found as the pipeline finds it,
:func:`lightning_par.pipeline.discovery.find_blocks`), then the root module for everything else
(embeddings, final norm, output head, tied weights). A model without a block stack is one unit: its
memory at rest is still 1/N, but the peak holds all of it. FSDP2 keeps the module's parameter names.

[Note: running a step through the root unit]
FSDP's root unit (the module) gathers its own parameters (embeddings, head) in its forward pre-hook and
registers the hooks that reduce every gradient; a step such as ``training_step`` need not call the module
(a wrapper of a Hugging Face model calls ``self.model(...)``), so the step runs *inside* the module's
``__call__`` (Lightning's forward redirection, as DDP's wrapper does). A step that calls ``self(...)`` itself
then enters the root twice, nested, and FSDP2 frees the root's parameters after the outer call although it
keeps them after the inner one: one more all-gather of the root unit in backward. :class:`StepRunner`
counts the module's calls: once a step of some name has called the module itself, later steps of that
name run directly, with the root unit gathered beforehand (``unshard()``: the gather its pre-hook would
do), so every step gathers each unit exactly as FSDP's formula says.

[Note: mixed precision under FSDP]
Lightning's ``bf16-mixed`` on one device or DDP is autocast over fp32 weights: matmuls in bf16, the rest
(embedding lookups, residual adds, norms) in fp32, fp32 gradients. Under stages 2 / 3 we keep Lightning's
autocast and give every unit ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, FSDP's usual
policy (torchtitan's; Lightning's own FSDPStrategy takes bf16 for parameters *and* reductions):
- parameters are all-gathered and held whole in bf16: half the all-gather bytes and half the peak
  parameter memory, the reasons to shard at all; the optimizer steps the fp32 shards;
- gradients are reduce-scattered and kept in fp32, as DDP all-reduces fp32 gradients under autocast;
- a unit's floating inputs are cast to bf16 (FSDP's default): the module runs in one dtype. Gathering only
  some weights in bf16 does not work: CPU ``layer_norm`` refuses fp32 activations with a bf16 weight, and
  gathering norm weights in fp32 would leave the residual stream to whatever dtype each op promotes to.
What differs from one device's ``bf16-mixed``: activations between ops (the residual stream included) and
every weight are bf16-rounded in forward (~2^-8 relative), so losses and gradients agree to bf16 precision,
not fp32's (the test derives its tolerance from that). ``*-true`` precisions convert the module before
sharding (FSDP gathers and reduces in that dtype, as DDP would). ``16-mixed`` is refused: its ``GradScaler``
would look for infs in this rank's gradient shard only, and ranks could disagree on skipping a step.

[Note: FSDP under pipeline parallelism]
A stage runs many micro-batches per step, forwards and backwards interleaved (1F1B), and its step is the
user's ``training_step`` entered through block hooks, not a call of the module. FSDP's hooks alone would
gather and free every unit for each micro-batch and reduce-scatter after each backward. As torchtitan
and ``torch.distributed.pipelining``'s stage do, :class:`StageShards` instead gathers each unit of the
stage once before the step's first micro-batch (the root unit, the ends, explicitly: a step need not call
the module), keeps the whole parameters through every micro-batch (``reshard_after_forward`` and
``reshard_after_backward`` off), lets the whole gradients accumulate unreduced
(``requires_gradient_sync`` off), and after the last backward runs every unit's post-backward by hand:
one reduce-scatter (the replicas' average) into the shards' ``.grad``, then the whole parameters freed.
Per stage and step: one all-gather and one reduce-scatter of its parameters, whichever the stage (2 or 3);
between steps the stage holds 1/N of its parameters, gradients and optimizer state. During the step it
holds its whole parameters and gradients, as ZeRO-1 would: under pipeline parallelism stages 2 and 3
differ from 1 in what is kept at rest and in the bytes (FSDP's formula), not in the step's peak. The root
is made root before any block's forward (FSDP makes the first unit that runs forward the root).
Zero bubble's split backward takes the weights the graph uses: the whole parameters, named anew each step
(:meth:`StageShards.trainable`). Forward-only steps gather every unit and reshard at the end.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_par._compat import broadcast_coalesced
from lightning_par.comm import local_nbytes
from lightning_par.dp.zero import optimizer_state_bytes
from lightning_par.pipeline.discovery import find_blocks

PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "bf16-mixed")


def check_precision(precision: str, zero_stage: int) -> None:
    """Raise ``ValueError`` for a precision stages 2 / 3 cannot train correctly ([Note: mixed precision under FSDP]).

    Example:
        >>> check_precision("bf16-mixed", 3)
        >>> check_precision("16-mixed", 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `precision='16-mixed'` with `zero_stage=3` is not supported: ...
    """
    if precision in PRECISIONS:
        return
    why = ("its GradScaler would look for infs in this rank's gradient shard only, so ranks could disagree on "
           "skipping a step" if precision == "16-mixed" else "FSDP2's mixed-precision policy is derived only for "
           f"{', '.join(PRECISIONS)}")
    raise ValueError(f"`precision={precision!r}` with `zero_stage={zero_stage}` is not supported: {why}. Use "
                     f"`precision='bf16-mixed'` (no loss scaling needed) or `zero_stage=0` / `1`.")


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for Lightning's ``precision`` (see [Note: mixed precision under FSDP]).

    Example:
        >>> policy = mixed_precision_policy("bf16-mixed")
        >>> policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs
        (torch.bfloat16, torch.float32, True)
        >>> mixed_precision_policy("32-true") == MixedPrecisionPolicy()
        True
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


OFFLOADS = (None, "cpu")


def check_offload(offload: Any) -> None:
    """``offload``: None or ``"cpu"`` (what it needs of ``zero_stage``: :func:`check_offload_stage`)."""
    if offload not in OFFLOADS:
        raise ValueError(f"`offload={offload!r}` must be None or 'cpu' (FSDP2's CPUOffloadPolicy: parameter shards, "
                         f"gradients and optimizer state in host memory, the optimizer step on the host).")


def check_offload_stage(offload: Any, zero_stage: int) -> None:
    if offload is not None and zero_stage != 3:
        raise ValueError(f"`offload={offload!r}` needs `zero_stage=3` (got zero_stage={zero_stage}): only FSDP's "
                         f"fully sharded parameters can live in host memory. Set zero_stage=3, or offload=None.")


def check_offload_layout(offload: Any, *, sharded: bool, data_parallel_size: int) -> None:
    """The hybrid core shards over its ``dp`` axis only with several replicas (one replica keeps its stage's or
    tensor shard's parameters whole): there are then no FSDP shards to offload, so ``offload`` is refused rather
    than ignored."""
    if offload is not None and not sharded:
        raise ValueError(f"`offload={offload!r}` offloads FSDP's zero-stage-3 shards over the data-parallel axis, but "
                         f"this layout has data_parallel_size={data_parallel_size}: nothing is sharded, so nothing "
                         f"would move to host memory. Use more devices (a data-parallel axis of 2 or more), or "
                         f"offload=None.")


def check_offload_devices(offload: Any, devices) -> None:
    """[Note: CPU offload refused on a CPU device]
    ``offload="cpu"`` keeps FSDP2's parameter shards, gradients and optimizer state in (pinned) host memory and steps
    the optimizer there (``CPUOffloadPolicy``); it saves device memory only. On a CPU accelerator the module lives
    in host memory already, and torch's policy then pins and copies host tensors to the host for nothing: refused
    when the Trainer is built, with the reason."""
    if offload == "cpu" and all(d.type == "cpu" for d in devices):
        raise ValueError("`offload='cpu'` saves device memory by keeping the shards in host memory; this Trainer "
                         "trains on the CPU, whose memory they occupy already. Use a CUDA accelerator, or offload=None.")


def shard_module(module: nn.Module, mesh, *, zero_stage: int, precision: str = "32-true", broadcast: bool = True,
                 ignored=None, blocks: Optional[list[tuple[str, nn.Module]]] = None,
                 offload: Optional[str] = None) -> list[str]:
    """Shard ``module`` in place over the 1-D ``mesh`` (every rank of it calls this) and return the units'
    names (``""`` is the root). With ``broadcast`` every rank first takes the mesh's first rank's weights and
    buffers, as DDP does at construction (the layout strategies broadcast before they split). ``ignored``:
    parameters FSDP leaves alone (a pipeline stage's copies of what it does not hold). A module that is
    sharded already is left as it is. Parameters may be tensor-parallel DTensors on another axis of the
    same mesh (FSDP2's 2-D sharding). ``blocks``: the (name, block) units, found here when not given.
    ``offload="cpu"``: shards, gradients and optimizer state in pinned host memory (FSDP2's ``CPUOffloadPolicy``)."""
    if zero_stage not in (2, 3):
        raise ValueError(f"`zero_stage={zero_stage!r}`: FSDP shards for stages 2 and 3 only.")
    if blocks is None:
        try:
            path, stack = find_blocks(module)
            blocks = [(f"{path}.{name}", block) for name, block in stack.named_children()]
        except ValueError:  # no repeated block stack: the root is the only unit
            blocks = []
    if is_sharded(module):
        return [name for name, _ in blocks] + [""]
    if broadcast:
        _broadcast_from_first_rank(module, mesh)
    policy = mixed_precision_policy(precision)
    reshard = zero_stage == 3
    ignored = set(ignored or ())
    # pinned host memory serves the copies to a device; training on the CPU there is none to pin for
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload == "cpu" else OffloadPolicy()
    for _, block in blocks:
        if any(True for _ in block.parameters()):  # a pipeline's ghost of another stage's block holds none
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored,
                        offload_policy=offload_policy)
    # None: FSDP2's choice for the root (keep its parameters through the step); stage 2 never reshards early
    fully_shard(module, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=policy,
                ignored_params=ignored, offload_policy=offload_policy)
    return [name for name, _ in blocks] + [""]


class StepRunner:
    """Runs the step methods of a sharded ``module`` (see [Note: running a step through the root unit]).

    ``redirect(wrapper, module, name, *args, **kwargs)`` runs ``module.<name>`` inside ``wrapper.__call__``
    (Lightning's ``_ForwardRedirection``). Call :meth:`close` when done: it removes the counting hook.
    """

    def __init__(self, module: nn.Module):
        self._module, self._calls, self._direct = module, 0, set()
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self._calls += 1

    def run(self, name: str, redirect, *args, **kwargs):
        if name in self._direct:
            self._module.unshard()
            return getattr(self._module, name)(*args, **kwargs)
        before = self._calls
        out = redirect(self._module, self._module, name, *args, **kwargs)
        if self._calls - before > 1:  # the step called the module itself
            self._direct.add(name)
        return out

    def close(self) -> None:
        self._handle.remove()


class StageShards:
    """ZeRO stages 2 / 3 on one pipeline stage (see [Note: FSDP under pipeline parallelism]): ``module``
    sharded by :func:`shard_module` over the stage's replicas, driven by the schedule runner through
    :meth:`begin_step` (before a training step's first micro-batch) and :meth:`end_step` (after its last
    backward)."""

    def __init__(self, module: nn.Module):
        from lightning_par._compat import fsdp_root_init

        self.module = module
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        fsdp_root_init(module)  # the root before any block's forward runs

    def _set(self, final: bool) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(final, recurse=False)
            unit.set_reshard_after_backward(final, recurse=False)
            unit.set_is_last_backward(final)

    def begin_step(self) -> None:
        """Every unit gathered once; its whole gradients accumulate over the micro-batches, unreduced."""
        self._set(False)
        self.gather()

    def trainable(self) -> list[nn.Parameter]:
        """The trainable parameters the module holds now: the whole ones while gathered."""
        return [p for p in self.module.parameters() if p.requires_grad and not p.is_meta]

    def end_step(self) -> None:
        """The accumulated gradients reduce-scattered (averaged over the replicas) into the shards' ``.grad``,
        the whole parameters freed."""
        from lightning_par._compat import fsdp_finish_backward

        self._set(True)
        fsdp_finish_backward(self.module)
        reshard(self.module)

    def gather(self) -> None:
        """Every unit gathered, kept until :meth:`reshard` (a training step, or a forward-only one)."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()

    def reshard(self) -> None:
        reshard(self.module)


def _broadcast_from_first_rank(module: nn.Module, mesh) -> None:
    """Every rank starts from the first mesh rank's parameters and buffers (FSDP takes each rank's own
    weights for its shard: ranks that built different weights would train a model nobody initialised)."""
    tensors = [t.detach() for t in list(module.parameters()) + list(module.buffers()) if not t.is_meta]  # meta: no values
    if mesh.size() > 1 and tensors:
        group = mesh.get_group()
        with torch.no_grad():
            broadcast_coalesced(group, tensors, dist.get_global_rank(group, 0))


def reshard(module: nn.Module) -> None:
    """Free every unit's whole parameters that a forward-only pass left gathered (see the first Note)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# -- memory --------------------------------------------------------------------------------------------

def local_training_bytes(module: nn.Module, optimizers=()) -> dict[str, int]:
    """Bytes this rank stores for parameters, gradients and optimizer state (local shards of DTensors)."""
    params = list(module.parameters())
    return {"params": sum(local_nbytes(p) for p in params),
            "grads": sum(local_nbytes(p.grad) for p in params),
            "optimizer": sum(optimizer_state_bytes(o) for o in optimizers)}


__all__ = ["PRECISIONS", "check_precision", "mixed_precision_policy", "is_sharded",
           "shard_module", "StepRunner", "StageShards", "reshard", "local_training_bytes"]
