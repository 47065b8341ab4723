"""Megatron-style tensor parallelism (DTensor) for an unchanged LightningModule, with data-parallel replicas.

    Trainer(devices=4, strategy=TensorParallelStrategy(tensor_parallel_size=2))   # tp=2 × dp=2

At setup the module is parallelized by a plan found by inspecting it (:mod:`lightning_par.tensor.plan`);
rank 0 prints the plan. Gradients are averaged over the data-parallel replicas after the last backward
of each optimizer step, before clipping.

[Note: a DDPStrategy base, not ModelParallelStrategy]
Lightning's ``ModelParallelStrategy`` only has the popen launcher, demands ``configure_model`` and
refuses ``16-mixed`` for its subclasses. ``DDPStrategy`` brings the popen / spawn / fork launchers,
process-group setup with a timeout, barrier / broadcast / reduce; this class never wraps the module in
``DistributedDataParallel`` (gradients of a tensor-parallel model are averaged over the ``dp`` mesh axis
by :func:`lightning_par.tensor.mixed.average_grads` instead), so DDP's hooks stay inert.
"""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Literal, Mapping, Optional, Union

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import checkpoint as ckpt
from lightning_par.strategies._base import LayoutStrategy, check_flags
from lightning_par.tensor.mixed import (average_grads, install_clipping, install_scaler, reduce_partial_grads,
                                        split_step_by_kind)
from lightning_par.tensor.parallelize import backward_context, parallelize, register_rules, to_plain
from lightning_par.tensor.plan import build_plan, check_user_plan
from lightning_par.tensor.rules import restore_rules
from lightning_par.topology import Topology, check_sizes, keep_loader_on_one_process

Size = Union[int, Literal["auto"]]
DEFAULT_TIMEOUT_S = 1800


class TensorParallelStrategy(LayoutStrategy):
    """Tensor parallel over ``tensor_parallel_size`` ranks × ``data_parallel_size`` replicas.

    Args:
        tensor_parallel_size: ranks that split each layer (``"auto"``: every device not given to data parallel).
        data_parallel_size: replicas (``"auto"``: world size / tensor_parallel_size).
        plan: ``"auto"`` or ``{module_glob: "colwise" | "rowwise" | "sequence" | "replicate"}`` overriding it.
        sequence_parallel: split the residual stream, norms and dropout inside the block stack along the
            sequence (all-gather / reduce-scatter instead of all-reduce); see [Note: sequence parallel span].
        loss_parallel: the output head writes vocabulary-sharded logits (the tied / matching embedding becomes
            vocabulary-parallel) and the user's ``F.cross_entropy`` runs on the shards inside
            ``torch.distributed.tensor.parallel.loss_parallel()``; see [Note: loss parallel].
        save_distributed_checkpoint: write ``torch.distributed.checkpoint`` directories instead of one file.
        async_save: write checkpoints in the background (see :mod:`lightning_par.strategies._checkpoint`).
        start_method: ``"popen"`` (as DDPStrategy), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: collective timeout in seconds (or a ``timedelta``).
    """

    strategy_name = "tensor_parallel"
    strategy_description = "lightning_par tensor parallel (DTensor, auto Megatron plan)"

    def __init__(
        self,
        *,
        tensor_parallel_size: Size = "auto",
        data_parallel_size: Size = "auto",
        plan: Union[str, Mapping[str, str]] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = False,
        async_save: bool = False,
        start_method: str = "popen",
        timeout: Union[float, int, timedelta] = DEFAULT_TIMEOUT_S,
        process_group_backend: Optional[str] = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        check_sizes(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
        if plan != "auto":
            plan = check_user_plan(plan)
        check_flags(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, start_method=start_method,
                         timeout=timeout, async_save=async_save, accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend)
        self._tp_size, self._dp_size = tensor_parallel_size, data_parallel_size
        self._plan_arg = plan
        self._sequence_parallel, self._loss_parallel = sequence_parallel, loss_parallel
        self._mesh = None
        self._plan = None
        self._restore_loader = lambda: None

    # -- state that exists after setup_environment ------------------------------------------------------
    @property
    def device_mesh(self):
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once processes are set up (Trainer.fit / validate / ...).")
        return self._mesh

    @property
    def tp_mesh(self):
        return self.device_mesh["tp"]

    @property
    def plan(self):
        """The :class:`~lightning_par.tensor.plan.TensorPlan` applied at setup."""
        if self._plan is None:
            raise RuntimeError("The tensor-parallel plan is applied in Trainer setup; it does not exist yet.")
        return self._plan

    # -- lifecycle ----------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        # Called in the launching process at Trainer construction: check the sizes before any process starts.
        Topology.resolve(self.num_nodes * self.num_processes, data_parallel_size=self._dp_size,
                         tensor_parallel_size=self._tp_size, model_axis="tp")
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _ConsolidatingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        # Sizes are checked against the world before the process group exists, so a bad size cannot hang.
        world = self.num_nodes * self.num_processes
        self._topology = Topology.resolve(world, data_parallel_size=self._dp_size,
                                          tensor_parallel_size=self._tp_size, model_axis="tp")
        super().setup_environment()
        self._mesh = self._topology.build_mesh(self.root_device.type, timeout=self._timeout)

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self._restore_loader = keep_loader_on_one_process(trainer, self.world_size)  # [Note: one process ...]
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for opt in self.optimizers:
                split_step_by_kind(opt._optimizer if isinstance(opt, LightningOptimizer) else opt)
        self.setup_precision_plugin()
        install_clipping(self.precision_plugin)
        install_scaler(getattr(self.precision_plugin, "scaler", None))
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def teardown(self) -> None:
        # As Lightning's ModelParallelStrategy: the sharded module stays where it is (DDPStrategy would move it
        # to the CPU, which swaps every DTensor parameter and fails when anything holds a weak reference to one).
        assert self.cluster_environment is not None and self.accelerator is not None
        self._close_checkpointing()
        self._restore_loader()
        restore_rules()  # DTensor's propagator is process-global: no rule of ours outlives the run
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _parallelize(self) -> None:
        module = self.lightning_module
        register_rules()  # taken out at teardown: a later fit / test of the same module needs them again
        if getattr(module, "_lp_tensor_parallel", None) is not None:
            self._plan = module._lp_tensor_parallel
            return
        # Pure: raises the same ValueError on every rank before any collective.
        plan = build_plan(module, self.topology.tensor_parallel_size, self._plan_arg,
                          sequence_parallel=self._sequence_parallel, loss_parallel=self._loss_parallel)
        self._sync_plain_state(module)
        self._sync_rng()
        parallelize(module, plan, self.tp_mesh, sequence_parallel=self._sequence_parallel)
        module._lp_tensor_parallel = self._plan = plan
        if self._loss_parallel:
            _log_plain_values(module)
        if self.is_global_zero:
            rank_zero_info(f"{self.topology}\n{plan.describe(module)}")

    def _sync_plain_state(self, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's weights (a module built without a common seed would diverge)."""
        tensors = [t for t in list(module.parameters()) + list(module.buffers())]
        if self.world_size > 1 and tensors:
            with torch.no_grad():
                torch.distributed._broadcast_coalesced(torch.distributed.group.WORLD, tensors, 1 << 24, 0)

    def _sync_rng(self) -> None:
        """Every rank continues rank 0's random stream: tensor-parallel peers hold the same replicated
        activations and must draw the same dropout masks on them (different masks would silently train a
        different model)."""
        if self.world_size > 1:
            cuda = self.root_device.type == "cuda"
            state = [torch.get_rng_state(), torch.cuda.get_rng_state(self.root_device) if cuda else None]
            torch.distributed.broadcast_object_list(state, src=0, device=self.root_device)
            torch.set_rng_state(state[0])
            if cuda:
                torch.cuda.set_rng_state(state[1], self.root_device)

    # -- training -----------------------------------------------------------------------------------
    # [Note: loss parallel]
    # With loss_parallel=True the logits are DTensors sharded on the vocabulary. The user's step runs inside
    # ``loss_parallel()`` (cross-entropy on shards) and so does backward, which runs outside the step.
    # What a step returns and what it logs are turned into plain tensors (the loss is replicated: no
    # communication; ``full_tensor`` keeps the autograd graph), so Lightning never handles a DTensor.
    def _step(self, hook: str, *args, **kwargs):
        fn = getattr(super(), hook)
        if not self._loss_parallel:
            return fn(*args, **kwargs)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return to_plain(fn(*args, **kwargs))

    def training_step(self, *args, **kwargs):
        return self._step("training_step", *args, **kwargs)

    def validation_step(self, *args, **kwargs):
        return self._step("validation_step", *args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self._step("test_step", *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        return self._step("predict_step", *args, **kwargs)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        with backward_context(loss_parallel=self._loss_parallel):  # see [Note: one layout per region]
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        dp = self.topology.data_parallel_size
        group = self.device_mesh["dp"].get_group() if dp > 1 else None

        def closure_then_average():
            result = closure()
            params = list(self.lightning_module.parameters())
            reduce_partial_grads(params, self.tp_mesh.get_group())
            average_grads(params, group, dp)
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load full tensors into the shards, after parallelize


def _log_plain_values(module) -> None:
    """``module.log`` / ``log_dict`` receive full plain tensors instead of DTensors (see [Note: loss parallel])."""
    if getattr(module, "_lp_plain_log", False):
        return
    log, log_dict = module.log, module.log_dict
    module.log = lambda name, value, *a, **k: log(name, to_plain(value), *a, **k)
    module.log_dict = lambda dictionary, *a, **k: log_dict(to_plain(dictionary), *a, **k)
    module._lp_plain_log = True


class _ConsolidatingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, but the weights handed back to the calling process are gathered to full
    tensors (every rank takes part), so the caller's unparallelized module receives plain trained weights."""

    def _collect_rank_zero_results(self, trainer, results):
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        state_dict = ckpt.full_state(trainer.lightning_module.state_dict())  # collective
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))
