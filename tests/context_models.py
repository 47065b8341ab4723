"""Tiny Hugging Face models of the families context parallelism is tested on beyond tests/models.py's (built from
their configs, random weights, nothing downloaded): Gemma-3 (sliding-window layers), StarCoder2, Falcon with
multi-query attention, Gemma-2 (soft-capped eager attention), GPT-NeoX, Bloom (ALiBi)."""
from __future__ import annotations

from torch import nn

from models import CausalLM

_SIZES = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=32)
FAMILIES = {  # family: (config class, model class, tiny config)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_SIZES, num_key_value_heads=2, head_dim=8, sliding_window=8, attention_dropout=0.0,
                    layer_types=["sliding_attention", "full_attention"])),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(_SIZES, num_key_value_heads=2, sliding_window=None, residual_dropout=0.0,
                        embedding_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)),
    "falcon_mqa": ("FalconConfig", "FalconForCausalLM",
                   dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                        new_decoder_architecture=False, alibi=False, parallel_attn=True, hidden_dropout=0.0,
                        attention_dropout=0.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_SIZES, num_key_value_heads=2, head_dim=8, sliding_window=8, attention_dropout=0.0,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(_SIZES, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=32, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
}


def family_model(family: str, **overrides) -> nn.Module:
    import transformers

    config_cls, model_cls, sizes = FAMILIES[family]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**sizes, **overrides}))


def family_lm(family: str, **config):
    """A factory for ``seeded``: :class:`CausalLM` around ``family_model(family, **config)``."""
    return lambda: CausalLM(family_model(family, **config), call={"use_cache": False})
