"""`AttentionRequest`: phase classification, the length plan, repr and hashing."""

from __future__ import annotations

import dataclasses
import math

import pytest

from metal_attn.constants import GQA_PARTITION_SIZES, PARTITION_SIZE, SIMDGROUPS_PER_CORE
from metal_attn.errors import InvalidInputError
from metal_attn.request import (
    LENGTH_PLAN_SIZES,
    VERIFY_MAX_Q_LEN,
    AttentionRequest,
    Phase,
    classify_phase,
    length_plan,
)


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "phase"),
    [
        ([1], [1], Phase.DECODE),
        ([1, 1, 1], [5, 4096, 1], Phase.DECODE),
        ([1, 1, 7], [10, 20, 7], Phase.MIXED),
        ([1, 300], [4096, 300], Phase.MIXED),
        ([4, 4], [10, 20], Phase.VERIFY),  # uniform small q_len with earlier context
        ([2], [9], Phase.VERIFY),
        ([VERIFY_MAX_Q_LEN] * 2, [100, 100], Phase.VERIFY),
        ([VERIFY_MAX_Q_LEN + 1] * 2, [100, 100], Phase.PREFILL),  # too long for verification
        ([4, 4], [4, 20], Phase.PREFILL),  # the first sequence has no earlier context
        ([3, 4], [10, 20], Phase.PREFILL),  # not uniform
        ([512], [512], Phase.PREFILL),
        ([100, 37], [300, 37], Phase.PREFILL),
    ],
)
def test_phase_classification(q_lens, seq_lens, phase):
    assert classify_phase(q_lens, seq_lens) is phase
    req = AttentionRequest.from_lengths(q_lens=q_lens, seq_lens=seq_lens)
    assert req.phase is phase
    assert str(phase) == phase.value


def test_decode_prefix_is_counted():
    req = AttentionRequest.from_lengths(q_lens=[1, 1, 6, 3], seq_lens=[900, 4000, 6, 70])
    assert (req.num_decode_seqs, req.max_decode_seq_len) == (2, 4000)
    assert (req.num_seqs, req.total_q_tokens, req.max_q_len, req.max_seq_len) == (4, 11, 6, 4000)
    pre = AttentionRequest.from_lengths(q_lens=[5], seq_lens=[5])
    assert (pre.num_decode_seqs, pre.max_decode_seq_len) == (0, 0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"q_lens": [1, 1], "seq_lens": [5]}, r"non-empty and of equal length \(got 2 and 1\)"),
    ({"q_lens": [], "seq_lens": []}, "non-empty"),
    ({"q_lens": [1, 4], "seq_lens": [5, 3]}, r"sequence 1: q_len=4, seq_len=3 \(allowed: 1 <= q_len <= seq_len"),
    ({"q_lens": [0], "seq_lens": [5]}, r"sequence 0: q_len=0, seq_len=5"),
    # explain chose classic for 10**20 tokens, which no metadata (int32 positions) can hold
    ({"q_lens": [1, 1], "seq_lens": [5, 2**31]}, r"sequence 1: seq_len=2147483648 \(allowed: at most 2147483647"),
    ({"q_lens": [2**30, 2**30], "seq_lens": [2**30, 2**30]}, r"q_lens sum to 2147483648 query rows"),
    ({"q_lens": [1], "seq_lens": [5], "num_heads": 6, "num_kv_heads": 4},
     r"num_heads=6 is not a multiple of num_kv_heads=4"),
    ({"q_lens": [1], "seq_lens": [5], "head_size": 0}, r"head_size=0 \(allowed: an int >= 1\)"),
    ({"q_lens": [1], "seq_lens": [5], "num_kv_heads": 0}, r"num_kv_heads=0 \(allowed: an int >= 1\)"),
])
def test_a_batch_no_call_could_make_is_refused(fields, message):
    """`from_lengths` (and so `metal_attn.explain`) refuses what `paged_attention` would: it used to
    explain, and route, a sequence of 4 query rows over 3 KV tokens."""
    with pytest.raises(InvalidInputError, match=message):
        AttentionRequest.from_lengths(**fields)


def test_length_plan_sizes_follow_the_constants():
    assert LENGTH_PLAN_SIZES == (512, 256)
    assert set(LENGTH_PLAN_SIZES) == {PARTITION_SIZE, *GQA_PARTITION_SIZES}


def test_length_plan_counts_complete_partitions_summed_over_the_batch():
    lens = [255, 256, 511, 512, 1000, 1]
    expected = {p: sum(n // p for n in lens) for p in (512, 256)}  # 0+0+0+1+1+0 and 0+1+1+2+3+0
    assert expected == {512: 2, 256: 7}
    assert length_plan(lens) == ((512, 2), (256, 7))
    assert length_plan(lens, sizes=(128,)) == ((128, 1 + 2 + 3 + 4 + 7 + 0),)
    # Four rows of 2,688 tokens hold 10,752 tokens but only 4 * 10 complete P256 partitions.
    assert length_plan([2688] * 4) == ((512, 20), (256, 40))


@pytest.mark.parametrize(
    ("tokens", "partition", "full"),
    [(10_752, 256, 42), (10_751, 256, 41), (21_504, 512, 42), (21_503, 512, 41), (10_752, 512, 21)],
)
def test_full_partitions_at_the_gqa_thresholds(tokens, partition, full):
    """KERNELS.md: 40 cores, 32 heads -> P256 from 10,752 tokens, P512 from 21,504."""
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[tokens], num_heads=32)
    assert req.full_partitions(partition) == full
    budget = 40 * SIMDGROUPS_PER_CORE["metal"]
    threshold = math.ceil(budget / 32)  # complete partitions needed so that full * heads >= budget
    assert threshold == 42
    assert (req.full_partitions(partition) * 32 >= budget) == (full >= threshold)


def test_full_partitions_of_an_unplanned_size_raises():
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[1000])
    with pytest.raises(KeyError, match=r"partition_size=128 is not in this request's length plan \(has: 512, 256\)"):
        req.full_partitions(128)
    bare = dataclasses.replace(req, length_plan=())
    with pytest.raises(KeyError, match=r"\(has: none\)"):
        bare.full_partitions(512)


def test_repr_is_readable():
    req = AttentionRequest.from_lengths(
        q_lens=[1, 1, 300],
        seq_lens=[1024, 600, 300],
        backend="metal",
        dtype="bfloat16",
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        sinks=True,
        sliding_window=128,
        softcap=30.0,
    )
    assert repr(req) == (
        "AttentionRequest(metal mixed, q=bfloat16 cache=bfloat16, heads=32/8x128, block_size=16, "
        "seqs=3 (decode 2), q_tokens=302, max_q_len=300, max_seq_len=1024, full_partitions=[P512:3, P256:7], "
        "features=sinks, sliding_window=128, softcap=30)"
    )
    plain = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[5], dtype="float32")
    assert repr(plain).endswith("full_partitions=[P512:0, P256:0], features=none)")
    assert "cache=float32" in repr(plain)


def test_requests_are_frozen_hashable_values():
    a = AttentionRequest.from_lengths(q_lens=[1, 1], seq_lens=[100, 300])
    b = AttentionRequest.from_lengths(q_lens=[1, 1], seq_lens=[100, 300])
    assert a == b and hash(a) == hash(b) and a is not b
    assert {a: "cached"}[b] == "cached"
    assert len({a, b, dataclasses.replace(a, softcap=5.0)}) == 2
    assert a != AttentionRequest.from_lengths(q_lens=[1, 1], seq_lens=[100, 301])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_heads = 4  # type: ignore[misc]


def test_features_and_gqa_group():
    req = AttentionRequest.from_lengths(
        q_lens=[1], seq_lens=[9], num_heads=24, num_kv_heads=4, sinks=True, softcap=50.0
    )
    assert req.gqa_group == 6
    assert req.features == ("sinks", "softcap=50")
    assert AttentionRequest.from_lengths(q_lens=[1], seq_lens=[9]).features == ()


def test_cache_dtype_defaults_to_the_query_dtype():
    assert AttentionRequest.from_lengths(q_lens=[1], seq_lens=[9], dtype="bfloat16").cache_dtype == "bfloat16"
    mixed = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[9], dtype="float16", cache_dtype="float32")
    assert (mixed.dtype, mixed.cache_dtype) == ("float16", "float32")


@pytest.mark.parametrize(("q_lens", "seq_lens", "counts"), [([], [], "0 and 0"), ([1, 1], [5], "2 and 1")])
def test_from_lengths_rejects_mismatched_lengths(q_lens, seq_lens, counts):
    with pytest.raises(
        ValueError, match=rf"q_lens and seq_lens must be non-empty and of equal length \(got {counts}\)"
    ):
        AttentionRequest.from_lengths(q_lens=q_lens, seq_lens=seq_lens)
