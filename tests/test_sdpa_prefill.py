"""The ``sdpa_prefill`` provider on the CPU: its per-backend rule through `metal_attn.explain` on
hypothetical devices, and its gathering, grouping and row order against the float64 oracle
(MLX's unfused SDPA on the CPU stands in for the fused kernel, which only GPUs have; the fused
route's numerics run in tests/gpu/test_sdpa_prefill_gpu.py)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn._layout import import_builtin_providers
from metal_attn.device import DeviceInfo
from metal_attn.provider import AttentionInputs
from metal_attn.settings import get_settings, override_settings
from metal_attn.testing import assert_close_to_oracle, make_case

import_builtin_providers()
from metal_attn.providers import sdpa_prefill as sp  # noqa: E402

H200 = DeviceInfo.preset("h200")


def _explain(device, q_lens, seq_lens, *, heads=(32, 8, 128), dtype="bfloat16", **features):
    h, kvh, d = heads
    return ma.explain(q_lens=q_lens, seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d, block_size=16,
                      dtype=dtype, device=device, **features)


def _row(ex, name="sdpa_prefill"):
    return next(r for r in ex.rows if r.name == name)


@pytest.mark.parametrize(("q_lens", "seq_lens"), [([4096], [4096]), ([512], [32768 + 512]), ([2048] * 8, [2048] * 8),
                                                  ([256], [4096])], ids=("prompt", "chunk", "eight", "256-after-4k"))
def test_cuda_prefill_takes_the_route_and_explain_shows_the_rule(q_lens, seq_lens):
    ex = _explain(H200, q_lens, seq_lens)
    row = _row(ex)
    assert row.chosen, str(ex)
    assert row.plan.route == "sdpa_prefill"
    rows = max(q_lens)
    assert any(f"longest prefill chunk {rows} rows >= SDPA_PREFILL_RULES[cuda].min_chunk_rows=32" in n
               for n in row.plan.notes), row.plan.notes
    assert "sdpa_prefill" in str(ex)


@pytest.mark.parametrize(("q_lens", "seq_lens", "pairs"), [([64], [2112], 64 * 2048 + 64 * 65 // 2),
                                                      ([96], [4096], 96 * 4000 + 96 * 97 // 2),
                                                      ([32, 300], [1024, 300], 300 * 724 + 300 * 301 // 2)],
                         ids=("64-after-2k", "96-after-4k", "bound-of-a-batch"))
def test_cuda_chunks_with_few_pairs_go_to_the_tiles(q_lens, seq_lens, pairs):
    # The tiles, split over the keys, ran these faster (docs/bench-h200-prefill.md); the last case's
    # bound pairs its longest chunk (300 rows) with its longest sequence (1,024 tokens).
    ex = _explain(H200, q_lens, seq_lens)
    reasons = "\n".join(_row(ex).reasons)
    assert f"its attended pairs <= {max(q_lens)}*({max(seq_lens)}-{max(q_lens)})+" in reasons, str(ex)
    assert f"={pairs} < SDPA_PREFILL_RULES[cuda].min_chunk_pairs=500000" in reasons, str(ex)
    tiles = _row(ex, "tiled_prefill")
    assert tiles.chosen and tiles.plan.route.startswith("tiled_prefill_ps"), str(ex)


def test_cuda_mixed_batch_splits_its_decode_rows_off():
    row = _row(_explain(H200, [1, 1, 2048], [4096, 4096, 2048]))
    assert row.chosen and row.plan.route == "sdpa_prefill_decode"
    assert any(n.startswith("decode rows: per_token") for n in row.plan.notes), row.plan.notes
    assert any("longest prefill chunk 2048 rows >= SDPA_PREFILL_RULES[cuda].mixed[0].min_chunk_rows "
               "(longest decode row 4096 >= 4096)=32" in n for n in row.plan.notes), row.plan.notes
    # The decode rows' stream: the CUDA rule's, and the toggle's when it is set.
    from metal_attn.providers import gpu_common as gc

    assert row.plan.specialization[-1].side_stream is gc.DECODE_ROWS_STREAM_RULES["cuda"].side_stream
    for on in (False, True):
        with override_settings(decode_rows_stream=on):
            forced = _row(_explain(H200, [1, 1, 2048], [4096, 4096, 2048]))
        assert forced.plan.specialization[-1].side_stream is on, forced.plan.notes


@pytest.mark.parametrize(("q_lens", "seq_lens", "chosen", "note"), [
    ([1] * 8 + [64], [4096] * 8 + [2048], "sdpa_prefill",
     "longest prefill chunk 64 rows >= SDPA_PREFILL_RULES[cuda].mixed[0].min_chunk_rows "
     "(longest decode row 4096 >= 4096)=32"),
    ([1] * 8 + [24], [4096] * 8 + [2048], "tiled_prefill",
     "longest prefill chunk 24 rows < SDPA_PREFILL_RULES[cuda].mixed[0].min_chunk_rows "
     "(longest decode row 4096 >= 4096)=32"),
    ([1] * 32 + [64], [1024] * 32 + [1024], "tiled_prefill",
     "longest prefill chunk 64 rows < SDPA_PREFILL_RULES[cuda].mixed[1].min_chunk_rows "
     "(longest decode row 1024 >= 0)=128"),
    ([1] * 32 + [512], [1024] * 32 + [1024], "sdpa_prefill",
     "longest prefill chunk 512 rows >= SDPA_PREFILL_RULES[cuda].mixed[1].min_chunk_rows "
     "(longest decode row 1024 >= 0)=128"),
], ids=("long-decode-64", "long-decode-24", "short-decode-64", "short-decode-512"))
def test_cuda_mixed_rule_by_decode_context_and_chunk_rows(q_lens, seq_lens, chosen, note):
    ex = _explain(H200, q_lens, seq_lens)
    row = _row(ex)
    text = "\n".join([*row.reasons, *(row.plan.notes if row.plan else ())])
    assert note in text, str(ex)
    assert _row(ex, chosen).chosen, str(ex)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"heads": (16, 2, 256)}, "head_size=256 (supported: 64, 96, 128)"),
    ({"sliding_window": 512}, "sliding_window=512 (supported: none)"),
    ({"softcap": 30.0}, "softcap=30 (supported: none)"),
    ({"dtype": "float32"}, "dtype=float32 (supported: bfloat16, float16)"),
])
def test_cuda_refusals_leave_the_batch_to_the_tiles(kwargs, reason):
    ex = _explain(H200, [256], [1024], **kwargs)
    row = _row(ex)
    assert not row.chosen and reason in "\n".join(row.reasons), str(ex)
    if kwargs.get("dtype") != "float32":
        assert _row(ex, "tiled_prefill").chosen, str(ex)


def test_cuda_chunks_under_the_measured_rows_stay_tiled():
    ex = _explain(H200, [24, 20], [90, 300])
    reasons = "\n".join(_row(ex).reasons)
    assert "longest prefill chunk 24 rows < SDPA_PREFILL_RULES[cuda].min_chunk_rows=32" in reasons, str(ex)
    assert _row(ex, "tiled_prefill").chosen


def test_pure_decode_never():
    row = _row(_explain(H200, [1] * 8, [4096] * 8))
    assert not row.chosen and "phase=decode (supported: mixed, prefill)" in "\n".join(row.reasons)


@pytest.mark.parametrize("preset", ["m5-max", "m4-max", "m3-max"])
def test_metal_keeps_upstreams_rule(preset):
    ex = _explain(DeviceInfo.preset(preset), [4096], [4096])
    assert "SDPA_PREFILL_RULES[metal]: not admitted (not measured on Apple hardware" in "\n".join(_row(ex).reasons)
    assert not _row(ex).chosen


def test_cpu_is_measured_out():
    ex = _explain(DeviceInfo.preset("cpu-2core"), [2048], [2048])
    assert "SDPA_PREFILL_RULES[cpu]: not admitted (2-core CPU" in "\n".join(_row(ex).reasons)


def test_mixed_batch_refused_when_the_decode_rows_kernel_is_disabled():
    with override_settings(disabled_providers=("classic",)):
        ex = _explain(H200, [1, 2048], [4096, 2048])
    assert "its decode rows need the classic kernel" in "\n".join(_row(ex).reasons), str(ex)


@pytest.mark.parametrize("page", [1, 12, 20])
def test_a_mixed_batch_on_a_page_the_per_token_kernel_lacks_is_refused_and_a_prompt_is_not(page):
    # The decode rows leave for the per-token kernel, built for pages of 8, 16 and 32 (classic refuses the
    # others); the gather itself takes any page, so a batch without decode rows stays on the route.
    def explain(q_lens, seq_lens):
        return ma.explain(q_lens=q_lens, seq_lens=seq_lens, num_heads=32, num_kv_heads=8, head_size=128,
                          block_size=page, dtype="bfloat16", device=H200)

    mixed = _row(explain([1, 2048], [4096, 2048]))
    assert not mixed.admitted
    assert (f"its decode rows need the per-token kernel, built for block_size in 8, 16, 32 (got block_size={page})"
            in "\n".join(mixed.reasons)), mixed.reasons
    assert _row(explain([2048], [2048])).admitted


def test_disable_switch():
    with override_settings(disabled_providers=("sdpa_prefill",)):
        ex = _explain(H200, [4096], [4096])
    assert not _row(ex).chosen and "disabled by the disabled_providers setting" in "\n".join(_row(ex).reasons)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gathering_grouping_and_row_order_match_the_oracle(dtype, sinks):
    # Runs of equal (q_len, seq_len) share one call; continuation chunks, a fresh prompt, shared blocks,
    # scattered pages and a block size that does not divide the lengths.
    case = make_case(q_lens=[16, 16, 16, 40, 9, 9], seq_lens=[100, 100, 100, 40, 700, 650], num_heads=8,
                     num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, sinks=sinks, shared_prefix_blocks=2,
                     seed=21, label=f"cpu gather {dtype}")
    md = case.metadata()
    assert sp._runs(md, 0) == [(0, 3, 16, 100), (3, 1, 40, 40), (4, 1, 9, 700), (5, 1, 9, 650)]
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale, sinks=case.sinks)
    out = mx.concatenate(sp.prefill_rows(inputs, md, force_fused=False), axis=0)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


def test_rows_after_the_first_sequences_are_the_callers():
    case = make_case(q_lens=[1, 1, 30], seq_lens=[50, 60, 200], num_heads=4, num_kv_heads=1, head_size=64,
                     block_size=8, dtype="float16", seed=3)
    md = case.metadata()
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale)
    out = mx.concatenate(sp.prefill_rows(inputs, md, first_seq=2, force_fused=False), axis=0)
    assert_close_to_oracle(out, case.oracle()[2:], "float16")


def test_lead_rows_go_in_front_of_the_first_output():
    # A mixed batch's decode rows, computed elsewhere, lead the outputs (on a GPU the first run's
    # sdpa_finish writes them; without one they stay a part of their own).
    case = make_case(q_lens=[1, 1, 30, 12], seq_lens=[50, 60, 200, 90], num_heads=4, num_kv_heads=1, head_size=64,
                     block_size=8, dtype="float16", seed=5)
    md = case.metadata()
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale)
    ref = case.oracle()
    lead = mx.array(ref[:2].astype(np.float16))
    parts = sp.prefill_rows(inputs, md, first_seq=2, force_fused=False, lead=lead)
    assert parts[0] is lead and len(parts) == 3
    assert_close_to_oracle(mx.concatenate(parts, axis=0), ref, "float16")


def test_every_rule_states_its_evidence():
    assert set(sp.SDPA_PREFILL_RULES) == {"cuda", "metal", "cpu"}
    for backend, rule in sp.SDPA_PREFILL_RULES.items():
        assert rule.evidence, backend


def test_out_of_pool_block_ids_and_short_tables_give_nan_rows_never_a_read():
    import numpy as np

    case = make_case(q_lens=[20, 20, 30], seq_lens=[40, 40, 64], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype="float16", seed=5)
    ref = case.oracle()
    nb = case.k_cache.shape[0]
    tables = case.block_tables.copy()
    tables[1, 1] = nb + 10**6  # out of the pool
    from metal_attn.metadata import AttentionMetadata

    md = AttentionMetadata.build(mx.array(tables), mx.array(case.seq_lens), mx.array(case.cu_seqlens_q),
                                 validate=False)
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale)
    got = np.array(mx.concatenate(sp.prefill_rows(inputs, md, force_fused=False), axis=0).astype(mx.float32))
    assert np.isnan(got[20:40]).all()
    keep = np.r_[0:20, 40:70]
    assert_close_to_oracle(got[keep], ref[keep], "float16")
    short = AttentionMetadata.build(mx.array(case.block_tables[:, :3]), mx.array([40, 40, 64]),
                                    mx.array(case.cu_seqlens_q), validate=False)  # 64 tokens need 4 pages
    out = np.array(mx.concatenate(sp.prefill_rows(AttentionInputs(case.q, case.k_cache, case.v_cache, short,
                                                                  case.scale), short, force_fused=False),
                                  axis=0).astype(mx.float32))
    assert np.isnan(out[40:]).all() and np.isfinite(out[:40]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_nan_contract_around_the_fused_kernel(dtype):
    # Non-finite K/V after a row's causal end must not reach it (an unfused or fused kernel multiplies
    # zero probabilities with V); at an attended position it makes the row NaN; a NaN query row too.
    nan, inf = float("nan"), float("inf")
    case = make_case(q_lens=[40, 24, 24], seq_lens=[40, 300, 300], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=dtype, seed=9,
                     poison=[("v", 0, 30, 0, nan), ("k", 0, 35, 1, inf), ("v", 0, 39, 1, -inf), ("q", 0, 10, 3, nan),
                             ("v", 1, 290, 0, nan), ("k", 2, 10, 1, -inf)],
                     label=f"nan contract {dtype}")
    md = case.metadata()
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale)
    out = mx.concatenate(sp.prefill_rows(inputs, md, force_fused=False), axis=0)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize("sinks", [False, True])
def test_an_infinite_query_makes_its_row_nan(sinks):
    # q = +inf against keys whose scores are all -inf: the SDPA arithmetic gives 0 (sinks) or the mean of
    # masked keys (an additive mask), never NaN by itself; the contract wants NaN.
    case = make_case(q_lens=[4], seq_lens=[4], num_heads=1, num_kv_heads=1, head_size=64, block_size=8,
                     dtype="float16", sinks=sinks, seed=2, poison=[("q", 0, 1, 0, float("inf"))])
    k = case.k_cache.astype(mx.float32)
    k[..., 0] = -1.0  # every score of the infinite row is -inf
    case.k_cache = k.astype(case.k_cache.dtype)
    case.host = None
    md = case.metadata()
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale, sinks=case.sinks)
    out = mx.concatenate(sp.prefill_rows(inputs, md, force_fused=False), axis=0)
    assert_close_to_oracle(out, case.oracle(), "float16", label=f"inf q sinks={sinks}")


def _recording_kernels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """Replace the kernel loader by one that records each launch's (kernel, template) and returns
    zeros of the output shapes, and let MLX's unfused SDPA stand in for the fused kernel."""
    from metal_attn import kernels

    seen: list[tuple[str, tuple]] = []

    def load(name, *_args, **_kw):
        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            seen.append((name, tuple((k, str(v)) for k, v in template)))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    fused = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(kernels, "load_kernel", load)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, force_fused=False, **kw: fused(*a, **kw))
    return seen


@pytest.mark.parametrize("heads", [(32, 8), (16, 2), (4, 4)])
def test_prepare_compiles_the_kernels_every_geometry_runs(monkeypatch, heads):
    # prepare's tiny batch (one KV head, block 16) must instantiate exactly the templates a real call of
    # another geometry launches, so a compile failure surfaces in prepare as a recorded fallback.
    seen = _recording_kernels(monkeypatch)
    num_heads, kv_heads = heads
    device = DeviceInfo(backend="cuda", name="recording", architecture="sm_90")
    req = ma.AttentionRequest.from_lengths(q_lens=[64, 64], seq_lens=[700, 64], backend="cuda", num_heads=num_heads,
                                           num_kv_heads=kv_heads, head_size=128, block_size=32, dtype="bfloat16")
    plan = sp.SdpaPrefillProvider().plan(req, device, get_settings())
    sp.SdpaPrefillProvider().prepare(plan, device)
    prepared = set(seen)
    assert {name for name, _ in prepared} == {"gather_kv", "first_flagged", "sdpa_finish"}
    seen.clear()
    case = make_case(q_lens=[64, 64], seq_lens=[700, 64], num_heads=num_heads, num_kv_heads=kv_heads, head_size=128,
                     block_size=32, dtype="bfloat16", seed=4)
    md = case.metadata()
    sp.prefill_rows(AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale), md, backend="cuda")
    assert set(seen) == prepared


def test_launches_stay_within_32_bit_indices():
    # gather_kv and sdpa_finish index rows in 32 bits: a run of sequences is split so that no launch
    # exceeds MAX_GRID_THREADS, and a single sequence that would is refused at admission.
    per_seq = sp.seq_threads(4096, 4096, 32, 8)
    cap = sp.MAX_GRID_THREADS // per_seq
    runs = sp._capped([(3, 2 * cap + 5, 4096, 4096), (2 * cap + 8, 1, 64, 100)], 32, 8)
    assert runs == [(3, cap, 4096, 4096), (3 + cap, cap, 4096, 4096), (3 + 2 * cap, 5, 4096, 4096),
                    (2 * cap + 8, 1, 64, 100)]
    assert all(n * sp.seq_threads(sl, ql, 32, 8) <= sp.MAX_GRID_THREADS for _, n, ql, sl in runs)
    too_long = sp.MAX_GRID_THREADS // (8 * 32) + 1
    ex = _explain(H200, [64], [too_long])
    assert not _row(ex).chosen
    assert f"a sequence of {too_long} tokens needs" in "\n".join(_row(ex).reasons), str(ex)
    assert _row(_explain(H200, [64], [too_long - 1])).chosen


def test_the_rule_can_be_opened_for_measurements():
    # benchmarks/probe_sdpa_fused.py measures the route below its rule; plans made inside the block
    # never serve outside it.
    from metal_attn.testing.overrides import opened_sdpa_prefill_rule

    def admitted() -> bool:
        return _row(ma.explain(q_lens=[40], seq_lens=[100], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                               dtype="float16")).admitted

    assert not admitted()
    with opened_sdpa_prefill_rule():
        assert admitted()
    assert not admitted()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sinks_past_what_the_dtype_or_float32_s_log2_range_holds_outweigh_every_score(dtype):
    """MLX SDPA takes the sinks in the query's dtype and scales them by log2(e) in float32: 3.4e38 rounded
    to +inf in bfloat16 (70000 in float16) and 3e38 * log2(e) overflowed, and those heads turned NaN (a
    review of the GPU tests found it; MLX's CPU SDPA does the same). Finite sinks are kept finite at the
    largest value both hold, which outweighs every score as the unclamped sink does (the oracle)."""
    import numpy as np

    big = 3.4e38 if dtype == "bfloat16" else 7e4
    case = make_case(q_lens=[40, 9], seq_lens=[300, 1030], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, sinks=True, seed=12, label=f"huge sinks {dtype}")
    host = np.array([big, 0.5, -big, 2.0, 3e38, -1.0, 1e38, 0.0], dtype=np.float32)
    case = dataclasses.replace(case, sinks=mx.array(host), host={**case.host, "sinks": host})
    ref = np.asarray(case.oracle())
    assert np.isfinite(ref).all() and np.abs(ref[:, [0, 4, 6]]).max() < 1e-30
    md = case.metadata()
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale, sinks=case.sinks)
    out = mx.concatenate(sp.prefill_rows(inputs, md, force_fused=False), axis=0)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_non_finite_sinks_pass_to_mlx_unclamped(dtype):
    import numpy as np

    inf, nan = float("inf"), float("nan")
    got = np.array(sp.sinks_for_mlx(mx.array([inf, -inf, nan, 1.5, -2.0]), getattr(mx, dtype)).astype(mx.float32))
    assert got[0] == inf and got[1] == -inf and np.isnan(got[2]) and got[3] == 1.5 and got[4] == -2.0


@pytest.mark.parametrize(("pairs", "per"), [(1, 1), (2048, 1), (65535, 1), (65536, 2), (99264, 3), (262144, 8),
                                            (1 << 20, 16), (1 << 24, 16)])
def test_finish_launches_give_each_simdgroup_a_share_of_the_pairs(pairs, per):
    got_per, threads = sp.finish_launch(pairs)
    simdgroups = threads // 32
    assert got_per == per and threads % 32 == 0
    assert simdgroups * per >= pairs > (simdgroups - 1) * per  # every pair covered, no idle simdgroup
    assert simdgroups >= min(pairs, sp.FINISH_SIMDGROUPS)


@pytest.mark.usefixtures("needs_clang")
def test_the_route_s_metal_texts_type_check():
    # gather_kv and sdpa_finish per (dtype, head size), and first_flagged: never run (no Apple GPU
    # here), but type-checked with clang against the MSL shim, the finish's in-place and several-pairs
    # paths included (they are runtime parameters).
    from metal_attn import msl_check

    result = msl_check.check(providers=["sdpa_prefill"])
    assert result.ok, result.summary()
    assert result.count == 2 * 2 * 3 + 1  # {float16, bfloat16} x heads {64, 96, 128} x 2 kernels, first_flagged
