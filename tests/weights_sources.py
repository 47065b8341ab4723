"""The weights sources the reader tests share (tests/unit/test_weights_reader.py, test_weights_boxes.py): a tiny
GPT's state written as safetensors, torch.save, a Lightning checkpoint and a DCP directory (the DCP directories
written by two real gloo ranks, one fork), and an odd-shaped DCP state whose chunks cut the boxes the tests read.
The fixtures over them are session-wide, in tests/unit/conftest.py."""
import os
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

from harness import free_port, start_ranks
from lightning_par.models import GPT
from lightning_par.weights import open_weights

# vocab 30 and n_embd 10 split unevenly over 4 ranks (8, 8, 8, 6 rows; 3, 3, 3, 1 columns); block_size 5
# leaves rank 3 of 4 an empty Shard(0) of the position embedding (2, 2, 1, 0 rows)
GPT_CONFIG = dict(vocab_size=30, block_size=5, n_layer=2, n_head=2, n_embd=10, tie_weights=False)
KINDS = ["safetensors", "torch", "ckpt", "dcp"]


def gpt_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in GPT(**GPT_CONFIG).state_dict().items()}


def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(**GPT_CONFIG)



ODD = {"rows": ((7, 5), Shard(0)), "cols": ((5, 9), Shard(1))}  # chunks: rows 0-3 | 4-6; columns 0-4 | 5-8
ODD_BOXES = {"rows": [(0, 2, 4), ((3, 3), (1, 3)), (1, 1, 3), None],
             "cols": [(1, 3, 4), ((1, 3), (4, 3)), (0, 1, 2), None]}


def odd_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(shape, generator=g) for k, (shape, _) in ODD.items()}


def _placement(name: str, t: torch.Tensor):
    return Shard(1) if t.dim() == 2 and name.endswith(("q_proj.weight", "fc.weight", "lm_head.weight")) else \
        Shard(0) if t.dim() >= 1 else Replicate()


def _dcp_worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        from lightning_par.checkpoint import sharded as sharded_checkpoint

        mesh = init_device_mesh("cpu", (2,))
        sharded = {k: distribute_tensor(v, mesh, [_placement(k, v)]) for k, v in gpt_state().items()}
        sharded_checkpoint.save(os.path.join(out_dir, "gpt"), sharded, meta={"epoch": 0}, is_rank_zero=rank == 0)
        odd = {k: distribute_tensor(v, mesh, [ODD[k][1]]) for k, v in odd_state().items()}
        dcp.save({"odd": odd}, checkpoint_id=os.path.join(out_dir, "odd"))
        dist.barrier()
        # each rank reads its own DTensor shards back, the box taken from the DTensor's placements
        diffs = {}
        with open_weights(os.path.join(out_dir, "gpt")) as reader:
            for k, v in sharded.items():
                target = distribute_tensor(torch.zeros(v.shape), mesh, v.placements)
                reader.read_into(k, target)
                diffs[k] = (target.to_local() - v.to_local()).abs().max().item() if v.to_local().numel() else 0.0
        torch.save(diffs, os.path.join(out_dir, f"diffs{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_dcp_dirs(out) -> None:
    """The DCP directories ``gpt`` and ``odd`` under ``out``, with each rank's read-back differences."""
    start_ranks(_dcp_worker, (free_port(), str(out)), 2)


class _Tokens(pl.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        x = torch.randint(0, GPT_CONFIG["vocab_size"], (4, GPT_CONFIG["block_size"]), generator=g)
        return DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)


def write_sources(root, dcp_dirs) -> dict:
    """kind -> (path, the state the path holds)."""
    state = gpt_state()
    save_file(state, str(root / "gpt.safetensors"))
    torch.save(state, root / "gpt.pt")
    # a checkpoint that Lightning wrote itself, after a step, with optimizer and loop state beside the weights
    torch.manual_seed(0)
    module = GPT(**GPT_CONFIG)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=_Tokens())
    trainer.save_checkpoint(root / "gpt.ckpt")
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"safetensors": (root / "gpt.safetensors", state), "torch": (root / "gpt.pt", state),
            "ckpt": (root / "gpt.ckpt", trained), "dcp": (dcp_dirs / "gpt", state)}
