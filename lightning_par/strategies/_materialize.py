"""What every strategy shares for models too big for one device: the meta build of Lightning's
``trainer.init_module(empty_init=True)`` and ``configure_model`` ([Note: meta parameters, real buffers] in
:mod:`lightning_par.materialize.meta`), the materialization of this rank's share at setup and
``weights=`` / ``weights_prefix=`` read into it. The work lives in :mod:`lightning_par.materialize`.
"""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from typing import Generator, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par._compat import multiprocessing_launcher, optimizers_to_device
from lightning_par.materialize import (assign_state, free_parameters, has_meta, initialize, is_meta, materialize,
                                       meta_parameters, move_real, open_module_weights, read_weights)
from lightning_par.weights import WeightsReader


class Weights:
    """The strategy's weights reader: ``weights=`` / ``weights_prefix=`` opened and checked against the whole module
    before anything is placed, then read into this rank's share by :meth:`place`, which first gives the share
    storage and initializes it. Owned by the strategy; ``strategy``: its ``root_device``, its name in refusals."""

    def __init__(self, strategy, weights, weights_prefix: str) -> None:  # checked by WeightsOptions
        self.s = strategy
        self.path = None if weights is None else os.fspath(weights)
        self.prefix = weights_prefix
        self.reader: Optional[WeightsReader] = None  # the last reader, once read
        self.read = False
        self._restore_decision: Optional[bool] = None

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read if self.reader is not None else 0

    def open(self, module: nn.Module, expected: Optional[Mapping] = None) -> Optional[WeightsReader]:
        """The reader of ``weights=``, checked against the whole module (or ``expected``) before anything is
        placed; None without weights or once they were read (a later fit / test keeps the trained weights)."""
        if self.path is None or self.read:
            return None
        return open_module_weights(self.path, module, prefix=self.prefix, expected=expected)

    def restore_after_setup(self, module: Optional[nn.Module]) -> bool:
        """A checkpoint must be restored after setup (into the materialized share, after ``weights=``): loaded
        before, it would land in meta tensors, or be overwritten by the weights."""
        if self._restore_decision is None:  # asked before setup and again after it: the answer of before
            self._restore_decision = self.path is not None or (module is not None and has_meta(module))
        return self._restore_decision

    def forget_restore_decision(self) -> None:  # at teardown
        self._restore_decision = None

    def place(self, module: nn.Module, reader: Optional[WeightsReader], owned=None) -> None:
        """The parameters ``owned`` rejects freed (meta), then storage on this rank's device for the meta
        tensors it accepts (all when None), initialized as
        the module's own code would, then ``weights=`` read into every tensor this rank holds
        ([Note: initializing a materialized share] in :mod:`lightning_par.materialize.init`). Every rank
        calls it: what no init wrote and no file holds is refused on every rank, by name."""
        device = self.s.root_device
        if owned is not None:  # a plainly built module: what this rank does not own goes first
            free_parameters(module, [n for n, _ in module.named_parameters() if not owned(n)])
        made = materialize(module, device, owned)
        covered = set(reader.tensors) if reader is not None else set()
        left = initialize(module, made, seed=init_seed(), skip=covered)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, left)
            left = sorted({name for names in everyone for name in names})
        if left:
            if reader is not None:
                reader.close()
            shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
            raise ValueError(
                f"{type(self.s).__name__}: {type(module).__name__} was built on the meta device, and no init wrote "
                f"{shown}: their modules have no `reset_parameters()` (nor an `_init_weights` of a parent), "
                f"{'the weights file lacks them' if reader is not None else 'and no `weights=` was given'}. Give "
                f"those modules a `reset_parameters()`, pass `weights=` holding them, or build the module with "
                f"`trainer.init_module(empty_init=False)`."
            )
        if reader is not None:
            read_weights(module, reader)
            reader.close()
            self.reader, self.read = reader, True
        move_real(module, device)


@contextlib.contextmanager
def meta_init_context(strategy) -> Generator[None, None, None]:
    """Parameters on the meta device (each rank materializes its share in setup); buffers are built for real
    ([Note: meta parameters, real buffers] in :mod:`lightning_par.materialize.meta`)."""
    with meta_parameters(), strategy.root_device, strategy.precision_plugin.tensor_init_context():
        yield


def swap_launcher(strategy, launcher, start_method: str, consolidates: bool):
    """The one launcher swap of every strategy: Lightning's fork / spawn ``launcher`` replaced by ours
    (``consolidates``: the caller receives the whole module gathered from every rank, else rank 0's tensors)."""
    if type(launcher) is _Launcher:
        launcher = (ConsolidatingLauncher if consolidates else HeldTensorsLauncher)(strategy, start_method=start_method)
    return launcher


def teardown_meta(strategy) -> bool:
    """Lightning's teardown ends with ``lightning_module.cpu()``, which cannot copy the meta tensors of what other
    ranks own: the same steps, moving only the tensors that hold storage (False: nothing meta, Lightning's own)."""
    module = strategy.lightning_module
    if module is None or not has_meta(module):
        return False
    optimizers_to_device(strategy.optimizers, torch.device("cpu"))
    move_real(module, torch.device("cpu"))
    teardown_in_place(strategy)
    return True


def init_seed() -> int:
    """One seed for every rank's init: global rank 0's ``torch.initial_seed()``."""
    seed = torch.initial_seed() % (1 << 62)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return seed


def teardown_in_place(strategy) -> None:
    """Lightning's strategy teardown without moving the module, as Lightning's ``ModelParallelStrategy`` does: the
    one teardown of a sharded module (DDPStrategy's would move it to the CPU, which swaps every DTensor parameter
    and fails when anything holds a weak reference to one) and of a meta-built one's real tensors."""
    strategy.cluster_environment.teardown()
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


_Launcher, _WorkerOutput = multiprocessing_launcher()


class HeldTensorsLauncher(_Launcher):
    """Lightning's fork / spawn launcher, but the weights rank 0 hands back to the calling process leave out the
    meta tensors of what other ranks own (the caller loads them with ``strict=False``; a meta value would fail
    to copy), and a caller's meta-built module takes them as its tensors (copying into meta ones does nothing)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        """[Note: collect before fork]
        A process group destroyed in this process (an earlier one-device fit: Lightning makes a world group for
        DDP at ``devices=1``; a notebook's earlier run) whose Python object a reference cycle still holds is
        freed by the cyclic collector at some later allocation. In a forked child that destructor joins the
        backend's threads, which fork did not copy, and the child waits forever: every rank stopped at an
        arbitrary line of setup, its main thread in a futex wait (seen with gloo on torch 2.13; a 20-line
        reproduction: destroy a world-1 gloo group held by a cycle, fork, ``gc.collect()`` in the child). Collecting
        before the fork frees such objects in the process that owns their threads.

        [Note: freeze before fork]
        Then the survivors are frozen (``gc.freeze()``, CPython's advice for fork without exec) until the ranks are
        back: a forked rank's collections skip what it inherited. Without it every full collection in a rank walks
        the caller's whole heap (~0.5 s for a process that imported Lightning and transformers) and writes into
        each object's header, copying every page of it; the tensor-parallel probe collects once per region. The
        caller's objects are unfrozen again when the launch returns; a caller that froze its own stays frozen."""
        if self._start_method != "fork":
            return super().launch(function, *args, trainer=trainer, **kwargs)
        gc.collect()
        ours = gc.get_freeze_count() == 0
        if ours:
            gc.freeze()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            if ours:
                gc.unfreeze()

    def _recover_results_in_main_process(self, worker_output, trainer) -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None and has_meta(module):
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            assign_state(module, state)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)

    def _collect_rank_zero_results(self, trainer, results):
        def drop_meta(module, state_dict, prefix, local_metadata):
            for key in [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and is_meta(v)]:
                del state_dict[key]

        handle = trainer.lightning_module.register_state_dict_post_hook(drop_meta)
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            handle.remove()


class ConsolidatingLauncher(HeldTensorsLauncher):
    """Lightning's spawn/fork launcher, but the weights handed back to the calling process are the whole
    module's (``strategy.consolidated_state()``, every rank takes part): Lightning's own hands back rank 0's state
    dict and loads it with ``strict=False``, which would leave the caller's module with the shards and
    stages rank 0 did not hold at their initial values, silently. A caller's meta-built module takes them as its
    tensors (:class:`HeldTensorsLauncher`)."""

    def _collect_rank_zero_results(self, trainer, results):
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        state_dict = self._strategy.consolidated_state()  # collective: the stages assembled, the shards gathered
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))
