"""Peak memory per rank by the start of training: one device vs PP2, TP2 and zero 3 of a meta-built GPT
whose weights stream from a safetensors file (``trainer.init_module(empty_init=True)`` + ``weights=``).

    python benchmarks/meta_memory.py --quick          # ~3 minutes on 2 cores
    python benchmarks/meta_memory.py                  # GPT 32 × 384 (57 M parameters, 227 MB fp32)
    python benchmarks/meta_memory.py --accelerator cuda --n-layer 32 --n-embd 2048

CPU: every rank is its own interpreter (Lightning's popen launcher), and its peak resident memory
(``ru_maxrss``: tensors, mapped file pages, allocator slack) at ``on_train_start`` is reported net of the same
run with a tiny model (interpreter, torch, Lightning, process group). CUDA: ``max_memory_allocated``. Beside
each rank: the bytes of the parameters it holds (its share, the replicated ends included) and the ratio
``net peak / held`` (the issue's bound: ≤ 1.1) and ``net peak / one device's net peak`` (2-way: ≤ 0.6).
Measured (2-core CPU, torch 2.13, default sizes; net peak / held, net peak / one device): pp2 1.05 / 0.26,
tp2 1.10 / 0.27, zero3 1.08 / 0.27 on the worse rank; one device 2.01 (the model plus the loaded file).
The peak is reset (Linux ``clear_refs``) just before the Trainer is built, in every rank. Tensor parallelism's
setup check runs one region of each kind forward and backward on a whole copy ([Note: the region probe]):
its weights and gradients are a transient ~2 × one block's MLP, small beside a share only when there are
many blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

VARIANTS = ("one", "pp2", "tp2", "zero3")
# block-dominated: 32 blocks of 12·d² parameters each beside a small vocabulary
FULL = dict(n_layer=32, n_embd=384, vocab=256, seq=32, batch=4)    # 57 M parameters, 227 MB fp32
QUICK = dict(n_layer=32, n_embd=192, vocab=128, seq=16, batch=4)   # 14 M parameters, 57 MB fp32
TINY = dict(n_layer=2, n_embd=16, vocab=32, seq=16, batch=4)


def gpt(cfg):
    from lightning_par.models import GPT

    return GPT(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=8 if cfg["n_embd"] >= 64
               else 2, n_embd=cfg["n_embd"], warmup_steps=1, lr_decay_steps=10)


def strategy(variant: str, weights: str):
    from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    return {"one": lambda: "auto",
            "pp2": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, weights=weights),
            "tp2": lambda: TensorParallelStrategy(tensor_parallel_size=2, weights=weights),
            "zero3": lambda: DataParallelStrategy(zero_stage=3, weights=weights)}[variant]()


def inner(args) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_par.data import SyntheticCorpus
    from lightning_par.peak_memory import held_bytes, peak_resident, reset_peak

    cfg = json.loads(args.cfg)
    torch.set_num_threads(args.threads)
    cuda = cfg["accelerator"] == "cuda"

    class Peak(Callback):
        def on_train_start(self, trainer, module):
            held = held_bytes(module)
            peak = torch.cuda.max_memory_allocated() if cuda else peak_resident()
            with open(os.path.join(args.run_dir, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump({"rank": trainer.global_rank, "peak": peak, "held": held,
                           "read": getattr(trainer.strategy, "weights_bytes_read", 0)}, f)

    data = SyntheticCorpus(vocab_size=cfg["vocab"], seq_len=cfg["seq"], train_sequences=8, val_sequences=2)
    devices = 1 if args.inner == "one" else 2
    reset_peak()  # every rank (popen re-runs this script) from here: the Trainer, the model, setup
    trainer = Trainer(accelerator=cfg["accelerator"], devices=devices, strategy=strategy(args.inner, cfg["weights"]),
                      max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Peak()])
    if args.inner == "one":  # one device: the model built as usual, then the same file loaded
        from safetensors.torch import load_file

        module = gpt(cfg)
        module.load_state_dict(load_file(cfg["weights"]), strict=False)
    else:
        with trainer.init_module(empty_init=True):
            module = gpt(cfg)
    trainer.fit(module, DataLoader(data.train_set, batch_size=cfg["batch"]))


def write_weights(cfg: dict, directory: str) -> str:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in gpt(cfg).state_dict().items() if k != "lm_head.weight"}  # tied
    path = os.path.join(directory, f"gpt{cfg['n_layer']}x{cfg['n_embd']}.safetensors")
    save_file(state, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a GPT 32 × 192 (14 M parameters)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json")
    for k in FULL:
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None)
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    # glibc raises its mmap threshold after large frees, after which freed buffers stay resident as heap slack
    # that depends on each process's history; a fixed threshold returns them (the tensors' bytes are unchanged)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    variants = args.variants.split(",")
    directory = tempfile.mkdtemp(prefix="meta-memory-")
    rows, failures = {}, []
    for size, sizes in (("model", cfg), ("tiny", {**TINY, "seq": cfg["seq"]})):
        sizes = {**sizes, "accelerator": args.accelerator}
        sizes["weights"] = write_weights(sizes, directory)
        for v in variants:
            recs, err = _launch.launch(__file__, v, sizes, args.threads, args.timeout, ranks=1 if v == "one" else 2,
                                       prefix="meta-memory")
            if err:
                failures.append(f"{v} ({size}): {err}")
                print(f"{v} ({size}): FAILED {err}", flush=True)
                continue
            rows.setdefault(v, {})[size] = recs
            print(f"{v} ({size}): peak per rank {[round(r['peak'] / 2**20) for r in recs]} MiB", flush=True)
    print(f"\nGPT {cfg['n_layer']} × {cfg['n_embd']}, vocab {cfg['vocab']}; peak memory by the start of training, net of "
          f"the tiny model's; held = the parameters a rank holds (its share + the replicated ends)")
    print(f"{'variant':8} {'rank':>4} {'net peak MiB':>13} {'held MiB':>9} {'peak/held':>10} {'peak/one':>9} "
          f"{'read MiB':>9}")
    one = None
    if "model" in rows.get("one", {}) and "tiny" in rows["one"]:
        one = rows["one"]["model"][0]["peak"] - rows["one"]["tiny"][0]["peak"]
    summary = {}
    for v in variants:
        if "model" not in rows.get(v, {}) or "tiny" not in rows[v]:
            continue
        for rec, base in zip(rows[v]["model"], rows[v]["tiny"]):
            net = rec["peak"] - base["peak"]
            summary[f"{v}/rank{rec['rank']}"] = {"net_peak": net, "held": rec["held"], "read": rec["read"]}
            print(f"{v:8} {rec['rank']:>4} {net / 2**20:13.1f} {rec['held'] / 2**20:9.1f} {net / rec['held']:10.2f} "
                  f"{(net / one) if one else float('nan'):9.2f} {rec['read'] / 2**20:9.1f}")
    for f in failures:
        print("FAILED", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": summary, "one_device_net_peak": one, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
