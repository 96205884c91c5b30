"""Random-weight mlx-lm models built in code, for tests and GPU benchmarks (no download).

`tiny_model` builds a small instance of each served architecture, its weights scaled
so that greedy decoding is decisive (random weights give flat logits otherwise).
`llama_8b_shaped` builds the GPU throughput model: 32 layers, hidden 4096, 32/8
heads, FFN 14336, vocab 128256.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

__all__ = ["TINY_CONFIGS", "WORD_TOKENIZER_VOCAB", "WordTokenizer", "llama_8b_shaped", "tiny_model"]

_HEAD = 64

#: ``mlx_lm.models`` module -> ModelArgs fields of a small instance (head size 64, GQA 2).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                  tie_word_embeddings=False, max_position_embeddings=2048),
    "qwen2": dict(model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
                  tie_word_embeddings=True, max_position_embeddings=2048),
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD, rms_norm_eps=1e-6,
                  vocab_size=256, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=2048),
    "phi3": dict(model_type="phi3", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                 max_position_embeddings=2048),
    "gemma2": dict(model_type="gemma2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD, rms_norm_eps=1e-6,
                   vocab_size=256, attn_logit_softcapping=8.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=_HEAD),
    # Layers 0, 2 slide over 24 tokens; layer 1 and 3 are global: prompts run past the window.
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD, rms_norm_eps=1e-6,
                        vocab_size=256, sliding_window=24, sliding_window_pattern=2, query_pre_attn_scalar=_HEAD,
                        max_position_embeddings=2048),
    # Sinks on every layer, sliding (window 24) and full layers alternating, 4 experts of which 2 per token.
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD, rms_norm_eps=1e-5,
                    vocab_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                    rope_theta=10000, max_position_embeddings=2048),
}

#: Vocabulary of `WordTokenizer` (token ids 0..255; 0 is the end token).
WORD_TOKENIZER_VOCAB = 256


def _gemma2_varied(model: nn.Module) -> None:
    """gemma2 scales its embeddings by sqrt(hidden) and ties its head, and its zero-initialised post-norms
    (weight 1 + w) pass the residual through: the random model echoed its last prompt token forever, so
    a test of its tokens could not fail. Smaller embeddings and random post-norms give varied tokens."""
    inner = model.model
    inner.embed_tokens.weight = inner.embed_tokens.weight / 16
    for layer in model.layers:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight = mx.random.normal(norm.weight.shape) * 3.0


#: Models whose random weights greedily repeat one token, and what makes their tokens vary
#: (`tests/test_mlx_lm_adapter.py` checks that every tiny model's tokens vary).
_ECHOES = {"gemma2": _gemma2_varied}


def tiny_model(name: str, *, dtype: Any = mx.float32, seed: int = 0, weight_scale: float = 3.0) -> nn.Module:
    """A small random-weight instance of ``mlx_lm.models.<name>`` (see `TINY_CONFIGS`).

    Every matrix is multiplied by ``weight_scale`` after initialisation, so logits are
    peaked and greedy choices are rarely near-ties; sinks get random values so that
    they matter.
    """
    module = importlib.import_module(f"mlx_lm.models.{name}")
    args = module.ModelArgs.from_dict(TINY_CONFIGS[name])
    mx.random.seed(seed)
    model = module.Model(args)
    params = tree_map(lambda w: w * weight_scale if w.ndim >= 2 else w, model.parameters())
    model.update(params)
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and "sinks" in attn:
            attn.sinks = mx.random.normal(attn.sinks.shape) * 2.0
    if name in _ECHOES:
        _ECHOES[name](model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def llama_8b_shaped(*, dtype: Any = mx.bfloat16, num_layers: int = 32, seed: int = 0) -> nn.Module:
    """An 8B-shaped llama with random weights (about 16 GB in bf16), for GPU throughput runs."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=4096, num_hidden_layers=num_layers, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256,
        rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    # The float32 initial values are lazy: evaluating after the cast materialises only the bf16 weights.
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


class WordTokenizer:
    """A tokenizer for random-weight models: one id per byte value modulo 255, id 0 ends.

    It has the parts of mlx-lm's `TokenizerWrapper` the engine uses (``encode``,
    ``decode``, ``eos_token_ids``, ``detokenizer``).
    """

    eos_token_ids = frozenset({0})
    bos_token = None
    has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + b % 255 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    @property
    def detokenizer(self) -> Any:
        return _IdDetokenizer(self)


class _IdDetokenizer:
    def __init__(self, tok: WordTokenizer) -> None:
        self.tok, self.tokens, self.text = tok, [], ""

    def add_token(self, t: int) -> None:
        self.tokens.append(t)
        self.text = self.tok.decode(self.tokens)

    def finalize(self) -> None:
        pass
