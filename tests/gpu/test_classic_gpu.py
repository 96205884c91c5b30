"""The ``classic`` provider on a GPU backend against the float64 oracle.

Covers every dtype, head size and kernel block size; GQA ratios 1, 2, 4, 6, 8
and MQA; sinks, sliding windows (in-window scores far below zero, partitions
entirely outside the window), softcap; lengths at page and partition edges;
pure decode, mixed batches, prefill chunks with earlier context; scattered and
shared blocks; every route (``per_token_ps0``, ``per_token_ps512`` and the smallest
partitions ``per_token_ps64``, chosen through the occupancy gate by overriding the GPU core
count and the partition size: `metal_attn.testing.overrides.forced_per_token_route`); bitwise repeats.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn import diagnostics
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.overrides import (
    PER_TOKEN_TEST_ROUTES,
    expected_route,
    forced_per_token_route,
    partition_size_of,
)

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16", "float32")
HEADS = (64, 80, 96, 112, 128, 192, 256)
BLOCKS = (8, 16, 32)
ROUTES = PER_TOKEN_TEST_ROUTES


def _check(case, route: str) -> np.ndarray:
    with forced_per_token_route(route):
        got = run_case(case, provider="classic")
        rec = diagnostics.last_dispatch()
    assert rec is not None and rec.provider == "classic", rec
    expect = expected_route(route, case.seq_lens)
    assert rec.route == expect, f"{case.label}: route {rec.route} (expected {expect})"
    assert rec.partition_size == partition_size_of(expect)
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=f"{case.label} {rec.route}")
    return got


def test_smoke_decode_both_routes():
    case = make_case(q_lens=[1, 1], seq_lens=[17, 1000], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="float16", seed=1, label="smoke")
    for route in ROUTES:
        _check(case, route)


# Every (dtype, head size) pair, the block size cycling so that each block size meets every dtype;
# a mixed batch: decode rows at page/partition edges, then a prefill chunk with earlier context.
_MATRIX = [(d, h, BLOCKS[(i + j) % 3]) for j, d in enumerate(DTYPES) for i, h in enumerate(HEADS)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("dtype", "head", "block"), _MATRIX, ids=[f"{d}-h{h}-b{b}" for d, h, b in _MATRIX])
def test_dtype_head_block_matrix(dtype, head, block, route):
    case = make_case(q_lens=[1, 1, 1, 1, 7], seq_lens=[1, 16, 513, 1100, 530], num_heads=4, num_kv_heads=2,
                     head_size=head, block_size=block, dtype=dtype, seed=head + block,
                     label=f"{dtype} h{head} b{block}")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_lengths_at_page_and_partition_edges(dtype, route):
    lens = [1, 15, 16, 17, 511, 512, 513, 4095, 4097]
    case = make_case(q_lens=[1] * len(lens), seq_lens=lens, num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, seed=7, label=f"edges {dtype}")
    _check(case, route)


#: Geometry and prefetch variants a table may ship: ((lanes per token, unroll, heads per threadgroup,
#: heads per simdgroup, staged chunk tokens, stages[, matrix path, threads[, row padding]]), PREFETCH); direct loads
#: then staged chunks
#: (one chunk a partition, several, a chunk longer than the shortest rows).
_TUNINGS = [((8, 1, 2), 1), ((8, 2, 2), 1), ((8, 1, 2), 0), ((16, 1, 2), 1), ((16, 2, 4), 1), ((4, 1, 1), 1),
            ((32, 2, 2), 1), ((8, 2, 1), 0), ((8, 1, 4, 1, 32, 2), 0), ((8, 1, 4, 1, 16, 3), 0),
            ((8, 2, 4, 2, 32, 2), 0), ((8, 1, 2, 1, 16, 2), 0), ((16, 1, 1, 1, 8, 4), 0), ((4, 1, 4, 2, 32, 2), 0),
            # the matrix path ((..., mma, threads)): 128 and 64 threads, every head of the group or fewer
            ((8, 1, 4, 4, 32, 2, 1, 128), 0), ((8, 1, 2, 2, 32, 2, 1, 128), 0), ((8, 1, 4, 4, 16, 2, 1, 64), 0),
            ((8, 1, 1, 1, 16, 4, 1, 64), 0),
            # the matrix path's rows padded by 32 bytes (METAL_ATTN_MMA_STAGE_PAD=32), and 48
            ((8, 1, 4, 4, 32, 2, 1, 128, 32), 0), ((8, 1, 4, 4, 16, 2, 1, 64, 48), 0),
            # its rows unpadded and swizzled (METAL_ATTN_MMA_STAGE_SWIZZLE, CUDA's default)
            ((8, 1, 4, 4, 32, 2, 1, 128, 16, 1), 0), ((8, 1, 2, 2, 32, 2, 1, 128, 16, 1), 0),
            ((8, 1, 4, 4, 16, 2, 1, 64, 16, 1), 0),
            # the keys as rows (METAL_ATTN_MMA_KEY_ROWS, CUDA only): chunks of 32 on 64 threads, the group's 4
            # heads or 2 of them
            ((8, 1, 4, 4, 32, 2, 2, 64, 16, 1), 0), ((8, 1, 2, 2, 32, 2, 2, 64, 16, 1), 0)]


def _tuning_id(t) -> str:
    return "geo{}-prefetch{}".format("-".join(map(str, t[0])), t[1])


@pytest.mark.parametrize("partition_size", (0, 512, 64), ids=("ps0", "ps512", "ps64"))
@pytest.mark.parametrize("tuning", _TUNINGS, ids=_tuning_id)
def test_every_tuning_matches_oracle(tuning, partition_size):
    """Each geometry/prefetch variant (bare launch) against the oracle: a window, a sink-free mixed batch,
    rows shorter than a simdgroup's first step (idle simdgroups must merge as empty states)."""
    from metal_attn.providers import gpu_common as gc

    case = make_case(q_lens=[1, 1, 1, 1, 5], seq_lens=[1, 3, 17, 1100, 530], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", seed=sum(tuning[0]), sliding_window=700,
                     label=f"tuning {tuning}")
    md = case.metadata()
    backend = metal_attn.current_device().backend
    geo = gc.Geometry(*tuning[0])
    problem = gc.geometry_problem(geo, 128, 4, 2, backend)
    if problem and backend != "cuda":  # the table is CUDA's: on CUDA every variant must launch
        pytest.skip(f"{geo} is not a {backend} geometry: {problem}")
    out = gc.launch_paged(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=None,
                          sliding_window=700, softcap=None, partition_size=partition_size, backend=backend,
                          geometry_override=geo, prefetch=tuning[1])
    assert_close_to_oracle(out, case.oracle(), "bfloat16", label=f"{case.label} partitions of {partition_size}")


@pytest.mark.parametrize("swizzle", (True, False), ids=("swizzled", "padded"))
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("dtype", "head", "group"), [("bfloat16", 128, 4), ("float16", 128, 8), ("bfloat16", 256, 4),
                                                     ("float16", 256, 8)])
def test_matrix_row_layouts_match_oracle(dtype, head, group, route, swizzle):
    """``METAL_ATTN_MMA_STAGE_SWIZZLE`` on (CUDA's default) and off (the padded rows, Metal's layout)
    through the public call, on the head sizes and groups the matrix path takes on CUDA (128 and 256;
    4 and 8), with sinks and a window (on Metal the geometry refuses the swizzle and its own rows run)."""
    from metal_attn.providers import gpu_common as gc

    from metal_attn.settings import override_settings

    case = make_case(q_lens=[1, 1, 1, 1, 7], seq_lens=[1, 16, 513, 1100, 530], num_heads=2 * group, num_kv_heads=2,
                     head_size=head, block_size=16, dtype=dtype, seed=head + group, sinks=True, sliding_window=600,
                     label=f"{'swizzled' if swizzle else 'padded'} {dtype} h{head} g{group}")
    backend = metal_attn.current_device().backend
    with override_settings(mma_stage_swizzle=swizzle, mma_key_rows=False):  # the heads-as-rows path's layouts
        _check(case, route)
        psize = diagnostics.last_dispatch().partition_size
        geo = gc.launch_geometry(case.q, case.k_cache, case.metadata(), partition_size=psize, backend=backend)
    assert (geo.mma, geo.swizzle) == (1, int(swizzle)) if backend == "cuda" else geo.swizzle == 0, geo


@pytest.mark.parametrize("features", ("plain", "sinks+window", "softcap"))
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("dtype", "group"), [("bfloat16", 4), ("float16", 4), ("bfloat16", 6), ("float16", 8),
                                              ("bfloat16", 8)])
def test_key_rows_path_matches_oracle(dtype, group, route, features):
    """``METAL_ATTN_MMA_KEY_ROWS=1`` (the keys as the rows of 16x8 tensor-core products, CUDA) through the
    public call at head 128, groups of 4, 6 (two masked head columns) and 8: rows shorter than one
    simdgroup step and than the first chunk, rows ending inside a 16-key block, a chunk of 7 query rows,
    with sinks and a window or a softcap. The batch is a small grid on the H200 at every forced route
    (under 6 threadgroups a core), so on CUDA the launch must take the path; elsewhere the geometry
    refuses it and the test checks the fallback's output."""
    from metal_attn.providers import gpu_common as gc

    from metal_attn.settings import override_settings

    sinks = features == "sinks+window"
    case = make_case(q_lens=[1, 1, 1, 1, 1, 7], seq_lens=[1, 9, 40, 1100, 1500, 530], num_heads=2 * group,
                     num_kv_heads=2, head_size=128, block_size=16, dtype=dtype, seed=group * 7 + len(features),
                     sinks=sinks, sliding_window=600 if sinks else None,
                     softcap=30.0 if features == "softcap" else None, label=f"key rows {dtype} g{group} {features}")
    backend = metal_attn.current_device().backend
    with override_settings(mma_key_rows=True):
        _check(case, route)
        psize = diagnostics.last_dispatch().partition_size
        geo = gc.launch_geometry(case.q, case.k_cache, case.metadata(), partition_size=psize, backend=backend)
    assert geo.mma == 2 if backend == "cuda" else geo.mma != 2, geo


@pytest.mark.parametrize("partition_size", (192, 384, 768, 1024, 1536, 2048, 3072, 4096))
@pytest.mark.parametrize("features", ("plain", "sinks+window"))
def test_long_partitions_match_oracle(partition_size, features):
    """The partition sizes above 512 and those between powers of two, forced, against
    the oracle: rows ending inside, at and one past a partition's edge, a row shorter than one
    partition, a chunk, and windows that leave whole partitions out."""
    from metal_attn.providers import gpu_common as gc

    window = 1500 if features != "plain" else None
    case = make_case(q_lens=[1, 1, 1, 1, 3], seq_lens=[9000, 4096, 4097, 700, 2050], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", seed=partition_size // 64,
                     sinks=features != "plain", sliding_window=window, label=f"partitions of {partition_size}")
    md = case.metadata()
    out = gc.launch_paged(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=case.sinks,
                          sliding_window=window, softcap=None, partition_size=partition_size,
                          backend=metal_attn.current_device().backend)
    assert_close_to_oracle(out, case.oracle(), "bfloat16", label=case.label)


@pytest.mark.parametrize("route", ROUTES)
def test_very_long_context(route):
    case = make_case(q_lens=[1, 1], seq_lens=[33000, 4097], num_heads=4, num_kv_heads=1, head_size=128,
                     block_size=32, dtype="bfloat16", seed=3, label="33000")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (12, 2), (16, 2), (8, 1)],
                         ids=["gqa1", "gqa2", "gqa4", "gqa6", "gqa8", "mqa"])
def test_gqa_ratios(num_heads, num_kv_heads, route):
    case = make_case(q_lens=[1, 1, 5], seq_lens=[700, 33, 1030], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=128, block_size=16, dtype="float16", seed=num_heads * 10 + num_kv_heads,
                     label=f"gqa {num_heads}/{num_kv_heads}")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_with_earlier_context(dtype, route):
    # Two prefill chunks after earlier context plus a fresh prompt (no earlier context).
    case = make_case(q_lens=[33, 64, 20], seq_lens=[600, 1100, 20], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=32, dtype=dtype, seed=11, label=f"prefill {dtype}")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_sinks(dtype, route):
    case = make_case(q_lens=[1, 1, 9], seq_lens=[5, 1500, 700], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, sinks=True, seed=5, label=f"sinks {dtype}")
    _check(case, route)


def test_sink_folded_once_dominant_sink():
    # A sink far above every score: the output scale is set by how often the sink is counted.
    case = make_case(q_lens=[1, 1], seq_lens=[40, 1200], num_heads=4, num_kv_heads=1, head_size=64,
                     block_size=8, dtype="float32", sinks=True, seed=9, label="sink once")
    case.sinks = mx.full((4,), 3.0, mx.float32)
    case.host = None
    for route in ROUTES:
        _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("window", "lens"), [(1, [1, 600]), (100, [4097, 33, 1030]), (600, [2000, 599])])
def test_sliding_window(window, lens, route):
    case = make_case(q_lens=[1] * (len(lens) - 1) + [3], seq_lens=lens, num_heads=4, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", sliding_window=window, seed=window,
                     label=f"window {window}")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
def test_window_scores_far_below_zero(route):
    # Partitions entirely outside the window must be neutral: a max of 0 there would attenuate this head.
    case = make_case(q_lens=[1, 1, 2], seq_lens=[4097, 2600, 1500], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=32, dtype="float32", sliding_window=300, score_bias=-120.0, seed=21,
                     label="window far below zero")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", ("float16", "float32"))
def test_softcap(dtype, route):
    case = make_case(q_lens=[1, 1, 4], seq_lens=[900, 12, 600], num_heads=4, num_kv_heads=2, head_size=96,
                     block_size=8, dtype=dtype, softcap=5.0, scale=0.5, seed=13, label=f"softcap {dtype}")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
def test_all_features_with_shared_blocks(route):
    case = make_case(q_lens=[1, 1, 6], seq_lens=[1300, 800, 1030], num_heads=12, num_kv_heads=2, head_size=256,
                     block_size=16, dtype="bfloat16", sinks=True, sliding_window=700, softcap=30.0,
                     shared_prefix_blocks=3, seed=17, label="all features, shared blocks")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
def test_page_size_translation(route):
    # A 64-token cache page is served by kernel blocks of 32.
    case = make_case(q_lens=[1, 3], seq_lens=[777, 130], num_heads=4, num_kv_heads=2, head_size=80,
                     block_size=64, dtype="float16", seed=19, label="page 64")
    _check(case, route)


@pytest.mark.parametrize("route", ROUTES)
def test_bitwise_identical_on_repeat(route):
    case = make_case(q_lens=[1, 1, 8], seq_lens=[3000, 70, 900], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", sinks=True, seed=23, label="repeat")
    with forced_per_token_route(route):
        outs = []
        for _ in range(3):
            o = metal_attn.paged_attention(**case.kwargs(), provider="classic")
            mx.eval(o)
            outs.append(np.array(o.view(mx.uint16)))
            assert diagnostics.last_dispatch().route == route
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_gate_routes_on_real_device():
    """Without overrides the gate decides from the probed core count; explain shows the arithmetic."""
    case = make_case(q_lens=[1], seq_lens=[8192], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", seed=29, label="gate")
    got = run_case(case, provider="classic")
    rec = diagnostics.last_dispatch()
    ex = metal_attn.explain(**case.explain_kwargs())
    assert rec.route == ex.chosen.plan.route and rec.partition_size > 0, (rec, str(ex))
    assert_close_to_oracle(got, case.oracle(), case.dtype, label="gate")
    text = str(ex)
    assert "split gate: num_heads*total_q_tokens=8*1=8 <" in text
    assert f"partition size {rec.partition_size}" in text  # PARTITION_RULES' note


# -- the shared reducer -------------------------------------------------------------------------


@pytest.mark.parametrize("slices", (1, 2, 8))
def test_reducer_contract_with_neutral_partials(slices):
    """The reducer alone on random partials, a neutral one among them; rows of 1 to 3 partitions, so with
    several partition slices most slices have nothing to sum."""
    from metal_attn.providers.gpu_common import reduce_partitions

    from metal_attn.constants import LOG2E, NEG_FLT_MAX, SOFTMAX_EPS
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.settings import override_settings

    rng = np.random.default_rng(0)
    seq_lens, q_lens = [1500, 513, 40], [1, 1, 2]
    md = AttentionMetadata.build(np.zeros((3, 1), np.int32), seq_lens, np.cumsum([0, *q_lens]), validate=False)
    total, heads, parts, d = 4, 3, 3, 64
    ml = rng.normal(size=(total, heads, parts)).astype(np.float32) * 3
    es = rng.uniform(0.5, 4, size=(total, heads, parts)).astype(np.float32)
    tmp = rng.normal(size=(total, heads, parts, d)).astype(np.float32)
    ml[0, :, 0], es[0, :, 0], tmp[0, :, 0] = NEG_FLT_MAX, 0.0, 0.0  # neutral partial
    sinks = rng.normal(size=heads).astype(np.float32)
    with override_settings(reducer_slices=slices):
        out = reduce_partitions(mx.array(ml), mx.array(es), mx.array(tmp), md, mx.array(sinks), 512,
                                out_dtype=mx.float32)
    ctx = [1500, 513, 39, 40]
    ref = np.zeros((total, heads, d))
    for t in range(total):
        n = -(-ctx[t] // 512)
        for h in range(heads):
            m = max(ml[t, h, :n].max(), sinks[h] * LOG2E)
            w = es[t, h, :n].astype(np.float64) * np.exp2(ml[t, h, :n].astype(np.float64) - m)
            tot = w.sum() + np.exp2(sinks[h] * LOG2E - m)
            ref[t, h] = (w[:, None] * tmp[t, h, :n]).sum(0) / (tot + SOFTMAX_EPS)
    np.testing.assert_allclose(np.array(out), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("slices", (1, 2, 4, 8))
@pytest.mark.parametrize(("head", "features"), [(128, "plain"), (256, "sinks+window"), (64, "sinks")])
def test_reducer_slices_match_oracle(slices, head, features):
    """The split route's reducer at each partition slice count (``METAL_ATTN_REDUCER_SLICES``), through the
    per-token kernel at 64-token partitions: a row of 1,094 partitions (two blocks of even 8 x 128
    threads' weights), rows whose partitions do not divide among the slices, a row of one partition
    (every slice but the first empty), a chunk, and with a window whole partitions left out."""
    from metal_attn.providers import gpu_common as gc

    from metal_attn.settings import override_settings

    window = 3000 if "window" in features else None
    case = make_case(q_lens=[1, 1, 1, 1, 3], seq_lens=[70000, 9000, 4097, 40, 2050], num_heads=8, num_kv_heads=2,
                     head_size=head, block_size=16, dtype="bfloat16", seed=slices + head,
                     sinks="sinks" in features, sliding_window=window, label=f"slices={slices} h{head} {features}")
    md = case.metadata()
    with override_settings(reducer_slices=slices):
        out = gc.launch_paged(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=case.sinks,
                              sliding_window=window, softcap=None, partition_size=64,
                              backend=metal_attn.current_device().backend)
    assert_close_to_oracle(out, case.oracle(), "bfloat16", label=case.label)


# -- compile failure becomes a recorded fallback ----------------------------------------------------


def test_compile_failure_falls_back(planted_kernels, seq_line):
    from metal_attn import kernels

    planted = planted_kernels("pagedattention.metal", seq_line, seq_line.replace("qtok);", "qtok) + nope;"))
    case = make_case(q_lens=[1], seq_lens=[33], num_heads=4, num_kv_heads=2, head_size=192, block_size=8,
                     dtype="float32", seed=31, label="fallback")
    kernels.use_source_dir(planted)
    try:
        got = run_case(case)
        rec = diagnostics.last_dispatch()
    finally:
        kernels.use_source_dir(None)
    assert rec.provider == "reference"
    assert rec.fallbacks and rec.fallbacks[0][0] == "classic" and "failed to build" in rec.fallbacks[0][1]
    assert_close_to_oracle(got, case.oracle(), case.dtype, label="fallback")


# -- reshape_and_cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_scatter(dtype):
    rng = np.random.default_rng(1)
    nb, bs, kvh, d, n = 37, 16, 2, 80, 50
    mdt = getattr(mx, dtype)
    kc = mx.array(rng.normal(size=(nb, bs, kvh, d)).astype(np.float32)).astype(mdt)
    vc = mx.array(rng.normal(size=(nb, bs, kvh, d)).astype(np.float32)).astype(mdt)
    key = mx.array(rng.normal(size=(n, kvh, d)).astype(np.float32)).astype(mdt)
    val = mx.array(rng.normal(size=(n, kvh, d)).astype(np.float32)).astype(mdt)
    slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int64)
    slots[[3, 17, 40]] = -1  # padding
    raw = mx.uint16 if dtype != "float32" else mx.uint32
    exp_k = np.array(kc.view(raw)).copy()
    exp_v = np.array(vc.view(raw)).copy()
    kk = np.array(key.view(raw))
    vv = np.array(val.view(raw))
    ek = exp_k.reshape(nb * bs, -1)
    ev = exp_v.reshape(nb * bs, -1)
    keep = slots >= 0
    ek[slots[keep]] = kk.reshape(n, -1)[keep]
    ev[slots[keep]] = vv.reshape(n, -1)[keep]
    # The GPU kernel itself (reachable directly: the public call prefers the in-place scatter).
    from metal_attn.providers.classic import gpu as classic_gpu

    k1, v1 = classic_gpu.write_cache(key, val, kc, vc, mx.array(slots), metal_attn.current_device())
    mx.eval(k1, v1)
    assert np.array_equal(np.array(k1.view(raw)).reshape(nb * bs, -1), ek)
    assert np.array_equal(np.array(v1.view(raw)).reshape(nb * bs, -1), ev)
    # The public call: byte-identical too, through the in-place MLX scatter on GPU backends.
    k2, v2 = metal_attn.reshape_and_cache(key, val, kc, vc, mx.array(slots))
    mx.eval(k2, v2)
    assert diagnostics.last_cache_write().provider == "reference"
    assert np.array_equal(np.array(k2.view(raw)).reshape(nb * bs, -1), ek)
    assert np.array_equal(np.array(v2.view(raw)).reshape(nb * bs, -1), ev)
