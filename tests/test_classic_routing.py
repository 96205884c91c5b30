"""Routing of the ``classic`` provider on the GPU backends (device probe overridden), its
admission reasons, the split gate arithmetic in ``explain``, and the CPU delegation."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import metal_attn
from metal_attn.constants import PARTITION_SIZE, SPLIT_GATE_FACTOR
from metal_attn.device import DeviceInfo
from metal_attn.settings import Settings, get_settings, override_settings


def _classic_row(**kw):
    kw.setdefault("num_heads", 8)
    kw.setdefault("num_kv_heads", 2)  # not a GQA decode geometry: classic is chosen
    kw.setdefault("head_size", 128)
    kw.setdefault("block_size", 16)
    kw.setdefault("dtype", "bfloat16")
    device = kw.pop("device", "m5-max")
    ex = metal_attn.explain(device=device, **kw)
    row = next(r for r in ex.rows if r.name == "classic")
    return ex, row


def test_small_decode_grid_splits_with_gate_arithmetic():
    ex, row = _classic_row(q_lens=[1], seq_lens=[8192])
    assert row.admitted and row.chosen, str(ex)
    assert row.plan.route == "per_token_ps512" and row.plan.partition_size == PARTITION_SIZE
    notes = " | ".join(row.plan.notes)
    assert "num_heads*total_q_tokens=8*1=8 < 8*gpu_cores=8*40=320" in notes
    assert "partitions=ceil(max_seq_len/512)=ceil(8192/512)=16 >= 2" in notes
    assert row.plan.grid == (8 * 128, 1, 16)  # Metal: one threadgroup (4 simdgroups) per head
    assert "split gate" in str(ex)


def test_full_grid_does_not_split():
    _, row = _classic_row(q_lens=[1] * 40, seq_lens=[8192] * 40)
    assert row.plan.route == "per_token_ps0" and row.plan.partition_size == 0
    assert "num_heads*total_q_tokens=8*40=320 >= 8*gpu_cores=8*40=320" in " ".join(row.plan.notes)
    assert row.plan.grid == (8 * 128, 40, 1)
    # On the H200 (which splits: 2,048-token partitions, 2.4 KV items a core, a small grid) the four query
    # heads of a KV head share a threadgroup (staged loads, the keys as the rows of matrix products, 64
    # threads): 8 heads, 2 threadgroups.
    _, row = _classic_row(q_lens=[1] * 40, seq_lens=[8192] * 40, device="h200")
    notes = " ".join(row.plan.notes)
    assert row.plan.grid[0] == 2 * 64 and "heads_per_threadgroup=4 as the columns of 16x8 matrix products" in notes
    assert "staged chunks of 32 tokens, 2 in flight" in notes


def test_single_partition_does_not_split():
    _, row = _classic_row(q_lens=[1], seq_lens=[PARTITION_SIZE])
    assert row.plan.route == "per_token_ps0"
    assert "=1 < 2" in " ".join(row.plan.notes)
    _, row = _classic_row(q_lens=[1], seq_lens=[PARTITION_SIZE + 1])
    assert row.plan.route == "per_token_ps512"


def test_core_count_changes_the_gate():
    # 10-core M3: threshold 80; 8 heads x 12 rows = 96 -> no split; on a 40-core chip -> split.
    _, small = _classic_row(q_lens=[1] * 12, seq_lens=[4096] * 12, device="m3-10core")
    _, large = _classic_row(q_lens=[1] * 12, seq_lens=[4096] * 12, device="m5-max")
    assert small.plan.route == "per_token_ps0" and large.plan.route == "per_token_ps512"


def test_unknown_core_count_fails_closed():
    dev = DeviceInfo.preset("m5-max").replace(gpu_cores=None)
    _, row = _classic_row(q_lens=[1], seq_lens=[8192], device=dev)
    assert row.plan.route == "per_token_ps0"
    assert "gpu_cores unknown" in " ".join(row.plan.notes)


def test_scratch_cap_blocks_split():
    dev = DeviceInfo.preset("m5-max").replace(gpu_cores=4096)
    _, row = _classic_row(q_lens=[1] * 64, seq_lens=[200_000] * 64, num_heads=64, num_kv_heads=8, device=dev)
    assert row.plan.route == "per_token_ps0"
    assert "> cap 536870912" in " ".join(row.plan.notes)


def test_cuda_gate_uses_its_own_factor():
    assert "cuda" in SPLIT_GATE_FACTOR, "the CUDA split factor is measured (docs/bench-h200-classic.md)"
    k = SPLIT_GATE_FACTOR["cuda"]
    _, row = _classic_row(q_lens=[1], seq_lens=[8192], device="h200")
    assert f"{k}*gpu_cores={k}*132={k * 132}" in " ".join(row.plan.notes)


def test_mixed_and_prefill_batches_are_admitted():
    for q_lens, seq_lens in (([1, 1, 30], [100, 900, 600]), ([64, 20], [64, 1000])):
        _, row = _classic_row(q_lens=q_lens, seq_lens=seq_lens)
        assert row.admitted, row.reasons


@pytest.mark.parametrize("device", ["m5-max", "h200"])
def test_every_reason_names_value_and_allowed_set(device):
    _, row = _classic_row(q_lens=[1], seq_lens=[100], head_size=72, block_size=12, device=device)
    backend = DeviceInfo.preset(device).backend
    assert not row.admitted
    assert f"head_size=72 (supported on {backend}: 64, 80, 96, 112, 128, 192, 256)" in row.reasons
    assert f"block_size=12 (supported on {backend}: 8, 16, 32)" in row.reasons


@pytest.mark.parametrize("head", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_admission_table(head, dtype):
    _, row = _classic_row(q_lens=[1, 3], seq_lens=[40, 700], head_size=head, dtype=dtype, device="h200")
    assert row.admitted, row.reasons


def test_features_admitted():
    _, row = _classic_row(q_lens=[1], seq_lens=[5000], sinks=True, sliding_window=128, softcap=30.0)
    assert row.admitted, row.reasons


def test_disable_toggle_is_a_reason():
    from metal_attn.settings import override_settings

    with override_settings(disabled_providers=("classic",)):
        _, row = _classic_row(q_lens=[1], seq_lens=[100])
    assert not row.admitted and any("METAL_ATTN_DISABLED_PROVIDERS" in r for r in row.reasons)


def test_lanes_per_token_geometry():
    from metal_attn.providers.gpu_common import Geometry, geometry

    # Metal (upstream's shape): lanes take whole 4-element vectors, at most 8 per token; unroll 2 up
    # to 16 elements per lane; one head per threadgroup whatever the GQA group.
    assert geometry(128, "bfloat16") == Geometry(8, 2, 1)
    assert geometry(128, "bfloat16", "metal", group=4) == Geometry(8, 2, 1)
    assert geometry(80, "float16") == Geometry(4, 1, 1)  # 20 vectors: 4 lanes x 5 vectors
    assert geometry(112, "float32") == Geometry(4, 1, 1)
    assert geometry(256, "float16") == Geometry(8, 1, 1)
    assert geometry(64, "float32") == Geometry(8, 2, 1)
    # CUDA (H200), direct loads: 16 elements per lane where the vectors allow it, two heads of a GQA
    # group per threadgroup (heads x elements <= 32), 2 tokens unrolled on the unsplit route only;
    # groups below 4 and head sizes the staging sweep did not measure.
    assert geometry(128, "bfloat16", "cuda", group=1) == Geometry(8, 2, 1)
    assert geometry(128, "bfloat16", "cuda", group=2, split=True) == Geometry(8, 1, 2)
    assert geometry(128, "bfloat16", "cuda", group=3) == Geometry(8, 2, 1)
    assert geometry(64, "float16", "cuda", group=4) == Geometry(4, 2, 2)
    assert geometry(80, "float16", "cuda", group=4) == Geometry(4, 1, 1)  # 20 elements a lane: one head
    assert geometry(96, "float16", "cuda", group=4) == Geometry(4, 1, 1)  # 24 elements a lane
    assert geometry(192, "bfloat16", "cuda", group=6) == Geometry(8, 1, 1)  # 48 vectors: 8 lanes x 6
    # CUDA, groups >= 4 at heads 128 and 256: the whole group (up to 8 heads) in one threadgroup.
    # 16-bit types take the matrix path (heads as the rows of 8x8 products): 128 threads and
    # chunks of 32 tokens where two fit in 40 KiB (head 128), else 64 threads and chunks of 16; the
    # staged rows unpadded and swizzled (the last field; Metal pads them instead).
    assert geometry(128, "bfloat16", "cuda", group=4) == Geometry(8, 1, 4, 4, 32, 2, 1, 128, 16, 1)
    assert geometry(128, "float16", "cuda", group=8, split=True, kv_items_per_core=8.0) == Geometry(
        8, 1, 8, 8, 32, 2, 1, swizzle=1)
    # on grids of fewer than 6 threadgroups a core, head 128, partitions of at most 2,048 tokens: the keys
    # as rows (64 threads, chunks of 32)
    assert geometry(128, "float16", "cuda", group=8, split=True, kv_items_per_core=1.0, kv_tokens=2048) == Geometry(
        8, 1, 8, 8, 32, 2, 2, 64, swizzle=1)
    assert geometry(128, "float16", "cuda", group=8, split=True, kv_items_per_core=1.0, kv_tokens=4096).mma == 1
    assert geometry(256, "bfloat16", "cuda", group=6, split=True) == Geometry(16, 1, 6, 6, 16, 2, 1, 64, swizzle=1)
    assert geometry(128, "float16", "cuda", group=16) == Geometry(8, 1, 8, 8, 32, 2, 1, swizzle=1)  # divisor <= 8
    # float32 stages per-token loads: two heads a simdgroup (unroll 2) unless a split grid is
    # small (< 6 threadgroups a core: one head, unroll 4); chunks halved until two fit in 40 KiB.
    assert geometry(128, "float32", "cuda", group=4) == Geometry(8, 2, 4, 2, 16, 2)
    assert geometry(128, "float32", "cuda", group=4, split=True, kv_items_per_core=31.0) == Geometry(8, 2, 4, 2, 16, 2)
    assert geometry(128, "float32", "cuda", group=4, split=True, kv_items_per_core=3.9) == Geometry(8, 4, 4, 1, 16, 2)
    assert geometry(128, "float32", "cuda", group=4, split=False, kv_items_per_core=3.9) == Geometry(8, 2, 4, 2, 16, 2)
    # group 8: eight heads need two a simdgroup (unroll 2) even on a small grid
    assert geometry(128, "float32", "cuda", group=8, split=True, kv_items_per_core=1.0) == Geometry(8, 2, 8, 2, 16, 2)
    # head 256, group 6: three heads a simdgroup (6 / 3 = 2 simdgroups across heads), chunks of 8
    assert geometry(256, "float32", "cuda", group=6, split=True, kv_items_per_core=3.9) == Geometry(16, 2, 6, 3, 8, 2)
    with pytest.raises(ValueError, match="head_size=66"):
        geometry(66, "float16")


def test_cpu_backend_is_delegated(monkeypatch):
    import metal_attn.providers.classic as classic

    calls = []

    class FakeCpu:
        @staticmethod
        def availability_reasons(device):
            calls.append("availability")
            return []

        @staticmethod
        def not_supported_reasons(request, device, settings):
            calls.append("not_supported")
            return ["head_size=1000 (supported on cpu: fake)"] if request.head_size == 1000 else []

        @staticmethod
        def plan(request, device, settings):
            calls.append("plan")
            return metal_attn.Plan(provider="classic", route="per_token_ps0", specialization=("fake",))

    monkeypatch.setattr(classic.ClassicProvider, "_cpu", lambda self: (FakeCpu, None))
    p = classic.ClassicProvider()
    dev = DeviceInfo.preset("cpu-2core")
    req = metal_attn.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[10], backend="cpu", head_size=1000)
    assert p.not_supported_reasons(req, dev, get_settings()) == ["head_size=1000 (supported on cpu: fake)"]
    req = metal_attn.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[10], backend="cpu")
    assert p.not_supported_reasons(req, dev, get_settings()) == []
    assert p.plan(req, dev, get_settings()).specialization == ("fake",)
    assert p.availability_reasons(dev) == []
    assert calls == ["not_supported", "not_supported", "plan", "availability"]


def test_cpu_module_missing_is_an_availability_reason(monkeypatch):
    import metal_attn.providers.classic as classic

    monkeypatch.setattr(classic, "_CPU_MODULE", "metal_attn.providers.classic.no_such_module")
    p = classic.ClassicProvider()
    dev = DeviceInfo.preset("cpu-2core")
    reasons = p.availability_reasons(dev)
    assert len(reasons) == 1 and "cpu backend not available" in reasons[0] and "no_such_module" in reasons[0]
    req = metal_attn.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[10], backend="cpu")
    assert any("could not be imported" in r for r in p.not_supported_reasons(req, dev, get_settings()))


@pytest.mark.parametrize(("geo", "prefetch"), [((3, 1, 1), 0), ((8, 0, 1), 0), ((8, 1, 3), 0), ((8, 1, 2), 2)])
def test_launch_refuses_a_bad_geometry_before_any_kernel(geo, prefetch):
    """Sweep overrides are checked first: lanes a power of two dividing head/4, unroll >= 1,
    heads per threadgroup dividing the GQA group (here 4), prefetch 0 or 1."""
    import mlx.core as mx
    import numpy as np
    from metal_attn.providers import gpu_common as gc

    from metal_attn.metadata import AttentionMetadata

    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 1])
    q = mx.zeros((1, 8, 128), mx.bfloat16)
    kc = mx.zeros((1, 16, 2, 128), mx.bfloat16)
    with pytest.raises(ValueError, match=r"geometry_override=|prefetch=2"):
        gc.launch_paged(q, kc, kc, md, scale=1.0, sinks=None, sliding_window=None, softcap=None,
                        partition_size=0, backend="cuda", geometry_override=gc.Geometry(*geo), prefetch=prefetch)


@pytest.mark.parametrize(("geo", "head", "group", "itemsize", "backend", "needle"), [
    ((8, 1, 4, 4, 32, 2, 1), 128, 4, 4, "cuda", "itemsize=4"),          # the matrix path is 16-bit only
    ((8, 1, 4, 2, 32, 2, 1), 128, 4, 2, "cuda", "hps=4, hpw=2"),        # every head in one row block
    ((8, 1, 8, 8, 0, 2, 1), 128, 8, 2, "cuda", "mma=1"),                # staged only
    ((4, 1, 4, 4, 32, 2, 1), 80, 4, 2, "cuda", "head_size=80"),         # whole 32-column fragment loads
    ((8, 1, 4, 4, 32, 2, 1), 128, 4, 2, "metal", "on metal"),           # 34 KiB of chunks: not on Apple
    ((8, 1, 4, 4, 32, 2, 1, 96), 128, 4, 2, "cuda", "threads=96"),
    ((8, 1, 4, 4, 16, 2, 1, 128), 128, 4, 2, "cuda", "stage=16"),       # 4 simdgroups x 8 tokens a pass
])
def test_geometry_problem_names_what_the_matrix_path_needs(geo, head, group, itemsize, backend, needle):
    from metal_attn.providers import gpu_common as gc

    problem = gc.geometry_problem(gc.Geometry(*geo), head, group, itemsize, backend)
    assert problem is not None and needle in problem, problem


def test_matrix_path_geometries_are_valid_where_the_rule_gives_them():
    from metal_attn.providers import gpu_common as gc

    for dtype in ("float16", "bfloat16"):
        for head in (128, 256):
            for group in (4, 6, 8, 16):
                for items in (4.0, 8.0):  # the keys as rows at head 128 on the small grid
                    geo = gc.geometry(head, dtype, "cuda", group, split=True, kv_items_per_core=items,
                                      kv_tokens=512)
                    hps = max(d for d in range(1, 9) if group % d == 0)
                    assert geo.mma == (2 if head == 128 and items * group / hps < 6 else 1)
                    assert geo.hps == geo.hpw == hps
                    assert gc.geometry_problem(geo, head, group, 2, "cuda") is None
                    assert geo.stage % geo.tokens_per_pass == 0


def test_plan_specialization_reaches_the_launch(monkeypatch):
    """Host side of a planned launch, with the kernels replaced by recorders: the plan's geometry
    and grid are what the kernel receives, a split plan goes through the reducer, ``rows`` launches
    only the first rows, and `launch_geometry` (bare launches, sweeps) agrees with the plan."""
    import mlx.core as mx
    import numpy as np
    from metal_attn.providers import gpu_common as gc
    from metal_attn.providers.classic import gpu

    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs

    calls = []

    kernel_geometries = []

    def recorder(name):
        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            calls.append((name, dict(template), grid, threadgroup))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return kernel

    def paged_kernel(backend, split, geo):
        kernel_geometries.append(geo)  # the code path (defines) is chosen from it
        return recorder(f"paged split={int(split)}")

    monkeypatch.setattr(gc.per_token, "per_token_kernel", paged_kernel)
    monkeypatch.setattr(gc.reducer, "reducer_kernel", lambda backend: recorder("reduce"))
    batch, ctx, heads, kv_heads = 8, 4096, 32, 8
    _, row = _classic_row(q_lens=[1] * batch, seq_lens=[ctx] * batch, device="h200", num_heads=heads,
                          num_kv_heads=kv_heads)
    plan = row.plan
    assert plan.route == "per_token_ps512"
    nblk = ctx // 16
    md = AttentionMetadata.build(np.arange(batch * nblk, dtype=np.int32).reshape(batch, nblk), [ctx] * batch,
                                 list(range(batch + 1)))
    q = mx.zeros((batch, heads, 128), mx.bfloat16)
    kc = mx.zeros((batch * nblk, 16, kv_heads, 128), mx.bfloat16)
    inputs = AttentionInputs(q, kc, kc, md, scale=1.0)

    out = gpu.run(inputs, plan)
    assert out.shape == (batch, heads, 128) and out.dtype == mx.bfloat16
    (name, template, grid, threadgroup), (reduce_name, _, reduce_grid, reduce_threadgroup) = calls
    geo = gc.plan_geometry(plan.specialization)
    assert name == "paged split=1" and reduce_name == "reduce"
    assert kernel_geometries == [geo] and geo.mma == 2 and geo.stage > 0  # the keys as rows (a small grid), staged
    assert grid == plan.grid and reduce_grid == (heads * gc.NUM_THREADS, batch, 1)
    assert threadgroup == plan.threadgroup == (geo.threads, 1, 1) and reduce_threadgroup == (gc.NUM_THREADS, 1, 1)
    assert (template["TPT"], template["UNROLL"], template["HPS"], template["HPW"], template["STAGE"],
            template["STAGES"]) == (geo.lanes, geo.unroll, geo.hps, geo.hpw, geo.stage, geo.stages)
    assert template["PREFETCH"] == gc.PREFETCH_NEXT["cuda"]
    assert template["STAGE_PAD"] == geo.row_pad == 0 and geo.swizzle == 1  # CUDA: unpadded, swizzled rows

    calls.clear()
    out = gc.run_per_token(inputs, plan.specialization, rows=3)
    assert out.shape == (3, heads, 128) and calls[0][2] == (plan.grid[0], 3, plan.grid[2])
    assert kernel_geometries == [geo, geo]

    # A bare launch without an override takes the plan's geometry, with the device's core count:
    # float32's staged per-token path picks its heads per simdgroup by threadgroups per core.
    with override_settings(gpu_cores=132):
        assert gc.launch_geometry(q, kc, md, partition_size=512, backend="cuda") == geo
    q32, kc32 = q.astype(mx.float32), kc.astype(mx.float32)
    by_cores = {}
    for cores in (132, 16):
        with override_settings(gpu_cores=cores):
            by_cores[cores] = gc.launch_geometry(q32, kc32, md, partition_size=512, backend="cuda")
        items = gc.kv_items_per_core(kv_heads, batch, ctx // 512, cores)
        assert by_cores[cores] == gc.geometry(128, "float32", "cuda", heads // kv_heads, True, items)
    assert by_cores[132] != by_cores[16]


# -- the partition size of split launches (PARTITION_RULES) ----------------------------------------


def _cuda_plan(q_lens, seq_lens, **kw):
    _, row = _classic_row(q_lens=q_lens, seq_lens=seq_lens, num_heads=32, num_kv_heads=8, device="h200", **kw)
    return row.plan


def test_the_shipped_rules_say_why():
    from metal_attn.providers import gpu_common as gc

    assert set(gc.PARTITION_RULES["cuda"].sizes) <= set(gc.PER_TOKEN_PARTITION_SIZES)
    assert gc.PARTITION_RULES["metal"].sizes == (PARTITION_SIZE,)
    for backend, rule in gc.PARTITION_RULES.items():
        assert rule.evidence, backend


def test_a_small_launch_takes_the_largest_size_that_fills_the_gpu():
    with override_settings(gpu_cores=132):  # a fresh epoch: no plan cached from another test
        plan = _cuda_plan([1], [600])
    assert (plan.route, plan.partition_size, plan.grid[2]) == ("per_token_ps64", 64, 10)
    notes = " | ".join(plan.notes)
    assert "partitions=ceil(max_seq_len/512)=ceil(600/512)=2 >= 2" in notes  # the gate still decides at 512
    assert "partition size 64: KV items 8*1*10=80 < 1*gpu_cores=132" in notes
    with override_settings(gpu_cores=132):
        assert _cuda_plan([1], [8192]).partition_size == 256  # 8*32 = 256 items
        assert _cuda_plan([1], [32768]).partition_size == 512  # 8*64 = 512 items already
        assert _cuda_plan([1] * 8, [4096] * 8).partition_size == 512
        assert _cuda_plan([1] * 4, [1024] * 4).partition_size == 128  # 8*4*4 = 128 < 132 <= 8*4*8


def test_long_contexts_over_many_rows_take_partitions_above_512():
    """A size above 512 needs two KV items per core and two partitions; else the sizes up to 512."""
    with override_settings(gpu_cores=132):
        plan = _cuda_plan([1] * 8, [32768] * 8)
        assert (plan.route, plan.partition_size, plan.grid[2]) == ("per_token_ps4096", 4096, 8)
        assert "partition size 4096: KV items 8*8*8=512 >= 2*gpu_cores=264" in " | ".join(plan.notes)
        assert _cuda_plan([1] * 32, [4096] * 32).partition_size == 2048  # 4096 would be one partition
        assert _cuda_plan([1] * 8, [4096] * 8).partition_size == 512  # 8*8*4 = 256 < 264 at 1024
        assert _cuda_plan([1], [32768]).partition_size == 512  # 8*1*32 = 256 < 264 at 1024


def test_a_one_size_rule_says_so(monkeypatch):
    from metal_attn.providers import gpu_common as gc

    monkeypatch.setitem(gc.PARTITION_RULES, "cuda", gc.PartitionRule((PARTITION_SIZE,), 1.0, "test"))
    with override_settings(gpu_cores=132):
        plan = _cuda_plan([1], [600])
    assert (plan.route, plan.partition_size) == ("per_token_ps512", 512)
    assert "partition size 512 (PARTITION_RULES[cuda]: one size)" in " | ".join(plan.notes)


def test_metal_keeps_upstreams_partitions():
    _, row = _classic_row(q_lens=[1], seq_lens=[600])
    assert row.plan.partition_size == 512
    assert "PARTITION_RULES[metal]: one size" in " ".join(row.plan.notes)


def test_the_partition_size_can_be_forced():
    with override_settings(partition_size=128):
        plan = _cuda_plan([1] * 8, [4096] * 8)
    assert (plan.route, plan.partition_size, plan.grid[2]) == ("per_token_ps128", 128, 32)
    assert "forced by METAL_ATTN_PARTITION_SIZE=128" in " ".join(plan.notes)
    with override_settings(partition_size=64):
        assert _cuda_plan([1], [400]).partition_size == 0  # the gate still needs two 512-token partitions


def test_partition_sizes_respect_the_scratch_cap(monkeypatch):
    from metal_attn.providers import gpu_common as gc

    from metal_attn.request import AttentionRequest, split_scratch_bytes

    # One request at 600 tokens wants 64-token partitions; with a cap that holds 256-token partitions
    # but not 128 the rule takes 256, the smallest that fits.
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[600], backend="cuda", dtype="bfloat16",
                                        num_heads=32, num_kv_heads=8)
    monkeypatch.setattr(gc.per_token, "SCRATCH_CAP_BYTES", split_scratch_bytes(1, 32, req.partitions(256), 128))
    size, note = gc.partition_choice(req, DeviceInfo.preset("h200"), get_settings())
    assert size == 256, note


def test_a_forced_size_never_exceeds_the_scratch_cap(monkeypatch):
    from metal_attn.providers import gpu_common as gc

    from metal_attn.request import AttentionRequest, split_scratch_bytes

    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[600], backend="cuda", dtype="bfloat16",
                                        num_heads=32, num_kv_heads=8)
    monkeypatch.setattr(gc.per_token, "SCRATCH_CAP_BYTES", split_scratch_bytes(1, 32, req.partitions(128), 128))
    with override_settings(partition_size=64):
        size, note = gc.partition_choice(req, DeviceInfo.preset("h200"), get_settings())
    assert size == 128 and "64 would exceed the" in note, note


def test_the_matrix_paths_row_padding_is_a_toggle():
    """``METAL_ATTN_MMA_STAGE_PAD``: the matrix path's staged rows padded by 32 bytes instead of 16
    (an A/B toggle where the rows are not swizzled: Metal, or CUDA with the swizzle off), in the plan's
    geometry and its threadgroup memory; the scalar path keeps 64."""
    from metal_attn.providers import gpu_common as gc

    base = gc.geometry(128, "bfloat16", "cuda", 4, True, 4.0, mma_stage_swizzle=False)
    padded = gc.geometry(128, "bfloat16", "cuda", 4, True, 4.0, mma_stage_pad=32, mma_stage_swizzle=False)
    with override_settings(mma_stage_pad=32, mma_stage_swizzle=False):
        assert gc.plan_geometry(_cuda_plan([1] * 8, [4096] * 8).specialization).stage_pad == 32  # the plan carries it
    assert (base.mma, base.stage_pad, padded.stage_pad) == (1, 16, 32)
    assert padded.stage_bytes(128, 2) - base.stage_bytes(128, 2) == base.stages * 2 * base.stage * 16
    assert gc.Geometry(8, 2, 4, 2, 32, 2).stage_pad == 64
    assert "stage_pad=8 (allowed: a positive multiple of 16" in gc.geometry_problem(
        gc.Geometry(8, 1, 4, 4, 32, 2, mma=1, stage_pad=8), 128, 4, 2, "cuda")


def test_the_matrix_paths_rows_are_swizzled_on_cuda_by_default():
    """``METAL_ATTN_MMA_STAGE_SWIZZLE`` (on by default): on CUDA the matrix path stages unpadded rows with
    swizzled pieces (the plan's geometry, its threadgroup memory, the kernel's template and defines,
    explain's note), and 0 gives the padded rows back; where the swizzle cannot apply (Metal, the scalar
    path, rows of fewer than eight 16-byte pieces) the geometry says why, and the padded rows run."""
    from metal_attn.providers import gpu_common as gc

    base = gc.geometry(128, "bfloat16", "cuda", 4, True, 4.0, mma_stage_swizzle=False)
    swz = gc.geometry(128, "bfloat16", "cuda", 4, True, 4.0)
    # geometry()'s own default (for callers without settings: cuda_check's sources) is the setting's
    assert inspect.signature(gc.geometry).parameters["mma_stage_swizzle"].default is \
        Settings.model_fields["mma_stage_swizzle"].default is True
    assert (base.swizzle, base.row_pad, swz.swizzle, swz.row_pad) == (0, 16, 1, 0)
    assert base.stage_bytes(128, 2) - swz.stage_bytes(128, 2) == base.stages * 2 * base.stage * 16
    assert dict(gc.paged_template("bfloat16", 128, 16, 512, swz, 1))["STAGE_PAD"] == 0
    assert dict(gc.paged_defines(True, swz))["PA_SWIZZLE"] == 1
    assert dict(gc.paged_defines(True, base))["PA_SWIZZLE"] == 0
    plan = _cuda_plan([1] * 8, [4096] * 8)
    assert gc.plan_geometry(plan.specialization).swizzle == 1
    assert any("rows unpadded and swizzled" in n for n in plan.notes), plan.notes
    with override_settings(mma_stage_swizzle=False):
        padded = _cuda_plan([1] * 8, [4096] * 8)
    assert gc.plan_geometry(padded.specialization).row_pad == 16
    assert not any("swizzled" in n for n in padded.notes), padded.notes
    # Where it does not apply: Metal keeps its padded rows; the scalar path and short rows are refused.
    assert gc.geometry(128, "bfloat16", "metal", 4, True, 4.0, mma_stage_swizzle=True).swizzle == 0
    assert gc.geometry(32, "bfloat16", "cuda", 4, True, 4.0, mma_stage_swizzle=True).swizzle == 0
    scalar = gc.Geometry(8, 2, 4, 2, 32, 2, swizzle=1)
    for geo, head, backend in ((swz, 128, "metal"), (scalar, 128, "cuda"), (swz, 32, "cuda")):
        problem = gc.geometry_problem(geo, head, 4, 2, backend)
        assert problem and problem.startswith("swizzle=1 (allowed: 0, or 1 on the matrix path"), problem


def test_the_key_rows_matrix_path_is_a_cuda_toggle():
    """``METAL_ATTN_MMA_KEY_ROWS`` (on by default): on CUDA, on grids of fewer than 6 threadgroups a GPU
    core, 16-bit heads of 128 with groups of 4 to 8 take the keys-as-rows path (64 threads, chunks of 32 =
    two simdgroups of 16 keys, swizzled rows, Q in registers: no Q operands in threadgroup memory), through
    the plan, the kernel's defines and explain's note. Where it cannot apply the heads-as-rows path runs:
    larger grids, head 256 (its two chunks of 32 would take 64 KiB), float32, groups under 4, padded rows
    (``METAL_ATTN_MMA_STAGE_SWIZZLE=0``), Metal (the geometry says why)."""
    from metal_attn.providers import gpu_common as gc

    assert Settings.model_fields["mma_key_rows"].default is True
    assert inspect.signature(gc.geometry).parameters["mma_key_rows"].default is True
    def geo(items=4.0, tokens=512, **kw):
        return gc.geometry(128, kw.pop("dtype", "bfloat16"), kw.pop("backend", "cuda"), kw.pop("group", 4),
                           kw.pop("split", True), items, kv_tokens=tokens, **kw)

    assert geo(mma_key_rows=False).mma == 1  # the toggle off
    assert geo(items=8.0).mma == 1  # a large grid: heads as rows
    assert geo(items=None).mma == 1  # cores unknown: taken as large
    assert geo(tokens=4096).mma == 1 and geo(tokens=None).mma == 1  # long (or unknown) partitions
    assert geo(split=False, tokens=8192).mma == 1  # an unsplit row walks all its tokens
    assert geo(mma_stage_swizzle=False).mma == 1  # padded rows
    key_rows = geo(tokens=2048)
    assert key_rows == gc.Geometry(8, 1, 4, 4, 32, 2, 2, 64, 16, 1)
    assert key_rows.tokens_per_pass == 32 and key_rows.token_simdgroups == 2
    assert geo(items=0.5, dtype="float16", group=8, split=False, tokens=1000).mma == 2
    assert geo(items=0.5, dtype="float16", group=6, split=False, tokens=1000).hps == 6
    assert gc.geometry(256, "bfloat16", "cuda", 4, True, 4.0, kv_tokens=512).mma == 1
    assert geo(dtype="float32").mma == 0 and geo(group=2).mma == 0 and geo(backend="metal").mma == 0
    # Q stays in registers and the merge reuses the stages: the threadgroup memory is the stages alone;
    # three chunks of 32 (48 KiB) exceed the 40 KiB stage budget, which leaves the fused reducer its scratch
    assert key_rows.threadgroup_bytes(128, 2, "cuda") == key_rows.stage_bytes(128, 2) == 32 * 1024
    three = dataclasses.replace(key_rows, stages=3)
    assert "stage=32 stages=3: 49152 bytes of threadgroup memory on cuda (allowed: <= 40960)" in gc.geometry_problem(
        three, 128, 4, 2, "cuda")
    # the swizzle needs rows of whole groups of 8 pieces (head 96: 12 pieces, XOR by row % 8 leaves the row)
    assert "rows of whole groups of eight 16-byte pieces (head_size=96" in gc.geometry_problem(
        gc.Geometry(8, 1, 4, 4, 32, 2, 2, 64, swizzle=1), 96, 4, 2, "cuda")
    assert "allowed on cuda (backend=metal) with swizzled rows" in gc.geometry_problem(
        dataclasses.replace(key_rows, swizzle=0), 128, 4, 2, "metal")
    assert "swizzled rows (swizzle=0) only" in gc.geometry_problem(dataclasses.replace(key_rows, swizzle=0), 128, 4,
                                                                   2, "cuda")
    with override_settings(mma_key_rows=True):
        plan = _cuda_plan([1] * 8, [4096] * 8)
    assert gc.plan_geometry(plan.specialization).mma == 2
    assert dict(gc.paged_defines(True, gc.plan_geometry(plan.specialization)))["PA_MMA"] == 2
    assert any("with the keys as rows" in n for n in plan.notes), plan.notes


def test_the_plan_says_why_the_keys_as_rows_were_taken_or_not():
    """explain's notes give the keys-as-rows rule's arithmetic and verdict wherever the matrix path runs: taken
    on a small grid of short partitions; not taken outside the rule (long partitions, large grids), with the
    toggle off, or where no launch fits (head 256); no such note off the matrix path (float32, Metal)."""
    def note(**kw):
        _, row = _classic_row(device=kw.pop("device", "h200"), **kw)
        return [n for n in row.plan.notes if n.startswith("keys as rows:")]

    b8 = dict(q_lens=[1] * 8, num_heads=32, num_kv_heads=8)
    assert note(seq_lens=[4096] * 8, **b8) == [
        "keys as rows: threadgroups per core 3.88 < key_rows_max_per_core=6, KV tokens a threadgroup walks 512 "
        "<= key_rows_max_tokens=2048 -> taken"]
    assert note(seq_lens=[32768] * 8, **b8)[0].endswith("4096 > key_rows_max_tokens=2048 -> not taken: outside "
                                                          "the rule")
    assert "7.76 >= key_rows_max_per_core=6" in note(q_lens=[1] * 64, seq_lens=[8192] * 64, num_heads=32,
                                                   num_kv_heads=8)[0]
    with override_settings(mma_key_rows=False):
        assert note(seq_lens=[4096] * 8, **b8)[0].endswith("-> not taken: METAL_ATTN_MMA_KEY_ROWS=0")
    assert note(q_lens=[1], seq_lens=[65536], num_heads=24, num_kv_heads=4, head_size=256)[0].endswith(
        "not taken: no launch of key_rows_launches=[(64, 32, 2)] fits head_size=256")
    assert note(seq_lens=[4096] * 8, dtype="float32", **b8) == []
    assert note(seq_lens=[4096] * 8, device="m5-max", **b8) == []


def test_a_grid_exactly_at_the_core_count_takes_the_larger_partition():
    """4 KV heads x 1 row x 33 partitions of 512 = 132 work items, the H200's 132 cores: enough for 512."""
    _, row = _classic_row(q_lens=[1], seq_lens=[16500], num_heads=16, num_kv_heads=4, device="h200")
    assert row.plan.partition_size == 512
