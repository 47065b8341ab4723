"""``lightning-par-advise``: which layout to train a model with, and what each would cost per device.

    lightning-par-advise                                       # reference GPT on this machine's devices
    lightning-par-advise model.n_layer=48 model.n_embd=2048 --devices 8 --device-memory-gb 80
    lightning-par-advise data=classification model=mlp --precision bf16-mixed

Positional ``key=value`` arguments are the training app's Hydra overrides (``model=``, ``data=``, ...),
so the advice is for exactly the model ``lightning-par-train`` would build. The model runs one
forward/backward on a micro-batch of real data to measure its activations (see
:mod:`lightning_par.advisor.profile`); everything else is arithmetic (:mod:`lightning_par.advisor.memory`).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from lightning_par._compat import tree_map

from lightning_par.advisor import advise, korthikanti_bytes_per_layer, profile_lightning_module
from lightning_par.advisor.memory import OPTIMIZER_STATES, PRECISION_BYTES, SCHEDULES

GiB = 1024**3


def machine_devices() -> tuple[int, int]:
    """(device count, bytes of memory per device) of this machine: its GPUs, else its CPU cores sharing RAM."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cores, ram // cores


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    devices, memory = machine_devices()
    p = argparse.ArgumentParser(prog="lightning-par-advise", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the training config (model=..., data=...)")
    p.add_argument("--devices", type=int, default=devices, help=f"device count (default: this machine's, {devices})")
    p.add_argument("--device-memory-gb", type=float, default=memory / GiB,
                   help=f"memory per device in GiB (default: this machine's, {memory / GiB:.1f})")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch per optimizer step (default: the data config's per-device batch × devices)")
    p.add_argument("--precision", default=None, choices=sorted(PRECISION_BYTES),
                   help="default: the training config's trainer.precision")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default 2 × stages)")
    p.add_argument("--probe-samples", type=int, default=2, help="micro-batch size of the activation probe")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    from hydra import compose, initialize_config_dir

    from lightning_par.config import check_keys, register_configs
    from lightning_par.paths import conf_dir
    from lightning_par.train import build_datamodule, build_model

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    check_keys(cfg)
    torch.manual_seed(cfg.seed)
    datamodule = build_datamodule(cfg.data)
    module = build_model(cfg.model, datamodule)
    batch = next(iter(datamodule.train_dataloader()))
    probe = tree_map(lambda t: t[: args.probe_samples] if isinstance(t, torch.Tensor) else t, batch)
    precision = args.precision or cfg.trainer.precision
    profile = profile_lightning_module(module, probe, precision=precision)
    batch_size = args.batch_size or datamodule.batch_size * args.devices
    memory = int(args.device_memory_gb * GiB)
    result = advise(profile, args.devices, memory, batch_size, precision=precision, optimizer=args.optimizer,
                    schedule=args.schedule, microbatches=args.microbatches)
    print(f"model: {type(module).__name__}, {profile.total_params:,} parameters, {profile.n_blocks} blocks; "
          f"global batch {batch_size}, {precision}, {args.optimizer}; {args.devices} devices × "
          f"{args.device_memory_gb:.1f} GiB")
    if profile.num_heads:
        formula = korthikanti_bytes_per_layer(profile.seq_len, 1, profile.hidden_size, profile.num_heads)
        measured = profile.block_activation_bytes[0]
        print(f"activations of one block per sample: measured {measured:,} B ({profile.dtype_bytes}-byte elements); "
              f"Korthikanti et al. sbh(34 + 5as/h) for 16-bit: {formula:,.0f} B")
    print(result.table())


if __name__ == "__main__":
    main()
