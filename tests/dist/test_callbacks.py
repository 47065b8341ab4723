"""ParallelMetrics on real ranks: its counts against the formulas they must equal."""
import json

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, seeded
from models import corpus, tiny_gpt
from lightning_par.advisor import profile_lightning_module
from lightning_par.callbacks import ParallelMetrics, format_summary


@pytest.mark.timeout(TIMEOUT_S)
def test_metrics_under_ddp_match_the_formulas(tmp_path, capsys):
    data = corpus()
    out = str(tmp_path / "rows.json")  # rank 0 runs in a forked child: rows come back through the file
    fit_and_record(seeded(tiny_gpt), DataLoader(data.train_set, batch_size=4), str(tmp_path / "rec"),
                   strategy=DDPStrategy(start_method="fork"), devices=2, max_steps=5,
                   callbacks=[ParallelMetrics(measure_step=1, save_path=out)])
    rows = json.loads(open(out).read())
    assert len(rows) == 2
    gpt = seeded(tiny_gpt)
    params = sum(p.numel() for p in gpt.parameters())
    x, y = (torch.stack(t) for t in zip(*(data.train_set[i] for i in range(4))))
    profile = profile_lightning_module(gpt, (x, y))
    for row in rows:
        assert row["param_bytes"] == 4 * params
        assert row["grad_bytes"] == 4 * params
        # AdamW: exp_avg and exp_avg_sq per element, plus a float32 `step` scalar per parameter tensor
        assert row["optimizer_bytes"] == 2 * 4 * params + 4 * len(list(gpt.parameters()))
        # ring all-reduce of every gradient once, in backward: 2(N-1)/N × gradient bytes
        assert row["comm_bytes_by_kind"]["all_reduce[bwd]"] == 2 * (2 - 1) / 2 * 4 * params
        # besides gradients only Lightning's small control messages (broadcast_object_list of a few bytes)
        assert 0 <= row["comm_bytes"] - row["comm_bytes_by_kind"]["all_reduce[bwd]"] < 1024
        # the same saved-tensor count as the advisor's probe on a micro-batch of the rank's 4 samples
        assert row["activation_bytes"] == pytest.approx(4 * profile.activation_bytes_per_sample, rel=0.02)
        assert 0 < row["comm_share"] <= 1
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 16)
    table = format_summary(rows)
    assert "comm MiB/step" in table and len(table.splitlines()) == 4
