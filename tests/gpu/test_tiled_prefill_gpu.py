"""The ``tiled_prefill`` provider on a GPU backend against the float64 oracle.

Covers both dtypes, every head size of the tile table and every kernel block size;
query lengths at 8-row fragment and tile edges, fresh prompts and chunks with earlier
context; GQA ratios 1, 2, 4, 6, 8 and MQA; sinks, sliding windows (tiles left of the
window, in-window scores far below zero), softcap; verification batches; mixed batches
on both routes (decode rows riding in the tiles, and ``mixed_prefill_decode``, forced
through the threshold table); scattered and shared blocks; other tile shapes (both
row-block variants) through the launcher; bitwise repeats.

Every test runs twice: unsplit (``METAL_ATTN_TILED_PARTITION_SIZE=-1``) and split-KV at 128-key
partitions (every batch whose longest row spans two of them, mixed batches excepted, takes the
split route and the per-token kernel's reducer); the split tests at the end add other partition
sizes, windows that leave whole partitions empty, and non-finite values across partitions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn import diagnostics
from metal_attn.settings import get_settings, override_settings
from metal_attn.testing import assert_close_to_oracle, forced_mixed_threshold, make_case, run_case

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=(-1, 128), ids=("unsplit", "split128"))
def kv_split(request) -> int:
    """The tiled launch's split for the test: -1 never, 128 at 128-key partitions (forced)."""
    with override_settings(tiled_partition_size=request.param):
        yield request.param


def _split() -> int:
    """The launcher's ``partition_size`` under the test's split setting (0: unsplit)."""
    return max(get_settings().tiled_partition_size, 0)


def _route(case, route: str = "tiled_prefill") -> str:
    """The route the provider takes for ``case``: a forced split applies to batches that are not
    mixed (decode rows in front of prefill rows) and whose longest row spans two partitions."""
    p = _split()
    mixed = case.q_lens[0] == 1 and max(case.q_lens) > 1
    if route == "tiled_prefill" and p and not mixed and int(max(case.seq_lens)) > p:
        return f"tiled_prefill_ps{p}"
    return route

DTYPES = ("float16", "bfloat16")
HEADS = (64, 96, 128, 256)
BLOCKS = (8, 16, 32)


def _check(case, route: str = "tiled_prefill") -> np.ndarray:
    route = _route(case, route)
    got = run_case(case, provider="tiled_prefill")
    rec = diagnostics.last_dispatch()
    assert rec is not None and rec.provider == "tiled_prefill", rec
    assert rec.route == route, f"{case.label}: route {rec.route} (expected {route})"
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=f"{case.label} {rec.route}")
    return got


def test_smoke_prompt():
    case = make_case(q_lens=[40], seq_lens=[40], num_heads=4, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="float16", seed=1, label="smoke")
    _check(case)


_MATRIX = [(d, h, BLOCKS[(i + j) % 3]) for j, d in enumerate(DTYPES) for i, h in enumerate(HEADS)]
_MATRIX += [(d, 128, b) for d in DTYPES for b in BLOCKS if (d, 128, b) not in _MATRIX]


@pytest.mark.parametrize(("dtype", "head", "block"), _MATRIX, ids=[f"{d}-h{h}-b{b}" for d, h, b in _MATRIX])
def test_dtype_head_block_matrix(dtype, head, block):
    # A chunk with earlier context, a fresh prompt, a one-row chunk after them.
    case = make_case(q_lens=[37, 70, 1], seq_lens=[300, 70, 45], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=head + block, label=f"{dtype} h{head} b{block}")
    _check(case)


@pytest.mark.parametrize("head", (128, 256))
def test_query_lengths_at_fragment_and_tile_edges(head):
    q_lens = [2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65]
    case = make_case(q_lens=q_lens, seq_lens=[q + 5 * i for i, q in enumerate(q_lens)], num_heads=4,
                     num_kv_heads=1, head_size=head, block_size=16, dtype="bfloat16", seed=head,
                     label=f"edges h{head}")
    _check(case)


def test_long_prompt_and_long_chunk():
    case = make_case(q_lens=[1500, 513], seq_lens=[1500, 4097], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=32, dtype="bfloat16", seed=3, label="long")
    _check(case)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (12, 2), (16, 2), (8, 1)],
                         ids=["gqa1", "gqa2", "gqa4", "gqa6", "gqa8", "mqa"])
def test_gqa_ratios(num_heads, num_kv_heads):
    case = make_case(q_lens=[20, 45], seq_lens=[20, 300], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=64, block_size=16, dtype="float16", seed=num_heads * 10 + num_kv_heads,
                     label=f"gqa {num_heads}/{num_kv_heads}")
    _check(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks(dtype):
    case = make_case(q_lens=[9, 50], seq_lens=[700, 50], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, sinks=True, seed=5, label=f"sinks {dtype}")
    _check(case)


@pytest.mark.parametrize(("window", "q_lens", "seq_lens"),
                         [(1, [40], [40]), (5, [33, 70], [600, 70]), (100, [130, 64], [1030, 400]),
                          (600, [50], [2000])])
def test_sliding_window(window, q_lens, seq_lens):
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", sliding_window=window, seed=window, label=f"window {window}")
    _check(case)


def test_window_scores_far_below_zero():
    # Tiles left of the window are never loaded; a row must not see a max of 0 from them.
    case = make_case(q_lens=[40, 9], seq_lens=[2600, 1500], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=32, dtype="float16", sliding_window=300, score_bias=-120.0, seed=21,
                     label="window far below zero")
    _check(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap(dtype):
    case = make_case(q_lens=[12, 30], seq_lens=[600, 30], num_heads=4, num_kv_heads=2, head_size=96,
                     block_size=8, dtype=dtype, softcap=5.0, scale=0.5, seed=13, label=f"softcap {dtype}")
    _check(case)


def test_all_features_with_shared_blocks():
    case = make_case(q_lens=[6, 40, 33], seq_lens=[1300, 800, 1030], num_heads=12, num_kv_heads=2, head_size=256,
                     block_size=16, dtype="bfloat16", sinks=True, sliding_window=700, softcap=30.0,
                     shared_prefix_blocks=3, seed=17, label="all features, shared blocks")
    _check(case)


def test_verify_batch():
    case = make_case(q_lens=[4, 4, 4], seq_lens=[100, 517, 33], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=23, label="verify")
    _check(case)


@pytest.mark.parametrize("split", (False, True), ids=("ride-along", "split"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_both_routes(dtype, split):
    case = make_case(q_lens=[1, 1, 1, 37, 100], seq_lens=[1, 600, 1100, 37, 900], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype=dtype, sinks=True, seed=29, label=f"mixed {dtype}")
    with forced_mixed_threshold(0 if split else 1 << 30):
        _check(case, "mixed_prefill_decode" if split else "tiled_prefill")


def test_mixed_split_with_window_and_softcap():
    case = make_case(q_lens=[1, 1, 64], seq_lens=[5000, 4096, 200], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=32, dtype="float16", sliding_window=1000, softcap=20.0, seed=31,
                     label="mixed split, window, softcap")
    with forced_mixed_threshold(4096):
        _check(case, "mixed_prefill_decode")


_TILES = [(8, 16, 1), (16, 16, 1), (16, 32, 2), (32, 16, 1), (64, 32, 2), (32, 64, 2), (64, 64, 2), (128, 32, 2),
          (128, 16, 2)]


@pytest.mark.parametrize("tile", _TILES, ids=lambda t: "BQ{}-BKV{}-rb{}".format(*t))
def test_other_tile_shapes_through_the_launcher(tile):
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[70, 33], seq_lens=[300, 33], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", sliding_window=90, seed=sum(tile), label=f"tile {tile}")
    md = case.metadata()
    out = tiled_prefill.launch(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=None,
                               sliding_window=90, softcap=None, backend=metal_attn.current_device().backend,
                               config=tiled_prefill.TileConfig(*tile), partition_size=_split())
    assert_close_to_oracle(out, case.oracle(), "bfloat16", label=case.label)


@pytest.mark.parametrize("tile", [(32, 32, 2), (32, 32, 1)], ids=("rb2", "rb1"))
def test_row_block_variants_with_every_feature(tile):
    """Both row-block variants (RB 2: two blocks sharing operands) with sinks, softcap, a window and
    rows past the end of a block (q_len 13: the second block of the only simdgroup is partial)."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[13, 77, 40], seq_lens=[500, 77, 1040], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=8, dtype="float16", sinks=True, softcap=25.0, sliding_window=300, seed=43,
                     label=f"tile {tile} features")
    md = case.metadata()
    out = tiled_prefill.launch(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=case.sinks,
                               sliding_window=300, softcap=25.0, backend=metal_attn.current_device().backend,
                               config=tiled_prefill.TileConfig(*tile), partition_size=_split())
    assert_close_to_oracle(out, case.oracle(), "float16", label=case.label)


def _launch_tile(case, config, sinks=None, window=None, softcap=None, partition_size=None) -> np.ndarray:
    from metal_attn.providers import tiled_prefill

    out = tiled_prefill.launch(case.q, case.k_cache, case.v_cache, case.metadata(), scale=case.scale, sinks=sinks,
                               sliding_window=window, softcap=softcap, backend=metal_attn.current_device().backend,
                               config=config, partition_size=_split() if partition_size is None else partition_size)
    mx.eval(out)
    return np.array(out.astype(mx.float32)).astype(np.float64)


#: The one-buffer tests' tiles take up to 33.8 KB of threadgroup memory (two 32-key tiles at head 256;
#: one at head 512), past Metal's 32 KB: they run on CUDA, whose NAX tests take this path as their reference.
needs_cuda_tiles = pytest.mark.skipif(metal_attn.current_device().backend != "cuda",
                                      reason="these tiles need more than Metal's 32 KB of threadgroup memory")


@needs_cuda_tiles
@pytest.mark.parametrize("head", (64, 128, 256))
def test_one_buffer_equals_two_buffers_bit_for_bit(head):
    """K then V through one buffer computes the same products in the same order as two buffers: the
    outputs are bitwise equal (sinks, a window, rows past a block's end, a poisoned V at a masked
    position of the diagonal tile and at an attended one)."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[13, 77, 40], seq_lens=[500, 77, 1040], num_heads=8, num_kv_heads=2, head_size=head,
                     block_size=16, dtype="bfloat16", sinks=True, sliding_window=300, seed=head,
                     poison=[("v", 1, 70, 1, float("nan")), ("v", 2, 1020, 0, float("inf"))],
                     label=f"one buffer h{head}")
    sinks = case.sinks.astype(mx.float32)
    two = _launch_tile(case, tiled_prefill.TileConfig(32, 32), sinks, 300)
    one = _launch_tile(case, tiled_prefill.TileConfig(32, 32, one_buffer=True), sinks, 300)
    assert_close_to_oracle(one, case.oracle(), "bfloat16", label=case.label)
    assert np.array_equal(one, two, equal_nan=True)


@needs_cuda_tiles
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_one_buffer_at_head_512(dtype):
    """Head 512 with 32-key tiles (33 KB of threadgroup memory through one buffer; two would take
    66 KB) against the float64 oracle: sinks, softcap, a window, a continuation chunk."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[37, 70, 1], seq_lens=[300, 70, 45], num_heads=4, num_kv_heads=2, head_size=512,
                     block_size=8, dtype=dtype, sinks=True, sliding_window=200, softcap=30.0, seed=512,
                     label=f"one buffer h512 {dtype}")
    out = _launch_tile(case, tiled_prefill.TileConfig(32, 32, one_buffer=True), case.sinks.astype(mx.float32), 200,
                       30.0)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


def test_bitwise_identical_on_repeat():
    case = make_case(q_lens=[1, 1, 77, 300], seq_lens=[900, 5000, 200, 300], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", seed=37, label="repeat")
    for threshold in (0, 1 << 30):
        with forced_mixed_threshold(threshold):
            first = run_case(case, provider="tiled_prefill")
            again = run_case(case, provider="tiled_prefill")
            assert diagnostics.last_dispatch().route == ("mixed_prefill_decode" if threshold == 0 else _route(case))
        assert np.array_equal(first, again)


@pytest.mark.parametrize(("q_lens", "seq_lens"), [([50, 9], [50, 300]), ([1, 50], [300, 50])],
                         ids=("prefill", "mixed"))
def test_auto_routes_prefill_and_mixed_batches_here(q_lens, seq_lens):
    # Without forcing (sdpa_prefill, which takes these batches on CUDA by its rule, disabled):
    # prefill rows of an admitted geometry go to the tiles; the decode rows of a mixed batch leave
    # them from the backend's measured threshold on.
    from metal_attn.constants import MIXED_DECODE_MIN_CONTEXT
    from metal_attn.settings import override_settings

    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=41, label="auto")
    with override_settings(disabled_providers=("sdpa_prefill",)):
        out = metal_attn.paged_attention(**case.kwargs())
    mx.eval(out)
    rec = diagnostics.last_dispatch()
    split = q_lens[0] == 1 and seq_lens[0] >= MIXED_DECODE_MIN_CONTEXT[rec.backend]
    assert rec.provider == "tiled_prefill", rec
    assert rec.route == ("mixed_prefill_decode" if split else _route(case)), rec
    assert_close_to_oracle(np.array(out.astype(mx.float32)), case.oracle(), "bfloat16", label=f"auto {rec.route}")


# -- split-KV --------------------------------------------------------------------------------------


@pytest.mark.parametrize("psize", (128, 256, 512))
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_partition_sizes_with_sinks_and_a_window(psize, dtype):
    """Every partition size on chunks after long context: the reducer folds the sinks once; a window
    of 300 leaves whole partitions left of it empty (neutral partials); the short fresh prompt
    spans one partition; rows of one tile end in different partitions."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[64, 9, 130], seq_lens=[2112, 1500, 130], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, sinks=True, sliding_window=300, seed=psize,
                     label=f"split {psize} {dtype}")
    out = _launch_tile(case, tiled_prefill.TileConfig(128, 32, rb=2), case.sinks.astype(mx.float32), 300,
                       partition_size=psize)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize("head", (64, 256))
def test_split_with_softcap_gqa_and_non_finite_values(head):
    """Softcap, a window, GQA 8, shared blocks, and the NaN contract across partitions: a NaN V at a
    key the later rows of a chunk attend (their rows NaN, the earlier rows' not), an infinite K at
    the last row's own position, a NaN V left of every row's window (nothing)."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[40, 17], seq_lens=[1000, 700], num_heads=16, num_kv_heads=2, head_size=head,
                     block_size=16, dtype="bfloat16", softcap=30.0, sliding_window=500, shared_prefix_blocks=2,
                     seed=head + 1,
                     poison=[("v", 0, 975, 1, float("nan")), ("k", 0, 999, 0, float("inf")),
                             ("v", 1, 100, 1, float("nan"))],
                     label=f"split h{head} softcap gqa8 poison")
    cfg = tiled_prefill.tile_config(metal_attn.current_device().backend, head)
    out = _launch_tile(case, cfg, None, 500, 30.0, partition_size=128)
    assert_close_to_oracle(out, case.oracle(), "bfloat16", label=case.label)
    assert np.isnan(out).any() and np.isfinite(out).any()


def test_split_rule_takes_short_chunks_after_long_context():
    """Without a forced size (the backend's rule): a 64-row chunk after 2K tokens at 32/8 heads is one
    tile per head, and splits where the backend has a rule."""
    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[64], seq_lens=[2112], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                     dtype="bfloat16", seed=64, label="rule q64 L2112")
    with override_settings(tiled_partition_size=0):
        got = run_case(case, provider="tiled_prefill")
    rec = diagnostics.last_dispatch()
    backend = rec.backend
    if backend in tiled_prefill.TILED_SPLIT_RULES:
        assert rec.route.startswith("tiled_prefill_ps"), rec
    else:
        assert rec.route == "tiled_prefill", rec
    assert_close_to_oracle(got, case.oracle(), "bfloat16", label=f"{case.label} {rec.route}")


_SHORT = [("bfloat16", 32, 8, False, None, 16), ("float16", 8, 8, True, None, 16), ("bfloat16", 16, 2, True, 700, 32),
          ("float16", 32, 4, False, None, 8)]


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "sinks", "window", "block"), _SHORT,
                         ids=[f"{d}-{h}/{k}-sinks{int(s)}-w{w}-b{b}" for d, h, k, s, w, b in _SHORT])
def test_short_chunk_tile_against_the_oracle(dtype, heads, kv_heads, sinks, window, block):
    """The rule's short-chunk tile (CUDA, head 128: a 64-row tile where a split launch's chunks have at
    most 64 rows), at its own partition choice: three short chunks after long context, two of them
    behind a shared prefix, with sinks and a window in some cases; the tile the plan ran is checked."""
    import dataclasses

    from metal_attn.providers import tiled_prefill

    case = make_case(q_lens=[64, 17, 40], seq_lens=[2112, 3000, 1800], num_heads=heads, num_kv_heads=kv_heads,
                     head_size=128, block_size=block, dtype=dtype, sinks=sinks, sliding_window=window,
                     shared_prefix_blocks=4, seed=heads + block, label=f"short tile {dtype} {heads}/{kv_heads}")
    with override_settings(tiled_partition_size=0):
        got = run_case(case, provider="tiled_prefill")
        rec = diagnostics.last_dispatch()
        plan = next(r for r in metal_attn.explain(request=rec.request).rows if r.name == "tiled_prefill").plan
    from metal_attn.device import current_device

    rule = tiled_prefill.TILED_SPLIT_RULES.get(rec.backend)
    cores = current_device().gpu_cores or 0
    # At most 4 short tiles x heads threadgroups: the batch splits with the short tile where that stays
    # below the core count (every case here on the H200's 132 cores).
    if rule is not None and 128 in rule.short_tiles and heads * 4 < cores:
        assert plan.specialization[5] == dataclasses.astuple(rule.short_tiles[128].config), plan.notes
        assert rec.route.startswith("tiled_prefill_ps"), rec
    assert_close_to_oracle(got, case.oracle(), dtype, label=f"{case.label} {rec.route}")
