"""``offload="cpu"`` on the hybrid core's data axis: zero stage 3 under the tensor preset (dp2 × tp2) and the
pipeline preset (dp2 × pp2) hands FSDP2 its ``CPUOffloadPolicy``, and training under it reproduces one process.

On a CPU accelerator the strategies refuse ``offload`` at Trainer construction (there is no device memory to save:
tests/unit/test_activation_checkpointing.py). Here that refusal is switched off for the test, which leaves FSDP2's
offload path on a CPU "device": shards, gradients and the optimizer step in host memory, copied to the device (the
CPU again) for each unit's forward and backward, without pinning (no device to pin for). The arithmetic is that of
zero stage 3, so losses and every gradient match one process at fp32's 1e-5, as in test_core_zero.py.
"""
import pytest
from lightning.pytorch import Callback

from harness import TIMEOUT_S, one_process_fit
from test_core_zero import DATA, LAYOUTS, STEPS, assert_as_one_process, deep_gpt, fit
from lightning_par.dp import fsdp


class Offloaded(Callback):
    """Asserts on every rank, at the first step: each FSDP2 unit this rank holds offloads its parameters."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx:
            return
        groups = [m._get_fsdp_state()._fsdp_param_group for m in pl_module.modules() if hasattr(m, "_get_fsdp_state")]
        params = [p for g in groups if g is not None for p in g.fsdp_params]  # None: a unit holding no parameter
        assert len(groups) > 1 and params
        assert all(p.offload_to_cpu for p in params)


@pytest.fixture(scope="module")
def one_process():
    return one_process_fit(deep_gpt, DATA.train_set, 16, max_steps=STEPS)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_offload_under_zero3_matches_one_process(tmp_path, monkeypatch, one_process, layout):
    monkeypatch.setattr(fsdp, "check_offload_devices", lambda offload, devices: None)  # forked ranks inherit it
    factory, devices = LAYOUTS[layout]
    recs, _ = fit(tmp_path, f"{layout}-offload", factory(3, offload="cpu"), devices, callbacks=[Offloaded()])
    assert_as_one_process(one_process, recs)
