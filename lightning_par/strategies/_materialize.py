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
from typing import Any, Generator, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par._compat import multiprocessing_launcher, optimizers_to_device
from lightning_par.materialize import (assign_state, free_parameters, has_meta, initialize, is_meta, materialize,
                                       meta_parameters, move_real, open_module_weights, read_weights)
from lightning_par.weights import WeightsReader


class MaterializingStrategy:
    """Mixin of our strategies (before Lightning's base in the bases): ``tensor_init_context`` builds parameters
    on the meta device when ``_meta_build()`` says so, and :meth:`_place_share` gives this rank's share
    storage, initializes it and reads ``weights=`` into it."""

    _weights: Optional[str] = None
    _weights_prefix: str = ""
    _weights_reader: Optional[WeightsReader] = None
    _weights_read = False
    _restore_decision: Optional[bool] = None

    def _set_weights(self, weights, weights_prefix: str) -> None:  # checked by WeightsOptions
        self._weights = None if weights is None else os.fspath(weights)
        self._weights_prefix = weights_prefix

    def _meta_build(self) -> bool:
        return True

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Parameters on the meta device unless ``empty_init=False`` (``configure_model`` asks with ``None``);
        each rank materializes its share in setup. Buffers are built for real (see the Note)."""
        if empty_init is False or not self._meta_build():
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_parameters(), self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @property
    def weights_bytes_read(self) -> int:
        """Bytes of tensor data this rank read from ``weights=`` (0 before setup or without weights)."""
        return self._weights_reader.bytes_read if self._weights_reader is not None else 0

    def _open_weights(self, module: nn.Module, expected: Optional[Mapping] = None) -> Optional[WeightsReader]:
        """The reader of ``weights=``, checked against the whole module (or ``expected``) before anything is
        placed; None without weights or once they were read (a later fit / test keeps the trained weights)."""
        if self._weights is None or self._weights_read:
            return None
        return open_module_weights(self._weights, module, prefix=self._weights_prefix, expected=expected)

    def _restore_after_setup(self) -> bool:
        """A checkpoint must be restored after setup (into the materialized share, after ``weights=``): loaded
        before, it would land in meta tensors, or be overwritten by the weights."""
        if self._restore_decision is None:  # asked before setup and again after it: the answer of before
            module = self.lightning_module
            self._restore_decision = self._weights is not None or (module is not None and has_meta(module))
        return self._restore_decision

    def _place_share(self, module: nn.Module, reader: Optional[WeightsReader], owned=None) -> None:
        """The parameters ``owned`` rejects freed (meta), then storage on this rank's device for the meta
        tensors it accepts (all when None), initialized as
        the module's own code would, then ``weights=`` read into every tensor this rank holds
        ([Note: initializing a materialized share] in :mod:`lightning_par.materialize.init`). Every rank
        calls it: what no init wrote and no file holds is refused on every rank, by name."""
        if owned is not None:  # a plainly built module: what this rank does not own goes first
            free_parameters(module, [n for n, _ in module.named_parameters() if not owned(n)])
        made = materialize(module, self.root_device, owned)
        covered = set(reader.tensors) if reader is not None else set()
        left = initialize(module, made, seed=self._init_seed(), skip=covered)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, left)
            left = sorted({name for names in everyone for name in names})
        if left:
            if reader is not None:
                reader.close()
            shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
            raise ValueError(
                f"{type(self).__name__}: {type(module).__name__} was built on the meta device, and no init wrote "
                f"{shown}: their modules have no `reset_parameters()` (nor an `_init_weights` of a parent), "
                f"{'the weights file lacks them' if reader is not None else 'and no `weights=` was given'}. Give "
                f"those modules a `reset_parameters()`, pass `weights=` holding them, or build the module with "
                f"`trainer.init_module(empty_init=False)`."
            )
        if reader is not None:
            read_weights(module, reader)
            reader.close()
            self._weights_reader, self._weights_read = reader, True
        move_real(module, self.root_device)

    def _consolidates_weights(self) -> bool:
        """Whether a fork / spawn launch hands the caller the whole module gathered from every rank
        (:class:`ConsolidatingLauncher`) rather than rank 0's tensors (:class:`HeldTensorsLauncher`)."""
        return False

    def _configure_launcher(self) -> None:  # the one launcher swap of every strategy
        super()._configure_launcher()
        if type(self._launcher) is _Launcher:
            launcher = ConsolidatingLauncher if self._consolidates_weights() else HeldTensorsLauncher
            self._launcher = launcher(self, start_method=self._start_method)

    def teardown(self) -> None:
        """Lightning's teardown ends with ``lightning_module.cpu()``, which cannot copy the meta tensors of what
        other ranks own: the same steps, moving only the tensors that hold storage."""
        self._restore_decision = None
        module = self.lightning_module
        if module is None or not has_meta(module):
            return super().teardown()
        optimizers_to_device(self.optimizers, torch.device("cpu"))
        move_real(module, torch.device("cpu"))
        teardown_in_place(self)

    def _init_seed(self) -> int:
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
