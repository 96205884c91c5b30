"""The NaN contract on the GPU kernels (``docs/providers.md``), against the float64 oracle.

A NaN or infinity in q, or in K/V at a position a row attends to, makes that (row, head)
non-finite; one at a position the row does not attend to (past its causal end, left of its
window, in a partition left of the window, in a tile's keys that only other rows attend)
changes nothing. Every GPU provider and code path: ``classic`` on every route (unsplit, 512-
and 64-token partitions) with direct loads, staged loads and the matrix path; ``gqa_decode`` on
every geometry of the backend's
table at both partition sizes; ``tiled_prefill`` on both mixed routes, with diagonal tiles,
tiles that start left of a window and partial last tiles, unsplit and split-KV. Also the non-finite specs of the
conformance suite, forced on each provider that admits them.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from metal_attn import diagnostics
from metal_attn._layout import import_builtin_providers
from metal_attn.device import current_device
from metal_attn.settings import override_settings
from metal_attn.testing import (
    NONFINITE_SPECS,
    AttentionCase,
    admission_reasons,
    assert_close_to_oracle,
    forced_mixed_threshold,
    make_case,
    run_case,
)
from metal_attn.testing.conformance import CONFORMANCE_SPECS
from metal_attn.testing.overrides import (
    PER_TOKEN_TEST_ROUTES,
    expected_route,
    forced_per_token_route,
    rule_opened_for,
)

import_builtin_providers()
from metal_attn.providers import gqa_decode as gq  # noqa: E402

pytestmark = pytest.mark.gpu

BACKEND = current_device().backend
TABLE = gq.geometry_table(BACKEND if BACKEND in ("cuda", "metal") else "cuda")
NAN, INF = float("nan"), float("inf")
ALL_NONFINITE = [s for s in CONFORMANCE_SPECS if s.get("poison")]
def _check(case, provider: str, route: str | None = None) -> None:
    with rule_opened_for(provider):  # sdpa_prefill: its numerics on batches its rule leaves to the tiles
        got = run_case(case, provider=provider)
    rec = diagnostics.last_dispatch()
    assert rec is not None and rec.provider == provider, rec
    if route is not None:
        assert rec.route == route, f"{case.label}: route {rec.route} (expected {route})"
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=f"{case.label} via {provider}/{rec.route}")


@pytest.mark.parametrize("provider", ("classic", "gqa_decode", "tiled_prefill", "sdpa_prefill"))
@pytest.mark.parametrize("spec", ALL_NONFINITE, ids=[s["label"] for s in ALL_NONFINITE])
def test_conformance_nonfinite_specs(spec, provider):
    with rule_opened_for(provider):
        reasons = admission_reasons(spec, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit {spec['label']}: " + "; ".join(reasons))
    _check(make_case(**spec), provider)


@pytest.mark.parametrize("route", PER_TOKEN_TEST_ROUTES)
@pytest.mark.parametrize("spec", NONFINITE_SPECS, ids=[s["label"] for s in NONFINITE_SPECS])
def test_classic_both_routes(spec, route):
    case = make_case(**spec)
    expect = expected_route(route, case.seq_lens)
    with forced_per_token_route(route):
        _check(case, "classic", expect)


# Classic's code paths on CUDA: direct loads (GQA 2), staged per-token loads (float32, GQA >= 4 at
# head 128/256) and the matrix path (16-bit, GQA >= 4 at head 128/256); a decode row, a row in its
# second partition, a prefill chunk with earlier context and a window.
_CLASSIC_PATHS = [(d, h, g) for d in ("float16", "bfloat16", "float32") for h in (128, 256) for g in (2, 4, 8)]


@pytest.mark.parametrize("route", PER_TOKEN_TEST_ROUTES)
@pytest.mark.parametrize(("dtype", "head", "group"), _CLASSIC_PATHS,
                         ids=[f"{d}-h{h}-g{g}" for d, h, g in _CLASSIC_PATHS])
def test_classic_code_paths(dtype, head, group, route):
    case = make_case(q_lens=[1, 1, 7], seq_lens=[70, 1100, 600], num_heads=2 * group, num_kv_heads=2,
                     head_size=head, block_size=16, dtype=dtype, sliding_window=900, seed=head + group,
                     poison=[("q", 0, 0, 1, NAN), ("k", 0, 31, 1, -INF), ("v", 1, 1099, 0, INF),
                             ("v", 1, 100, 1, NAN),  # left of row 1's window: no effect
                             ("v", 2, 597, 0, NAN),  # rows 3..6 of the chunk only
                             ("k", 2, 598, 1, NAN)],  # rows 4..6
                     label=f"classic {dtype} h{head} g{group}")
    with forced_per_token_route(route):
        _check(case, "classic", route)


#: (provider, per-token route or None for the provider's choice, settings) for the sink tests: every GPU
#: path that folds a sink. classic's split routes with the CUDA fused reducer too (off by default), the
#: tiled kernel unsplit (it starts a row's softmax from the sink) besides its own choice (split on CUDA:
#: the reducer folds the sink). gqa_decode takes no sinks; NAX prefill runs on M5 GPUs only.
_SINK_ROUTES = ([("classic", r, {}) for r in PER_TOKEN_TEST_ROUTES]
                + [("classic", r, {"cuda_fused_reduce": True}) for r in PER_TOKEN_TEST_ROUTES if r != "per_token_ps0"]
                + [("tiled_prefill", None, {}), ("tiled_prefill", None, {"tiled_partition_size": -1}),
                   ("sdpa_prefill", None, {})])
_SINK_IDS = [f"{p}-{r or 'own'}" + "".join(f"-{k}={v}" for k, v in o.items()) for p, r, o in _SINK_ROUTES]


def _sinks_case(provider: str, sinks: list[float], seed: int, label: str) -> AttentionCase:
    """A batch the provider's phase takes (a chunk after context for the prefill providers, decode rows
    otherwise), 8 query heads on 2 KV heads, with ``sinks`` as its sinks."""
    import numpy as np

    prefill = provider in ("tiled_prefill", "sdpa_prefill")
    q_lens, seq_lens = ([40, 9], [300, 1030]) if prefill else ([1, 1, 1], [700, 40, 1100])
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", sinks=True, seed=seed, label=f"{label} {provider}")
    host = np.array(sinks, dtype=np.float32)
    return dataclasses.replace(case, sinks=mx.array(host), host={**case.host, "sinks": host})


def _check_on_route(case: AttentionCase, provider: str, route: str | None, settings: dict | None = None) -> None:
    """`_check` on ``route`` of the per-token kernel (None: the provider's own choice) under ``settings``,
    or skip where the provider does not admit the batch."""
    with override_settings(**(settings or {})):
        with rule_opened_for(provider):
            reasons = admission_reasons(case, provider)
        if reasons:
            pytest.skip(f"{provider} does not admit the batch: " + "; ".join(reasons))
        if route is None:
            _check(case, provider)
        else:
            with forced_per_token_route(route):
                _check(case, provider, expected_route(route, case.seq_lens))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the oracle's inf - inf
@pytest.mark.parametrize(("provider", "route", "settings"), _SINK_ROUTES, ids=_SINK_IDS)
def test_non_finite_sinks_follow_the_oracle(provider, route, settings):
    """A +inf or NaN sink makes its head NaN, as the oracle does; -inf is no sink (a finite head). On every
    GPU path that folds sinks (`_SINK_ROUTES`): classic's decode rows on each route, the prefill providers
    on a chunk after context (where their rules admit it)."""
    import numpy as np

    inf, nan = float("inf"), float("nan")
    case = _sinks_case(provider, [0.5, inf, nan, -inf, 2.0, nan, inf, -1.0], 11, "non-finite sinks")
    ref = np.asarray(case.oracle())
    assert np.isnan(ref[:, [1, 2, 5, 6]]).all() and np.isfinite(ref[:, [0, 3, 4, 7]]).all()
    _check_on_route(case, provider, route, settings)


@pytest.mark.parametrize(("provider", "route", "settings"), _SINK_ROUTES, ids=_SINK_IDS)
def test_sinks_past_float32_s_log2_range_outweigh_every_score(provider, route, settings):
    """A finite sink past FLT_MAX / log2(e) overflowed to +inf in log2 space (ma_sink_log2 keeps it at FLT_MAX):
    on the CPU kernels the split rows turned NaN (twenty-third session; this GPU test is written, not yet run).
    sdpa_prefill keeps finite sinks within what MLX SDPA takes (`SINK_LIMITS`): 3.4e38 is +inf in bfloat16."""
    import numpy as np

    case = _sinks_case(provider, [3e38, 0.5, -3e38, 2.0, 3.4e38, -1.0, 1e38, 0.0], 12, "huge sinks")
    assert np.isfinite(np.asarray(case.oracle())).all()
    _check_on_route(case, provider, route, settings)


@pytest.mark.parametrize("partition_size", (256, 512))
@pytest.mark.parametrize("geom", TABLE, ids=[gq._fmt_geom(g) for g in TABLE])
def test_gqa_decode_every_geometry(geom, partition_size):
    h, kvh, d, bs = geom
    seq_lens = [1, 17, 700, 2000]
    case = make_case(q_lens=[1] * 4, seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d, block_size=bs,
                     dtype="bfloat16", seed=h + d,
                     poison=[("q", 1, 0, h - 1, NAN), ("k", 2, 699, 0, -INF), ("k", 2, 3, kvh - 1, INF),
                             ("v", 3, 1999, 1 % kvh, NAN), ("v", 3, 300, 0, INF)],
                     label=f"gqa {gq._fmt_geom(geom)} P{partition_size}")
    out = gq.launch(case.q, case.k_cache, case.v_cache, case.metadata(), scale=case.scale,
                    partition_size=partition_size, backend=BACKEND)
    mx.eval(out)
    assert_close_to_oracle(out, case.oracle(), case.dtype, label=case.label)


@pytest.mark.parametrize("kv_split", (-1, 128), ids=("unsplit", "split128"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("head", (64, 128, 256))
def test_tiled_prompt_tiles(head, dtype, kv_split):
    # A 200-row prompt: diagonal tiles (keys some rows of the tile do not attend), a partial last
    # tile; with a window of 50 the later query tiles start at a key tile aligned down left of
    # their first row's window (keys loaded for no row).
    for window in (None, 50):
        poison = [("v", 0, 150, 0, NAN), ("k", 0, 151, 1, INF), ("v", 0, 199, 1, -INF), ("q", 0, 60, 3, NAN)]
        if window:
            poison += [("v", 0, 70, 0, NAN), ("k", 0, 65, 1, NAN)]
        case = make_case(q_lens=[200], seq_lens=[200], num_heads=4, num_kv_heads=2, head_size=head, block_size=16,
                         dtype=dtype, sliding_window=window, seed=head, poison=poison,
                         label=f"tiled h{head} {dtype} window={window} split={kv_split}")
        with override_settings(tiled_partition_size=kv_split):  # 128: two partitions of the 200 keys
            _check(case, "tiled_prefill", "tiled_prefill_ps128" if kv_split > 0 else "tiled_prefill")


@pytest.mark.parametrize("threshold", (0, 1 << 30), ids=("mixed_prefill_decode", "decode-rows-in-tiles"))
def test_tiled_mixed_batches(threshold):
    case = make_case(q_lens=[1, 1, 40, 9], seq_lens=[300, 1500, 100, 60], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", sinks=True, seed=3,
                     poison=[("v", 0, 299, 1, NAN), ("k", 1, 600, 0, NAN), ("v", 2, 99, 0, NAN),
                             ("v", 2, 70, 1, INF), ("q", 3, 8, 2, -INF), ("v", 3, 59, 0, NAN)],
                     label="tiled mixed")
    route = "mixed_prefill_decode" if threshold == 0 else "tiled_prefill"
    with forced_mixed_threshold(threshold):
        _check(case, "tiled_prefill", route)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("head", (64, 96, 128))
def test_sdpa_prefill_masked_positions(head, dtype):
    """The gathered-SDPA route: non-finite K/V after a row's causal end (inside the fused kernel's
    diagonal tiles) must not reach it; a chunk after context and a mixed batch's decode rows too."""
    if BACKEND != "cuda":
        pytest.skip(f"sdpa_prefill's rule admits cuda only (backend={BACKEND})")
    poison = [("v", 0, 150, 0, NAN), ("k", 0, 151, 1, INF), ("v", 0, 199, 1, -INF), ("q", 0, 60, 3, NAN),
              ("q", 0, 70, 1, INF), ("v", 1, 420, 0, NAN), ("k", 1, 30, 1, NAN)]
    case = make_case(q_lens=[200, 64], seq_lens=[200, 450], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=16, dtype=dtype, seed=head, poison=poison, label=f"sdpa h{head} {dtype}")
    _check(case, "sdpa_prefill", "sdpa_prefill")
    mixed = make_case(q_lens=[1, 1, 1030], seq_lens=[300, 40, 1030], num_heads=4, num_kv_heads=2, head_size=head,
                      block_size=16, dtype=dtype, seed=head + 1,
                      poison=[("v", 0, 299, 0, NAN), ("k", 1, 3, 1, INF), ("v", 2, 80, 1, NAN)],
                      label=f"sdpa mixed h{head} {dtype}")
    _check(mixed, "sdpa_prefill", "sdpa_prefill_decode")
