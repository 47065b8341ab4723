"""The harness itself: Lightning's DDP on 2 forked ranks equals one process on the same global batches."""
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded
from models import corpus, tiny_gpt


@pytest.mark.timeout(TIMEOUT_S)
def test_lightning_ddp_matches_one_process(tmp_path):
    data = corpus()
    ref = one_process_fit(tiny_gpt, data.train_set, 8)
    got = fit_and_record(seeded(tiny_gpt), DataLoader(data.train_set, batch_size=4), str(tmp_path / "ddp"),
                         strategy=DDPStrategy(start_method="fork"), devices=2)
    assert len(got) == 2
    mean_losses = torch.tensor([r["losses"] for r in got]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    for rec in got:
        assert_close_records(ref, rec, losses=False)
