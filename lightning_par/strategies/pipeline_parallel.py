"""Pipeline parallelism for an unchanged LightningModule (``Trainer(strategy=PipelineParallelStrategy(...))``).

The work lives in :mod:`lightning_par.pipeline`; this class wires it into Lightning's hooks:

1. ``setup_environment``: resolve the (pp, dp) layout, start the process group, build the groups.
2. ``configure_ddp`` / ``setup``: find the block stack, partition it, install this rank's stage
   (blocks of other stages become ghosts) before the optimizers are built from what is left.
3. ``training_step``: the whole schedule (every micro-batch's forward and backward), see
   [Note: schedule inside training_step]; ``backward``: reduce and hand over the gradients.
4. ``validation_step`` / ``test_step`` / ``predict_step``: forward-only pipeline.
5. Checkpoints: one consolidated state dict under the module's own names; optimizer states of all
   ranks in the same file, reloaded under the same layout.

[Note: schedule inside training_step] Lightning's automatic optimization calls ``zero_grad`` between
``strategy.training_step`` and ``strategy.backward``. A 1F1B stage must interleave backwards with
forwards, so the whole schedule runs in ``training_step``: the gradients of the step are taken aside
(the ones accumulated before are put back untouched) and added in ``backward``, after Lightning's
``zero_grad``. ``training_step`` returns the true batch loss on every rank (broadcast from the last
stage) so the progress bar and callbacks agree; ``backward`` ignores the tensor it is given.

[Note: own schedule runner] torch.distributed.pipelining drives each stage as a module whose forward it
calls with the received activation. Here the user's own ``training_step`` drives the stage (it computes
masks, rotary tables and the loss, and logs), and the stage is entered and left through block hooks in
the middle of that code, so a stage is not a callable submodule that a ``PipelineStage`` could wrap
without rewriting the user's forward. The orders are short pure functions in ``schedules.py`` (GPipe,
1F1B, interleaved 1F1B after Megatron, a ZB-H1-style zero bubble), checked for completeness and
deadlock freedom by a simulator in the unit tests; only zero bubble's split backward reuses torch's
private helpers (``split_backward.py``). Transfers carry a tag per (direction, virtual stage,
micro-batch), so out-of-order arrivals between two ranks (interleaving) cannot be confused on gloo.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par.strategies._registry import RegisteredByName
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.microbatch import batch_size, check_microbatches, first_batch, split_batch
from lightning_par.pipeline.partition import BALANCES, partition_blocks, stage_bounds, stage_costs
from lightning_par.pipeline.profile import profile_step
from lightning_par.checkpoint import is_distributed_checkpoint, read_meta, save_distributed
from lightning_par.pipeline import sharded_checkpoint as sharded
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.routing import LogCapture, combine_outputs, concat_outputs
from lightning_par.pipeline.schedules import (SCHEDULES, interleaved_actions, looped_gpipe_actions,
                                              stage_actions, zero_bubble_actions)
from lightning_par.pipeline.stage import Ghost, StageRuntime
from lightning_par.topology import Topology, keep_loader_on_one_process

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class PipelineParallelStrategy(RegisteredByName, DDPStrategy):
    """Split the model's repeated blocks into ``pipeline_parallel_size`` stages, ``data_parallel_size``
    replicas of the pipeline; micro-batches flow through the stages in a ``gpipe``, ``1f1b``,
    ``interleaved_1f1b`` (``stages_per_rank`` ≥ 2 chunks per rank) or ``zero_bubble`` order."""

    strategy_name = "pipeline_parallel"
    strategy_description = "lightning_par pipeline parallel (unchanged module; GPipe, 1F1B, interleaved, zero bubble)"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, str] = "auto",
        data_parallel_size: Union[int, str] = "auto",
        microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        blocks: Optional[str] = None,
        balance: Union[str, Sequence[int]] = "params",
        save_distributed_checkpoint: bool = False,
        start_method: str = "popen",
        timeout: Union[float, timedelta] = 1800.0,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
    ):
        _check_options(pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                       microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                       blocks=blocks, balance=balance, start_method=start_method, timeout=timeout)
        if not isinstance(save_distributed_checkpoint, bool):
            raise ValueError(f"`save_distributed_checkpoint={save_distributed_checkpoint!r}` must be True or False.")
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, start_method=start_method,
            timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout)),
        )
        self._pp_size, self._dp_size = pipeline_parallel_size, data_parallel_size
        self._microbatches, self._schedule, self._stages_per_rank = microbatches, schedule, stages_per_rank
        self._blocks, self._balance = blocks, list(balance) if not isinstance(balance, str) else balance
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._dcp_path: Optional[str] = None  # the sharded checkpoint being resumed (its optimizer states load after setup)
        self._topology: Optional[Topology] = None
        self._pp_group = self._dp_group = None
        self._p2p_groups: tuple = (None, None, None, None)
        self._runtime: Optional[StageRuntime] = None
        self._mailbox: Optional[ResultMailbox] = None
        self._params: list[torch.nn.Parameter] = []
        self._new_grads: list[Optional[torch.Tensor]] = []
        self._block_param_ids: set[int] = set()
        self._owner_stage: Optional[dict[str, int]] = None  # non-block parameter name -> owning stage
        self._shared: dict[str, Any] = {}  # non-block parameter name -> group of the stages that use it
        self._shared_order: Optional[list] = None
        self._full_keys: list[str] = []
        self._block_prefix = ""
        self.last_step_stats: dict[str, float] = {}  # seconds of the last training step's schedule (benchmarks)
        self._restore_loader = lambda: None

    # -- layout -----------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("The pipeline layout exists only after the strategy's `setup_environment`.")
        return self._topology

    @property
    def stage(self) -> int:
        return self.topology.coordinates(self.global_rank)["pp"]

    @property
    def runtime(self) -> StageRuntime:
        if self._runtime is None:
            raise RuntimeError("The pipeline stage exists only after the strategy's `setup`.")
        return self._runtime

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.topology.sampler_kwargs(self.global_rank)  # every stage of a pipeline sees the same batch

    def setup_environment(self) -> None:
        world = self.num_nodes * len(self.parallel_devices or [None])
        self._topology = Topology.resolve(world, data_parallel_size=self._dp_size,
                                          pipeline_parallel_size=self._pp_size, model_axis="pp")
        pp = self._topology.pipeline_parallel_size
        self._stages_per_rank = 1 if pp == 1 else self._stages_per_rank  # one stage: no chunks to interleave
        if self._schedule == "interleaved_1f1b" and self._microbatches is not None and self._microbatches % pp:
            raise ValueError(
                f"`schedule='interleaved_1f1b'` sends micro-batches through each chunk in groups of "
                f"pipeline_parallel_size ({pp}); `microbatches={self._microbatches}` must be a multiple of it."
            )
        super().setup_environment()
        self._pp_group = self._new_groups("pp")
        self._dp_group = self._new_groups("dp")
        # activations up, gradients down, and with several chunks per rank the same to a lower / higher rank
        # (the ring wraps around): [Note: one direction per group] in pipeline/p2p.py
        self._p2p_groups = tuple(self._new_groups("pp") for _ in range(2 if self._stages_per_rank == 1 else 4))
        self._result_group = self._new_groups("pp")  # the last stage's step results: [Note: result mailbox]

    def _new_groups(self, axis: str):
        mine = None
        for ranks in self.topology.all_groups(axis):  # same order on every rank, as new_group requires
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks, timeout=self._timeout)
            if self.global_rank in ranks:
                mine = group
        return mine

    # -- installing the stage ---------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self._restore_loader = keep_loader_on_one_process(trainer, self.world_size)  # [Note: one process ...]
        if trainer.state.fn == TrainerFn.FITTING and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "PipelineParallelStrategy supports automatic optimization only: the schedule runs each "
                "micro-batch's backward itself. Remove `self.automatic_optimization = False` from the module."
            )
        if self._runtime is not None:
            # A later fit / validate / test / predict of the same Trainer (under popen, rank 0 is this very
            # process): the stage is installed, and DDPStrategy's module-state broadcast would now pair
            # tensors of different stages. Redo only what a stage needs.
            self.accelerator.setup(trainer)
            self.model_to_device()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                _optimizers_to_device(self.optimizers, self.root_device)
            return
        super().setup(trainer)
        if self._runtime is None:  # validate / test / predict: no configure_ddp
            self._install()

    def teardown(self) -> None:
        self._restore_loader()
        super().teardown()

    def configure_ddp(self) -> None:  # called by DDPStrategy.setup before the optimizers are built
        self._install()

    def _install(self) -> None:
        lm = self.lightning_module
        topo = self.topology
        if any(isinstance(m, Ghost) for m in lm.modules()):
            raise RuntimeError(
                f"This {type(lm).__name__} was already split into pipeline stages by another Trainer in this "
                f"process; its other stages' blocks are gone. Reuse that Trainer, or load the consolidated "
                f"checkpoint into a fresh module (`{type(lm).__name__}.load_from_checkpoint(path)`)."
            )
        path, container = find_blocks(lm, self._blocks)
        with _rng_fork(self.root_device, True):  # [Note: block flow] in pipeline/flow.py; the batch drawn too
            step = self._sample_step(lm)  # (a shuffling sampler draws its seed from the global generator)
            flow = trace_flow(lm, path, container, step) if step is not None else None
        for warning in flow.warnings if flow is not None else ():
            rank_zero_warn(warning)
        costs = [float(sum(p.numel() for p in b.parameters())) for b in container]
        ends, times = (0.0, 0.0), None
        if self._balance == "time":
            times = self._profile(lm, container)
            if times is not None:
                ends, costs = (times[0], times[2]), times[1]
        pp, v = topo.pipeline_parallel_size, self._stages_per_rank
        counts = partition_blocks(len(container), pp * v, balance=self._balance, costs=costs,
                                  first_extra=ends[0], last_extra=ends[1])
        bounds = stage_bounds(counts)
        if flow is not None:
            flow.check_stages(path, bounds)
        self._full_keys = list(lm.state_dict().keys())
        self._block_prefix = f"{path}."
        self._print_table(path, counts, container, lm, times)
        ring = topo.group_ranks("pp", self.global_rank)
        virtual = [c * pp + self.stage for c in range(v)]  # virtual stage c·p + s is this rank's chunk c
        self._runtime = StageRuntime(
            container=container, chunks=[(k, *bounds[k]) for k in virtual], ranks=[ring[k % pp] for k in range(pp * v)],
            device=self.root_device, seed=_base_seed(), groups=self._p2p_groups, flow=flow,
        )
        self._runtime.install()
        self._mailbox = (ResultMailbox(ranks=ring, me=self.global_rank, group=self._result_group,
                                       device=self.root_device) if self._result_group is not None else None)
        self._runtime.weights = [p for p in lm.parameters() if p.requires_grad]
        self._block_param_ids = {id(p) for b in container for p in b.parameters()}
        self._params = [p for p in lm.parameters() if p.requires_grad]
        self.model = lm
        self._confine_metrics(lm)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # global norm over stages
        if getattr(self.precision_plugin, "scaler", None) is not None:
            self._plugin_after_closure = self.precision_plugin._after_closure
            self.precision_plugin._after_closure = self._after_closure

    def _confine_metrics(self, lm) -> None:
        """torchmetrics objects are updated by the last stage only: sync them over the last stages of the
        replicas (the ranks that updated them), never over ranks that did not (that would hang)."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover
            return
        for metric in (m for m in lm.modules() if isinstance(m, Metric)):
            if self.runtime.is_last and self._dp_group is not None:
                metric.process_group = self._dp_group
            else:
                metric.sync_on_compute = False

    def _profile(self, lm, container):
        """Every rank times the user's step on one micro-batch of its first training batch (see
        [Note: profiling the unchanged step] in pipeline/profile.py), all at once, so the timings see the
        contention of the real run (CPU ranks share cores and memory bandwidth, which slows a large head
        more than the blocks); every rank then uses the mean over ranks, so all choose the same split."""
        if lm.trainer.state.fn != TrainerFn.FITTING:
            rank_zero_warn("balance='time' profiles a training batch; outside fit the split follows 'params'.")
            return None
        everyone = [None] * dist.get_world_size()
        dist.barrier()  # start together: every repetition runs while the other ranks run theirs
        dist.all_gather_object(everyone, self._profile_locally(lm, container))
        pre, blocks, post = zip(*everyone)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return mean(pre), [mean(b) for b in zip(*blocks)], mean(post)

    def _sample_step(self, lm):
        """The user's step (of this trainer function) on one micro-batch of its first batch, or None."""
        t, plugin = lm.trainer, self.precision_plugin
        loop, hook, context = {TrainerFn.FITTING: (t.fit_loop, "training_step", plugin.train_step_context),
                               TrainerFn.VALIDATING: (t.validate_loop, "validation_step", plugin.val_step_context),
                               TrainerFn.TESTING: (t.test_loop, "test_step", plugin.test_step_context),
                               TrainerFn.PREDICTING: (t.predict_loop, "predict_step", plugin.predict_step_context),
                               }[t.state.fn]
        batch = first_batch(loop._data_source.dataloader() if loop._data_source.is_defined() else None)
        if batch is None:
            return None
        mb = split_batch(self.batch_to_device(batch), self._num_microbatches())[0]

        def step():
            with LogCapture(lm), context():
                return getattr(lm, hook)(mb, 0)
        return step

    def _profile_locally(self, lm, container):
        with _rng_fork(self.root_device, True):
            step = self._sample_step(lm)
            result = profile_step(container, lambda: _loss_of(step()), self.root_device, repeats=8)
        for p in lm.parameters():
            p.grad = None
        return result

    def _print_table(self, path: str, counts: list[int], container, lm, times) -> None:
        params = [sum(p.numel() for p in b.parameters()) for b in container]
        other = sum(p.numel() for p in lm.parameters()) - sum(params)
        lines = [f"Pipeline: {len(counts)} stages over `{path}` ({len(params)} blocks), "
                 f"{self.topology.data_parallel_size} data-parallel replica(s), schedule={self._schedule}, "
                 f"balance={self._balance}",
                 f"{'stage':>5} {'blocks':>9} {'block params':>13} {'~MB (fp32 Adam)':>16}"
                 + (f" {'profiled ms':>12}" if times else "")]
        stage_ms = stage_costs(counts, times[1], times[0], times[2]) if times else None
        for s, (lo, hi) in enumerate(stage_bounds(counts)):
            n = sum(params[lo:hi])
            lines.append(f"{s:>5} {f'{lo}-{hi - 1}':>9} {n:>13,} {n * 16 / 2**20:>16.2f}"
                         + (f" {stage_ms[s] * 1e3:>12.2f}" if stage_ms else ""))
        lines.append(f"non-block parameters ({other:,}: embeddings, head) live on the stages that use them")
        rank_zero_info("\n".join(lines))

    # -- training ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        loader = self.lightning_module.trainer.train_dataloader
        check_microbatches(self._microbatches, getattr(loader, "batch_size", None))

    def _num_microbatches(self) -> int:
        return self._microbatches or 2 * self.topology.pipeline_parallel_size

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lm, rt = self.lightning_module, self.runtime
        batch, rest = args[0], args[1:]
        mbs = split_batch(batch, self._num_microbatches())
        sizes = [batch_size(mb) for mb in mbs]
        accumulate = lm.trainer.accumulate_grad_batches
        coefs = [n / sum(sizes) / accumulate for n in sizes]
        stash = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        rt.seeded = lm.training
        rt.step = lm.trainer.global_step * 65_537 + int(rest[0] if rest else 0)
        outputs: dict[int, Any] = {}
        capture = LogCapture(lm)
        scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: one loss scale, see _after_closure
        rt.wait_s = rt.busy_s = 0.0
        actions = self._actions(len(mbs))
        rt.begin_step(actions)
        deferred: list[tuple[int, int]] = []  # zero bubble: (chunk, micro-batch) whose B ran and whose W has not
        payload = None  # the last stage's (result, logs), sent once its last backward has run
        self._post_result()
        start = time.perf_counter()
        with _rng_fork(self.root_device, rt.seeded), capture:
            for kind, c, i in actions:
                capture.microbatch = i
                last = rt.is_last and c == len(rt.chunks) - 1  # the chunk that computes the loss
                if kind == "F":
                    with self.precision_plugin.train_step_context():
                        out = rt.forward(i, lambda: lm.training_step(mbs[i], *rest, **kwargs), chunk=c)
                    if last:
                        outputs[i] = out
                elif kind == "W":
                    if (c, i) in deferred:  # not run early to fill a wait, nor fused with its B
                        deferred.remove((c, i))
                        rt.backward_weight(i, chunk=c)
                else:
                    loss = _loss_of(outputs[i]) * coefs[i] if last else None
                    if loss is not None and scaler is not None:
                        loss = scaler.scale(loss)
                    if self._schedule != "zero_bubble" or rt.is_last:
                        rt.backward(i, loss, chunk=c)  # zero bubble's last stage: B and W in one pass
                    else:
                        while deferred and not rt.gradient_arrived(i, chunk=c):  # [Note: filling waits]
                            early_c, early_i = deferred.pop(0)
                            rt.backward_weight(early_i, chunk=early_c)
                        rt.backward_input(i, loss, chunk=c)
                        deferred.append((c, i))
                    if last:
                        outputs[i] = _detach(outputs[i])
                        if i == len(mbs) - 1:  # every forward has run; sent after the last gradient went upstream
                            payload = self._send_result([outputs[j] for j in range(len(mbs))], sizes, capture)
            rt.finish()
        self.last_step_stats = {"schedule_s": time.perf_counter() - start, "busy_s": rt.busy_s, "wait_s": rt.wait_s,
                                "microbatches": len(mbs)}
        self._new_grads = [p.grad for p in self._params]
        for p, g in zip(self._params, stash):
            p.grad = g
        return self._route(payload)

    def _actions(self, microbatches: int) -> list[tuple[str, int, int]]:
        """This rank's (kind, chunk, micro-batch) actions for one step."""
        pp, rt = self.topology.pipeline_parallel_size, self.runtime
        if self._schedule == "interleaved_1f1b":
            if microbatches % pp == 0:
                return interleaved_actions(rank=self.stage, ranks=pp, chunks=len(rt.chunks), microbatches=microbatches)
            return looped_gpipe_actions(chunks=len(rt.chunks), microbatches=microbatches)  # a partial batch
        if self._schedule == "zero_bubble":
            return [(k, 0, i) for k, i in zero_bubble_actions(stage=self.stage, num_stages=pp, microbatches=microbatches)]
        return [(k, 0, i) for k, i in stage_actions(self._schedule, stage=self.stage, num_stages=pp,
                                                      microbatches=microbatches)]

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward hooks
        grads = self._new_grads
        if self._owner_stage is None:
            self._find_shared_parameters(grads)
            self._drop_unused_optimizer_state(grads)
        self._reduce_gradients(grads)
        for p, g in zip(self._params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self._new_grads = []
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward hooks

    def _find_shared_parameters(self, grads: list) -> None:
        """[Note: shared parameters] Which stage uses a parameter outside the blocks is not known before a
        step runs (an embedding tied to the head, a position table every block reads). After the first
        step every rank reports which of them got a gradient (one ``all_gather_object``); a parameter used
        by several stages of a pipeline gets a group of exactly those ranks and its gradient is summed
        there every step; the lowest such stage owns it for the global norm and the consolidated
        checkpoint. Copies that a stage never uses stay untouched (stale) on that rank."""
        lm = self.lightning_module
        names = {id(p): n for n, p in lm.named_parameters()}
        used = sorted(names[id(p)] for p, g in zip(self._params, grads)
                      if g is not None and id(p) not in self._block_param_ids)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.global_rank, used))
        users: dict[tuple[int, str], list[int]] = {}  # (pipeline id, name) -> stages
        for rank, rank_used in everyone:
            c = self.topology.coordinates(rank)
            for n in rank_used:
                users.setdefault((c["dp"], n), []).append(c["pp"])
        me = self.topology.coordinates(self.global_rank)
        self._owner_stage = {n: min(st) for (dp, n), st in users.items() if dp == me["dp"]}
        shared_sets = sorted({(dp, tuple(sorted(st))) for (dp, n), st in users.items() if len(st) > 1})
        groups = {}
        for dp, stages in shared_sets:  # every rank creates every group, in one order
            ranks = [self.topology.rank_of(pp=s, dp=dp, tp=0) for s in stages]
            groups[(dp, stages)] = dist.new_group(ranks, timeout=self._timeout)
        for (dp, n), st in users.items():
            if dp == me["dp"] and len(st) > 1 and me["pp"] in st:
                self._shared[n] = groups[(dp, tuple(sorted(st)))]

    def _drop_unused_optimizer_state(self, grads: list) -> None:
        """Optimizer state loaded for a parameter copy this stage never uses (a sharded checkpoint gives every
        stage the state of every parameter it holds) is freed: the copy never gets a gradient."""
        unused = {id(p) for p, g in zip(self._params, grads) if g is None and id(p) not in self._block_param_ids}
        for optimizer in self.optimizers:
            state = getattr(optimizer, "_optimizer", optimizer).state
            for p in [p for p in state if id(p) in unused]:
                del state[p]

    def _reduce_gradients(self, grads: list) -> None:
        if self._shared_order is None:  # (index into _params, group), in name order: the same on every rank
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            order = sorted(enumerate(self._params), key=lambda ip: names[id(ip[1])])
            self._shared_order = [(i, self._shared[names[id(p)]]) for i, p in order if names[id(p)] in self._shared]
        for p_idx, group in self._shared_order:
            if grads[p_idx] is None:
                grads[p_idx] = torch.zeros_like(self._params[p_idx])
            dist.all_reduce(grads[p_idx], group=group)
        if self._dp_group is None:
            return
        present = [g for g in grads if g is not None]
        flat = torch.cat([g.reshape(-1) for g in present])
        dist.all_reduce(flat, group=self._dp_group)
        flat /= self.topology.data_parallel_size
        offset = 0
        for g in present:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this stage counts ``p`` (for the global gradient norm and the consolidated state)."""
        if id(p) in self._block_param_ids:
            return True
        return (self._owner_stage or {}).get(name, 0) == self.stage

    def _after_closure(self, model, optimizer) -> None:
        """16-mixed: the GradScaler has unscaled this rank's gradients; an overflow found on any rank must
        skip the step on every rank (and halve the one loss scale everywhere), so the found-inf flags are
        max-reduced over the world before Lightning's hooks, clipping and ``scaler.step`` see them."""
        scaler = self.precision_plugin.scaler
        state = scaler._per_optimizer_states[id(getattr(optimizer, "_optimizer", optimizer))]
        found = list(state["found_inf_per_device"].values())
        flag = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for f in found:
            flag = torch.maximum(flag, f.to(flag.device, torch.float32))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for f in found:
            f.fill_(flag.item())
        self._plugin_after_closure(model, optimizer)

    def _clip_grad_by_norm(self, optimizer, clip_val: Union[int, float]) -> None:
        lm = self.lightning_module
        names = {id(p): n for n, p in lm.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for p in params:
            if self._owns(p, names.get(id(p), "")):
                sq += p.grad.detach().float().pow(2).sum()
        if self._pp_group is not None:
            dist.all_reduce(sq, group=self._pp_group)
        coef = torch.clamp(float(clip_val) / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))

    # -- evaluation -------------------------------------------------------------------------------
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _eval_step(self, hook: str, context, args: tuple, kwargs: dict) -> Any:
        lm, rt = self.lightning_module, self.runtime
        batch, rest = args[0], args[1:]
        mbs = split_batch(batch, self._num_microbatches())
        sizes = [batch_size(mb) for mb in mbs]
        rt.seeded = False
        rt.begin_step([("F", c, i) for i in range(len(mbs)) for c in range(len(rt.chunks))])
        outputs = []
        capture = LogCapture(lm)
        if hook != "predict_step":
            self._post_result()
        with capture:
            for i, mb in enumerate(mbs):
                capture.microbatch = i
                for c in range(len(rt.chunks)):
                    with context():
                        out = rt.forward(i, lambda: getattr(lm, hook)(mb, *rest, **kwargs), chunk=c)
                outputs.append(out)
            rt.finish()
        if hook == "predict_step":
            return self._broadcast_from_last(concat_outputs(outputs) if rt.is_last else None)
        return self._route(self._send_result(outputs, sizes, capture) if rt.is_last else None)

    # -- routing results to every rank of the pipeline (see [Note: log routing] in pipeline/routing.py) --
    def _post_result(self) -> None:
        if self._mailbox is not None:
            self._mailbox.post()

    def _send_result(self, outputs: list, sizes: list[int], capture: LogCapture) -> tuple:
        """The last stage: combine the micro-batches' results and logs, and send them on (see [Note: result
        mailbox] in pipeline/mailbox.py)."""
        result = None if outputs[0] is None else combine_outputs(outputs, sizes)
        payload = (_to_cpu(result), capture.combined(sizes))
        if self._mailbox is not None:
            self._mailbox.send(payload)
        return payload

    def _route(self, payload: Optional[tuple]) -> Any:
        """Every rank: return and log the last stage's ``payload`` (received here on the other stages)."""
        if self._mailbox is not None:
            if self.runtime.is_last:
                self._mailbox.finish()
            else:
                payload = self._mailbox.receive()
        result, logs = payload
        result, logs = _to_device(result, self.root_device), [(n, v.to(self.root_device), kw) for n, v, kw in logs]
        if self._dp_group is not None:
            result, logs = self._mean_over_replicas(result, logs)
        lm = self.lightning_module
        for name, value, kw in logs:
            lm.log(name, value, **kw)
        return result

    def _mean_over_replicas(self, result: Any, logs: list) -> tuple[Any, list]:
        """The replicas' values averaged (they train equal shares of the global batch), so every rank
        returns and logs what one device would for the global batch and ``callback_metrics`` agree on all
        ranks (see [Note: log routing])."""
        keys = [k for k, v in (result.items() if isinstance(result, dict) else [(None, result)])
                if isinstance(v, torch.Tensor) and v.numel() == 1]
        picked = [result[k] if k is not None else result for k in keys] + [v for _, v, _ in logs]
        if not picked:
            return result, logs
        vec = torch.stack([v.detach().float().reshape(()) for v in picked])
        dist.all_reduce(vec, group=self._dp_group)
        vec /= self.topology.data_parallel_size
        for i, k in enumerate(keys):
            if k is None:
                result = vec[i]
            else:
                result = {**result, k: vec[i]}
        return result, [(n, vec[len(keys) + j], kw) for j, (n, _, kw) in enumerate(logs)]

    def _broadcast_from_last(self, obj: Any) -> Any:
        if self._pp_group is None:
            return obj
        ring = self.topology.group_ranks("pp", self.global_rank)
        box = [obj]
        dist.broadcast_object_list(box, src=ring[-1], group=self._pp_group)
        return box[0]

    # -- checkpoints ------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """[Note: consolidated checkpoint] The first replica's stages each contribute what they own (their
        blocks; outside the blocks, the parameters they own per [Note: shared parameters] and, on the first
        stage, the buffers); rank 0 assembles them in the unchanged module's key order, so the file loads
        strictly into the module on one device. Optimizer states stay per rank (``optimizer_state``)."""
        lm = self.lightning_module
        if self._runtime is None:
            return lm.state_dict()
        mine = self._owned_state()
        if self._save_distributed_checkpoint:
            return mine  # each rank writes its part: [Note: sharded pipeline checkpoint]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {k: v.detach().cpu() for k, v in mine.items()})
        merged: dict[str, Any] = {}
        for part in everyone:
            for k, v in part.items():
                merged.setdefault(k, v)
        missing = [k for k in self._full_keys if k not in merged]
        if missing:
            raise RuntimeError(f"Consolidating the pipeline's state dict lost {missing[:5]}.")
        return {k: merged[k] for k in self._full_keys} if self.is_global_zero else {}

    def _owned_state(self) -> dict[str, torch.Tensor]:
        """The entries of the module's state dict this rank writes (none on replicas other than the first)."""
        lm = self.lightning_module
        params = dict(lm.named_parameters(remove_duplicate=False))
        canonical = {id(p): n for n, p in lm.named_parameters()}
        mine = {}
        if self.topology.coordinates(self.global_rank)["dp"] == 0:
            for k, v in lm.state_dict().items():
                if k.startswith(self._block_prefix):
                    keep = True  # only this stage's blocks have entries here
                elif k in params:
                    keep = self._owns(params[k], canonical[id(params[k])])
                else:
                    keep = self.stage == 0  # buffers outside the blocks: the first stage's copy
                if keep:
                    mine[k] = v.detach()
        return mine

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        lm = self.lightning_module
        if self._runtime is None:  # before setup: the whole unchanged module
            return super().load_model_state_dict(checkpoint, strict=strict)
        local = set(lm.state_dict())
        lm.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in local}, strict=strict)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            first = self.topology.coordinates(self.global_rank)["dp"] == 0
            return sharded.optimizer_items(getattr(optimizer, "_optimizer", optimizer), names,
                                           lambda p: first and self._owns(p, names[id(p)]))
        state = super().optimizer_state(optimizer)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, state)
        return {"pipeline_parallel": {"layout": list(self.topology.shape), "ranks": everyone}}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = self.broadcast(str(filepath))
        save_distributed(path, checkpoint, is_rank_zero=self.is_global_zero)
        self.barrier("save_distributed_checkpoint")

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        if not is_distributed_checkpoint(path):
            self._dcp_path = None
            return super().load_checkpoint(path, weights_only=weights_only)
        self._dcp_path = path
        meta = read_meta(path)
        state = sharded.load_model(path, self.lightning_module.state_dict())
        return {**meta, "state_dict": state, "optimizer_states": [None] * sharded.optimizer_count(path)}

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._dcp_path is not None:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            for i, optimizer in enumerate(self.optimizers):
                sharded.load_optimizer(self._dcp_path, getattr(optimizer, "_optimizer", optimizer), i, names)
                _optimizer_to_device(optimizer, self.root_device)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if "pipeline_parallel" in state:
                saved = state["pipeline_parallel"]
                if list(saved["layout"]) != list(self.topology.shape):
                    raise ValueError(
                        f"The checkpoint's optimizer states were saved under the layout (pp, dp, tp) = "
                        f"{tuple(saved['layout'])}; this run has {self.topology.shape}. Resume with the same "
                        f"sizes, or load only the weights (`Module.load_from_checkpoint`) and start a new fit."
                    )
                state = saved["ranks"][self.global_rank]
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)


def _check_options(*, pipeline_parallel_size, data_parallel_size, microbatches, schedule, stages_per_rank,
                   blocks, balance, start_method, timeout) -> None:
    """Reject bad arguments at construction, before any process starts."""
    for name, value in (("pipeline_parallel_size", pipeline_parallel_size), ("data_parallel_size", data_parallel_size)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}={value!r}` must be a positive integer or 'auto'.")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise ValueError(f"`microbatches={microbatches!r}` must be a positive integer or None (2 × pipeline size).")
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule={schedule!r}` is not a pipeline schedule; choose one of {SCHEDULES}.")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"`stages_per_rank={stages_per_rank!r}` must be a positive integer.")
    if schedule == "interleaved_1f1b" and stages_per_rank < 2:
        raise ValueError(
            f"`schedule='interleaved_1f1b'` needs `stages_per_rank` >= 2 (got {stages_per_rank}): it interleaves "
            f"several virtual stages per rank. Use stages_per_rank=2 or schedule='1f1b'."
        )
    if schedule != "interleaved_1f1b" and stages_per_rank != 1:
        raise ValueError(
            f"`stages_per_rank={stages_per_rank}` needs `schedule='interleaved_1f1b'`; `{schedule}` runs one stage per rank."
        )
    if blocks is not None and (not isinstance(blocks, str) or not blocks):
        raise ValueError(f"`blocks={blocks!r}` must be the dotted name of the block container, e.g. 'model.layers'.")
    if isinstance(balance, str):
        if balance not in BALANCES:
            raise ValueError(f"`balance={balance!r}` must be one of {BALANCES} or a list of blocks per stage.")
    elif not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in balance):
        raise ValueError(f"`balance={list(balance)!r}` must list positive block counts, one per stage.")
    if start_method not in _START_METHODS:
        raise ValueError(f"`start_method={start_method!r}` must be one of {_START_METHODS}.")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(f"`timeout={timeout!r}` must be a finite positive number of seconds (or a timedelta).")


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "Under pipeline parallelism `training_step` must return the loss tensor (or a dict with 'loss') for "
            f"every micro-batch; got {type(output).__name__}. Skipping a batch by returning None is not supported."
        )
    return loss


def _detach(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, dict):
        return {k: _detach(v) for k, v in output.items()}
    return output


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _base_seed() -> int:
    import os

    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class _rng_fork:
    """Save the RNG state before a seeded pipeline step and restore it after (the user's stream stays put)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled

    def __enter__(self):
        if self.enabled:
            self.cpu = torch.get_rng_state()
            self.cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def __exit__(self, *exc):
        if self.enabled:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)


__all__ = ["PipelineParallelStrategy"]
