"""The checkpoint hooks every lightning_par strategy shares: one format for every layout.

The strategy owns a :class:`Checkpointer` and calls it from each of Lightning's checkpoint hooks
(``lightning_module_state_dict``, ``optimizer_state``, ``save_checkpoint``, ``load_checkpoint``,
``load_model_state_dict``, ``load_optimizer_state_dict``, ``remove_checkpoint``); the work is in
:mod:`lightning_par.checkpoint`. The strategy answers the layout's questions (its engine's answers):

- ``_checkpoint_model_share()``: the module state-dict entries this rank writes (all it holds; identical replicas
  are written once). A pipeline stage leaves out the copies it never trains.
- ``_checkpoint_writes_param(param, name)``: whether this rank writes ``name``'s optimizer state.
- ``_checkpoint_expected_keys()``: the whole unchanged module's state-dict keys.
- ``_checkpoint_layout()``: a dict describing the layout (``lightning-par-checkpoint inspect`` prints it).
- ``_checkpoint_prepare()``: bring the module to its at-rest layout before reading or writing it (FSDP: reshard).

:meth:`Checkpointer.record_one_device_order` is called at setup, *before* splitting the module, where this rank's
optimizer will not hold the whole module's parameters (a pipeline stage); otherwise the live optimizer's groups are
one device's order already (tensor parallel, FSDP and ZeRO keep every parameter and its name).

[Note: two forms of one checkpoint]
``save_distributed_checkpoint=False``: one file in plain Lightning's one-device format (the module's full
state dict, optimizer states positional in one device's numbering: [Note: optimizer state by name]), so
``load_from_checkpoint`` and a plain one-device ``Trainer.fit(ckpt_path=...)`` take it. ``True``: a DCP
directory ([Note: one sharded format]). Both load under any layout: a rank reads what it holds, by name.
``async_save=True`` stages this rank's share (one copy) and writes it in the background; the next save,
load or teardown waits for it first, and the checkpoint gets its final name only once it is complete.
"""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_par._compat import lightning_optimizers, optimizer_to_device
from lightning_par.atomic import write_file
from lightning_par.checkpoint import sharded
from lightning_par.checkpoint.gather import gather_share
from lightning_par.checkpoint.optim import (flat_params, from_positional, live_order, load_named, named_groups,
                                            named_state, to_positional)
from lightning_par.checkpoint.tensors import local_shard_like
from lightning_par.dp.zero import local_optimizer

INFO_KEY = sharded.INFO_KEY
FORMAT_VERSION = 1


def _unwrap(optimizer):
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _cloned(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def check_fit(where: str, module_name: str, expected, targets: Mapping[str, torch.Tensor],
              saved: Mapping[str, tuple], strict: bool) -> None:
    """Refuse a checkpoint whose model entries do not fit the module, naming the path and the keys."""
    known = set(expected)
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in known]
    misshaped = [f"{k}: checkpoint {tuple(saved[k])}, module {tuple(targets[k].shape)}" for k in targets
                 if k in saved and isinstance(targets[k], torch.Tensor) and tuple(saved[k]) != tuple(targets[k].shape)]
    problems = []
    if strict and missing:
        problems.append(f"{len(missing)} missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:10])}"
                        f"{' ...' if len(unexpected) > 10 else ''}")
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped: {'; '.join(misshaped[:10])}")
    if problems:
        raise ValueError(f"The checkpoint {where} does not fit {module_name}: " + "; ".join(problems) +
                         ". Was it saved from another model? (`strict_loading=False` on the module allows missing "
                         "and unexpected keys.)")


class Checkpointer:
    """The checkpoint hooks' work for ``strategy`` (which calls it from each Lightning hook and implements the
    interface of the module docstring): owned by the strategy, one per strategy."""

    def __init__(self, strategy, *, save_distributed_checkpoint: bool, async_save: bool) -> None:
        self.s = strategy
        self.distributed, self.async_save = save_distributed_checkpoint, async_save
        self.source: Optional[str] = None  # a DCP directory being restored
        self.where = "the checkpoint"
        self._one_device_orders: Optional[list] = None
        self._pending_save = None  # (future, done event) of a background save
        self._save_group = None
        self._writer: Optional[ThreadPoolExecutor] = None

    def record_one_device_order(self) -> None:
        """Record which parameter names each group of ``configure_optimizers`` holds on the whole module, before
        the module is split. [Note: recording one device's order] ``configure_optimizers`` is called once more
        for this (its optimizers and schedulers are dropped): only the user's own code knows which parameters
        go to which group, in which order, and a stage's optimizer holds only its own."""
        module = self.s.lightning_module
        names = {id(p): n for n, p in module.named_parameters()}
        self._one_device_orders = [live_order(_unwrap(o), names) for o in lightning_optimizers(module)]

    # -- helpers ----------------------------------------------------------------------------------------
    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.s.lightning_module.named_parameters()}

    def _one_device_order(self, index: int, optimizer) -> list[list[str]]:
        if self._one_device_orders is not None:
            if index >= len(self._one_device_orders):
                raise RuntimeError(f"`configure_optimizers` returned {len(self._one_device_orders)} optimizers at "
                                   f"setup and more later.")
            return self._one_device_orders[index]
        return live_order(optimizer, self._param_names())

    def _optimizer_index(self, optimizer) -> int:
        ids = [id(_unwrap(o)) for o in self.s.optimizers]
        if id(optimizer) not in ids:
            raise RuntimeError(f"{type(optimizer).__name__} is not one of the strategy's optimizers.")
        return ids.index(id(optimizer))

    def _checkpoint_info(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        orders = [self._one_device_order(i, _unwrap(o)) for i, o in enumerate(self.s.optimizers)]
        return {"format": FORMAT_VERSION, "layout": self.s._checkpoint_layout(), "param_names": orders, "rng": rng}

    @staticmethod
    def _restore_rng(info: Any) -> None:
        rng = info.get("rng") if isinstance(info, Mapping) else None
        if not rng:
            return
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    # -- writing ----------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.distributed:
            self.s._checkpoint_prepare()
            return self.s._checkpoint_model_share()  # each rank writes its part: [Note: one sharded format]
        return self.consolidated_state()

    def consolidated_state(self) -> dict[str, Any]:
        """The whole unchanged module's state dict on global rank 0 (``{}`` elsewhere; every rank calls it):
        the consolidated file's, and what a fork / spawn launch hands back to the calling process."""
        self.s._checkpoint_prepare()
        merged = gather_share(self.s._checkpoint_model_share())  # [Note: who sends what when consolidating]
        if not self.s.is_global_zero:
            return {}
        keys = self.s._checkpoint_expected_keys()
        lost = [k for k in keys if k not in merged]
        if lost:
            raise RuntimeError(f"Consolidating the state dict of {type(self.s.lightning_module).__name__} lost "
                               f"{lost[:5]}: no rank wrote them.")
        known = set(keys)
        return {**{k: merged[k] for k in keys}, **{k: v for k, v in merged.items() if k not in known}}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        state = named_state(local_optimizer(optimizer), self._param_names(), self.s._checkpoint_writes_param)
        groups = named_groups(optimizer, self._one_device_order(self._optimizer_index(optimizer), optimizer))
        if self.distributed:
            return {"state": state, "param_groups": groups}
        merged = gather_share({(n, k): v for n, entry in state.items() for k, v in entry.items()})
        if not self.s.is_global_zero:
            return {}
        nested: dict[str, dict[str, Any]] = {}
        for (name, key), value in merged.items():
            nested.setdefault(name, {})[key] = value
        return to_positional(nested, groups)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        self.finish_save()
        path = self.s.broadcast(str(filepath))
        info = self._checkpoint_info()
        if not self.distributed:
            if not self.s.is_global_zero:
                return
            checkpoint = {**checkpoint, INFO_KEY: info}
            if not self.async_save:
                return self.s.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self._save_in_background(_cloned(checkpoint), path, storage_options)
            return
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        flat = sharded.flatten(checkpoint.get("state_dict", {}), checkpoint.get("optimizer_states", []),
                               {**meta, INFO_KEY: info} if self.s.is_global_zero else None)
        if self.async_save:
            if self._save_group is None and dist.is_initialized():
                # a group of its own: the background save's collectives must not interleave with training's
                self._save_group = dist.new_group(backend="gloo")
            future = sharded.start_save(path, flat, async_save=True, process_group=self._save_group)
            done = threading.Event()
            rank_zero = self.s.is_global_zero

            def finish(f):
                try:
                    if rank_zero and f.exception() is None:
                        sharded.publish(sharded.incomplete(path), path)
                finally:
                    done.set()
            future.add_done_callback(finish)
            self._pending_save = (future, done)
            return
        sharded.start_save(path, flat)
        if self.s.is_global_zero:
            sharded.publish(sharded.incomplete(path), path)  # dcp.save returned on every rank: all is written
        self.s.barrier("save_distributed_checkpoint")

    def _save_in_background(self, checkpoint: dict, path: str, storage_options) -> None:
        """Rank 0 writes the consolidated file from a thread, under a temporary name renamed when complete."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_par_save")
        done = threading.Event()

        def write():
            try:  # under a hidden temporary, renamed when complete ([Note: atomic checkpoints])
                write_file(path, lambda tmp: self.s.checkpoint_io.save_checkpoint(checkpoint, tmp,
                                                                                storage_options=storage_options))
            finally:
                done.set()
        self._pending_save = (self._writer.submit(write), done)

    def finish_save(self) -> None:
        """Wait for a background save to complete (its errors raised here)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            future, done = pending
            future.result()
            done.wait()

    def close(self) -> None:
        """At teardown: finish a background save, release its thread and group."""
        self.finish_save()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        if self._save_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._save_group)
        self._save_group = None

    # -- reading ----------------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path, read: Callable[[str], Any]) -> dict[str, Any]:
        """``read``: Lightning's own reading of a file (the strategy's ``checkpoint_io``)."""
        self.finish_save()
        path = self.s.broadcast(str(checkpoint_path))
        self.where = path
        if sharded.is_sharded(path):
            self.source = path
            checkpoint = {**sharded.read_meta(path), "state_dict": {}}
            count = sharded.optimizer_count(path)
            if count:  # none (save_weights_only): Lightning's own message if a fit needs them
                checkpoint["optimizer_states"] = [None] * count
        else:
            self.source = None
            try:
                checkpoint = read(path)
            except FileNotFoundError:
                raise
            except Exception as err:
                raise ValueError(f"The checkpoint {path} cannot be read (truncated or not a checkpoint?): "
                                 f"{type(err).__name__}: {err}") from err
            if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
                raise ValueError(f"The file {path} is not a Lightning checkpoint: it has no `state_dict` entry.")
        self._restore_rng(checkpoint.get(INFO_KEY))
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.s._checkpoint_prepare()
        module = self.s.lightning_module
        targets = module.state_dict()
        if self.source is not None:
            saved_shapes = sharded.model_names(self.source)
        else:
            saved = checkpoint["state_dict"]
            saved_shapes = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
        check_fit(self.where, type(module).__name__, self.s._checkpoint_expected_keys(), targets, saved_shapes,
                  strict)
        if self.source is not None:
            loaded = sharded.load_model(self.source, {k: v for k, v in targets.items() if k in saved_shapes})
        else:
            loaded = {k: (local_shard_like(saved[k], targets[k]) if isinstance(saved[k], torch.Tensor) else saved[k])
                      for k in targets if k in saved}
        module.load_state_dict(loaded, strict=False)  # every key was checked above; a stage loads its own

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        saved = checkpoint["optimizer_states"]
        if len(saved) != len(self.s.optimizers):
            raise ValueError(f"The checkpoint {self.where} holds the state of {len(saved)} optimizers; "
                             f"`configure_optimizers` returns {len(self.s.optimizers)}.")
        names = self._param_names()
        for i, wrapped in enumerate(self.s.optimizers):
            optimizer = _unwrap(wrapped)
            if self.source is not None:  # only the state this rank keeps (ZeRO-1: its partition)
                params = {names[id(p)]: p for p in flat_params(local_optimizer(optimizer))}
                state, groups = sharded.load_optimizer(self.source, i, params)
            else:
                state, groups = from_positional(saved[i], self._one_device_order(i, optimizer), where=self.where)
            load_named(optimizer, state, groups, names, where=self.where)
            optimizer_to_device(wrapped, self.s.root_device)


__all__ = ["Checkpointer", "INFO_KEY", "check_fit"]
