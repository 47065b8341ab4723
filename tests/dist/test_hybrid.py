"""HybridParallelStrategy (data × pipeline × tensor) on real gloo ranks (fork) against one process on the same
global batches: losses on every rank, every gradient a rank holds (tensor shards gathered), every parameter
of its stage (fp32, 1e-5)."""
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_matches, fit_and_record, hybrid, one_process_fit, seeded
from models import corpus, deep_gpt
from lightning_par.models import GPT

DATA = corpus(val_sequences=16)




@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1),
                                                      ("zero_bubble", 1)])
def test_pp2_tp2_matches_one_process(tmp_path, schedule, stages_per_rank):
    """Ranks (pp, dp, tp): 0=(0,0,0) 1=(0,0,1) 2=(1,0,0) 3=(1,0,1)."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 8)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                         microbatches=4, schedule=schedule, stages_per_rank=stages_per_rank),
                         devices=4)
    assert len(got) == 4
    assert_matches(ref, got)
    # tensor-parallel peers hold the same stage: the same parameter names
    assert set(got[0]["grads"][0]) == set(got[1]["grads"][0])
    assert set(got[2]["grads"][0]) == set(got[3]["grads"][0])
    for rec in got:
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,stages_per_rank,mesh_order", [("1f1b", 1, "pp_dp_tp"),
                                                                 ("interleaved_1f1b", 2, "dp_pp_tp")])
def test_dp2_pp2_tp2_matches_one_process(tmp_path, schedule, stages_per_rank, mesh_order):
    """8 ranks; each replica sees half of the global batch of 16. With mesh_order="dp_pp_tp" the replicas are
    the outermost axis: ranks 0-3 hold replica 0's pipeline."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 16, max_steps=2)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2,
                                         microbatches=4, schedule=schedule, stages_per_rank=stages_per_rank,
                                         mesh_order=mesh_order),
                         devices=8, max_steps=2)
    assert len(got) == 8
    assert_matches(ref, got)
    # rank = (pp·2 + dp)·2 + tp, or (dp·2 + pp)·2 + tp: block 0 lives on the first stage of both replicas
    first_stage = [0, 1, 2, 3] if mesh_order == "pp_dp_tp" else [0, 1, 4, 5]
    for r in range(8):
        assert any(n.startswith("blocks.0.") for n in got[r]["grads"][0]) == (r in first_stage), r
    for rec in got:  # every rank returns and logs the global batch's loss
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)


@pytest.mark.timeout(TIMEOUT_S)
def test_3d_clipping_accumulation_and_validation(tmp_path):
    """dp2 × pp2 × tp2: accumulate 2, clip at the global norm over stages and shards, validation with
    sync_dist val_loss, equal to one process."""
    settings = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05, limit_val_batches=2,
                    val_check_interval=4)
    ref = one_process_fit(deep_gpt, DATA.train_set, 8, val_loader=DataLoader(DATA.val_set, batch_size=8), **settings)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "h"),
                         strategy=hybrid(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2,
                                         microbatches=2),
                         devices=8, val_loader=DataLoader(DATA.val_set, batch_size=4), **settings)
    assert_matches(ref, got)
    for rec in got:
        assert rec["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5)


@pytest.mark.timeout(TIMEOUT_S)
def test_consolidated_checkpoint_loads_on_one_device_and_resumes(tmp_path):
    """pp2 × tp2 writes one file under the module's own names (tensor shards gathered, stages assembled): it
    loads strictly into the unchanged module on one device with the trained weights, and a resumed run under
    the same layout continues as the uninterrupted one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def strategy():
        return hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1, microbatches=2)

    loader = DataLoader(DATA.train_set, batch_size=16)  # 4 batches an epoch
    whole = fit_and_record(seeded(deep_gpt), loader, str(tmp_path / "whole"), strategy=strategy(), devices=4,
                           max_steps=-1, max_epochs=2)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    first = fit_and_record(seeded(deep_gpt), loader, str(tmp_path / "first"), strategy=strategy(), devices=4,
                           max_steps=-1, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True)
    path = str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    model = GPT.load_from_checkpoint(path, strict=True, map_location="cpu")
    loaded = dict(model.named_parameters())
    for rec in first:  # what each rank trained (a stage's stale copies of what it does not use excluded)
        for name in rec["grads"][-1]:
            torch.testing.assert_close(loaded[name].detach(), rec["params"][name], atol=0, rtol=0)
    assert set(loaded) == {n for rec in first for n in rec["grads"][-1]}
    resumed = fit_and_record(seeded(deep_gpt), loader, str(tmp_path / "resumed"), strategy=strategy(), devices=4,
                             max_steps=-1, max_epochs=2, ckpt_path=path)
    for w, r in zip(whole, resumed):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(w["losses"][4:]), atol=1e-5, rtol=1e-5)
        for name in r["grads"][-1]:
            torch.testing.assert_close(r["params"][name], w["params"][name], atol=1e-5, rtol=1e-5)


# -- 16-bit precisions under 3-D ------------------------------------------------------------------------
# The tolerances are those of [Note: mixed-precision tolerances] in test_tensor_hf_precision.py (the same
# tiny GPT of 2 blocks: K = 8 sites where tensor parallelism rounds what one device does not). The pipeline
# adds no rounding: a block's output is the fp32 residual stream, sent as it is, and the replicas average in
# fp32. The reference runs the very micro-batches of the parallel run as accumulation steps (a 16-bit
# weight gradient rounds once per micro-batch), in the order replica 0's, then replica 1's.

def microbatch_reference_loader(dataset, *, replicas: int, batch: int, microbatches: int) -> DataLoader:
    """One process, the parallel run's micro-batches one after the other (see above)."""
    from torch.utils.data import DistributedSampler

    per_rank = [list(DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=0))
                for r in range(replicas)]
    size = batch // microbatches
    batches = [idx[i * batch + m * size:i * batch + (m + 1) * size]
               for i in range(len(per_rank[0]) // batch) for idx in per_rank for m in range(microbatches)]
    return DataLoader(dataset, batch_sampler=batches)


def one_pipeline(records: list[dict], ranks: list[int]) -> dict:
    """The records of one pipeline's stages as one record: each stage's gradients and the parameters it trains."""
    grads = [{k: v for r in ranks for k, v in records[r]["grads"][step].items()}
             for step in range(len(records[ranks[0]]["grads"]))]
    params = {n: records[r]["params"][n] for r in ranks for n in records[r]["grads"][-1]}
    return {**records[ranks[0]], "grads": grads, "params": params}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_3d_16bit_precisions(tmp_path, precision):
    from lightning.pytorch.plugins.precision import MixedPrecision
    from test_tensor_hf_precision import CLIP, DATA as SMALL, U_BF16, U_FP16, assert_mixed_precision_close
    from test_tensor_hf_precision import lr_gpt as small_gpt

    def settings():  # Lightning would turn "16-mixed" into bf16 on CPU: fp16 AMP with a GradScaler, clipped
        if precision == "bf16-mixed":
            return dict(precision="bf16-mixed")
        return dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))],
                    gradient_clip_val=CLIP)

    ref = fit_and_record(seeded(small_gpt), microbatch_reference_loader(SMALL.train_set, replicas=2, batch=4,
                                                                       microbatches=2),
                         str(tmp_path / "ref"), max_steps=2, accumulate_grad_batches=4, **settings())[0]
    ref = {**ref, "losses": torch.tensor(ref["losses"]).view(-1, 4).sum(1).tolist()}  # each divided by 4
    got = fit_and_record(seeded(small_gpt), DataLoader(SMALL.train_set, batch_size=4), str(tmp_path / "h"),
                         strategy=hybrid(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2,
                                         microbatches=2),
                         devices=8, max_steps=2, **settings())
    u, clip = (U_BF16, None) if precision == "bf16-mixed" else (U_FP16, CLIP)
    for dp in range(2):
        for tp in range(2):  # ranks (pp·2 + dp)·2 + tp of stages 0 and 1
            assert_mixed_precision_close(ref, one_pipeline(got, [dp * 2 + tp, 4 + dp * 2 + tp]), u, clip=clip)
