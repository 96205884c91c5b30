"""``METAL_ATTN_VALIDATE_METADATA=0`` never crashes, on any provider.

With validation off, a block id outside the pool (10^9, 2^31-1, ``num_blocks``, -1) or a table
row too short for its ``seq_len`` makes that sequence's rows NaN and nothing else: no provider
reads outside the pool (the API hands every provider a table with such entries replaced by block
0, `AttentionMetadata.pool_guard`), the other sequences match the float64 oracle. A slot outside
the pool in ``reshape_and_cache`` is skipped by every cache writer, the rest is written. With
validation on the same inputs raise, naming the entry. Every provider that admits the request is
run (forced); the others skip with their reasons.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn.errors import InvalidInputError
from metal_attn.plugins import get_registry
from metal_attn.settings import override_settings
from metal_attn.testing import admission_reasons, assert_close_to_oracle, make_case
from metal_attn.testing.cases import to_numpy

PROVIDERS = [p["name"] for p in metal_attn.providers()]
#: The out-of-range ids the issue found crashing or reading garbage.
BAD_IDS = (10**9, 2**31 - 1, "num_blocks", -1)
#: (label, q_lens, seq_lens, page size): decode, prefill/mixed, and a page of 64 tokens (served as
#: kernel blocks of 32: the check speaks in pages).
SHAPES = [
    ("decode", [1] * 6, [40, 17, 70, 33, 100, 9], 16, {}),
    ("mixed", [1, 1, 12, 9, 20, 6], [30, 50, 12, 40, 20, 70], 16, {}),
    ("prefill", [8, 5, 12, 9, 20, 6], [8, 40, 12, 40, 20, 70], 16, {}),
    ("pages64", [1] * 6, [150, 70, 65, 64, 129, 1], 64, {}),
    # The GPU kernels' own shapes: a GQA-decode geometry and a half-precision prefill.
    ("decode-32x8x128-bf16", [1] * 6, [600, 17, 1030, 33, 100, 9], 16,
     dict(dtype="bfloat16", num_heads=32, num_kv_heads=8, head_size=128)),
    ("prefill-f16", [40, 5, 12, 9, 20, 6], [40, 40, 12, 40, 20, 70], 16,
     dict(dtype="float16", num_heads=8, num_kv_heads=2, head_size=128)),
]


def _bad_case(q_lens, seq_lens, page, dtype="float32", num_heads=4, num_kv_heads=2, head_size=64):
    """A case whose sequences 1-4 each use one out-of-range block id (`BAD_IDS`), and the oracle
    of the untouched case (valid for sequences 0 and 5)."""
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, block_size=page, dtype=dtype, seed=len(q_lens) + page)
    ref = case.oracle()
    nb = case.k_cache.shape[0]
    tables = case.block_tables.astype(np.int64)
    for seq, bad in zip(range(1, 5), BAD_IDS, strict=True):
        used = -(-seq_lens[seq] // page)
        tables[seq, used - 1] = nb if bad == "num_blocks" else bad  # the last page the sequence reads
    case.block_tables = tables.astype(np.int32)
    return case, ref


def _rows(q_lens, seqs):
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("label", "q_lens", "seq_lens", "page", "geo"), SHAPES, ids=[s[0] for s in SHAPES])
def test_bad_block_ids_give_nan_rows_on_every_provider(label, q_lens, seq_lens, page, geo, provider):
    case, ref = _bad_case(q_lens, seq_lens, page, **geo)
    spec = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, **geo, "q_lens": q_lens, "seq_lens": seq_lens,
            "block_size": page}
    reasons = admission_reasons(spec, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit {label}: " + "; ".join(reasons))
    with override_settings(validate_metadata=False):
        out = metal_attn.paged_attention(**case.kwargs(), provider=provider)
        got = to_numpy(out).astype(np.float64)
    assert metal_attn.diagnostics.last_dispatch().provider == provider
    bad, good = _rows(q_lens, range(1, 5)), _rows(q_lens, (0, 5))
    assert np.isnan(got[bad]).all(), f"{provider}: rows of sequences with an out-of-range block id are not NaN"
    assert_close_to_oracle(got[good], ref[good], case.dtype, label=f"{label} via {provider}")
    # Validation on: the same call raises and names the first bad entry.
    with pytest.raises(InvalidInputError, match=r"block_tables\[1\]\[\d+\]=1000000000 is out of range"):
        metal_attn.paged_attention(**case.kwargs(), provider=provider)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_short_table_gives_nan_rows(provider):
    q_lens, seq_lens = [1, 1, 5], [40, 60, 20]
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     seed=3)
    ref = case.oracle()
    spec = dict(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    reasons = admission_reasons(spec, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit the batch: " + "; ".join(reasons))
    kw = case.kwargs()
    kw["seq_lens"] = mx.array([40, 16 * case.block_tables.shape[1] + 5, 20], dtype=mx.int32)  # row 1: too short
    with override_settings(validate_metadata=False):
        got = to_numpy(metal_attn.paged_attention(**kw, provider=provider)).astype(np.float64)
    assert np.isnan(got[1]).all()
    assert_close_to_oracle(got[[0, 2, 3, 4, 5, 6]], ref[[0, 2, 3, 4, 5, 6]], "float32", label=provider)
    with pytest.raises(InvalidInputError, match=r"block_tables row 1 has \d+ entries but seq_lens\[1\]="):
        metal_attn.paged_attention(**kw, provider=provider)


def test_a_wild_seq_len_costs_no_pass_over_it():
    """A bad sequence runs over its own query rows only: seq_len 2**31 - 1 against a one-page table took
    93 s and 2 GB (a table padded to 134M columns, the kernel over the whole length) to give a NaN row."""
    case = make_case(q_lens=[1, 3], seq_lens=[40, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     seed=5)
    kw = case.kwargs()
    kw["seq_lens"] = mx.array([2**31 - 1, 20], dtype=mx.int32)
    with override_settings(validate_metadata=False):
        md = metal_attn.AttentionMetadata.build(kw.pop("block_tables"), kw.pop("seq_lens"), kw.pop("cu_seqlens_q"))
        guarded, _ = md.pool_guard(case.k_cache.shape[0], 16)
        got = to_numpy(metal_attn.paged_attention(**kw, metadata=md)).astype(np.float64)
    assert guarded.max_blocks_per_seq == case.block_tables.shape[1] and guarded.seq_lens_host == (1, 20)
    assert np.isnan(got[0]).all()
    assert_close_to_oracle(got[1:], case.oracle()[1:], "float32", label="the good sequence")


def test_out_of_range_padding_is_not_an_error_and_never_reaches_a_provider():
    """Entries past a sequence's blocks may hold anything (-1 padding, huge ids), with validation on
    or off: the providers see block 0 there, and no row is poisoned."""
    case = make_case(q_lens=[1, 1], seq_lens=[20, 40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    ref = case.oracle()
    tables = case.block_tables.copy()
    tables[0, 2:] = -1
    tables[1, 3:] = 2**31 - 1
    case.block_tables = tables
    for validate in (True, False):
        with override_settings(validate_metadata=validate):
            md = case.metadata()
            safe, poison = md.pool_guard(case.k_cache.shape[0], 16)
            assert poison is None and safe.block_tables.tolist()[0][2:] == [0] * (tables.shape[1] - 2)
            for provider in PROVIDERS:
                if admission_reasons(case, provider):
                    continue
                out = metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md, provider=provider)
                assert_close_to_oracle(out, ref, "float32", label=f"{provider} validate={validate}")


def test_guard_runs_once_per_metadata_and_pool():
    case, _ = _bad_case(*SHAPES[0][1:4])
    with override_settings(validate_metadata=False):
        md = case.metadata()
        first = md.pool_guard(case.k_cache.shape[0], 16)
        assert md.pool_guard(case.k_cache.shape[0], 16) is first
        assert md.pool_guard(case.k_cache.shape[0] + 1, 16) is not first


def _writers() -> list[str]:
    return [e.provider.name for e in get_registry().entries if e.provider.writes_cache]


@pytest.mark.parametrize("container", ["mx.array", "numpy", "list"])
@pytest.mark.parametrize("writer", ["auto", *_writers()])
def test_slots_outside_the_pool_are_skipped(writer, container):
    """reshape_and_cache with validation off: slots past the pool (the pool size, 10^6, 2^40) are
    skipped, negative ones are padding, the rest land, whatever container holds the slots;
    validation on raises naming the slot."""
    nb, bs, kvh, d = 4, 16, 2, 64
    kc = mx.zeros((nb, bs, kvh, d))
    vc = mx.zeros_like(kc)
    slots = np.array([0, nb * bs, 5, 10**6, -1, 2**40, nb * bs - 1], np.int64)
    key = mx.array(np.arange(1, 8, dtype=np.float32)[:, None, None] * np.ones((7, kvh, d), np.float32))
    others = tuple(w for w in _writers() if w != writer) if writer != "auto" else ()
    with override_settings(validate_metadata=False, disabled_providers=others):
        given = {"mx.array": mx.array(slots), "numpy": slots, "list": slots.tolist()}[container]
        k2, v2 = metal_attn.reshape_and_cache(key, key * 2, kc, vc, given)
        mx.eval(k2, v2)
    if writer != "auto":
        assert metal_attn.diagnostics.last_cache_write().provider == writer
    want = np.zeros((nb * bs, kvh, d), np.float32)
    for row, slot in enumerate(slots):
        if 0 <= slot < nb * bs:
            want[slot] = row + 1
    np.testing.assert_array_equal(np.array(k2).reshape(nb * bs, kvh, d), want)
    np.testing.assert_array_equal(np.array(v2).reshape(nb * bs, kvh, d), 2 * want)
    with pytest.raises(InvalidInputError, match=r"slot_mapping holds slot 1099511627776, out of range"):
        metal_attn.reshape_and_cache(key, key, kc, vc, given)
