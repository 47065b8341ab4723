"""One pipeline stage of an unchanged module, by block interception.

Every rank keeps the whole LightningModule and runs the user's own ``training_step`` for each
micro-batch. The blocks of other stages are replaced by parameter-free :class:`Ghost` modules (so the
names of this stage's parameters do not change). Hooks on this stage's blocks do the pipelining:

- on every stage but the first, the ghost of the previous stage's last block returns what that block
  returned there: the hidden state received from the previous stage (a leaf that requires grad) and the
  outputs later blocks take ([Note: block flow] in flow.py), so the user's code hands them to this
  stage's first block as it would on one device; the other arguments (masks, rotary tables, position
  ids) were computed locally by the user's code, since every stage of a pipeline sees the same batch;
- the last block (on every stage but the last) sends its hidden state (and those outputs) on and raises
  :class:`StopStage`, which ends the user's step there (a ``BaseException``, so a user's
  ``except Exception`` cannot swallow it);
- every block reseeds the RNG from (step, micro-batch, block index) when ``seeded``, so dropout masks
  do not depend on the layout or the schedule.

Backward of a micro-batch: the last stage backpropagates its weighted loss; the others backpropagate
what they sent with the gradients received from the next stage; all but the first then send their
inputs' gradients back.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
from torch import nn

from lightning_par import patches
from lightning_par.pipeline import p2p, split_backward
from lightning_par.pipeline.flow import BlockFlow, hidden_name, no_mha_fastpath
from lightning_par.pipeline.ghost import Ghost, shadow_of  # noqa: F401  (shadow_of: re-exported)
from lightning_par.saved import SavedTensorMeter


class StopStage(BaseException):
    """Raised after the last block of a stage that is not the pipeline's last: the rest of the step runs elsewhere."""


class StageRuntime:
    """Installs this rank's stage into ``container`` and runs micro-batches through it.

    ``chunks`` lists the rank's virtual stages as ``(virtual index, lo, hi)`` block ranges, one for the
    GPipe / 1F1B schedules, several for interleaved 1F1B; ``ranks[k]`` is the global rank that runs virtual
    stage ``k`` (of ``len(ranks)``). With several chunks only the active chunk's blocks compute: the others
    pass their input through like ghosts (see [Note: gated chunks]).
    """

    def __init__(self, *, container: nn.Module, chunks: list[tuple[int, int, int]], ranks: list[int],
                 device: torch.device, seed: int = 0, groups: tuple = (None, None, None, None),
                 flow: BlockFlow | None = None, boundary: Any = None):
        self.container, self.chunks, self.ranks = container, list(chunks), list(ranks)
        # a tensor-parallel stage's codec of what crosses a boundary (``outgoing`` / ``incoming``: see
        # [Note: sequence-sharded stage boundaries] in tensor/boundary.py); None: tensors travel as they are
        self.boundary = boundary
        # what blocks return and which outputs travel with the hidden state ([Note: block flow]); without a
        # traced step, a probe learns the arity at the first ghost and only the hidden state travels
        self.flow = flow
        self.carried = flow.carried if flow is not None else ()
        # process groups: activations, gradients, each of them once more for transfers to a lower rank
        # (interleaved chunks wrap around the ring), see [Note: one direction per group] in p2p.py
        self._groups = dict(zip([("act", True), ("grad", False), ("act", False), ("grad", True)], groups))
        self.num_virtual = len(ranks)
        self.device, self.seed = device, seed
        self.seeded = False
        self.step = 0
        self.current = 0
        self.active = 0  # index into self.chunks
        # [Note: hooks act inside a stage forward] the blocks' hooks act only while :meth:`forward` runs the
        # user's step: a copy of a block (the tensor-parallel region probe deep-copies a block that is itself a
        # region, hooks included) runs as the block alone, without receiving, sending or reseeding
        self.running = False
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # received floating entries (grad leaves)
        self.outputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # sent floating entries
        self._received: dict[tuple[int, int], torch.Tensor] = {}  # hidden states a ghost has taken for its block
        self.works: list = []
        self._ghost_tuple_len: int | None = None
        self._hidden_name: str | None = None
        self._handles: list = []
        self.wait_s = 0.0  # seconds spent blocked in receives (the bubble plus transfer time)
        self.busy_s = 0.0  # seconds in forwards and backwards, receives excluded (the stage's compute)
        self.meter: SavedTensorMeter | None = None  # activations alive, when a benchmark asks
        self.weights: list[torch.nn.Parameter] = []  # this rank's trainable parameters (zero bubble's W)
        self._deferred: dict = {}
        # [Note: receive plan] this step's receives in the order the schedule takes them, and the one posted
        self._act_plan = p2p.ReceivePlan()
        self._grad_plan = p2p.ReceivePlan()
        self._last_sent: tuple | None = None  # (shape, dtype) of this step's last activation sent ...
        self._last_received: tuple | None = None  # ... and received, and of the previous step's first ones:
        self._first_sent: tuple | None = None  # what a posted receive is shaped like ([Note: speculative receive])
        self._first_received: tuple | None = None

    # -- layout ------------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first virtual stage (the code before the blocks counts there)."""
        return self.chunks[0][0] == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last virtual stage (the head and the loss)."""
        return self.chunks[-1][0] == self.num_virtual - 1

    @property
    def lo(self) -> int:
        return self.chunks[0][1]

    def _virtual(self, chunk: int) -> int:
        return self.chunks[chunk][0]

    def _group(self, kind: str, src: int, dst: int):
        """The process group of a ``kind`` transfer from virtual stage ``src`` to ``dst``."""
        return self._groups[(kind, self.ranks[dst] > self.ranks[src])]

    def _tag(self, kind: int, virtual: int, microbatch: int) -> int:
        # one tag per transfer of a step: out-of-order arrivals between two ranks cannot be confused
        return (kind * self.num_virtual + virtual) * 4096 + microbatch % 4096

    # -- installation -----------------------------------------------------------------------------
    def install(self) -> None:
        self._hidden_name = hidden_name(self.container[self.lo])
        chunk_of = {i: c for c, (_, lo, hi) in enumerate(self.chunks) for i in range(lo, hi)}
        for i in range(len(self.container)):
            if i not in chunk_of:
                self.container[i] = Ghost(self, i, shadow_of(self.container[i]))
        for i, c in chunk_of.items():
            block = self.container[i]
            self._handles.append(
                block.register_forward_pre_hook(lambda m, a, k, i=i, c=c: self._pre_block(i, c, a, k), with_kwargs=True)
            )
            if len(self.chunks) > 1:
                # [Note: gated chunks] with several chunks on a rank, a block of an inactive chunk must not
                # compute (its output would be discarded): an instance-level `forward` passes through instead,
                # which keeps the module, its parameter names and its hooks in place.
                block.forward = self._gate(c, i, block.forward)
                patches.record("gated-block-forward", None)  # lives as long as the pipelined model
        self._register_sends()

    def _register_sends(self) -> None:
        self._sends = [self.container[hi - 1].register_forward_hook(
            lambda m, a, out, c=c: self._post_last_block(c, out))
            for c, (k, lo, hi) in enumerate(self.chunks) if k < self.num_virtual - 1]

    def send_last(self) -> None:
        """Register again the hooks that send a chunk's output on (and raise :class:`StopStage`), so that they run
        after every forward hook registered since (context parallelism's gather, which must see the output of
        the tensor-parallel region hooks too)."""
        for handle in self._sends:
            handle.remove()
        self._register_sends()

    def _gate(self, chunk: int, index: int, forward: Callable) -> Callable:
        def gated(*args: Any, **kwargs: Any) -> Any:
            # outside a stage forward the block computes: activation checkpointing recomputes it in backward,
            # while another chunk may be the active one
            if self.running and chunk != self.active:
                return self.ghost_output(args, kwargs, index)
            return forward(*args, **kwargs)
        return gated

    # -- hooks ------------------------------------------------------------------------------------
    def _pre_block(self, index: int, chunk: int, args: tuple, kwargs: dict):
        if chunk != self.active or not self.running:  # [Note: hooks act inside a stage forward]
            return None
        if self.seeded:
            self._reseed(index)
        k, lo, _ = self.chunks[chunk]
        if index != lo or k == 0:
            return None
        if self._received.pop((chunk, self.current), None) is not None:
            return None  # the ghost before this block took the activation and the user's code passed it here
        # untraced (no step at setup): no ghost took it; the block's hidden-state argument is replaced
        return self._replace_hidden(args, kwargs, self._receive(chunk)[0])

    def _receive(self, chunk: int) -> list:
        """The bundle from the previous stage for the active micro-batch through ``chunk``: the hidden state,
        then the carried outputs ([Note: bundles] in p2p.py); floating entries become leaves that require grad."""
        k = self._virtual(chunk)
        t0 = time.perf_counter()
        bundle = p2p.recv_bundle(self.ranks[k - 1], self.device, 1 + len(self.carried),
                                 tag=self._tag(0, k, self.current), group=self._group("act", k - 1, k),
                                 posted=self._act_plan.take((chunk, self.current)))
        like = tuple(p2p.like_of(t) for t in bundle)
        if self._last_received is None:
            self._first_received = like
        self._last_received = like
        self._post_next_activation()
        self.wait_s += time.perf_counter() - t0
        floating = [t for t in bundle if t is not None and t.is_floating_point()]
        if torch.is_grad_enabled() and floating:
            for t in floating:
                t.requires_grad_(True)
            self.inputs[(chunk, self.current)] = floating
        return self.boundary.incoming(bundle) if self.boundary is not None else bundle

    def _post_last_block(self, chunk: int, output: Any):
        if chunk != self.active or not self.running:  # [Note: hooks act inside a stage forward]
            return None
        k = self._virtual(chunk)
        if isinstance(output, (tuple, list)):
            bundle = [output[0]] + [output[e] if e < len(output) else None for e in self.carried]
        else:
            bundle = [output] + [None] * len(self.carried)
        if self.boundary is not None:
            bundle = self.boundary.outgoing(bundle)
        floating = [t for t in bundle if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if torch.is_grad_enabled() and floating:  # the next stage sends a gradient for each of them
            self.outputs[(chunk, self.current)] = floating
        # what the next stage has posted for this activation ([Note: speculative receive]): shaped like the
        # previous one on this channel, this step's or (for the step's first) the previous step's first
        sent = tuple(p2p.like_of(t) for t in bundle)
        if self._last_sent is None:
            posted_like, self._first_sent = self._first_sent, sent
        else:
            posted_like = self._last_sent
        self._last_sent = sent
        p2p.send_bundle(bundle, self.ranks[k + 1], self.works, tag=self._tag(0, k + 1, self.current),
                        group=self._group("act", k, k + 1), posted_like=posted_like)
        self._post_next_gradient()  # this activation's gradient may be the next one backward waits for
        raise StopStage()

    def ghost_output(self, args: tuple, kwargs: dict, index: int) -> Any:
        """What the ghost (or gated block) of block ``index`` returns: its hidden-state argument passed
        through, or, standing in for the previous stage's last block, what that block returned there."""
        k, lo, _ = self.chunks[self.active]
        arity = self._arity(index, args, kwargs)
        if index == lo - 1 and k > 0:
            bundle = self._receive(self.active)
            self._received[(self.active, self.current)] = bundle[0]
            if arity == 0:
                return bundle[0]
            out = [bundle[0]] + [None] * (arity - 1)
            for e, value in zip(self.carried, bundle[1:]):
                out[e] = value
            return tuple(out)
        hidden = self._hidden(args, kwargs)
        return hidden if arity == 0 else (hidden,) + (None,) * (arity - 1)

    def _arity(self, index: int, args: tuple, kwargs: dict) -> int:
        if self.flow is not None:
            return self.flow.arity[min(index, len(self.flow.arity) - 1)]
        if self._ghost_tuple_len is None:
            self._ghost_tuple_len = self._probe_output_arity(args, kwargs)
        return self._ghost_tuple_len

    def _probe_output_arity(self, args: tuple, kwargs: dict) -> int:
        # [Note: ghost outputs] Code between blocks may index the block's output (`x = block(x)[0]`). A ghost
        # must then return a tuple too: run this rank's first block once (no grad, hooks and gate bypassed)
        # on the ghost's input to learn whether blocks return a tensor (0) or a tuple of some length. The
        # probe gets copies of the non-tensor arguments: a block may update them (a Hugging Face KV cache
        # appends this layer's keys), and the real call must not find the probe's entries there.
        block = self.container[self.lo]
        args, kwargs = _copy_objects(args), _copy_objects(kwargs)
        try:
            with torch.no_grad():
                out = type(block).forward(block, *args, **kwargs)
        except Exception:
            return 0
        return len(out) if isinstance(out, (tuple, list)) else 0

    def _hidden(self, args: tuple, kwargs: dict) -> Any:
        if args:
            return args[0]
        return kwargs.get(self._hidden_name)

    def _replace_hidden(self, args: tuple, kwargs: dict, x: torch.Tensor):
        if args:
            return (x,) + tuple(args[1:]), kwargs
        return args, {**kwargs, self._hidden_name: x}

    def _reseed(self, index: int) -> None:
        # Only the generators this stage draws from: `torch.manual_seed` also queues a lazy seeding of every
        # CUDA device, recording a Python stack each time (~2 ms a call; 5 calls per block per step).
        seed = (self.seed * 1_000_003 + self.step * 10_007 + self.current * 101 + index + 1) % (2**63)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index if self.device.index is not None
                                          else torch.cuda.current_device()].manual_seed(seed)

    # -- running micro-batches --------------------------------------------------------------------
    def begin_step(self, actions: list[tuple[str, int, int]]) -> None:
        """Start a step that runs ``actions`` (``(kind, chunk, micro-batch)``; kinds "F", "B", "W") and post
        its first receive (see [Note: receive plan])."""
        last = self.num_virtual - 1
        self._act_plan.begin([(c, i) for kind, c, i in actions if kind == "F" and self._virtual(c) > 0])
        self._grad_plan.begin([(c, i) for kind, c, i in actions if kind == "B" and self._virtual(c) < last])
        self._post_next_activation()

    def _post_next_activation(self) -> None:
        key = self._act_plan.due()
        if key is not None:
            k = self._virtual(key[0])
            like = self._last_received if self._last_received is not None else self._first_received
            self._act_plan.posted(key, p2p.post_recv_bundle(self.ranks[k - 1], self.device, 1 + len(self.carried),
                                                            like=like, tag=self._tag(0, k, key[1]),
                                                            group=self._group("act", k - 1, k)))

    def _post_next_gradient(self) -> None:
        key = self._grad_plan.due()
        if key is not None and key in self.outputs:  # its forward has run (the gradient's shape is known)
            k = self._virtual(key[0])
            posted = p2p.post_recv_grads(self.outputs[key], self.ranks[k + 1], tag=self._tag(1, k, key[1]),
                                         group=self._group("grad", k + 1, k))
            self._grad_plan.posted(key, posted)

    def forward(self, microbatch: int, fn: Callable[[], Any], chunk: int = 0) -> Any:
        """Run the user's step for one micro-batch through ``chunk``; its output on the last virtual stage,
        ``None`` elsewhere."""
        self.current, self.active = microbatch, chunk
        if self.seeded:
            self._reseed(-1)
        t0, w0 = time.perf_counter(), self.wait_s
        self.running = True
        try:
            with no_mha_fastpath():
                if self.meter is not None and torch.is_grad_enabled():
                    with self.meter.track((chunk, microbatch)):
                        out = fn()
                else:
                    out = fn()
        except StopStage:
            return None
        finally:
            self.running = False
            self.busy_s += time.perf_counter() - t0 - (self.wait_s - w0)
        if self._virtual(chunk) != self.num_virtual - 1:
            raise RuntimeError(
                f"Pipeline stage {self._virtual(chunk)} finished the step without calling its last block "
                f"({self.chunks[chunk][2] - 1}); every micro-batch must run through the whole block stack."
            )
        return out

    def backward(self, microbatch: int, loss: torch.Tensor | None = None, chunk: int = 0) -> None:
        """Backpropagate one micro-batch through ``chunk`` (``loss``: the last virtual stage's weighted loss)."""
        t0, w0 = time.perf_counter(), self.wait_s
        k = self._virtual(chunk)
        if k == self.num_virtual - 1:
            torch.autograd.backward(loss)
        else:
            outs = self.outputs.pop((chunk, microbatch))
            t1 = time.perf_counter()
            grads = self._recv_grad(outs, k, chunk, microbatch)
            self.wait_s += time.perf_counter() - t1
            _backprop(outs, grads)
        if k > 0:
            self._send_input_grads(chunk, microbatch, self.inputs.pop((chunk, microbatch)))
        self.busy_s += time.perf_counter() - t0 - (self.wait_s - w0)

    def backward_input(self, microbatch: int, loss: torch.Tensor | None = None, chunk: int = 0) -> None:
        """Zero bubble's "B": the gradient of the stage input only, sent upstream at once; what the weight
        gradients need is kept for :meth:`backward_weight` (see [Note: split backward])."""
        t0, w0 = time.perf_counter(), self.wait_s
        k = self._virtual(chunk)
        if k == self.num_virtual - 1:
            outs, grads = [loss], None
        else:
            outs = self.outputs.pop((chunk, microbatch))
            t1 = time.perf_counter()
            grads = self._recv_grad(outs, k, chunk, microbatch)
            self.wait_s += time.perf_counter() - t1
        if k == 0:  # nothing upstream waits: all of the backward runs in W
            self._deferred[(chunk, microbatch)] = ("full", outs, grads)
        else:
            xs = self.inputs.pop((chunk, microbatch))
            groups = split_backward.backward_input(outs, grads, xs, self.weights)
            self._send_input_grads(chunk, microbatch, xs)
            self._deferred[(chunk, microbatch)] = ("weights", groups, None)
        self.busy_s += time.perf_counter() - t0 - (self.wait_s - w0)

    def backward_weight(self, microbatch: int, chunk: int = 0) -> None:
        """Zero bubble's "W": the weight gradients of a micro-batch whose "B" has run."""
        t0 = time.perf_counter()
        kind, a, b = self._deferred.pop((chunk, microbatch))
        if kind == "full":
            _backprop(a, b)
        else:
            split_backward.backward_weight(self.weights, a)
        self.busy_s += time.perf_counter() - t0

    def gradient_arrived(self, microbatch: int, chunk: int = 0) -> bool:
        """Whether the output gradient ``backward`` of this micro-batch needs is here already (always on the
        last virtual stage, which starts from the loss)."""
        if self._virtual(chunk) == self.num_virtual - 1:
            return True
        self._post_next_gradient()
        posted = self._grad_plan.peek()
        return posted is not None and posted[0] == (chunk, microbatch) and posted[1][0].is_completed()

    def _send_input_grads(self, chunk: int, microbatch: int, xs: list[torch.Tensor]) -> None:
        k = self._virtual(chunk)
        p2p.send_grads([x.grad if x.grad is not None else torch.zeros_like(x) for x in xs], self.ranks[k - 1],
                       self.works, tag=self._tag(1, k - 1, microbatch), group=self._group("grad", k, k - 1))

    def _recv_grad(self, outs: list[torch.Tensor], k: int, chunk: int, microbatch: int) -> list[torch.Tensor]:
        self._post_next_gradient()
        posted = self._grad_plan.take((chunk, microbatch))
        if posted is None:  # not in this step's plan (cannot happen with the schedules here): receive now
            return p2p.recv_grads(outs, self.ranks[k + 1], tag=self._tag(1, k, microbatch),
                                  group=self._group("grad", k + 1, k))
        work, grads = posted
        p2p.wait_grads(work, self.ranks[k + 1])
        self._post_next_gradient()
        return grads

    def finish(self) -> None:
        """Wait for this step's sends and drop what the step kept."""
        self._last_sent = self._last_received = None
        left = self._act_plan.left() + self._grad_plan.left()
        if left:  # every planned receive is taken; one left over is a schedule bug
            raise RuntimeError(f"pipeline stage {self._virtual(0)}: planned receives {left} (chunk, micro-batch) "
                               f"were never taken.")
        p2p.wait_all(self.works)
        self.inputs.clear()
        self.outputs.clear()
        self._received.clear()
        self._deferred.clear()


def _backprop(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Backpropagate the sent entries that autograd reaches (a carried tensor may be a constant)."""
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _copy_objects(obj: Any) -> Any:
    """``obj`` with every object that is not a tensor, a number, a string or a container of those deep-copied
    (left as it is when it cannot be copied); tensors are shared."""
    if obj is None or isinstance(obj, (torch.Tensor, int, float, bool, str, torch.dtype, torch.device)):
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_objects(o) for o in obj)
    if isinstance(obj, list):
        return [_copy_objects(o) for o in obj]
    if type(obj) is dict:
        return {k: _copy_objects(v) for k, v in obj.items()}
    try:
        return copy.deepcopy(obj)
    except Exception:
        return obj
