"""``METAL_ATTN_VALIDATE_METADATA=0`` on the GPU providers: an out-of-range block id (10^9, 2^31-1,
``num_blocks``, -1) or a too-short table makes that sequence's rows NaN, the others match the float64
oracle, and nothing reads outside the pool (no illegal-address error, which would poison the CUDA
context for every later call: the last test checks the process still computes). Every GPU provider
and route, forced. The CPU-side version is tests/test_validation_off.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn.settings import override_settings
from metal_attn.testing import admission_reasons, assert_close_to_oracle, forced_mixed_threshold, make_case
from metal_attn.testing.cases import to_numpy
from metal_attn.testing.overrides import rule_opened_for

pytestmark = pytest.mark.gpu

BAD_IDS = (10**9, 2**31 - 1, "num_blocks", -1)
#: (label, q_lens, seq_lens, heads, kv heads, head size, dtype): a GQA-decode geometry (gqa_decode,
#: classic's matrix path), a prefill batch (tiled), a mixed batch (both mixed routes), float32 (staged).
SHAPES = [
    ("decode-32x8x128-bf16", [1] * 6, [600, 17, 1030, 33, 100, 9], 32, 8, 128, "bfloat16"),
    ("prefill-f16", [40, 5, 12, 9, 20, 6], [40, 40, 12, 40, 20, 70], 8, 2, 128, "float16"),
    ("mixed-bf16", [1, 1, 12, 9, 20, 6], [300, 1500, 12, 40, 20, 70], 8, 2, 128, "bfloat16"),
    ("decode-f32-g4", [1] * 6, [600, 17, 1030, 33, 100, 9], 16, 4, 128, "float32"),
]
PROVIDERS = ("classic", "gqa_decode", "tiled_prefill", "sdpa_prefill", "reference")


def _bad_case(q_lens, seq_lens, heads, kv_heads, head, dtype):
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_size=head,
                     block_size=16, dtype=dtype, seed=heads + head)
    ref = case.oracle()
    nb = case.k_cache.shape[0]
    tables = case.block_tables.astype(np.int64)
    for seq, bad in zip(range(1, 5), BAD_IDS, strict=True):
        tables[seq, -(-seq_lens[seq] // 16) - 1] = nb if bad == "num_blocks" else bad
    case.block_tables = tables.astype(np.int32)
    return case, ref


def _rows(q_lens, seqs):
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])


@pytest.mark.parametrize("threshold", (0, 1 << 30), ids=("split-decode-rows", "rows-in-tiles"))
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bad_block_ids_give_nan_rows(shape, provider, threshold):
    label, q_lens, seq_lens, heads, kv_heads, head, dtype = shape
    if threshold and provider != "tiled_prefill":
        pytest.skip("the mixed-route threshold only matters to tiled_prefill")
    case, ref = _bad_case(q_lens, seq_lens, heads, kv_heads, head, dtype)
    with rule_opened_for(provider):  # sdpa_prefill: these small batches are the tiles' by its rule
        reasons = admission_reasons(case, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit {label}: " + "; ".join(reasons))
    with (override_settings(validate_metadata=False), forced_mixed_threshold(threshold),
          rule_opened_for(provider)):
        out = metal_attn.paged_attention(**case.kwargs(), provider=provider)
        got = to_numpy(out).astype(np.float64)
    assert metal_attn.diagnostics.last_dispatch().provider == provider
    assert np.isnan(got[_rows(q_lens, range(1, 5))]).all()
    good = _rows(q_lens, (0, 5))
    assert_close_to_oracle(got[good], ref[good], case.dtype, label=f"{label} via {provider}")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_short_table_gives_nan_rows(provider):
    case = make_case(q_lens=[1, 1, 5], seq_lens=[40, 60, 20], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=3)
    ref = case.oracle()
    with rule_opened_for(provider):
        reasons = admission_reasons(case, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit the batch: " + "; ".join(reasons))
    kw = case.kwargs()
    kw["seq_lens"] = mx.array([40, 16 * case.block_tables.shape[1] + 5, 20], dtype=mx.int32)
    with override_settings(validate_metadata=False), rule_opened_for(provider):
        got = to_numpy(metal_attn.paged_attention(**kw, provider=provider)).astype(np.float64)
    assert np.isnan(got[1]).all()
    keep = [0, 2, 3, 4, 5, 6]
    assert_close_to_oracle(got[keep], ref[keep], case.dtype, label=provider)


def test_the_process_still_computes_afterwards():
    case = make_case(q_lens=[1, 7], seq_lens=[900, 30], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", seed=9)
    assert_close_to_oracle(metal_attn.paged_attention(**case.kwargs()), case.oracle(), case.dtype, label="after")
