"""Expert parallelism inside pipeline stages (pp 2 x ep 2 on 4 gloo ranks, [Note: expert parallelism inside
pipeline stages] in lightning_par/experts/apply.py): equal to the same pipeline with ep 1, its checkpoints, and
the refusal of an experts list found as the block stack."""
import functools

import pytest
import torch
from torch.utils.data import DataLoader

from experts_models import MoEModule
from harness import TIMEOUT_S, fit_and_record, fit_whole_then_resumed, seeded
from test_experts_strategy import DATA, STEPS, _fit, assert_matches, hybrid, plan_log


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family,optimizer,zero", [("mixtral", "adamw", 0), ("mixtral", "sgd", 0),
                                                   ("list_blocks", "sgd", 0), ("mixtral", "adamw", 1),
                                                   pytest.param("qwen2_moe", "adamw", 0, marks=pytest.mark.slow),
                                                   pytest.param("deepseek_v3", "adamw", 0, marks=pytest.mark.slow),
                                                   pytest.param("qwen2_moe", "sgd", 0, marks=pytest.mark.slow),
                                                   pytest.param("deepseek_v3", "sgd", 0, marks=pytest.mark.slow)])
def test_pp2_ep2_matches_the_data_parallel_pipeline(tmp_path, family, optimizer, zero):
    """pp 2 x dp 2 with ep 2 (4 ranks): each stage's blocks' experts divided over its two replicas ([Note: expert
    parallelism inside pipeline stages]) equal the same pipeline with ep 1 (whole experts, gradients averaged over
    dp): losses over 8 steps, the first two steps' gradients, the parameters (each rank's experts against their
    rows / modules of the whole). The reference is the pipeline, not DDP: a router's aux loss is taken per
    micro-batch there, as under ep. The per-expert lists' stack is named: an experts list is the longest. With
    zero_stage=1 the dense optimizer state is sharded over dp, each stage's experts' over their holders."""
    from lightning_par.topology import Topology

    # DeepSeek-V3's first layer is dense (first_k_dense_replace=1): with 3 layers each stage holds one MoE layer
    factory = functools.partial(MoEModule, family, optimizer, **({"layers": 3} if family == "deepseek_v3" else {}))
    loader = DataLoader(DATA.train_set, batch_size=2)
    pp = dict(pipeline_parallel_size=2, microbatches=2, blocks="model.layers" if family == "list_blocks" else None)
    ref = fit_and_record(seeded(factory), loader, str(tmp_path / "p"), devices=4, max_steps=STEPS,
                         strategy=hybrid(**pp))
    with plan_log(tmp_path / "plan.log") as log:
        got = fit_and_record(seeded(factory), loader, str(tmp_path / "e"), devices=4, max_steps=STEPS,
                             strategy=hybrid(**pp, expert_parallel_size=2, zero_stage=zero))
    assert len(got) == len(ref) == 4
    topo = Topology(data_parallel_size=2, pipeline_parallel_size=2)
    for r, (want, rec) in enumerate(zip(ref, got)):
        assert_matches(want, [rec], 1, index=topo.coordinates(r)["dp"])
    assert "Expert parallel: ep=2, this rank holds experts [0, 2) of each of 1 MoE layers" in log.read_text()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["mixtral", "list_blocks"])
def test_checkpoint_under_pp2_ep2_holds_the_whole_module_and_resumes_exactly(tmp_path, family):
    """Each stage's experts are written by the ranks holding them ([Note: who writes the experts]): the file holds
    the whole module's entries at their whole shapes and its optimizer state, and pp 2 x ep 2 resumes from it bit
    for bit."""
    pp = dict(pipeline_parallel_size=2, microbatches=2, blocks="model.layers" if family == "list_blocks" else None)

    def fit(tmp, name, strategy, **kw):
        factory = functools.partial(MoEModule, family, "adamw")
        return fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=2), str(tmp / name),
                              strategy=strategy, devices=4, **kw)
    whole, resumed, path = fit_whole_then_resumed(fit, tmp_path, lambda: hybrid(**pp, expert_parallel_size=2))
    steps = len(whole[0]["losses"])
    for w, r in zip(whole, resumed, strict=True):  # a stage's own parameters (the others' copies are not trained)
        assert r["global_step"] == steps and r["losses"] == w["losses"][steps // 2:]
        owned = set(w["grads"][-1])
        assert owned and any(".experts." in n for n in owned)
        for name in owned:
            torch.testing.assert_close(r["params"][name], w["params"][name], atol=0, rtol=0,
                                       msg=lambda m: f"rank {w['rank']} {name}: {m}")
    saved = torch.load(path, weights_only=False)
    ref = MoEModule(family).state_dict()
    assert {k: v.shape for k, v in saved["state_dict"].items()} == {k: v.shape for k, v in ref.items()}
    state = saved["optimizer_states"][0]["state"]
    assert len(state) == len(list(MoEModule(family).parameters()))  # every parameter's AdamW state, experts too


@pytest.mark.timeout(TIMEOUT_S)
def test_pp_ep_refuses_an_experts_list_as_the_block_stack():
    """The per-expert list (4 experts) is the longest list of one class, so it would be found as the pipeline's
    block stack: under ep it is refused at setup naming the stack and `blocks=`, on every rank alike."""
    with pytest.raises(Exception, match=r"block stack `model.layers.0.experts` is MoEModule.s routed experts"):
        _fit(hybrid(pipeline_parallel_size=2, microbatches=2, expert_parallel_size=2), MoEModule("list"), devices=4)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["mixtral", "list_blocks"])
def test_meta_build_with_weights_under_pp2_ep2_matches_the_pipeline(tmp_path, family):
    """A module built on the meta device and given ``weights=`` (the module's own file) under pp 2 x ep 2: each
    rank materializes its stage's block with only its experts (half of its layer's), reads from the file exactly
    the bytes it holds (the reader's count), and trains as the ep-1 pipeline built with the same weights does
    (losses, gradients, parameters as in the test above)."""
    import lightning.pytorch as pl
    from safetensors.torch import save_file

    from harness import Recorder, trainer_kwargs
    from lightning_par.topology import Topology
    from test_experts_strategy import HoldsExperts, ReadsItsShare

    factory = functools.partial(MoEModule, family, "adamw")
    path = str(tmp_path / "model.safetensors")
    state = {k: v.detach().clone().contiguous() for k, v in seeded(factory).state_dict().items()}
    save_file(state, path)
    file_experts = sum(v.numel() * v.element_size() for k, v in state.items() if ".experts." in k)
    loader = DataLoader(DATA.train_set, batch_size=2)
    pp = dict(pipeline_parallel_size=2, microbatches=2, blocks="model.layers" if family == "list_blocks" else None)
    ref = fit_and_record(seeded(factory), loader, str(tmp_path / "p"), devices=4, max_steps=STEPS,
                         strategy=hybrid(**pp))
    trainer = pl.Trainer(**trainer_kwargs(strategy=hybrid(**pp, expert_parallel_size=2, weights=path), devices=4,
                                          max_steps=STEPS, callbacks=[Recorder(str(tmp_path / "m")),
                                                                      HoldsExperts(2 if family != "list_blocks"
                                                                                   else 1),
                                                                      ReadsItsShare(str(tmp_path))]))
    torch.manual_seed(5)  # not the file's weights: they must come from the file
    with trainer.init_module(empty_init=True):
        module = factory()
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader)
    got = [torch.load(tmp_path / "m" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    topo = Topology(data_parallel_size=2, pipeline_parallel_size=2)
    for r, (want, rec) in enumerate(zip(ref, got)):
        assert any(".experts." in n for n in rec["grads"][0])
        assert_matches(want, [rec], 1, index=topo.coordinates(r)["dp"])
        share = torch.load(tmp_path / f"share{r}.pt", weights_only=False)
        # one MoE layer a stage, half of its experts a rank: a quarter of the file's expert bytes
        assert file_experts > 0 and share["experts"] * 4 == file_experts, (share, file_experts)
        assert share["read"] == share["held"] > share["experts"], share
