"""fault_tolerance: lose a data-parallel replica mid-run, keep training, recover it from a live peer
(recipes/fault_tolerance/README.md).

Three launches of the same job (:mod:`lightning_par.recipes._ft_job`, a plain LightningModule):

1. ``DataParallelStrategy(fault_tolerance="torchft")``: ``torchft_lighthouse`` and two replica groups, one torchrun
   each; group 1's worker is SIGKILLed, its torchrun restarts it, it rejoins with group 0's state;
2. plain DDP on 2 ranks (one torchrun), uninterrupted: the reference loss curve and throughput;
3. the same DDP run killed at the same step: the job is launched again and resumes from ``last.ckpt``.

[Note: the checkpoint restart is a relaunch]
Without fault tolerance a lost rank fails the whole job: torchrun stops the other rank, and the job starts again
from its last checkpoint. The recipe relaunches it (a new torchrun, as a scheduler's requeue would) as soon as the
killed launch has exited, rather than through torchrun's ``--max-restarts``: on this machine a restarted gloo
rendezvous sometimes failed to connect (the new rank 1 refused by a stale address) when the cores were loaded.

[Note: the run ends after the recoveries]
The launches do not run a fixed number of steps: once the restarted replica group has healed and made a step, the
recipe writes one stop step into every launch's directory (``_ft_job.STOP_FILE``): ``steps_after_recovery`` past the
furthest step any launch has made, rounded up to a checkpoint step (a multiple of ``ckpt_every``), at most ``steps``.
Every launch ends on that step, with a ``last.ckpt`` of it, so the throughputs compare the
same steps, and the checkpoint restart, relaunched meanwhile, ends at least as far past its kill step. A fixed count
had to outlast the slowest restart under load (300 quick steps of 0.15 s: the test's slowest minute and a half).
"""
from __future__ import annotations

import time
from pathlib import Path

from lightning_par.recipes import _ft_job as job
from lightning_par.recipes.common import Report, figure, savefig

RUNS = {"torchft": "torchft, one replica killed", "ddp": "DDP, uninterrupted", "ckpt": "DDP killed, restarted from its checkpoint"}


def _job_args(cfg, mode: str) -> list[str]:
    return ["--mode", mode, "--steps", str(cfg.steps), "--sleep", str(cfg.sleep_s), "--width", str(cfg.width),
            "--batch", str(cfg.batch), "--ckpt-every", str(cfg.ckpt_every), "--ft-timeout", "30"]


def _latest(rows: list[dict]) -> dict[int, dict]:
    """The last record of every step (a checkpoint restart records the steps it redoes again)."""
    return {r["step"]: r for r in rows}


def _curve(out: Path, idents=(0, 1)) -> dict[int, float]:
    """Loss per step: the mean over the replicas that made the step (rank-local losses, as DDP logs them)."""
    per = [_latest(job.read_records(out, i)) for i in idents]
    steps = sorted(set().union(*per))
    return {s: sum(p[s]["loss"] for p in per if s in p) / sum(1 for p in per if s in p) for s in steps}


def _throughput(out: Path, batch: int, idents=(0, 1)) -> dict:
    rows = [r for i in idents for r in job.read_records(out, i)]
    first, last = min(r["time"] for r in rows), max(r["time"] for r in rows)
    final = max(r["step"] for r in rows)
    live = {}  # step -> replicas that made it (the last attempt of a redone step)
    for i in idents:
        for s in _latest(job.read_records(out, i)):
            live[s] = live.get(s, 0) + 1
    samples = batch * sum(live.values())
    return {"final_step": final, "train_s": last - first, "steps_per_s": final / (last - first),
            "samples_per_s": samples / (last - first), "recorded_steps": len(rows)}


def _start(cfg, out: Path, mode: str, lighthouse: str | None = None) -> list:
    out.mkdir(parents=True, exist_ok=True)
    if mode == "ft":
        # group 1: one restart for the kill, and one for the race of its restarted rank with other processes for
        # the port its torchrun picked (docs/limitations.md, Launching)
        return [job.start_group(out, _job_args(cfg, "ft"), group_id=g, num_groups=2, lighthouse=lighthouse,
                                max_restarts=2 if g == 1 else 0) for g in range(2)]
    return [job.start_group(out, _job_args(cfg, "ckpt"), group_id=None, num_groups=1, lighthouse=None,
                            max_restarts=0, nproc=2)]


def _drive(cfg, dirs: dict[str, Path], procs: dict[str, list]) -> tuple[dict[str, tuple[float, int]], int]:
    """Run the three launches to their end: SIGKILL process 1 of ``torchft`` and ``ckpt`` once it has recorded
    ``kill_after`` steps, relaunch ``ckpt`` once its killed launch has exited, and choose the step every launch
    stops at ([Note: the run ends after the recoveries]). Returns the kills (time, step) and that step; a launch
    that ends before its kill is an error."""
    kills: dict[str, tuple[float, int]] = {}
    end, relaunched, deadline = None, False, time.time() + cfg.timeout_s
    while not (relaunched and all(p.poll() is not None for ps in procs.values() for p in ps)):
        for name in ("torchft", "ckpt"):
            if name not in kills and (killed := job.try_kill(dirs[name], 1, cfg.kill_after)):
                kills[name] = killed
        if "ckpt" in kills and not relaunched and all(p.poll() is not None for p in procs["ckpt"]):
            # [Note: the checkpoint restart is a relaunch]
            procs["ckpt"] = [job.start_group(dirs["ckpt"], _job_args(cfg, "ckpt"), group_id=None, num_groups=1,
                                             lighthouse=None, max_restarts=0, nproc=2, attempt=1)]
            relaunched = True
        if end is None and "torchft" in kills and _rejoined(dirs["torchft"]):
            # at least `steps_after_recovery` past the checkpoint restart's kill step too, and past every step
            # already made (a launch past the stop step would stop later than the others)
            ahead = max(cfg.kill_after, *(job.last_step(d) for d in dirs.values()))
            # on a checkpoint step: every launch's `last.ckpt` then holds the end step, and the groups' compare
            end = min(cfg.steps, -(-(ahead + cfg.steps_after_recovery) // cfg.ckpt_every) * cfg.ckpt_every)
            for d in dirs.values():
                job.write_stop(d, end)
        waiting = [p for name in ("torchft", "ckpt") if name not in kills for p in procs[name]]
        if time.time() > deadline or any(p.poll() is not None for p in waiting):
            raise RuntimeError(f"{sorted({'torchft', 'ckpt'} - set(kills))} did not record {cfg.kill_after} steps, "
                               f"or the run outlived timeout_s={cfg.timeout_s} (logs under "
                               f"{next(iter(dirs.values())).parent})")
        time.sleep(0.05)
    return kills, end if end is not None else cfg.steps


def _rejoined(out: Path) -> bool:
    """Whether the restarted replica group has made a step after healing from the survivor."""
    return any(r["restart"] >= 1 and r["healed_at"] is not None for r in job.read_records(out, 1))


def run(cfg, out_dir: Path, command: str) -> Report:
    if not 0 < cfg.kill_after < cfg.steps // 4:
        raise ValueError(f"`kill_after={cfg.kill_after}` must be between 1 and steps/4 ({cfg.steps // 4}): the "
                         f"restarted replica must find the survivor still training.")
    dirs = {name: out_dir / name for name in RUNS}
    # The three launches run at the same time, so they share the cores alike and their throughputs compare.
    lighthouse, address = job.start_lighthouse(min_replicas=1)
    procs = {}
    try:
        procs = {"torchft": _start(cfg, dirs["torchft"], "ft", address), "ddp": _start(cfg, dirs["ddp"], "ckpt"),
                 "ckpt": _start(cfg, dirs["ckpt"], "ckpt")}
        kills, end = _drive(cfg, dirs, procs)
        codes = {name: job.wait_all(ps, timeout_s=1) for name, ps in procs.items()}
    finally:
        for ps in procs.values():
            job.wait_all(ps, timeout_s=1)
        lighthouse.kill()
        lighthouse.wait()
    if any(any(c) for c in codes.values()):
        raise RuntimeError(f"a launch failed (exit codes {codes}); the torchrun logs are under {out_dir}")
    (kill_time, kill_step), (ckpt_kill_time, ckpt_kill_step) = kills["torchft"], kills["ckpt"]
    res = job.summarize_kill(dirs["torchft"], survivor=0, killed=1, kill_time=kill_time, kill_step=kill_step)
    alive = job.read_records(dirs["torchft"], 0)
    after_kill = [r for r in alive if r["step"] >= kill_step]
    res["survivor_pause_s"] = after_kill[1]["time"] - after_kill[0]["time"] if len(after_kill) > 1 else None
    # steps before both groups were in one quorum (the first to start trains alone until the other joins)
    res["steps_before_both_joined"] = max(min(r["step"] for r in job.read_records(dirs["torchft"], g)
                                              if r["restart"] == 0) for g in range(2)) - 1
    redo = [r for r in job.read_records(dirs["ckpt"], 0) if r["restart"] >= 1]
    res["ckpt_restart"] = {
        "kill_step": ckpt_kill_step, "resumed_from_step": redo[0]["step"] - 1 if redo else None,
        "steps_redone": ckpt_kill_step - (redo[0]["step"] - 1) if redo else None,
        # kill -> back at the step it was killed at (restart, checkpoint load, redone steps)
        "recovery_s": next((r["time"] for r in redo if r["step"] > ckpt_kill_step), float("nan")) - ckpt_kill_time,
    }
    res["end_step"] = end  # [Note: the run ends after the recoveries]
    res["throughput"] = {name: _throughput(path, cfg.batch) for name, path in dirs.items()}
    curves = {name: _curve(path) for name, path in dirs.items()}
    res["curves"] = {k: [v[s] for s in sorted(v)] for k, v in curves.items()}
    res["final_loss"] = {k: v[max(v)] for k, v in curves.items()}
    together = [s for s in curves["torchft"] if res["steps_before_both_joined"] < s <= kill_step]
    res["max_loss_diff_vs_ddp_before_kill"] = (max(abs(curves["torchft"][s] - curves["ddp"][s]) for s in together)
                                               if res["steps_before_both_joined"] == 0 and together else None)
    return _report(cfg, command, out_dir, res, curves, alive)


def _report(cfg, command, out_dir, res, curves, alive) -> Report:
    report = Report(
        title="fault_tolerance: lose a data-parallel replica, keep training, recover it from a live peer (torchft)",
        command=command,
        published=("the seeds: data parallelism recovers easily, a failed device reloads the model state of the "
                   "other replicas (“若某台设备发生故障，可通过重新加载其他设备的模型状态进行恢复”); torchft's per-step "
                   "fault tolerance: a lighthouse quorum per step, live recovery from a healthy peer without a "
                   "checkpoint on disk (pytorch/torchft)"),
        data=res,
    )
    ck = res["ckpt_restart"]
    report.tables.append(("What the kill did", ["", "torchft (replica groups)", "DDP + checkpoint restart"], [
        ["killed at step", res["kill_step"], ck["kill_step"]],
        ["recovered", res["recovered"], ck["resumed_from_step"] is not None],
        ["steps the survivor made alone", res["steps_alone"], 0],
        ["steps lost and redone", 0, ck["steps_redone"]],
        ["time to recover (s)", res["recovery_s"], ck["recovery_s"]],
        ["rejoined replica bit-equal to the survivor (params + AdamW state)", res["weights_equal_after_recovery"], "-"],
        ["global_step == torchft step on every record", res["steps_agree"], "-"],
        ["final step", res["final_step"], res["throughput"]["ckpt"]["final_step"]],
    ]))
    tp = res["throughput"]
    report.tables.append(("Throughput from the first step to the last (steps include a sleep of "
                          f"{cfg.sleep_s} s; samples = {cfg.batch} per live replica per step)",
                          ["run", "steps/s", "samples/s", "final loss", "train s"],
                          [[RUNS[k], tp[k]["steps_per_s"], tp[k]["samples_per_s"], res["final_loss"][k],
                            tp[k]["train_s"]] for k in RUNS]))
    report.figures.append(("Loss per step (mean over the live replicas)", savefig(_plot_loss(curves, res, alive),
                                                                                  out_dir, "loss.png")))
    report.figures.append(("Throughput and time to recover", savefig(_plot_throughput(res), out_dir,
                                                                     "throughput.png")))
    report.notes += [
        f"The survivor (group 0) paused {res['survivor_pause_s']:.2f} s after the kill (its all-reduce failed, then the "
        f"lighthouse waited for the dead group's heartbeat to time out), retried the step with a quorum of one and "
        f"went on alone for {res['steps_alone']} steps at half the global batch, while torchrun restarted group 1.",
        f"The restarted process (other random weights: seed 1) joined the quorum in the strategy's setup, received "
        f"group 0's checkpoint from memory (torchft's HTTP transport) at step {res['heal_step']}, and Lightning resumed "
        "from it as from a file: weights, AdamW moments, LR schedule, loop counters. Its parameters and optimizer "
        "state at the start of its first step, and after every later step, hash to the survivor's "
        f"(sha256): {res['weights_equal_after_recovery']}.",
        _before_kill_note(res),
        f"Every launch stopped at step {res['end_step']}, chosen when the restarted replica group had healed: "
        f"{cfg.steps_after_recovery} steps past the furthest step any launch had made then, rounded up to a "
        f"checkpoint step (every {cfg.ckpt_every}; at most {cfg.steps}), "
        "so the three throughputs cover the same steps and the checkpoint restart ends past its kill step too.",
        f"The checkpoint restart loses the steps since its last checkpoint (every {cfg.ckpt_every}) and the restart of "
        "every rank; torchft loses no step, only the lost replica's share of the batch while it is away.",
        "Both replica groups, the lighthouse and the DDP ranks share this machine's cores; absolute seconds follow "
        "the load (a process start is seconds of imports), read the ratios.",
    ]
    return report


def _before_kill_note(res) -> str:
    if res["max_loss_diff_vs_ddp_before_kill"] is not None:
        return (f"Both groups started in one quorum, and until the kill torchft equals DDP on the same batches: largest "
                f"loss difference {res['max_loss_diff_vs_ddp_before_kill']:.1e} (fp32 round-off: the groups average by "
                "sum-then-divide, DDP divides first). After it the survivor's steps see half the data: the curves part.")
    return (f"The first group to start trained {res['steps_before_both_joined']} step(s) alone before the other "
            "joined and received its state (with min_replicas=1 a quorum does not wait for a group that is still "
            "importing), so the curves differ from DDP's from the start; tests/dist/test_fault_tolerance.py checks "
            "torchft against DDP step by step with a lighthouse that waits for both.")


def _plot_loss(curves, res, alive):
    fig, ax = figure(7, 4)
    for key, curve in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], label=RUNS[key], lw=1)
    ax.axvline(res["kill_step"], color="k", ls="--", lw=0.8, label="SIGKILL")
    if res["heal_step"] is not None:
        ax.axvline(res["heal_step"], color="g", ls=":", lw=0.8, label="rejoined (torchft)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    twin = ax.twinx()
    twin.step([r["step"] for r in alive], [r["participants"] for r in alive], color="0.6", lw=0.8, where="post")
    twin.set_ylim(0, 3)
    twin.set_ylabel("live replica groups (torchft)")
    ax.legend(fontsize=8)
    return fig


def _plot_throughput(res):
    fig, a = figure(9, 3.5)
    a.remove()
    a, b = fig.subplots(1, 2)
    keys = list(RUNS)
    a.bar(range(3), [res["throughput"][k]["samples_per_s"] for k in keys], 0.6)
    a.set_xticks(range(3), ["torchft\n(killed)", "DDP", "DDP killed,\nckpt restart"])
    a.set_ylabel("samples / s (first to last step)")
    b.bar(range(2), [res["recovery_s"] or 0, res["ckpt_restart"]["recovery_s"]], 0.6)
    b.set_xticks(range(2), ["torchft: kill to\nrejoined step", "ckpt: kill to back\nat the killed step"])
    b.set_ylabel("seconds")
    return fig
