"""The harness itself: Lightning's DDP on 2 forked ranks equals one process on the same global batches, and the
session's cache of one-process references hands out what a fresh fit records."""
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import harness
from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, reference_loader, seeded
from models import corpus, gpt_factory, tiny_gpt


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


@pytest.mark.timeout(TIMEOUT_S)
def test_one_process_references_are_fitted_once_per_configuration(tmp_path, monkeypatch):
    data = corpus(train_sequences=16)
    fits = []
    monkeypatch.setattr(harness, "fit_and_record", lambda *a, **kw: fits.append(1) or fit_and_record(*a, **kw))
    monkeypatch.setattr(harness, "_ONE_PROCESS", {})
    first = one_process_fit(gpt_factory(n_layer=1), data.train_set, 8, max_steps=1)
    again = one_process_fit(gpt_factory(n_layer=1), corpus(train_sequences=16).train_set, 8, max_steps=1)
    assert len(fits) == 1  # equal factory, equal samples, equal settings: one fit
    again["losses"].append(0.0)  # each caller holds its own copy
    assert len(one_process_fit(gpt_factory(n_layer=1), data.train_set, 8, max_steps=1)["losses"]) == 1
    fresh = fit_and_record(seeded(gpt_factory(n_layer=1)), reference_loader(data.train_set, 8), str(tmp_path),
                           max_steps=1)[0]
    assert_close_records(fresh, first, atol=0.0, rtol=0.0)
    one_process_fit(lambda: tiny_gpt(n_layer=1), data.train_set, 8, max_steps=1)  # no content key: fitted, not kept
    assert len(fits) == 2 and len(harness._ONE_PROCESS) == 1
    with pytest.raises(TypeError, match="no content key"):
        harness._key(lambda: None)


def _failing_once(out):
    """A rank body that records torchrun's environment; on the first attempt rank 1 fails and rank 0 waits."""
    import os
    import time

    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    record = out / f"r{rank}-{restart}"
    # written whole, then renamed: the agent's SIGTERM may stop rank 0 at any point after it
    record.with_suffix(".tmp").write_text(f"{os.environ['WORLD_SIZE']} {os.environ['TORCHELASTIC_RUN_ID']} "
                                          f"{os.environ['GIVEN']}")
    os.replace(record.with_suffix(".tmp"), record)
    if restart == 0:
        if rank == 1:
            deadline = time.monotonic() + TIMEOUT_S
            while not (out / "r0-0").exists() and time.monotonic() < deadline:  # rank 0 has recorded its attempt
                time.sleep(0.01)
            raise RuntimeError("rank 1 fails")
        time.sleep(TIMEOUT_S)  # until its agent stops it


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_forked_agent_restarts_a_failed_group_as_torchrun(tmp_path, max_restarts):
    """[Note: replica groups by fork] in tests/ft_groups.py: a failed rank has its agent stop the group's other rank
    (SIGTERM) and start the whole group again, with torchrun's environment and restart count; out of restarts, the
    agent fails."""
    from ft_groups import fork_agent

    log = tmp_path / "agent.log"
    agent = fork_agent(lambda: _failing_once(tmp_path), nproc=2, max_restarts=max_restarts, env={"GIVEN": "yes"},
                       log=str(log), restart_delay_s=0)
    assert agent.wait(timeout=60) == (0 if max_restarts else 1), log.read_text()
    text = log.read_text()
    assert "attempt 0 ended with exit codes [-15, 1]" in text and "RuntimeError: rank 1 fails" in text, text
    assert ("attempt 1 ended with exit codes [0, 0]" in text) == bool(max_restarts), text
    ran = ["r0-0", "r1-0"] + (["r0-1", "r1-1"] if max_restarts else [])
    assert sorted(p.name for p in tmp_path.glob("r*-*")) == sorted(ran)
    assert all((tmp_path / name).read_text() == "2 fork yes" for name in ran)
