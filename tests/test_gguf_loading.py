"""Damaged and hostile model files: a clear `ModelError` before MLX reads them, never a crash or a wrong model.

MLX's GGUF reader trusts the header: a count off by one, a key length past the file or an
alignment of 0 crashed the process (segmentation fault, floating-point exception), an unknown
tensor type ended the tensor list early, and a block count of 2**31 built layers until memory ran
out. The files here are written byte by byte (`_gguf`), small, in the layout of the GGUF
specification; the metadata checks run on the values as MLX returns them.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import mlx.core as mx
import pytest

from metal_attn.errors import ModelError
from metal_attn.mlx_lm import gguf, gguf_header, load
from metal_attn.mlx_lm.gguf_header import check_gguf

U8, I32, U32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 5, 4, 6, 7, 8, 9, 10, 11, 12


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item, values = value
        body = b"".join(_value(item, v) for v in values)
        return struct.pack("<IQ", item, len(values)) + body
    fmt = {U8: "<B", I32: "<i", U32: "<I", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}.get(kind, "<I")
    return struct.pack(fmt, value)


def _gguf(kv=(("general.architecture", STRING, "llama"),), tensors=(("a.weight", (32, 2), 0, 0),), *,
          version=3, n_tensors=None, n_kv=None, data: int | None = None) -> bytes:
    """A GGUF file: ``kv`` as (key, type, value), ``tensors`` as (name, dims, type, offset), then ``data``
    bytes of tensor data (enough for the tensors when None)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                len(kv) if n_kv is None else n_kv)
    for key, kind, value in kv:
        out += _string(key) + struct.pack("<I", kind) + _value(kind, value)
    for name, dims, kind, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % 32)
    return out + b"\0" * (256 if data is None else data)


@pytest.fixture
def write(tmp_path):
    def _write(content: bytes, name: str = "m.gguf"):
        path = tmp_path / name
        path.write_bytes(content)
        return path
    return _write


def test_a_well_formed_header_is_read(write):
    header = check_gguf(write(_gguf(kv=(("general.architecture", STRING, "llama"), ("n", U32, 7),
                                        ("toks", ARRAY, (STRING, ["a", "bc"]))))))
    assert header.version == 3 and header.metadata["n"] == 7 and header.metadata["toks"].length == 2
    assert [(t.name, t.dims, t.nbytes) for t in header.tensors] == [("a.weight", (32, 2), 256)]


@pytest.mark.parametrize(("content", "message"), [
    (_gguf(version=4), "GGUF version 4 (allowed: 2, 3)"),
    (_gguf(version=1), "GGUF version 1"),
    (_gguf(n_tensors=2), "tensor '' has 0 dimensions"),  # a count off by one: a segmentation fault in MLX
    (_gguf(n_tensors=2**40), "the tensor count=1099511627776 (allowed: at most 65536)"),
    (_gguf(n_tensors=1000), "the tensor count=1000 items"),
    (_gguf(n_kv=2**63), "the metadata count="),
    (_gguf(n_kv=2), "(at byte"),  # the tensor entry read as a key: whatever follows fails
    (_gguf(kv=(("general.alignment", U32, 0),)), "general.alignment=0 (allowed: a power of two"),
    (_gguf(kv=(("general.alignment", U32, 24),)), "general.alignment=24"),
    (_gguf(kv=(("general.alignment", STRING, "32"),)), "general.alignment='32'"),
    (_gguf(kv=(("k", 99, 0),)), "metadata 'k' has value type 99"),
    (_gguf(kv=(("k", ARRAY, (ARRAY, [(U8, [1])])),)), "metadata 'k' is an array of arrays"),
    (_gguf(kv=(("k", STRING, "x"), ("k", STRING, "y"))), "metadata key 'k' appears twice"),
    (_gguf(kv=(("k", STRING, b"\xff\xfe"),)), "metadata 'k' is not UTF-8"),
    (_gguf(tensors=(("a.weight", (32, 2), 99, 0),)), "type 99 (unknown), which this loader does not read"),
    (_gguf(tensors=(("a.weight", (32, 2), 30, 0),)), "type 30 (BF16)"),
    (_gguf(tensors=(("a.weight", (32, 2), 26, 0),)), "type 26 (I32)"),  # an integer norm weight
    (_gguf(tensors=(("a.weight", (32, 2), 0, 0), ("a.weight", (32, 2), 0, 256))), "'a.weight' appears twice"),
    (_gguf(tensors=(("a.weight", (32, 2), 0, 1 << 40),)), "lies outside the 256 bytes of tensor data"),
    (_gguf(tensors=(("a.weight", (32, 2), 0, 8),)), "off its 32-byte alignment"),
    (_gguf(tensors=(("a.weight", (32, 2), 0, 0),), data=100), "lies outside the 100 bytes"),
    (_gguf(tensors=(("a.weight", (2**31, 2), 0, 0),)), "has dimensions [2147483648, 2]"),
    (_gguf(tensors=(("a.weight", (1, 1, 1, 1, 1), 0, 0),)), "has 5 dimensions"),
    (_gguf(tensors=(("a.weight", (30, 2), 2, 0),)), "rows of 30 elements (allowed: a multiple of its block of 32)"),
    (b"GGUX" + _gguf()[4:], "it does not start with the GGUF magic"),
])
def test_a_damaged_header_is_refused_before_mlx_reads_it(write, content, message):
    path = write(content)
    with pytest.raises(ModelError, match="is not a readable GGUF file") as exc:
        gguf.read_gguf(path)  # the header check runs first: MLX never sees the file
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_every_truncation_of_a_file_is_refused(write):
    whole = _gguf(kv=(("general.architecture", STRING, "llama"), ("toks", ARRAY, (STRING, ["a", "bc"]))))
    header_end = len(whole) - 256
    for cut in range(header_end + 255):
        if cut in range(header_end - (header_end % 32), header_end):  # the padding before the data: a shorter file
            continue
        with pytest.raises(ModelError, match="is not a readable GGUF file"):
            check_gguf(write(whole[:cut]))


def _sparse(path, size: int):
    """``path`` grown to ``size`` bytes without writing them (a few KB on disk)."""
    with open(path, "r+b") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("kv", [
    (("x", F64, 1.5),),
    (("general.architecture", STRING, "llama"), ("llama.rope.freq_base", F64, 1e4)),
    (("x", ARRAY, (F64, [1.0, 2.0])),),
])
def test_a_float64_metadata_value_is_refused_before_mlx_reads_it(write, kv):
    """MLX 0.32.4 stores a float64 as a float32 and reads 4 bytes short: a segmentation fault."""
    key = kv[-1][0]
    with pytest.raises(ModelError, match=rf"metadata '{re.escape(key)}' (is|is an array of) float64 \(type 12\), "
                                         r"which MLX 0.32.4 misreads.*allowed: .*6 \(float32\)"):
        gguf.read_gguf(write(_gguf(kv=kv)))


def _big_tensor_file(write, nbytes_at_least: int):
    """A sparse GGUF whose one F32 tensor takes more than ``nbytes_at_least`` bytes, all inside the file."""
    rows = nbytes_at_least // (4 << 20) + 1
    content = _gguf(tensors=(("a.weight", (1 << 20, rows), 0, 0),), data=0)
    return _sparse(write(content), len(content) + rows * (4 << 20))


def test_a_tensor_larger_than_memory_is_refused(write):
    """MLX does not check its allocation: a 32 GiB tensor in a sparse file crashed the process."""
    memory = gguf_header.memory_bytes()
    path = _big_tensor_file(write, memory)
    with pytest.raises(ModelError, match=rf"tensor 'a.weight' is \d+ bytes, more than this machine's {memory} bytes"):
        check_gguf(path)


def test_tensors_larger_than_memory_together_are_refused(write, monkeypatch):
    monkeypatch.setattr(gguf_header, "memory_bytes", lambda: 300)
    path = write(_gguf(tensors=(("a.weight", (32, 2), 0, 0), ("b.weight", (32, 2), 0, 256)), data=512))
    with pytest.raises(ModelError, match=r"the tensors take 512 bytes or more, more than this machine's 300 bytes"):
        check_gguf(path)


def _declared(key: bytes, kind: int, body: bytes) -> bytes:
    """A GGUF of one metadata entry and no tensors, the entry's bytes as given."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + body


@pytest.mark.parametrize(("key", "kind", "body", "size", "message"), [
    # MLX reads an array length as a 32-bit int: 2**32 + 8 elements were read as 8 (another header than the one checked)
    (b"k", ARRAY, struct.pack("<IQ", U8, 2**32 + 8), 2**32 + 64,
     "the length of metadata 'k'=4294967304 (allowed: at most 16777216)"),
    (b"k", ARRAY, struct.pack("<IQ", STRING, 2**21 + 1), 2**24 + 64,
     "the length of metadata 'k'=2097153 (allowed: at most 2097152)"),
    (b"k", STRING, struct.pack("<Q", (4 << 20) + 1), (4 << 20) + 64,
     "metadata 'k' is 4194305 bytes long (allowed: at most 4194304)"),
    (b"k" * 4097, U8, b"\0", 8192, "metadata key 0 is 4097 bytes long (allowed: at most 4096)"),
])
def test_lengths_past_their_caps_are_refused_before_they_are_read(write, key, kind, body, size, message):
    """Lengths bounded only by the file size let a sparse file set this check's memory and time (a 2 GiB
    string read whole) and, past 2**31, MLX's reading of the header."""
    path = _sparse(write(_declared(key, kind, body)), size)
    with pytest.raises(ModelError) as exc:
        check_gguf(path)
    assert message in str(exc.value)


def test_a_header_past_its_cap_is_refused(write, monkeypatch):
    monkeypatch.setattr(gguf_header, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(ModelError, match="reaches past 1000 bytes"):
        check_gguf(write(_gguf(kv=(("k", ARRAY, (STRING, ["x" * 8] * 200)),))))


def test_a_string_array_that_is_not_utf8_is_refused_naming_its_key(write):
    with pytest.raises(ModelError, match=r"metadata 'toks'\[1\] is not UTF-8"):
        check_gguf(write(_gguf(kv=(("toks", ARRAY, (STRING, [b"a", b"\xff"])),))))


@pytest.mark.parametrize("kind", [U64, I32, U8])
def test_an_alignment_not_stored_as_uint32_is_refused(write, kind):
    """MLX honours general.alignment only as a uint32: stored as a uint64, the tensors came back shifted."""
    path = write(_gguf(kv=(("general.alignment", kind, 64),), tensors=(("a.weight", (32, 2), 0, 0),)))
    with pytest.raises(ModelError, match=r"general.alignment=64 is stored as \w+ \(allowed: uint32"):
        check_gguf(path)


def test_a_uint32_alignment_is_used(write):
    header = check_gguf(write(_gguf(kv=(("general.alignment", U32, 64),))))
    assert header.alignment == 64 and header.data_offset % 64 == 0


def test_overlapping_tensors_are_refused_naming_both(write):
    """Every layer pointed at the same bytes loaded as one shared set of weights."""
    path = write(_gguf(tensors=(("a.weight", (32, 2), 0, 0), ("b.weight", (32, 2), 0, 128)), data=512))
    with pytest.raises(ModelError, match=r"tensors 'a.weight' \(bytes 0 to 256\) and 'b.weight' \(from 128\) overlap"):
        check_gguf(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_check_gguf_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    import signal

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)

    def hung(*_):
        raise TimeoutError("check_gguf waited on the FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        with pytest.raises(ModelError, match=r"pipe.gguf' is not a regular file \(allowed: a GGUF file\)"):
            check_gguf(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- the metadata, as MLX returns it ----------------------------------------------------------------------


def _meta(**overrides) -> dict:
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.block_count": 2, "llama.feed_forward_length": 96,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 32, "llama.rope.freq_base": 1e4,
            "llama.context_length": 128}
    return {k: (mx.array(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in (base | overrides).items() if v is not None}


def _weights(layers: int = 2, ffn: int = 96) -> dict:
    w = {"token_embd.weight": mx.zeros((32, 64)), "output_norm.weight": mx.zeros((64,))}
    for i in range(layers):
        w |= {f"blk.{i}.attn_q.weight": mx.zeros((64, 64)), f"blk.{i}.attn_k.weight": mx.zeros((32, 64)),
              f"blk.{i}.ffn_gate.weight": mx.zeros((ffn, 64))}
    return w


def test_well_formed_metadata_gives_the_model_args():
    args = gguf.model_args(_meta(), _weights())
    assert (args.hidden_size, args.num_hidden_layers, args.num_key_value_heads, args.head_dim) == (64, 2, 2, 16)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"llama.block_count": "thirty"}, "llama.block_count='thirty' (allowed: an integer >= 1 and <= 2**31 - 1)"),
    ({"llama.block_count": 2**31}, "llama.block_count=2147483648 (allowed: an integer >= 1 and <= 2**31 - 1)"),
    ({"llama.block_count": 3}, "llama.block_count=3 but the file has tensors of 2 blocks"),
    ({"llama.block_count": -1}, "llama.block_count=-1 (allowed: an integer >= 1"),
    ({"llama.attention.head_count": 0}, "llama.attention.head_count=0"),
    ({"llama.attention.head_count_kv": 3}, "head_count=4 is not a multiple of head_count_kv=3"),
    ({"llama.embedding_length": [64, 64]}, "llama.embedding_length=[64, 64]"),
    ({"llama.feed_forward_length": 2**20}, "blk.0.ffn_gate.weight is 96 x 64 but the metadata"),
    ({"llama.feed_forward_length": 2**33}, "llama.feed_forward_length=8589934592 (allowed: an integer >= 1 and <="),
    ({"llama.vocab_size": 33}, "token_embd.weight is 32 x 64"),
    ({"llama.attention.layer_norm_rms_epsilon": math.nan}, "layer_norm_rms_epsilon=nan (allowed: a finite"),
    ({"llama.attention.layer_norm_rms_epsilon": -1e-5}, "layer_norm_rms_epsilon=-9.99"),
    ({"llama.rope.freq_base": 0.0}, "llama.rope.freq_base=0.0"),
    ({"llama.rope.freq_base": True}, "llama.rope.freq_base=True"),
    ({"llama.rope.freq_base": math.inf}, "llama.rope.freq_base=inf"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, "rope.scaling.factor=0.0"),
    ({"llama.context_length": "8k"}, "llama.context_length='8k'"),
])
def test_bad_metadata_is_refused_before_a_model_is_built(overrides, message):
    with pytest.raises(ModelError) as exc:
        gguf.model_args(_meta(**overrides), _weights())
    assert message in str(exc.value)


@pytest.mark.parametrize(("overrides", "drop", "message"), [
    ({"llama.feed_forward_length": 2**33}, "blk.0.ffn_gate.weight", "feed_forward_length=8589934592 (allowed"),
    ({"llama.vocab_size": 2**31}, "token_embd.weight", "llama.vocab_size=2147483648 (allowed"),
    ({}, "blk.0.ffn_gate.weight", "GGUF tensor blk.0.ffn_gate.weight is missing; a llama GGUF needs it"),
    ({}, "token_embd.weight", "GGUF tensor token_embd.weight is missing"),
])
def test_a_size_whose_tensor_is_absent_is_refused_not_overflowed(overrides, drop, message):
    """A size of 2**31 or more went unchecked when its tensor was absent: building the model raised OverflowError."""
    weights = _weights()
    del weights[drop]
    with pytest.raises(ModelError) as exc:
        gguf.model_args(_meta(**overrides), weights)
    assert message in str(exc.value)


def test_more_tokens_than_embedding_rows_are_refused_naming_both_counts():
    """Tokens past the embedding's rows indexed out of range: non-finite logits."""
    with pytest.raises(ModelError, match=r"tokenizer.ggml.tokens has 40 tokens but the model's vocabulary "
                                         r"\(llama.vocab_size, the rows of token_embd.weight\) is 32"):
        gguf.model_args(_meta(**{"tokenizer.ggml.tokens": [str(i) for i in range(40)]}), _weights())
    padded = gguf.model_args(_meta(**{"tokenizer.ggml.tokens": [str(i) for i in range(20)]}), _weights())
    assert padded.vocab_size == 32  # fewer tokens than rows: a padded vocabulary


def test_plain_tensors_named_like_a_quantized_triple_are_refused(write):
    """An F16 .weight with F32 .scales/.biases was built as a QuantizedLinear that failed at the first forward."""
    path = write(_gguf(tensors=(("x.weight", (32, 2), 1, 0), ("x.scales", (32, 1), 0, 128),
                                ("x.biases", (32, 1), 0, 256)), data=512))
    with pytest.raises(ModelError, match=r"tensor 'x.scales' of type F32 \(allowed: names ending in .weight or .bias"):
        gguf.read_gguf(path)


def test_each_array_has_the_dtype_of_its_header_type(write):
    weights, _ = gguf.read_gguf(write(_gguf(tensors=(("a.weight", (32, 2), 0, 0), ("b.weight", (32, 2), 1, 256)),
                                            data=512)))
    assert (weights["a.weight"].dtype, weights["b.weight"].dtype) == (mx.float32, mx.float16)


def test_a_file_mlx_cannot_open_read_write_is_refused_saying_so(write, monkeypatch):
    """MLX's reader opens a GGUF read-write: a file the user may only read failed as "gguf_init failed"."""
    path = write(_gguf())
    real_open = os.open

    def read_only(p, flags, *args, **kwargs):
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ModelError, match=r"can be read but not opened for writing \(Permission denied\); MLX's GGUF "
                                         "reader opens the file read-write"):
        gguf.read_gguf(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")
def test_a_read_only_file_is_refused_saying_so(write):
    path = write(_gguf())
    path.chmod(0o444)
    with pytest.raises(ModelError, match="can be read but not opened for writing"):
        gguf.read_gguf(path)


def test_metadata_errors_name_the_file(write):
    path = write(_gguf(kv=(("x", U32, 1),)))
    with pytest.raises(ModelError, match=rf"model='{re.escape(str(path))}': GGUF metadata key 'general.architecture' "
                                         "is missing"):
        gguf.load_gguf(path)


def test_a_symlink_loop_is_named_as_one(tmp_path):
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(tmp_path / "a.gguf")
    with pytest.raises(ModelError, match=r"a\.gguf' is a symbolic link loop"):
        gguf.read_gguf(tmp_path / "a.gguf")
    with pytest.raises(ModelError, match=r"a\.gguf' is a symbolic link loop"):
        load(tmp_path / "a.gguf")


def test_a_path_that_is_not_utf8_is_refused_saying_so(tmp_path):
    path = tmp_path / os.fsdecode(b"caf\xe9.gguf")
    path.write_bytes(_gguf())
    with pytest.raises(ModelError, match="is a path that is not UTF-8, which MLX's GGUF reader cannot open"):
        gguf.read_gguf(path)


def _tok_meta(**overrides) -> dict:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": mx.array([1, 1, 1, 3]),
            "tokenizer.ggml.eos_token_id": mx.array(3), "tokenizer.ggml.pre": "gpt2"}
    return {k: v for k, v in (base | overrides).items() if v is not None}


def test_a_well_formed_tokenizer_is_built():
    tok = gguf.build_tokenizer(_tok_meta(**{"tokenizer.chat_template": "{{ messages[0]['content'] }}"}))
    assert tok.encode("ab", add_special_tokens=False) == [2] and 3 in tok.eos_token_ids


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tokenizer.ggml.tokens": mx.array([1, 2])}, "tokenizer.ggml.tokens is an array of 2 int"),
    ({"tokenizer.ggml.tokens": "ab"}, "tokenizer.ggml.tokens is 'ab'"),
    ({"tokenizer.ggml.tokens": ["a", "a", "ab", "x"]}, "holds 1 repeated tokens"),
    ({"tokenizer.ggml.merges": ["a zz"]}, "do not make a BPE tokenizer"),
    ({"tokenizer.ggml.token_type": mx.array(1)}, "tokenizer.ggml.token_type is 1"),
    ({"tokenizer.ggml.token_type": mx.array([1, 1])}, "one integer per token, 4 of them"),
    ({"tokenizer.ggml.eos_token_id": "2"}, "tokenizer.ggml.eos_token_id='2' (allowed: a token id in 0..3)"),
    ({"tokenizer.ggml.bos_token_id": mx.array(9)}, "tokenizer.ggml.bos_token_id=9"),
    ({"tokenizer.chat_template": mx.array(5)}, "tokenizer.chat_template is 5"),
    ({"tokenizer.ggml.add_bos_token": "false"}, "tokenizer.ggml.add_bos_token='false' (allowed: a boolean)"),
    ({"tokenizer.chat_template": "{% if %}"}, "does not compile as a Jinja template"),
])
def test_bad_tokenizer_metadata_is_refused(overrides, message):
    with pytest.raises(ModelError) as exc:
        gguf.build_tokenizer(_tok_meta(**overrides))
    assert message in str(exc.value)


def test_an_empty_chat_template_is_no_template():
    assert gguf.build_tokenizer(_tok_meta(**{"tokenizer.chat_template": ""})).has_chat_template is False


# -- model folders and paths ------------------------------------------------------------------------------


def _folder(tmp_path, config: dict, layers: int = 2):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {f"model.layers.{i}.mlp.up_proj.weight": mx.zeros((2, 2)) for i in range(layers)})
    return folder


def test_a_folder_whose_config_claims_more_layers_than_its_weights_is_refused_before_a_build(tmp_path):
    """2**31 layers allocated until memory ran out: the weights' own names bound the count."""
    folder = _folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 2**31})
    with pytest.raises(ModelError, match=r"num_hidden_layers=2147483648 but the weights hold layers 0 to 1 "
                                         r"\(allowed: layers 0 to 2147483647"):
        load(folder)


@pytest.mark.parametrize(("names", "layers", "shown"), [
    (["model.embed_tokens.weight"], 100000, "no layers"),  # the guard was skipped: 73 s and 8.9 GB to a refusal
    (["model.layers.99999.x"], 100000, "layers 99999"),  # one tensor satisfied it
    (["model.layers.0.x", "model.layers.1.x", "model.layers.2.x"], 2, "layers 0 to 2"),
    (["model.layers.0.x", "model.layers.2.x"], 2, "layers 0, 2"),
    (["model.layers.0.x", "vision_tower.encoder.layers.5.x"], 3, "layers 0 (allowed"),  # a tower's layers do not count
])
def test_a_folder_whose_layers_are_not_exactly_0_to_n_minus_1_is_refused_before_a_build(tmp_path, names, layers, shown):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    mx.save_safetensors(str(folder / "model.safetensors"), {n: mx.zeros((1,)) for n in names})
    with pytest.raises(ModelError, match=rf"num_hidden_layers={layers} but the weights hold {re.escape(shown)}"):
        load(folder)


def test_deeply_nested_json_is_a_model_error_naming_the_file(tmp_path):
    """100,000 nested arrays raised an uncaught RecursionError."""
    folder = _folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 2})
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text("[" * 100000)
    with pytest.raises(ModelError, match=r"config.json could not be read \(RecursionError"):
        load(folder)
    (folder / "config.json").write_text(config)
    deep = b"[" * 100000
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(ModelError, match=r"model.safetensors has an unreadable safetensors header \(RecursionError"):
        load(folder)


@pytest.mark.parametrize(("scaling", "shown"), [
    ({"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor=nan (allowed: a finite number > 0)"),
    ({"rope_type": "linear", "factor": 0}, "rope_scaling.factor=0 (allowed: a finite number > 0)"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": float("inf")}, "rope_scaling.low_freq_factor=inf"),
    ({"rope_type": "longrope", "short_factor": [1.0, float("nan")]}, "rope_scaling.short_factor=[1.0, nan]"),
])
def test_a_folder_rope_scaling_that_is_not_finite_and_positive_is_refused(tmp_path, scaling, shown):
    """A factor of NaN loaded without a word and every logit was NaN (the GGUF path checked its factor)."""
    folder = _folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "rope_scaling": scaling})
    with pytest.raises(ModelError, match=re.escape(shown)):
        load(folder)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("rope_theta", float("nan"), "rope_theta=nan"), ("rope_theta", -1.0, "rope_theta=-1.0"),
    ("rms_norm_eps", 0, "rms_norm_eps=0"), ("rope_theta", "1e4", "rope_theta='1e4'"),
    ("rope_theta", True, "rope_theta=True"), ("rms_norm_eps", 1e300, "rms_norm_eps=1e+300")])
def test_a_folder_config_with_a_rope_base_or_norm_epsilon_that_is_not_positive_is_refused(tmp_path, field, value,
                                                                                          shown):
    """A tiny llama with rope_theta NaN or -1 loaded without a word and generated "[UNK]" from then on."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 10000.0, field: value}
    folder = _folder(tmp_path, config)
    with pytest.raises(ModelError, match=rf"config.json has {re.escape(shown)} \(allowed: a finite number > 0, at most "
                                         r"3\.403e\+38, float32's largest"):
        load(folder)
    nested = tmp_path / "nested"
    nested.mkdir()
    folder.rename(nested / "model")
    config = {"model_type": "llama", "num_hidden_layers": 2, "text_config": {field: value}}
    (nested / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=rf"text_config\.{re.escape(shown)}"):
        load(nested / "model")


def test_a_folder_config_mlx_lm_cannot_build_is_a_model_error(tmp_path):
    folder = _folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 0, "intermediate_size": 8, "rms_norm_eps": 1e-5,
                                "vocab_size": 8})
    with pytest.raises(ModelError, match=r"could not be loaded by mlx-lm \(ZeroDivisionError"):
        load(folder)


def test_a_damaged_safetensors_file_is_a_model_error(tmp_path):
    folder = _folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 2})
    (folder / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelError, match=r"model\.safetensors is not a readable safetensors file"):
        load(folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_path_that_is_neither_a_file_nor_a_folder_is_refused(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="is neither a regular file nor a folder"):
        load(fifo)
