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

import errno
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from metal_attn.checks import is_decimal, is_finite_real, is_int
from metal_attn.errors import ModelError
from metal_attn.mlx_lm.gguf_header import SUPPORTED_TENSOR_TYPES, GGUFHeader, check_gguf

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


def _describe_path(p: Path, path: str | os.PathLike[str]) -> None:
    """`ModelError` unless ``p`` is a regular file at a UTF-8 path (MLX's reader cannot open another:
    ``std::bad_cast``); a symbolic link loop is named as such."""
    try:
        st = p.stat()
    except OSError as exc:
        what = ("is a symbolic link loop" if exc.errno == errno.ELOOP else "does not exist"
                if exc.errno in (errno.ENOENT, errno.ENOTDIR) else f"could not be read ({exc.strerror or exc})")
        raise ModelError(f"model={str(path)!r} {what}; expected a GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)"
                         ) from None
    if not stat.S_ISREG(st.st_mode):
        what = "is a directory" if stat.S_ISDIR(st.st_mode) else "is not a regular file"
        raise ModelError(
            f"model={str(path)!r} {what}; expected a GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)"
        )
    try:
        str(p).encode("utf-8")
    except UnicodeEncodeError:
        raise ModelError(f"model={str(path)!r} is a path that is not UTF-8, which MLX's GGUF reader cannot open "
                         "(allowed: a UTF-8 path; rename the file or link to it from one)") from None


def _check_writable(p: Path, path: str | os.PathLike[str]) -> None:
    """MLX 0.32.4's GGUF reader opens the file read-write (and maps it writable; it writes nothing): a file
    this user may only read fails inside MLX as "gguf_init failed". Say what is missing instead."""
    try:
        os.close(os.open(p, os.O_RDWR))
    except OSError as exc:
        raise ModelError(f"model={str(path)!r} can be read but not opened for writing ({exc.strerror or exc}); MLX's "
                         "GGUF reader opens the file read-write, though it does not change it (allowed: a .gguf file "
                         "this user may write, e.g. a copy of this one)") from None


#: The dtype MLX returns for each part of a tensor of each GGUF type.
_DTYPES = {"F32": mx.float32, "F16": mx.float16}
_QUANTIZED_DTYPES = {".weight": mx.uint32, ".scales": mx.float16, ".biases": mx.float16}


def _expected_arrays(path: str | os.PathLike[str], header: GGUFHeader) -> dict[str, mx.Dtype]:
    """The arrays MLX returns for the header's tensors and their dtypes: a quantized tensor ``x.weight``
    as ``x.weight``/``x.scales``/``x.biases`` (uint32, float16, float16), F32 and F16 as they are. A plain
    tensor named like a quantized part would pass for one (a float16 "packed" weight): refused."""
    expected: dict[str, mx.Dtype] = {}
    for t in header.tensors:
        stem, _, suffix = t.name.rpartition(".")
        if suffix in ("scales", "biases") or (t.quantized and suffix != "weight"):
            raise ModelError(f"model={str(path)!r}: tensor {t.name!r} of type {SUPPORTED_TENSOR_TYPES[t.type][0]} "
                             "(allowed: names ending in .weight or .bias; .scales and .biases are the names MLX "
                             "gives the parts of a quantized .weight)")
        if t.quantized:
            expected |= {stem + part: dtype for part, dtype in _QUANTIZED_DTYPES.items()}
        else:
            expected[t.name] = _DTYPES[SUPPORTED_TENSOR_TYPES[t.type][0]]
    return expected


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The tensors and metadata of a GGUF file; `ModelError` if it is missing, unreadable or damaged
    (its header is checked in Python first, `check_gguf`: MLX's reader trusts it)."""
    p = Path(path).expanduser()
    _describe_path(p, path)
    header = check_gguf(p)
    expected = _expected_arrays(path, header)
    _check_writable(p, path)
    try:
        weights, metadata = mx.load(str(p), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise ModelError(f"model={str(path)!r} is not a readable GGUF file ({err}); expected a GGUF file") from err
    if set(weights) != set(expected):
        missing = sorted(set(expected) - set(weights))
        raise ModelError(f"model={str(path)!r}: MLX read {len(weights)} arrays where the header lists "
                         f"{len(header.tensors)} tensors ({len(expected)} arrays); missing: "
                         f"{', '.join(missing[:4]) or 'none'}{'...' if len(missing) > 4 else ''}")
    for name, dtype in expected.items():
        if weights[name].dtype != dtype:
            raise ModelError(f"model={str(path)!r}: MLX read {name} as {weights[name].dtype} where its header type "
                             f"gives {dtype}")
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


#: The largest size MLX and mlx-lm take (a C int): past it, building the model raised a bare OverflowError.
MAX_SIZE = 2**31 - 1


def _whole(key: str, value: Any, minimum: int = 1, maximum: int | None = MAX_SIZE) -> int:
    """A metadata count: an integer from ``minimum`` to ``maximum`` (not a bool, a string or a float)."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        most = "" if maximum is None else " and <= 2**31 - 1" if maximum == MAX_SIZE else f" and <= {maximum}"
        raise ModelError(f"GGUF {key}={value!r} (allowed: an integer >= {minimum}{most})")
    return value


def _positive(key: str, value: Any) -> float:
    """A metadata real: finite and > 0 (an epsilon, a RoPE base, a scaling factor)."""
    if not is_finite_real(value) or value <= 0:
        raise ModelError(f"GGUF {key}={value!r} (allowed: a finite number > 0)")
    return float(value)


def _in_out(weights: Mapping[str, mx.array], stem: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of the matrix ``stem`` (packed when quantized); `ModelError` if absent."""
    w = weights.get(f"{stem}.weight")
    if w is None:
        raise ModelError(f"GGUF tensor {stem}.weight is missing; a llama GGUF needs it")
    if w.ndim != 2:
        raise ModelError(f"GGUF tensor {stem}.weight has shape {tuple(w.shape)} (allowed: a matrix)")
    scales = weights.get(f"{stem}.scales")
    return int(w.shape[0]), int(scales.shape[-1] * GGUF_GROUP_SIZE if scales is not None else w.shape[1])


def _check_against_tensors(arch: str, args: ModelArgs, weights: Mapping[str, mx.array]) -> None:
    """The metadata's sizes against the tensors' own, before a model of that size is built (a feed-forward
    length of 2**31 would allocate its matrices)."""
    kv_dim = args.num_key_value_heads * args.head_dim
    checks = (("token_embd", (args.vocab_size, args.hidden_size), "vocab_size, embedding_length"),
              ("blk.0.attn_q", (args.num_attention_heads * args.head_dim, args.hidden_size),
               "attention.head_count x key_length, embedding_length"),
              ("blk.0.attn_k", (kv_dim, args.hidden_size), "attention.head_count_kv x key_length, embedding_length"),
              ("blk.0.ffn_gate", (args.intermediate_size, args.hidden_size), "feed_forward_length, embedding_length"))
    for stem, want, keys in checks:
        got = _in_out(weights, stem)
        if got != want:
            raise ModelError(f"GGUF tensor {stem}.weight is {got[0]} x {got[1]} but the metadata ({arch}.{keys}) "
                             f"says {want[0]} x {want[1]}")


def model_args(metadata: Mapping[str, Any], weights: Mapping[str, mx.array]) -> ModelArgs:
    """mlx-lm `ModelArgs` from the GGUF metadata (llama defaults only for optional keys), each value
    checked for its type and range and the sizes against the tensors' own."""
    arch = architecture(metadata)

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        return meta_value(metadata[full]) if full in metadata else default

    hidden = _whole(f"{arch}.embedding_length", _require(metadata, f"{arch}.embedding_length"))
    heads = _whole(f"{arch}.attention.head_count", _require(metadata, f"{arch}.attention.head_count"))
    kv_heads = _whole(f"{arch}.attention.head_count_kv", get("attention.head_count_kv", heads))
    if heads % kv_heads:
        raise ModelError(f"GGUF {arch}.attention.head_count={heads} is not a multiple of head_count_kv={kv_heads}")
    if get("attention.key_length") is None and hidden % heads:
        raise ModelError(f"GGUF {arch}.embedding_length={hidden} is not a multiple of attention.head_count={heads} "
                         "and no attention.key_length gives the head size")
    head_dim = _whole(f"{arch}.attention.key_length", get("attention.key_length", hidden // heads))
    rope_dims = _whole(f"{arch}.rope.dimension_count", get("rope.dimension_count", head_dim))
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
        rope_scaling = {"type": "linear",
                        "factor": _positive(f"{arch}.rope.scaling.factor", get("rope.scaling.factor", 1.0))}
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if isinstance(tokens, (list, tuple)) else None)
    if vocab is None:
        raise ModelError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens; one is needed")
    context = get("context_length")
    blocks = _whole(f"{arch}.block_count", _require(metadata, f"{arch}.block_count"))
    layers = {int(n.split(".")[1]) for n in weights if n.startswith("blk.") and is_decimal(n.split(".")[1])}
    if len(layers) != blocks or max(layers) != blocks - 1:  # 0..blocks-1; checked before ModelArgs (a list per layer)
        raise ModelError(f"GGUF {arch}.block_count={blocks} but the file has tensors of {len(layers)} blocks "
                         f"(blk.0 to blk.{max(layers, default=-1)})")
    args = ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=blocks,
        intermediate_size=_whole(f"{arch}.feed_forward_length", _require(metadata, f"{arch}.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive(f"{arch}.attention.layer_norm_rms_epsilon",
                               _require(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=_whole(f"{arch}.vocab_size", vocab),
        rope_theta=_positive(f"{arch}.rope.freq_base", get("rope.freq_base", 10000.0)),
        rope_traditional=True,
        rope_scaling=rope_scaling,
        max_position_embeddings=(_whole(f"{arch}.context_length", context, maximum=None)  # a bound: any is harmless
                                 if context is not None else None),
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_gate.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
    )
    _check_against_tensors(arch, args, weights)
    if isinstance(tokens, (list, tuple)) and len(tokens) > args.vocab_size:  # fewer is a padded vocabulary
        raise ModelError(f"GGUF tokenizer.ggml.tokens has {len(tokens)} tokens but the model's vocabulary "
                         f"({arch}.vocab_size, the rows of token_embd.weight) is {args.vocab_size} (allowed: at most "
                         f"{args.vocab_size} tokens; a larger id would index past the embedding)")
    return args


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
    if len(parts) == 3 and parts[0] == "blk" and is_decimal(parts[1]) and parts[2] in _BLOCK_NAMES:
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


def _token_id(metadata: Mapping[str, Any], key: str, vocab: int) -> int | None:
    """A ``tokenizer.ggml.*_token_id``: None when absent, else an id of the vocabulary."""
    if key not in metadata:
        return None
    value = meta_value(metadata[key])
    if not is_int(value) or not 0 <= value < vocab:
        raise ModelError(f"GGUF {key}={value!r} (allowed: a token id in 0..{vocab - 1})")
    return value


def _string_list(metadata: Mapping[str, Any], key: str) -> list[str]:
    value = _require(metadata, key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelError(f"GGUF {key} is {_describe(value)} (allowed: an array of strings)")
    return value


def _token_types(metadata: Mapping[str, Any], n: int) -> list[int]:
    types = meta_value(metadata.get("tokenizer.ggml.token_type", [1] * n))
    if not isinstance(types, list) or len(types) != n or not all(is_int(t) for t in types):
        raise ModelError(f"GGUF tokenizer.ggml.token_type is {_describe(types)} (allowed: one integer per token, "
                         f"{n} of them)")
    return types


def _describe(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value[:64]})
        return f"an array of {len(value)} {'/'.join(kinds) or 'values'}"
    return f"{value!r:.60}"


def chat_template(metadata: Mapping[str, Any]) -> str | None:
    """``tokenizer.chat_template``: None when absent or empty, else a Jinja template that compiles."""
    value = meta_value(metadata.get("tokenizer.chat_template"))
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ModelError(f"GGUF tokenizer.chat_template is {_describe(value)} (allowed: a Jinja template string)")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # as transformers compiles it for apply_chat_template
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(value)
    except TemplateError as exc:
        raise ModelError(f"GGUF tokenizer.chat_template does not compile as a Jinja template: {exc}") from None
    return value


def eos_token_ids(metadata: Mapping[str, Any]) -> set[int]:
    """Ids that end a generation: the eos/eot/eom ids of the metadata and end-marker control tokens."""
    tokens: Sequence[str] = meta_value(metadata.get("tokenizer.ggml.tokens", []))
    ids = {i for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if (i := _token_id(metadata, k, len(tokens))) is not None}
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
    tokens = _string_list(metadata, "tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        raise ModelError(f"GGUF tokenizer.ggml.tokens holds {len(tokens) - len(set(tokens))} repeated tokens "
                         "(allowed: each token once)")
    merges: list[tuple[str, str]] = []
    for m in _string_list(metadata, "tokenizer.ggml.merges"):
        pair = m.split(" ")
        if len(pair) != 2:
            raise ModelError(f"GGUF tokenizer.ggml.merges entry {m!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    try:
        tok = Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
        )
    except Exception as exc:  # the tokenizers library raises plain Exceptions (a merge of an unknown token)
        raise ModelError(f"GGUF tokenizer.ggml.tokens/merges do not make a BPE tokenizer: {exc}") from None
    tok.pre_tokenizer = _pre_tokenizer(str(meta_value(metadata.get("tokenizer.ggml.pre", "gpt2"))))
    tok.decoder = decoders.ByteLevel()
    types = _token_types(metadata, len(tokens))
    control = [tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def token(key: str) -> str | None:
        i = _token_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens))
        return None if i is None else tokens[i]

    add_bos = meta_value(metadata.get("tokenizer.ggml.add_bos_token", False))
    if type(add_bos) is not bool:  # the string 'false' was true
        raise ModelError(f"GGUF tokenizer.ggml.add_bos_token={add_bos!r} (allowed: a boolean)")
    if add_bos and token("bos") is not None:
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
        chat_template=chat_template(metadata),
        additional_special_tokens=control,
    )
    stop = sorted(eos_token_ids(metadata))
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=stop)


# -- all of it ---------------------------------------------------------------------------------


def load_gguf(path: str | os.PathLike[str]) -> tuple[Model, TokenizerWrapper]:
    """The stock mlx-lm llama `Model` (quantized as stored, float32 activations) and its tokenizer."""
    weights, metadata = read_gguf(path)
    try:
        args = model_args(metadata, weights)
        model = build_model(args, mlx_weights(weights))
        return model, build_tokenizer(metadata)
    except ModelError as err:  # the metadata and tokenizer checks name the key; this names the file
        raise ModelError(f"model={str(path)!r}: {err}") from None
