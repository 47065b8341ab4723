"""Every recipe's --quick mode end to end: it writes report.md, its plots and results.json."""
import json

import pytest

from harness import TIMEOUT_S
from lightning_par.recipe import run_recipe as recipe
from lightning_par.recipes import RECIPES


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", RECIPES)
def test_quick_recipe_writes_its_report(name, tmp_path, capsys):
    path = recipe([name, "--quick", "--out", str(tmp_path)])
    assert capsys.readouterr().out.strip().endswith("report.md")
    text = path.read_text()
    assert text.startswith("# ") and f"lightning-par-recipe {name}" in text and "Published result" in text
    for line in text.splitlines():
        if line.startswith("!["):
            assert (tmp_path / line.split("(")[-1].rstrip(")")).stat().st_size > 1000
    results = json.loads((tmp_path / "results.json").read_text())
    if name == "decision":
        # model states of mixed-precision Adam: 16 bytes per parameter (the ZeRO paper's 16Ψ)
        assert all(row[-1] == "1.000" for row in results["model_states"])
        assert len(results["grid"]) == 3 and all(len(line) == 2 for line in results["grid"])
        # the smallest model fits everywhere: data parallel; the 13B one needs model parallelism or does not fit
        assert results["grid"][0] == [0, 0] and all(k >= 2 for k in results["grid"][2])
    if name == "parity":
        floor_gap = results["curves"]["single"][0] - results["floor"]
        assert floor_gap > 0
        for layout, curve in results["curves"].items():
            # fp32 round-off over a few AdamW steps; a wrong split or a lost gradient is off by >1e-3
            assert max(abs(a - b) for a, b in zip(curve, results["curves"]["single"])) < 1e-5, layout
    if name == "fault_tolerance":
        # the killed replica group came back, received the survivor's exact state, and both ended on the last step
        assert results["killed"] and results["recovered"] and results["weights_equal_after_recovery"], results
        assert results["steps_agree"] and results["final_step"] == 300 and results["steps_alone"] >= 1
        assert results["recovery_s"] > 0 and results["ckpt_restart"]["steps_redone"] >= 1
    if name == "pipeline_bubble":
        for res in results.values():
            assert all(0 < b < 1 for b in res["per_rank_bubble"]) and len(res["per_rank_bubble"]) == res["p"]
        for m in (2, 4):  # 1F1B holds at most min(p, m) of GPipe's m micro-batches of activations
            ratio = results[f"p2-m{m}-1f1b"]["activation_bytes"] / results[f"p2-m{m}-gpipe"]["activation_bytes"]
            assert ratio <= min(2, m) / m + 0.01, (m, ratio)
    if name == "memory":
        for layout, res in results.items():
            measured = max(sum(r[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
                           for r in res["rows"])
            predicted = sum(res["predicted"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                          "activation_bytes"))
            assert 0.9 <= predicted / measured <= 1.1, (layout, predicted, measured)  # the advisor within 10%
    if name == "communication":
        for layout, res in results.items():
            # the formulas, plus only small control messages (loss broadcast, activation headers)
            assert 0 <= res["measured"] - res["predicted"] < 0.06 * res["predicted"] + 1024, (layout, res)
            # FSDP: one all-gather per unit and step, two per block under ZeRO-3 without a pipeline
            assert res["all_gathers"] == res["all_gathers_formula"] or not res["all_gathers_formula"], (layout, res)
    if name == "network":  # two namespaces joined by a veth pair, the link shaped with tc (see test_two_nodes)
        res, grad_bytes = results["results"], results["gradient_bytes"]
        for layout, by_rate in res.items():
            for rate, r in by_rate.items():
                assert r["max_loss_diff_vs_one_device"] < 1e-5, (layout, rate, r)
                assert len(r["nodes"]) == 2 and r["drops"] == 0, (layout, rate, r)
                # what crossed the veth is what lightning_par.comm counted plus TCP/IP headers and acks
                counted = r["counted_bytes_per_step"]
                assert counted <= r["link_bytes_per_step"] < 1.1 * counted + 4096, (layout, rate, r)
            slow = by_rate["20mbit"]
            assert "tbf" in slow["qdisc"] and "rate 20Mbit" in slow["qdisc"], slow["qdisc"]
            # a token bucket passes at most its 16 KiB bucket ahead of the rate: the step cannot beat the wire
            assert slow["step_s"] >= (slow["link_bytes_per_step"] - 16 * 1024) * 8 / 20e6, (layout, slow)
        assert res["dp"]["unshaped"]["link_bytes_per_step"] >= grad_bytes  # every gradient, once (ring, N=2)
        assert res["pp"]["unshaped"]["link_bytes_per_step"] < 0.5 * grad_bytes  # a pipeline sends far less
    if name == "scaling":
        rows = {(r[0], r[1]): r for r in results["rows"]}
        assert rows[(1, "single")][5] == 1.0
        for strategy in ("lightning_par", "lightning_ddp"):
            assert rows[(2, strategy)][2] > 0
            assert rows[(2, strategy)][6] > 0  # gradients were communicated


def test_unknown_recipe_setting_fails_naming_it(tmp_path):
    from omegaconf.errors import ConfigKeyError

    with pytest.raises(ConfigKeyError, match="nonsense"):
        recipe(["decision", "nonsense=1", "--quick", "--out", str(tmp_path)])
