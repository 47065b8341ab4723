"""The core's SPMD engine, for a layout with one pipeline stage (the interface: [Note: engines behind one interface]
in :mod:`~lightning_par.strategies._engine`): the whole module is parallelized over its
tensor-parallel group by a plan found by inspecting it (:mod:`lightning_par.tensor.plan`; rank 0 prints the
plan), Lightning runs the user's step as usual, and the gradients are settled over the tensor-parallel
ranks and averaged over the data-parallel replicas after the last backward of each optimizer step, before
clipping. With ``context_parallel_size > 1`` the block stack runs on this rank's piece of every sequence
(:func:`lightning_par.context.apply_context_parallel`) and the gradients are averaged over the cp group too.

[Note: ZeRO under context parallelism]
With ``zero_stage`` 2 / 3 FSDP2 shards over the ``dp`` axis alone, and the ranks of a cp group hold the same shards:
FSDP's reduce-scatter averages over the replicas, then the cp average of every rank's local shard is the same
all-reduce as at stages 0 / 1 ([Note: gradients under context parallelism]). Sharding over dp × cp flattened
(torchtitan's ``dp_shard_cp``) would cut parameters, gradients and optimizer state by a further ``cp``, but it needs a
flattened mesh axis (a private DeviceMesh API) and FSDP's mean over dp × cp in place of the cp average; the
activations, which cp is for, shrink the same in both.

[Note: the replicas' mean of a step]
With data-parallel replicas every rank returns and logs the mean over the replicas ([Note: loss reporting, one
rule] in :mod:`~lightning_par.strategies._engine`): the step's
``self.log`` calls are captured and replayed with the replicas' mean, and the returned loss becomes
``loss + (mean - loss).detach()``: its value is the mean, its gradient this rank's own (the replicas'
gradients are averaged by the strategy, not through the loss).

[Note: loss parallel]
With loss_parallel=True the logits are DTensors sharded on the vocabulary. The user's step runs inside
``loss_parallel()`` (cross-entropy on shards) and so does backward, which runs outside the step. What a step
returns and what it logs are turned into plain tensors (the loss is replicated: no communication;
``full_tensor`` keeps the autograd graph), so Lightning never handles a DTensor.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par._compat import optimizers_to_device
from lightning_par.dp import fsdp
from lightning_par.experts.apply import divided_before
from lightning_par.materialize import move_real
from lightning_par.parallelize import parallelize_spmd
from lightning_par.pipeline.routing import LogCapture, ResultRouter
from lightning_par.strategies._engine import Engine, optimizer_params as _params
from lightning_par.strategies._materialize import teardown_in_place
from lightning_par.strategies._pipeline_sample import sample_step
from lightning_par.strategies._precision import PrecisionHooks
from lightning_par.tensor.mixed import average_grads, clip_grad_norm_, clip_grad_value_, reduce_partial_grads
from lightning_par.tensor.parallelize import backward_context, parallelized_size, register_rules, to_plain


class SpmdEngine(Engine):
    """The one-stage hooks of ``strategy`` (a
    :class:`~lightning_par.strategies.hybrid_parallel.HybridParallelStrategy`)."""

    def __init__(self, strategy, options, groups, host):
        super().__init__(strategy, options, groups, host)
        self.s = strategy  # its public Lightning attributes only
        self.plan = None
        self.planned = None  # the module this engine applied ``plan`` to
        self.steps = None  # zero_stage 2 / 3: runs each step through FSDP's root unit
        self.context = None  # context_parallel_size > 1: the block stack's hooks (lightning_par.context)
        self.experts = None  # expert_parallel_size > 1: lightning_par.experts.ExpertParallel

    def setup(self, trainer) -> None:
        s = self.s
        self.take_user_compile(s.lightning_module, self.options.blocks)  # before anything reads the tree
        s.accelerator.setup(trainer)
        s.precision_plugin.convert_module(s.model)
        move_real(s.model, s.root_device)  # a meta-built module gets its shards' storage in _parallelize
        module = s.lightning_module
        register_rules()  # taken out at teardown: a later fit / test of the same module needs them again
        before = divided_before(module, self.options.layout.expert_parallel_size)  # experts an earlier setup divided
        self.experts = before if before is not None else self.experts
        fresh = not self._parallelized_before(module) and before is None
        self.uncheckpoint_blocks()
        fitting = trainer.state.fn == TrainerFn.FITTING

        def sample():  # the step of this trainer's stage (fitting: the training step) on one micro-batch
            return sample_step(s, module, 1)

        made = parallelize_spmd(module, self.options, self.groups, self.rank_values(), place=self.host.place_share,
                                open_weights=self.host.open_weights, fresh=fresh, sample=sample,
                                user_compile=self.user_compile, train_sample=sample if fitting else None,
                                before_experts=(self.host.record_one_device_order  # [Note: recording one device's
                                                if fitting else None))  # order]
        self.checkpointed, self.context, self.compiled = made.checkpointed, made.context, made.compiled
        if fresh:
            self.plan, self.planned, self.experts = made.plan, module, made.experts
            if s.is_global_zero:
                rank_zero_info(made.summary)
        if trainer.state.fn == TrainerFn.FITTING:
            s.setup_optimizers(trainer)
        self.start_periodic_sync(trainer)  # sync="local_sgd" | "diloco": [Note: periodic sync on the data axis]
        # DTensor and plain gradients clipped and unscaled apart ([Note: precision subclasses])
        self.host.install_precision(PrecisionHooks(
            clip_by_norm=self.clip_grad_norm,
            clip_by_value=lambda opt, value: clip_grad_value_(_params(opt), value), split_unscale=True))
        s.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(s.optimizers, s.root_device)

    def reshard(self) -> None:
        """After forward-only passes and before checkpoints: the sharded module at rest (FSDP's shards)."""
        if fsdp.is_sharded(self.s.lightning_module):
            fsdp.reshard(self.s.lightning_module)

    def clip_grad_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm_(_params(optimizer), clip_val)

    def expected_keys(self):
        """Under expert parallelism: the other ranks' per-expert modules' keys too (a checkpoint holds them)."""
        if self.experts is None:
            return None
        return self.experts.expected_keys(list(self.s.lightning_module.state_dict()))

    def teardown(self) -> None:
        self.stop_periodic_sync()
        if self.context is not None:
            self.context.remove()
            self.context = None
        self.uncheckpoint_blocks()
        self.uncompile_blocks()
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        teardown_in_place(self.s)  # the sharded module stays where it is

    def _parallelized_before(self, module) -> bool:
        """Whether an earlier setup parallelized ``module``: this engine's (a later fit / test of the same
        Trainer) or another Trainer's (the module stays sharded after teardown), read from the module itself.
        Of another Trainer's the plan is on that Trainer's strategy, not here; a different tensor-parallel size
        is refused."""
        size = parallelized_size(module)
        if size is None and not fsdp.is_sharded(module):
            return False
        tp = self.s.topology.tensor_parallel_size
        if size is not None and size != tp:
            raise ValueError(f"{type(module).__name__} was parallelized by an earlier Trainer with "
                             f"tensor_parallel_size={size}, and this strategy has tensor_parallel_size={tp}; a "
                             f"parallelized module keeps its shards. Use tensor_parallel_size={size}, or build the "
                             f"module anew for this run.")
        if self.planned is not module:
            self.plan = self.planned = None
            if self.s.is_global_zero:
                rank_zero_info(f"{self.s.topology}\n{type(module).__name__} was parallelized by an earlier Trainer")
        return True

    # -- steps ([Note: the replicas' mean of a step], [Note: loss parallel]) -------------------------
    def training_step(self, run, args: tuple, kwargs: dict) -> Any:
        return self.eval_step("training_step", run, self.s.precision_plugin.train_step_context, args, kwargs)

    def eval_step(self, hook: str, run, context, args: tuple, kwargs: dict) -> Any:
        """``run()`` (Lightning's call of the user's ``hook``), its result and logs made plain and, with
        replicas, averaged over them. A module sharded by FSDP runs ``hook`` through its root unit instead
        ([Note: running a step through the root unit] in dp/fsdp.py)."""
        s = self.s
        if fsdp.is_sharded(s.lightning_module):
            if self.steps is None:
                self.steps = fsdp.StepRunner(s.lightning_module)

            def run():
                with context():
                    return self.steps.run(hook, self.host.forward_redirection, *args, **(kwargs or {}))
        if hook == "training_step" and self.context is not None:  # [Note: sharded to the loss]
            run = _within(self.context.sharded_loss, run)
        replicas = s.topology.data_parallel_size > 1 and hook != "predict_step"
        loss_parallel_ = self.options.loss_parallel
        if not replicas and not loss_parallel_:
            return run()
        from torch.distributed.tensor.parallel import loss_parallel

        lm = s.lightning_module
        with loss_parallel() if loss_parallel_ else contextlib.nullcontext():
            with LogCapture(lm, convert=to_plain) as capture:
                out = to_plain(run())
        logs = capture.combined([1])
        if replicas:
            router = ResultRouter(mailbox=None, is_last=True, device=s.root_device, dp_group=self.groups.dp,
                                  dp_size=s.topology.data_parallel_size)
            mean, logs = router.mean_over_replicas(_detached(out), logs)
            out = _with_values(out, mean)
        for name, value, kw in logs:
            lm.log(name, value.to(s.root_device), **kw)
        return out

    def backward(self, run, closure_loss: torch.Tensor) -> torch.Tensor:
        with backward_context(loss_parallel=self.options.loss_parallel):  # see [Note: one layout per region]
            return run()

    def finish_gradients(self, closure):
        """``closure`` followed by the gradients' tensor-parallel settling and the replicas' average."""
        s = self.s
        dp = s.topology.data_parallel_size

        def closure_then_average():
            result = closure()
            params = list(s.lightning_module.parameters())
            reduce_partial_grads(params, self.groups.mesh["tp"].get_group())
            if self.experts is not None:  # averaged over the ranks holding the same experts instead
                params = self.experts.dense_parameters(s.lightning_module)
                self.experts.finish_gradients(s.lightning_module)
            # [Note: gradients under context parallelism], [Note: ZeRO under context parallelism]
            if self.groups.cp is not None:
                average_grads(params, self.groups.cp, s.topology.context_parallel_size)
            if not fsdp.is_sharded(s.lightning_module) and not self.syncs_periodically:  # FSDP: averaged already
                average_grads(params, self.groups.dp, dp, average=self.replica_average)  # torchft's (fault tolerance)
            return result

        return closure_then_average


def _within(scope, run):
    def scoped():
        with scope():
            return run()
    return scoped


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, dict):
        return {k: _detached(v) for k, v in out.items()}
    return out


def _with_values(out: Any, mean: Any) -> Any:
    """``out`` with each scalar replaced by its replicas' mean: the value of ``mean``, the gradient of ``out``."""
    if isinstance(out, torch.Tensor) and isinstance(mean, torch.Tensor) and out.numel() == 1:
        mean = mean.to(out.device, out.dtype).reshape(out.shape)
        return out + (mean - out.detach()) if out.requires_grad else mean
    if isinstance(out, dict) and isinstance(mean, dict):
        return {k: _with_values(v, mean.get(k)) for k, v in out.items()}
    return out
