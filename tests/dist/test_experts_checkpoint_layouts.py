"""Any-layout checkpoints of an expert-parallel fit ([Note: expert tensors as DTensors] in
lightning_par/experts/apply.py): the one file written under ep 2 (tiny Mixtral, fused experts) resumes on one
device, under ep 4 and under tp 2, each training on as the same layout's reference resumed from the same file, and
the converter writes it back in the Hugging Face layout (fused expert tensors under their own names)."""
import functools

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from experts_models import MoEModule
from harness import TIMEOUT_S, fit_and_record, fit_whole_then_resumed, reference_loader, seeded
from lightning.pytorch.strategies import DDPStrategy
from test_experts_strategy import DATA, HoldsExperts, hybrid

FACTORY = functools.partial(MoEModule, "mixtral", "adamw")


def _fit(tmp, name, strategy, *, devices=2, loader=None, family="mixtral", **kw):
    factory = FACTORY if family == "mixtral" else functools.partial(MoEModule, family, "adamw")
    return fit_and_record(seeded(factory), loader or DataLoader(DATA.train_set, batch_size=2), str(tmp / name),
                          strategy=strategy, devices=devices, **kw)


class ReplicasInTurn(Sampler):
    """One process's micro-batches in the order two data-parallel replicas take theirs (Lightning's
    ``DistributedSampler(shuffle=True, seed=0)`` on each): replica 0's step-k batch, then replica 1's. With
    ``accumulate_grad_batches=2`` one device then steps on the mean of the replicas' gradients, each loss (the
    router's auxiliary loss too) computed on one replica's tokens, as under data parallelism."""

    def __init__(self, dataset, batch_size: int):
        self.dataset, self.batch_size = dataset, batch_size
        # replica 0's sampler: Lightning sets the epoch of a batch sampler's ``sampler`` at every epoch's start
        self.sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)

    def _replica(self, rank: int) -> list[int]:
        sampler = DistributedSampler(self.dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(self.sampler.epoch)
        return list(sampler)

    def __iter__(self):
        a, b, n = self._replica(0), self._replica(1), self.batch_size
        for k in range(0, len(a), n):
            yield a[k:k + n]
            yield b[k:k + n]

    def __len__(self):
        return 2 * len(self._replica(0)) // self.batch_size


def _assert_params(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and got
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, atol=2e-4, rtol=0, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.timeout(TIMEOUT_S)
def test_a_checkpoint_under_ep2_resumes_on_one_device_and_under_tp2(tmp_path):
    """One device resumed from the ep-2 file (micro-batches of the two replicas in turn, accumulated) trains on as
    ep 2 resumed from it does: the replicas' mean losses and the parameters within 2e-4 over 8 AdamW steps. tp 2
    (each rank 2 of the 4 experts) resumed from it trains on as one device resumed from it on the same batches."""
    whole, resumed, path = fit_whole_then_resumed(_fit, tmp_path, lambda: hybrid(expert_parallel_size=2))
    steps = len(whole[0]["losses"])
    one = _fit(tmp_path, "one", "auto", devices=1, max_steps=-1, max_epochs=2, ckpt_path=path,
               accumulate_grad_batches=2,
               loader=DataLoader(DATA.train_set, batch_sampler=ReplicasInTurn(DATA.train_set, 2)))[0]
    assert one["global_step"] == steps and len(one["losses"]) == steps  # 8 steps of 2 micro-batches each
    pairs = torch.tensor(one["losses"]).reshape(-1, 2).sum(1)  # each recorded loss is Lightning's loss / 2
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), pairs, atol=2e-4, rtol=0)
    _assert_params(resumed[0]["params"], one["params"], "ep 2 against one device:")

    loader = reference_loader(DATA.train_set, 2)  # one replica: one device's batches are tp 2's
    ref = _fit(tmp_path, "one_tp", "auto", devices=1, max_steps=-1, max_epochs=2, ckpt_path=path, loader=loader)[0]
    tp = _fit(tmp_path, "tp", hybrid(tensor_parallel_size=2), max_steps=-1, max_epochs=2, ckpt_path=path,
              loader=DataLoader(DATA.train_set, batch_size=2), callbacks=[HoldsExperts(2)])
    assert len(tp) == 2 and len(ref["losses"]) == len(DATA.train_set) // 2 > 0
    for rec in tp:
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=2e-4, rtol=0)
        _assert_params(rec["params"], ref["params"], "tp 2 against one device:")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family,distributed", [("mixtral", False), ("list", False),
                                                pytest.param("mixtral", True, marks=pytest.mark.slow)])
def test_a_checkpoint_under_ep2_resumes_under_ep4(tmp_path, family, distributed):
    """The ep-2 checkpoint (one file; or a DCP directory written by the same run) resumed on 4 ranks under ep 4
    (each rank 1 of the 4 experts: a fused tensor's row, a per-expert list's module) trains on as Lightning's DDP on
    the same 4 ranks resumed from the file: the replicas' mean losses and the parameters within 2e-4."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    fit = functools.partial(_fit, family=family)
    _, _, path = fit_whole_then_resumed(fit, tmp_path, lambda: hybrid(expert_parallel_size=2))
    source = path
    if distributed:  # the same first epoch again, written as a DCP directory
        fit(tmp_path, "dcp", hybrid(expert_parallel_size=2, save_distributed_checkpoint=True), max_steps=-1,
            max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "dcp_ckpt"))])
        (source,) = (tmp_path / "dcp_ckpt").iterdir()
        assert source.is_dir()
    ddp = fit(tmp_path, "ddp", DDPStrategy(start_method="fork"), devices=4, max_steps=-1, max_epochs=2,
              ckpt_path=path)
    ep4 = fit(tmp_path, "ep4", hybrid(expert_parallel_size=4), devices=4, max_steps=-1, max_epochs=2,
              ckpt_path=str(source), callbacks=[HoldsExperts(4)])
    assert len(ep4) == len(ddp) == 4
    mean = torch.tensor([sum(r["losses"][i] for r in ddp) / 4 for i in range(len(ddp[0]["losses"]))])
    assert len(mean) > 0
    held = {}
    for rec in ep4:
        torch.testing.assert_close(torch.tensor(rec["losses"]), mean, atol=2e-4, rtol=0)
        mine = {n: p for n, p in ddp[0]["params"].items() if n in rec["params"]}  # a list's other experts: not here
        _assert_params(rec["params"], mine, f"ep 4 rank {rec['rank']} against DDP:")
        held.update(rec["params"])
    assert held.keys() == ddp[0]["params"].keys()
    if family == "list":  # each rank holds one expert module of every layer
        assert all(sum(".experts." in n for n in rec["params"]) * 4 == sum(".experts." in n for n in held)
                   for rec in ep4)


class SavesItsWeights(pl.Callback):
    """Rank 0's whole module state (experts gathered) at the end of fit, into ``path``: what a checkpoint holds."""

    def __init__(self, path: str):
        self.path = path

    def on_fit_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in pl_module.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save(state, self.path)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family,distributed", [("mixtral", False), ("qwen2_moe", False), ("mixtral", True)])
def test_the_converter_writes_the_hugging_face_layout_from_an_ep2_checkpoint(tmp_path, family, distributed):
    """``lightning-par-checkpoint convert <ep-2 checkpoint> model.safetensors --strip-prefix model.`` (one file or
    a DCP directory): the file holds the Hugging Face model's own names and shapes (the fused expert tensors
    whole: ``mlp.experts.gate_up_proj [E, 2I, H]``, as transformers 5 holds them) with the trained values, and
    ``from_pretrained`` beside the model's config loads it to exactly the fitted module's weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors import safe_open

    from lightning_par.checkpoint.cli import main

    factory = functools.partial(MoEModule, family, "adamw")
    fitted = str(tmp_path / "fitted.pt")
    fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=2), str(tmp_path / "e"), devices=2,
                   strategy=hybrid(expert_parallel_size=2, save_distributed_checkpoint=distributed), max_steps=4,
                   enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt")),
                                                         SavesItsWeights(fitted)])
    (path,) = (tmp_path / "ckpt").iterdir()
    assert path.is_dir() == distributed
    out = tmp_path / "hf"
    out.mkdir()
    assert main(["convert", str(path), str(out / "model.safetensors"), "--strip-prefix", "model."]) in (0, None)
    model = seeded(factory).model  # the fit's initial weights
    want = torch.load(fitted, weights_only=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in model.state_dict().items()}
    experts = [k for k in written if k.endswith("mlp.experts.gate_up_proj")]
    assert experts and all(written[k].shape[0] == 4 for k in experts)
    model.config.save_pretrained(str(out))
    loaded = type(model).from_pretrained(str(out))
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, want["model." + name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(want[f"model.{experts[0]}"], model.state_dict()[experts[0]])  # trained weights
