"""The streaming weights reader (lightning_par.weights): every kind of weights source round-trips a state
dict, names map with prefixes and ties, bad files are refused with the names and the path before any
read, and a rank's box of a tensor reads exactly the box's bytes (checked against /proc/self/io where
the reads are this package's own). The DCP directories are written by two real gloo ranks (one fork)."""
import doctest
import os
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

import lightning_par._compat as compat
import lightning_par.weights.reader as reader_module
import lightning_par.weights.regions as regions_module
from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.models import GPT
from lightning_par.weights import (expected_state, open_weights, region_slices, shard_region,
                                   split_region)
from lightning_par.weights.regions import region_shape

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


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


PROC_SLACK = 16  # reading /proc/self/io counts itself; its length varies by a few digits between reads


def _measured(read):
    """``read()``'s result and the bytes the kernel saw this process read meanwhile (/proc/self/io rchar,
    less what reading /proc/self/io itself costs)."""
    r0 = _rchar()
    r1 = _rchar()
    out = read()
    r2 = _rchar()
    return out, (r2 - r1) - (r1 - r0)


def _chunk(full: torch.Tensor, world: int, rank: int, dim: int) -> torch.Tensor:
    """What torch.chunk gives rank ``rank`` (empty past the last chunk): the independent truth for Shard(dim)."""
    parts = full.chunk(world, dim)
    return parts[rank] if rank < len(parts) else full.narrow(dim, full.shape[dim], 0)


# -- two gloo ranks write the DCP directories ------------------------------------------------------------

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


@pytest.fixture(scope="module")
def dcp_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    start_ranks(_dcp_worker, (free_port(), str(out)), 2)
    return out


# -- every source kind --------------------------------------------------------------------------------------

class _Tokens(pl.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        x = torch.randint(0, GPT_CONFIG["vocab_size"], (4, GPT_CONFIG["block_size"]), generator=g)
        return DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, dcp_dirs):
    """kind -> (path, the state the path holds)."""
    root = tmp_path_factory.mktemp("weights")
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


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_the_gpt_state(sources, kind):
    path, state = sources[kind]
    with open_weights(path) as reader:
        assert reader.check(expected_state(meta_gpt())) == ((), ())
        assert {k: (v.shape, v.dtype) for k, v in reader.tensors.items()} == \
            {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        assert reader.bytes_read == 0  # listing and checking read no tensor data
        for name, full in state.items():
            target = torch.full_like(full, float("nan"))
            assert reader.read_into(name, target) is target
            torch.testing.assert_close(target, full, rtol=0, atol=0)
        assert reader.bytes_read == sum(v.nbytes for v in state.values())


@pytest.mark.timeout(TIMEOUT_S)
def test_dcp_directory_read_into_dtensor_shards_on_each_rank(dcp_dirs):
    for rank in (0, 1):
        diffs = torch.load(dcp_dirs / f"diffs{rank}.pt")
        assert set(diffs) == set(gpt_state()) and max(diffs.values()) == 0.0


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """Two tiny Hugging Face Llamas saved as sharded safetensors directories: untied and tied."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for tie in (False, True):
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        path = tmp_path_factory.mktemp(f"llama_tied{int(tie)}")
        model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
        out[tie] = (path, model)
    return out


class Wrapper(nn.Module):
    """A user's module that holds the Hugging Face model as ``self.net``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.net = model


@pytest.mark.timeout(TIMEOUT_S)
def test_sharded_hugging_face_directory_under_a_prefix(llama_dirs):
    path, model = llama_dirs[False]
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    with torch.device("meta"):
        wrapped = Wrapper(type(model)(model.config))
    with open_weights(path, prefix="net.") as reader:
        assert reader.file_name("net.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
        reader.check(expected_state(wrapped))
        for name, full in model.state_dict().items():
            target = torch.empty_like(full)
            torch.testing.assert_close(reader.read_into("net." + name, target), full, rtol=0, atol=0)
    with open_weights(path) as plain, pytest.raises(ValueError) as err:
        plain.check(expected_state(wrapped))
    assert str(path) in str(err.value) and "prefix='net.'?" in str(err.value)


@pytest.mark.timeout(TIMEOUT_S)
def test_strip_prefix_reads_a_causal_lm_file_into_its_base_model(llama_dirs):
    path, model = llama_dirs[False]
    with torch.device("meta"):
        base = type(model.model)(model.config)  # LlamaModel: names without `model.`, no lm_head
    with open_weights(path, strip_prefix="model.") as reader:
        with pytest.raises(ValueError, match=r"1 unexpected .*: lm_head\.weight"):
            reader.check(expected_state(base))
        reader.check(expected_state(base), ignore=("lm_head.*",))
        target = torch.empty(model.config.vocab_size, model.config.hidden_size)
        reader.read_into("embed_tokens.weight", target)
        torch.testing.assert_close(target, model.model.embed_tokens.weight.detach(), rtol=0, atol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_tied_weights_read_from_the_entry_they_are_tied_to(llama_dirs):
    path, model = llama_dirs[True]
    with torch.device("meta"):
        module = type(model)(model.config)
    expected = expected_state(module)
    assert "lm_head.weight" in expected
    with open_weights(path) as untied:
        assert "lm_head.weight" not in untied.tensors  # Hugging Face writes the embedding only
        with pytest.raises(ValueError, match=r"1 missing .*: lm_head\.weight"):
            untied.check(expected)
    with open_weights(path, tied={"lm_head.weight": "model.embed_tokens.weight"}) as reader:
        reader.check(expected)
        head = reader.read_into("lm_head.weight", torch.empty(expected["lm_head.weight"].shape))
        torch.testing.assert_close(head, model.model.embed_tokens.weight.detach(), rtol=0, atol=0)


# -- refusals before any read -------------------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_missing_unexpected_and_mis_shaped_names_are_refused_with_the_path(sources, kind):
    path, _ = sources[kind]
    expected = expected_state(meta_gpt())
    expected.pop("lm_head.weight")                                     # the file's: unexpected
    expected["blocks.9.attn.q_proj.weight"] = ((10, 10), torch.float32)  # the module's: missing
    expected["ln_f.weight"] = ((11,), torch.float32)                   # mis-shaped
    expected["ln_f.bias"] = ((10,), torch.int64)                       # a dtype of another kind
    with open_weights(path) as reader:
        with pytest.raises(ValueError) as err:
            reader.check(expected)
        message = str(err.value)
        assert str(path) in message
        assert "1 missing" in message and "blocks.9.attn.q_proj.weight" in message
        assert "1 unexpected" in message and "lm_head.weight" in message
        assert "2 mis-shaped" in message and "ln_f.weight: file (10,) torch.float32, module (11,)" in message
        assert "ln_f.bias" in message
        # strict=False lets names be missing or unexpected, never mis-shaped
        with pytest.raises(ValueError, match="2 mis-shaped"):
            reader.check(expected, strict=False)
        expected["ln_f.weight"] = expected["ln_f.bias"] = ((10,), torch.float32)
        assert reader.check(expected, strict=False) == (("blocks.9.attn.q_proj.weight",), ("lm_head.weight",))
        assert reader.check(expected, ignore=("blocks.9.*", "lm_head.*")) == ((), ())
        assert reader.bytes_read == 0


@pytest.mark.timeout(TIMEOUT_S)
def test_long_lists_show_ten_names_and_count_the_rest(sources):
    path, state = sources["safetensors"]
    expected = {f"other.{k}": v for k, v in state.items()}
    with open_weights(path) as reader, pytest.raises(ValueError) as err:
        reader.check(expected)
    n = len(state)
    assert f"{n} missing" in str(err.value) and f"... and {n - 10} more" in str(err.value)
    assert "prefix='other.'?" in str(err.value)


@pytest.mark.timeout(TIMEOUT_S)
def test_bad_reads_and_bad_files_are_refused(sources, tmp_path):
    path, state = sources["torch"]
    with open_weights(path) as reader:
        with pytest.raises(ValueError, match="'nope' is not in the weights"):
            reader.read_into("nope", torch.empty(1))
        with pytest.raises(ValueError, match=r"has the shape \(2, 10\), the target \(3, 10\)"):
            reader.read_into("tok_emb.weight", torch.empty(3, 10), (0, 0, 2))
        with pytest.raises(ValueError, match="does not lie inside"):
            reader.read_into("tok_emb.weight", torch.empty(3, 10), (0, 29, 3))
        with pytest.raises(ValueError, match="step 2"):
            reader.read_into("tok_emb.weight", torch.empty(15, 10), (slice(0, 30, 2),))
        with pytest.raises(ValueError, match="on the meta device"):
            reader.read_into("tok_emb.weight", torch.empty(30, 10, device="meta"))
        with pytest.raises(ValueError, match="not converted to integer"):
            reader.read_into("tok_emb.weight", torch.empty(30, 10, dtype=torch.int64))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(path, "rb").read()[:-100])
    with pytest.raises(ValueError, match=f"{truncated}.*truncated"):
        open_weights(truncated)
    cut = tmp_path / "truncated.safetensors"
    cut.write_bytes(open(sources["safetensors"][0], "rb").read()[:-100])
    with pytest.raises(ValueError, match=f"cannot read {cut} as a safetensors file"):
        open_weights(cut)
    with pytest.raises(ValueError, match="does not exist"):
        open_weights(tmp_path / "absent.safetensors")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="without a torch.distributed.checkpoint"):
        open_weights(tmp_path / "empty_dir")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-1.safetensors"}}')
    with pytest.raises(ValueError, match="names the file .*model-1.safetensors, which does not exist"):
        open_weights(tmp_path / "hf")
    torch.save({"model": state}, tmp_path / "nested.pt")
    with pytest.raises(ValueError, match=r"neither a state dict .* \(found: \['model'\]\)"):
        open_weights(tmp_path / "nested.pt")


@pytest.mark.timeout(TIMEOUT_S)
def test_dcp_chunks_in_another_serialization_format_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = FileSystemWriter(str(tmp_path), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"state_dict": {"w": torch.ones(4, 4)}}, storage_writer=writer, no_dist=True)
    with open_weights(tmp_path) as reader:
        with pytest.raises(ValueError, match=r"'w'.* is not a torch.save archive"):
            reader.read_into("w", torch.empty(4, 4))
    with pytest.raises(ValueError, match=r"no tensors under 'model' \(its top-level entries: \['state_dict'\]\)"):
        open_weights(tmp_path, dcp_root="model")


# -- boxes: a rank's share, and exactly its bytes ----------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_boxes_equal_the_full_tensors_chunks(sources, kind, world, dim):
    path, state = sources[kind]
    with open_weights(path) as reader:
        for name, full in state.items():
            if full.dim() <= dim:
                continue
            for rank in range(world):
                region = shard_region(full.shape, [Shard(dim)], (world,), (rank,))
                expected = _chunk(full, world, rank, dim)
                assert region_shape(region) == tuple(expected.shape), (name, rank)
                target = reader.read_into(name, torch.full(expected.shape, float("nan")), region)
                torch.testing.assert_close(target, expected, rtol=0, atol=0)
        assert reader.bytes_read == sum(v.nbytes for v in state.values() if v.dim() > dim)


def test_a_two_dimensional_mesh_box():
    # rows over the first mesh axis, columns over the second: rank (1, 0) of a 2 x 2 mesh
    assert shard_region((30, 10), [Shard(0), Shard(1)], (2, 2), (1, 0)) == ((15, 15), (0, 5))
    assert shard_region((30, 10), [Replicate(), Shard(0)], (2, 4), (1, 3)) == ((24, 6), (0, 10))
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        shard_region((30, 10), [Shard(0)], (2, 2), (1, 0))
    with pytest.raises(ValueError, match="strided shard"):
        shard_region((30, 10), [compat.strided_shard_type()(0, split_factor=2)], (2,), (0,))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_half_a_tensor_costs_half_its_bytes(sources, kind):
    path, state = sources[kind]
    full = state["blocks.0.mlp.fc.weight"]  # (40, 10) float32: 1600 bytes
    with open_weights(path) as reader:
        reader.read_into("blocks.0.mlp.fc.bias", torch.empty(40))  # warm up: first-use imports, chunk headers
        for index, shape in (((0, 0, 20), (20, 10)), ((1, 5, 5), (40, 5)), ((0, 20, 20), (20, 10))):
            before, overhead = reader.bytes_read, reader.overhead_bytes
            out, rchar = _measured(lambda: reader.read_into("blocks.0.mlp.fc.weight", torch.empty(shape), index))
            read = reader.bytes_read - before
            torch.testing.assert_close(out, full[region_slices(torch_region(index, full.shape))], rtol=0, atol=0)
            assert read == full.nbytes // 2 == 800
            if kind != "safetensors":  # our own preads: the kernel counts exactly them (+ a chunk's header)
                assert abs(rchar - read - (reader.overhead_bytes - overhead)) <= PROC_SLACK


def torch_region(index, shape):
    return regions_module.as_region(index, shape)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("root", sorted(ODD))
def test_dcp_boxes_across_chunk_boundaries_read_only_the_overlap(dcp_dirs, root):
    full = odd_state()[root]
    boxes = ODD_BOXES[root]
    with open_weights(dcp_dirs / "odd", dcp_root="odd") as reader:
        reader.read_into(root, torch.empty(full.shape))  # warm up
        for index in boxes:
            region = regions_module.as_region(index, full.shape)
            before, overhead = reader.bytes_read, reader.overhead_bytes
            out, rchar = _measured(lambda: reader.read_into(root, torch.empty(region_shape(region)), index))
            read = reader.bytes_read - before
            torch.testing.assert_close(out, full[region_slices(region)], rtol=0, atol=0)
            assert read == out.nbytes
            assert abs(rchar - read - (reader.overhead_bytes - overhead)) <= PROC_SLACK


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_a_small_buffer_reads_in_pieces_no_larger_than_it(sources, kind, monkeypatch):
    path, state = sources[kind]
    with open_weights(path, buffer_bytes=64) as reader:
        pieces = []
        read_piece = type(reader.source)._read_piece

        def recording(self, name, piece):
            pieces.append(piece)
            return read_piece(self, name, piece)

        monkeypatch.setattr(type(reader.source), "_read_piece", recording)
        full = state["tok_emb.weight"]  # 30 x 10 float32: rows of 40 bytes, one row a piece
        # a float64 target: converted through the buffer (safetensors reads a float32 one in place, no buffer)
        out = reader.read_into("tok_emb.weight", torch.empty(15, 5, dtype=torch.float64), ((10, 15), (5, 5)))
        torch.testing.assert_close(out, full[10:25, 5:10].double(), rtol=0, atol=0)
        assert len(pieces) == 5 and all(len(p) == 2 and p[0][1] == 3 for p in pieces)  # 3 rows x 5 x 4 B = 60 B


@pytest.mark.timeout(TIMEOUT_S)
def test_safetensors_reads_into_a_contiguous_target_without_a_buffer(sources, monkeypatch):
    """[Note: reading safetensors by byte range]: a box lands in the target itself (no piece buffer, no mapping of
    the file): the allocator holds nothing beside the target while it is read, and exactly its bytes are read."""
    from lightning_par.peak_memory import TensorPeak

    path, state = sources["safetensors"]
    full = state["tok_emb.weight"]
    with open_weights(path, buffer_bytes=64) as reader:
        monkeypatch.setattr(type(reader.source), "_read_piece", lambda *a: pytest.fail("read through a buffer"))
        for box in [((10, 15), (5, 5)), ((0, 30), (0, 10)), ((29, 1), (9, 1))]:
            out = torch.nn.Parameter(torch.empty(box[0][1], box[1][1]))  # a parameter, as a materialized share
            before, meter = reader.bytes_read, TensorPeak()
            meter.start()
            reader.read_into("tok_emb.weight", out, box)
            meter.stop()
            torch.testing.assert_close(out.detach(), full[box[0][0]:sum(box[0]), box[1][0]:sum(box[1])], rtol=0, atol=0)
            assert meter.peak == 0 and reader.bytes_read - before == out.numel() * 4, (box, meter.peak)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_reads_convert_to_the_targets_dtype(sources, kind, dtype):
    path, state = sources[kind]
    full = state["tok_emb.weight"]
    with open_weights(path) as reader:
        out = reader.read_into("tok_emb.weight", torch.empty(15, 10, dtype=dtype), (0, 15, 15))
    torch.testing.assert_close(out, full[15:].to(dtype), rtol=0, atol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_files_read_into_float32(tmp_path):
    full = torch.randn(6, 4).to(torch.bfloat16)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    torch.save({"w": full}, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        with open_weights(tmp_path / name) as reader:
            assert reader.tensors["w"] == ((6, 4), torch.bfloat16)
            out = reader.read_into("w", torch.empty(6, 2), (1, 2, 2))
            assert reader.bytes_read == 6 * 2 * 2
        torch.testing.assert_close(out, full[:, 2:].float(), rtol=0, atol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_non_contiguous_and_shared_tensors_in_torch_files(tmp_path):
    base = torch.arange(24.).reshape(4, 6)
    torch.save({"t": base.t(), "a": base, "b": base[1:3]}, tmp_path / "odd.pt")
    with open_weights(tmp_path / "odd.pt") as reader:
        torch.testing.assert_close(reader.read_into("t", torch.empty(2, 4), (0, 1, 2)), base.t()[1:3])
        torch.testing.assert_close(reader.read_into("b", torch.empty(2, 3), (1, 3, 3)), base[1:3, 3:])
        torch.testing.assert_close(reader.read_into("a", torch.empty(4, 6)), base)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", ["torch", "ckpt", "dcp"])
def test_without_storage_offsets_from_torch_the_reads_fall_back(sources, kind, monkeypatch):
    monkeypatch.setattr(compat, "checkpoint_offset", lambda storage: None)
    path, state = sources[kind]
    full = state["lm_head.weight"]
    with open_weights(path) as reader:
        out = reader.read_into("lm_head.weight", torch.empty(15, 5), ((0, 15), (5, 5)))
        torch.testing.assert_close(out, full[:15, 5:], rtol=0, atol=0)
        # mmap touches only the box's bytes; a DCP chunk is read whole (lm_head was saved Shard(1): columns 5-9)
        assert reader.bytes_read == (full.nbytes // 2 if kind == "dcp" else full.nbytes // 4)
        if kind != "dcp":
            assert reader.source._mmapped is not None  # the box came from torch's mapping


def test_split_region_covers_the_region_once():
    region = ((3, 5), (1, 7), (0, 4))
    for limit in (1, 4, 15, 16, 17, 112, 10_000):
        pieces = list(split_region(region, 4, limit))
        covered = torch.zeros(8, 8, 4, dtype=torch.int64)
        for p in pieces:
            assert torch.Size(region_shape(p)).numel() * 4 <= max(limit, 4)
            covered[region_slices(p)] += 1
        expected = torch.zeros_like(covered)
        expected[region_slices(region)] = 1
        assert torch.equal(covered, expected)


@pytest.mark.parametrize("module", [regions_module, reader_module])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
