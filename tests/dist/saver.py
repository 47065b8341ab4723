"""Saves checkpoints the way the strategies do (files through AtomicCheckpointIO, torch.distributed.checkpoint
directories through lightning_par.checkpoint.sharded.save: a hidden temporary published atomically), for
tests/dist/test_atomic_checkpoints.py, which kills it mid-save:

    python tests/dist/saver.py FOLDER loop                # saves for ever: files ckpt0/1.ckpt, directories dcp0/1
    python tests/dist/saver.py FOLDER write|write_dir|replace|aside   # saves once, then dies in the next save
"""
import os
import signal
import sys

import torch

from lightning_par.checkpoint import sharded
from lightning_par.strategies._checkpoint_io import AtomicCheckpointIO

N = 1 << 20  # 4 MiB per tensor: a save takes long enough to be caught in the middle


def checkpoint(step: int) -> dict:
    return {"state_dict": {"w": torch.full((N,), float(step)), "b": torch.full((7,), float(step))},
            "optimizer_states": [], "global_step": step}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def save_file(folder, name, step):
    AtomicCheckpointIO().save_checkpoint(checkpoint(step), os.path.join(folder, name))


def save_dir(folder, name, step):
    ckpt = checkpoint(step)
    sharded.save(os.path.join(folder, name), ckpt["state_dict"], ckpt["optimizer_states"],
                 {"global_step": step}, is_rank_zero=True)


def main(folder, mode):
    if mode == "loop":
        step = 0
        while True:
            save_file(folder, f"ckpt{step % 2}.ckpt", step)
            save_dir(folder, f"dcp{step % 2}", step)
            step += 1
    save_file(folder, "ckpt0.ckpt", 1)
    save_dir(folder, "dcp0", 1)
    if mode == "write":  # dies with half the bytes of the file written
        real_save = torch.save
        torch.save = lambda obj, f: (open(f, "wb").write(b"\x80" * 1000), die())
        save_file(folder, "ckpt0.ckpt", 2)
        torch.save = real_save
    if mode == "write_dir":  # dies with the DCP shards and .metadata written, before the directory is published
        sharded.publish = lambda *a: die()
        save_dir(folder, "dcp0", 2)
    if mode == "replace":  # dies with the file and the directory written, before either is renamed
        os.replace = lambda *a: die()
        save_file(folder, "ckpt0.ckpt", 2)
    if mode == "aside":  # dies between moving the old directory aside and renaming the new one in
        real_rename = os.rename  # (dcp.save renames its .metadata.tmp too)
        os.rename = lambda a, b: die() if str(a).endswith(".partial") else real_rename(a, b)
        save_dir(folder, "dcp0", 2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
