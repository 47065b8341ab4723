"""One rank of a 2-rank (``--world 4``: 4-rank) fit launched from outside Lightning (as torchrun launches it), whose rank ``--rank``
stops answering (``--fault stop``: SIGSTOP) or dies (``--fault kill``: SIGKILL) at the start of training
batch ``--step``, after writing the time to ``<--out>/fault``. Run by tests/dist/test_bounded_waits.py:

    python tests/dist/faulty_rank.py --strategy pp --fault stop --rank 1 --step 2 --timeout 5 --port 29512 \
        --out /tmp/x --me 0
"""
import argparse
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import trainer_kwargs  # noqa: E402
from models import tiny_gpt  # noqa: E402
from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,  # noqa: E402
                           TensorParallelStrategy)
from lightning_par.data import SyntheticCorpus  # noqa: E402


class Fault(pl.Callback):
    def __init__(self, rank: int, step: int, sig: int, out: str):
        self.rank, self.step, self.sig, self.out = rank, step, sig, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with open(os.path.join(self.out, "fault"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), self.sig)


def main(argv=None):
    ap = argparse.ArgumentParser()
    for name in ("strategy", "fault", "out"):
        ap.add_argument(f"--{name}", required=True)
    for name in ("rank", "step", "port", "me"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), WORLD_SIZE=str(a.world), NODE_RANK="0",
                      LOCAL_RANK=str(a.me))
    common = dict(start_method="popen", timeout=a.timeout)
    strategy = {"dp": lambda: DataParallelStrategy(**common),
                "pp": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, **common),
                "tp": lambda: TensorParallelStrategy(tensor_parallel_size=2, **common),
                "hybrid": lambda: HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                         data_parallel_size=a.world // 4, microbatches=2, **common),
                }[a.strategy]()
    torch.manual_seed(0)
    module = tiny_gpt()
    data = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=64, val_sequences=8)
    sig = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}[a.fault]
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=a.world, max_steps=10_000, max_time=None,
                                          callbacks=[Fault(a.rank, a.step, sig, a.out)]))
    trainer.fit(module, DataLoader(data.train_set, batch_size=4))


if __name__ == "__main__":
    main()
