"""The converter's files are torch's own: a ``.ckpt`` written by ``torch.save`` (64-byte aligned storages, its
version and serialization records, valid zip CRCs) with the bytes streamed in, safetensors of every dtype the
weights reader takes, float8 included; and the refusals of ``convert`` / ``describe`` (in-process; the console
script's exit status and messages are in tests/dist/test_checkpoint_cli.py)."""
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_par.checkpoint.convert import convert, describe
from lightning_par.checkpoint.writers import Lazy, tensor_leaves, write_safetensors, write_torch
from lightning_par.weights.sources import _SAFETENSORS_DTYPES, TensorInfo


def _state(dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                   torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)) -> dict:
    """One tensor per dtype, odd sizes (3, 5, 7 elements) so that unaligned offsets would show."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(dtypes):
        values = torch.randn(2 * i + 3, generator=g) * 4
        out[f"net.t{i}"] = values > 0 if dtype == torch.bool else values.to(dtype)
    out["net.empty"] = torch.zeros(0, 4)
    return out


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality for every dtype (float8 has no ``torch.equal`` on CPU builds of some versions)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                     b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("src_form", ["ckpt", "dcp"])
def test_a_converted_ckpt_is_torchs_own_archive(tmp_path, src_form):
    state = _state()
    rng = torch.get_rng_state()
    torch.save({"state_dict": state, "epoch": 1, "global_step": 7, "callbacks": {"mc": {"best": torch.tensor(0.5)}},
                "rng": rng}, tmp_path / "src.ckpt")
    src = tmp_path / "src.ckpt"
    if src_form == "dcp":  # a DCP source keeps the float8 entries and the metadata tensors as well
        convert(src, tmp_path / "dcp", weights_only=True)
        src = tmp_path / "dcp"
    assert convert(src, tmp_path / "out.ckpt", weights_only=True) == "ckpt"

    loaded = torch.load(tmp_path / "out.ckpt", mmap=True, weights_only=True)
    assert list(loaded["state_dict"]) == list(state)
    for name, tensor in loaded["state_dict"].items():
        assert _equal_bits(tensor, state[name]), name
    for tensor in tensor_leaves(loaded):  # the metadata's tensors too
        assert tensor.data_ptr() % 64 == 0, (tensor.dtype, tensor.shape, tensor.data_ptr() % 64)
    assert loaded["callbacks"]["mc"]["best"] == 0.5 and torch.equal(loaded["rng"], rng)
    assert (loaded["epoch"], loaded["global_step"]) == (1, 7)

    with zipfile.ZipFile(tmp_path / "out.ckpt") as archive:
        root = archive.namelist()[0].split("/")[0]
        names = set(archive.namelist())
        assert {f"{root}/{r}" for r in (".format_version", ".storage_alignment", "byteorder", "version",
                                        ".data/serialization_id", "data.pkl")} <= names
        assert archive.read(f"{root}/.storage_alignment") == b"64"
        assert archive.testzip() is None  # every record's CRC-32 matches its bytes, tensor records included
    # what torch.save itself writes for the same object has the same records
    torch.save(torch.load(tmp_path / "out.ckpt", weights_only=True), tmp_path / "ref.ckpt")
    with zipfile.ZipFile(tmp_path / "ref.ckpt") as ref:
        assert {n.split("/", 1)[1] for n in ref.namelist()} == {n.split("/", 1)[1] for n in names}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_round_trips_through_both_writers(tmp_path, dtype):
    values = torch.linspace(-6, 6, 13).to(dtype)
    torch.save({"w": values, "scale": torch.tensor(0.25)}, tmp_path / "raw.pt")
    convert(tmp_path / "raw.pt", tmp_path / "w.safetensors")
    convert(tmp_path / "w.safetensors", tmp_path / "back.ckpt", weights_only=True)  # safetensors -> torch
    assert _equal_bits(load_file(tmp_path / "w.safetensors")["w"], values)
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)["state_dict"]
    assert _equal_bits(back["w"], values) and back["scale"] == 0.25


def test_the_safetensors_writer_takes_every_dtype_the_reader_does(tmp_path):
    state = {code: torch.arange(3).to(dtype) for code, dtype in _SAFETENSORS_DTYPES.items()}
    lazies = {k: Lazy(TensorInfo(tuple(v.shape), v.dtype), lambda v=v: v) for k, v in state.items()}
    write_safetensors(str(tmp_path / "all.safetensors"), lazies)
    with safe_open(tmp_path / "all.safetensors", "pt") as f:
        for code in state:
            assert f.get_slice(code).get_dtype() == code
            assert _equal_bits(f.get_tensor(code), state[code])


def test_write_torch_keeps_a_tensor_named_twice_as_one_storage(tmp_path):
    shared = Lazy(TensorInfo((4,), torch.float32), lambda: torch.arange(4.0))
    write_torch(str(tmp_path / "t.pt"), {"a": shared, "b": [shared, torch.tensor([1, 2])]})
    out = torch.load(tmp_path / "t.pt", weights_only=True)
    assert out["a"].untyped_storage().data_ptr() == out["b"][0].untyped_storage().data_ptr()
    assert torch.equal(out["a"], torch.arange(4.0)) and torch.equal(out["b"][1], torch.tensor([1, 2]))


def test_inspect_tells_a_state_dict_from_a_lightning_checkpoint(tmp_path):
    state = _state((torch.float32, torch.int64))
    torch.save(state, tmp_path / "raw.pt")
    torch.save({"state_dict": state, "epoch": 0, "global_step": 2}, tmp_path / "one.ckpt")
    raw, ckpt = describe(tmp_path / "raw.pt"), describe(tmp_path / "one.ckpt")
    assert raw.splitlines()[0].endswith(": a state dict of 3 tensors (torch.save file, not a Lightning checkpoint)")
    assert "layout: weights only" in raw and "global_step" not in raw
    assert ckpt.splitlines()[0].endswith(": Lightning checkpoint file") and "global_step: 2" in ckpt


def test_mistakes_are_refused_with_the_value_and_the_fix(tmp_path):
    torch.save({"state_dict": _state((torch.float32,)), "epoch": 0}, tmp_path / "one.ckpt")
    with pytest.raises(ValueError, match=r"The prefix 'foo\.' \(--strip-prefix\) starts none of the 2 tensor names "
                                         r"in .*one\.ckpt; they start with 'net\.' \(2\)\. Pass one of those"):
        convert(tmp_path / "one.ckpt", tmp_path / "w.safetensors", strip_prefix="foo.")
    with pytest.raises(FileNotFoundError, match=r"The folder .*nowhere of .*nowhere/w\.ckpt does not exist: create it "
                                                r"first \(mkdir -p .*nowhere\)"):
        convert(tmp_path / "one.ckpt", tmp_path / "nowhere" / "w.ckpt")
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist"):
        convert(tmp_path / "missing.ckpt", tmp_path / "w.ckpt")
    torch.save(_state((torch.float32,)), tmp_path / "raw.pt")
    with pytest.raises(ValueError, match=r"raw\.pt holds weights only; pass --weights-only"):
        convert(tmp_path / "raw.pt", tmp_path / "w.ckpt")
    assert not list(tmp_path.glob("w*")) and not list(tmp_path.glob(".w*"))  # nothing half-written left
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.bin").write_bytes(b"a user's file")
    with pytest.raises(FileExistsError, match=r"models exists and is not a checkpoint directory; .* would replace it\. "
                                              r"Name a new directory \(say .*models/ckpt\) or a file"):
        convert(tmp_path / "one.ckpt", tmp_path / "models")  # a DCP destination: never in place of a folder
    assert (tmp_path / "models" / "mine.bin").read_bytes() == b"a user's file"
    convert(tmp_path / "one.ckpt", tmp_path / "dcp")
    convert(tmp_path / "one.ckpt", tmp_path / "dcp")  # an older checkpoint directory is replaced, as a file is


class Note:
    """A callback's custom state object (DCP keeps Lightning's metadata as a pickle, so any object can be there)."""

    def __init__(self, value):
        self.value = value


def test_custom_objects_in_the_metadata_travel_and_tensors_inside_them_are_refused(tmp_path):
    from lightning_par.checkpoint import sharded

    model = {"w": torch.arange(6.0).view(2, 3)}
    sharded.save(str(tmp_path / "plain"), model, meta={"epoch": 0, "callbacks": {"note": Note("kept")}})
    convert(tmp_path / "plain", tmp_path / "plain.ckpt")
    out = torch.load(tmp_path / "plain.ckpt", weights_only=False, mmap=True)
    assert out["callbacks"]["note"].value == "kept" and torch.equal(out["state_dict"]["w"], model["w"])

    sharded.save(str(tmp_path / "hidden"), model, meta={"epoch": 0, "callbacks": {"note": Note(torch.ones(3))}})
    with pytest.raises(ValueError, match=r"hidden\.ckpt: it would hold 1 tensor\(s\) inside objects other than "
                                         r"dicts, lists and tuples .* Convert with --weights-only"):
        convert(tmp_path / "hidden", tmp_path / "hidden.ckpt")
    assert not (tmp_path / "hidden.ckpt").exists()
