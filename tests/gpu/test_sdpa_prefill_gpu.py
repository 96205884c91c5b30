"""The ``sdpa_prefill`` provider (gathered pages + MLX's fused SDPA) on a GPU against the float64 oracle.

Covers its admitted head sizes (64, 96, 128) and that head 256 stays with ``tiled_prefill``;
GQA ratios 1 to 8; sinks; fresh prompts and continuation chunks after long context; blocks shared
between sequences; random block tables; runs of equal-length sequences (one SDPA call) next to
unequal ones; mixed batches (decode rows through the per-token kernel); float16 and bfloat16 (the
provider forced, its measured rule opened: most of these batches are the tiles' by the rule); and
that automatic selection picks it for a prefill chunk past the rule's pairs on CUDA.
"""

from __future__ import annotations

import pytest

from metal_attn import diagnostics
from metal_attn.device import current_device
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.overrides import rule_opened_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(current_device().backend == "metal",
                       reason="SDPA_PREFILL_RULES admits sdpa_prefill on cuda only (Metal: not measured on Apple "
                              "hardware)"),
]

DTYPES = ("float16", "bfloat16")


def _check(case, route: str = "sdpa_prefill", provider: str | None = "sdpa_prefill") -> None:
    # A forced provider runs under its rule opened (these are tests of its numerics: the small batches
    # below are the tiles' by SDPA_PREFILL_RULES); automatic selection under the rule itself.
    with rule_opened_for(provider):
        got = run_case(case, provider=provider)
    rec = diagnostics.last_dispatch()
    assert rec is not None and rec.provider == "sdpa_prefill", rec
    assert rec.route == route, f"{case.label}: route {rec.route} (expected {route})"
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=f"{case.label} {rec.route}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", (64, 96, 128))
@pytest.mark.parametrize("block", (8, 16, 32))
def test_dtype_head_block(dtype, head, block):
    # A continuation chunk, a fresh prompt and a short chunk, in one batch.
    case = make_case(q_lens=[37, 70, 3], seq_lens=[300, 70, 45], num_heads=8, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=head + block, label=f"{dtype} h{head} b{block}")
    _check(case)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (16, 2), (8, 1)],
                         ids=["gqa1", "gqa2", "gqa4", "gqa8", "mqa"])
def test_gqa_ratios(num_heads, num_kv_heads):
    case = make_case(q_lens=[20, 45], seq_lens=[20, 300], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=128, block_size=16, dtype="bfloat16", seed=num_heads * 10 + num_kv_heads,
                     label=f"gqa {num_heads}/{num_kv_heads}")
    _check(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks(dtype):
    case = make_case(q_lens=[33, 64], seq_lens=[200, 64], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=dtype, sinks=True, seed=5, label=f"sinks {dtype}")
    _check(case)


def test_continuation_chunk_after_long_context():
    case = make_case(q_lens=[512], seq_lens=[8192 + 512], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=7, label="512 rows after 8K")
    _check(case)


def test_shared_blocks_and_equal_length_runs():
    # Four sequences with the same lengths (one SDPA call over a batch of 4) sharing their first
    # blocks, then a different one.
    case = make_case(q_lens=[16, 16, 16, 16, 40], seq_lens=[100, 100, 100, 100, 300], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="float16", shared_prefix_blocks=4, seed=11,
                     label="shared + runs")
    _check(case)


@pytest.mark.parametrize("seed", range(4))
def test_random_block_tables(seed):
    case = make_case(q_lens=[9, 130, 57], seq_lens=[700, 130, 1000], num_heads=16, num_kv_heads=4, head_size=96,
                     block_size=(8, 16, 32)[seed % 3], dtype=DTYPES[seed % 2], seed=100 + seed,
                     label=f"random tables {seed}")
    _check(case)


@pytest.mark.parametrize("sinks", [False, True])
def test_mixed_batch_decode_rows_split_off(sinks):
    case = make_case(q_lens=[1, 1, 1, 48, 1100], seq_lens=[4096, 900, 33, 400, 2200], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=16, dtype="bfloat16", sinks=sinks, seed=13, label="mixed")
    _check(case, route="sdpa_prefill_decode")


@pytest.mark.parametrize(("q_lens", "seq_lens", "heads", "route", "per", "partial", "poison"), [
    ([3101], [3101], (32, 8), "sdpa_prefill", 3, True,
     [("q", 0, 3100, 31, "nan"), ("q", 0, 3099, 0, "inf"), ("k", 0, 3000, 7, "nan"), ("v", 0, 12, 2, "-inf")]),
    ([1, 1, 3101], [700, 40, 3101], (32, 8), "sdpa_prefill_decode", 3, True,
     [("q", 2, 3100, 31, "nan"), ("q", 2, 3099, 0, "inf"), ("k", 2, 3000, 7, "nan"), ("v", 2, 12, 2, "-inf")]),
    # One lead row of 16 heads (16 pairs) and two chunks of 3,100 rows in one run: simdgroups of 3 pairs
    # (99,216 pairs: no partial share) straddle the lead rows' end and the first sequence's end, where the
    # kernel's counted (sequence, row, head) moves on. The straddling simdgroup's last pair (sequence 2, row
    # 0, head 0) is finite, and NaN if the count kept sequence 1 (its KV head 0 flagged at 100) or row 3,100
    # of sequence 2 (flagged at 250, past row 0's last key, 200).
    ([1, 3100, 3100], [700, 3300, 3300], (16, 4), "sdpa_prefill_decode", 3, False,
     [("q", 1, 3099, 15, "nan"), ("v", 1, 100, 0, "nan"), ("k", 2, 250, 0, "nan"), ("q", 2, 0, 1, "-inf"),
      ("k", 2, 3260, 3, "nan")]),
], ids=["one run", "lead rows", "two sequences after a lead row"])
def test_a_big_batch_finishes_several_pairs_per_simdgroup(q_lens, seq_lens, heads, route, per, partial, poison):
    # sdpa_finish's simdgroups take several (row, head) pairs each, and the last one a partial share where
    # ``partial``; NaN rows near the end, at a sequence's end and flagged keys must still land.
    from metal_attn.providers import sdpa_prefill as sp

    num_heads, num_kv_heads = heads
    pairs = sum(q_lens) * num_heads
    got_per, threads = sp.finish_launch(pairs)
    assert got_per == per and (threads // 32 * per > pairs) == partial, (got_per, threads)
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64,
                     block_size=16, dtype="bfloat16", seed=41, label=f"big {route}",
                     poison=[(*p[:4], float(p[4])) for p in poison])
    _check(case, route=route)


@pytest.mark.parametrize("provider", ["sdpa_prefill", "tiled_prefill"])
def test_decode_rows_on_a_second_stream_give_the_same_bytes(provider):
    """A mixed batch's decode rows queued on the GPU's second stream (overlapping the chunks) give the
    bytes of the same kernels on one stream, and the oracle's values."""
    from unittest import mock

    import numpy as np
    from metal_attn.providers.gpu_common import decode_rows

    from metal_attn.settings import override_settings
    from metal_attn.testing.overrides import forced_mixed_threshold

    case = make_case(q_lens=[1, 1, 1, 300, 64], seq_lens=[4096, 1500, 40, 2300, 64], num_heads=16, num_kv_heads=4,
                     head_size=128, block_size=16, dtype="bfloat16", sinks=True, seed=31, label="mixed, two streams")
    got, streams = {}, {}
    for on in (False, True):
        with override_settings(decode_rows_stream=on), rule_opened_for(provider), forced_mixed_threshold(0), \
                mock.patch.object(decode_rows, "side_stream", wraps=decode_rows.side_stream) as side:
            got[on] = run_case(case, provider=provider)
            streams[on] = side.call_count
            rec = diagnostics.last_dispatch()
        assert rec.route in ("sdpa_prefill_decode", "mixed_prefill_decode"), rec
    assert streams[False] == 0 and streams[True] >= 1, streams  # the second stream ran the rows, or not
    assert np.array_equal(got[True], got[False])
    assert_close_to_oracle(got[True], case.oracle(), case.dtype, label=f"{case.label} {provider}")


@pytest.mark.skipif(current_device().backend != "cuda", reason="CUDA chains exist on MLX's CUDA backend only")
def test_chained_batch_is_bitwise_the_mx_fast_route():
    """Decode rows and three runs of chunks (one of two equal sequences): the batch as two CUDA
    chains (one output written by every run's finish) gives the ``mx.fast`` launches' bytes."""
    import numpy as np

    from metal_attn import cuda_ops
    from metal_attn.settings import override_settings

    if not cuda_ops.enabled():
        pytest.skip(f"CUDA chains are off here: {cuda_ops.unavailable_reason()}")
    case = make_case(q_lens=[1, 1, 40, 40, 300, 33], seq_lens=[3000, 17, 200, 200, 1300, 2500], num_heads=16,
                     num_kv_heads=4, head_size=128, block_size=16, dtype="bfloat16", sinks=True, seed=21,
                     label="three runs")
    with rule_opened_for("sdpa_prefill"):
        chained = run_case(case, provider="sdpa_prefill")
        assert diagnostics.last_dispatch().route == "sdpa_prefill_decode"
        with override_settings(cuda_chains=False):
            plain = run_case(case, provider="sdpa_prefill")
    assert np.array_equal(chained, plain)  # float64 copies of the bfloat16 outputs
    assert_close_to_oracle(chained, case.oracle(), case.dtype, label=case.label)


def test_auto_picks_it_for_prefill_and_tiled_for_head_256():
    # 256 rows after 4K: 1.02M attended pairs, past the rule's 500K.
    case = make_case(q_lens=[256], seq_lens=[4096], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype="bfloat16", seed=17, label="auto h128")
    _check(case, provider=None)
    small = make_case(q_lens=[64], seq_lens=[300], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                      dtype="bfloat16", seed=17, label="auto h128 small")
    got = run_case(small)
    rec = diagnostics.last_dispatch()
    assert rec.provider == "tiled_prefill", rec  # 17K pairs: the tiles'
    assert_close_to_oracle(got, small.oracle(), small.dtype, label="auto h128 small tiled")
    case = make_case(q_lens=[64], seq_lens=[300], num_heads=8, num_kv_heads=2, head_size=256, block_size=16,
                     dtype="bfloat16", seed=17, label="auto h256")
    got = run_case(case)
    rec = diagnostics.last_dispatch()
    assert rec.provider == "tiled_prefill", rec
    assert_close_to_oracle(got, case.oracle(), case.dtype, label="auto h256 tiled")
