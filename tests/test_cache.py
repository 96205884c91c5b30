"""Tests of the paged KV cache: allocator, sequences, copy-on-write, step plans, writes.

The oracles are independent Python models: a list of holders for the allocator,
a dict ``seq -> token ids`` (with abstract shared pages) for the cache, and a
float64 numpy attention computed straight from the modelled tokens.
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import metal_attn as ma
from metal_attn.cache import BlockAllocator, PagedKVCache, StepPlan
from metal_attn.errors import CacheExhaustedError, InvalidInputError
from metal_attn.provider import scatter_slots

# ---------------------------------------------------------------------------------------------
# BlockAllocator
# ---------------------------------------------------------------------------------------------


def _alloc_state(a: BlockAllocator) -> tuple:
    return a.free_blocks(), tuple(a.refcount(b) for b in range(a.num_blocks))


def test_allocator_hands_out_distinct_blocks_with_one_reference():
    a = BlockAllocator(6)
    got = a.allocate(4)
    assert len(set(got)) == 4 and all(0 <= b < 6 for b in got)
    assert [a.refcount(b) for b in got] == [1, 1, 1, 1]
    assert a.num_free == 2 and a.num_used == 4
    assert set(a.free_blocks()) == set(range(6)) - set(got)
    assert a.allocate(0) == []


def test_allocator_exhaustion_names_counts_and_changes_nothing():
    a = BlockAllocator(5)
    a.allocate(3)
    before = _alloc_state(a)
    with pytest.raises(CacheExhaustedError, match="cannot allocate 3 blocks: only 2 of 5 are free"):
        a.allocate(3)
    assert _alloc_state(a) == before
    assert isinstance(CacheExhaustedError("x"), ma.MetalAttnError)


@pytest.mark.parametrize("n", [-1, 1.5, True, "2"])
def test_allocator_rejects_bad_counts(n):
    a = BlockAllocator(4)
    with pytest.raises(InvalidInputError, match=rf"n={n!r} \(allowed: an int >= 0"):
        a.allocate(n)
    assert a.num_free == 4


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, None, True])
def test_allocator_rejects_bad_sizes(num_blocks):
    with pytest.raises(InvalidInputError, match=rf"num_blocks={num_blocks!r} \(allowed: an int >= 1\)"):
        BlockAllocator(num_blocks)


def test_free_returns_blocks_and_reports_released():
    a = BlockAllocator(4)
    b0, b1 = a.allocate(2)
    a.share([b0])
    assert a.free([b0, b1]) == [b1]
    assert a.refcount(b0) == 1 and a.refcount(b1) == 0
    assert b1 in a.free_blocks() and b0 not in a.free_blocks()
    assert a.free([b0]) == [b0]
    assert a.num_free == 4


def test_double_free_names_the_block_and_changes_nothing():
    a = BlockAllocator(4)
    b0, b1 = a.allocate(2)
    a.free([b1])
    before = _alloc_state(a)
    with pytest.raises(InvalidInputError, match=rf"double free of block {b1}: freed 1 time\(s\) but it is already"):
        a.free([b0, b1])
    assert _alloc_state(a) == before
    with pytest.raises(InvalidInputError, match=rf"double free of block {b0}: freed 2 time\(s\) but it holds only 1"):
        a.free([b0, b0])
    assert _alloc_state(a) == before


@pytest.mark.parametrize("bad", [4, -1, 2.0, "1"])
def test_unknown_block_ids_are_named(bad):
    a = BlockAllocator(4)
    a.allocate(4)
    before = _alloc_state(a)
    for call in (a.free, a.share, a.fork):
        with pytest.raises(InvalidInputError, match=rf"block id {bad!r} is unknown \(allowed: an int in 0..3\)"):
            call([0, bad])
    with pytest.raises(InvalidInputError, match="is unknown"):
        a.refcount(bad)
    assert _alloc_state(a) == before


def test_share_and_fork_add_references():
    a = BlockAllocator(5)
    blocks = a.allocate(3)
    child = a.fork(blocks)
    assert child == blocks and child is not blocks
    a.share(blocks[:1])
    assert [a.refcount(b) for b in blocks] == [3, 2, 2]
    (free_block,) = a.free(a.allocate(1))
    with pytest.raises(InvalidInputError, match=f"block {free_block} is free"):
        a.share([blocks[0], free_block])
    assert [a.refcount(b) for b in blocks] == [3, 2, 2]


def test_copy_on_write_exclusive_block_is_kept():
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    assert a.copy_on_write(b) == (b, b)
    assert a.refcount(b) == 1 and a.num_free == 2


def test_copy_on_write_shared_block_moves_one_reference():
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    a.share([b])
    old, new = a.copy_on_write(b)
    assert old == b and new != b
    assert a.refcount(b) == 1 and a.refcount(new) == 1 and a.num_free == 1
    # The other holder is now exclusive.
    assert a.copy_on_write(b) == (b, b)


def test_copy_on_write_exhausted_changes_nothing():
    a = BlockAllocator(2)
    b, _ = a.allocate(2)
    a.share([b])
    before = _alloc_state(a)
    with pytest.raises(CacheExhaustedError, match="only 0 of 2 are free"):
        a.copy_on_write(b)
    assert _alloc_state(a) == before
    a.free([1])
    with pytest.raises(InvalidInputError, match="block 1 is free: copy_on_write needs an allocated block"):
        a.copy_on_write(1)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free/fork/copy-on-write against a list of holders (each a list of ids)."""

    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(self.NUM_BLOCKS)
        self.holders: list[list[int]] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free_before = self.a.num_free
        if n > free_before:
            before = _alloc_state(self.a)
            with pytest.raises(CacheExhaustedError, match=f"cannot allocate {n} blocks: only {free_before} of"):
                self.a.allocate(n)
            assert _alloc_state(self.a) == before
        else:
            self.holders.append(self.a.allocate(n))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        held = self.holders.pop(i)
        others = Counter(b for h in self.holders for b in h)
        released = self.a.free(held)
        assert sorted(released) == sorted(b for b in set(held) if others[b] == 0)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.holders.append(self.a.fork(self.holders[i]))

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def copy_on_write(self, data):
        i = data.draw(st.sampled_from([j for j, h in enumerate(self.holders) if h]))
        j = data.draw(st.integers(0, len(self.holders[i]) - 1))
        b = self.holders[i][j]
        holders_of_b = sum(h.count(b) for h in self.holders)
        if holders_of_b > 1 and self.a.num_free == 0:
            before = _alloc_state(self.a)
            with pytest.raises(CacheExhaustedError):
                self.a.copy_on_write(b)
            assert _alloc_state(self.a) == before
            return
        old, new = self.a.copy_on_write(b)
        assert old == b
        assert (new == b) == (holders_of_b == 1)
        assert new not in {x for h in self.holders for x in h} or new == b
        self.holders[i][j] = new

    @invariant()
    def refcounts_match_holders(self):
        held = Counter(b for h in self.holders for b in h)
        for b in range(self.NUM_BLOCKS):
            assert self.a.refcount(b) == held[b], b

    @invariant()
    def free_list_partitions_the_pool(self):
        free = self.a.free_blocks()
        assert len(free) == len(set(free)) == self.a.num_free
        used = {b for h in self.holders for b in h}
        assert not used & set(free)
        assert used | set(free) == set(range(self.NUM_BLOCKS))
        assert self.a.num_used == len(used)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------------------------------
# PagedKVCache: construction and sequences
# ---------------------------------------------------------------------------------------------


def _cache(**kw) -> PagedKVCache:
    args = dict(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=4, dtype=mx.float32)
    args.update(kw)
    return PagedKVCache(**args)


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("num_layers", 0, r"an int >= 1"),
        ("num_blocks", -2, r"an int >= 1"),
        ("num_kv_heads", 1.0, r"an int >= 1"),
        ("head_size", None, r"an int >= 1"),
        ("block_size", 0, r"an int >= 1"),
        ("block_size", 12, r"a multiple of 8, so that a kernel block size of 32, 16, 8 divides it"),
        ("block_size", 4, r"a multiple of 8"),
    ],
)
def test_cache_rejects_bad_geometry(name, value, allowed):
    with pytest.raises(InvalidInputError, match=rf"{name}={value!r} \(allowed: {allowed}"):
        _cache(**{name: value})


@pytest.mark.parametrize(("dtype", "shown"), [(mx.int32, "int32"), ("float64", "'float64'"), (np.float16, "<class")])
def test_cache_rejects_bad_dtype(dtype, shown):
    with pytest.raises(InvalidInputError, match=rf"dtype={shown}.*allowed: float16, bfloat16, float32"):
        _cache(dtype=dtype)


@pytest.mark.parametrize(
    ("page", "kernel", "ratio"), [(8, 8, 1), (16, 16, 1), (24, 8, 3), (32, 32, 1), (48, 16, 3), (64, 32, 2)]
)
def test_kernel_block_size_translation(page, kernel, ratio):
    c = _cache(block_size=page, num_blocks=2)
    assert c.kernel_block_size == kernel
    assert c.kernel_blocks_per_page == ratio
    assert repr(c).count(f"kernel blocks of {kernel}") == 1


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32, "bfloat16"])
def test_pools_shape_dtype_and_zeroed(dtype):
    c = _cache(num_layers=3, dtype=dtype)
    assert c.pool_shape == (8, 16, 2, 4)
    for layer in range(3):
        k, v = c.pools(layer)
        assert k.shape == v.shape == (8, 16, 2, 4)
        assert k.dtype == v.dtype == c.dtype == (dtype if not isinstance(dtype, str) else mx.bfloat16)
        assert not np.any(np.array(k.astype(mx.float32))) and not np.any(np.array(v.astype(mx.float32)))
    with pytest.raises(InvalidInputError, match=r"layer=3 \(allowed: an int in 0..2\)"):
        c.pools(3)


def test_sequence_lifecycle_and_errors():
    c = _cache()
    c.add_sequence("a")
    with pytest.raises(InvalidInputError, match="seq_id='a' is already in the cache"):
        c.add_sequence("a")
    with pytest.raises(InvalidInputError, match=r"seq_id='zz' is not in the cache \(known: 'a'\)"):
        c.fork("zz", "b")
    with pytest.raises(InvalidInputError, match="child_id='a' is already in the cache"):
        c.fork("a", "a")
    with pytest.raises(InvalidInputError, match=r"seq_id=\[1\] is not in the cache"):
        c.free_sequence([1])
    with pytest.raises(InvalidInputError, match=r"seq_id=\[1\] \(allowed: a hashable id"):
        c.add_sequence([1])
    with pytest.raises(InvalidInputError, match=r"child_id=\{\} \(allowed: a hashable id"):
        c.fork("a", {})
    c.prepare_step([("a", 20)])
    c.fork("a", "b")
    assert c.seq_ids == ("a", "b") and "b" in c and "c" not in c
    assert c.block_table("b") == c.block_table("a") and c.seq_len("b") == 20
    assert [c.allocator.refcount(b) for b in c.block_table("a")] == [2, 2]
    c.free_sequence("a")
    assert [c.allocator.refcount(b) for b in c.block_table("b")] == [1, 1]
    assert c.num_free_blocks == 6
    c.free_sequence("b")
    assert c.num_free_blocks == 8 and c.seq_ids == ()


# ---------------------------------------------------------------------------------------------
# prepare_step
# ---------------------------------------------------------------------------------------------


def test_prepare_step_plans_slots_tables_and_lengths():
    c = _cache(block_size=8)
    for s in (0, 1, 2):
        c.add_sequence(s)
    c.prepare_step([(0, 3), (1, 9)])  # 0: 1 block, 1: 2 blocks
    plan = c.prepare_step([(0, 1), (1, 1), (2, 10)])
    assert isinstance(plan, StepPlan)
    t0, t1, t2 = c.block_table(0), c.block_table(1), c.block_table(2)
    assert (len(t0), len(t1), len(t2)) == (1, 2, 2)
    assert len(set(t0 + t1 + t2)) == 5
    expect = [t0[0] * 8 + 3, t1[1] * 8 + 1] + [t2[p // 8] * 8 + p % 8 for p in range(10)]
    assert plan.slot_mapping.dtype == mx.int64
    assert plan.slot_mapping.tolist() == expect
    assert plan.positions.dtype == mx.int32 and plan.positions.tolist() == [3, 9, *range(10)]
    md = plan.metadata
    assert md.block_tables.dtype == mx.int32
    assert md.block_tables.tolist() == [[t0[0], 0], list(t1), list(t2)]
    assert md.seq_lens.tolist() == [4, 10, 10] and plan.seq_lens == (4, 10, 10)
    assert md.cu_seqlens_q.tolist() == [0, 1, 2, 12] and plan.q_lens == (1, 1, 10)
    assert md.num_decode_seqs == 2 and md.phase == ma.Phase.MIXED
    assert plan.num_tokens == 12 and plan.seq_ids == (0, 1, 2) and plan.copies == ()


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "batch is empty"),
        ([("a", 0)], r"batch\[0\]: num_new_tokens=0 for seq_id='a' \(allowed: an int >= 1\)"),
        ([("a", 2.0)], r"num_new_tokens=2.0"),
        ([("a", 1), ("a", 1)], r"batch\[1\]: seq_id='a' appears more than once"),
        ([("a", 3), ("b", 1)], r"batch\[1\]: seq_id='b' is a decode row \(1 token\) after the prefill chunk at "),
        ([("a", 1), ("x", 1)], r"seq_id='x' is not in the cache"),
        ([("a", 1, 2)], r"batch\[0\]=\('a', 1, 2\) \(allowed: a \(seq_id, num_new_tokens\) pair\)"),
        ([5], "batch must be a sequence of"),
    ],
)
def test_prepare_step_rejects_bad_batches(batch, message):
    c = _cache()
    c.add_sequence("a")
    c.add_sequence("b")
    with pytest.raises(InvalidInputError, match=message):
        c.prepare_step(batch)
    assert c.seq_len("a") == c.seq_len("b") == 0 and c.num_free_blocks == 8


def test_prepare_step_exhaustion_changes_nothing():
    c = _cache(num_blocks=4, block_size=8)
    c.add_sequence("a")
    c.add_sequence("c")
    _fill(c, c.prepare_step([("a", 12)]), 1.0)  # 2 blocks
    c.fork("a", "b")  # shares both, last one half full
    before = (c.block_table("a"), c.block_table("b"), c.allocator.free_blocks())
    assert c.blocks_needed([("a", 1), ("b", 1), ("c", 9)]) == 3  # one copy, two new pages
    with pytest.raises(
        CacheExhaustedError, match=r"needs 3 free blocks but only 2 of 4 are free .*no sequence was changed"
    ):
        c.prepare_step([("a", 1), ("b", 1), ("c", 9)])
    assert (c.block_table("a"), c.block_table("b"), c.allocator.free_blocks()) == before
    assert (c.seq_len("a"), c.seq_len("b"), c.seq_len("c")) == (12, 12, 0)
    plan = c.prepare_step([("a", 1), ("b", 1), ("c", 8)])  # exactly fits: one copy + one page
    assert len(plan.copies) == 1 and c.num_free_blocks == 0


def _fill(c: PagedKVCache, plan: StepPlan, base: float) -> None:
    """Write distinct values for every token of ``plan`` in every layer."""
    n = plan.num_tokens
    shape = (n, c.num_kv_heads, c.head_size)
    for layer in range(c.num_layers):
        k = base + layer * 1000 + np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        c.write(layer, mx.array(k), mx.array(-k), plan.slot_mapping)


def test_copy_on_write_copies_the_page_in_every_layer():
    c = _cache(num_layers=3, block_size=8)
    c.add_sequence("p")
    _fill(c, c.prepare_step([("p", 11)]), 1.0)
    c.fork("p", "c")
    shared_last = c.block_table("p")[-1]
    plan = c.prepare_step([("c", 1)])
    (old, new), = plan.copies
    assert old == shared_last and c.block_table("c") == (c.block_table("p")[0], new)
    assert c.block_table("p")[-1] == shared_last
    assert c.allocator.refcount(old) == c.allocator.refcount(new) == 1
    for layer in range(3):
        for pool in c.pools(layer):
            p = np.array(pool)
            np.testing.assert_array_equal(p[new], p[old])
            assert np.any(p[old][:3])  # the copied page held data


@pytest.mark.parametrize("pairs", [[(0, 99)], [(-1, 2)], [(0, 1, 2)], [(True, 1)], [(0.0, 1)], [(0, 1), (2, 4)]])
def test_copy_pages_refuses_ids_outside_the_pool_and_changes_nothing(pairs):
    """An id past the pool would be gathered and scattered out of bounds; a negative one would wrap."""
    c = _cache(num_layers=2, block_size=8, num_blocks=4)
    c.add_sequence("p")
    _fill(c, c.prepare_step([("p", 11)]), 1.0)
    before = [np.array(pool) for layer in range(2) for pool in c.pools(layer)]
    refusal = r"pairs\[\d\]=.* \(allowed: \(old page, new page\), page ids in 0..3\)"
    with pytest.raises(InvalidInputError, match=refusal):
        c.copy_pages(pairs)
    after = [np.array(pool) for layer in range(2) for pool in c.pools(layer)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_copy_on_write_once_when_both_holders_append():
    c = _cache(block_size=8)
    c.add_sequence("p")
    _fill(c, c.prepare_step([("p", 5)]), 1.0)
    c.fork("p", "c")
    assert c.blocks_needed([("p", 1), ("c", 1)]) == 1
    plan = c.prepare_step([("p", 1), ("c", 1)])
    assert len(plan.copies) == 1
    assert c.block_table("p") != c.block_table("c")
    assert c.allocator.num_used == 2


def test_fork_at_a_page_boundary_needs_no_copy():
    c = _cache(block_size=8)
    c.add_sequence("p")
    c.prepare_step([("p", 16)])
    c.fork("p", "c")
    plan = c.prepare_step([("p", 1), ("c", 1)])
    assert plan.copies == ()
    assert c.block_table("p")[:2] == c.block_table("c")[:2]
    assert c.block_table("p")[2] != c.block_table("c")[2]


@pytest.mark.parametrize("appender", ["child", "parent"])
def test_a_copy_on_write_before_the_planned_write_is_refused(appender):
    """prepare_step, fork, then an append to the shared page before the first step's write: the copy was made
    from the page without the planned token, and the sequence holding the copy attended to zeros in its place
    (the parent's own second append lost its planned slot the same way). Refused now, changing nothing; once
    every layer is written, the same append copies the token."""
    c = ma.PagedKVCache(2, 8, 8, 1, 4, dtype=mx.float32)
    c.add_sequence("p")
    _fill(c, c.prepare_step([("p", 2)]), 1.0)
    planned = c.prepare_step([("p", 1)])  # token 2, on page 0
    c.fork("p", "c")
    before = (c.seq_len("p"), c.seq_len("c"), c.block_table("p"), c.block_table("c"), c.num_free_blocks)
    who = "c" if appender == "child" else "p"
    refusal = (r"prepare_step: the batch appends to shared page\(s\) 0, .* 2 of 2 layers have not written yet "
               r"\(first: layer 0\).*no sequence was changed")
    with pytest.raises(InvalidInputError, match=refusal):
        c.prepare_step([(who, 1)])
    c.write(0, mx.full((1, 1, 4), 5.0), mx.full((1, 1, 4), 5.0), planned.slot_mapping)
    with pytest.raises(InvalidInputError, match=r"1 of 2 layers have not written yet \(first: layer 1\)"):
        c.prepare_step([(who, 1)])
    assert (c.seq_len("p"), c.seq_len("c"), c.block_table("p"), c.block_table("c"), c.num_free_blocks) == before
    c.write_step(1, mx.full((1, 1, 4), 5.0), mx.full((1, 1, 4), 5.0), planned)
    plan = c.prepare_step([(who, 1)])
    assert plan.copies == ((0, c.block_table(who)[0]),)
    for layer in range(2):
        assert c.pools(layer)[0][c.block_table(who)[0], 2].tolist() == [[5.0] * 4]


def test_pools_given_back_unchanged_still_wait_for_the_planned_write():
    """put_pools took every layer as written: pools taken and given back as they were (a compiled step that
    failed) let a fork's append copy the page without the parent's planned token."""
    c = ma.PagedKVCache(2, 8, 8, 1, 4, dtype=mx.float32)
    c.add_sequence("p")
    _fill(c, c.prepare_step([("p", 2)]), 1.0)
    planned = c.prepare_step([("p", 1)])
    pools = c.take_pools()
    c.put_pools(pools)  # nothing written
    c.fork("p", "c")
    with pytest.raises(InvalidInputError, match=r"2 of 2 layers have not written yet"):
        c.prepare_step([("c", 1)])
    pools = c.take_pools()  # a compiled step's write: new arrays for layer 0, the same ones for layer 1
    k0, v0 = (scatter_slots(x, mx.full((1, 1, 4), 5.0), planned.slot_mapping) for x in pools[:2])
    c.put_pools([k0, v0, *pools[2:]])
    with pytest.raises(InvalidInputError, match=r"1 of 2 layers have not written yet \(first: layer 1\)"):
        c.prepare_step([("c", 1)])
    c.write_step(1, mx.full((1, 1, 4), 5.0), mx.full((1, 1, 4), 5.0), planned)
    assert c.prepare_step([("c", 1)]).copies


def test_a_copy_on_write_with_the_pools_taken_changes_nothing():
    """prepare_step used to grow the fork onto a new page, then find the pools gone when copying the shared
    one: the fork was left a token longer on a page of zeros, and attended to them from then on."""
    c = ma.PagedKVCache(1, 8, 16, 1, 16, dtype=mx.float32)
    c.add_sequence("a")
    plan = c.prepare_step([("a", 5)])
    kv = mx.ones((5, 1, 16))
    c.write_step(0, kv, kv, plan)
    c.fork("a", "b")
    before = (c.seq_len("b"), c.block_table("b"), c.num_free_blocks, c.allocator.refcount(0))
    pools = c.take_pools()
    with pytest.raises(InvalidInputError, match=r"prepare_step: the batch appends to 1 shared, partly filled "
                                                r"page\(s\).*taken by take_pools.*no sequence was changed"):
        c.prepare_step([("b", 1)])
    assert (c.seq_len("b"), c.block_table("b"), c.num_free_blocks, c.allocator.refcount(0)) == before
    c.put_pools(pools)
    plan = c.prepare_step([("b", 1)])
    assert plan.copies and c.pools(0)[0][c.block_table("b")[0], :5].tolist() == [[[1.0] * 16]] * 5


def test_write_step_refuses_another_cache_s_plan():
    """A plan of another cache of the same geometry passed every check and overwrote this cache's pages."""
    mine, other = (ma.PagedKVCache(1, 8, 16, 1, 16, dtype=mx.float32) for _ in range(2))
    mine.add_sequence("a")
    other.add_sequence("x")
    kv = mx.ones((3, 1, 16))
    mine.write_step(0, kv, kv, mine.prepare_step([("a", 3)]))
    foreign = other.prepare_step([("x", 3)])
    with pytest.raises(InvalidInputError, match="plan was made by another PagedKVCache's prepare_step"):
        mine.write_step(0, -7 * kv, -7 * kv, foreign)
    assert mine.pools(0)[0][0, :3].tolist() == [[[1.0] * 16]] * 3


def test_allocator_ids_from_arrays_and_checked_everywhere():
    a = BlockAllocator(4)
    a.allocate(2)
    assert a.free(mx.array([1])) == [1]  # an MLX array of ids was refused as "block id array(1) is unknown"
    assert a.free(np.array([0])) == [0]
    for bad in ([-1], [99]):  # -1 read the last block (Python indexing), 99 was a bare IndexError
        with pytest.raises(InvalidInputError, match=rf"block id {bad[0]} is unknown"):
            a.released_since(bad, 0)
    c = _cache()
    c.take_pools()
    with pytest.raises(InvalidInputError, match="take_pools: the pools were already taken"):  # was RuntimeError
        c.take_pools()


def test_write_rebinds_pools_and_survives_bad_input():
    c = _cache()
    c.add_sequence("a")
    plan = c.prepare_step([("a", 2)])
    k_before, _ = c.pools(0)
    key = mx.ones((2, 2, 4), dtype=mx.float32)
    c.write(0, key, 2 * key, plan.slot_mapping)
    k, v = c.pools(0)
    assert k is not k_before
    slots = plan.slot_mapping.tolist()
    flat_k = np.array(k).reshape(-1, 2, 4)
    flat_v = np.array(v).reshape(-1, 2, 4)
    assert (flat_k[slots] == 1).all() and (flat_v[slots] == 2).all()
    assert flat_k.sum() == 16  # nothing else was touched
    bad = mx.ones((2, 3, 4), dtype=mx.float32)
    with pytest.raises(InvalidInputError, match=r"key has \[num_kv_heads, head_size\]=\[3, 4\]"):
        c.write(0, bad, bad, plan.slot_mapping)
    with pytest.raises(InvalidInputError, match=r"layer=-1 \(allowed: an int in 0..1\)"):
        c.write(-1, key, key, plan.slot_mapping)
    k2, v2 = c.pools(0)
    assert k2 is k and v2 is v


@pytest.mark.parametrize("writer", ["native", "mlx"], ids=["classic-writer", "scatter-writer"])
@pytest.mark.parametrize(("key", "message"), [
    # one int32 row was broadcast and cast into every slot, head and element of the step
    (mx.full((1, 1, 1), 7, dtype=mx.int32), r"key has \[num_kv_heads, head_size\]=\[1, 1\] but the pool has \[2, 4\]"),
    (mx.ones((2, 2, 4), dtype=mx.float16), r"key.dtype=float16 differs from k_cache.dtype=float32"),
    (mx.ones((3, 2, 4), dtype=mx.float32), r"key has 3 rows but the step plan writes 2 slots"),
    (np.ones((2, 2, 4), dtype=np.float32), r"key must be an mx.array of rank 3 .* \(got ndarray"),
])
def test_write_step_refuses_what_does_not_match_the_plan(writer, key, message):
    c = _cache()
    c.add_sequence("a")
    plan = c.prepare_step([("a", 2)])
    before = [np.array(a) for a in c.pools(0)]
    disabled = ("classic",) if writer == "mlx" else ()
    with ma.override_settings(disabled_providers=disabled), pytest.raises(InvalidInputError, match=message):
        c.write_step(0, key, key, plan)
    after = c.pools(0)
    assert all(x is not None for x in after), "the pools survive a refused write"
    for b, a in zip(before, after):
        np.testing.assert_array_equal(np.array(a), b)


def test_pools_larger_than_the_device_are_refused_before_allocating():
    # 64 GiB of float16 pools; MLX's CPU backend crashed the process on this allocation.
    memory = ma.device.current_device().memory_bytes
    if not memory:
        pytest.skip("this device reports no memory size, so the cache has nothing to check against")
    blocks = (memory // (2 * 16 * 8 * 128 * 2)) + 1
    beyond = r"the K/V pools need .* GiB .* more than (this \w+ device's memory|the host memory available)"
    with pytest.raises(InvalidInputError, match=beyond):
        PagedKVCache(num_layers=1, num_blocks=blocks, block_size=16, num_kv_heads=8, head_size=128)


def test_pools_larger_than_the_available_host_memory_are_refused(monkeypatch):
    if ma.device.current_device().backend != "cpu":
        pytest.skip("the available-memory bound is the CPU backend's")
    monkeypatch.setattr(ma.device, "available_host_memory", lambda: 1 << 20)  # 1 MiB left
    with pytest.raises(InvalidInputError, match=r"more than the host memory available now \(MemAvailable\), 0.00 GiB"):
        _cache(num_blocks=1024, head_size=64)
    _cache()  # 8 KiB of pools still fit


# ---------------------------------------------------------------------------------------------
# Property test: random add/fork/free/step/write against a Python model of the tokens
# ---------------------------------------------------------------------------------------------


class CacheMachine(RuleBasedStateMachine):
    """The cache against a model: seq -> token ids, and seq -> abstract pages (shared on fork).

    Every written token gets a unique id; its K in layer ``l`` is ``[id, l]`` and
    its V ``[-id, l]``, so reading a slot back identifies exactly which token is
    stored there.
    """

    LAYERS, BLOCKS, BS = 2, 10, 8

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(self.LAYERS, self.BLOCKS, self.BS, 1, 2, dtype=mx.float32)
        self.tokens: dict[int, list[int]] = {}
        self.pages: dict[int, list[object]] = {}  # abstract pages: shared objects after fork
        self.next_seq = 0
        self.next_token = 1

    def _model_step(self, batch):
        """Pages the model's sequences would hold after ``batch`` (None if the pool overflows)."""
        pages = {s: list(p) for s, p in self.pages.items()}
        for s, n in batch:
            length = len(self.tokens[s])
            if length % self.BS and sum(p.count(pages[s][-1]) for p in pages.values()) > 1:
                pages[s][-1] = object()  # copy-on-write
            pages[s] += [object() for _ in range(math.ceil((length + n) / self.BS) - len(pages[s]))]
        used = {id(p) for ps in pages.values() for p in ps}
        return pages if len(used) <= self.BLOCKS else None

    def _snapshot(self):
        c = self.cache
        return (
            {s: (c.block_table(s), c.seq_len(s)) for s in c.seq_ids},
            c.allocator.free_blocks(),
            [np.array(p) for layer in range(self.LAYERS) for p in c.pools(layer)],
        )

    @initialize()
    def two_sequences(self):
        self.add()
        self.add()

    @precondition(lambda self: len(self.tokens) < 6)
    @rule()
    def add(self):
        self.cache.add_sequence(self.next_seq)
        self.tokens[self.next_seq], self.pages[self.next_seq] = [], []
        self.next_seq += 1

    @precondition(lambda self: self.tokens and len(self.tokens) < 6)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.fork(parent, self.next_seq)
        self.tokens[self.next_seq] = list(self.tokens[parent])
        self.pages[self.next_seq] = list(self.pages[parent])
        self.next_seq += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free_sequence(s)
        del self.tokens[s], self.pages[s]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True))
        rows = [(s, data.draw(st.integers(1, 11))) for s in ids]
        batch = [r for r in rows if r[1] == 1] + [r for r in rows if r[1] > 1]
        predicted = self._model_step(batch)
        if predicted is None:
            before = self._snapshot()
            event("step exhausted the pool")
            with pytest.raises(CacheExhaustedError, match="no sequence was changed"):
                self.cache.prepare_step(batch)
            after = self._snapshot()
            assert before[:2] == after[:2]
            for x, y in zip(before[2], after[2], strict=True):
                np.testing.assert_array_equal(x, y)
            return
        plan = self.cache.prepare_step(batch)
        self.pages = predicted
        event(f"step copied {len(plan.copies)} page(s)")
        new_ids = []
        for s, n in batch:
            ids_s = list(range(self.next_token, self.next_token + n))
            self.next_token += n
            self.tokens[s] += ids_s
            new_ids += ids_s
        assert plan.seq_lens == tuple(len(self.tokens[s]) for s, _ in batch)
        col = np.array(new_ids, dtype=np.float32)[:, None, None]
        for layer in range(self.LAYERS):
            k = np.concatenate([col, np.full_like(col, layer)], axis=2)
            v = np.concatenate([-col, np.full_like(col, layer)], axis=2)
            self.cache.write(layer, mx.array(k), mx.array(v), plan.slot_mapping)

    @invariant()
    def tokens_read_back_from_the_pools(self):
        c = self.cache
        pools = [tuple(np.array(p) for p in c.pools(layer)) for layer in range(self.LAYERS)]
        for s, toks in self.tokens.items():
            table = c.block_table(s)
            assert c.seq_len(s) == len(toks) and len(table) == math.ceil(len(toks) / self.BS)
            if not toks:
                continue
            pos = np.arange(len(toks))
            blocks = np.array(table)[pos // self.BS]
            ids = np.array(toks, dtype=np.float32)
            for layer, (kp, vp) in enumerate(pools):
                np.testing.assert_array_equal(kp[blocks, pos % self.BS, 0, 0], ids)
                np.testing.assert_array_equal(vp[blocks, pos % self.BS, 0, 0], -ids)
                assert (kp[blocks, pos % self.BS, 0, 1] == layer).all()

    @invariant()
    def refcounts_count_holding_sequences(self):
        c = self.cache
        held = Counter(b for s in c.seq_ids for b in c.block_table(s))
        for b in range(self.BLOCKS):
            assert c.allocator.refcount(b) == held[b], b
        free = c.allocator.free_blocks()
        assert len(free) == len(set(free))
        assert not set(free) & set(held)
        assert set(free) | set(held) == set(range(self.BLOCKS))

    @invariant()
    def sharing_matches_the_model(self):
        # Two sequences hold the same physical page exactly when the model says they share it.
        c = self.cache
        where = {s: {id(p): i for i, p in enumerate(self.pages[s])} for s in self.pages}
        for s in self.pages:
            for t in self.pages:
                phys_t = c.block_table(t)
                for i, p in enumerate(self.pages[s]):
                    j = where[t].get(id(p))
                    if j is None:
                        assert c.block_table(s)[i] not in phys_t, (s, t, i)
                    else:
                        assert c.block_table(s)[i] == phys_t[j], (s, t, i)
        used = {id(p) for ps in self.pages.values() for p in ps}
        assert c.allocator.num_used == len(used)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------------------------------------
# End to end: prepare_step + write + paged_attention against float64 numpy attention
# ---------------------------------------------------------------------------------------------


def _dense_attention(q, tokens_k, tokens_v, q_lens, seq_lens, scale):
    """float64 causal attention; row i of a q_len chunk sees KV positions [0, seq_len - q_len + i + 1)."""
    out = np.zeros_like(q)
    num_heads, kvh = q.shape[1], tokens_k[0].shape[1]
    group = num_heads // kvh
    row = 0
    for k, v, q_len, seq_len in zip(tokens_k, tokens_v, q_lens, seq_lens, strict=True):
        assert k.shape[0] == seq_len
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            for h in range(num_heads):
                s = k[:visible, h // group] @ q[row, h] * scale
                p = np.exp(s - s.max())
                out[row, h] = (p / p.sum()) @ v[:visible, h // group]
            row += 1
    return out


@pytest.mark.parametrize(
    ("block_size", "dtype", "tol"), [(16, mx.float32, 2e-5), (48, mx.float32, 2e-5), (64, mx.float16, 4e-3)]
)
def test_end_to_end_against_dense_attention(block_size, dtype, tol):
    rng = np.random.default_rng(block_size)
    layers, kvh, heads, head = 2, 2, 4, 32
    c = PagedKVCache(layers, 24, block_size, kvh, head, dtype=dtype)
    np_dtype = np.float16 if dtype == mx.float16 else np.float32
    model: dict[int, list[list[np.ndarray]]] = {}  # seq -> per layer [k rows, v rows] as float64

    def add(s):
        c.add_sequence(s)
        model[s] = [[np.zeros((0, kvh, head)), np.zeros((0, kvh, head))] for _ in range(layers)]

    def fork(p, s):
        c.fork(p, s)
        model[s] = [[k.copy(), v.copy()] for k, v in model[p]]

    # (op, argument, page copies expected from the step)
    steps = [
        ("add", [0, 1, 2], 0),
        ("step", [(0, 37), (1, 5), (2, 70)], 0),
        ("fork", (0, 3), 0),
        ("step", [(0, 1), (3, 1), (1, 1), (2, 20)], 1),  # mixed; 0 appends first and copies the shared page
        ("fork", (2, 4), 0),
        ("step", [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3)], 1),
        ("free", 1, 0),
        ("step", [(4, 1), (3, 9)], 0),
    ]
    checked = 0
    for op, arg, copies in steps:
        if op == "add":
            for s in arg:
                add(s)
        elif op == "fork":
            fork(*arg)
        elif op == "free":
            c.free_sequence(arg)
            del model[arg]
        else:
            plan = c.prepare_step(arg)
            assert len(plan.copies) == copies
            n = plan.num_tokens
            for layer in range(layers):
                k = rng.standard_normal((n, kvh, head)).astype(np_dtype)
                v = rng.standard_normal((n, kvh, head)).astype(np_dtype)
                c.write(layer, mx.array(k), mx.array(v), plan.slot_mapping)
                start = 0
                for s, q_len in arg:
                    mk, mv = model[s][layer]
                    model[s][layer] = [
                        np.concatenate([mk, k[start : start + q_len]]),
                        np.concatenate([mv, v[start : start + q_len]]),
                    ]
                    start += q_len
                q = rng.standard_normal((n, heads, head)).astype(np_dtype)
                out = ma.paged_attention(mx.array(q), *c.pools(layer), metadata=plan.metadata)
                got = np.array(out.astype(mx.float32), dtype=np.float64)
                expect = _dense_attention(
                    q.astype(np.float64),
                    [model[s][layer][0].astype(np.float64) for s, _ in arg],
                    [model[s][layer][1].astype(np.float64) for s, _ in arg],
                    plan.q_lens,
                    plan.seq_lens,
                    head**-0.5,
                )
                np.testing.assert_allclose(got, expect, atol=tol, rtol=tol)
                checked += 1
    assert checked == 4 * layers
    assert c.kernel_block_size == {16: 16, 48: 16, 64: 32}[block_size]


@settings(max_examples=25, deadline=None)
@given(page_tokens=st.lists(st.integers(1, 40), min_size=1, max_size=5), block_size=st.sampled_from([8, 24, 32]))
def test_slot_mapping_is_a_bijection_onto_fresh_slots(page_tokens, block_size):
    """Every prefill token gets its own slot, inside its sequence's pages, in position order."""
    c = PagedKVCache(1, 40, block_size, 1, 8, dtype=mx.float32)
    for s in range(len(page_tokens)):
        c.add_sequence(s)
    plan = c.prepare_step([(s, n) for s, n in enumerate(page_tokens) if n == 1]
                          + [(s, n) for s, n in enumerate(page_tokens) if n > 1])
    slots = plan.slot_mapping.tolist()
    assert len(slots) == len(set(slots)) == sum(page_tokens)
    start = 0
    for s, n in zip(plan.seq_ids, plan.q_lens, strict=True):
        table = c.block_table(s)
        assert [x // block_size for x in slots[start : start + n]] == [table[p // block_size] for p in range(n)]
        assert [x % block_size for x in slots[start : start + n]] == [p % block_size for p in range(n)]
        start += n


def test_allocator_refuses_non_iterables_and_pools_past_int32():
    """free(1), share(1) and fork(None) raised raw TypeErrors; BlockAllocator(10**12) a bare MemoryError."""
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    for call in (a.free, a.share, a.fork):
        for bad in (b, None, "01"):
            with pytest.raises(InvalidInputError, match=r"block_ids=.* \(allowed: an iterable of block ids"):
                call(bad)
    assert a.refcount(b) == 1 and a.num_free == 3
    with pytest.raises(InvalidInputError, match=r"num_blocks=1000000000000 \(allowed: an int in 1..2\^31-1"):
        BlockAllocator(10**12)


def test_a_cache_without_its_pools_says_so_and_a_foreign_plan_is_refused():
    """After take_pools, pools() raised a bare AssertionError and write_step/write/copy_pages raw errors; a
    plan from a larger cache wrote nothing (its slots past the pool) without a word; plan=None an
    AttributeError."""
    small, big = _cache(num_blocks=4), _cache(num_blocks=64)
    for c in (small, big):
        for i in range(5):
            c.add_sequence(i)
    big.prepare_step([(i, 40) for i in range(5)])  # 15 blocks: ids past the small pool's 4
    plan = big.prepare_step([(4, 1)])
    kv = mx.ones((1, 2, 4), dtype=mx.float32)
    before = [np.array(a) for a in small.pools(0)]
    with pytest.raises(InvalidInputError, match="plan was made by another PagedKVCache's prepare_step"):
        small.write_step(0, kv, kv, plan)
    with pytest.raises(InvalidInputError, match=r"plan=None \(allowed: a StepPlan from prepare_step\)"):
        small.write_step(0, kv, kv, None)
    assert all(np.array_equal(a, b) for a, b in zip(small.pools(0), before))
    pools = small.take_pools()
    for call in (lambda: small.pools(0), lambda: small.write(0, kv, kv, mx.array([0])),
                 lambda: small.write_step(0, kv, kv, small.prepare_step([(0, 1)])),
                 lambda: small.copy_pages([(0, 1)])):
        with pytest.raises(InvalidInputError, match="the pools were taken by take_pools"):
            call()
    small.put_pools(pools)
    assert small.pools(0)[0].shape == pools[0].shape


def test_a_plan_whose_pages_were_freed_since_is_refused_and_an_unrelated_free_is_not():
    """A stale plan of a freed sequence wrote over the page its successor now held."""
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=1, head_size=16, dtype=mx.float32)
    cache.add_sequence("a")
    cache.add_sequence("c")
    plan_a = cache.prepare_step([("a", 4)])
    plan_c = cache.prepare_step([("c", 4)])
    rows = lambda x: mx.full((4, 1, 16), x)  # noqa: E731
    cache.free_sequence("a")
    cache.add_sequence("b")
    plan_b = cache.prepare_step([("b", 4)])  # takes a's page
    cache.write_step(0, rows(2.0), rows(2.0), plan_b)
    cache.write_step(0, rows(5.0), rows(5.0), plan_c)  # a free of another sequence's page: still valid
    with pytest.raises(InvalidInputError, match=r"plan is stale: page \d+ it names was freed after prepare_step"):
        cache.write_step(0, rows(-1.0), rows(-1.0), plan_a)
    k, _ = cache.pools(0)
    assert float(k[cache.block_table("b")[0], 0, 0, 0]) == 2.0
    assert float(k[cache.block_table("c")[0], 0, 0, 0]) == 5.0


def test_padded_block_tables_pad_with_block_zero():
    """Kernels read whole table rows: a padding column must name a page of the pool (block 0), not -1."""
    from metal_attn.metadata import AttentionMetadata

    md = AttentionMetadata.build(mx.array([[3, 5], [7, 0]], dtype=mx.int32), mx.array([20, 9], dtype=mx.int32),
                                 mx.array([0, 1, 2], dtype=mx.int32))
    assert np.array(md.padded_block_tables(5)).tolist() == [[3, 5, 0, 0, 0], [7, 0, 0, 0, 0]]
    assert md.padded_block_tables(2) is md.block_tables


def test_freeing_a_shared_block_twice_in_one_call_drops_both_references():
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    a.share([b])
    assert a.free([b, b]) == [b]
    assert a.refcount(b) == 0 and a.num_free == 4
