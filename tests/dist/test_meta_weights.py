"""Meta-built modules (``trainer.init_module(empty_init=True)``, ``configure_model``) under PP2, TP2 and zero 3:
each rank materializes only its share, reads only its share of ``weights=``, and trains as one device that
loaded the same file; without weights the share is initialized by the module's own init code."""
import fnmatch
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, Recorder, assert_close_records, reference_loader, trainer_kwargs
from models import CausalLM, corpus, deep_gpt, hf_model
from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.materialize import initialize, materialize, meta_parameters
from lightning_par.peak_memory import TensorPeak, held_bytes
from test_pipeline import assert_pipeline_matches

DATA = corpus()




class LitLlama(CausalLM):
    """A user's wrapper of a Hugging Face Llama built from a config (untied head: only the last stage holds it)."""

    def __init__(self):
        super().__init__(hf_model("llama", num_hidden_layers=4, tie_word_embeddings=False))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Configured(pl.LightningModule):
    """Builds its layers in ``configure_model`` (Lightning calls it inside the strategy's init context)."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 4):
        super().__init__()
        self.vocab, self.width, self.depth = vocab, width, depth
        self.blocks = None

    def configure_model(self):
        if self.blocks is not None:
            return
        self.embed = nn.Embedding(self.vocab, self.width)
        self.blocks = nn.ModuleList(Block(self.width) for _ in range(self.depth))
        self.norm = nn.LayerNorm(self.width)
        self.head = nn.Linear(self.width, self.vocab)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def plain_configured():
    m = Configured()
    m.configure_model()
    return m


# model name -> (factory, built plainly, the file's names gain this prefix, sharded TP weights, file drops)
MODELS = {
    "gpt": (deep_gpt, deep_gpt, "", ["blocks.*.attn.*_proj.weight", "blocks.*.mlp.*.weight"], ["lm_head.weight"]),
    "llama": (LitLlama, LitLlama, "model.", ["model.model.layers.*_proj.weight"], []),
    "configured": (Configured, plain_configured, "", ["blocks.*.fc*.weight"], []),
}
STRATEGIES = {
    "pp2": lambda **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork",
                                                 timeout=120, **kw),
    "tp2": lambda **kw: TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120, **kw),
    "zero3": lambda **kw: DataParallelStrategy(zero_stage=3, start_method="fork", timeout=120, **kw),
}


class Share(pl.Callback):
    """At the start of training, what this rank holds: per parameter 'meta', 'shard' (a DTensor with a Shard
    placement and its local numel) or 'whole'; the bytes of the state entries it holds; the bytes it read."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        kinds = {}
        for name, p in pl_module.named_parameters(remove_duplicate=False):
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.is_meta:
                kinds[name] = ("meta", 0)
            elif isinstance(p, DTensor) and any(isinstance(pl_, Shard) for pl_ in p.placements):
                kinds[name] = ("shard", local.numel(), p.numel())
            else:
                kinds[name] = ("whole", local.numel())
        seen, held = set(), 0
        for t in pl_module.state_dict(keep_vars=True).values():
            local = t.to_local() if isinstance(t, DTensor) else t
            if id(t) not in seen and not local.is_meta:
                seen.add(id(t))
                held += local.numel() * 4
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"kinds": kinds, "held_bytes": held, "read": trainer.strategy.weights_bytes_read},
                   os.path.join(self.out_dir, f"share{trainer.global_rank}.pt"))


def save_weights(module: nn.Module, path: str, strip: str = "", drop=()) -> int:
    """The module's state as a safetensors file under the file's names; returns the file's tensor bytes."""
    from safetensors.torch import save_file

    state = {k[len(strip):]: v.detach().clone().contiguous() for k, v in module.state_dict().items()
             if k not in drop}
    save_file(state, path)
    return sum(v.numel() * v.element_size() for v in state.values())


def fit_meta(factory, strategy, out_dir: str, max_steps: int = 2, devices: int = 2) -> tuple[list, list]:
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, max_steps=max_steps,
                                          callbacks=[Recorder(out_dir), Share(out_dir)]))
    torch.manual_seed(0)  # the run's init seed (each rank materializes with global rank 0's)
    with trainer.init_module(empty_init=True):
        model = factory()
    if not isinstance(model, Configured):
        assert all(p.is_meta for p in model.parameters())
    # zero 3's ranks are data-parallel replicas: 4 samples each, one device's global batch of 8
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4 if isinstance(strategy, DataParallelStrategy) else 8))
    load = lambda pattern: [torch.load(f, weights_only=False)  # noqa: E731
                            for f in sorted(glob.glob(os.path.join(out_dir, pattern)))]
    records = load("rank*.pt")
    # the caller's module received the whole trained module (gathered from the shards, assembled from the
    # stages: what each rank trained); a module that builds its layers in configure_model built them in the
    # ranks only
    if not isinstance(model, Configured):
        received = {n: p for n, p in model.named_parameters() if not p.is_meta}
        assert len(received) == len(list(model.parameters()))
        for rec in records:  # what each rank trained (its gradients' names)
            for name in rec["grads"][-1]:
                torch.testing.assert_close(received[name].detach(), rec["params"][name], atol=0, rtol=0)
        assert model.model.lm_head.weight is not model.model.model.embed_tokens.weight if isinstance(
            model, LitLlama) else model.lm_head.weight is model.tok_emb.weight  # ties kept
    return records, load("share*.pt")


def check_shares(kind: str, shares: list, sharded: list[str], names: list[str]) -> None:
    """No rank holds a whole tensor it does not own: under PP2 each stage's blocks only (the others' are gone)
    and the ends it uses; under TP2 the plan's matrices as shards; under zero 3 every parameter as a shard."""
    for rank, share in enumerate(shares):
        kinds = share["kinds"]
        if kind == "pp2":
            mine = {n.split(".")[3] if n.startswith("model.model.") else n.split(".")[1] for n in kinds
                    if n.startswith(("blocks.", "model.model.layers."))}
            assert mine == ({"0", "1"} if rank == 0 else {"2", "3"}), (rank, mine)
            head = next(n for n in names if n.endswith(("lm_head.weight", "head.weight")))
            tied = kinds[head][0] == "whole" and head == "lm_head.weight"  # the GPT's head is its embedding
            assert kinds[head][0] == ("whole" if rank == 1 or tied else "meta"), (rank, head, kinds[head])
            norm = next(n for n in names if n in ("ln_f.weight", "model.model.norm.weight", "norm.weight"))
            assert kinds[norm][0] == ("whole" if rank == 1 else "meta"), (rank, norm)
        elif kind == "tp2":
            for name in names:
                if any(fnmatch.fnmatch(name, g) for g in sharded):
                    assert kinds[name][0] == "shard" and kinds[name][1] * 2 == kinds[name][2], (name, kinds[name])
            assert any(k[0] == "shard" for k in kinds.values())
        else:
            for name, k in kinds.items():
                assert k[0] == "shard" and k[1] <= (k[2] + 1) // 2 + 64, (name, k)
        assert all(k[0] != "meta" for k in kinds.values()) or kind == "pp2"
        # it read exactly the bytes of what it holds, never the whole file
        assert share["read"] == share["held_bytes"] > 0, (rank, share["read"], share["held_bytes"])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_meta_build_with_weights_matches_one_device(tmp_path, model, strategy):
    pytest.importorskip("transformers")
    factory, plain, prefix, sharded, drop = MODELS[model]
    torch.manual_seed(1)
    source = plain()  # the weights, written as a user's file would be (the GPT's file holds its tied head once)
    path = str(tmp_path / "weights.safetensors")
    file_bytes = save_weights(source, path, strip=prefix, drop=drop)
    torch.manual_seed(2)
    ref_module = plain()  # one device that loaded the same file
    from safetensors.torch import load_file

    missing, unexpected = ref_module.load_state_dict({prefix + k: v for k, v in load_file(path).items()}, strict=False)
    assert list(missing) == list(drop) and not unexpected
    ref = fit_and_record_one(ref_module, str(tmp_path / "ref"))
    got, shares = fit_meta(factory, STRATEGIES[strategy](weights=path, weights_prefix=prefix), str(tmp_path / "par"))
    names = [n for n, _ in ref_module.named_parameters(remove_duplicate=False)]
    check_shares(strategy, shares, sharded, names)
    assert all(s["read"] < file_bytes for s in shares)
    assert_matches_one_device(strategy, ref, got)


def assert_matches_one_device(strategy: str, ref: dict, got: list) -> None:
    """PP2 and TP2 return one device's losses; zero 3 reports rank-local losses (as DDP) whose mean is one
    device's on the global batch; gradients and parameters equal one device's everywhere (fp32, 1e-5)."""
    if strategy == "pp2":
        return assert_pipeline_matches(ref, got)
    for rec in got:
        assert_close_records(ref, rec, atol=1e-5, rtol=1e-5, losses=strategy != "zero3")
    if strategy == "zero3":
        mean = torch.tensor([r["losses"] for r in got]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)


def fit_and_record_one(module, out_dir: str, batch: int = 8) -> dict:
    trainer = pl.Trainer(**trainer_kwargs(devices=1, max_steps=2, callbacks=[Recorder(out_dir)]))
    trainer.fit(module, reference_loader(DATA.train_set, batch))
    return torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)


def file_and_reference(tmp_path, model: str, batch: int = 8) -> tuple[str, int, dict]:
    """A weights file of ``model`` (under the file's names), its tensor bytes, and one device's record after it
    loaded that file and trained on global batches of ``batch``."""
    _, plain, prefix, _, drop = MODELS[model]
    torch.manual_seed(1)
    path = str(tmp_path / "weights.safetensors")
    file_bytes = save_weights(plain(), path, strip=prefix, drop=drop)
    torch.manual_seed(2)
    ref_module = plain()
    from safetensors.torch import load_file

    ref_module.load_state_dict({prefix + k: v for k, v in load_file(path).items()}, strict=False)
    return path, file_bytes, fit_and_record_one(ref_module, str(tmp_path / "ref"), batch)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_meta_build_without_weights_is_initialized_and_trains(tmp_path, strategy):
    """No weights file: every rank initializes its share by the module's own init under per-module seeds, so
    the run equals one device that materialized the same meta-built module (same seed), and the weights have
    the statistics of a plainly built module's (HF Llama: its `_init_weights`, normal(0, 0.02))."""
    pytest.importorskip("transformers")
    with meta_parameters():
        ref_module = LitLlama()
    initialize(ref_module, materialize(ref_module, torch.device("cpu")), seed=0)
    plain = LitLlama()
    for (name, p), q in zip(ref_module.named_parameters(), plain.parameters()):
        assert torch.isfinite(p).all(), name
        if p.dim() == 2:
            assert 0.75 < p.std().item() / q.std().item() < 1.33, (name, p.std().item(), q.std().item())
        else:
            torch.testing.assert_close(p, q)  # norms: ones
    ref = fit_and_record_one(ref_module, str(tmp_path / "ref"))
    got, _ = fit_meta(LitLlama, STRATEGIES[strategy](), str(tmp_path / "par"))
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in got)
    assert_matches_one_device(strategy, ref, got)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", ["pp2", "tp2"])
def test_weights_with_missing_extra_and_misshaped_names_are_refused_before_training(tmp_path, strategy):
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in deep_gpt().state_dict().items() if k != "lm_head.weight"}
    del state["blocks.3.mlp.fc.bias"]  # missing
    state["blocks.9.extra.weight"] = torch.zeros(2)  # unexpected
    state["ln_f.weight"] = torch.ones(17)  # mis-shaped
    from safetensors.torch import save_file

    path = str(tmp_path / "bad.safetensors")
    save_file(state, path)
    with pytest.raises(Exception) as info:
        fit_meta(deep_gpt, STRATEGIES[strategy](weights=path), str(tmp_path / "par"))
    text = str(info.value)
    for expected in ("1 missing", "blocks.3.mlp.fc.bias", "1 unexpected", "blocks.9.extra.weight", "1 mis-shaped",
                     "ln_f.weight: file (17,)"):
        assert expected in text, (expected, text[-2000:])
    assert not glob.glob(str(tmp_path / "par" / "share*.pt"))  # refused before training started


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model,flags", [("gpt", False), ("llama", False), ("gpt", True)])
def test_meta_build_with_weights_under_pp2_tp2_matches_one_device(tmp_path, model, flags):
    """The hybrid core: ranks (pp, tp) hold their stage's blocks as tensor shards, the ends their stage uses,
    nothing whole of another stage; each reads only that from the file; training equals one device's.
    ``flags``: under sequence_parallel and loss_parallel too (the GPT's tied embedding / head then sharded by
    vocabulary on both the first and the last stage)."""
    pytest.importorskip("transformers")
    from lightning_par import HybridParallelStrategy

    factory, plain, prefix, sharded, drop = MODELS[model]
    path, file_bytes, ref = file_and_reference(tmp_path, model)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                      microbatches=2, start_method="fork", timeout=120, weights=path,
                                      weights_prefix=prefix, sequence_parallel=flags, loss_parallel=flags)
    got, shares = fit_meta(factory, strategy, str(tmp_path / "par"), devices=4)
    assert_pipeline_matches(ref, got)
    for rank, share in enumerate(shares):  # ranks 0, 1: stage 0 (blocks 0-1); 2, 3: stage 1 (blocks 2-3)
        kinds, stage = share["kinds"], rank // 2
        for name, kind in kinds.items():
            block = name.split(".")[3] if name.startswith("model.model.layers.") else (
                name.split(".")[1] if name.startswith("blocks.") else None)
            if block is not None and int(block) // 2 != stage:
                assert kind[0] == "meta", (rank, name, kind)  # another stage's block: no storage
            elif block is not None and any(fnmatch.fnmatch(name, g) for g in sharded):
                assert kind[0] == "shard" and kind[1] * 2 == kind[2], (rank, name, kind)  # its tensor shard
        assert share["read"] == share["held_bytes"] > 0 and share["read"] < file_bytes / 2, (rank, share)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["pp2_dp2", "tp2_dp2"])
def test_meta_build_with_weights_under_zero3_replicas_matches_one_device(tmp_path, layout):
    """zero_stage=3 on the hybrid core: FSDP shards the meta-built stage / tensor shards over the replicas
    before anything is materialized, so every rank holds every parameter it owns as a replica shard (under
    tensor parallelism a shard of its tensor shard), reads exactly those bytes of the file, and trains as one
    device that loaded the file (losses and gradients at 1e-5)."""
    from lightning_par import HybridParallelStrategy

    factory = MODELS["gpt"][0]
    path, file_bytes, ref = file_and_reference(tmp_path, "gpt", batch=16)  # 2 replicas of 8
    pp, tp = (2, 1) if layout == "pp2_dp2" else (1, 2)
    strategy = HybridParallelStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=2,
                                      zero_stage=3, microbatches=2, start_method="fork", timeout=120, weights=path)
    got, shares = fit_meta(factory, strategy, str(tmp_path / "par"), devices=4)
    for rec in got:  # the replicas' mean on every rank: one device's losses on the global batch of 16
        assert_close_records(ref, {**rec, "params": {}}, atol=1e-5, rtol=1e-5, require_all_grads=False)
    for rank, share in enumerate(shares):
        held = {n: k for n, k in share["kinds"].items() if k[0] != "meta"}
        assert held and all(k[0] == "shard" for k in held.values()), (rank, {n: k for n, k in held.items() if k[0] != "shard"})
        for name, (_, local, whole) in held.items():  # half of it, or a quarter under tp2 × dp2 (padding: a row)
            assert local <= (whole + 1) // 2 + 16, (rank, name, local, whole)
        if tp == 2:
            assert any(local * 4 <= whole + 64 for _, local, whole in held.values())
        assert share["read"] == share["held_bytes"] > 0 and share["read"] < file_bytes / 3, (rank, share)


class SetupMemory(pl.Callback):
    """From the setup hook (after the meta build, before the strategy's setup) to the start of training: the most
    CPU tensor bytes this rank held at once and still holds (the allocator's counts, deterministic), beside the
    bytes of the parameters it holds and the largest one, and the bytes it read."""

    def __init__(self, out_dir: str):
        self.out_dir, self.meter = out_dir, None

    def setup(self, trainer, pl_module, stage):
        self.meter = TensorPeak()
        self.meter.start()

    def on_train_start(self, trainer, pl_module):
        self.meter.stop()
        from lightning_par.comm import local_nbytes

        sizes = [local_nbytes(p) for p in pl_module.parameters() if not p.is_meta and not (
            isinstance(p, DTensor) and p.to_local().is_meta)]
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"peak": self.meter.peak, "still": self.meter.held, "held": held_bytes(pl_module),
                    "largest": max(sizes), "read": trainer.strategy.weights_bytes_read},
                   os.path.join(self.out_dir, f"memory{trainer.global_rank}.pt"))


def wide_llama():
    """LitLlama at a size where a rank's share (1 MiB) is far above the allocator's fixed costs."""
    import transformers

    m = LitLlama()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    m.model = transformers.LlamaForCausalLM(config)
    return m


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_meta_built_hf_llama_holds_only_its_share_at_setup(tmp_path, strategy):
    """A meta-built Hugging Face Llama with ``weights=``: from the strategy's setup to the start of training, each
    rank's tensors never exceed 1.1 × what it holds (its share + the replicated ends), none stays behind beyond
    it (the region probe's copies, the weights reader's buffers), and it read exactly what it holds. Counted by
    the CPU allocator (the torch profiler's allocation events), not by the resident set."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    torch.manual_seed(1)
    path = str(tmp_path / "weights.safetensors")
    save_file({k[len("model."):]: v.contiguous() for k, v in wide_llama().state_dict().items()}, path)
    out = str(tmp_path / "par")
    trainer = pl.Trainer(**trainer_kwargs(strategy=STRATEGIES[strategy](weights=path, weights_prefix="model."),
                                          devices=2, max_steps=1, callbacks=[SetupMemory(out)]))
    with trainer.init_module(empty_init=True):
        model = wide_llama()
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4))
    for rank in range(2):
        m = torch.load(os.path.join(out, f"memory{rank}.pt"))
        assert m["read"] == m["held"] > 0, (rank, m)
        # what is left at the start of training is the share: a few runs in ten under TP2 also keep 64 KiB (one
        # whole MLP weight's size) that a later collection frees; the 5 KiB RNG state a gloo broadcast may hold
        assert m["still"] <= 1.1 * m["held"], (rank, m)
        assert m["peak"] <= 1.1 * m["held"], (rank, m)
