"""The float64 oracle against a brute-force formulation and hand-computed cases,
and the case builder's promises (garbage placement, tables, exact host copies)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from metal_attn.testing import AttentionCase, attention_oracle, make_case
from metal_attn.testing import oracle as oracle_module
from metal_attn.testing.cases import GARBAGE_KEY, round_to_dtype, to_numpy
from metal_attn.testing.conformance import NONFINITE_SPECS


def brute_force(q, kc, vc, tables, seq_lens, cu, *, scale, sinks=None, sliding_window=None, softcap=None):
    """Per row, per head, per KV position: the textbook softmax with Python floats."""
    total, num_heads, head_size = q.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((total, num_heads, head_size))
    for seq, seq_len in enumerate(seq_lens):
        q_len = int(cu[seq + 1] - cu[seq])
        for i in range(q_len):
            row = int(cu[seq]) + i
            end = int(seq_len) - q_len + i + 1
            begin = 0 if sliding_window is None else max(0, end - sliding_window)
            for h in range(num_heads):
                kvh = h // group
                logits, values = [], []
                for pos in range(begin, end):
                    blk, off = int(tables[seq][pos // block_size]), pos % block_size
                    s = scale * math.fsum(float(a) * float(b) for a, b in zip(q[row, h], kc[blk, off, kvh]))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                    values.append(vc[blk, off, kvh].astype(np.float64))
                top = max(logits + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(s - top) for s in logits]
                denom = math.fsum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                out[row, h] = sum(w * v for w, v in zip(weights, values)) / denom
    return out


def _oracle_args(case: AttentionCase) -> tuple[tuple, dict]:
    h = case.host
    args = (h["q"], h["k_cache"], h["v_cache"], case.block_tables, case.seq_lens, case.cu_seqlens_q)
    kw = dict(scale=case.scale, sinks=h["sinks"], sliding_window=case.sliding_window, softcap=case.softcap)
    return args, kw


BRUTE_CASES = {
    "decode": dict(q_lens=[1, 1, 1], seq_lens=[1, 9, 17], num_heads=4, num_kv_heads=2, head_size=8, block_size=8),
    "prefill": dict(q_lens=[9], seq_lens=[9], num_heads=2, num_kv_heads=1, head_size=8, block_size=8),
    "continuation": dict(q_lens=[3, 5], seq_lens=[20, 5], num_heads=4, num_kv_heads=4, head_size=8, block_size=8),
    "gqa4-mixed": dict(q_lens=[1, 4], seq_lens=[12, 7], num_heads=8, num_kv_heads=2, head_size=4, block_size=8),
    "sinks": dict(q_lens=[1, 3], seq_lens=[6, 10], num_heads=4, num_kv_heads=2, head_size=8, block_size=8,
                  sinks=True),
    "window": dict(q_lens=[1, 6], seq_lens=[30, 14], num_heads=2, num_kv_heads=1, head_size=8, block_size=8,
                   sliding_window=5),
    "softcap": dict(q_lens=[2, 1], seq_lens=[11, 3], num_heads=2, num_kv_heads=2, head_size=8, block_size=8,
                    softcap=0.7, scale=1.3),
    "everything": dict(q_lens=[1, 1, 5], seq_lens=[19, 2, 25], num_heads=6, num_kv_heads=3, head_size=8,
                       block_size=8, sinks=True, sliding_window=7, softcap=2.0, shared_prefix_blocks=1),
    "bfloat16": dict(q_lens=[1, 4], seq_lens=[10, 9], num_heads=2, num_kv_heads=1, head_size=8, block_size=8,
                     dtype="bfloat16"),
}


@pytest.mark.parametrize("name", sorted(BRUTE_CASES))
def test_oracle_matches_brute_force(name: str) -> None:
    case = make_case(**BRUTE_CASES[name], seed=7)
    args, kw = _oracle_args(case)
    got = attention_oracle(*args, **kw)
    want = brute_force(*args, **kw)
    assert got.dtype == np.float64 and got.shape == case.q.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_oracle_chunked_rows_equal_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long prefills are computed in row chunks; chunking must not change the result."""
    case = make_case(q_lens=[40, 33], seq_lens=[90, 33], num_heads=4, num_kv_heads=2, head_size=16,
                     block_size=16, sliding_window=20, sinks=True, seed=3)
    args, kw = _oracle_args(case)
    whole = attention_oracle(*args, **kw)
    monkeypatch.setattr(oracle_module, "_MAX_SCORE_ELEMENTS", 4 * 90 * 3)  # 3 rows at a time
    chunked = attention_oracle(*args, **kw)
    np.testing.assert_allclose(chunked, whole, rtol=1e-13, atol=1e-13)


# -- hand-computed cases ------------------------------------------------------------------------


def _pool(values: np.ndarray, block_size: int) -> np.ndarray:
    """[tokens, kv_heads, d] -> a contiguous pool [blocks, block_size, kv_heads, d] (zero-padded)."""
    n = -(-values.shape[0] // block_size)
    pool = np.zeros((n * block_size, *values.shape[1:]))
    pool[: values.shape[0]] = values
    return pool.reshape(n, block_size, *values.shape[1:])


def _single(q, k, v, *, q_len=None, block_size=4, **kw):
    """One sequence of ``len(k)`` tokens laid out contiguously."""
    seq_len = k.shape[0]
    q_len = q.shape[0] if q_len is None else q_len
    kc, vc = _pool(k, block_size), _pool(v, block_size)
    table = np.arange(kc.shape[0], dtype=np.int32)[None]
    kw.setdefault("scale", 1.0)
    return attention_oracle(q, kc, vc, table, np.array([seq_len]), np.array([0, q_len]), **kw)


def test_one_token_returns_its_value() -> None:
    rng = np.random.default_rng(0)
    v = rng.standard_normal((1, 1, 4))
    out = _single(rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 1, 4)), v)
    np.testing.assert_array_equal(out[0, 0], v[0, 0])
    np.testing.assert_array_equal(out[0, 1], v[0, 0])


def test_sink_takes_its_share_of_the_weight() -> None:
    """q = 0: the token's logit is 0; a sink of ln 3 takes 3/4 of the weight and adds no value."""
    v = np.full((1, 1, 2), 8.0)
    out = _single(np.zeros((1, 1, 2)), np.ones((1, 1, 2)), v, sinks=np.array([math.log(3.0)]))
    np.testing.assert_allclose(out[0, 0], [2.0, 2.0], rtol=1e-15)


def test_sink_is_counted_once_per_row() -> None:
    """8 equal tokens of value 1 and sink s: 8 / (8 + e^s) (counting it once per 8-lane group would give
    8 / (8 + 8 e^s), the upstream bug)."""
    s = 1.5
    out = _single(np.zeros((1, 1, 1)), np.zeros((8, 1, 1)), np.ones((8, 1, 1)), sinks=np.array([s]))
    assert out[0, 0, 0] == pytest.approx(8.0 / (8.0 + math.exp(s)), rel=1e-14)


def test_window_of_one_returns_each_rows_own_value() -> None:
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((10, 1, 4)), rng.standard_normal((10, 1, 4))
    out = _single(rng.standard_normal((4, 1, 4)), k, v, sliding_window=1)  # rows at positions 6..9
    np.testing.assert_array_equal(out[:, 0], v[6:10, 0])


def test_causal_rule_for_a_continuation_chunk() -> None:
    """q = 0 gives uniform weights: row i of a 2-row chunk over 5 tokens averages v[0 .. 3 + i]."""
    v = np.arange(5.0).reshape(5, 1, 1)
    out = _single(np.zeros((2, 1, 1)), np.zeros((5, 1, 1)), v)
    np.testing.assert_allclose(out[:, 0, 0], [np.mean([0, 1, 2, 3]), np.mean([0, 1, 2, 3, 4])], rtol=1e-15)


def test_window_averages_the_last_w_positions() -> None:
    v = np.arange(12.0).reshape(12, 1, 1)
    out = _single(np.zeros((1, 1, 1)), np.zeros((12, 1, 1)), v, sliding_window=3)
    assert out[0, 0, 0] == pytest.approx(np.mean([9.0, 10.0, 11.0]), rel=1e-15)


def test_softcap_bounds_the_scores() -> None:
    """Scores 100 and 0 capped at c=1 become tanh(100) and 0: weights e^tanh(100) : 1."""
    k = np.array([[[100.0]], [[0.0]]])
    v = np.array([[[1.0]], [[0.0]]])
    out = _single(np.ones((1, 1, 1)), k, v, softcap=1.0)
    e = math.exp(math.tanh(100.0))
    assert out[0, 0, 0] == pytest.approx(e / (e + 1.0), rel=1e-14)


def test_scale_multiplies_the_scores() -> None:
    k = np.array([[[1.0]], [[0.0]]])
    v = np.array([[[1.0]], [[0.0]]])
    out = _single(np.ones((1, 1, 1)), k, v, scale=math.log(3.0))
    assert out[0, 0, 0] == pytest.approx(0.75, rel=1e-14)


def test_gqa_head_h_reads_kv_head_h_over_group() -> None:
    v = np.array([[[1.0], [2.0]]])  # one token, kv heads valued 1 and 2
    out = _single(np.zeros((1, 4, 1)), np.zeros((1, 2, 1)), v)
    np.testing.assert_array_equal(out[0, :, 0], [1.0, 1.0, 2.0, 2.0])


def test_pages_are_read_through_the_block_table() -> None:
    """Scattered pages give the same result as the same tokens laid out contiguously."""
    case = make_case(q_lens=[3, 1], seq_lens=[21, 13], num_heads=2, num_kv_heads=1, head_size=8, block_size=8,
                     seed=5)
    args, kw = _oracle_args(case)
    scattered = attention_oracle(*args, **kw)
    h = case.host
    for seq, (seq_len, q0) in enumerate(zip(case.seq_lens, case.cu_seqlens_q[:-1], strict=True)):
        n = -(-int(seq_len) // 8)
        k = h["k_cache"][case.block_tables[seq, :n]].reshape(-1, 1, 8)[:seq_len]
        v = h["v_cache"][case.block_tables[seq, :n]].reshape(-1, 1, 8)[:seq_len]
        q_len = int(case.cu_seqlens_q[seq + 1] - q0)
        dense = _single(h["q"][q0 : q0 + q_len], k, v, block_size=8, scale=case.scale)
        np.testing.assert_allclose(scattered[q0 : q0 + q_len], dense, rtol=1e-14, atol=1e-14)


def test_oracle_rejects_bad_inputs() -> None:
    q = np.zeros((2, 2, 4))
    kc = np.zeros((2, 4, 1, 4))
    with pytest.raises(ValueError, match=r"q_len=2, seq_len=1"):
        attention_oracle(q, kc, kc, np.zeros((1, 1), np.int32), np.array([1]), np.array([0, 2]), scale=1.0)
    with pytest.raises(ValueError, match=r"positions up to 9 need 3"):
        attention_oracle(q, kc, kc, np.zeros((1, 2), np.int32), np.array([9]), np.array([0, 2]), scale=1.0)
    with pytest.raises(ValueError, match=r"out of range for a pool of 2 blocks"):
        attention_oracle(q, kc, kc, np.array([[5]], np.int32), np.array([3]), np.array([0, 2]), scale=1.0)
    with pytest.raises(TypeError, match="convert bfloat16 through float32"):
        attention_oracle(q.astype(object), kc, kc, np.zeros((1, 1), np.int32), np.array([2]), np.array([0, 2]),
                         scale=1.0)


# -- the case builder ------------------------------------------------------------------------------


def test_case_tables_are_scattered_and_padding_points_at_garbage() -> None:
    case = make_case(q_lens=[1, 1, 4], seq_lens=[33, 100, 4], num_heads=4, num_kv_heads=2, head_size=16,
                     block_size=16, seed=11)
    tables, lens = case.block_tables, case.seq_lens
    needed = [-(-int(s) // 16) for s in lens]
    used = np.concatenate([tables[i, :n] for i, n in enumerate(needed)])
    assert tables.dtype == np.int32 and case.seq_lens.dtype == np.int32 and case.cu_seqlens_q.dtype == np.int32
    assert tables.shape == (3, max(needed) + 1)
    assert len(set(used.tolist())) == used.size, "each block belongs to one sequence"
    assert 0 not in used, "block 0 is reserved for garbage so that 0-padding is detectable"
    assert not np.array_equal(np.sort(used), used), "tables are not in pool order"
    for i, n in enumerate(needed):
        assert (tables[i, n:] == 0).all()
    v = case.host["v_cache"]
    k = case.host["k_cache"]
    assert np.isnan(v[0]).all() and (k[0] == GARBAGE_KEY).all()
    spare = sorted(set(range(v.shape[0])) - set(used.tolist()))
    assert spare and all(np.isnan(v[b]).all() for b in spare)
    # the unused slots of each sequence's last page are garbage; the used ones are data
    last = tables[0, needed[0] - 1]
    assert np.isfinite(v[last, :1]).all() and np.isnan(v[last, 1:]).all()


def test_case_shared_prefix_and_contiguous_tables() -> None:
    shared = make_case(q_lens=[1, 1, 1], seq_lens=[40, 50, 33], num_heads=2, num_kv_heads=1, head_size=8,
                       block_size=16, shared_prefix_blocks=2, seed=2)
    t = shared.block_tables
    assert (t[:, :2] == t[0, :2]).all()
    assert len({*t[0, 2:3], *t[1, 2:4], *t[2, 2:3]}) == 4
    simple = make_case(q_lens=[1, 8], seq_lens=[30, 8], num_heads=2, num_kv_heads=1, head_size=8,
                       block_size=16, contiguous=True)
    assert simple.block_tables.tolist() == [[0, 1], [2, 0]]
    assert simple.k_cache.shape[0] == 3


def test_case_host_copies_are_the_mlx_values() -> None:
    for dtype in ("float32", "float16", "bfloat16"):
        case = make_case(q_lens=[2, 1], seq_lens=[20, 5], num_heads=4, num_kv_heads=2, head_size=8,
                         block_size=8, dtype=dtype, sinks=True, seed=4)
        assert case.dtype == dtype
        np.testing.assert_array_equal(to_numpy(case.q), case.host["q"])
        np.testing.assert_array_equal(to_numpy(case.k_cache), case.host["k_cache"])
        np.testing.assert_array_equal(to_numpy(case.v_cache), case.host["v_cache"])  # NaNs compare equal
        assert case.sinks is not None and case.sinks.dtype == mx.float32
        # a case built by hand (no host copies) computes the same oracle from its MLX arrays
        bare = AttentionCase(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                             case.cu_seqlens_q, case.scale, case.sinks)
        np.testing.assert_array_equal(bare.oracle(), case.oracle())


def test_round_to_bfloat16_matches_mlx() -> None:
    x = np.random.default_rng(9).standard_normal(4096, dtype=np.float32) * 100
    x[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38]  # ties to even, and a large value
    mine = round_to_dtype(x, "bfloat16")
    theirs = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(mine, theirs)


def test_score_bias_shifts_every_score() -> None:
    case = make_case(q_lens=[1], seq_lens=[40], num_heads=2, num_kv_heads=1, head_size=16, block_size=16,
                     score_bias=-120.0, seed=8)
    h = case.host
    n = 3
    k = h["k_cache"][case.block_tables[0, :n]].reshape(-1, 1, 16)[:40]
    scores = case.scale * np.einsum("hd,nd->hn", h["q"][0].astype(np.float64), k[:, 0].astype(np.float64))
    assert scores.max() < -110 and scores.min() > -130


def test_make_case_rejects_bad_arguments() -> None:
    base = dict(num_heads=4, num_kv_heads=2, head_size=8, block_size=8)
    with pytest.raises(ValueError, match=r"\(q_len, seq_len\) pairs \[\(5, 3\)\]"):
        make_case(q_lens=[5], seq_lens=[3], **base)
    with pytest.raises(ValueError, match="num_blocks=2 is too small"):
        make_case(q_lens=[1], seq_lens=[30], num_blocks=2, **base)
    with pytest.raises(ValueError, match="dtype='int8'"):
        make_case(q_lens=[1], seq_lens=[3], dtype="int8", **base)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        make_case(q_lens=[1], seq_lens=[3], **{**base, "num_heads": 3})


# -- the non-finite contract ------------------------------------------------------------------------


def _reached_pairs(spec: dict, case: AttentionCase) -> set[tuple[int, int]]:
    """(token, head) pairs a spec's poison reaches, by brute force: a poisoned q vector, or a
    poisoned K/V slot inside a row's attended range (any sequence whose table maps to that slot)."""
    bs, group = spec["block_size"], spec["num_heads"] // spec["num_kv_heads"]
    cu = case.cu_seqlens_q
    window = spec.get("sliding_window")
    out: set[tuple[int, int]] = set()
    for what, seq, index, head, _ in spec["poison"]:
        if what == "q":
            out.add((int(cu[seq]) + index, head))
            continue
        slot = int(case.block_tables[seq][index // bs]) * bs + index % bs
        for s2, n in enumerate(case.seq_lens.tolist()):
            q_len = int(cu[s2 + 1] - cu[s2])
            for i in range(q_len):
                end = n - q_len + i + 1
                begin = 0 if window is None else max(0, end - window)
                slots = {int(case.block_tables[s2][p // bs]) * bs + p % bs for p in range(begin, end)}
                if slot in slots:
                    out |= {(int(cu[s2]) + i, h) for h in range(head * group, (head + 1) * group)}
    return out


@pytest.mark.parametrize("spec", NONFINITE_SPECS, ids=[s["label"] for s in NONFINITE_SPECS])
def test_oracle_poisons_exactly_the_pairs_a_nonfinite_input_reaches(spec: dict) -> None:
    """Poisoned pairs are NaN in every element; every other pair equals the clean case's output bit for
    bit (a NaN the row does not attend to changes nothing), and there are some of both."""
    case = make_case(**spec)
    clean = make_case(**{**spec, "poison": ()})
    got, want = case.oracle(), clean.oracle()
    reached = _reached_pairs(spec, case)
    bad = {(int(t), int(h)) for t, h in np.argwhere(np.isnan(got).any(axis=-1))}
    assert bad == reached
    assert reached and len(reached) < got.shape[0] * got.shape[1]
    for t, h in reached:
        assert np.isnan(got[t, h]).all()
    keep = np.ones(got.shape[:2], dtype=bool)
    for t, h in reached:
        keep[t, h] = False
    np.testing.assert_array_equal(got[keep], want[keep])


def test_oracle_nonfinite_corners_that_float64_alone_would_hide() -> None:
    """A key scored -inf, a softcapped infinite score and a sink next to an infinite query are all
    poisoned, although plain float64 arithmetic would keep those rows finite."""
    q = np.ones((1, 1, 4))
    k = np.ones((2, 1, 4))
    v = np.arange(8, dtype=np.float64).reshape(2, 1, 4)
    k_neg = k.copy()
    k_neg[1, 0, 0] = -np.inf  # score -inf: exp gives weight 0, the row would stay finite
    assert np.isnan(_single(q, k_neg, v)).all()
    assert np.isnan(_single(q, k_neg, v, softcap=2.0)).all()  # c*tanh(-inf/c) = -c, finite
    q_inf = q.copy()
    q_inf[0, 0, 1] = -np.inf
    assert np.isnan(_single(q_inf, k, v, sinks=np.array([5.0]))).all()
    v_bad = v.copy()
    v_bad[0, 0, 3] = np.nan
    assert np.isnan(_single(q, k, v_bad)).all()


def test_the_documented_tolerances_are_the_code_s() -> None:
    """Every numeric test is held to `TOLERANCES`; loosening one 10x went unnoticed by the whole suite. The
    bounds are a documented contract (docs/providers.md, "Testing a provider"): code and table agree."""
    from pathlib import Path

    from metal_attn.testing.conformance import TOLERANCES

    text = (Path(__file__).resolve().parent.parent / "docs" / "providers.md").read_text()
    table = text.split("<!-- tolerances:start -->")[1].split("<!-- tolerances:end -->")[0]
    rows = [line.strip("|").split("|") for line in table.strip().splitlines()[2:]]
    documented = {cells[0].strip(): tuple(float(c) for c in cells[1:]) for cells in rows}
    assert documented == {name: tuple(tol) for name, tol in TOLERANCES.items()}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_checker_holds_the_elementwise_bound_exactly(dtype: str) -> None:
    """Half the bound passes; one and a half times it fails (one element out of many, so the L2 bound alone
    would not catch it)."""
    from metal_attn.testing.conformance import TOLERANCES, assert_close_to_oracle

    tol = TOLERANCES[dtype]
    ref = np.random.default_rng(0).standard_normal((64, 4, 32))
    bound = tol.atol + tol.rtol * abs(ref[3, 1, 5])
    near, far = ref.copy(), ref.copy()
    near[3, 1, 5] += 0.5 * bound
    far[3, 1, 5] += 1.5 * bound
    assert_close_to_oracle(near, ref, dtype)
    with pytest.raises(AssertionError, match="elements"):
        assert_close_to_oracle(far, ref, dtype)
