"""What the advisor knows about a module: parameter counts by region and activation bytes, measured.

Activations are measured, not guessed: one forward + backward of the real module on a micro-batch,
counting every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
attributed to the block that was running when it was saved. Parameters and tensors saved twice are
counted once (by storage). The result scales linearly with the micro-batch, which is what the memory
model assumes.

For activation checkpointing the probe also measures, per block, the bytes of the block's input (what full
checkpointing keeps) and of the outputs of the matmuls and attention kernels (what selective checkpointing keeps,
``SAVED_OPS`` of :mod:`lightning_par.memory.checkpointing`), and times the step a second time: the blocks' forward
against forward + backward (the recompute of full checkpointing) and, inside the blocks, the time of the ops
selective checkpointing recomputes (everything but those kernels).
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from lightning_par.saved import SavedTensorMeter, saved_storage


@dataclass(frozen=True)
class ModuleProfile:
    """Per-sample activation bytes and parameter counts of one module, measured on a micro-batch."""

    total_params: int                # unique parameters (tied weights once)
    block_params: tuple[int, ...]    # parameters of each block of the repeated stack, in order
    first_params: int                # parameters used before the blocks (embeddings)
    last_params: int                 # parameters used after the blocks (final norm, head) not already first
    tied_params: int                 # parameters shared by the first and the last part (a tied lm head)
    shardable_block_params: int      # parameters of the nn.Linear layers inside the blocks (tensor-parallel)
    block_activation_bytes: tuple[int, ...]  # bytes saved for backward per sample, per block
    first_activation_bytes: int      # bytes saved per sample before the blocks (embeddings)
    last_activation_bytes: int       # bytes saved per sample after the blocks (final norm, logits, loss)
    hidden_size: int                 # last dim of a block's input
    seq_len: int                     # second dim of a block's input (1 if 2-D)
    num_heads: int | None            # from the first block (n_head / num_heads / num_attention_heads)
    dtype_bytes: int                 # bytes per element of the measured activations' dominant dtype
    block_input_bytes: int = 0       # bytes of one block's input per sample (0: seq_len × hidden × dtype_bytes)
    selective_bytes: tuple[int, ...] = ()  # bytes per sample of each block's matmul / attention outputs
    step_s_per_sample: float = 0.0   # seconds of forward + backward per sample (0: not timed)
    block_forward_s_per_sample: float = 0.0  # seconds of the blocks' forward per sample
    selective_recompute_share: float = 0.0   # share of the blocks' forward time outside the kept ops
    block_kv_bytes: tuple[int, ...] = ()  # bytes per sample of the K and V each block hands SDPA ([Note: what
    kv_dtype_bytes: int = 0               # the probe sees of attention]), and their element size (0: no SDPA)
    block_attention_bytes: tuple[int, ...] = ()  # bytes per sample of each block's SDPA outputs
    block_whole_bytes: tuple[int, ...] = ()  # of block_activation_bytes, what a tensor-parallel rank holds whole
    # without sequence parallelism ([Note: what tensor parallelism leaves whole]); () : not measured
    block_whole_sp_bytes: tuple[int, ...] = ()  # what a rank holds whole with sequence parallelism: the
    # column-parallel layers' gathered inputs, and what does not come from the block's input
    head_largest_bytes: int = 0  # the largest single tensor saved after the blocks, per sample (a language model's
    # log-softmax of the logits): what the loss's backward makes once more beside them; 0: take all of last
    block_attention_io_bytes: tuple[int, ...] = ()  # bytes per sample of the q, k, v and output of each block's
    # attention calls, SDPA or Hugging Face's attention interface (what Ulysses's all-to-alls carry)
    block_interface_calls: tuple[int, ...] = ()  # calls through Hugging Face's attention interface per block
    block_expert_params: tuple[int, ...] = ()  # of block_params, the routed experts' (lightning_par.experts finds
    # them); () : no MoE layer ([Note: the advisor under expert parallelism] in advisor/memory.py)
    expert_linear_params: int = 0  # of shardable_block_params, the routed experts' (a per-expert list's linears)
    num_experts: int = 0  # the fewest routed experts of an MoE layer (expert_parallel_size must divide it)
    expert_top_k: int = 0  # experts each token goes to (num_experts_per_tok / top_k where the module says; else 1)

    @property
    def n_blocks(self) -> int:
        return len(self.block_params)

    @property
    def moe_blocks(self) -> int:
        """Blocks holding routed experts (0: not a mixture-of-experts module)."""
        return sum(1 for n in self.block_expert_params if n)

    @property
    def sdpa_blocks(self) -> bool:
        """Whether every block called ``scaled_dot_product_attention`` (what context parallelism routes)."""
        return bool(self.block_kv_bytes) and len(self.block_kv_bytes) == self.n_blocks and all(self.block_kv_bytes)

    @property
    def context_methods(self) -> tuple[str, ...]:
        """The context-parallel methods that serve every block's attention, as the strategy's setup check decides
        ([Note: the setup check of context parallelism]): all three where every block calls SDPA, Ulysses alone
        where every block's attention goes through Hugging Face's attention interface (eager, soft-capped, ...)."""
        if self.sdpa_blocks:
            return ("ring", "allgather", "ulysses")
        calls = self.block_interface_calls
        if calls and len(calls) == self.n_blocks and all(calls):
            return ("ulysses",)
        return ()

    @property
    def activation_bytes_per_sample(self) -> int:
        return sum(self.block_activation_bytes) + self.first_activation_bytes + self.last_activation_bytes


# [Note: what selective checkpointing keeps]
# The strategies' selective checkpointing (:mod:`lightning_par.memory.checkpointing`, as torchtitan's op-level
# one) saves the outputs of the expensive ops, the matmuls, the fused attention kernels and the reducing
# collectives (its ``SAVED_OPS``), and recomputes the rest (layer norms, activations, dropout, adds) in backward.
# The probe counts those same ops' output bytes inside each block (a dispatch mode sees the aten ops below
# autograd, where ``nn.Linear`` is an ``addmm`` / ``mm``), which is what the policy caches, whether or not
# autograd would have saved them.
#
# [Note: what tensor parallelism leaves whole]
# Without sequence parallelism a tensor-parallel rank holds some of a block's saved tensors whole and the rest
# 1/t: Megatron's column-parallel layers read a whole input and write a shard, the row-parallel ones read a shard
# and write (after their all-reduce) a whole output. The same dispatch mode follows that through each block: a
# matmul with a weight (a parameter operand) whose activation operand is whole writes a shard, one whose operand
# is a shard writes a whole tensor; any other op writes a shard if it reads one. The block's input is whole. So
# the norms, their outputs (what the column-parallel layers save), residual dropout masks and adds are whole, and
# q, k, v, attention, the MLP's hidden and its activation are shards, whatever the module calls them. The
# advisor counts the whole bytes once and the rest / t (:func:`~lightning_par.advisor.memory.tp_block_bytes`),
# where Korthikanti et al.'s (10 + 24/t) / 34 assumes their block's 16-bit mix (2 dropout masks, 5as/h scores):
# the reference GPT in fp32 keeps 4 of its 16 s·h elements whole, (4 + 12/t) / 16 = 0.625 at t = 2 against 0.647.
# With sequence parallelism the whole tensors run on sequence shards, 1/t, except what a column-parallel layer
# reads: its input is all-gathered first, and the layer saves the gathered, whole tensor (DTensor keeps no shard
# to gather again in backward, as Megatron does; Korthikanti et al.'s 34/t assumes it), and what does not come
# from the block's input (a rotary table, a mask handed in: replicated). The probe marks those inputs
# (``gathered``) and what comes from the block's input (``stream``): a rank keeps the gathered inputs and what is
# neither whole, the rest / t. The GPT in fp32 keeps its two norms' outputs whole, (2 + 14/t) / 16 = 0.5625 at
# t = 2 where 34/t gives 0.5 (measured on a rank: equal, byte for byte).
_WEIGHT_OPS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")


def _op_ledger(params: set):
    """A dispatch mode that adds up, per :attr:`tag`, the output bytes of the ops selective checkpointing keeps
    and the seconds spent in them and in every other op, and marks the storages a tensor-parallel rank would
    hold a shard of (``sharded``, [Note: what tensor parallelism leaves whole]), the whole inputs of column-
    parallel layers (``gathered``) and what comes from the block's input (``stream``); ``params``: the
    parameters' storage keys."""
    from lightning_par._compat import torch_dispatch_mode, tree_flatten
    from lightning_par.memory.checkpointing import SAVED_OPS

    weight_ops = {op for op in SAVED_OPS if str(op) in _WEIGHT_OPS}

    class OpLedger(torch_dispatch_mode()):
        def __init__(self):
            super().__init__()
            self.tag = None
            self.saved: dict = {}
            self.sharded: set = set()
            self.gathered: set = set()
            self.stream: set = set()
            self.seconds = {"kept": 0.0, "other": 0.0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            kept = func in SAVED_OPS
            self.seconds["kept" if kept else "other"] += time.perf_counter() - t0
            if self.tag is None:
                return out
            keys = [k[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                    and (k := saved_storage(a)) is not None]
            shard = any(k in self.sharded for k in keys if k not in params)
            stream = any(k in self.stream for k in keys if k not in params)
            if func in weight_ops and any(k in params for k in keys):
                if not shard:  # column-parallel: reads a whole (under sequence parallel, gathered) input
                    self.gathered.update(k for k in keys if k not in params)
                shard = not shard  # column-parallel writes a shard, row-parallel a whole tensor
            seen = set()
            for t in tree_flatten(out)[0]:
                found = saved_storage(t) if isinstance(t, torch.Tensor) else None
                if found is None or found[0] in seen:
                    continue
                seen.add(found[0])
                if found[0] not in keys:  # a new storage: a freed tensor's address may come back as another's
                    for marks in (self.sharded, self.gathered, self.stream):
                        marks.discard(found[0])
                if shard:
                    self.sharded.add(found[0])
                if stream:
                    self.stream.add(found[0])
                if kept:
                    self.saved[self.tag] = self.saved.get(self.tag, 0) + found[1]
            return out

    return OpLedger()


# [Note: what the probe sees of attention]
# Context parallelism routes the blocks' ``F.scaled_dot_product_attention`` calls across the group and passes each
# rank's K and V around it (:mod:`lightning_par.context.attention`), so its bytes are K's and V's sizes: a
# ``TorchFunctionMode`` active while a block runs adds up the bytes of the ``key`` and ``value`` of every SDPA call
# (their shapes carry the k/v head count and head dim, grouped-query attention included) and their element size
# (the dtype training runs attention in: autocast's under a mixed precision), and the bytes of its outputs (what
# the ring's output costs, [Note: the advisor under context parallelism]). A block without such a call (eager
# attention) records 0: the advisor proposes cp for it with Ulysses where its attention goes through Hugging Face's
# attention interface (below), and no cp layout otherwise.
def _sdpa_ledger():
    """A function mode that adds up, per :attr:`tag`, the bytes of the keys and values handed to SDPA."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class SdpaLedger(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.tag = None
            self.kv: dict = {}
            self.out: dict = {}
            self.io: dict = {}  # q, k, v and output bytes, SDPA or the attention interface
            self.interface: dict = {}  # calls through Hugging Face's attention interface
            self.elem = 0
            self.calls = 0

        def add_io(self, *tensors):
            if self.tag is not None:
                self.io[self.tag] = self.io.get(self.tag, 0) + sum(t.numel() * t.element_size() for t in tensors)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and self.tag is not None:
                named = dict(zip(("query", "key", "value"), args), **kwargs)
                k, v = named["key"], named["value"]
                nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
                self.kv[self.tag] = self.kv.get(self.tag, 0) + nbytes
                self.elem = k.element_size()
                out = func(*args, **kwargs)
                self.out[self.tag] = self.out.get(self.tag, 0) + out.numel() * out.element_size()
                self.add_io(named["query"], k, v, out)
                self.calls += 1
                return out
            return func(*args, **kwargs)

    return SdpaLedger()


# The attention interface's side of the same ledger: while the probe runs, the Hugging Face attention modules of
# the blocks (:func:`lightning_par.context.probe.hf_attention_modules`) name an implementation registered here,
# which calls theirs and counts the call and its q, k, v and output bytes (where their implementation calls SDPA,
# the SDPA side counts the bytes once). Ulysses serves such a block ([Note: Ulysses]); its all-to-alls carry those
# bytes.
_INTERFACE = "lightning_par_advisor_probe"
_LEDGERS: list = []  # (ledger, {id(config): its own implementation}) of the probe running, innermost last


def _interface_probe(module, query, key, value, attention_mask, **kwargs):
    from lightning_par._compat import hf_attention_function

    ledger, originals = _LEDGERS[-1]
    before = ledger.calls
    out = hf_attention_function(module, originals[id(module.config)])(module, query, key, value, attention_mask,
                                                                       **kwargs)
    if ledger.tag is not None:
        ledger.interface[ledger.tag] = ledger.interface.get(ledger.tag, 0) + 1
        if ledger.calls == before:  # not through SDPA: count its bytes here
            ledger.add_io(query, key, value, out[0] if isinstance(out, tuple) else out)
    return out


def _route_interface(stack: ExitStack, blocks: list[nn.Module], ledger) -> None:
    """Point the blocks' Hugging Face attention modules at :func:`_interface_probe` until ``stack`` closes."""
    from lightning_par.context.probe import hf_attention_configs, hf_attention_through

    configs = hf_attention_configs(blocks)
    if configs:
        _LEDGERS.append((ledger, stack.enter_context(hf_attention_through(configs, _INTERFACE, _interface_probe))))
        stack.callback(_LEDGERS.pop)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _num_heads(block: nn.Module) -> int | None:
    """The attention head count of the first module of ``block`` that stores one (the plan's own reading:
    :func:`lightning_par.tensor.layers.query_heads`)."""
    from lightning_par.tensor.layers import query_heads

    return next((n for n in map(query_heads, block.modules()) if n is not None), None)


def measure(module: nn.Module, blocks: nn.ModuleList | nn.Sequential, run_step, batch_size: int) -> ModuleProfile:
    """Profile ``module`` by calling ``run_step()`` once: it must run forward on a micro-batch of
    ``batch_size`` samples and return the loss (the advisor calls ``backward`` on it).

    ``blocks`` is the repeated block container inside ``module`` (the one a pipeline would split).
    """
    block_list = list(blocks)
    block_ids = {id(p) for b in block_list for p in b.parameters()}
    meter = SavedTensorMeter(module.parameters(), keep_keys=True)  # tagged: a block's index, or "before" / "after"
    meter.tag = "before"
    first_ids: set[int] = set()
    last_ids: set[int] = set()
    input_shape: list[torch.Size] = []
    input_bytes: list[int] = []
    ledger = _op_ledger(meter.params)
    attention = _sdpa_ledger()

    def leaf_hook(mod, args):
        if meter.tag in ("before", "after"):
            target = last_ids if meter.tag == "after" else first_ids
            target.update(id(p) for p in mod.parameters(recurse=False))

    def enter(i):
        def hook(mod, args):
            meter.tag = ledger.tag = attention.tag = i
            if args and isinstance(args[0], torch.Tensor) and (found := saved_storage(args[0])) is not None:
                ledger.sharded.discard(found[0])  # a block's input is whole (a sequence shard under SP)
                ledger.stream.add(found[0])
            if i == 0 and args and isinstance(args[0], torch.Tensor):
                input_shape.append(args[0].shape)
                input_bytes.append(args[0].numel() * args[0].element_size())
            attention.__enter__()
            ledger.__enter__()
        return hook

    def leave(i):
        def hook(mod, args, out):
            ledger.__exit__(None, None, None)
            attention.__exit__(None, None, None)
            ledger.tag = attention.tag = None
            meter.tag = "after" if i == len(block_list) - 1 else "before"  # code between blocks counts before
        return hook

    with ExitStack() as stack:
        for i, b in enumerate(block_list):
            stack.callback(b.register_forward_pre_hook(enter(i)).remove)
            stack.callback(b.register_forward_hook(leave(i)).remove)
        for m in module.modules():
            if not any(True for _ in m.children()) and not any(id(p) in block_ids for p in m.parameters()):
                stack.callback(m.register_forward_pre_hook(leaf_hook).remove)
        _route_interface(stack, block_list, attention)
        stack.enter_context(meter.track())
        loss = run_step()
        loss.backward()
    module.zero_grad(set_to_none=True)
    step_s, block_s = _time_step(module, block_list, run_step)

    unique = {id(p): p for p in module.parameters()}
    tied = first_ids & last_ids
    shape = input_shape[0] if input_shape else torch.Size([batch_size, 1, 1])
    linear = {id(p): p for b in block_list for m in b.modules() if isinstance(m, nn.Linear) for p in m.parameters()}

    experts = _experts(module, block_list)

    def saved_per_block(counted) -> tuple[int, ...]:  # bytes per sample each block saved in storages ``counted``
        return tuple(sum(n for k, n in meter.keys.get(i, {}).items() if counted(k)) // batch_size
                     for i in range(len(block_list)))

    return ModuleProfile(
        total_params=sum(p.numel() for p in unique.values()),
        block_params=tuple(sum(p.numel() for p in b.parameters()) for b in block_list),
        first_params=sum(unique[i].numel() for i in first_ids),
        last_params=sum(unique[i].numel() for i in last_ids - first_ids),
        tied_params=sum(unique[i].numel() for i in tied),
        shardable_block_params=sum(p.numel() for p in linear.values()),
        block_activation_bytes=tuple(meter.by_tag.get(i, 0) // batch_size for i in range(len(block_list))),
        first_activation_bytes=meter.by_tag.get("before", 0) // batch_size,
        last_activation_bytes=meter.by_tag.get("after", 0) // batch_size,
        hidden_size=int(shape[-1]),
        seq_len=int(shape[1]) if len(shape) >= 3 else 1,
        num_heads=_num_heads(block_list[0]) if block_list else None,
        dtype_bytes=max(meter.by_width, key=meter.by_width.get) if meter.by_width else 4,
        block_input_bytes=input_bytes[0] // batch_size if input_bytes else 0,
        selective_bytes=tuple(ledger.saved.get(i, 0) // batch_size for i in range(len(block_list))),
        step_s_per_sample=step_s / batch_size,
        block_forward_s_per_sample=block_s / batch_size,
        selective_recompute_share=ledger.seconds["other"] / max(sum(ledger.seconds.values()), 1e-12),
        block_kv_bytes=tuple(attention.kv.get(i, 0) // batch_size for i in range(len(block_list))),
        kv_dtype_bytes=attention.elem,
        block_attention_bytes=tuple(attention.out.get(i, 0) // batch_size for i in range(len(block_list))),
        block_attention_io_bytes=tuple(attention.io.get(i, 0) // batch_size for i in range(len(block_list))),
        block_interface_calls=tuple(attention.interface.get(i, 0) for i in range(len(block_list))),
        block_whole_bytes=saved_per_block(lambda k: k not in ledger.sharded),
        block_whole_sp_bytes=saved_per_block(lambda k: k not in ledger.sharded
                                             and (k in ledger.gathered or k not in ledger.stream)),
        head_largest_bytes=max(meter.keys.get("after", {}).values(), default=0) // batch_size,
        block_expert_params=experts[0],
        expert_linear_params=sum(p.numel() for i in experts[1] if (p := linear.get(i)) is not None),
        num_experts=experts[2],
        expert_top_k=experts[3],
    )


def _experts(module: nn.Module, block_list: list[nn.Module]) -> tuple[tuple[int, ...], set, int, int]:
    """(routed-expert parameters per block, their ids, the fewest experts of a layer, top-k) of ``module``: its
    MoE containers as expert parallelism finds them (:func:`lightning_par.experts.find_experts`); top-k from a
    config's ``num_experts_per_tok`` or a router's ``top_k``, else 1."""
    from lightning_par.experts.discovery import find_experts

    found = find_experts(module)
    if not found:
        return (), set(), 0, 0
    ids = {id(p) for c in found for _, p in c.expert_parameters()}
    per_block = tuple(sum(p.numel() for p in b.parameters() if id(p) in ids) for b in block_list)
    top_k = next((int(v) for m in module.modules() for v in (getattr(getattr(m, "config", None),
                                                                     "num_experts_per_tok", None),
                                                             getattr(m, "top_k", None)) if isinstance(v, int)), 1)
    return per_block, ids, min(c.num_experts for c in found), top_k


def _time_step(module: nn.Module, block_list: list[nn.Module], run_step, repeats: int = 3) -> tuple[float, float]:
    """Seconds of one more forward + backward of ``run_step`` (warm: the probe ran it once), and of the blocks'
    forward inside it (what full activation checkpointing runs again in backward): the fastest of ``repeats``
    runs each (a shared machine's noise only adds time)."""
    device = next(module.parameters()).device
    spent, started = [0.0], [0.0]

    def enter(mod, args):
        _sync(device)
        started[0] = time.perf_counter()

    def leave(mod, args, out):
        _sync(device)
        spent[0] += time.perf_counter() - started[0]

    totals, blocks = [], []
    with ExitStack() as stack:
        for b in block_list:
            stack.callback(b.register_forward_pre_hook(enter).remove)
            stack.callback(b.register_forward_hook(leave).remove)
        for _ in range(repeats):
            spent[0] = 0.0
            _sync(device)
            t0 = time.perf_counter()
            run_step().backward()
            _sync(device)
            totals.append(time.perf_counter() - t0)
            blocks.append(spent[0])
            module.zero_grad(set_to_none=True)
    return min(totals), min(blocks)
