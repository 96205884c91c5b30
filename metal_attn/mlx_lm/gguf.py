"""Load a llama-architecture GGUF file into the stock `mlx_lm.models.llama.Model` and a tokenizer.

`mx.load` reads the GGUF: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine-quantized
(weight, scales, biases) triples with group size 32, other types as float16,
and the metadata as a dict. This module renames the tensors to mlx-lm's names,
quantizes the matching modules of the stock model with the bits each tensor
was stored at, and builds the tokenizer from the metadata alone (no
tokenizer.json). Activations stay float32: on the CPU, float16/bfloat16 are far
slower.

RoPE: llama.cpp's converter permutes the rows of the q/k projections into the
interleaved (GPT-J) layout, so the rows are kept as stored and the model uses
``rope_traditional=True``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from metal_attn.errors import ModelError

#: The quantization group size of every quantized tensor `mx.load` returns from a GGUF.
GGUF_GROUP_SIZE = 32

#: GGUF `general.architecture` values this loader serves.
SUPPORTED_ARCHITECTURES = ("llama",)

#: `tokenizer.ggml.pre` values this loader can rebuild (BPE pre-tokenizer recipes).
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt2")

#: GGUF token type of control (special) tokens.
TOKEN_TYPE_CONTROL = 3

#: Texts of control tokens that end a generation (as llama.cpp recognises them).
END_OF_GENERATION_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"}
)

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PARAM_SUFFIXES = ("weight", "scales", "biases", "bias")


# -- reading -----------------------------------------------------------------------------------


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The tensors and metadata of a GGUF file; `ModelError` if it is missing or unreadable."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ModelError(
            f"model={str(path)!r} {what}; expected a GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)"
        )
    try:
        weights, metadata = mx.load(str(p), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise ModelError(f"model={str(path)!r} is not a readable GGUF file ({err}); expected a GGUF file") from err
    return dict(weights), dict(metadata)


def meta_value(value: Any) -> Any:
    """A metadata value as plain Python: 0-d arrays -> scalars, arrays and lists -> lists."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [meta_value(v) for v in value]
    return value


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    """A required metadata value, or `ModelError` naming the missing key."""
    if key not in metadata:
        raise ModelError(f"GGUF metadata key {key!r} is missing; a llama GGUF needs it")
    return meta_value(metadata[key])


def architecture(metadata: Mapping[str, Any]) -> str:
    """`general.architecture`, checked against `SUPPORTED_ARCHITECTURES`."""
    arch = str(_require(metadata, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"GGUF general.architecture={arch!r} is not supported; allowed: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


# -- model -------------------------------------------------------------------------------------


def model_args(metadata: Mapping[str, Any], weights: Mapping[str, mx.array]) -> ModelArgs:
    """mlx-lm `ModelArgs` from the GGUF metadata (llama defaults only for optional keys)."""
    arch = architecture(metadata)

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        return meta_value(metadata[full]) if full in metadata else default

    hidden = int(_require(metadata, f"{arch}.embedding_length"))
    heads = int(_require(metadata, f"{arch}.attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelError(
            f"GGUF {arch}.rope.dimension_count={rope_dims} differs from the head size {head_dim}; "
            "allowed: RoPE over the whole head (partial rotary embeddings are not supported)"
        )
    if "rope_freqs.weight" in weights:
        raise ModelError("GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported; allowed: none")
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ModelError(
                f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported; allowed: none, linear"
            )
        rope_scaling = {"type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ModelError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens; one is needed")
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_require(metadata, f"{arch}.block_count")),
        intermediate_size=int(_require(metadata, f"{arch}.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_require(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_traditional=True,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length")) if get("context_length") is not None else None,
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_gate.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
    )


def mlx_name(gguf_name: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor.

    ``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``.
    """
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in _PARAM_SUFFIXES:
        raise ModelError(f"GGUF tensor {gguf_name!r} has an unknown suffix {suffix!r}; allowed: {_PARAM_SUFFIXES}")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ModelError(
        f"GGUF tensor {gguf_name!r} has no llama counterpart; allowed: {', '.join(_TOP_LEVEL_NAMES)} and "
        f"blk.N.{{{', '.join(_BLOCK_NAMES)}}}"
    )


def mlx_weights(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """The GGUF tensors under mlx-lm names; unquantized float tensors (norms) cast to float32."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        quantized = name.rpartition(".")[0] + ".scales" in weights
        if not quantized and mx.issubdtype(w.dtype, mx.floating) and w.dtype != mx.float32:
            w = w.astype(mx.float32)
        out[mlx_name(name)] = w
    return out


def quantized_bits(weights: Mapping[str, mx.array], module_path: str) -> int | None:
    """Bits of the quantized weight of ``module_path`` (from its packed width), ``None`` if not quantized."""
    scales = weights.get(f"{module_path}.scales")
    if scales is None:
        return None
    packed = weights[f"{module_path}.weight"]
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits, rem = divmod(packed.shape[-1] * 32, in_features)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise ModelError(
            f"tensor {module_path}.weight of shape {packed.shape} with scales {scales.shape} does not match any "
            f"affine quantization with group size {GGUF_GROUP_SIZE}; allowed bits: 2, 3, 4, 5, 6, 8"
        )
    return bits


def build_model(args: ModelArgs, weights: Mapping[str, mx.array]) -> Model:
    """The stock llama `Model` for ``args`` with ``weights`` (mlx-lm names) loaded strictly.

    Each Linear/Embedding whose weight is quantized becomes a QuantizedLinear /
    QuantizedEmbedding at the bits it was stored at.
    """
    model = Model(args)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        bits = quantized_bits(weights, path)
        if bits is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": GGUF_GROUP_SIZE, "bits": bits}

    nn.quantize(model, class_predicate=predicate)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise ModelError(f"GGUF tensors do not fit the llama model built from its metadata: {err}") from err
    mx.eval(model.parameters())
    model.eval()
    return model


# -- tokenizer ---------------------------------------------------------------------------------


def _pre_tokenizer(pre: str) -> Any:
    """The `tokenizers` pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` name."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt2":
        return byte_level
    raise ModelError(
        f"GGUF tokenizer.ggml.pre={pre!r} is not supported; allowed: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def eos_token_ids(metadata: Mapping[str, Any]) -> set[int]:
    """Ids that end a generation: the eos/eot/eom ids of the metadata and end-marker control tokens."""
    ids = {
        int(meta_value(metadata[k]))
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in metadata
    }
    tokens: Sequence[str] = meta_value(metadata.get("tokenizer.ggml.tokens", []))
    types = meta_value(metadata.get("tokenizer.ggml.token_type", []))
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_TYPE_CONTROL and text in END_OF_GENERATION_TEXTS:
            ids.add(i)
    return ids


def build_tokenizer(metadata: Mapping[str, Any]) -> TokenizerWrapper:
    """The tokenizer of a GGUF with a GPT-2-style BPE vocabulary, from its metadata alone."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    kind = meta_value(metadata.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise ModelError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; allowed: 'gpt2' (byte-level BPE)")
    tokens: list[str] = list(_require(metadata, "tokenizer.ggml.tokens"))
    merges: list[tuple[str, str]] = []
    for m in _require(metadata, "tokenizer.ggml.merges"):
        pair = str(m).split(" ")
        if len(pair) != 2:
            raise ModelError(f"GGUF tokenizer.ggml.merges entry {m!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = _pre_tokenizer(str(meta_value(metadata.get("tokenizer.ggml.pre", "gpt2"))))
    tok.decoder = decoders.ByteLevel()
    types = meta_value(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    control = [tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def token(key: str) -> str | None:
        value = meta_value(metadata.get(f"tokenizer.ggml.{key}_token_id"))
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    if bool(meta_value(metadata.get("tokenizer.ggml.add_bos_token", False))) and token("bos") is not None:
        from tokenizers import processors

        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta_value(metadata.get("tokenizer.chat_template")),
        additional_special_tokens=control,
    )
    stop = sorted(eos_token_ids(metadata))
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=stop)


# -- all of it ---------------------------------------------------------------------------------


def load_gguf(path: str | os.PathLike[str]) -> tuple[Model, TokenizerWrapper]:
    """The stock mlx-lm llama `Model` (quantized as stored, float32 activations) and its tokenizer."""
    weights, metadata = read_gguf(path)
    args = model_args(metadata, weights)
    model = build_model(args, mlx_weights(weights))
    return model, build_tokenizer(metadata)
