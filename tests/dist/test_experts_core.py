"""Expert parallelism's building block on real gloo ranks, without Lightning: tiny MoE models (Hugging Face
Mixtral / Qwen2-MoE / DeepSeek-V3 from configs, fused experts; a per-expert ModuleList MoE) under ep 2 train as the
data-parallel run of the same global batch does, in one process (each replica's loss on its own slice, the
gradients averaged)."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from experts_models import FAMILIES, ListMoELM, lm_loss, mixtral
from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.experts import apply_expert_parallel, is_expert_parameter

STEPS, PER_RANK = 8, 2
FACTORIES = {**FAMILIES, "list": ListMoELM}


def _optimizer(kind, params):
    return torch.optim.AdamW(params, lr=1e-2) if kind == "adamw" else torch.optim.SGD(params, lr=0.1)


def _batches(world):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (PER_RANK * world, 8), generator=g) for _ in range(STEPS)]


def _force_first_experts(model):
    """A router that sends every token to experts 0 and 1 (the user's own hook, on both runs): the ranks holding
    the others receive nothing."""
    def hook(_m, _args, out):
        logits, weights, idx = out
        return logits, weights, torch.zeros_like(idx) + torch.arange(idx.shape[-1])
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(hook)


def _build(family, skew):
    torch.manual_seed(0)
    model = FACTORIES[family]()
    if skew:
        _force_first_experts(model)
    return model


def _worker(rank, port, out_dir, family, world, ep, opt, skew):
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    ep_groups = [list(range(i, i + ep)) for i in range(0, world, ep)]
    replica_groups = [list(range(j, world, ep)) for j in range(ep)]
    mine = rep = None
    for ranks in ep_groups:
        g = dist.new_group(ranks, timeout=timeout)
        mine = g if rank in ranks else mine
    for ranks in replica_groups:
        g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        rep = g if rank in ranks else rep
    model = _build(family, skew)
    applied = apply_expert_parallel(model, mine, rep, ep=ep, rank=rank % ep, replicas=world, timeout=timeout)
    dense = [p for p in model.parameters() if not is_expert_parameter(p)]
    optimizer = _optimizer(opt, model.parameters())
    losses, grads = [], {}
    fused = {f"{c.name}.{t}" for c in applied.containers for t in c.tensors}
    for step, batch in enumerate(_batches(world)):
        loss = lm_loss(model, batch[rank * PER_RANK:(rank + 1) * PER_RANK])
        optimizer.zero_grad()
        loss.backward()
        for p in dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
        applied.finish_gradients()
        if step == 0:
            grads = _whole(model, "grad", fused, ep, mine)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    state = _whole(model, "data", fused, ep, mine)
    torch.save({"losses": losses, "state": state, "grads": grads}, os.path.join(out_dir, f"ep{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _whole(model, what, fused, ep, group):
    """Fused expert tensors gathered whole; a ModuleList's experts: each rank its own (merged by the test)."""
    state = {}
    for name, p in model.named_parameters():
        full = getattr(p, what).detach()
        if name in fused:  # a DTensor sharded over the expert-parallel group
            assert isinstance(full, DTensor) and full.to_local().shape[0] == full.shape[0] // ep
            full = full.full_tensor()
        state[name] = full.clone()
    return state


def _reference(family, world, opt, skew):
    """The data-parallel run of the same global batches in one process."""
    model = _build(family, skew)
    optimizer = _optimizer(opt, model.parameters())
    losses, grads = [], {}
    for step, batch in enumerate(_batches(world)):
        parts = [lm_loss(model, batch[r * PER_RANK:(r + 1) * PER_RANK]) for r in range(world)]
        loss = sum(parts) / world
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


def _run(tmp_path, family, world=2, ep=2, opt="adamw", skew=False):
    start_ranks(_worker, (free_port(), str(tmp_path), family, world, ep, opt, skew), world)
    got = torch.load(tmp_path / "ep0.pt")
    for r in range(1, world):
        other = torch.load(tmp_path / f"ep{r}.pt")
        got["state"], got["grads"] = {**other["state"], **got["state"]}, {**other["grads"], **got["grads"]}
    losses, grads, state = _reference(family, world, opt, skew)
    for name, g in grads.items():  # step 1's gradients, before any optimizer could hide a scale
        torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=2e-4, rtol=0)
    for name, p in state.items():
        q = got["state"][name]
        torch.testing.assert_close(q, p, atol=2e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert got["losses"][0] != got["losses"][-1]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_families_under_ep2_equal_data_parallel(tmp_path, family):
    _run(tmp_path, family)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["mixtral", "list"])
def test_plain_sgd_under_ep2_equals_data_parallel(tmp_path, family):
    _run(tmp_path, family, opt="sgd")


@pytest.mark.timeout(TIMEOUT_S)
def test_dp4_ep2_sums_experts_over_their_replicas(tmp_path):
    """4 ranks, ep 2: experts [0, 2) on ranks 0 and 2, [2, 4) on ranks 1 and 3; SGD shows a wrong divisor."""
    _run(tmp_path, "mixtral", world=4, ep=2, opt="sgd")


@pytest.mark.timeout(TIMEOUT_S)
def test_zero_token_rank_trains_on(tmp_path):
    _run(tmp_path, "mixtral", skew=True)
