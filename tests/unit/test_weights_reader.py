"""The streaming weights reader (lightning_par.weights): every kind of weights source round-trips a state
dict, names map with prefixes and ties, and bad files are refused with the names and the path before any
read. A rank's box of a tensor and its bytes: test_weights_boxes.py. The sources: tests/weights_sources.py."""
import os

import pytest
import torch
from torch import nn

from harness import TIMEOUT_S
from lightning_par.weights import expected_state, open_weights
from weights_sources import KINDS, gpt_state, meta_gpt


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
