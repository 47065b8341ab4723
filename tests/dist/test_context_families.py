"""Families whose attention context parallelism serves beyond Llama / Qwen2 / BERT train under cp 2 (ring) as on
one process, through HybridParallelStrategy: Gemma-3 (sliding-window and full layers), StarCoder2 and Falcon with
multi-query attention (one k/v head broadcast to the query heads by SDPA). 8 AdamW steps, every rank's losses within
2e-4, the first two steps' gradients within 1e-5, the parameters after all the steps within 1e-5 plus Adam's
response to the gradients' rounding (tests/dist/test_context_strategy.py's assert_matches)."""
import pytest
from torch.utils.data import DataLoader

from context_models import family_lm
from harness import TIMEOUT_S, fit_and_record, one_process_fit, seeded
from models import corpus
from harness import hybrid
from test_context_strategy import assert_steps_match

DATA = corpus(val_sequences=8)
STEPS = 8


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["gemma3", "starcoder2", "falcon_mqa"])
def test_cp2_ring_trains_these_families_as_one_process(tmp_path, family):
    factory = family_lm(family, attn_implementation="sdpa")
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=STEPS)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "l"),
                         strategy=hybrid(context_parallel_size=2), devices=2, max_steps=STEPS)
    assert_steps_match(ref, got, STEPS)


@pytest.mark.timeout(TIMEOUT_S)
def test_cp2_tp2_gemma3_query_replicated_beside_values_sharded_by_head(tmp_path):
    """Gemma-3's per-head norm leaves the query replicated where the values are sharded by head: each tensor-parallel
    rank slices the query to its heads ([Note: DTensor attention]). 2 AdamW steps."""
    factory = family_lm("gemma3", attn_implementation="sdpa")
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "l"),
                         strategy=hybrid(context_parallel_size=2, tensor_parallel_size=2), devices=4, max_steps=2)
    assert_steps_match(ref, got, 2)
