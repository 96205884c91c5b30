"""The NAX prefill kernel's CUDA twin on a GPU: its logic against the float64 oracle and the tiled kernel.

The twin is the text of ``kernels_v2/nax_prefill.metal`` assembled with ``nax_tensor_ops_cuda.h`` (the
Metal 4 tensor-op subset on ``mma.sync``, in the same per-lane layout), run through
`metal_attn.providers.nax_prefill.run_twin`, which plans as the provider does on an M5 (route,
mixed split). It needs MLX's CUDA backend: on Metal the provider itself runs (a Mac's tests are
`test_dispatch_on_an_m5` below), elsewhere the module skips.

Every specialization (dtype x head size x kernel block size: 2 x 5 x 3) runs once and must

- match the float64 oracle within the dtype's tolerance (as the tiled kernel's tests), and
- match the tiled kernel on the same inputs within upstream's bound for relaxed precision: at most
  2 ULP of the output dtype at the maximum, at most 0.05 ULP on average. For heads 256 and 512
  "the tiled kernel" is its launcher with an explicit tile (`TILED_CONFIGS`: 32-key tiles as the NAX
  kernel's; for 512, which the tiled provider does not tile, through one buffer). The figures
  (and each kernel's distance to the oracle rounded to the dtype) are in
  the assertion messages and printed (``-s`` or ``-rP`` shows them).

Then: sinks, sliding windows whose leading tiles are skipped (in-window scores far below zero),
softcap, continuation chunks, mixed batches on both routes, random block tables (shared blocks and
scattered pages are `make_case`'s defaults), rows at 16-row and 64-row edges, the NaN contract, and
bitwise repeats.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_attn.device import detect_backend
from metal_attn.provider import AttentionInputs
from metal_attn.settings import override_settings
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.cases import round_to_dtype, to_numpy
from metal_attn.testing.overrides import forced_mixed_threshold
from metal_attn.testing.ulp import ulp_figures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(detect_backend() not in ("cuda", "metal"), reason="needs an MLX GPU backend"),
]

from metal_attn._layout import import_builtin_providers  # noqa: E402

import_builtin_providers()
from metal_attn.providers import nax_prefill as nx  # noqa: E402
from metal_attn.providers import tiled_prefill as tp  # noqa: E402

BACKEND = detect_backend()
needs_cuda = pytest.mark.skipif(BACKEND != "cuda", reason="the CUDA twin needs MLX's CUDA backend")

#: Upstream's bound for relaxed precision against the tiled kernel, in ULP of the output dtype.
MAX_ULP = 2
MEAN_ULP = 0.05
#: Tiles of the tiled launcher where the tiled provider's CUDA table would not walk the keys 32 at a
#: time as the NAX kernel does: its head-256 tile takes 16, and it has none at head 512, where a 32-key
#: K and V tile (66 KB) passes the 48 KB of static shared memory an MLX CUDA kernel may declare; there
#: the launcher stages K, then V, through one buffer (`TileConfig.one_buffer`, 33 KB). With the same
#: 32-key tiles both kernels move the softmax's maximum at the same keys and round the same products in
#: the same order. Different tile sizes alone put bfloat16 outputs near zero, where one ULP is tiny,
#: tens of ULP apart (the ninth session's 16-key reference at head 512: max 119 / 14 / 28 ULP;
#: benchmarks/probe_tile_order_ulp.py: the tiled kernel against itself, 16 against 32 keys).
TILED_CONFIGS = {256: tp.TileConfig(128, 32, rb=2), 512: tp.TileConfig(32, 32, rb=1, one_buffer=True)}


# -- helpers ----------------------------------------------------------------------------------------------


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return round_to_dtype(np.asarray(x, dtype=np.float32), dtype).astype(np.float64)


def _inputs(case) -> AttentionInputs:
    sinks = case.sinks.astype(mx.float32) if case.sinks is not None else None
    return AttentionInputs(case.q, case.k_cache, case.v_cache, case.metadata(), case.scale, sinks,
                           case.sliding_window, case.softcap)


def _twin(case, route: str = "nax_prefill") -> np.ndarray:
    out, plan = nx.run_twin(_inputs(case))
    mx.eval(out)
    assert plan.route == route, f"{case.label}: route {plan.route} (expected {route})"
    assert out.dtype == case.q.dtype and tuple(out.shape) == tuple(case.q.shape)
    return to_numpy(out).astype(np.float64)


def _tiled(case) -> np.ndarray:
    head = int(case.q.shape[2])
    if head not in TILED_CONFIGS:
        with override_settings(tiled_partition_size=-1):  # the unsplit walk, as the NAX kernel's
            return run_case(case, provider="tiled_prefill")
    md = case.metadata()
    sinks = case.sinks.astype(mx.float32) if case.sinks is not None else None
    common = dict(scale=case.scale, sinks=sinks, sliding_window=case.sliding_window, softcap=case.softcap,
                  backend=BACKEND, config=TILED_CONFIGS[head])
    out = tp.launch(case.q, case.k_cache, case.v_cache, md, **common)
    mx.eval(out)
    return to_numpy(out).astype(np.float64)


def _check(case, route: str = "nax_prefill") -> np.ndarray:
    """The twin against the oracle and against the tiled kernel (upstream's ULP bound)."""
    dtype = case.dtype
    got = _twin(case, route)
    oracle = case.oracle()
    assert_close_to_oracle(got, oracle, dtype, label=f"{case.label} twin {route}")
    tiled = _tiled(case)
    assert np.array_equal(np.isfinite(got), np.isfinite(tiled)), f"{case.label}: non-finite elements differ"
    mx_ulp, mean_ulp = ulp_figures(got, tiled, dtype)
    ref = _rounded(oracle, dtype)
    twin_o = ulp_figures(got, ref, dtype)
    tiled_o = ulp_figures(tiled, ref, dtype)
    figures = (f"{case.label}: twin vs tiled max {mx_ulp} ULP, mean {mean_ulp:.4f} ULP; vs the oracle rounded to "
               f"{dtype}: twin max {twin_o[0]} / mean {twin_o[1]:.4f}, tiled max {tiled_o[0]} / mean {tiled_o[1]:.4f}")
    print(figures)
    assert mx_ulp <= MAX_ULP and mean_ulp <= MEAN_ULP, (
        f"{figures} (bound: max <= {MAX_ULP}, mean <= {MEAN_ULP})")
    return got


# -- every specialization -----------------------------------------------------------------------------------

_MATRIX = [(d, h, b) for d in nx.DTYPES for h in nx.HEAD_SIZES for b in nx.BLOCK_SIZES]


@needs_cuda
@pytest.mark.parametrize(("dtype", "head", "block"), _MATRIX, ids=[f"{d}-h{h}-b{b}" for d, h, b in _MATRIX])
def test_every_specialization(dtype, head, block):
    # A chunk with earlier context (not 16-row aligned), a fresh prompt past one 64-row tile, a one-row
    # chunk: the last simdgroups of the tiles are partial or empty.
    case = make_case(q_lens=[37, 70, 1], seq_lens=[300, 70, 45], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=head + block, label=f"{dtype} h{head} b{block}")
    _check(case)


# -- features ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", nx.DTYPES)
def test_sinks_initialise_the_state(dtype):
    case = make_case(q_lens=[9, 50], seq_lens=[700, 50], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, sinks=True, seed=5, label=f"sinks {dtype}")
    _check(case)


@needs_cuda
@pytest.mark.parametrize(("window", "q_lens", "seq_lens"),
                         [(1, [40], [40]), (5, [33, 70], [600, 70]), (100, [130, 64], [1030, 400]),
                          (600, [50], [2000])])
def test_sliding_window_skips_leading_tiles(window, q_lens, seq_lens):
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", sliding_window=window, seed=window, label=f"window {window}")
    _check(case)


def _skipped_leading_tiles(case) -> int:
    """KV tiles left of the first row's window that no simdgroup of the case reads (host arithmetic)."""
    total = 0
    for q_len, seq_len in zip(case.q_lens, case.seq_lens.tolist()):
        ctx0 = seq_len - q_len
        for row0 in range(0, q_len, 16):
            total += max(ctx0 + row0 + 1 - case.sliding_window, 0) // nx.NAX_TILE_KV
    return total


@needs_cuda
def test_window_scores_far_below_zero():
    # Tiles left of the window are never read; a row must not see a max of 0 from them: with every
    # in-window score near -120, a kernel that read a masked tile as 0 would give zeros.
    case = make_case(q_lens=[40, 9], seq_lens=[2600, 1500], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=32, dtype="float16", sliding_window=300, score_bias=-120.0, seed=21,
                     label="window far below zero")
    assert _skipped_leading_tiles(case) > 0
    _check(case)


@needs_cuda
@pytest.mark.parametrize("dtype", nx.DTYPES)
def test_softcap(dtype):
    case = make_case(q_lens=[12, 30], seq_lens=[600, 30], num_heads=4, num_kv_heads=2, head_size=96,
                     block_size=8, dtype=dtype, softcap=5.0, scale=0.5, seed=13, label=f"softcap {dtype}")
    _check(case)


@needs_cuda
def test_continuation_chunks_and_row_edges():
    q_lens = [2, 15, 16, 17, 63, 64, 65, 129]
    case = make_case(q_lens=q_lens, seq_lens=[q + 37 * i for i, q in enumerate(q_lens)], num_heads=4,
                     num_kv_heads=1, head_size=64, block_size=16, dtype="bfloat16", seed=7, label="chunks, edges")
    _check(case)


@needs_cuda
def test_every_feature_with_shared_blocks_and_gqa():
    case = make_case(q_lens=[6, 40, 33], seq_lens=[1300, 800, 1030], num_heads=12, num_kv_heads=2, head_size=256,
                     block_size=16, dtype="bfloat16", sinks=True, sliding_window=700, softcap=30.0,
                     shared_prefix_blocks=3, seed=17, label="all features, shared blocks")
    _check(case)


@needs_cuda
def test_random_block_tables_long_prompt():
    case = make_case(q_lens=[700, 300], seq_lens=[700, 1900], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=8, dtype="float16", num_blocks=600, seed=3, label="long, scattered")
    _check(case)


@needs_cuda
@pytest.mark.parametrize("split", (False, True), ids=("ride-along", "split"))
@pytest.mark.parametrize("dtype", nx.DTYPES)
def test_mixed_batch_both_routes(dtype, split):
    # The provider's mixed rule (the tiled provider's): decode rows ride in the tiles below the
    # threshold, else they go through the classic kernel; forced both ways, for both kernels.
    threshold = 0 if split else 1 << 30
    case = make_case(q_lens=[1, 1, 1, 37, 100], seq_lens=[1, 600, 1100, 37, 900], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype=dtype, sinks=True, seed=29, label=f"mixed {dtype}")
    with forced_mixed_threshold(threshold):
        _check(case, "mixed_prefill_decode" if split else "nax_prefill")


@needs_cuda
def test_nan_contract():
    # NaN in V at a position the diagonal tile holds but the earlier rows do not attend, +inf in K at
    # an attended position, NaN in q: exactly the (row, head) pairs the oracle marks turn non-finite.
    case = make_case(q_lens=[40, 20], seq_lens=[40, 300], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype="float16", seed=11, label="nan contract",
                     poison=[("v", 0, 30, 1, float("nan")), ("k", 1, 100, 0, float("inf")),
                             ("q", 1, 3, 2, float("nan"))])
    got = _twin(case)
    assert_close_to_oracle(got, case.oracle(), "float16", label=case.label)
    assert not np.isfinite(got).all()


@needs_cuda
def test_bitwise_identical_on_repeat():
    case = make_case(q_lens=[77, 300], seq_lens=[200, 300], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=37, label="repeat")
    assert np.array_equal(_twin(case), _twin(case))


@pytest.mark.skipif(BACKEND != "metal", reason="the provider itself runs only on an Apple M5-class GPU")
def test_dispatch_on_an_m5():
    """On a Mac with the tensor units (never run in this project): automatic routing picks the provider,
    or records why not (a compile failure falls back to the tiled kernel)."""
    import metal_attn
    from metal_attn import diagnostics

    case = make_case(q_lens=[50, 9], seq_lens=[50, 300], num_heads=4, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=41, label="m5")
    reasons = nx.GATE.reasons(metal_attn.current_device())
    out = metal_attn.paged_attention(**case.kwargs())
    mx.eval(out)
    rec = diagnostics.last_dispatch()
    if reasons:
        assert rec.provider != "nax_prefill"
    elif rec.provider != "nax_prefill":
        assert any(name == "nax_prefill" for name, _ in rec.fallbacks), rec
    assert_close_to_oracle(np.array(out.astype(mx.float32)), case.oracle(), "bfloat16", label="m5")
