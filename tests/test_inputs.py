"""Bad inputs to `paged_attention` and `reshape_and_cache`, value semantics of the caller's
arrays, the scatter contract of `reshape_and_cache`, and randomized correctness of the
reference provider against the float64 oracle."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metal_attn
from metal_attn import InvalidInputError, native
from metal_attn.metadata import AttentionMetadata
from metal_attn.settings import override_settings
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.cases import to_numpy

HEAD = 16


def _attention_args(**changes: Any) -> dict[str, Any]:
    """A valid call (2 sequences: a decode row over 10 tokens, a 2-row prefill), with ``changes`` applied."""
    rng = np.random.default_rng(0)
    args: dict[str, Any] = {
        "q": mx.array(rng.standard_normal((3, 4, HEAD), dtype=np.float32)),
        "k_cache": mx.array(rng.standard_normal((6, 8, 2, HEAD), dtype=np.float32)),
        "v_cache": mx.array(rng.standard_normal((6, 8, 2, HEAD), dtype=np.float32)),
        "block_tables": np.array([[1, 2], [3, 0]], dtype=np.int32),
        "seq_lens": np.array([10, 2], dtype=np.int32),
        "cu_seqlens_q": np.array([0, 1, 3], dtype=np.int32),
    }
    args.update(changes)
    return args


def _f32(shape: tuple[int, ...], dtype: Any = mx.float32) -> mx.array:
    return mx.zeros(shape, dtype=dtype)


BAD_ATTENTION = {
    # tensors: ranks, types, dtypes, shapes
    "q-rank": ({"q": _f32((3, 4 * HEAD))}, ["q must have rank 3", f"(got shape (3, {4 * HEAD}))"]),
    "q-numpy": ({"q": np.zeros((3, 4, HEAD), np.float32)}, ["q must be an mx.array (got ndarray)"]),
    "k-rank": ({"k_cache": _f32((48, 2, HEAD))}, ["k_cache must have rank 4", "(got shape (48, 2, 16))"]),
    "v-rank": ({"v_cache": _f32((6, 8, 2 * HEAD))}, ["v_cache must have rank 4"]),
    "q-int-dtype": ({"q": _f32((3, 4, HEAD), mx.int32)}, ["q.dtype=int32 (supported: float16, bfloat16, float32)"]),
    "kv-shapes": ({"v_cache": _f32((7, 8, 2, HEAD))},
                  ["k_cache.shape=(6, 8, 2, 16) and v_cache.shape=(7, 8, 2, 16) must be equal"]),
    "kv-dtypes": ({"v_cache": _f32((6, 8, 2, HEAD), mx.float16)},
                  ["k_cache.dtype=float32 and v_cache.dtype=float16 must be equal"]),
    "head-size": ({"q": _f32((3, 4, 32))}, ["q head_size=32 differs from the cache's head_size=16"]),
    "heads-not-divisible": ({"q": _f32((3, 3, HEAD))},
                            ["num_heads=3 is not a multiple of num_kv_heads=2"]),
    "empty-dim": ({"k_cache": _f32((0, 8, 2, HEAD)), "v_cache": _f32((0, 8, 2, HEAD))},
                  ["k_cache has an empty dimension (shape (0, 8, 2, 16))"]),
    # metadata: q rows, cu_seqlens_q, seq_lens, block tables
    "q-rows": ({"q": _f32((4, 4, HEAD))}, ["q has 4 rows but cu_seqlens_q[-1]=3 (they must be equal)"]),
    "cu-not-increasing": ({"cu_seqlens_q": np.array([0, 3, 3], np.int32)},
                          ["cu_seqlens_q must be strictly increasing", "cu_seqlens_q[1]=3, cu_seqlens_q[2]=3",
                           "q_len=0 for sequence 1"]),
    "cu-decreasing": ({"cu_seqlens_q": np.array([0, 4, 3], np.int32), "seq_lens": np.array([10, 5], np.int32)},
                      ["cu_seqlens_q[1]=4, cu_seqlens_q[2]=3 gives q_len=-1 for sequence 1"]),
    "cu-start": ({"cu_seqlens_q": np.array([1, 2, 3], np.int32)}, ["cu_seqlens_q[0]=1 (must be 0)"]),
    "cu-length": ({"cu_seqlens_q": np.array([0, 3], np.int32)},
                  ["cu_seqlens_q has 2 entries; with 2 sequences it needs 3"]),
    "cu-float": ({"cu_seqlens_q": np.array([0.0, 1.0, 3.0])}, ["cu_seqlens_q must hold integers (got dtype float64)"]),
    "seq-len-below-q-len": ({"seq_lens": np.array([10, 1], np.int32)},
                            ["sequence 1 has q_len=2 query rows (cu_seqlens_q[1]=1 to cu_seqlens_q[2]=3) but "
                             "seq_lens[1]=1 KV tokens", "check cu_seqlens_q"]),
    # The issue's case: 30 decode rows meant, cu_seqlens_q written for 2 sequences.
    "cu-seqlens-for-decode-rows": ({"q": _f32((30, 4, HEAD)), "cu_seqlens_q": np.array([0, 1, 30], np.int32)},
                                   ["sequence 1 has q_len=29 query rows (cu_seqlens_q[1]=1 to cu_seqlens_q[2]=30)",
                                    "check cu_seqlens_q (prefix sums of the query rows per sequence, 3 entries) "
                                    "and seq_lens (2 sequences)"]),
    "seq-lens-rank": ({"seq_lens": np.array([[10, 2]], np.int32)},
                      ["seq_lens must have rank 1 (got shape (1, 2))"]),
    "seq-lens-empty": ({"seq_lens": np.array([], np.int32), "block_tables": np.zeros((0, 2), np.int32),
                        "cu_seqlens_q": np.array([0], np.int32)}, ["seq_lens is empty"]),
    "table-rows": ({"block_tables": np.array([[1, 2]], np.int32)},
                   ["block_tables has 1 rows but seq_lens has 2 sequences"]),
    "table-rank": ({"block_tables": np.array([1, 2, 3, 0], np.int32)}, ["block_tables must have rank 2"]),
    "table-float": ({"block_tables": np.array([[1.0, 2.0], [3.0, 0.0]])},
                    ["block_tables must hold integers (got dtype float64)"]),
    "table-missing": ({"block_tables": None}, ["block_tables is required (got None)"]),
    "block-id-too-large": ({"block_tables": np.array([[1, 6], [3, 0]], np.int32)},
                           ["block_tables[0][1]=6 is out of range (pool has 6 blocks: 0..5)"]),
    "block-id-negative": ({"block_tables": np.array([[1, 2], [-1, 0]], np.int32)},
                          ["block_tables[1][0]=-1 is out of range (pool has 6 blocks: 0..5)"]),
    "table-too-short": ({"seq_lens": np.array([17, 2], np.int32)},
                        ["block_tables row 0 has 2 entries but seq_lens[0]=17 with block_size=8 needs 3"]),
    # features
    "scale-zero": ({"scale": 0.0}, ["scale=0.0 (allowed: a finite number > 0 that float32 holds",
                                    "(1.175e-38 to 2.359e+38), or None for head_size**-0.5)"]),
    "scale-negative": ({"scale": -1}, ["scale=-1 (allowed: a finite number > 0"]),
    "scale-nan": ({"scale": float("nan")}, ["scale=nan (allowed: a finite number > 0"]),
    "scale-inf": ({"scale": float("inf")}, ["scale=inf (allowed: a finite number > 0"]),
    "scale-string": ({"scale": "0.25"}, ["scale='0.25' (allowed: a finite number > 0"]),
    "window-zero": ({"sliding_window": 0}, ["sliding_window=0 (allowed: an int from 1 to 2147483647, or None)"]),
    "window-negative": ({"sliding_window": -4}, ["sliding_window=-4 (allowed: an int from 1 to 2147483647, or None)"]),
    "window-float": ({"sliding_window": 2.5}, ["sliding_window=2.5 (allowed: an int from 1 to 2147483647, or None)"]),
    "window-bool": ({"sliding_window": True}, ["sliding_window=True (allowed: an int from 1 to 2147483647, or None)"]),
    "window-past-int32": ({"sliding_window": 2**31},
                          ["sliding_window=2147483648 (allowed: an int from 1 to 2147483647"]),
    # float32 is what the kernels get: 1e-300 would be 0 ("no softcap"), 1e39 would be inf
    "softcap-below-float32": ({"softcap": 1e-300}, ["softcap=1e-300 (allowed: a finite number > 0 that float32 holds"]),
    "scale-above-float32": ({"scale": 1e39}, ["scale=1e+39 (allowed: a finite number > 0 that float32 holds"]),
    # 3e38 * log2(e) overflows float32: every output was NaN
    "scale-above-float32-log2": ({"scale": 3e38}, ["scale=3e+38 (allowed: a finite number > 0 that float32 holds, "
                                                   "times log2(e) too (1.175e-38 to 2.359e+38)"]),
    "scale-bool": ({"scale": True}, ["scale=True (allowed: a finite number > 0"]),
    "softcap-bool": ({"softcap": True}, ["softcap=True (allowed: a finite number > 0"]),
    "provider-list": ({"provider": ["classic"]}, ["provider=['classic'] (allowed: a provider name as a str"]),
    "softcap-zero": ({"softcap": 0.0}, ["softcap=0.0 (allowed: a finite number > 0 that float32 holds", "or None)"]),
    "softcap-negative": ({"softcap": -30.0}, ["softcap=-30.0 (allowed: a finite number > 0 that float32", "or None)"]),
    "softcap-inf": ({"softcap": float("inf")}, ["softcap=inf (allowed: a finite number > 0 that float32", "or None)"]),
    "sinks-shape": ({"sinks": mx.zeros((2,))}, ["sinks.shape=(2,) (allowed: [4], one logit per query head)"]),
    "sinks-numpy": ({"sinks": np.zeros(4, np.float32)}, ["sinks must be an mx.array of shape [4] (got ndarray)"]),
    "sinks-int": ({"sinks": mx.zeros((4,), dtype=mx.int32)}, ["sinks.dtype=int32 (allowed: a floating dtype"]),
}


@pytest.mark.parametrize("name", list(BAD_ATTENTION))
def test_paged_attention_rejects_bad_input(name: str) -> None:
    changes, expected = BAD_ATTENTION[name]
    args = _attention_args(**changes)
    with pytest.raises(InvalidInputError) as info:
        metal_attn.paged_attention(**args)
    for text in expected:
        assert text in str(info.value), f"{text!r} not in {str(info.value)!r}"
    assert metal_attn.diagnostics.last_dispatch() is None, "a rejected call must not be recorded as dispatched"


def test_metadata_with_arrays_is_ambiguous() -> None:
    args = _attention_args()
    md = AttentionMetadata.build(args["block_tables"], args["seq_lens"], args["cu_seqlens_q"])
    with pytest.raises(InvalidInputError, match="pass either metadata= or block_tables/seq_lens/cu_seqlens_q"):
        metal_attn.paged_attention(**args, metadata=md)
    with pytest.raises(InvalidInputError, match=r"metadata must be a metal_attn.AttentionMetadata \(got dict\)"):
        metal_attn.paged_attention(args["q"], args["k_cache"], args["v_cache"], metadata={})


def test_valid_baseline_call_runs() -> None:
    """The base arguments of the table above are valid (so each row isolates one fault)."""
    out = metal_attn.paged_attention(**_attention_args())
    mx.eval(out)
    assert out.shape == (3, 4, HEAD)


def test_numpy_scalars_are_numbers() -> None:
    """numpy floats and ints are accepted for scale, softcap and sliding_window, with the same result."""
    args = _attention_args()
    plain = metal_attn.paged_attention(**args, scale=0.25, softcap=30.0, sliding_window=3)
    numpy = metal_attn.paged_attention(**args, scale=np.float32(0.25), softcap=np.float64(30.0),
                                       sliding_window=np.int64(3))
    np.testing.assert_array_equal(np.array(plain), np.array(numpy))


def test_block_table_errors_name_the_callers_values_for_large_pages() -> None:
    """Pages of 64 tokens run as kernel blocks of 32; errors still speak in the caller's pages."""
    args = _attention_args(
        k_cache=_f32((6, 64, 2, HEAD)), v_cache=_f32((6, 64, 2, HEAD)),
        block_tables=np.array([[1, 9], [3, 0]], np.int32), seq_lens=np.array([100, 2], np.int32),
    )
    with pytest.raises(InvalidInputError, match=r"block_tables\[0\]\[1\]=9 is out of range \(pool has 6 blocks"):
        metal_attn.paged_attention(**args)
    args["seq_lens"] = np.array([129, 2], np.int32)
    too_short = r"block_tables row 0 has 2 entries but seq_lens\[0\]=129 with block_size=64 needs 3"
    with pytest.raises(InvalidInputError, match=too_short):
        metal_attn.paged_attention(**args)


def test_validate_metadata_off_skips_the_pool_checks() -> None:
    """Block ids and table lengths raise unless METAL_ATTN_VALIDATE_METADATA=0; off, the bad sequence's
    rows are NaN (tests/test_validation_off.py has the rest); the structural checks stay on."""
    bt, sl, cu = np.array([[1, -1]], np.int32), np.array([10], np.int32), np.array([0, 1], np.int32)
    with pytest.raises(InvalidInputError, match=r"block_tables\[0\]\[1\]=-1 is out of range"):
        AttentionMetadata.build(bt, sl, cu).check_against_pool(6, 8)
    with override_settings(validate_metadata=False):
        md = AttentionMetadata.build(bt, sl, cu)
        assert md.validate is False
        md.check_against_pool(6, 8)  # no error
        md.check_against_pool(6, 1)  # a table far too short: no error either
        safe, poison = md.pool_guard(6, 8)
        assert safe.block_tables.tolist() == [[1, 0]] and poison.tolist() == [[[True]]]
        args = _attention_args(q=_f32((1, 4, HEAD)), block_tables=bt, seq_lens=sl, cu_seqlens_q=cu)
        out = metal_attn.paged_attention(**args)
        assert np.isnan(np.array(out)).all()
        with pytest.raises(InvalidInputError, match=r"sequence 0 has q_len=2 query rows .* seq_lens\[0\]=1 KV tokens"):
            AttentionMetadata.build(bt, [1], [0, 2])


def test_validate_metadata_off_skips_the_slot_value_checks() -> None:
    """With validation off an mx slot mapping is passed through unchecked (shape and dtype still are)."""
    dup = mx.array(np.array([5, 9, -1, 5], np.int64))
    with pytest.raises(InvalidInputError, match="slot_mapping holds slot 5 more than once"):
        metal_attn.reshape_and_cache(**_cache_args(slot_mapping=dup))
    with override_settings(validate_metadata=False):
        new_k, _ = metal_attn.reshape_and_cache(**_cache_args(slot_mapping=dup))
        mx.eval(new_k)
        with pytest.raises(InvalidInputError, match=r"slot_mapping.shape=\(3,\) \(allowed: \[4\]"):
            metal_attn.reshape_and_cache(**_cache_args(slot_mapping=mx.array(np.array([1, 2, 3], np.int64))))


def test_caller_arrays_unchanged_after_an_error() -> None:
    args = _attention_args(seq_lens=np.array([17, 2], np.int32))  # table too short
    before = {k: (to_numpy(v) if isinstance(v, mx.array) else np.array(v)) for k, v in args.items()}
    with pytest.raises(InvalidInputError):
        metal_attn.paged_attention(**args)
    for k, v in args.items():
        np.testing.assert_array_equal(to_numpy(v) if isinstance(v, mx.array) else v, before[k], err_msg=k)


# -- reshape_and_cache -------------------------------------------------------------------------------


def _cache_args(**changes: Any) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    args: dict[str, Any] = {
        "key": mx.array(rng.standard_normal((4, 2, HEAD), dtype=np.float32)),
        "value": mx.array(rng.standard_normal((4, 2, HEAD), dtype=np.float32)),
        "k_cache": mx.array(rng.standard_normal((6, 8, 2, HEAD), dtype=np.float32)),
        "v_cache": mx.array(rng.standard_normal((6, 8, 2, HEAD), dtype=np.float32)),
        "slot_mapping": mx.array(np.array([3, 17, -1, 40], np.int64)),
    }
    args.update(changes)
    return args


BAD_CACHE = {
    "key-rank": ({"key": _f32((4, 2 * HEAD))}, ["key must be an mx.array of rank 3", "(got array (4, 32))"]),
    "value-numpy": ({"value": np.zeros((4, 2, HEAD), np.float32)},
                    ["value must be an mx.array of rank 3", "(got ndarray (4, 2, 16))"]),
    "pool-rank": ({"k_cache": _f32((48, 2, HEAD))},
                  ["k_cache must be an mx.array of rank 4", "(got array (48, 2, 16))"]),
    "key-value-shapes": ({"value": _f32((4, 2, 8))}, ["key.shape=(4, 2, 16) and value.shape=(4, 2, 8) must be equal"]),
    "pool-shapes": ({"v_cache": _f32((5, 8, 2, HEAD))},
                    ["k_cache.shape=(6, 8, 2, 16) and v_cache.shape=(5, 8, 2, 16) must be equal"]),
    "heads": ({"key": _f32((4, 1, HEAD)), "value": _f32((4, 1, HEAD))},
              ["key has [num_kv_heads, head_size]=[1, 16] but the pool has [2, 16]"]),
    "value-dtype": ({"value": _f32((4, 2, HEAD), mx.float16)},
                    ["value.dtype=float16 differs from k_cache.dtype=float32 (they must match)"]),
    "pool-dtype": ({"v_cache": _f32((6, 8, 2, HEAD), mx.bfloat16)},
                   ["v_cache.dtype=bfloat16 differs from k_cache.dtype=float32"]),
    "int-pool": ({"key": _f32((4, 2, HEAD), mx.int32), "value": _f32((4, 2, HEAD), mx.int32),
                  "k_cache": _f32((6, 8, 2, HEAD), mx.int32), "v_cache": _f32((6, 8, 2, HEAD), mx.int32)},
                 ["k_cache.dtype=int32 (supported: float16, bfloat16, float32)"]),
    "slot-out-of-range": ({"slot_mapping": mx.array(np.array([3, 48, -1, 0], np.int64))},
                          ["slot_mapping holds slot 48, out of range (pool has 48 slots: 0..47"]),
    "slot-duplicated": ({"slot_mapping": mx.array(np.array([5, 9, -1, 5], np.int64))},
                        ["slot_mapping holds slot 5 more than once"]),
    "slot-shape": ({"slot_mapping": mx.array(np.array([1, 2, 3], np.int64))},
                   ["slot_mapping.shape=(3,) (allowed: [4], one slot per token)"]),
    "slot-float-mx": ({"slot_mapping": mx.array([1.0, 2.0, 3.0, 4.0])},
                      ["slot_mapping.dtype=float32 (allowed: an integer dtype, e.g. int64 or int32)"]),
    "slot-float-numpy": ({"slot_mapping": np.array([1.0, 2.0, 3.0, 4.0])},
                         ["slot_mapping must hold integers (got dtype float64)"]),
}


def test_slot_dtypes_are_the_same_for_mlx_and_numpy() -> None:
    """NumPy uint32 slots were accepted and MLX uint32 ones refused."""
    slots = np.array([3, 17, 40, 0], np.int64)
    want = [to_numpy(a) for a in metal_attn.reshape_and_cache(**_cache_args(slot_mapping=slots))]
    for dtype in (mx.uint32, mx.int16, mx.uint8):
        got = metal_attn.reshape_and_cache(**_cache_args(slot_mapping=mx.array(slots).astype(dtype)))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(to_numpy(a), b)


@pytest.mark.parametrize("name", list(BAD_CACHE))
def test_reshape_and_cache_rejects_bad_input(name: str) -> None:
    changes, expected = BAD_CACHE[name]
    args = _cache_args(**changes)
    pools = [to_numpy(args[k]) for k in ("k_cache", "v_cache") if isinstance(args[k], mx.array)]
    with pytest.raises(InvalidInputError) as info:
        metal_attn.reshape_and_cache(**args)
    for text in expected:
        assert text in str(info.value), f"{text!r} not in {str(info.value)!r}"
    after = [to_numpy(args[k]) for k in ("k_cache", "v_cache") if isinstance(args[k], mx.array)]
    for b, a in zip(pools, after, strict=True):
        np.testing.assert_array_equal(a, b)


def _bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16 if x.dtype != mx.float32 else mx.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("slot_type", ["mx-int64", "mx-int32", "numpy", "list"])
def test_reshape_and_cache_is_a_plain_scatter(dtype: Any, slot_type: str) -> None:
    """Byte-identical to ``pool[slot] = kv`` in numpy, negative slots skipped; inputs untouched."""
    rng = np.random.default_rng(2)
    nb, bs, kvh, d, n = 7, 8, 2, HEAD, 20
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[[0, 7, 19]] = [-1, -5, -1]
    key, value = (mx.array(rng.standard_normal((n, kvh, d), dtype=np.float32)).astype(dtype) for _ in range(2))
    kc, vc = (mx.array(rng.standard_normal((nb, bs, kvh, d), dtype=np.float32)).astype(dtype) for _ in range(2))
    mx.eval(key, value, kc, vc)
    before = {name: _bits(x) for name, x in (("key", key), ("value", value), ("k_cache", kc), ("v_cache", vc))}
    slot_arg: Any = {
        "mx-int64": mx.array(slots), "mx-int32": mx.array(slots.astype(np.int32)), "numpy": slots,
        "list": slots.tolist(),
    }[slot_type]

    new_k, new_v = metal_attn.reshape_and_cache(key, value, kc, vc, slot_arg)
    mx.eval(new_k, new_v)

    keep = slots >= 0
    for new, pool, src in ((new_k, "k_cache", "key"), (new_v, "v_cache", "value")):
        want = before[pool].reshape(nb * bs, kvh, d).copy()
        want[slots[keep]] = before[src][keep]
        assert new.dtype == dtype and new.shape == (nb, bs, kvh, d)
        np.testing.assert_array_equal(_bits(new).reshape(nb * bs, kvh, d), want)
    # values semantics: the caller's arrays still hold what they held
    for name, x in (("key", key), ("value", value), ("k_cache", kc), ("v_cache", vc)):
        np.testing.assert_array_equal(_bits(x), before[name], err_msg=name)
    record = metal_attn.diagnostics.last_cache_write()
    assert record is not None and record.op == "reshape_and_cache"


def test_reshape_and_cache_all_padding_leaves_the_pool() -> None:
    args = _cache_args(slot_mapping=np.array([-1, -1, -1, -1]))
    before = to_numpy(args["k_cache"])
    new_k, _ = metal_attn.reshape_and_cache(**args)
    np.testing.assert_array_equal(to_numpy(new_k), before)


def test_slot_checks_survive_in_place_edits() -> None:
    """MLX arrays can be edited in place, so a slot mapping seen before is checked again."""
    args = _cache_args()
    metal_attn.reshape_and_cache(**args)
    slots = args["slot_mapping"]
    slots[1] = 3  # now [3, 3, -1, 40]: slot 3 twice
    with pytest.raises(InvalidInputError, match="slot_mapping holds slot 3 more than once"):
        metal_attn.reshape_and_cache(**args)


# -- randomized correctness of the reference provider ------------------------------------------------


@st.composite
def _batches(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 3))
    edge = st.builds(lambda b, d: max(1, b * block_size + d), st.integers(0, 4), st.sampled_from([-1, 0, 1]))
    seq_lens = draw(st.lists(st.one_of(edge, st.integers(1, 100)), min_size=n, max_size=n))
    q_lens = [draw(st.sampled_from(sorted({1, s, min(s, draw(st.integers(1, 24)))}))) for s in seq_lens]
    order = sorted(range(n), key=lambda i: q_lens[i] != 1)  # decode rows first
    return {
        "q_lens": [q_lens[i] for i in order],
        "seq_lens": [seq_lens[i] for i in order],
        "num_heads": num_kv_heads * group,
        "num_kv_heads": num_kv_heads,
        "head_size": draw(st.sampled_from([8, 32, 64])),
        "block_size": block_size,
        "dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        "sinks": draw(st.booleans()),
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 40))),
        "softcap": draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0]))),
        "shared_prefix_blocks": draw(st.sampled_from([0, 0, 1])),
        "contiguous": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_batches())
def test_reference_matches_oracle_randomized(spec: dict[str, Any]) -> None:
    case = make_case(**spec)
    got = run_case(case, provider="reference")
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=str(spec))


def test_mixed_dtypes_fall_back_to_reference_with_a_warning(log_records) -> None:
    """A float32 q over a float16 cache is computed (by the reference provider, the only one that takes
    mixed dtypes), and the slow fallback is said once, with what the kernels refused and the remedy."""
    args = _attention_args(q=_f32((3, 4, HEAD)), k_cache=_f32((6, 8, 2, HEAD)).astype(mx.float16),
                           v_cache=_f32((6, 8, 2, HEAD)).astype(mx.float16))
    for _ in range(2):
        mx.eval(metal_attn.paged_attention(**args))
    assert metal_attn.diagnostics.last_dispatch().provider == "reference"
    warned = log_records("slow_fallback")
    assert len(warned) == 1, [w.reason for w in warned]
    reason = warned[0].reason
    assert reason.startswith("paged_attention runs on the reference provider (gather + dense MLX ops: correct, slow)")
    assert "cast q to the cache dtype, float16, to use the kernels" in reason
    if metal_attn.current_device().backend == "cpu" and native.load() is not None:
        assert "classic: cache_dtype=float16 (supported on cpu: same as dtype=float32)" in reason
    # Forced on reference: the caller asked for it, nothing to warn about.
    mx.eval(metal_attn.paged_attention(**{**args, "q": _f32((3, 4, HEAD)) * 2}, provider="reference"))
    assert len(log_records("slow_fallback")) == 1


def test_a_backend_override_that_is_not_this_machine_s_says_where_calls_run(log_records) -> None:
    """METAL_ATTN_BACKEND_OVERRIDE=cuda on a CPU sent every call to the reference provider without a word
    (each kernel provider being "unavailable" on the pretended backend, the slow-fallback warning stayed quiet)."""
    from metal_attn.device import detect_backend

    other = next(b for b in ("cuda", "metal", "cpu") if b != detect_backend())
    args = _attention_args()
    with metal_attn.override_settings(backend_override=other):
        for _ in range(2):
            mx.eval(metal_attn.paged_attention(**args))
    warned = log_records("backend_override_call")
    assert len(warned) == 1
    assert warned[0].reason.startswith(f"METAL_ATTN_BACKEND_OVERRIDE={other} routes this call as on {other}, "
                                       f"but MLX computes on {detect_backend()} here: it ran on 'reference'")
    mx.eval(metal_attn.paged_attention(**args))  # no override: nothing more said
    assert len(log_records("backend_override_call")) == 1


@pytest.mark.parametrize("kwargs", [{"sliding_window": [8]}, {"sliding_window": np.array([8])},
                                    {"softcap": np.array([30.0])}])
def test_unhashable_features_get_the_argument_error(kwargs):
    md = AttentionMetadata.build([[0], [1]], [5, 7], [0, 1, 2])
    q = mx.zeros((2, 4, 64), mx.float16)
    k = mx.zeros((4, 16, 2, 64), mx.float16)
    name = next(iter(kwargs))
    with pytest.raises(InvalidInputError, match=name):
        metal_attn.paged_attention(q, k, k, metadata=md, **kwargs)


@pytest.mark.parametrize(("call", "message"), [
    # each raised AttributeError from deep inside (or explained 'str' has no 'backend' for every provider)
    (lambda: metal_attn.explain("not a request"), "request='not a request' (allowed: a metal_attn.AttentionRequest"),
    (lambda: metal_attn.explain(device=5), "device=5 (allowed: a metal_attn.DeviceInfo, a preset name"),
    (lambda: metal_attn.providers(5), "device=5 (allowed: a metal_attn.DeviceInfo"),
    (lambda: metal_attn.providers("h100"), "device preset 'h100' is unknown (known: cpu-2core, h200"),
    # a backend other than the device's: every provider, the reference too, refused it as a mismatch
    (lambda: metal_attn.explain(q_lens=[1], seq_lens=[4], backend="metal", device="h200"),
     "backend='metal' differs from the device's backend='cuda' (allowed: leave backend out, or pass device="),
    (lambda: metal_attn.explain(q_lens=[1], seq_lens=[4], provider=["classic"]),
     "provider=['classic'] (allowed: a provider name as a str"),
    (lambda: metal_attn.PagedKVCache(1, 4, 16, 1, 16, dtype=mx.float32).put_pools([1, 2]),
     "put_pools needs 2 mx.array pools of shape (4, 16, 1, 16) and dtype float32 (got 2: int, int)"),
])
def test_explain_providers_and_put_pools_name_a_wrong_argument(call, message) -> None:
    with pytest.raises(InvalidInputError) as info:
        call()
    assert message in str(info.value)


def _md() -> AttentionMetadata:
    return AttentionMetadata.build(np.array([[0, 1], [2, 3]], np.int32), np.array([3, 4], np.int32),
                                   np.array([0, 1, 2], np.int32))


@pytest.mark.parametrize(("call", "message"), [
    # IndexError, TypeError or AttributeError from inside, or a float accepted as a bound
    (lambda: _md().with_new_pages({0: (1,)}), "with_new_pages: row 0 -> (1,) (allowed: a row in 0..1 -> (a column"),
    (lambda: _md().with_new_pages({0: (0, 1.5)}), "with_new_pages: row 0 -> (0, 1.5)"),
    (lambda: _md().with_new_pages([1, 2]), "with_new_pages: pages=[1, 2] (allowed: a mapping"),
    (lambda: _md().next_decode_step(np.array([4, 5], np.int32), [4, 5]),
     "next_decode_step: seq_lens is an ndarray of int32 (2,) (allowed: an int32 mx.array of shape (2,))"),
    (lambda: AttentionMetadata.decode_bounds(mx.array([[0, 1]]), mx.array([3]), max_seq_len="10"),
     "max_seq_len='10' (allowed: an int in 1..2^31-1)"),
    (lambda: AttentionMetadata.decode_bounds(mx.array([[0, 1]]), mx.array([3]), max_seq_len=10.5),
     "max_seq_len=10.5 (allowed: an int in 1..2^31-1)"),
])
def test_metadata_step_helpers_name_a_wrong_argument(call, message) -> None:
    with pytest.raises(InvalidInputError) as info:
        call()
    assert message in str(info.value)


def test_metadata_values_past_int32_are_named() -> None:
    """One message named neither the array nor the entry; an unsigned 2**64 - 1 wrapped to -1 and was
    reported as seq_lens[0]=-1."""
    with pytest.raises(InvalidInputError, match=r"block_tables\[0\]\[1\]=1099511627776 \(allowed: values that fit "
                                                r"in int32"):
        AttentionMetadata.build([[0, 2**40]], [4], [0, 1])
    with pytest.raises(InvalidInputError, match=r"seq_lens\[1\]=18446744073709551615 \(allowed"):
        AttentionMetadata.build([[0], [1]], np.array([4, 2**64 - 1], dtype=np.uint64), [0, 1, 2])
    with pytest.raises(InvalidInputError, match=r"cu_seqlens_q\[1\]=2147483648 \(allowed"):
        AttentionMetadata.build([[0]], [4], [0, 2**31])


def test_metadata_keeps_its_own_view_of_the_callers_arrays():
    """`AttentionMetadata.build` kept the caller's arrays: an in-place update after the checks (an MLX
    ``bt[0, 0] = 2**30`` or a NumPy table edited in place) reached the kernels unchecked (NaN from classic,
    a segmentation fault from the reference provider)."""
    case = make_case(q_lens=[1, 1], seq_lens=[40, 70], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype="float32", seed=1)
    host = np.array(case.metadata().block_tables)
    bt, sl, cu = mx.array(host), mx.array([40, 70], dtype=mx.int32), mx.array([0, 1, 2], dtype=mx.int32)
    md = AttentionMetadata.build(bt, sl, cu)
    np_table = host.astype(np.int64)
    md_np = AttentionMetadata.build(np_table, [40, 70], [0, 1, 2])
    want = np.array(metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md))
    bt[0, 0] = 2**30
    sl[0] = 10**6
    np_table[0, 0] = 10**6
    assert md.block_tables is not bt and int(md.block_tables[0, 0]) == int(host[0, 0])
    assert not np.shares_memory(np_table, md_np._block_tables_host)
    for provider in ("classic", "reference"):
        got = np.array(metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md, provider=provider))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert int(md_np.with_new_pages({1: (0, 0)}).block_tables[0, 0]) == int(host[0, 0])


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("value", [np.float16(0), np.float16(-0.0), np.float16("nan")])
def test_float16_scalars_are_checked_as_numbers(name, value):
    """np.float16(0) passed the float32 range check (NumPy 2 cast the bound to float16's 0): a softcap of 0
    was silently no softcap, a scale of 0 failed inside the provider."""
    case = make_case(q_lens=[1], seq_lens=[20], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                     dtype="float32", seed=2)
    with pytest.raises(InvalidInputError, match=f"{name}="):
        metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=case.metadata(), **{name: value})


@pytest.mark.parametrize(("fields", "message"), [
    ({"sliding_window": -5}, r"sliding_window=-5 \(allowed: an int from 1"),
    ({"softcap": float("nan")}, r"softcap=nan \(allowed: a finite number > 0"),
    ({"softcap": 0}, r"softcap=0 \(allowed"),
    ({"softcap": "x"}, r"softcap='x' \(allowed"),
    ({"sinks": "no"}, r"sinks='no' \(allowed: True or False"),
    ({"dtype": "int8"}, r"dtype='int8' \(allowed: float16, bfloat16, float32\)"),
    ({"q_lens": [1.7], "seq_lens": [1.2]}, r"q_lens holds 1.7 \(allowed: a list, tuple or 1-D array of ints"),
    ({"q_lens": None}, r"q_lens=None \(allowed: a list, tuple or 1-D array of ints, in order\)"),
    ({"q_lens": [1, 1], "seq_lens": {4, 9}}, r"seq_lens=\{9, 4\} \(allowed"),  # paired with q_lens in no order
    ({"seq_len": [4]}, r"explain: unknown field\(s\) seq_len \(allowed: q_lens, seq_lens"),
])
def test_explain_refuses_what_paged_attention_refuses(fields, message):
    """explain() accepted values paged_attention refuses and still reported a choice (sliding_window=-5,
    softcap=nan or 0, sinks='no', dtype='int8'), truncated float lengths, and crashed printing softcap='x'."""
    kw = {"q_lens": [1], "seq_lens": [4], "num_heads": 4, "num_kv_heads": 2, "head_size": 64} | fields
    with pytest.raises(InvalidInputError, match=message):
        metal_attn.explain(**kw)


def test_metadata_switches_and_host_lengths_are_checked():
    """build(validate="no") read as on; next_decode_step truncated float host lengths (6.9 -> 6)."""
    with pytest.raises(InvalidInputError, match=r"validate='no' \(allowed: True, False, or None"):
        AttentionMetadata.build([[0]], [5], [0, 1], validate="no")
    md = AttentionMetadata.build([[0]], [5], [0, 1])
    with pytest.raises(InvalidInputError, match=r"next_decode_step: seq_lens_host=\[5.9\] \(allowed: ints"):
        md.next_decode_step(mx.array([6], dtype=mx.int32), [5.9])
    assert md.next_decode_step(mx.array([6], dtype=mx.int32), [6]).seq_lens_host == (6,)


@pytest.mark.parametrize(("kw", "message"), [
    ({"num_kv_heads": 0}, r"num_kv_heads=0 \(allowed: an int >= 1\)"),
    ({"head_size": -4}, r"head_size=-4 \(allowed: an int >= 1\)"),
    ({"block_size": 0}, r"block_size=0"),
    ({"num_heads": 0}, r"num_heads=0"),
    ({"shared_prefix_blocks": -1}, r"shared_prefix_blocks=-1 \(allowed: an int >= 0\)"),
    ({"scale": float("nan")}, r"scale=nan \(allowed: a finite number > 0"),
    ({"q_lens": [1.5, 3], "seq_lens": [4, 4]}, r"q_lens=\[1.5, 3\] \(allowed: ints"),
])
def test_make_case_names_a_bad_argument(kw, message):
    """make_case (the conformance suite's case builder, for provider authors too) raised ZeroDivisionError,
    a complex-number TypeError or a broadcast error, or accepted num_heads=0, scale=nan and float lengths."""
    args = {"q_lens": [1], "seq_lens": [4], "num_heads": 2, "num_kv_heads": 1, "head_size": 8, "block_size": 16} | kw
    with pytest.raises(ValueError, match=message):
        make_case(**args)


def test_an_empty_provider_name_is_refused():
    """provider="" was read as None (the registry's choice)."""
    case = make_case(q_lens=[1], seq_lens=[20], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                     dtype="float32", seed=3)
    with pytest.raises(InvalidInputError, match=r"provider='' \(allowed: a provider name as a str"):
        metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=case.metadata(), provider="")
    with pytest.raises(InvalidInputError, match=r"provider='' \(allowed: a provider name as a str"):
        metal_attn.explain(q_lens=[1], seq_lens=[4], provider="")


def test_explain_reads_block_size_as_the_pool_s_page_as_a_real_call_does():
    """explain(block_size=64) judged a block size no call uses: a call on 64-token pages runs kernel blocks of 32."""
    assert metal_attn.explain(q_lens=[1], seq_lens=[100], block_size=64).request.block_size == 32
    assert metal_attn.explain(q_lens=[1], seq_lens=[100], block_size=24).request.block_size == 8
    case = make_case(q_lens=[1], seq_lens=[100], num_heads=4, num_kv_heads=2, head_size=64, block_size=64,
                     dtype="float32", seed=4)
    metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=case.metadata())
    chosen = metal_attn.explain(q_lens=[1], seq_lens=[100], num_heads=4, num_kv_heads=2, head_size=64, block_size=64,
                                dtype="float32").chosen
    assert chosen.name == metal_attn.diagnostics.last_dispatch().provider
