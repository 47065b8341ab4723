"""Every recipe's --quick mode end to end: it writes report.md, its plots and results.json."""
import json

import pytest

from harness import TIMEOUT_S, assert_only_port_races_after_the_kill
from lightning_par.recipe import run_recipe as recipe
from lightning_par.recipes import RECIPES


def run_quick(name, tmp_path, capsys, overrides=()) -> dict:
    """Run a recipe's --quick mode, check its report and plots, return its results.json."""
    path = recipe([name, *overrides, "--quick", "--out", str(tmp_path)])
    assert capsys.readouterr().out.strip().endswith("report.md")
    text = path.read_text()
    assert text.startswith("# ") and f"lightning-par-recipe {name}" in text and "Published result" in text
    for line in text.splitlines():
        if line.startswith("!["):
            assert (tmp_path / line.split("(")[-1].rstrip(")")).stat().st_size > 1000
    return json.loads((tmp_path / "results.json").read_text())


def _assert_torchft_launch(out, results) -> None:
    """The recipe's torchft launch, record by record: the killed replica group's process (SIGKILLed, restarted by its
    torchrun) rejoined with the survivor's exact state, and no step was lost or repeated on the survivor. (The
    launch is the one a user of DataParallelStrategy(fault_tolerance="torchft") makes: one torchrun per group, one
    rank each, under a lighthouse; tests/dist/test_fault_tolerance.py tests the other outcomes.)"""
    from lightning_par.recipes import _ft_job as job

    steps = results["end_step"]
    alive, back = job.read_records(out, 0), [r for r in job.read_records(out, 1) if r["restart"] >= 1]
    # one restarted process trained: a restart that lost torchrun's port race (the recipe's spare) recorded nothing
    restarts = {r["restart"] for r in back}
    assert len(restarts) == 1, sorted(restarts)
    assert_only_port_races_after_the_kill((out / "torchrun-g1.log").read_text(errors="replace"), killed_local_rank=0)
    # no step lost or repeated on the survivor (with min_replicas=1 the first group to start may make step 1 alone,
    # the other then joins with its state: a survivor that joined so starts at the step it received + 1)
    assert [r["step"] for r in alive] == list(range(alive[0]["step"], steps + 1)) and alive[0]["step"] <= 3
    assert alive[0]["healed_at"] in (None, alive[0]["step"] - 1)
    assert back[0]["step"] == results["heal_step"] + 1 and back[-1]["step"] == steps
    assert all(r["participants"] == 2 for r in back)
    assert any(r["participants"] == 1 for r in alive) and alive[-1]["participants"] == 2
    # the LR schedule came along: both groups end on the same learning rate and the same checkpoint
    assert job.checkpoint_differences(out, steps) == []
    # Lightning's logger kept logging in the rejoined process, at the steps it continued from
    text = "\n".join(p.read_text() for p in (out / "logs1").rglob("metrics.csv"))
    assert "train_loss" in text and f",{steps - 1}," in text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", [n for n in RECIPES if n != "capacity"])  # capacity: its own test below
def test_quick_recipe_writes_its_report(name, tmp_path, capsys):
    results = run_quick(name, tmp_path, capsys)
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
        # the killed replica group came back, received the survivor's exact state, and both ended on the stop step
        # the recipe chose: 10 steps past every launch's furthest step once the group had healed, rounded up to a
        # checkpoint step (every 15; at most 300)
        assert results["killed"] and results["recovered"] and results["weights_equal_after_recovery"], results
        end = results["end_step"]
        assert results["steps_agree"] and results["final_step"] == end and results["steps_alone"] >= 1
        assert results["heal_step"] + 10 <= end <= 300 and end % 15 == 0 or end == 300, results
        assert results["recovery_s"] > 0 and results["ckpt_restart"]["steps_redone"] >= 1
        # all three launches ended on that step (the throughputs compare the same steps), the checkpoint restart
        # 10 or more steps past its kill step
        assert {t["final_step"] for t in results["throughput"].values()} == {end}, results["throughput"]
        assert end >= results["ckpt_restart"]["kill_step"] + 10 and len(results["curves"]["ckpt"]) == end
        _assert_torchft_launch(tmp_path / "torchft", results)
    if name == "pipeline_bubble":
        for res in results.values():
            assert all(0 < b < 1 for b in res["per_rank_bubble"]) and len(res["per_rank_bubble"]) == res["p"]
        for m in (2, 4):  # 1F1B holds at most min(p, m) of GPipe's m micro-batches of activations
            ratio = results[f"p2-m{m}-1f1b"]["activation_bytes"] / results[f"p2-m{m}-gpipe"]["activation_bytes"]
            assert ratio <= min(2, m) / m + 0.01, (m, ratio)
    if name == "memory":
        checkpointing = results.pop("checkpointing")
        # the issue's layouts, each mode: separate processes' peaks, net of the tiny-model fit under the same mode
        assert set(checkpointing) == {"single", "DP2", "PP2", "TP2"}, checkpointing.keys()
        for layout, modes in checkpointing.items():
            for mode, res in modes.items():
                ratio = res["predicted"]["total"] / res["measured_net"]
                assert 0.9 <= ratio <= 1.1, (layout, mode, res["predicted"], res["measured_net"])
            off, full = (modes[m]["measured_net"] - modes[m]["predicted"]["states"] for m in ("off", "full"))
            # full checkpointing keeps the blocks' inputs and recomputes one block: 4 blocks hold ~0.26 of off on
            # one device (TP2 ~0.25), a PP2 stage's 2 blocks ~0.3
            assert full < 0.45 * off, (layout, off, full)
        for layout, res in results.items():
            measured = max(sum(r[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
                           for r in res["rows"])
            # what ParallelMetrics measures: the saved tensors, not what backward adds beside them
            predicted = sum(res["predicted"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                          "activation_bytes")) - res["predicted"]["backward_bytes"]
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
            if layout.startswith(("local_sgd", "diloco")):  # replicas apart between syncs: not one device's losses
                from lightning_par.recipes._node_job import dp_options

                every = dp_options(layout)["sync_every"]
                for rate, r in by_rate.items():
                    assert len(set(r["eval_loss"])) == 1, (layout, rate, r)  # ended on a sync: one model
                    # one parameter all-reduce per H steps, plus every step's non-finite flag and their headers
                    assert r["link_bytes_per_step"] < res["dp"][rate]["link_bytes_per_step"] / every + 8192, r
                    assert r["drops"] == 0, (layout, rate, r)
                continue
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


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S)  # ~20 fits of 1-4 ranks, each a fresh process; ~1.5 min on 2 idle cores
def test_capacity_model_parallel_layouts_train_a_larger_gpt_within_the_budget(tmp_path, capsys):
    # --quick with a 48 MiB budget: the same ladder, smaller answers (fewer blocks to build and run)
    results = run_quick("capacity", tmp_path, capsys, overrides=["budget_gb=0.046875"])
    budget, layouts = results["budget_bytes"], results["layouts"]
    assert budget == 48 * 2**20 and set(layouts) == {"single", "DP2-ZeRO-3", "PP2", "TP2", "PP2xTP2"}
    one = layouts["single"]["largest_measured"]
    assert one is not None
    for name, res in layouts.items():
        best = res["largest_measured"]
        assert best is not None and res["largest_measured_params"] == results["params"][str(best)], (name, res)
        fit = res["measured"][str(best)]
        # measured on every rank of its own fit, net of the layout's tiny-model fit, within the budget
        assert len(fit["ranks"]) == res["devices"] and fit["fits"] and 0 < fit["model_net"] <= budget, (name, fit)
        assert all(r["held"] > 0 for r in fit["ranks"]), (name, fit)
        # the search bracketed it: the next rung was measured over budget (or it is the top of the ladder)
        rungs = results["ladder"]
        above = res["measured"].get(str(rungs[rungs.index(best) + 1])) if best != rungs[-1] else None
        assert best == rungs[-1] or (above is not None and not above["fits"]), (name, res["measured"])
        assert res["predicted_largest"] in results["ladder"] and res["predicted_largest_params"] > 0, (name, res)
        if name != "single":  # the seeds' claim in numbers: model parallelism trains a larger model
            assert best > one and res["largest_measured_params"] > layouts["single"]["largest_measured_params"]
    # two-way sharding holds less than one device's model per rank: PP2xTP2 the most of all
    assert layouts["PP2xTP2"]["largest_measured"] > max(layouts[n]["largest_measured"] for n in ("PP2", "TP2"))
    # the sequence axis: full activation checkpointing trains a longer sequence on one device, each fit measured
    # within the budget and the advisor within 10% of it there
    seq = results["sweeps"]["sequence"]["layouts"]
    off, full, cp2 = seq["sequence-single-off"], seq["sequence-single-full"], seq["sequence-CP2-off"]
    assert full["largest_measured"] > off["largest_measured"], (off, full)
    # context parallelism: cp 2 trains a longer sequence than one device (each rank holds half of it in the blocks)
    assert cp2["largest_measured"] > off["largest_measured"] and len(cp2["baseline"]) == 2, (off, cp2)
    for res in (off, full, cp2):
        best = str(res["largest_measured"])
        assert res["measured"][best]["fits"] and 0 < res["peak_at_largest"] <= budget, res
        assert 0.9 <= res["predicted_bytes"][best] / res["peak_at_largest"] <= 1.1, res


def test_unknown_recipe_setting_fails_naming_it(tmp_path):
    from lightning_par.cli_errors import UsageError

    with pytest.raises(UsageError, match="`nonsense` is not a setting of the recipe decision"):
        recipe(["decision", "nonsense=1", "--quick", "--out", str(tmp_path)])
