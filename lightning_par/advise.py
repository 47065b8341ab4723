"""``lightning-par-advise``: which layout to train a model with, and what each would cost per device.

    lightning-par-advise                                       # reference GPT on this machine's devices
    lightning-par-advise model.n_layer=48 model.n_embd=2048 --devices 8 --device-memory-gb 80
    lightning-par-advise data=classification model=mlp --precision bf16-mixed
    lightning-par-advise data.seq_len=1024 --devices 1 --device-memory-gb 2    # activations dominate: checkpointing
    lightning-par-advise data.seq_len=4096 --batch-size 1 --devices 4 --device-memory-gb 0.25   # context parallel

Positional ``key=value`` arguments are the training app's Hydra overrides (``model=``, ``data=``, ...),
so the advice is for exactly the model ``lightning-par-train`` would build. The model runs one
forward/backward on a micro-batch of real data to measure its activations (see
:mod:`lightning_par.advisor.profile`); everything else is arithmetic (:mod:`lightning_par.advisor.memory`).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch
from lightning_par._compat import tree_map

from lightning_par.advisor import advise, korthikanti_bytes_per_layer, profile_lightning_module
from lightning_par.advisor.memory import (CHECKPOINTING, OPTIMIZER_STATES, PRECISION_BYTES, SCHEDULES,
                                          block_kept_bytes, recompute_share)
from lightning_par.cli_errors import ArgumentParser, cwd_importable, run_cli

PROG = "lightning-par-advise"

GiB = 1024**3


def machine_devices() -> tuple[int, int]:
    """(device count, bytes of memory per device) of this machine: its GPUs, else its CPU cores sharing RAM."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cores, ram // cores


def parse(argv: list[str]) -> argparse.Namespace:
    devices, memory = machine_devices()
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
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
    p.add_argument("--no-context-parallel", dest="context", action="store_false",
                   help="leave context-parallel layouts out (considered where a method serves every block's attention)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="bandwidth each rank sends at, Gbit/s, to price communication in step time (default 100)")
    args = p.parse_intermixed_args(argv)
    for name in ("devices", "probe_samples", "microbatches", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer.")
    if args.device_memory_gb <= 0:
        p.error(f"--device-memory-gb={args.device_memory_gb} must be positive.")
    if args.link_gbps <= 0:
        p.error(f"--link-gbps={args.link_gbps} must be positive.")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script: a user's mistake is one message and exit 2 (``--debug``: the traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cwd_importable()  # `model=custom model._target_=my_pkg.MyModule`, as lightning-par-train takes it
    run_cli(PROG, lambda: advise_command(argv), argv)


def build(overrides: Sequence[str]):
    """The config, data module and module ``lightning-par-train`` would build for ``overrides``; a mistake in
    them is a :class:`UsageError` naming it."""
    from hydra import compose, initialize_config_dir

    from lightning_par.config import check_keys, register_configs
    from lightning_par.paths import conf_dir
    from lightning_par.train import build_datamodule, build_model, user_errors

    register_configs()
    with user_errors(), initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
        check_keys(cfg)
        torch.manual_seed(cfg.seed)
        datamodule = build_datamodule(cfg.data)
        return cfg, datamodule, build_model(cfg.model, datamodule)


def advise_command(argv: Sequence[str]) -> None:
    args = parse(list(argv))
    cfg, datamodule, module = build(args.overrides)
    batch = next(iter(datamodule.train_dataloader()))
    probe = tree_map(lambda t: t[: args.probe_samples] if isinstance(t, torch.Tensor) else t, batch)
    precision = args.precision or cfg.trainer.precision
    profile = profile_lightning_module(module, probe, precision=precision)
    batch_size = args.batch_size or datamodule.batch_size * args.devices
    memory = int(args.device_memory_gb * GiB)
    result = advise(profile, args.devices, memory, batch_size, precision=precision, optimizer=args.optimizer,
                    schedule=args.schedule, microbatches=args.microbatches, link_bytes_per_s=args.link_gbps * 1e9 / 8,
                    context=args.context)
    print(f"model: {type(module).__name__}, {profile.total_params:,} parameters, {profile.n_blocks} blocks; "
          f"global batch {batch_size}, {precision}, {args.optimizer}; {args.devices} devices × "
          f"{args.device_memory_gb:.1f} GiB")
    if profile.num_heads:
        formula = korthikanti_bytes_per_layer(profile.seq_len, 1, profile.hidden_size, profile.num_heads)
        measured = profile.block_activation_bytes[0]
        print(f"activations of one block per sample: measured {measured:,} B ({profile.dtype_bytes}-byte elements); "
              f"Korthikanti et al. sbh(34 + 5as/h) for 16-bit: {formula:,.0f} B")
    if profile.n_blocks:
        print(checkpointing_summary(profile))
        print(context_summary(profile, args.context))
        print(expert_summary(profile))
    print(result.table())


def checkpointing_summary(profile) -> str:
    """What one block keeps per sample under each activation checkpointing mode, and what each costs in time
    (the probe's timing: the blocks' forward run again, or the ops selective checkpointing does not keep)."""
    modes = []
    for mode in CHECKPOINTING:
        name = "off" if mode is None else (mode if isinstance(mode, str) else f"every {mode}")
        kept = sum(block_kept_bytes(profile, i, mode) for i in range(profile.n_blocks)) / profile.n_blocks
        modes.append(f"{name} {kept:,.0f} B (+{recompute_share(profile, mode):.0%} step time)")
    timed = "timed by the probe" if profile.step_s_per_sample else "not timed: a third of a step assumed"
    return "activation checkpointing, kept per block and sample (" + timed + "): " + "; ".join(modes)


def context_summary(profile, considered: bool = True) -> str:
    """Whether context-parallel layouts are among the candidates, with which method, and the bytes it moves."""
    if not profile.context_methods:
        return ("context parallelism: not considered (a block's attention called neither scaled_dot_product_attention "
                "nor Hugging Face's attention interface, the calls its methods route across the group)")
    if not considered:
        return "context parallelism: left out (--no-context-parallel)"
    if "ring" not in profile.context_methods:
        io = sum(profile.block_attention_io_bytes) / profile.n_blocks
        return (f"context parallelism: considered with context_parallel_method='ulysses' (the blocks' attention is "
                f"eager, through Hugging Face's attention interface; the ring serves SDPA only) at sizes c with 2c "
                f"dividing the sequence ({profile.seq_len}) and c dividing the query heads ({profile.num_heads}); its "
                f"all-to-alls carry q, k, v and the output, {io:,.0f} B per block and sample, split over the c ranks")
    kv = sum(profile.block_kv_bytes) / profile.n_blocks
    return (f"context parallelism: considered at sizes c with 2c dividing the sequence ({profile.seq_len}); the ring "
            f"passes K and V of {kv:,.0f} B per block and sample ({profile.kv_dtype_bytes}-byte elements), "
            f"split over the c ranks")


def expert_summary(profile) -> str:
    """Whether expert-parallel layouts (``EPn``) are among the candidates, and what they divide."""
    if not profile.moe_blocks:
        return "expert parallelism: not considered (no routed experts found)"
    experts = sum(profile.block_expert_params)
    return (f"expert parallelism: considered at sizes dividing dp × cp and the {profile.num_experts} experts of a "
            f"layer, ZeRO 0 / 1 (EPn rows); routed experts {experts:,} parameters ({experts / profile.total_params:.0%})"
            f" in {profile.moe_blocks} blocks, held / ep per rank; top-{max(profile.expert_top_k, 1)} all-to-all of "
            f"the tokens 4 times per MoE block and micro-batch")


if __name__ == "__main__":
    main()
