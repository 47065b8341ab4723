"""The checkpoint format without processes: optimizer state by name and one device's numbering, the
converter's round trips between a Lightning file, a DCP directory and safetensors (streamed: bounded
memory), ``inspect``, and bad checkpoints refused with the path and the keys."""
import doctest
import os

import lightning.pytorch as pl
import pytest
import torch

import lightning_par.checkpoint.optim as optim_mod
from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.checkpoint import sharded
from lightning_par.checkpoint.cli import main as cli
from lightning_par.checkpoint.convert import convert, describe
from lightning_par.models import GPT


def test_optim_doctests():
    assert doctest.testmod(optim_mod).failed == 0


def one_device_checkpoint(path, steps=2, names=True):
    """A checkpoint as plain Lightning writes it on one device (two AdamW steps), plus the names of the
    optimizer's order when ``names`` (what lightning_par's strategies add)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}])
    for _ in range(steps):
        model(torch.randint(0, 32, (2, 8))).sum().backward()
        opt.step()
    ckpt = {"epoch": 0, "global_step": steps, "pytorch-lightning_version": pl.__version__,
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "loops": {"fit_loop": {"x": 1}}, "callbacks": {}}
    if names:
        ids = {id(p): n for n, p in model.named_parameters()}
        ckpt["lightning_par"] = {"layout": {"strategy": "single", "world_size": 1},
                                 "param_names": [[[ids[id(p)] for p in g["params"]] for g in opt.param_groups]]}
    torch.save(ckpt, path)
    return ckpt


def test_file_to_dcp_to_file_round_trip_is_exact(tmp_path):
    src = one_device_checkpoint(tmp_path / "one.ckpt")
    convert(tmp_path / "one.ckpt", tmp_path / "dcp")
    assert sharded.is_sharded(tmp_path / "dcp") and not os.path.exists(str(tmp_path / ".dcp.partial"))
    convert(tmp_path / "dcp", tmp_path / "back.ckpt")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert set(back) == set(src)
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "lightning_par"):
        assert back[key] == src[key], key
    assert list(back["state_dict"]) == list(src["state_dict"])
    torch.testing.assert_close(back["state_dict"], src["state_dict"], atol=0, rtol=0)
    torch.testing.assert_close(back["optimizer_states"], src["optimizer_states"], atol=0, rtol=0)
    # the converted file is an ordinary checkpoint of the unchanged module
    GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16).load_state_dict(back["state_dict"])


def test_safetensors_with_a_stripped_prefix_and_inspect(tmp_path, capsys):
    from safetensors.torch import load_file

    src = one_device_checkpoint(tmp_path / "one.ckpt")
    args = ["convert", str(tmp_path / "one.ckpt"), str(tmp_path / "w.safetensors"), "--strip-prefix", "blocks."]
    assert cli(args) == 0
    weights = load_file(tmp_path / "w.safetensors")
    assert "0.attn.q_proj.weight" in weights and "tok_emb.weight" in weights
    torch.testing.assert_close(weights["0.attn.q_proj.weight"], src["state_dict"]["blocks.0.attn.q_proj.weight"])
    assert cli(["inspect", str(tmp_path / "one.ckpt")]) == 0
    out = capsys.readouterr().out
    assert "layout: strategy=single, world_size=1" in out and "global_step: 2" in out
    assert "blocks.0.attn.q_proj.weight  [16, 16]  float32" in out and "optimizer 0: groups of [" in out


def test_a_plain_lightning_file_without_names_is_not_converted_to_dcp(tmp_path):
    one_device_checkpoint(tmp_path / "plain.ckpt", names=False)
    assert "plain Lightning (one device)" in describe(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match=r"plain\.ckpt are numbered by position and the file does not say"):
        convert(tmp_path / "plain.ckpt", tmp_path / "dcp")
    convert(tmp_path / "plain.ckpt", tmp_path / "dcp", weights_only=True)  # the weights alone travel
    assert sharded.model_names(str(tmp_path / "dcp"))["tok_emb.weight"] == (32, 16)


# the peak resident memory of a process: /proc's VmHWM, reset where the run starts (writing 5 to
# /proc/self/clear_refs, Linux 4.0+); getrusage's ru_maxrss cannot be reset and keeps the forking parent's peak
def _vmhwm_kib() -> int:
    return int([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])


def _run_measured(args: tuple) -> None:
    import ctypes

    from lightning_par.checkpoint.convert import convert

    # glibc serves a large allocation from its own mapping (returned on free) only above a threshold that grows
    # with the sizes a process has freed: pytest's history had raised it, so a forked child kept freed tensors on
    # its heap. A fresh interpreter's threshold, fixed (M_MMAP_THRESHOLD = -3: 128 KiB, no growth).
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if args[0] != "baseline":
        convert(args[0], args[1])
    elif len(args) > 1:  # the contrast: a conversion that loads everything
        torch.save(torch.load(args[1], weights_only=True), args[1] + ".copy")


def _peak_kib(*runs: tuple) -> list[int]:
    """The peak of each run, the runs at the same time, each in its own process forked from this one (its own
    process image, whose peak does not depend on the others'): a forked child has everything imported, so the
    runs cost no interpreter starts."""
    children = []
    for args in runs:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its peak, or its error, through the pipe; never back into pytest
            code = 1
            try:
                os.close(read)
                try:
                    _run_measured(args)
                    message, code = str(_vmhwm_kib()), 0
                except BaseException:
                    import traceback

                    message = traceback.format_exc()
                with os.fdopen(write, "w") as out:
                    out.write(message)
            finally:
                os._exit(code)
        os.close(write)
        children.append((args, pid, read))
    peaks = []
    for args, pid, read in children:
        with os.fdopen(read) as pipe:
            message = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (args, message[-2000:])
        peaks.append(int(message))
    return peaks


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak memory read from /proc (Linux)")
def test_conversion_streams_tensor_by_tensor(tmp_path):
    """Converting 192 MiB in 96 tensors of 2 MiB holds about one tensor at a time: the converting process's peak
    resident memory exceeds that of a process that only imports by a bound that does not grow with the
    checkpoint (a conversion that loads the file whole exceeds it by the whole size)."""
    tensors = {f"layer{i}.weight": torch.full((512, 1024), float(i)) for i in range(96)}
    total_mib = sum(t.numel() * 4 for t in tensors.values()) / 2**20
    torch.save({"state_dict": tensors, "epoch": 0, "global_step": 0}, tmp_path / "big.ckpt")
    del tensors
    conversions = [("big.ckpt", "dcp"), ("big.ckpt", "big.safetensors")]
    baseline, whole, *peaks = _peak_kib(("baseline",), ("baseline", str(tmp_path / "big.ckpt")),
                                        *((str(tmp_path / src), str(tmp_path / dst)) for src, dst in conversions))
    conversions.append(("dcp", "again.ckpt"))  # reads what the first conversion wrote
    peaks += _peak_kib((str(tmp_path / "dcp"), str(tmp_path / "again.ckpt")))
    whole = (whole - baseline) / 1024
    assert whole > 0.9 * total_mib  # the measurement sees a conversion that holds everything
    for (src, dst), peak in zip(conversions, peaks):
        extra_mib = (peak - baseline) / 1024
        assert extra_mib < 32, (src, dst, extra_mib, total_mib)  # 2 MiB tensors, buffers, DCP's planning
    again = torch.load(tmp_path / "again.ckpt", weights_only=True, mmap=True)
    assert again["state_dict"]["layer95.weight"][0, 0] == 95.0


# -- bad checkpoints -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy])
def test_a_truncated_file_is_refused_with_its_path(tmp_path, cls):
    one_device_checkpoint(tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"The checkpoint .*cut\.ckpt cannot be read \(truncated"):
        cls().load_checkpoint(tmp_path / "cut.ckpt")


def test_a_truncated_directory_is_refused_with_its_path(tmp_path):
    one_device_checkpoint(tmp_path / "good.ckpt")
    convert(tmp_path / "good.ckpt", tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match=r"The checkpoint .*dcp cannot be read as a torch.distributed.checkpoint"):
        DataParallelStrategy().load_checkpoint(tmp_path / "dcp")


def test_a_directory_with_a_data_file_cut_short_is_refused_with_its_path_and_entries(tmp_path):
    one_device_checkpoint(tmp_path / "good.ckpt")
    convert(tmp_path / "good.ckpt", tmp_path / "dcp")
    strategy = DataParallelStrategy()
    strategy.connect(GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    checkpoint = strategy.load_checkpoint(tmp_path / "dcp")
    for data in [f for f in os.listdir(tmp_path / "dcp") if f.endswith(".distcp")]:  # one file per entry
        with open(tmp_path / "dcp" / data, "r+b") as f:
            f.truncate(os.path.getsize(tmp_path / "dcp" / data) // 2)
    with pytest.raises(ValueError, match=r"Reading \d+ entries \(state_dict\.blocks\.0\..*\) from the checkpoint "
                                         r".*dcp failed"):
        strategy.load_model_state_dict(checkpoint)


@pytest.mark.parametrize("form", ["file", "dcp"])
def test_another_models_checkpoint_and_missing_keys_are_refused_with_the_path_and_keys(tmp_path, form):
    one_device_checkpoint(tmp_path / "gpt.ckpt")
    path = tmp_path / "gpt.ckpt"
    if form == "dcp":
        convert(path, tmp_path / "dcp")
        path = tmp_path / "dcp"
    strategy = DataParallelStrategy()
    wider = GPT(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=24)  # another model
    strategy.connect(wider)
    checkpoint = strategy.load_checkpoint(path)
    with pytest.raises(ValueError, match=r"(?s)The checkpoint .*(gpt\.ckpt|dcp) does not fit GPT: \d+ missing: "
                                         r"blocks\.2\..*mis-shaped: .*tok_emb\.weight: checkpoint \(32, 16\), "
                                         r"module \(32, 24\)"):
        strategy.load_model_state_dict(checkpoint)
    # a checkpoint lacking keys of the right model
    if form == "file":
        state = torch.load(tmp_path / "gpt.ckpt", weights_only=True)
        del state["state_dict"]["ln_f.weight"], state["state_dict"]["blocks.1.mlp.fc.bias"]
        torch.save(state, tmp_path / "lacking.ckpt")
        strategy = DataParallelStrategy()
        strategy.connect(GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
        with pytest.raises(ValueError, match=r"lacking\.ckpt does not fit GPT: 2 missing: blocks\.1\.mlp\.fc\.bias, "
                                             r"ln_f\.weight"):
            strategy.load_model_state_dict(strategy.load_checkpoint(tmp_path / "lacking.ckpt"))
