"""The setup check of context parallelism's rewrite ([Note: the setup check of a context-parallel block] in
lightning_par/context/verify.py) on two ranks: a block that mixes positions outside its attention (a causal running
mean over time, which trains silently wrong under cp) is refused at setup naming the block and the difference;
the reference GPT and a Hugging Face Llama pass it (called directly, and through a Trainer that then trains equal
to one process); ``verify=False`` skips it."""
import datetime
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, free_port, one_process_fit, seeded, start_ranks
from models import GPT_SIZES, causal_lm, corpus, hf_model
from lightning_par import HybridParallelStrategy
from lightning_par.models import GPT
from lightning_par.models.gpt import Block

DATA = corpus()


class RunningMeanBlock(Block):
    """A GPT block that adds the running mean over time of its output: a causal token mixer outside attention.
    Under cp it would see this rank's piece of the sequence only."""

    def forward(self, x):
        x = super().forward(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return x + x.cumsum(1) / steps


class RunningMeanGPT(GPT):
    def __init__(self, **overrides):
        kw = {**GPT_SIZES, **overrides}
        super().__init__(**kw)
        for i, old in enumerate(self.blocks):
            block = RunningMeanBlock(kw["n_embd"], kw["n_head"])
            block.load_state_dict(old.state_dict())
            self.blocks[i] = block


def hybrid(**kw):
    return HybridParallelStrategy(start_method="fork", timeout=120, context_parallel_size=2, **kw)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_block_that_mixes_positions_outside_attention_is_refused_at_setup(tmp_path):
    with pytest.raises(Exception, match=r"context parallel \(context_parallel_method='ring'\): the setup check of "
                                        r"'blocks.0' \(RunningMeanBlock\) failed: the rewritten block's .* differs "
                                        r"from the original's by .*context_parallel_size=1"):
        fit_and_record(seeded(RunningMeanGPT), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "r"),
                       strategy=hybrid(), devices=2, max_steps=1)


@pytest.mark.timeout(TIMEOUT_S)
def test_the_block_is_refused_inside_pipeline_stages_too(tmp_path):
    # pp 2 × cp 2: the check runs on the whole module's eager blocks before the stages are cut
    with pytest.raises(Exception, match=r"the setup check of 'blocks.0' \(RunningMeanBlock\) failed"):
        fit_and_record(seeded(RunningMeanGPT), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "p"),
                       strategy=hybrid(pipeline_parallel_size=2, microbatches=2), devices=4, max_steps=1)


@pytest.mark.timeout(TIMEOUT_S)
def test_verify_false_skips_the_check(tmp_path):
    # unchecked, the block trains (differently from one device: not asserted, only that it runs)
    got = fit_and_record(seeded(RunningMeanGPT), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "v"),
                         strategy=hybrid(verify=False), devices=2, max_steps=2)
    assert len(got) == 2
    for rec in got:
        assert len(rec["losses"]) == 2 and all(math.isfinite(x) for x in rec["losses"])


LLAMA = causal_lm("llama", call={"use_cache": False}, attn_implementation="sdpa", max_position_embeddings=16)


@pytest.mark.timeout(TIMEOUT_S)
def test_llama_passes_the_check_and_trains_as_one_process(tmp_path):
    ref = one_process_fit(LLAMA, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(LLAMA), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "l"),
                         strategy=hybrid(), devices=2, max_steps=2)
    for rec in got:
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=2e-4, rtol=0)
        for name, p in rec["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=1e-5, rtol=1e-5)


def _check_directly(rank, port, out):
    """check_context_blocks as a building block: the GPT and a Llama pass (their largest difference within the
    allowance), the running-mean block is refused on both ranks with the same message."""
    from lightning_par.context.verify import block_kinds, check_context_blocks
    from lightning_par.verify import record_inputs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
        found = {}
        idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
        torch.manual_seed(rank)  # the ranks' weights differ: the check runs group rank 0's block on both
        for kind, model in (("gpt", GPT(**GPT_SIZES)), ("llama", hf_model("llama", attn_implementation="sdpa"))):
            call = (lambda: model(idx)) if kind == "gpt" else (lambda: model(input_ids=idx, use_cache=False))
            inputs = record_inputs(model, block_kinds(model), call)
            for method in ("ring", "allgather", "ulysses"):
                verdicts = check_context_blocks(model, inputs, group, method=method)
                found[kind, method] = {n: (v.ok, v.error, v.allowed) for n, v in verdicts.items()}
        model = RunningMeanGPT()
        try:
            check_context_blocks(model, record_inputs(model, block_kinds(model), lambda: model(idx)), group)
        except ValueError as e:
            found["refused"] = str(e)
        torch.save(found, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_check_context_blocks_is_a_building_block(tmp_path):
    start_ranks(_check_directly, (free_port(), str(tmp_path)), nprocs=2)
    found = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in range(2):
        for kind, name in (("gpt", "blocks.0"), ("llama", "model.layers.0")):
            for method in ("ring", "allgather", "ulysses"):
                verdicts = found[rank][kind, method]
                assert list(verdicts) == [name]  # one block per kind: every block of the stack is one class
                ok, error, allowed = verdicts[name]
                assert ok and error <= allowed, (kind, method, error, allowed)
        assert found[rank]["refused"].startswith(
            "context parallel (context_parallel_method='ring'): the setup check of 'blocks.0' (RunningMeanBlock) "
            "failed: the rewritten block's ")
    assert found[0]["refused"] == found[1]["refused"]  # every rank reaches the same verdict
