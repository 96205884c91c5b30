"""The paged KV cache: a reference-counted block allocator and per-layer K/V pools.

`BlockAllocator` hands out page ids from a free list and counts references, so
that sequences forked from a common prefix share its pages. `PagedKVCache`
owns one K and one V pool per layer in the layout
``[num_blocks, block_size, num_kv_heads, head_size]``, keeps each sequence's
block list and length, and turns a scheduler step (a list of
``(seq_id, num_new_tokens)``, decode rows first) into a `StepPlan`: the slot
mapping for `reshape_and_cache` and the `AttentionMetadata` for
`paged_attention`. A page that is shared and about to be appended to is copied
first (copy-on-write), in every layer.

MLX arrays are values. A write into a pool happens in place only while the pool
array is the sole owner of its buffer, so the cache hands pools out per call
(`PagedKVCache.pools`) and callers should not keep them across steps: one live
reference or view turns every later write into a copy of the whole pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn.api import (
    DTYPE_NAMES,
    MX_DTYPES,
    check_cache_write_tensors,
    dtype_name,
    kernel_block_size,
    reshape_and_cache,
    write_checked,
)
from metal_attn.checks import is_integer
from metal_attn.constants import KERNEL_BLOCK_SIZES
from metal_attn.device import memory_shortfall
from metal_attn.errors import CacheExhaustedError, InvalidInputError
from metal_attn.host_arrays import device_array, padded_base
from metal_attn.metadata import AttentionMetadata
from metal_attn.provider import scatter_slots

__all__ = ["BlockAllocator", "PagedKVCache", "StepPlan", "build_step_plan", "next_decode_plan"]


def _check_positive_int(name: str, value: Any) -> int:
    if not is_integer(value) or value < 1:
        raise InvalidInputError(f"{name}={value!r} (allowed: an int >= 1)")
    return int(value)


class BlockAllocator:
    """Free list and reference counts over ``num_blocks`` page ids ``0 .. num_blocks-1``.

    A block is free exactly when its reference count is 0. `allocate` hands out
    blocks with one reference each, `share`/`fork` add a reference per holder,
    `free` drops one and returns a block to the free list when none is left.
    Every method checks its whole argument before changing anything, so an
    error leaves the allocator as it was.
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = _check_positive_int("num_blocks", num_blocks)
        if self._num_blocks >= 2**31:  # the kernels read block ids as int32
            raise InvalidInputError(f"num_blocks={num_blocks!r} (allowed: an int in 1..2^31-1; block ids are int32)")
        self._refcounts = [0] * self._num_blocks
        # A stack: pop() hands out 0, 1, 2, ... first; freed blocks are reused first.
        self._free = list(range(self._num_blocks - 1, -1, -1))
        #: Blocks returned to the free list so far, and the count when each last was (`released_since`).
        self.releases = 0
        self._released_at = [0] * self._num_blocks

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self._num_blocks}, free={self.num_free})"

    @property
    def num_blocks(self) -> int:
        """Total number of blocks in the pool."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self._num_blocks - len(self._free)

    def free_blocks(self) -> tuple[int, ...]:
        """The free list as it stands (next to be handed out last)."""
        return tuple(self._free)

    def refcount(self, block_id: int) -> int:
        """References held on ``block_id`` (0 when it is free)."""
        return self._refcounts[self._check_id(block_id)]

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks, each with one reference.

        Raises `CacheExhaustedError` (allocator unchanged) when fewer than ``n`` are free.
        """
        if not is_integer(n) or n < 0:
            raise InvalidInputError(f"n={n!r} (allowed: an int >= 0, the number of blocks to allocate)")
        if n > len(self._free):
            raise CacheExhaustedError(
                f"cannot allocate {n} blocks: only {len(self._free)} of {self._num_blocks} are free"
            )
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refcounts[b] = 1
        return out

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each listed block (each must be allocated)."""
        ids = [self._check_id(b) for b in _id_list("block_ids", block_ids)]
        for b in ids:
            if self._refcounts[b] == 0:
                raise InvalidInputError(f"block {b} is free: only allocated blocks can be shared")
        for b in ids:
            self._refcounts[b] += 1

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """Share every listed block and return them as a new list (the child's block table)."""
        ids = _id_list("block_ids", block_ids)
        self.share(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference per listed occurrence; return the blocks that became free.

        Freeing a block more often than it is referenced (a double free) or an id
        outside the pool raises `InvalidInputError` naming the id; nothing changes then.
        """
        counts = Counter(self._check_id(b) for b in _id_list("block_ids", block_ids))
        for b, c in counts.items():
            held = self._refcounts[b]
            if c > held:
                what = "it is already free" if held == 0 else f"it holds only {held} reference(s)"
                raise InvalidInputError(f"double free of block {b}: freed {c} time(s) but {what}")
        released = []
        for b, c in counts.items():
            self._refcounts[b] -= c
            if self._refcounts[b] == 0:
                self._free.append(b)
                released.append(b)
                self.releases += 1
                self._released_at[b] = self.releases
        return released

    def released_since(self, block_ids: Iterable[int], mark: int) -> int | None:
        """A block of ``block_ids`` returned to the free list after `releases` read ``mark``, or None."""
        ids = [self._check_id(b) for b in _id_list("block_ids", block_ids)]
        return next((b for b in ids if self._released_at[b] > mark), None)

    def copy_on_write(self, block_id: int) -> tuple[int, int]:
        """Make ``block_id`` safe to append to for one of its holders.

        Returns ``(block_id, block_id)`` when the caller is its only holder. Otherwise
        allocates a new block, drops the caller's reference on the old one and returns
        ``(old, new)``: the caller must copy the page contents from ``old`` to ``new``.
        Raises `CacheExhaustedError` (allocator unchanged) when no block is free.
        """
        b = self._check_id(block_id)
        held = self._refcounts[b]
        if held == 0:
            raise InvalidInputError(f"block {b} is free: copy_on_write needs an allocated block")
        if held == 1:
            return b, b
        (new,) = self.allocate(1)
        self._refcounts[b] -= 1
        return b, new

    def _check_id(self, block_id: Any) -> int:
        if not is_integer(block_id) or not 0 <= block_id < self._num_blocks:
            raise InvalidInputError(
                f"block id {block_id!r} is unknown (allowed: an int in 0..{self._num_blocks - 1})"
            )
        return int(block_id)


def _id_list(name: str, value: Any) -> list[Any]:
    """``value`` as a list of (unchecked) ids; `InvalidInputError` when it is not an iterable of them."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidInputError(f"{name}={value!r} (allowed: an iterable of block ids, e.g. a list)")
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):  # NumPy or MLX: their elements as ints
        return value.tolist()
    return list(value)


@dataclasses.dataclass(eq=False)
class _Issued:
    """The allocator a `StepPlan` was planned on, its release count then (moved on once checked), and
    the pages the plan's tables name."""

    allocator: BlockAllocator
    mark: int
    blocks: frozenset[int]


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """What one scheduler step needs: where the new tokens go and the attention metadata.

    Row order follows the batch given to `PagedKVCache.prepare_step`.
    """

    seq_ids: tuple[Hashable, ...]
    #: New tokens per sequence (query rows of this step).
    q_lens: tuple[int, ...]
    #: KV length per sequence including this step's tokens.
    seq_lens: tuple[int, ...]
    #: ``[num_tokens]`` int64: ``block_id * block_size + offset`` of each new token.
    slot_mapping: mx.array
    #: ``[num_tokens]`` int32: each new token's position in its sequence (for RoPE).
    positions: mx.array
    #: Block tables (page ids, int32, right-padded with 0), lengths and cu_seqlens_q.
    metadata: AttentionMetadata
    #: ``(old, new)`` pages copied because a shared last page was appended to.
    copies: tuple[tuple[int, int], ...] = ()
    #: The `padded_base` buffers ``positions`` and ``slot_mapping`` are the leading elements of
    #: (``None``: not known), from which `next_decode_plan` derives the next step's on the device.
    bases: tuple[mx.array, mx.array] | None = dataclasses.field(default=None, repr=False)
    #: Where `PagedKVCache.prepare_step` issued it (``None`` for plans built elsewhere): `write_step`
    #: refuses the plan once a page it names has been freed.
    issued: _Issued | None = dataclasses.field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Total new tokens in the step (rows of ``q`` and of the K/V to write)."""
        return sum(self.q_lens)


def _check_not_stale(issued: _Issued) -> None:
    """Pages were freed since the plan was issued (one int compare said so): refuse the plan if one of them
    was its own (its write would land in a page another sequence may hold now); else remember the check."""
    stale = issued.allocator.released_since(issued.blocks, issued.mark)
    if stale is not None:
        raise InvalidInputError(f"plan is stale: page {stale} it names was freed after prepare_step planned it "
                                "(a free_sequence since; allowed: a plan prepared after the last free of its "
                                "sequences)")
    issued.mark = issued.allocator.releases


def build_step_plan(
    seq_ids: Sequence[Hashable],
    starts: Sequence[int],
    q_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    block_size: int,
    *,
    copies: Sequence[tuple[int, int]] = (),
    issued: _Issued | None = None,
) -> StepPlan:
    """The `StepPlan` of a step whose row ``i`` appends ``q_lens[i]`` tokens at positions
    ``starts[i] ..`` of a sequence stored in pages ``tables[i]`` (which must already cover them).

    Shared by `PagedKVCache.prepare_step` and by schedulers that keep their own block
    tables (the engine's block manager). Rows in the order given: decode rows first.
    """
    n_rows = len(tables)
    if not (len(seq_ids) == len(starts) == len(q_lens) == n_rows):
        raise ValueError("seq_ids, starts, q_lens and tables must have one entry per row")
    # Vectorized over rows (a step of 64 decode rows is one set of numpy calls, not 64).
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=n_rows)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    row_first = np.cumsum(lens) - lens  # where each row's table starts in ``flat``
    q = np.asarray(q_lens, dtype=np.int64)
    st = np.asarray(starts, dtype=np.int64)
    row_of_token = np.repeat(np.arange(n_rows), q)
    pos = np.arange(int(q.sum()), dtype=np.int64) - np.repeat(np.cumsum(q) - q, q) + np.repeat(st, q)
    slots = flat[row_first[row_of_token] + pos // block_size] * block_size + pos % block_size
    seq_lens = st + q
    width = int(lens.max())
    block_tables = np.zeros((n_rows, width), dtype=np.int32)
    block_tables[np.repeat(np.arange(n_rows), lens), np.arange(flat.size) - np.repeat(row_first, lens)] = flat
    cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    metadata = AttentionMetadata.build(block_tables, seq_lens.astype(np.int32), cu)
    n = pos.size
    pos_base, slot_base = padded_base(pos, np.int32), padded_base(slots, np.int64)
    return StepPlan(
        seq_ids=tuple(seq_ids),
        q_lens=tuple(int(n) for n in q_lens),
        seq_lens=tuple(int(n) for n in seq_lens),
        slot_mapping=slot_base[:n],
        positions=pos_base[:n],
        metadata=metadata,
        copies=tuple(copies),
        bases=(pos_base, slot_base),
        issued=issued,
    )


def next_decode_plan(plan: StepPlan, block_size: int, new_pages: Mapping[int, int] | None = None) -> StepPlan | None:
    """The plan of the step after ``plan`` when that step appends one token to each of the same
    sequences, in the same order (the caller's to know: the scheduler's rows): every position, slot
    and length one more, computed on the device from ``plan``'s own (its `StepPlan.bases`); the
    query starts are ``plan``'s, and so are the block tables but for ``new_pages``.

    ``new_pages`` maps the row of each sequence whose next token starts a page (its length a
    multiple of ``block_size``) to the block the caller gave it for that page. Such a row's slot
    is that block's first, and the tables gain the blocks (`AttentionMetadata.with_new_pages`):
    two small host arrays, where a plan built anew takes six and the host's Python
    (`build_step_plan`); a third when the table's padded width grows past the widths already
    handed out (a step a compiled forward traces anyway). Without page starts no host array is
    made at all.

    On MLX CUDA the first kernel to read a buffer the host has just written waits for it to
    migrate (`metal_attn.host_arrays`); at one decode row the step's fresh positions and slots cost
    more GPU time than its attention (docs/serving.md). ``None`` when the step cannot be derived:
    a row of more than one token, a row that starts a page without a block in ``new_pages`` (or a
    block for a row that does not), page copies, or a plan without bases. The derived arrays are
    lazy: for consumers that never read them on the host (a compiled decode step).
    """
    if plan.bases is None or plan.copies or any(q != 1 for q in plan.q_lens):
        return None
    new_pages = new_pages or {}
    starting = {i for i, s in enumerate(plan.seq_lens) if s % block_size == 0}  # position s starts a page
    if starting != set(new_pages):
        return None
    pos_base, slot_base = plan.bases
    n = len(plan.q_lens)
    positions, slots = pos_base + 1, slot_base + 1
    metadata = plan.metadata
    if new_pages:
        fix = np.full(slot_base.shape[0], -1, dtype=np.int64)  # the base's length: over the small pool
        for row, block in new_pages.items():
            fix[row] = int(block) * block_size
        fresh = device_array(fix)
        slots = mx.where(fresh >= 0, fresh, slots)
        metadata = metadata.with_new_pages({row: (plan.seq_lens[row] // block_size, block)
                                            for row, block in new_pages.items()})
    seq_lens = tuple(s + 1 for s in plan.seq_lens)
    # A decode row's length is its new token's position + 1; ``positions + 1`` on the base keeps
    # a one-row length out of MLX's small-allocation pool, as the base's own buffer is.
    metadata = metadata.next_decode_step((positions + 1)[:n], seq_lens)
    return dataclasses.replace(plan, seq_lens=seq_lens, slot_mapping=slots[:n], positions=positions[:n],
                               metadata=metadata, bases=(positions, slots))


@dataclasses.dataclass
class _Sequence:
    blocks: list[int]
    num_tokens: int = 0


def _fmt_ids(ids: Iterable[Any], limit: int = 8) -> str:
    ids = list(ids)
    if not ids:
        return "none"
    text = ", ".join(repr(i) for i in ids[:limit])
    return text + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


class PagedKVCache:
    """Per-layer K/V pools in pages of ``block_size`` tokens, shared by sequences.

    Pools have shape ``[num_blocks, block_size, num_kv_heads, head_size]`` and start
    zeroed. A page size that is not itself a kernel block size (32, 16, 8) is served
    by the largest of them that divides it (`kernel_block_size`); `paged_attention`
    does that translation, zero-copy, from the page-level tables this cache builds.

    Typical step::

        plan = cache.prepare_step([(seq_a, 1), (seq_b, 37)])  # decode rows first
        for layer in range(num_layers):
            cache.write(layer, k, v, plan.slot_mapping)
            out = metal_attn.paged_attention(q, *cache.pools(layer), metadata=plan.metadata)
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: Any = mx.float16,
    ) -> None:
        self.num_layers = _check_positive_int("num_layers", num_layers)
        self.num_blocks = _check_positive_int("num_blocks", num_blocks)
        self.block_size = _check_positive_int("block_size", block_size)
        self.num_kv_heads = _check_positive_int("num_kv_heads", num_kv_heads)
        self.head_size = _check_positive_int("head_size", head_size)
        kbs = kernel_block_size(self.block_size)
        if kbs is None:
            sizes = ", ".join(map(str, KERNEL_BLOCK_SIZES))
            raise InvalidInputError(
                f"block_size={block_size} (allowed: a multiple of {min(KERNEL_BLOCK_SIZES)}, so that a kernel "
                f"block size of {sizes} divides it)"
            )
        self._kernel_block_size = kbs
        self.dtype = self._check_dtype(dtype)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        self._check_fits(shape)
        self.allocator = BlockAllocator(self.num_blocks)
        self._k: list[mx.array | None] = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self._v: list[mx.array | None] = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        mx.eval(self._k, self._v)
        self._seqs: dict[Hashable, _Sequence] = {}
        # Pages that hold tokens prepare_step planned and not every layer has written yet, and the layers
        # not written since the last prepare_step: a copy-on-write of such a page (a fork appending before
        # the step's writes) would miss those tokens, so prepare_step refuses it.
        self._unwritten_pages: set[int] = set()
        self._layers_left: set[int] = set()
        self._taken: list[int] | None = None  # ids of the arrays take_pools handed out

    def _check_fits(self, shape: tuple[int, ...]) -> None:
        """Refuse pools larger than the memory there is before allocating them (MLX's CPU backend
        crashes the process on an allocation the machine cannot back): the device's memory, and on
        the CPU backend the host memory still available."""
        total = 2 * self.num_layers * math.prod(shape) * self.dtype.size
        short = memory_shortfall(total)
        if short:
            raise InvalidInputError(
                f"the K/V pools need {total / 2**30:.2f} GiB (2 x num_layers={self.num_layers} x num_blocks="
                f"{self.num_blocks} x block_size={self.block_size} x num_kv_heads={self.num_kv_heads} x head_size="
                f"{self.head_size} x {self.dtype.size} bytes of {dtype_name(self.dtype)}), {short} (allowed: pools "
                "that fit; fewer num_blocks, or a smaller KV memory budget)"
            )

    @staticmethod
    def _check_dtype(dtype: Any) -> Any:
        if isinstance(dtype, str) and dtype in MX_DTYPES:
            return MX_DTYPES[dtype]
        if isinstance(dtype, mx.Dtype) and dtype in DTYPE_NAMES:
            return dtype
        shown = dtype_name(dtype) if isinstance(dtype, mx.Dtype) else repr(dtype)
        raise InvalidInputError(f"dtype={shown} (allowed: {', '.join(MX_DTYPES)}, as mx dtypes or names)")

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size} "
            f"(kernel blocks of {self.kernel_block_size}), kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, dtype={dtype_name(self.dtype)}, sequences={len(self._seqs)}, "
            f"free={self.allocator.num_free})"
        )

    # -- geometry ------------------------------------------------------------------------------

    @property
    def kernel_block_size(self) -> int:
        """Tokens per kernel block the pages are served with (largest of 32/16/8 dividing the page)."""
        return self._kernel_block_size

    @property
    def kernel_blocks_per_page(self) -> int:
        """How many kernel blocks one page is split into."""
        return self.block_size // self._kernel_block_size

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        """``(num_blocks, block_size, num_kv_heads, head_size)``."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def num_free_blocks(self) -> int:
        """Pages on the allocator's free list."""
        return self.allocator.num_free

    def pools(self, layer: int) -> tuple[mx.array, mx.array]:
        """The current ``(k_pool, v_pool)`` of ``layer``. Use them now; do not keep them across writes."""
        return self._held_pools(self._check_layer(layer), "pools")

    def _held_pools(self, i: int, op: str) -> tuple[mx.array, mx.array]:
        """Layer ``i``'s pools, or `InvalidInputError` when `take_pools` has them."""
        k, v = self._k[i], self._v[i]
        if k is None or v is None:
            raise InvalidInputError(f"{op}: the pools were taken by take_pools (put_pools gives them back)")
        return k, v

    # -- sequences -----------------------------------------------------------------------------

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """Ids of the sequences in the cache, in insertion order."""
        return tuple(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens stored for ``seq_id`` (after the last `prepare_step` that included it)."""
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """The pages of ``seq_id`` in order (``ceil(seq_len / block_size)`` of them)."""
        return tuple(self._get(seq_id).blocks)

    def add_sequence(self, seq_id: Hashable) -> None:
        """Register an empty sequence; its pages are allocated as `prepare_step` grows it."""
        self._check_new_id("seq_id", seq_id)
        self._seqs[seq_id] = _Sequence(blocks=[])

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its pages.

        No data moves: the pages' reference counts grow, and the first append to a
        shared, partly filled last page copies it (`prepare_step`, which refuses the copy while the page
        waits for a planned write: fork between steps).
        """
        parent = self._get(parent_id)
        self._check_new_id("child_id", child_id)
        self._seqs[child_id] = _Sequence(self.allocator.fork(parent.blocks), parent.num_tokens)

    def free_sequence(self, seq_id: Hashable) -> None:
        """Drop ``seq_id``; pages no other sequence holds return to the free list."""
        seq = self._get(seq_id)
        self.allocator.free(seq.blocks)
        del self._seqs[seq_id]

    # -- steps ---------------------------------------------------------------------------------

    def blocks_needed(self, batch: Sequence[tuple[Hashable, int]]) -> int:
        """Free pages `prepare_step` would take for ``batch`` (new pages plus copy-on-write copies)."""
        return self._blocks_needed(self._check_batch(batch))

    def prepare_step(self, batch: Sequence[tuple[Hashable, int]]) -> StepPlan:
        """Grow each sequence of ``batch`` by its new tokens and plan the step.

        ``batch`` lists ``(seq_id, num_new_tokens)``, decode rows (1 token) first,
        then prefill chunks; each sequence at most once. A shared, partly filled last
        page is copied before it is appended to (in every layer's pools). Raises
        `CacheExhaustedError` when the pages do not fit, and `InvalidInputError` when such a copy
        cannot be made now (the pools taken by `take_pools`, or the page still waiting for an
        earlier step's write to every layer); nothing changes then.
        """
        rows = self._check_batch(batch)
        grow, to_copy = self._step_allocations(rows)
        need = grow + len(to_copy)
        if to_copy and any(a is None for a in (*self._k, *self._v)):
            raise InvalidInputError(
                f"prepare_step: the batch appends to {len(to_copy)} shared, partly filled page(s), which are "
                "copied first, but the pools were taken by take_pools (put_pools gives them back); no sequence "
                "was changed"
            )
        waiting = sorted(set(to_copy) & self._unwritten_pages)
        if waiting:
            left = sorted(self._layers_left)
            raise InvalidInputError(
                f"prepare_step: the batch appends to shared page(s) {_fmt_ids(waiting)}, which are copied first, "
                f"but they hold tokens an earlier prepare_step planned that {len(left)} of {self.num_layers} "
                f"layers have not written yet (first: layer {left[0]}); the copy would miss them. Allowed: write "
                "the earlier step to every layer first (a fork appends after its parent's step is written); no "
                "sequence was changed"
            )
        free = self.allocator.num_free
        if need > free:
            raise CacheExhaustedError(
                f"the step needs {need} free blocks but only {free} of {self.num_blocks} are free "
                f"(batch of {len(rows)} sequences, {sum(n for _, n in rows)} new tokens); no sequence was changed"
            )
        bs = self.block_size
        copies: list[tuple[int, int]] = []
        starts, tables = [], []
        for seq_id, n in rows:
            seq = self._seqs[seq_id]
            start = seq.num_tokens
            if start % bs:
                old, new = self.allocator.copy_on_write(seq.blocks[-1])
                if new != old:
                    seq.blocks[-1] = new
                    copies.append((old, new))
            extra = -(-(start + n) // bs) - len(seq.blocks)
            if extra > 0:
                seq.blocks.extend(self.allocator.allocate(extra))
            seq.num_tokens = start + n
            starts.append(start)
            tables.append(seq.blocks)
        if copies:
            self.copy_pages(copies)
        for start, (_, n), table in zip(starts, rows, tables):
            self._unwritten_pages.update(table[start // bs:(start + n - 1) // bs + 1])
        self._layers_left = set(range(self.num_layers))
        issued = _Issued(self.allocator, self.allocator.releases, frozenset(b for t in tables for b in t))
        return build_step_plan([s for s, _ in rows], starts, [n for _, n in rows], tables, bs, copies=copies,
                               issued=issued)

    def write(self, layer: int, key: mx.array, value: mx.array, slot_mapping: Any) -> None:
        """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into ``layer``'s pools.

        Goes through `metal_attn.reshape_and_cache` and rebinds the pools. The cache
        lets go of the old pool arrays before the call, so the write is in place
        unless the caller still holds one of them.
        """
        i = self._check_layer(layer)
        k, v = self._held_pools(i, "write")
        self._k[i] = self._v[i] = None
        try:
            k, v = reshape_and_cache(key, value, k, v, slot_mapping)
            self._written(i)
        finally:
            self._k[i], self._v[i] = k, v

    def write_step(self, layer: int, key: mx.array, value: mx.array, plan: StepPlan) -> None:
        """`write` for a step this cache planned: ``plan.slot_mapping`` was built (and so checked) by
        `prepare_step`, so the per-call slot validation is skipped. ``key``/``value`` must have the
        pools' ``[num_kv_heads, head_size]`` and dtype (the model adapter reads them off the model),
        and one row per slot of the plan; anything else is refused before the write. A plan whose
        tables name blocks past this pool (another cache's) is refused too: its metadata's pool check
        (`AttentionMetadata.pool_guard`, once per plan) runs against this pool."""
        i = self._check_layer(layer)
        if not isinstance(plan, StepPlan):
            raise InvalidInputError(f"plan={plan!r} (allowed: a StepPlan from prepare_step)")
        if plan.issued is not None and plan.issued.allocator is not self.allocator:
            raise InvalidInputError(
                "plan was made by another PagedKVCache's prepare_step (allowed: a StepPlan from this cache's "
                "prepare_step: another cache's slots would overwrite this cache's pages)"
            )
        plan.metadata.pool_guard(self.num_blocks, self.block_size)
        if plan.issued is not None and plan.issued.mark != plan.issued.allocator.releases:
            _check_not_stale(plan.issued)
        k, v = self._held_pools(i, "write_step")
        want = (plan.slot_mapping.shape[0], self.num_kv_heads, self.head_size)
        if not (type(key) is mx.array and type(value) is mx.array and key.shape == want and value.shape == want
                and key.dtype == self.dtype and value.dtype == self.dtype):
            self._refuse_step_write(key, value, k, v, want)
        self._k[i] = self._v[i] = None
        try:
            if plan.metadata.lengths_are_bounds:
                # A traced step's slots are the cache's own (none to skip), and a provider's writer
                # may read slots on the host, which a trace cannot: MLX's scatter, in place.
                k, v = scatter_slots(k, key, plan.slot_mapping), scatter_slots(v, value, plan.slot_mapping)
            else:
                k, v = write_checked(key, value, k, v, plan.slot_mapping)
            self._written(i)
        finally:
            self._k[i], self._v[i] = k, v

    @staticmethod
    def _refuse_step_write(key: Any, value: Any, k: Any, v: Any, want: tuple[int, ...]) -> None:
        check_cache_write_tensors(key, value, k, v)  # raises naming the argument
        raise InvalidInputError(
            f"key has {key.shape[0]} rows but the step plan writes {want[0]} slots (allowed: one row per "
            f"slot of plan.slot_mapping, shape {list(want)})"
        )

    def take_pools(self) -> list[mx.array]:
        """Every layer's pools, ``[k0, v0, k1, v1, ...]``, handed over: the cache holds none until
        `put_pools` (so a write into them stays in place). For steps run as one compiled function."""
        pools = [a for pair in zip(self._k, self._v) for a in pair]
        if any(a is None for a in pools):
            raise InvalidInputError("take_pools: the pools were already taken (put_pools gives them back)")
        self._k = [None] * self.num_layers
        self._v = [None] * self.num_layers
        self._taken = [id(a) for a in pools]  # put_pools tells the layers given back written from these
        return pools

    def put_pools(self, pools: Sequence[mx.array]) -> None:
        """Give the cache its pools back (`take_pools`' layout), e.g. a compiled step's new pools."""
        want = self.pool_shape
        if len(pools) != 2 * self.num_layers or any(
            type(a) is not mx.array or tuple(a.shape) != want or a.dtype != self.dtype for a in pools
        ):
            raise InvalidInputError(
                f"put_pools needs {2 * self.num_layers} mx.array pools of shape {want} and dtype "
                f"{dtype_name(self.dtype)} (got {len(pools)}: {', '.join(type(a).__name__ for a in pools[:4])}"
                f"{', ...' if len(pools) > 4 else ''})"
            )
        self._k = list(pools[0::2])
        self._v = list(pools[1::2])
        # A layer given back as other arrays than the ones taken was written (a compiled step's new pools); one
        # given back unchanged (a step that failed, say) was not, and its planned tokens still wait.
        taken = self._taken or [None] * len(pools)
        for layer in range(self.num_layers):
            if (id(pools[2 * layer]), id(pools[2 * layer + 1])) != (taken[2 * layer], taken[2 * layer + 1]):
                self._written(layer)
        self._taken = None

    # -- internals -----------------------------------------------------------------------------

    def _written(self, layer: int) -> None:
        """``layer`` took a write: once every layer has since the last `prepare_step`, the planned tokens
        are in the pools."""
        self._layers_left.discard(layer)
        if not self._layers_left:
            self._unwritten_pages.clear()

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise InvalidInputError(
                f"seq_id={seq_id!r} is not in the cache (known: {_fmt_ids(self._seqs)})"
            ) from None

    def _check_new_id(self, name: str, seq_id: Any) -> None:
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidInputError(f"{name}={seq_id!r} (allowed: a hashable id such as an int or a str)") from None
        if seq_id in self._seqs:
            raise InvalidInputError(f"{name}={seq_id!r} is already in the cache (ids must be unique)")

    def _check_layer(self, layer: Any) -> int:
        if not is_integer(layer) or not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer={layer!r} (allowed: an int in 0..{self.num_layers - 1})")
        return int(layer)

    def _check_batch(self, batch: Sequence[tuple[Hashable, int]]) -> list[tuple[Hashable, int]]:
        try:
            rows = [(row[0], row[1]) for row in batch]
            bad_len = next((i for i, row in enumerate(batch) if len(row) != 2), None)
        except (TypeError, IndexError, KeyError):
            raise InvalidInputError("batch must be a sequence of (seq_id, num_new_tokens) pairs") from None
        if bad_len is not None:
            raise InvalidInputError(f"batch[{bad_len}]={batch[bad_len]!r} (allowed: a (seq_id, num_new_tokens) pair)")
        if not rows:
            raise InvalidInputError("batch is empty: a step needs at least one (seq_id, num_new_tokens) pair")
        seen: set[Hashable] = set()
        prefill_at = None
        for i, (seq_id, n) in enumerate(rows):
            self._get(seq_id)
            if seq_id in seen:
                raise InvalidInputError(f"batch[{i}]: seq_id={seq_id!r} appears more than once in the batch")
            seen.add(seq_id)
            if not is_integer(n) or n < 1:
                raise InvalidInputError(
                    f"batch[{i}]: num_new_tokens={n!r} for seq_id={seq_id!r} (allowed: an int >= 1)"
                )
            if n > 1 and prefill_at is None:
                prefill_at = i
            elif n == 1 and prefill_at is not None:
                raise InvalidInputError(
                    f"batch[{i}]: seq_id={seq_id!r} is a decode row (1 token) after the prefill chunk at "
                    f"batch[{prefill_at}] (allowed order: every 1-token row first, then the prefill chunks)"
                )
        return [(s, int(n)) for s, n in rows]

    def _blocks_needed(self, rows: list[tuple[Hashable, int]]) -> int:
        """Simulate `prepare_step`'s allocations (copy-on-write included) without changing anything."""
        grow, copies = self._step_allocations(rows)
        return grow + len(copies)

    def _step_allocations(self, rows: list[tuple[Hashable, int]]) -> tuple[int, list[int]]:
        """The new pages `prepare_step` would take for ``rows`` and the shared pages it would copy (one entry
        per copy), changing nothing."""
        bs = self.block_size
        dropped: Counter[int] = Counter()  # references given up on shared pages earlier in the step
        grow = 0
        copies: list[int] = []
        for seq_id, n in rows:
            seq = self._seqs[seq_id]
            if seq.num_tokens % bs:
                last = seq.blocks[-1]
                if self.allocator.refcount(last) - dropped[last] > 1:
                    copies.append(last)
                    dropped[last] += 1
            grow += max(0, -(-(seq.num_tokens + n) // bs) - len(seq.blocks))
        return grow, copies

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy pages ``old -> new`` in every layer's K and V pools.

        The source pages are gathered and evaluated first: a scatter whose update
        still depends lazily on the same pool would copy the whole pool. Every page id
        is checked first (an id past the pool would be read and written out of bounds).
        """
        last = self.num_blocks - 1
        for k, pair in enumerate(pairs):
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                    or not all(is_integer(b) and 0 <= b <= last for b in pair)):
                raise InvalidInputError(f"pairs[{k}]={pair!r} (allowed: (old page, new page), page ids in 0..{last})")
        if pairs and any(a is None for a in (*self._k, *self._v)):
            raise InvalidInputError("copy_pages: the pools were taken by take_pools (put_pools gives them back)")
        src = device_array([o for o, _ in pairs], np.int32)
        dst = device_array([n for _, n in pairs], np.int32)
        all_pools = (self._k, self._v)
        pages = [[pool[src] for pool in pools] for pools in all_pools]
        mx.eval(pages)
        for pools, copied in zip(all_pools, pages, strict=True):
            for i, page in enumerate(copied):
                pool = pools[i]
                pools[i] = None  # sole owner while the scatter is built, so it runs in place
                pool[dst] = page
                pools[i] = pool
