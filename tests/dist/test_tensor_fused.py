"""Fused projections under TensorParallelStrategy (see [Note: fused projections]): nanoGPT's fused q/k/v
and a fused gate/up train like one process, with Megatron's collectives and 1/t of the bytes."""
import glob
import os

import pytest
import torch

from fused_gpt import FusedGPT
from harness import TIMEOUT_S, assert_close_records
from test_tensor_checkpoint import fit_tp, reference_pair
from test_tensor_comm import N_LAYER, fit_measure
from test_tensor_parallel import run_pair


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout,tp,sp", [("split", 2, False), ("view", 2, False), ("split", 4, False), ("view", 2, True)])
def test_fused_projections_match_one_process(tmp_path, layout, tp, sp):
    ref, got = run_pair(tmp_path, tp=tp, factory=lambda: FusedGPT(layout=layout), gradient_clip_val=0.05,
                        strategy_kw=dict(sequence_parallel=sp))
    for rec in got:
        assert_close_records(ref, rec)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["split", "view"])
def test_fused_projections_reduce_four_times_per_layer(tmp_path, layout):
    recs = fit_measure(tmp_path, factory=lambda: FusedGPT(n_layer=N_LAYER, layout=layout))
    assert len(recs) == 2
    for rec in recs:
        assert rec["counts"], "no step's collectives were recorded"
        for counts in rec["counts"]:
            # no gather of q/k/v or of their gradients: Megatron's 2 forward + 2 backward all-reduces
            assert counts == {"all_reduce": 4 * N_LAYER}, counts
        assert rec["full"] > 0 and rec["local"] * 2 == rec["full"], rec


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("distributed", [False, True])
def test_fused_checkpoints_load_on_one_device_and_resume_exactly(tmp_path, distributed):
    ref2, ref_resumed = reference_pair(tmp_path, factory=FusedGPT)
    kw = dict(save_distributed_checkpoint=distributed)
    got, _ = fit_tp(tmp_path, "tp", 2, strategy_kw=kw, factory=FusedGPT)
    for rec in got:
        assert_close_records(ref2, rec)
    path = str(tmp_path / "ckpt_tp" / "epoch=0-step=2.ckpt")
    if distributed:
        assert os.path.isdir(path) and glob.glob(os.path.join(path, "*.distcp"))
    else:  # the fused weight is saved whole, in the unchanged module's row order
        single = FusedGPT.load_from_checkpoint(path)
        for n, p in single.named_parameters():
            torch.testing.assert_close(p.detach(), ref2["params"][n], atol=1e-5, rtol=1e-5)
    resumed, _ = fit_tp(tmp_path, "resumed", 4, ckpt_path=path, strategy_kw=kw, factory=FusedGPT)
    for rec in resumed:
        assert_close_records(ref_resumed, rec)
        assert rec["global_step"] == 4
