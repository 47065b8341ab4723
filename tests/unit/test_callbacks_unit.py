"""The saved-tensor meter behind ParallelMetrics, the stage runtime and the advisor: peak bytes alive follows the
schedule."""
import torch

from lightning_par.callbacks import format_summary, state_bytes
from lightning_par.saved import SavedTensorMeter


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def test_peak_saved_bytes_all_forwards_first_vs_one_at_a_time():
    model = _mlp()
    # inputs are made inside the loops: a tensor the caller keeps (a list of inputs) stays alive and counts
    gpipe, one = SavedTensorMeter(model.parameters()), SavedTensorMeter(model.parameters())
    with gpipe.track():                        # GPipe order: every forward, then every backward
        losses = [model(torch.randn(4, 8)).square().sum() for _ in range(4)]
        for loss in losses:
            loss.backward()
    del losses
    with one.track():                          # one micro-batch in flight at a time
        for _ in range(4):
            model(torch.randn(4, 8)).square().sum().backward()
    assert gpipe.total == one.total > 0
    assert gpipe.peak == gpipe.total           # all four micro-batches alive at once
    assert one.peak * 4 == gpipe.peak          # one at a time holds a quarter


def test_state_bytes_counts_parameters_grads_and_adam_state():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert state_bytes(model, [opt]) == {"param_bytes": 4 * n, "grad_bytes": 4 * n,
                                         "optimizer_bytes": 8 * n + 4 * len(list(model.parameters()))}


def test_summary_table_has_a_row_per_rank_and_dashes_for_missing_values():
    table = format_summary([{"step_s": 0.1, "param_bytes": 2**20}, {"step_s": 0.2}])
    lines = table.splitlines()
    assert len(lines) == 4 and "params MiB" in lines[1]
    assert lines[3].split()[-1] == "-"
