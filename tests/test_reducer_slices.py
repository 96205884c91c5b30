"""The split-KV reducer's partition slices: the rule's arithmetic (data), the setting that forces them,
and what a launch passes the kernel. The kernel's sums against the float64 oracle are GPU tests
(tests/gpu/test_classic_gpu.py::test_reducer_slices_match_oracle)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_attn.providers import gpu_common as gc

import metal_attn
from metal_attn.settings import SettingsError, override_settings


@pytest.mark.parametrize(("rows", "heads", "parts", "cores", "want"), [
    (1, 24, 128, 132, 4),    # b1 24/4/256 L65536 at 512-token partitions: 24 threadgroups on 132 cores
    (1, 32, 64, 132, 4),     # b1 32/8 L32768: 64 partitions, 16 a slice
    (1, 32, 63, 132, 2),     # one partition short of four slices' 16
    (1, 32, 31, 132, 1),     # fewer than two slices' worth
    (8, 32, 8, 132, 1),      # b8 L4096: 8 partitions
    (16, 16, 16, 132, 1),    # b16 16/2 L16384 at 1,024-token partitions
    (4, 32, 512, 132, 4),    # 128 threadgroups: 0.97 per core
    (9, 32, 512, 132, 1),    # 288 threadgroups: 2.18 per core, the GPU is full already
    (1, 24, 128, None, 1),   # cores unknown
])
def test_the_cuda_rule_gives_slices_where_threadgroups_are_few_and_partitions_many(rows, heads, parts, cores, want):
    slices, note = gc.reducer_slices(rows, heads, parts, cores, "cuda")
    assert slices == want, note
    assert note.startswith(f"reducer: {want} partition slice")
    rule = gc.REDUCER_SLICE_RULES["cuda"]
    if cores and want > 1:
        assert parts >= want * rule.min_parts_per_slice and rows * heads / cores < rule.max_groups_per_core
        assert f"{parts} partitions" in note


def test_metal_keeps_one_slice_until_measured():
    assert "metal" not in gc.REDUCER_SLICE_RULES
    slices, note = gc.reducer_slices(1, 24, 128, 40, "metal")
    assert slices == 1 and "no REDUCER_SLICE_RULES['metal']" in note


@pytest.mark.parametrize("forced", gc.SLICE_COUNTS)
def test_the_setting_forces_slices_on_any_backend(forced):
    for backend in ("cuda", "metal"):
        slices, note = gc.reducer_slices(64, 32, 2, 132, backend, forced)
        assert slices == forced and f"METAL_ATTN_REDUCER_SLICES={forced}" in note


def test_a_slice_count_outside_the_choices_is_refused():
    with pytest.raises(ValueError, match=r"reducer_slices=3: allowed 0 \(the rule\) or one of \(1, 2, 4, 8\)"):
        gc.reducer_slices(1, 24, 128, 132, "cuda", 3)
    with pytest.raises(SettingsError, match="reducer_slices"), override_settings(reducer_slices=3):
        pass


def test_the_environment_variable_sets_it(monkeypatch):
    from pydantic import ValidationError

    from metal_attn.settings import Settings

    monkeypatch.setenv("METAL_ATTN_REDUCER_SLICES", " 4 ")
    assert Settings().reducer_slices == 4
    monkeypatch.setenv("METAL_ATTN_REDUCER_SLICES", "16")
    with pytest.raises(ValidationError, match=r"reducer_slices\n  Input should be 0, 1, 2, 4 or 8"):
        Settings()


@pytest.mark.parametrize(("cores", "forced", "want"), [(132, 0, 4), (None, 0, 1), (132, 2, 2), (None, 8, 8)])
def test_a_reducer_launch_has_slices_times_128_threads_and_tells_the_kernel(monkeypatch, cores, forced, want):
    """`reduce_launch` with the kernel replaced by a recorder: the threadgroup, the grid and the
    template's NUM_THREADS and SLICES follow the rule on the launch's batch (or the setting)."""
    from metal_attn.metadata import AttentionMetadata

    calls = []

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        calls.append((dict(template), grid, threadgroup))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(gc.reducer, "reducer_kernel", lambda backend: kernel)
    heads, parts, head = 24, 128, 256
    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [parts * 512], [0, 1], validate=False)
    with override_settings(gpu_cores=cores, reducer_slices=forced):
        launch = gc.reduce_launch((1, heads, parts, head), mx.float32, mx.bfloat16, md, False, 512, "cuda")
        out = launch(mx.zeros((1, heads, parts)), mx.zeros((1, heads, parts)), mx.zeros((1, heads, parts, head)),
                     md, None)
    assert out.shape == (1, heads, head)
    (template, grid, threadgroup), = calls
    assert template["SLICES"] == want and template["NUM_THREADS"] == 128 * want
    assert threadgroup == (128 * want, 1, 1) and grid == (heads * 128 * want, 1, 1)


def test_explain_names_the_reducers_slices():
    ex = metal_attn.explain(device="h200", q_lens=[1], seq_lens=[65536], num_heads=24, num_kv_heads=4,
                            head_size=256, dtype="bfloat16")
    row = next(r for r in ex.rows if r.name == "classic")
    assert row.chosen and row.plan.route == "per_token_ps512", str(ex)
    note = next(n for n in row.plan.notes if n.startswith("reducer:"))
    assert note.startswith("reducer: 4 partition slices of 128 threads (1x24 threadgroups / 132 cores = 0.18 < 2;")
    assert "reducer: 4 partition slices" in str(ex)
    with override_settings(reducer_slices=2):
        ex = metal_attn.explain(device="h200", q_lens=[1], seq_lens=[65536], num_heads=24, num_kv_heads=4,
                                head_size=256, dtype="bfloat16")
    assert "reducer: 2 partition slices of 128 threads (METAL_ATTN_REDUCER_SLICES=2)" in str(ex)
    with override_settings(cuda_fused_reduce=True):
        ex = metal_attn.explain(device="h200", q_lens=[1], seq_lens=[65536], num_heads=24, num_kv_heads=4,
                                head_size=256, dtype="bfloat16")
    assert "reducer: fused into the split kernel where CUDA chains run" in str(ex)
    assert "partition slices of 128 threads" not in str(ex)
    unsplit = metal_attn.explain(device="h200", q_lens=[1] * 128, seq_lens=[1024] * 128, num_heads=32,
                                 num_kv_heads=8, head_size=128, dtype="bfloat16")
    row = next(r for r in unsplit.rows if r.name == "classic")
    assert row.plan.route == "per_token_ps0" and not any(n.startswith("reducer:") for n in row.plan.notes)
