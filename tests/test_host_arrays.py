"""`metal_attn.host_arrays`: small kernel inputs live in buffers over MLX CUDA's small pool,
with their values, shapes and dtypes unchanged (the GPU cost it removes is measured by
benchmarks/probe_launch_floor.py, not here)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_attn import host_arrays, kernels
from metal_attn.cache import build_step_plan
from metal_attn.host_arrays import SMALL_POOL_BYTES, device_array, kernel_input, padded_length
from metal_attn.metadata import AttentionMetadata


@pytest.fixture
def buffers(monkeypatch):
    """The byte size of every buffer `host_arrays` allocates, in order."""
    sizes: list[int] = []
    real = host_arrays._allocate

    def watch(host):
        sizes.append(host.nbytes)
        return real(host)

    monkeypatch.setattr(host_arrays, "_allocate", watch)
    return sizes


@pytest.mark.parametrize("values, dtype", [
    (7, np.int32), ([3], np.int32), ([1, 2], np.int32), ([5], np.int64), ([[4]], np.int32),
    ([0.25, -1.5], np.float32), ([], np.int32), (list(range(9)), np.int32), (np.arange(6).reshape(2, 3), np.int64),
])
def test_values_shape_and_dtype_are_kept(values, dtype, buffers):
    host = np.asarray(values, dtype=dtype)
    got = device_array(values, dtype)
    assert got.shape == host.shape
    assert got.dtype == {np.int32: mx.int32, np.int64: mx.int64, np.float32: mx.float32}[dtype]
    np.testing.assert_array_equal(np.array(got), host)
    assert buffers == [max(host.nbytes, 16)]
    assert all(n > SMALL_POOL_BYTES for n in buffers)


def test_padded_length():
    assert padded_length(1, 4) == 4
    assert padded_length(2, 8) == 2
    assert padded_length(1, 8) == 2
    assert padded_length(3, 4) == 4
    assert padded_length(5, 4) == 5
    assert padded_length(0, 4) == 4


def test_kernel_input_keeps_a_large_array_and_rebuilds_a_small_one(buffers):
    big = mx.arange(4, dtype=mx.int32)
    assert kernel_input(big, np.arange(4), mx.int32) is big
    assert buffers == []
    small = mx.array([9], dtype=mx.int32)
    got = kernel_input(small, np.array([9]), mx.int32)
    assert got is not small and got.tolist() == [9] and buffers == [16]
    wrong_dtype = mx.arange(4, dtype=mx.int64)
    assert kernel_input(wrong_dtype, np.arange(4), mx.int32).dtype == mx.int32


def test_one_decode_row_builds_every_kernel_input_over_the_pool(buffers):
    """One request's decode step (the arrays of 4-8 bytes): its slots, positions, block table,
    length and query starts, and a kernel's parameter arrays, all come from `device_array`."""
    plan = build_step_plan([0], [37], [1], [[5, 9, 2]], 16)
    md = plan.metadata
    assert plan.slot_mapping.tolist() == [2 * 16 + 5] and plan.positions.tolist() == [37]
    assert md.seq_lens.tolist() == [38] and md.cu_seqlens_q.tolist() == [0, 1]
    assert md.block_tables.tolist() == [[5, 9, 2]]
    scale = kernels.param_array((0.3671875, 0.0), "float32")  # a value no other test caches
    assert scale.tolist() == [0.3671875, 0.0] and scale.dtype == mx.float32
    # slot (int64, 8 bytes), position, length, starts (8 bytes), the table (12 bytes), the scale
    assert len(buffers) >= 6
    assert all(n > SMALL_POOL_BYTES for n in buffers), buffers


def test_decode_bounds_query_starts_are_over_the_pool(buffers):
    from metal_attn.metadata import decode_query_starts

    decode_query_starts.cache_clear()  # built once per row count: make this test build it
    md = AttentionMetadata.decode_bounds(mx.array([[3]], dtype=mx.int32), mx.array([10], dtype=mx.int32),
                                         max_seq_len=16)
    assert md.cu_seqlens_q.tolist() == [0, 1]
    assert md.cu_seqlens_q.dtype == mx.int32
    assert buffers == [16]  # the 8-byte [0, 1] as the front of a 16-byte buffer
    again = AttentionMetadata.decode_bounds(mx.array([[4]], dtype=mx.int32), mx.array([11], dtype=mx.int32),
                                            max_seq_len=16)
    assert again.cu_seqlens_q is md.cu_seqlens_q and buffers == [16]  # a constant, not rebuilt per step
