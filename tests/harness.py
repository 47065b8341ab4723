"""Shared machinery of the strategy tests: run a Lightning fit on real ranks and record what happened,
run the same fit in one process as the reference, and compare the two.

A distributed fit runs under Lightning's own launcher with ``start_method="fork"``: the pytest process
never joins a process group, every rank (rank 0 included) is a child. Results come back through files
written by :class:`Recorder` (a child's objects never reach the caller).

Data order: in a distributed fit Lightning replaces the training sampler by
``DistributedSampler(shuffle=True, seed=0)``. :func:`reference_loader` builds the one-replica version of
that sampler, whose step-``i`` batch of ``B`` samples is exactly the union of the ranks' step-``i``
batches of ``B / dp`` samples, so one process sees the same global batches as the parallel run.
"""
from __future__ import annotations

import copy
import functools
import glob
import hashlib
import os
import re
import signal
import tempfile
from typing import Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler, default_collate

# the port of a rendezvous of ranks a test starts itself, picked as the recipes' launcher picks its own
# ([Note: a free port below the ephemeral range])
from lightning_par.recipes.ports import free_port  # noqa: F401  (the tests import it from here)
from lightning_par.strategies import HybridParallelStrategy
from models import corpus, warm_gpt
from ranks import _as_torchrun_rank, fork_as_torchrun, output_to, start_ranks  # noqa: F401  (re-exported)

# What a launch leaves in this process's environment (Lightning's launchers and `_init_dist_connection` set
# MASTER_ADDR / MASTER_PORT, a cluster environment may set NODE_RANK / LOCAL_RANK): a later test's subprocess
# inherits it, and a LOCAL_RANK there makes Lightning believe its ranks were launched externally, so the script
# starts no ranks of its own and waits for them until its timeout.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


TIMEOUT_S = 240  # per distributed test; hangs are the usual failure


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def _is_meta(t: torch.Tensor) -> bool:
    from lightning_par.materialize import is_meta

    return is_meta(t)


def _scalar(x) -> float | None:
    if isinstance(x, dict):
        x = x.get("loss")
    if isinstance(x, torch.Tensor):
        return float(_full(x))
    return None if x is None else float(x)


class Recorder(pl.Callback):
    """Per rank: the loss of every training batch, the gradients seen before every optimizer step,
    the final parameters and the callback metrics, saved to ``<out_dir>/rank<r>.pt`` at the end of fit.

    Names are the module's own parameter names; a rank that holds no gradient for a parameter (a
    pipeline stage that does not own it) records none. DTensors are gathered to full tensors.
    """

    def __init__(self, out_dir: str, grads: bool = True):
        self.out_dir, self.grads = out_dir, grads
        self.losses: list[float | None] = []
        self.grad_steps: list[dict[str, torch.Tensor]] = []
        self.adam_steps: list[dict[str, tuple]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(_scalar(outputs))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads:
            self.grad_steps.append(
                {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
            )
            self.adam_steps.append(_adam_settings(pl_module, optimizer))

    def on_fit_end(self, trainer, pl_module):
        # a pipeline stage holds what other stages own as meta tensors (no storage): not recorded
        params = {n: _full(p) for n, p in pl_module.named_parameters() if not _is_meta(p)}
        metrics = {k: float(_full(v)) for k, v in trainer.callback_metrics.items()}
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(
            {"rank": trainer.global_rank, "losses": self.losses, "grads": self.grad_steps, "params": params,
             "adam": self.adam_steps, "metrics": metrics, "global_step": trainer.global_step},
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


class SavePredictions(pl.Callback):
    """Each rank's predictions of ``trainer.predict``, concatenated, to ``<out_dir>/pred<rank>.pt``."""
    def __init__(self, out_dir):
        self.out_dir, self.preds = out_dir, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.preds.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(torch.cat(self.preds), os.path.join(self.out_dir, f"pred{trainer.global_rank}.pt"))


class SharesSequences(pl.Callback):
    """Fails the run unless every block (of the stage) runs on pieces of the sequence while training, and no hook of
    context parallelism is left on the module once fit ends."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        blocks = self.stage_blocks(trainer)
        if not blocks or not all(b._forward_pre_hooks for b in blocks):
            raise AssertionError("context parallelism is not installed on the blocks")
        self.blocks = blocks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        context = trainer.strategy._engine.context
        if context is None or context._seq != batch[0].shape[1] or context._modes:
            raise AssertionError("the blocks did not run on pieces of the sequence, or a routing mode was left")

    def stage_blocks(self, trainer):  # a pipeline stage's own blocks (its other blocks are ghosts)
        from lightning_par.pipeline.ghost import Ghost

        return [b for b in trainer.lightning_module.get_submodule(trainer.strategy._engine.context.path)
                if not isinstance(b, Ghost)]

    def teardown(self, trainer, pl_module, stage):  # a pipeline stage keeps its own hooks: none of cp's is left
        hooks = [h for b in self.blocks for h in (*b._forward_pre_hooks.values(), *b._forward_hooks.values())]
        if trainer.strategy._engine.context is not None or any("ContextParallel" in h.__qualname__ for h in hooks):
            raise AssertionError("hooks were left on the blocks after teardown")


class LossPieces(pl.Callback):
    """Each rank's verdict of context parallelism's loss check ([Note: sharded to the loss]) and the shapes of the
    logits its ``head`` made, to ``<out_dir>/loss<rank>.pt``."""

    def __init__(self, out_dir, head: str):
        self.out_dir, self.head, self.shapes = out_dir, head, []

    def on_train_start(self, trainer, pl_module):
        pl_module.get_submodule(self.head).register_forward_hook(lambda m, a, out: self.shapes.append(tuple(out.shape)))

    def on_train_end(self, trainer, pl_module):
        loss = trainer.strategy._engine.context.loss
        torch.save({"sharded": loss.sharded, "why": loss.why, "shapes": self.shapes},
                   os.path.join(self.out_dir, f"loss{trainer.global_rank}.pt"))


def trainer_kwargs(**overrides) -> dict:
    """Quiet, deterministic CPU trainer settings for tests (override any)."""
    kw = dict(accelerator="cpu", deterministic=True, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              limit_val_batches=0)
    kw.update(overrides)
    return kw


def fit_and_record(module: pl.LightningModule, train_loader: DataLoader, out_dir: str, *, strategy="auto",
                   devices=1, max_steps: int = 3, callbacks=(), val_loader=None, ckpt_path: str | None = None,
                   **overrides) -> list[dict]:
    """Run ``trainer.fit`` (resuming from ``ckpt_path`` if given) and return every rank's record, rank order."""
    for old in glob.glob(os.path.join(out_dir, "rank*.pt")):
        os.remove(old)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, max_steps=max_steps,
                                          callbacks=[Recorder(out_dir), *callbacks], **overrides))
    trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt_path)
    files = sorted(glob.glob(os.path.join(out_dir, "rank*.pt")), key=lambda f: int(f.rsplit("rank", 1)[1][:-3]))
    return [torch.load(f, weights_only=False) for f in files]


def reference_loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """One process, the same global batches as Lightning's distributed sampler gives N ranks (see top)."""
    return DataLoader(dataset, batch_size=batch_size,
                      sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))


# [Note: one-process references are fitted once per session]
# Many distributed tests compare with the same one-process fit (the same model factory, data, global batch and
# trainer settings), e.g. every parametrization of a schedule. ``one_process`` keys that fit by the content of its
# configuration (factories by module and name or as a ``functools.partial`` of such, datasets by the bytes of
# their samples, settings by value), fits once and hands each caller a deep copy. A configuration without such
# a key (a lambda, a callback or plugin object) is fitted every time, as before. A fork-started test's ranks
# inherit the cache of the pytest process; nothing of it outlives the session.
_ONE_PROCESS: dict = {}


def _key(x):
    """A hashable key of ``x`` by content, or TypeError where it has none (see the Note above)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_key(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, functools.partial):
        return ("partial", _key(x.func), _key(x.args), _key(x.keywords))
    if isinstance(x, DataLoader) and isinstance(x.sampler, SequentialSampler) and x.collate_fn is default_collate:
        return ("loader", _key(x.dataset), x.batch_size, x.drop_last)
    if isinstance(x, Dataset) and hasattr(x, "__len__") and len(x) <= 4096:
        digest = hashlib.sha1()
        for sample in (x[i] for i in range(len(x))):
            for t in sample if isinstance(sample, (tuple, list)) else (sample,):
                t = torch.as_tensor(t)
                digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                digest.update(t.contiguous().numpy().tobytes())
        return ("data", type(x).__qualname__, len(x), digest.hexdigest())
    if callable(x) and "<" not in getattr(x, "__qualname__", "<"):  # not a lambda, not a local function
        return ("named", x.__module__, x.__qualname__)
    raise TypeError(f"no content key for {x!r}")


def one_process_fit(factory: Callable[[], pl.LightningModule], dataset: Dataset, batch_size: int, *,
                max_steps: int = 3, **overrides) -> dict:
    """The record of ``fit_and_record(seeded(factory), reference_loader(dataset, batch_size), ...)`` in this
    process, fitted once per session for each configuration ([Note: one-process references are fitted once
    per session])."""
    try:
        key = _key((factory, dataset, batch_size, max_steps, overrides))
    except TypeError:
        key = None
    if key is None or key not in _ONE_PROCESS:
        with tempfile.TemporaryDirectory() as out:
            record = fit_and_record(seeded(factory), reference_loader(dataset, batch_size), out, max_steps=max_steps,
                                    **overrides)[0]
        if key is None:
            return record
        _ONE_PROCESS[key] = record
    return copy.deepcopy(_ONE_PROCESS[key])


# [Note: Adam's response to rounding]
# Adam moves a parameter by lr * m / (sqrt(v) + eps), a ratio of gradients: an entry whose gradient is itself
# rounding noise (|g| of ~1e-9, terms that cancel, e.g. the weights out of a hidden unit that is ~0 for every
# token) moves by a sizeable fraction of lr in one step whichever noise it got, and two correct runs that sum in
# another order (microbatches, stages, shards, replicas) move it differently. Measured on the tiny GPT under
# dp2 x pp2 x tp2: proj.weight[13, 32] has gradient -2.15e-9 on one process, -1.40e-9 on the ranks (equal to
# 1e-5 as every gradient), and the first step moves it by 0.177 lr against 0.123 lr: 1.6e-4 apart. The
# comparison of parameters therefore allows, entry by entry, exactly Adam's response to the two recorded
# gradient sequences: sum over steps of lr_t |d_t(got) - d_t(ref)|, d_t = m_hat / (sqrt(v_hat) + eps) replayed
# from each side's gradients with the optimizer's own lr, betas and eps (recorded per step). Where gradients
# are well above eps the response to a 1e-7 difference is ~1e-7 lr, so every other entry is held at 1e-5 as
# before, and a missed, doubled or misplaced step (off by ~lr everywhere) still fails. Optimizers other than
# Adam / AdamW get no allowance. Gradients are recorded before clipping: a clipped run's allowance is that of
# its unclipped gradients.
def _adam_settings(module: pl.LightningModule, optimizer) -> dict[str, tuple]:
    """``{parameter name: (lr, beta1, beta2, eps)}`` of this step for the parameters an Adam-family optimizer
    steps (``amsgrad`` excluded); ``{}`` for other optimizers."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return {}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"] if not g.get("amsgrad")}
    return {n: (float(g["lr"]), *map(float, g["betas"]), float(g["eps"]))
            for n, p in module.named_parameters() if (g := group_of.get(id(p))) is not None}


def _adam_directions(grads: list[torch.Tensor], settings: list[tuple]) -> list[torch.Tensor]:
    m = v = torch.zeros_like(grads[0], dtype=torch.float64)
    out = []
    for t, (g, (_, b1, b2, eps)) in enumerate(zip(grads, settings), 1):
        g = g.double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        out.append((m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps))
    return out


def adam_response(got: dict, ref: dict, name: str) -> torch.Tensor | None:
    """How far Adam moves ``name`` apart given the two records' gradients ([Note: Adam's response to
    rounding]); None where the record has no Adam settings for it at every step."""
    steps = got.get("adam") or []
    if not steps or not all(name in s for s in steps) or not all(name in g for g in got["grads"]):
        return None
    # a step where any of the reference's gradients is not finite is one the loss scaler skipped (16-mixed):
    # no parameter moved, no moment changed
    taken = [i for i, r in enumerate(ref["grads"]) if all(g.isfinite().all() for g in r.values())]
    if not taken:
        return None
    settings = [steps[i][name] for i in taken]
    mine = _adam_directions([got["grads"][i][name] for i in taken], settings)
    theirs = _adam_directions([ref["grads"][i][name] for i in taken], settings)
    return sum(s[0] * (a - b).abs() for s, a, b in zip(settings, mine, theirs)).float()


def assert_close_records(ref: dict, got: dict, *, atol: float = 1e-5, rtol: float = 1e-5,
                         losses: bool = True, require_all_grads: bool = True) -> None:
    """Compare one rank's record with the reference: every loss, every gradient it holds, every parameter."""
    if losses:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=atol, rtol=rtol)
    assert len(got["grads"]) == len(ref["grads"]), (len(got["grads"]), len(ref["grads"]))
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert g, f"step {step}: this rank recorded no gradient"
        if require_all_grads:
            assert set(g) == set(r), f"step {step}: gradients differ in names: {set(g) ^ set(r)}"
        for name, grad in g.items():
            torch.testing.assert_close(grad, r[name], atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}")
    assert_params_close(ref, got, atol=atol, rtol=rtol)


def assert_params_close(ref: dict, got: dict, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Every parameter of one rank's record against the reference, within ``atol`` / ``rtol`` plus Adam's
    response to the two records' gradient differences ([Note: Adam's response to rounding])."""
    for name, p in got["params"].items():
        # Adam's response to the gradient differences just bounded, element by element: see the Note above
        slack = adam_response(got, ref, name)
        if slack is None:
            torch.testing.assert_close(p, ref["params"][name], atol=atol, rtol=rtol,
                                       msg=lambda m: f"param {name}: {m}")
        else:
            excess = (p - ref["params"][name]).abs() - (atol + rtol * ref["params"][name].abs() + slack)
            assert excess.max() <= 0, (f"param {name}: {int((excess > 0).sum())} elements differ by more than "
                                       f"1e-5 + Adam's response to the gradient differences, by up to "
                                       f"{excess.max():.3g}")


def assert_ranks_close(expected: list, got: list, **tol) -> None:
    """Rank by rank (two ranks): losses, every gradient, every parameter and the callback metrics."""
    assert len(got) == len(expected) == 2
    for e, g in zip(expected, got):
        assert_close_records(e, g, **tol)
        assert g["metrics"].keys() == e["metrics"].keys()
        for k in e["metrics"]:
            torch.testing.assert_close(torch.tensor(g["metrics"][k]), torch.tensor(e["metrics"][k]), **tol)


def fit_whole_then_resumed(fit: Callable[..., list[dict]], tmp, strategy: Callable[[], object], *, epochs: int = 2,
                           **kw) -> tuple[list[dict], list[dict], str]:
    """``fit(tmp, name, strategy, max_epochs=epochs, ...)`` once whole, saving a checkpoint at every epoch's end
    (into ``tmp/ckpt``), then once resumed from the first epoch's: ``(whole, resumed, that checkpoint's path)``.
    The runs end with ``max_epochs`` (DESIGN.md "Learned in round 2")."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpts = str(tmp / "ckpt")
    whole = fit(tmp, "whole", strategy(), max_steps=-1, max_epochs=epochs, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_epochs=1)], **kw)
    (path,) = glob.glob(os.path.join(ckpts, "epoch=0-step=*.ckpt"))
    resumed = fit(tmp, "resumed", strategy(), max_steps=-1, max_epochs=epochs, ckpt_path=path, **kw)
    return whole, resumed, path


def assert_one_usage_error(code, out: str, err: str, prog: str, *named: str) -> str:
    """A console script's refusal: exit status 2, no traceback anywhere, exactly one ``prog: error:`` line on
    stderr, naming every one of ``named``; that line."""
    assert code == 2, (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    errors = [line for line in err.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1 and all(value in errors[0] for value in named), (out + err)[-3000:]
    return errors[0]


def assert_resumed_exactly(whole: list, resumed: list, *, steps: int, resumed_at: int) -> None:
    """Each rank's resumed run ends at ``steps`` with the uninterrupted run's later losses and, bit for bit, its
    parameters (a resume replays the same arithmetic)."""
    for w, r in zip(whole, resumed, strict=True):
        assert r["global_step"] == steps
        assert r["losses"] == w["losses"][resumed_at:]
        for name, p in w["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def assert_only_port_races_after_the_kill(log: str, killed_local_rank: int) -> None:
    """A torchrun agent's log: its first failed worker is the one the test SIGKILLed, and every failure after it is
    torchrun's port race (the restarted rank 0 could not listen on the ephemeral MASTER_PORT the agent had picked for
    it: EADDRINUSE). The launches give that race a spare restart, and nothing else may use it."""
    failures = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log)
    assert failures and failures[0] == (str(-signal.SIGKILL), str(killed_local_rank)), failures
    assert len(failures) - 1 <= log.count("name: EADDRINUSE"), log[-3000:]


def union_of_grad_names(records: list[dict]) -> set[str]:
    return {n for rec in records for step in rec["grads"] for n in step}


def hybrid(**kw) -> HybridParallelStrategy:
    """The core as the distributed tests run it: forked ranks, a 120 s collective timeout."""
    return HybridParallelStrategy(start_method="fork", timeout=120, **kw)


def assert_matches(ref: dict, got: list[dict], *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Every rank returns the true losses; each rank's gradients and its stage's parameters equal the reference;
    together the ranks hold a gradient for every parameter."""
    for r, rec in enumerate(got):
        try:
            assert_close_records(ref, {**rec, "params": {n: rec["params"][n] for n in rec["grads"][-1]}},
                                 atol=atol, rtol=rtol, require_all_grads=False)
        except AssertionError as err:
            raise AssertionError(f"rank {r}: {err}") from None
    assert union_of_grad_names(got) == union_of_grad_names([ref])


def fit_two_ranks(tmp, name: str, strategy, *, max_steps: int, model=warm_gpt, module=None, data=None,
                  per_rank: int = 4, validate: bool = True, **overrides) -> list[dict]:
    """A 2-rank fit of ``module`` (or ``seeded(model)``); with ``validate`` it also runs 2 validation batches every
    3 steps (``val_loss`` is logged with ``sync_dist=True``)."""
    data = data or corpus()
    if validate:
        overrides = dict(val_loader=DataLoader(data.val_set, batch_size=per_rank), val_check_interval=3,
                         limit_val_batches=2, **overrides)
    return fit_and_record(module or seeded(model), DataLoader(data.train_set, batch_size=per_rank), str(tmp / name),
                          strategy=strategy, devices=2, max_steps=max_steps, **overrides)


def seeded(factory: Callable[[], pl.LightningModule], seed: int = 0) -> pl.LightningModule:
    torch.manual_seed(seed)
    return factory()


# [Note: the bf16-mixed tolerance]
# bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Stage 3 under bf16-mixed differs from stage 0 under
# bf16-mixed by FSDP's policy ([Note: mixed precision under FSDP] in lightning_par.dp.fsdp): the matmuls see
# the same bf16 operands in both (autocast rounds them anyway), but stage 3 also rounds, once each, values
# that stage 0 keeps in fp32. Counted per block of the reference GPT: in forward the block's input, the two
# LayerNorms' weight, bias and output, the two residual adds (9); in backward the gradients through the two
# norms and the two adds (4): 13. Its root: the two embeddings, their sum, the final norm's weight, bias and
# output in forward, and in backward the gradients through the final norm, the sum and the embedding (9).
# Per Llama block: the input, the two RMSNorms' weight and output, rotary q and k, the gate x up product,
# the two adds in forward (10), the gradients through the norms, adds, rotary q/k and the product (7): 17;
# its root: the embedding, the final norm's weight and output, the gradient through that norm (4).
# Each rounding perturbs its value by at most u relative; to first order the perturbations along a
# gradient's path add up, so at step 0 (same weights, same data) the norm-wise relative difference of all
# gradients together is at most n u, n = per_block L + root (L = 2 blocks here: 35 u for GPT, 38 u for
# Llama). Every later step starts from weights that differ by Adam's response to the previous differences,
# of the same first order: step t is allowed (1 + t) n u. Measured: at most ~2 u (GPT) and ~3 u (Llama)
# over 4 steps. A reduction bug is far outside: a rank's own gradient differs from the averaged one by
# ~0.85 relative (~220 u) on both models.
U_BF16 = 2.0 ** -8
ROUNDINGS = {"gpt": (13, 9), "llama": (17, 4)}     # (per block, root), see the Note


def bf16_bound(model, step, n_layer=2):
    per_block, root = ROUNDINGS[model]
    return (1 + step) * (per_block * n_layer + root) * U_BF16
