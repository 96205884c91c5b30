"""The reference provider's float32 products on hardware that multiplies in TF32 (MLX CUDA).

MLX's CUDA matmuls run float32 through TF32 tensor cores; the reference provider then splits
each operand into two TF32-exact parts (`_matmul_split_tf32`). These tests emulate TF32 on the
CPU by truncating the operands, so they show both that plain TF32 products miss the float32
tolerance and that the split recovers it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_attn.providers.reference import ReferenceProvider, _matmul_split_tf32, _tf32_hi

from metal_attn.device import DeviceInfo
from metal_attn.provider import AttentionInputs
from metal_attn.request import AttentionRequest
from metal_attn.settings import Settings
from metal_attn.testing import assert_close_to_oracle, make_case


def _tf32_matmul(a: mx.array, b: mx.array) -> mx.array:
    """What a TF32 tensor core computes: operands truncated to 10 mantissa bits, float32 sums."""
    return _tf32_hi(a) @ _tf32_hi(b)


def test_tf32_hi_keeps_ten_mantissa_bits() -> None:
    x = mx.array([1.0 + 2.0**-10 + 2.0**-11, -3.0, 2.0**-20 * (1 + 2.0**-12)], dtype=mx.float32)
    assert np.array(_tf32_hi(x)).tolist() == [1.0 + 2.0**-10, -3.0, 2.0**-20]


def test_split_product_is_float32_accurate_where_tf32_is_not() -> None:
    rng = np.random.default_rng(3)
    a64, b64 = rng.standard_normal((4, 33, 128)), rng.standard_normal((4, 128, 57))
    a, b = mx.array(a64.astype(np.float32)), mx.array(b64.astype(np.float32))
    exact = a64.astype(np.float32).astype(np.float64) @ b64.astype(np.float32).astype(np.float64)
    scale = np.abs(exact).max()
    split_err = np.abs(np.array(_matmul_split_tf32(a, b), dtype=np.float64) - exact).max() / scale
    tf32_err = np.abs(np.array(_tf32_matmul(a, b), dtype=np.float64) - exact).max() / scale
    assert tf32_err > 1e-4, tf32_err  # TF32 alone misses the float32 tolerance (1e-4)
    assert split_err < 2e-6, split_err


@pytest.mark.parametrize(("preset", "dtype", "split"), [
    ("h200", "float32", True), ("h200", "bfloat16", False), ("h200", "float16", False),
    ("cpu-2core", "float32", False), ("m4-max", "float32", False),
])
def test_plan_splits_float32_products_on_cuda_only(preset: str, dtype: str, split: bool) -> None:
    device = DeviceInfo.preset(preset)
    request = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[40], backend=device.backend, dtype=dtype,
                                            head_size=48)
    plan = ReferenceProvider().plan(request, device, Settings())
    assert ("split_tf32" in plan.specialization) is split


@pytest.mark.parametrize("sinks", [False, True])
def test_split_plan_matches_the_oracle_in_float32(sinks: bool) -> None:
    case = make_case(q_lens=[1, 1, 7], seq_lens=[40, 90, 61], num_heads=8, num_kv_heads=2, head_size=48,
                     block_size=16, dtype="float32", sinks=sinks, seed=8)
    device = DeviceInfo.preset("h200")
    request = AttentionRequest.from_lengths(q_lens=case.q_lens, seq_lens=case.seq_lens.tolist(), backend="cuda",
                                            dtype="float32", num_heads=8, num_kv_heads=2, head_size=48,
                                            sinks=sinks)
    provider = ReferenceProvider()
    plan = provider.plan(request, device, Settings())
    inputs = AttentionInputs(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, metadata=case.metadata(),
                             scale=case.scale, sinks=case.sinks)
    assert_close_to_oracle(provider.run(inputs, plan), case.oracle(), "float32", label="split_tf32")
