"""One replica group's training job for the fault-tolerance runs, and the launcher that starts a lighthouse, the
replica groups and the kill (used by ``lightning-par-recipe fault_tolerance`` and ``tests/dist/test_fault_tolerance.py``).

    python -m lightning_par.recipes._ft_job --out DIR --steps 40             # under torchrun, one per replica group
    python -m lightning_par.recipes._ft_job --mode ckpt --out DIR --steps 40  # 2 ranks of plain DDP, resumed from disk

The module is a plain ``LightningModule`` (an MLP regressor, AdamW with a per-step LR schedule): nothing in it
knows lightning_par. Every process appends one JSON line per optimizer step to ``DIR/rec<id>.jsonl`` (``id`` =
REPLICA_GROUP_ID, or the rank in ``ckpt`` mode): the step (Lightning's ``global_step`` and torchft's), the live
replica groups, the loss, the wall clock, and sha256 digests of the parameters and optimizer state at the step's
start and end, of the parameters alone at its end, and of local SGD / DiLoCo's sync state (equal digests = bit-equal
states). ``DIR/pid<id>-<restart>`` holds the worker's pid, which the launcher SIGKILLs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.recipes.ports import free_port


ATTEMPT_ENV = "LIGHTNING_PAR_FT_ATTEMPT"  # a relaunch's attempt number (torchrun's restart count otherwise)


def attempt() -> int:
    """How many times this process's run was started before: relaunches plus torchrun's restarts."""
    return int(os.environ.get(ATTEMPT_ENV, 0)) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class Stack(nn.Module):
    """An input layer, ``depth`` residual-free Linear+Tanh blocks (the stack a pipeline splits) and a head."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 32, lr: float = 1e-2, depth: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.net = Stack(width, depth) if depth else nn.Sequential(nn.Linear(16, width), nn.Tanh(),
                                                                     nn.Linear(width, width), nn.Tanh(),
                                                                     nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = 1024, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def state_digest(module: nn.Module, optimizer) -> str:
    """sha256 over every parameter's and optimizer-state tensor's bytes and the groups' hyper-parameters."""
    from lightning_par.dp.ft import local_optimizer_state  # DTensors as this rank's shards

    h = _hash_params(hashlib.sha256(), module)
    sd = local_optimizer_state(optimizer)
    for idx in sorted(sd["state"]):
        for key in sorted(sd["state"][idx]):
            v = sd["state"][idx][key]
            h.update(f"{idx}.{key}".encode())
            h.update(v.cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode())
    return h.hexdigest()


def sync_digest(strategy) -> str | None:
    """sha256 of this rank's local SGD / DiLoCo shared state (the step count, the last synced parameters, the outer
    momentum), if any."""
    engine = getattr(strategy, "_engine", None)
    state = engine.sync_state(own=True) if engine is not None else None  # this rank's: no collective
    if state is None:
        return None
    own = state["own"]["sync"]
    h = hashlib.sha256(repr(own["since"]).encode())
    for t in own.get("synced", []):
        h.update(t.contiguous().numpy().tobytes())
    for entry in (own.get("outer") or {}).get("state", {}).values():
        h.update(entry["momentum_buffer"].contiguous().numpy().tobytes())
    return h.hexdigest()


def params_digest(module: nn.Module) -> str:
    """sha256 of this rank's parameters alone (its stage's, its shards)."""
    return _hash_params(hashlib.sha256(), module).hexdigest()


def _hash_params(h, module: nn.Module):
    """``h`` updated with each of this rank's parameters, by name (DTensors as this rank's shards)."""
    from lightning_par.dp.ft import local_module_state

    params = dict(module.named_parameters())
    for name, p in local_module_state(module).items():
        if name in params:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h


STOP_FILE = "stop_at"  # DIR/stop_at: a step every process stops after (written by a launcher while they run)


class StepRecord(pl.Callback):
    """One JSON line per optimizer step (see the module's doc); ``sleep_s`` after each makes steps last. Training
    stops after the step named in ``DIR/stop_at`` once that file exists (all groups end on the same step)."""

    def __init__(self, path: Path, sleep_s: float):
        self.path, self.sleep_s = path, sleep_s

    def _replica(self, trainer):
        ft = getattr(trainer.strategy, "_ft", None)  # the strategy's fault tolerance (its replica once joined)
        return ft.replica if ft is not None else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = state_digest(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replica = self._replica(trainer)
        row = {"step": trainer.global_step, "ft_step": replica.step if replica else None,
               "participants": replica.participants if replica else None,
               "healed_at": replica.healed_at if replica else None, "epoch": trainer.current_epoch,
               "loss": float(outputs["loss"]), "time": time.time(), "before": self._before,
               "after": state_digest(pl_module, trainer.optimizers[0]), "params": params_digest(pl_module),
               "sync": sync_digest(trainer.strategy), "restart": attempt()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        time.sleep(self.sleep_s)
        stop = self.path.parent / STOP_FILE
        if stop.exists() and trainer.global_step >= int(stop.read_text() or 10**9):
            trainer.should_stop = True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ft", "ckpt"), default="ft")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds after every step")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--ft-timeout", type=float, default=30.0)
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="ft mode: resume from last.ckpt (a whole-job restart)")
    p.add_argument("--pp", type=int, default=0, help="HybridParallelStrategy with this many stages (0: DDP)")
    p.add_argument("--tp", type=int, default=1, help="with --pp: tensor-parallel ranks per stage")
    p.add_argument("--sync", default="every_step", help="the data axis' sync (local_sgd, diloco)")
    p.add_argument("--sync-every", type=int, default=1)
    args = p.parse_args(argv)
    from lightning_par import DataParallelStrategy, HybridParallelStrategy

    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    ident = (rank_ident(int(os.environ.get("REPLICA_GROUP_ID", "0")), int(os.environ.get("RANK", "0")), nproc)
             if args.mode == "ft" else os.environ.get("RANK", "0"))
    restart = str(attempt())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pid{ident}-{restart}").write_text(str(os.getpid()))
    if args.mode == "ft" and restart == "0":  # all groups start together (imports take seconds under load)
        _wait_for(lambda: all((args.out / f"pid{rank_ident(g, r, nproc)}-0").exists()
                              for g in range(int(os.environ["NUM_REPLICA_GROUPS"])) for r in range(nproc)),
                  timeout_s=300)
    torch.manual_seed(int(restart))  # a restarted process starts from other weights: a peer's must replace them
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    ckpt_dir = args.out / (f"ckpt-g{group}" if args.mode == "ft" else "ckpt")
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0,
                                              every_n_train_steps=args.ckpt_every)
    ft_args = dict(fault_tolerance="torchft", min_replicas=args.min_replicas, ft_timeout=args.ft_timeout) \
        if args.mode == "ft" else dict(timeout=300)  # a restarted rank may wait for its peer's imports
    sync = dict(sync=args.sync, sync_every=args.sync_every)
    if args.pp:
        strategy = HybridParallelStrategy(pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp, **sync,
                                          **ft_args)
    else:
        strategy = DataParallelStrategy(**sync, **ft_args)
    devices = nproc
    if args.mode == "ft":
        resume = "last" if args.resume else None
    else:
        resume = "last" if (ckpt_dir / "last.ckpt").exists() else None
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps,
                         callbacks=[StepRecord(args.out / f"rec{ident}.jsonl", args.sleep), checkpoint],
                         logger=pl.loggers.CSVLogger(args.out, name=f"logs{ident}"), enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True)
    trainer.fit(Regressor(width=args.width, depth=4 if args.pp else 0), loader, ckpt_path=resume)


def rank_ident(group: int, rank: int, nproc: int) -> str:
    """How a fault-tolerant process names its files: its replica group, and with several ranks per group its rank."""
    return str(group) if nproc == 1 else f"{group}_{rank}"


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for the other replica groups to start")
        time.sleep(0.05)


# -- the launcher --------------------------------------------------------------------------------------------------


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000):
    """``torchft_lighthouse`` (the console script of torchft's wheel) on a free port: (process, its address)."""
    port = free_port()
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    cmd = [str(exe) if exe.exists() else "torchft_lighthouse", "--min_replicas", str(min_replicas),
           "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
           "--quorum_tick_ms", "20", "--bind", f"[::]:{port}"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://localhost:{port}"


def start_group(out: Path, job_args: list[str], *, group_id: int | None, num_groups: int, lighthouse: str | None,
                max_restarts: int, nproc: int = 1, attempt: int = 0) -> subprocess.Popen:
    """One torchrun (its own store) running :func:`main`; ``group_id=None``: plain DDP over ``nproc`` ranks;
    ``attempt``: the how-manyth launch of the same run (a whole-job relaunch that resumes from its checkpoint)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{ATTEMPT_ENV: str(attempt)},
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # restarted ranks reconnect (README: torch issue 135712)
    if group_id is not None:
        env.update(REPLICA_GROUP_ID=str(group_id), NUM_REPLICA_GROUPS=str(num_groups), TORCHFT_LIGHTHOUSE=lighthouse)
    name = f"g{group_id}" if group_id is not None else "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--monitor-interval", "0.2", "-m", "lightning_par.recipes._ft_job", "--out", str(out), *job_args]
    log = (out / f"torchrun-{name}.log").open("ab")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def read_records(out: Path, ident: int) -> list[dict]:
    path = out / f"rec{ident}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def try_kill(out: Path, ident: int, steps: int) -> tuple[float, int] | None:
    """SIGKILL process ``ident``'s worker if it has recorded ``steps`` steps: (time of the kill, its last step)."""
    rows = read_records(out, ident)
    if len(rows) < steps:
        return None
    pid = int((out / f"pid{ident}-{rows[-1]['restart']}").read_text())
    os.kill(pid, signal.SIGKILL)
    return time.time(), rows[-1]["step"]


def kill_after(out: Path, ident: int, steps: int, timeout_s: float, procs=()) -> tuple[float, int]:
    """:func:`try_kill` as soon as it can; a launch that ends or a timeout first is an error."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        killed = try_kill(out, ident, steps)
        if killed:
            return killed
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise RuntimeError(f"process {ident} did not record {steps} steps in {timeout_s:.0f} s (logs in {out})")


def summarize_kill(out: Path, *, survivor: int, killed: int, kill_time: float, kill_step: int) -> dict:
    """What a kill of replica group ``killed`` did, from the records (see the module's doc)."""
    alive, lost = read_records(out, survivor), read_records(out, killed)
    back = [r for r in lost if r["restart"] >= 1]
    by_step = {r["step"]: r for r in alive}
    first = back[0] if back else None
    common = [r for r in back if r["step"] in by_step]
    return {
        "killed": any(r["restart"] == 0 for r in lost),
        "recovered": bool(first and first["healed_at"] is not None and first["healed_at"] >= kill_step),
        "heal_step": first["healed_at"] if first else None,
        # the rejoined replica's parameters and optimizer state at the start of its first step, and after every
        # step from then on, are bit-equal to the survivor's
        "weights_equal_after_recovery": bool(common) and common[0] is first
        and first["before"] == by_step[first["step"]]["before"]
        and all(r["after"] == by_step[r["step"]]["after"] for r in common),
        "steps_agree": all(r["step"] == r["ft_step"] for r in alive + lost),  # global_step == torchft's step
        "final_step": min(alive[-1]["step"], lost[-1]["step"]) if back else alive[-1]["step"],
        "steps_alone": sum(1 for r in alive if r["step"] > kill_step and r["participants"] == 1),
        "recovery_s": first["time"] - kill_time if first else None,
        "kill_step": kill_step,
    }


def stop_after_rejoin(out: Path, ident, steps_after: int, every: int, timeout_s: float, procs=()) -> int:
    """Once restarted process ``ident`` has recorded a step, have every process stop ``steps_after`` or more steps
    later, on a multiple of ``every`` (a checkpoint step): returns that step."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        back = [r for r in read_records(out, ident) if r["restart"] >= 1]
        if back:
            stop = -(-(back[0]["step"] + steps_after) // every) * every
            write_stop(out, stop)
            return stop
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise RuntimeError(f"process {ident} did not come back within {timeout_s:.0f} s (logs in {out})")


def write_stop(out: Path, step: int) -> None:
    """Have every process of the launch in ``out`` stop after ``step`` (atomically: a reader sees all or nothing)."""
    tmp = out / f".{STOP_FILE}"
    tmp.write_text(str(step))
    tmp.rename(out / STOP_FILE)


def last_step(out: Path, idents=(0, 1)) -> int:
    """The highest step any process of the launch in ``out`` has recorded (0 before the first)."""
    return max((r["step"] for i in idents for r in read_records(out, i)), default=0)


def log_tail(out: Path, name: str, chars: int = 3000) -> str:
    """The end of torchrun's log of group ``name`` (``g0``, ``g1``, ``ckpt``)."""
    return (out / f"torchrun-{name}.log").read_text(errors="replace")[-chars:]


def stop(procs, lighthouse) -> None:
    """End the launch: what still runs of ``procs`` (with its session), then the lighthouse."""
    wait_all(procs, timeout_s=1)
    lighthouse.kill()
    lighthouse.wait()


def checkpoint_differences(out: Path, steps: int, groups: int = 2) -> list[str]:
    """How the groups' last checkpoints differ from group 0's and from a checkpoint of step ``steps`` ([]: not at
    all, bit for bit: step, LR schedulers, every module entry). A group's last checkpoint is its newest
    ``last*.ckpt``: a restarted process's ModelCheckpoint writes ``last-v1.ckpt`` beside the one its predecessor
    saved before it was killed."""
    ckpts = [torch.load(max((out / f"ckpt-g{g}").glob("last*.ckpt"), key=lambda f: f.stat().st_mtime_ns),
                        weights_only=False) for g in range(groups)]
    first, problems = ckpts[0], []
    for g, c in enumerate(ckpts):
        if c["global_step"] != steps:
            problems.append(f"group {g} saved step {c['global_step']}, not {steps}")
        if c["lr_schedulers"] != first["lr_schedulers"]:
            problems.append(f"group {g}'s LR schedulers differ")
        if sorted(c["state_dict"]) != sorted(first["state_dict"]):
            problems.append(f"group {g} saved other entries")
            continue
        problems += [f"group {g}: {k}" for k, v in c["state_dict"].items()
                     if not torch.equal(v, first["state_dict"][k])]
    return problems


def wait_all(procs, timeout_s: float) -> list[int]:
    """Exit codes of ``procs`` (each killed with its session if still running after ``timeout_s``)."""
    deadline, codes = time.time() + timeout_s, []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes.append(proc.wait())
    return codes


if __name__ == "__main__":
    main()
