"""Routing of the ``gqa_decode`` provider, with the device probe overridden (CPU only).

Every admission rule is asserted through `metal_attn.explain`: the chosen
provider (on CUDA gqa_decode ranks below classic: there its own plan is read),
the partition size in the plan, and the exact reason substrings of each
refusal. Devices: a 10-core M3 (``applegpu_g15g``), a 40-core M5 Max and the H200.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn import compat, diagnostics
from metal_attn._layout import import_builtin_providers
from metal_attn.constants import SCRATCH_CAP_BYTES, SIMDGROUPS_PER_CORE
from metal_attn.device import DeviceInfo
from metal_attn.plugins import get_registry
from metal_attn.request import AttentionRequest
from metal_attn.settings import load_settings, override_settings

M3 = DeviceInfo.preset("m3-10core")
M5 = DeviceInfo.preset("m5-max")
H200 = DeviceInfo.preset("h200")

import_builtin_providers()  # metal_attn.providers, from the install or the source checkout
from metal_attn.providers import gqa_decode as gq  # noqa: E402


def _explain(device: DeviceInfo, seq_lens, *, heads=(32, 8, 128), block_size=16, dtype="bfloat16",
             q_lens=None, **features):
    h, kvh, d = heads
    return ma.explain(
        q_lens=q_lens or [1] * len(seq_lens), seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d,
        block_size=block_size, dtype=dtype, device=device, **features,
    )


def _gqa_row(ex):
    return next(r for r in ex.rows if r.name == "gqa_decode")


def _chosen_partition(ex) -> int | None:
    """The GQA partition size when gqa_decode is chosen, else None."""
    row = _gqa_row(ex)
    if not row.chosen:
        return None
    assert row.plan.route == "gqa_decode"
    return row.plan.partition_size


def _admitted_partition(ex) -> int | None:
    """The partition size in gqa_decode's own plan when it admits, chosen or not (on CUDA it ranks
    below classic), else None."""
    row = _gqa_row(ex)
    return row.plan.partition_size if row.admitted else None


def _reasons(ex) -> str:
    return "\n".join(_gqa_row(ex).reasons)


# -- the budget thresholds (40 cores, 32 heads: P256 from 10,752 tokens, P512 from 21,504) ----------


@pytest.mark.parametrize(
    ("length", "expected"),
    [(10_751, None), (10_752, 256), (21_503, 256), (21_504, 512), (131_072, 512)],
)
def test_m5_max_single_request_thresholds(length, expected):
    ex = _explain(M5, [length])
    assert _chosen_partition(ex) == expected
    if expected is None:
        assert "below the budget 1320 (40 cores x 33)" in _reasons(ex)
        assert ex.chosen is not None and ex.chosen.name != "gqa_decode"
    else:
        assert f"P{expected}:" in " ".join(_gqa_row(ex).plan.notes)


def test_m5_max_plan_grid_and_specialization():
    plan = _gqa_row(_explain(M5, [21_504 + 100])).plan
    parts = -(-(21_504 + 100) // 512)  # 43 launched, 42 complete
    assert plan.grid == (32 * 4 * parts, 8, 1)
    assert plan.threadgroup == (128, 1, 1)
    assert plan.specialization == ("gqa_decode", "metal", "bfloat16", 32, 8, 128, 16, 512)


def test_m3_budget_for_head_256_single_request():
    # 10 cores x 33 = 330 simdgroups; 24 heads need 14 complete partitions.
    assert _chosen_partition(_explain(M3, [3_583], heads=(24, 4, 256))) is None
    assert _chosen_partition(_explain(M3, [3_584], heads=(24, 4, 256))) == 256
    assert _chosen_partition(_explain(M3, [7_167], heads=(24, 4, 256))) == 256
    assert _chosen_partition(_explain(M3, [7_168], heads=(24, 4, 256))) == 512
    # One request: no calibration rule applies however long the row.
    assert _chosen_partition(_explain(M3, [65_536], heads=(24, 4, 256))) == 512


# -- multi-request plans: complete partitions summed over the batch ---------------------------------


def test_partitions_counted_per_request_not_from_total_tokens():
    # 100 rows of 511 tokens: 51,100 tokens in all, but no complete P512 partition at all.
    ex = _explain(M5, [511] * 100)
    assert _chosen_partition(ex) == 256  # 100 complete P256 partitions x 32 heads = 3200
    assert "P256: 100 full partitions x 32 heads = 3200 >= 1320" in " ".join(_gqa_row(ex).plan.notes)
    # 2,600 rows of 255 tokens: no complete partition of either size.
    ex = _explain(M5, [255] * 2_600)
    assert _chosen_partition(ex) is None
    assert "P512: 0 x 32 heads = 0; P256: 0 x 32 heads = 0" in _reasons(ex)


def test_ragged_batch_thresholds_and_grid():
    # Four rows of 2,816 tokens: 4 x 11 = 44 complete P256 partitions -> 1408 >= 1320.
    assert _chosen_partition(_explain(M5, [2_816] * 4)) == 256
    # One token less in each: 4 x 10 = 40 -> 1280 < 1320.
    assert _chosen_partition(_explain(M5, [2_815] * 4)) is None
    # Ragged: the longest row sets the launched partitions, the sum sets the choice.
    lens = [30_000, 100, 5_000, 17]
    ex = _explain(M5, lens)
    assert _chosen_partition(ex) == 512  # (58 + 0 + 9 + 0) x 32 = 2144
    assert _gqa_row(ex).plan.grid == (128 * 59, 8, 4)


def test_mixed_and_prefill_batches_are_refused():
    ex = _explain(M5, [40_000, 40_000], q_lens=[1, 7])
    assert _chosen_partition(ex) is None
    assert "phase=mixed (supported: decode)" in _reasons(ex)
    ex = _explain(M5, [40_000], q_lens=[40_000])
    assert "phase=prefill (supported: decode)" in _reasons(ex)


# -- the 10-core M3 calibration rules (data keyed by device) -------------------------------------------


@pytest.mark.parametrize(
    ("device", "heads", "lens", "expected"),
    [
        (M3, (24, 4, 256), [8_192, 8_192], 256),  # two requests from 8K: P256 preferred
        (M3, (24, 4, 256), [8_191, 8_191], 512),  # just below: the budget's choice
        (M3, (16, 2, 256), [4_096] * 4, 256),  # four requests from 4K
        (M3, (16, 2, 256), [4_096] * 3, 512),  # three requests at 4K: no rule
        (M3, (32, 8, 128), [8_192] * 4, 512),  # head 128: no rule
        (DeviceInfo.preset("m3-max"), (24, 4, 256), [8_192] * 4, 512),  # another device: no rule
        (M3.replace(gpu_cores=8), (24, 4, 256), [8_192] * 4, 512),  # same GPU family, other core count
    ],
)
def test_m3_calibration_rules(device, heads, lens, expected):
    ex = _explain(device, lens, heads=heads)
    assert _chosen_partition(ex) == expected
    notes = " ".join(_gqa_row(ex).plan.notes)
    assert ("calibration prefers P256" in notes) == (device is M3 and expected == 256)


def test_calibration_rules_are_data():
    req = AttentionRequest.from_lengths(q_lens=[1, 1], seq_lens=[9_000, 9_000], backend="metal",
                                        num_heads=24, num_kv_heads=4, head_size=256)
    assert gq.calibration_preference(req, M3) == 256
    assert gq.calibration_preference(req, M5) is None
    custom = ({"architecture": "applegpu_g17s", "gpu_cores": 40, "head_size": 256, "min_seqs": 2,
               "min_max_seq_len": 1, "prefer": 256},)
    assert gq.calibration_preference(req, M5, custom) == 256


# -- the H200 -------------------------------------------------------------------------------------------


def test_h200_budget_is_measured_and_recorded():
    assert "cuda" in SIMDGROUPS_PER_CORE, "the CUDA budget must be measured on the H200 and recorded"
    budget, why = gq.work_budget(H200)
    assert why is None and budget == 132 * SIMDGROUPS_PER_CORE["cuda"]


def _threshold(budget: int, heads: int, p: int) -> int:
    return -(-budget // heads) * p


@pytest.mark.parametrize("heads", [(32, 8, 128), (24, 4, 256), (16, 2, 128)])
def test_h200_thresholds(heads):
    budget = 132 * SIMDGROUPS_PER_CORE["cuda"]
    t256 = _threshold(budget, heads[0], 256)
    t512 = _threshold(budget, heads[0], 512)
    assert _admitted_partition(_explain(H200, [t256 - 1], heads=heads)) is None
    assert _admitted_partition(_explain(H200, [t256], heads=heads)) == 256
    assert _admitted_partition(_explain(H200, [t512 - 1], heads=heads)) == 256
    assert _admitted_partition(_explain(H200, [t512], heads=heads)) == 512


def test_h200_auto_takes_classic_where_gqa_decode_admits():
    """On CUDA gqa_decode ranks below classic (its measured backend_priority): it still admits and
    plans, classic runs; forcing it runs it; on Metal the same request goes to gqa_decode."""
    ex = _explain(H200, [131_072])
    assert _admitted_partition(ex) == 512 and ex.chosen.name == "classic"
    prio = {r.name: r.priority for r in ex.rows}
    assert (prio["gqa_decode"], prio["classic"]) == (5, 10)
    assert [r.name for r in ex.rows].index("classic") < [r.name for r in ex.rows].index("gqa_decode")
    forced = ma.explain(q_lens=[1], seq_lens=[131_072], num_heads=32, num_kv_heads=8, head_size=128,
                        block_size=16, dtype="bfloat16", device=H200, provider="gqa_decode")
    assert forced.chosen.name == "gqa_decode" and forced.chosen.plan.partition_size == 512
    on_metal = _explain(M5, [131_072])
    assert on_metal.chosen.name == "gqa_decode" and _gqa_row(on_metal).priority == 80


def test_h200_unknown_core_count_falls_back():
    ex = _explain(H200.replace(gpu_cores=None), [131_072])
    assert _admitted_partition(ex) is None
    assert "gpu_cores unknown" in _reasons(ex)


# -- declarative refusals ---------------------------------------------------------------------------------


def test_dtype_feature_and_geometry_refusals():
    assert "dtype=float32 (supported: bfloat16, float16)" in _reasons(_explain(M5, [65_536], dtype="float32"))
    assert "sinks given" in _reasons(_explain(M5, [65_536], sinks=True))
    assert "softcap=30 (supported: none)" in _reasons(_explain(M5, [65_536], softcap=30.0))
    assert "sliding_window=4096 (supported: none)" in _reasons(_explain(M5, [65_536], sliding_window=4096))
    r = _reasons(_explain(M5, [65_536], heads=(32, 4, 128)))
    assert "geometry heads/kv_heads/head_size/block_size=32/4/128/bs16 (supported on metal: 32/8/128/bs16" in r
    r = _reasons(_explain(M5, [65_536], block_size=32))
    assert "32/8/128/bs32" in r
    assert _chosen_partition(_explain(M5, [65_536], heads=(16, 2, 256), block_size=32)) == 512
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[65_536], backend="metal", num_heads=32,
                                        num_kv_heads=8, head_size=128, dtype="bfloat16", cache_dtype="float16")
    assert "cache_dtype=float16 (supported: same as dtype=bfloat16)" in _reasons(ma.explain(req, device=M5))


def test_every_refusal_is_listed_at_once():
    ex = _explain(M5, [100], dtype="float32", heads=(32, 4, 128), softcap=5.0)
    reasons = _reasons(ex)
    for part in ("dtype=float32", "softcap=5", "geometry", "below the budget"):
        assert part in reasons


def test_cpu_backend_is_unavailable():
    ex = _explain(DeviceInfo.preset("cpu-2core"), [65_536])
    assert "backend=cpu (supported: cuda, metal)" in _reasons(ex)


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="needs a machine whose MLX has no GPU (the CPU machines here)")
@pytest.mark.parametrize("provider", ["gqa_decode", "classic", "tiled_prefill"])
def test_a_real_gpu_device_without_a_gpu_is_unavailable_to_every_gpu_provider(provider):
    # A device described as Metal but probed here (not a preset): each GPU provider says MLX has no GPU, so
    # explain, `metal-attn providers` and the real call agree (gqa_decode once claimed it was available).
    dev = dataclasses.replace(M5, hypothetical=False)
    row = next(r for r in ma.explain(q_lens=[1] * 4, seq_lens=[3000] * 4, num_heads=32, num_kv_heads=8, head_size=128,
                                     block_size=16, dtype="float16", device=dev).rows if r.name == provider)
    assert "backend=metal: MLX has no usable GPU here" in row.reasons, row.reasons
    listed = next(p for p in ma.providers(dev) if p["name"] == provider)
    assert not listed["available"]


# -- resource caps -----------------------------------------------------------------------------------------


def test_scratch_cap_boundary():
    # 32 heads x 128 x fp32 + 8 = 16,640 bytes per (row, head, partition)... per head: 520 bytes.
    per_row_part = 32 * (128 * 4 + 8)
    max_rows_parts = SCRATCH_CAP_BYTES // per_row_part  # 32,263
    parts = 256  # 131,072 tokens at P512
    fit = max_rows_parts // parts  # 126 rows fit, 127 do not
    assert _chosen_partition(_explain(M5, [131_072] * fit)) == 512
    ex = _explain(M5, [131_072] * (fit + 1))
    assert _chosen_partition(ex) is None
    assert f"split scratch={(fit + 1) * parts * per_row_part} bytes" in _reasons(ex)
    assert f"(allowed: <= {SCRATCH_CAP_BYTES} bytes)" in _reasons(ex)


def test_scratch_is_computed_without_overflow():
    n = 2**31 - 1
    req = AttentionRequest(
        backend="metal", phase=ma.Phase.DECODE, dtype="float16", cache_dtype="float16", num_heads=32,
        num_kv_heads=8, head_size=128, block_size=16, num_seqs=n, total_q_tokens=n, max_q_len=1,
        max_seq_len=n, length_plan=((512, n), (256, 2 * n)), num_decode_seqs=n, max_decode_seq_len=n,
    )
    exact = n * 32 * (-(-n // 512)) * (128 * 4 + 8)
    wrapped = int(np.array([n, 32, -(-n // 512), 520], dtype=np.int64).prod())  # what int64 math gives
    assert exact > 2**63 and wrapped != exact
    assert gq.split_scratch_bytes(n, 32, -(-n // 512), 128) == exact
    reasons = _reasons(ma.explain(req, device=M5))
    assert f"split scratch={exact} bytes" in reasons


def test_reducer_threadgroup_memory_must_fit():
    parts = 131_072 // 512
    need = gq.reducer_threadgroup_bytes(parts)
    assert need >= 2 * parts * 4 and need % 16 == 0
    assert _chosen_partition(_explain(M5.replace(max_threadgroup_memory=need), [131_072])) == 512
    ex = _explain(M5.replace(max_threadgroup_memory=need - 16), [131_072])
    assert _chosen_partition(ex) is None
    assert f"reducer threadgroup memory={need} bytes for {parts} partitions of P512" in _reasons(ex)
    ex = _explain(M5.replace(max_threadgroup_memory=None), [131_072])
    assert "max_threadgroup_memory unknown" in _reasons(ex)


# -- the disable switch and its upstream alias ---------------------------------------------------------------


def test_disable_switch():
    with override_settings(disable_gqa_decode=True):
        ex = _explain(M5, [65_536])
        assert _chosen_partition(ex) is None
        why = "disabled by the disable_gqa_decode setting (its variable: METAL_ATTN_DISABLE_GQA_DECODE=1)"
        assert why in _reasons(ex)
    assert _chosen_partition(_explain(M5, [65_536])) == 512


@pytest.mark.parametrize("var", ["METAL_ATTN_DISABLE_GQA_DECODE", "VLLM_METAL_DISABLE_GQA_DECODE"])
def test_disable_switch_from_environment(monkeypatch, var):
    monkeypatch.setenv(var, "1")
    settings = load_settings()
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[65_536], backend="metal", dtype="bfloat16")
    ex = get_registry().explain(req, M5, settings)
    assert not _gqa_row(ex).admitted
    assert f"disabled by {var}=1" in _reasons(ex)  # the variable the user set
    monkeypatch.setenv(var, "0")
    assert _gqa_row(get_registry().explain(req, M5, load_settings())).chosen


# -- diagnostics: route and partition size recorded through the public call --------------------------------


def test_dispatch_records_route_and_partition(monkeypatch):
    """The kernel is replaced by the reference computation (no GPU here); routing is real."""
    from metal_attn.providers.reference import ReferenceProvider

    ref = ReferenceProvider()
    monkeypatch.setattr(gq.GQADecodeProvider, "availability_reasons", lambda self, device: [])  # a GPU, as if
    monkeypatch.setattr(gq.GQADecodeProvider, "prepare", lambda self, plan, device: None)
    monkeypatch.setattr(gq.GQADecodeProvider, "run", lambda self, inputs, plan: ref.run(inputs, plan))
    rng = np.random.default_rng(0)
    block_size, kvh, d, h = 16, 8, 128, 32
    nb = 700
    k = ma_array(rng.standard_normal((nb, block_size, kvh, d)))
    v = ma_array(rng.standard_normal((nb, block_size, kvh, d)))
    q = ma_array(rng.standard_normal((1, h, d)))
    lens = [10_752]
    table = rng.permutation(nb)[None, : -(-lens[0] // block_size)].astype(np.int32)
    with override_settings(backend_override="metal", gpu_cores=40, gpu_architecture="applegpu_g17s",
                           max_threadgroup_memory=32768):
        diagnostics.reset()
        ma.paged_attention(q, k, v, block_tables=table, seq_lens=lens, cu_seqlens_q=[0, 1])
        rec = diagnostics.last_dispatch()
        assert (rec.provider, rec.route, rec.partition_size) == ("gqa_decode", "gqa_decode", 256)
        assert compat.last_paged_dispatch() == "gqa_decode"
        assert compat.last_gqa_partition_size() == 256
        ma.paged_attention(q, k, v, block_tables=table, seq_lens=[10_751], cu_seqlens_q=[0, 1])
        assert compat.last_paged_dispatch() != "gqa_decode"
        assert compat.last_gqa_partition_size() is None


def ma_array(x):
    import mlx.core as mx

    return mx.array(x.astype(np.float32)).astype(mx.bfloat16)


# -- the Metal generated-source check, for every specialization the provider can choose ------------------

_MSL_PROVIDER = ["gqa_decode"]


def test_msl_specializations_cover_every_choice():
    labels = {s.label for s in gq.GQADecodeProvider().msl_specializations()}
    for heads, kvh, head, block in gq.geometry_table("metal"):
        for dtype in ("float16", "bfloat16"):
            for p in (512, 256):
                assert f"gqa_decode {dtype} {heads}/{kvh}/{head}/bs{block} P{p}" in labels
                assert f"paged_attention_v2_reduce (gqa) {dtype} head={head} P{p}" in labels


def test_metal_generated_source_type_checks(needs_clang):
    from metal_attn.msl_check import check

    result = check(providers=_MSL_PROVIDER)
    assert result.ok, result.summary()
    assert result.count == len(gq.GQADecodeProvider().msl_specializations()) == 28


def test_metal_source_check_catches_a_planted_error(needs_clang, planted_kernels):
    from metal_attn.msl_check import check

    planted = planted_kernels("gqa_decode.metal", "page_next = simd_shuffle(page_after, 0);",
                              "page_next = simd_shuffle(next_page_id, 0);")
    result = check(providers=_MSL_PROVIDER, only=r"gqa_decode bfloat16 24/4/256/bs16 P256", kernels_dir=planted)
    assert not result.ok and "next_page_id" in result.summary()


@pytest.mark.parametrize("tuning", [(6, 1), (0, 0), (32, 0), (8, 2)])
def test_launch_refuses_a_bad_tuning_before_any_kernel(tuning):
    """A sweep's (CHUNK, PREFETCH) override is checked first: CHUNK a multiple of 4 dividing the page."""
    import mlx.core as mx

    from metal_attn.metadata import AttentionMetadata

    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 1])
    q = mx.zeros((1, 32, 128), mx.bfloat16)
    kc = mx.zeros((1, 16, 8, 128), mx.bfloat16)
    with pytest.raises(ValueError, match=r"tuning=\(.*CHUNK a multiple of 4 dividing block_size=16"):
        gq.launch(q, kc, kc, md, scale=1.0, partition_size=512, backend="cuda", tuning=tuning)
