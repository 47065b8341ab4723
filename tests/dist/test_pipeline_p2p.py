"""Point-to-point paths of the pipeline on real gloo ranks: activations whose data receive is posted
before the send ([Note: speculative receive] in lightning_par/pipeline/p2p.py) equal the sent ones whether
the next activation keeps the previous shape and dtype or not; the result mailbox ([Note: result mailbox])
delivers small and oversized payloads, with or without an early post."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.pipeline import p2p
from lightning_par.pipeline.mailbox import ResultMailbox

# one step's activations: equal shapes, a smaller last micro-batch, a dtype change, then equal again
SHAPES = [((4, 3, 8), torch.float32), ((4, 3, 8), torch.float32), ((2, 3, 8), torch.float32),
          ((2, 3, 8), torch.bfloat16), ((2, 3, 8), torch.bfloat16), ((5, 7), torch.float64)]


def _activation(i: int) -> torch.Tensor:
    shape, dtype = SHAPES[i]
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1000 * i).to(dtype)


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    got = []
    if rank == 0:
        works, last = [], None
        for i in range(len(SHAPES)):
            x = _activation(i)
            p2p.send_activation(x, 1, works, tag=i, posted_like=last)  # what rank 1 posted: the previous one's shape
            last = (tuple(x.shape), x.dtype)
        p2p.wait_all(works)
    else:
        posted = None
        for i in range(len(SHAPES)):
            x = p2p.recv_activation(0, torch.device("cpu"), tag=i, posted=posted)
            got.append(x)
            if i + 1 < len(SHAPES):
                posted = p2p.post_recv_activation(0, torch.device("cpu"), tag=i + 1, like=(x.shape, x.dtype))
        torch.save(got, os.path.join(out_dir, "received.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_speculative_receives_deliver_every_shape_and_dtype(tmp_path):
    start_ranks(_worker, (free_port(), str(tmp_path)), 2)
    got = torch.load(tmp_path / "received.pt")
    assert len(got) == len(SHAPES)
    for i, x in enumerate(got):
        expected = _activation(i)
        assert x.dtype == expected.dtype and x.shape == expected.shape, i
        assert torch.equal(x, expected), i


def test_a_changed_activation_is_announced_as_a_refill():
    x = torch.zeros(2, 3)
    assert int(p2p.header_of(x, refill=True)[2]) == 1
    assert int(p2p.header_of(x)[2]) == 0


def _payloads():
    big = torch.arange(4096, dtype=torch.float32)  # 16 KiB: outgrows the first message, needs the second
    scalar = torch.tensor(0.1, dtype=torch.bfloat16)  # a 0-dim tensor travels as a number: dtype kept
    return [(torch.tensor(1.5), [("loss", torch.tensor(2.0), {"prog_bar": True})]), {"preds": big}, scalar, None, "last"]


def _mailbox_worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    box = ResultMailbox(ranks=[0, 1, 2], me=rank, group=None, device=torch.device("cpu"))
    got = []
    for step, payload in enumerate(_payloads()):
        if step != 3:
            box.post()  # step 3: the receivers post late (receive() posts for them)
        if box.is_sender:
            box.send(payload)
            box.finish()
        else:
            got.append(box.receive())
    torch.save(got, os.path.join(out_dir, f"got{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_the_result_mailbox_delivers_every_payload_to_every_other_rank(tmp_path):
    start_ranks(_mailbox_worker, (free_port(), str(tmp_path)), 3)
    expected = _payloads()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"got{rank}.pt", weights_only=False)
        assert len(got) == len(expected)
        (loss, logs), preds, scalar, none, last = got
        assert torch.equal(loss, expected[0][0]) and logs[0][0] == "loss" and logs[0][2] == {"prog_bar": True}
        assert torch.equal(logs[0][1], expected[0][1][0][1])
        assert torch.equal(preds["preds"], expected[1]["preds"])
        assert scalar.dtype == torch.bfloat16 and torch.equal(scalar, expected[2])
        assert none is None and last == "last"
