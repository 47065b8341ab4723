"""The streaming weights reader's boxes (lightning_par.weights): a rank's box of a tensor reads exactly the
box's bytes (checked against /proc/self/io where the reads are this package's own), in pieces no larger than its
buffer, converted to the target's dtype. The sources: tests/weights_sources.py (fixtures in conftest.py)."""
import doctest

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard

import lightning_par._compat as compat
import lightning_par.weights.reader as reader_module
import lightning_par.weights.regions as regions_module
from harness import TIMEOUT_S
from lightning_par.weights import open_weights, region_slices, shard_region, split_region
from lightning_par.weights.regions import region_shape
from weights_sources import KINDS, ODD, ODD_BOXES, odd_state


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
