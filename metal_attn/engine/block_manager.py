"""The block manager: each request's pages, and the prefix cache, over a `BlockAllocator`.

Prefix caching: a full block is identified by a hash of (its parent block's hash, its
token ids), so equal hashes mean equal whole prefixes. A full block whose K/V a launched
step writes is registered under its hash; the cache holds one reference of its own on it.
A new request takes its longest run of cached leading blocks (one more reference each) and
prefills only the rest. When no request holds a cached block any more, it stays in the
cache, evictable in least-recently-used order, until the pool needs a page.

Writes only ever go to a request's blocks past its cached prefix, which it holds alone:
at least one prompt token is always recomputed (its logits start the generation), so a
fully cached prompt gives its last block back to be recomputed. `check_invariants`
states what must hold between any two calls.

Weights epochs: K/V depend on the model's weights as well as the tokens, so the first block's
parent is the root of the weights epoch the request was admitted in (`epoch_root`). `new_epoch`
(the model's weights changed) moves to a new root and takes every cached block out of the
lookup: nothing computed with the old weights matches a request admitted afterwards. A request
admitted before keeps registering under its old root, which no new request reaches.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from metal_attn.cache import BlockAllocator

__all__ = ["BlockManager", "block_hash", "epoch_root"]

_ROOT = b"metal-attn-prefix-root"


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its parent's hash (``None`` for the first block) and its token ids."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return h.digest()


def epoch_root(epoch: int) -> bytes | None:
    """The parent of a first block in weights epoch ``epoch`` (``None``, the plain root, for epoch 0)."""
    if epoch == 0:
        return None
    return hashlib.blake2b(_ROOT + epoch.to_bytes(8, "little"), digest_size=16).digest()


class BlockManager:
    """Per-request block tables and the prefix cache. Request ids are any hashables."""

    def __init__(self, allocator: BlockAllocator, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[object, list[int]] = {}
        #: Hashes of each request's leading full blocks that are registered (or were looked up).
        self._hashes: dict[object, list[bytes]] = {}
        #: The weights epoch (`new_epoch`), its root, and each request's root, taken at its admission.
        self.epoch = 0
        self._root: bytes | None = epoch_root(0)
        self._roots: dict[object, bytes | None] = {}
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        #: Cached blocks that only the cache holds, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: Pages held for the engine's own use (not a request's, never cached), with what for.
        self.reserved: dict[int, str] = {}
        #: Asked before a request is served cached blocks (the one way K/V reach a request they were not
        #: computed for): ``False`` when the model's weights changed since they were cached, and then a new
        #: weights epoch starts (`new_epoch`) and the request is served none. The engine sets it; ``None``
        #: trusts the cache.
        self.weights_unchanged: Callable[[], bool] | None = None
        #: Tokens looked up in the cache at admissions, and of them those served from cached blocks
        #: (a preempted request's readmission looks up its generated tokens too).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    # -- accounting ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Pages a request can get now: the free list plus evictable cached pages."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages in the prefix cache (held by requests or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some request holds (not the evictable cached ones, nor the engine's reserved ones)."""
        return self.allocator.num_used - len(self._evictable) - len(self.reserved)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is in the prefix cache (the cache then holds one reference on it)."""
        return block_id in self._hash_of

    def table(self, req_id: object) -> list[int]:
        """The request's pages in order (the live list: do not modify)."""
        return self._tables[req_id]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, purpose: str) -> int:
        """Take one page out of circulation for the engine's own use (``purpose`` says which), e.g.
        the scratch page that padding rows of a compiled step write to; it is never freed."""
        if self.num_free < 1:
            raise RuntimeError(f"no free page to reserve for {purpose}")
        (b,) = self._allocate(1)
        self.reserved[b] = purpose
        return b

    # -- admission -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks of the longest cached prefix of ``token_ids``, and their hashes.

        At most ``len(token_ids) - 1`` tokens are matched (the last token is always computed), under
        the current weights epoch's root. Takes no references.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = self._root
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def admit(self, req_id: object, token_ids: Sequence[int], max_new_tokens: int, *, reserve: int = 0) -> int | None:
        """Give a new request its cached prefix and pages for its first chunk.

        The chunk is the next ``min(max_new_tokens, uncached)`` tokens after the cached
        prefix. Returns the number of tokens served from the cache, or ``None`` (nothing
        changed) when the pages do not fit with ``reserve`` pages left over.
        """
        if req_id in self._tables:
            raise RuntimeError(f"request {req_id!r} already holds blocks")
        blocks, hashes = self.match_prefix(token_ids)
        need = self._pages_needed(token_ids, blocks, max_new_tokens, reserve)
        if need is None:
            return None
        if blocks and self.weights_unchanged is not None and not self.weights_unchanged():
            # The cached K/V were computed with other weights: serve none of them, now or later.
            self.new_epoch()
            blocks, hashes = [], []
            need = self._pages_needed(token_ids, blocks, max_new_tokens, reserve)
            if need is None:
                return None
        cached_tokens = len(blocks) * self.block_size
        for b in blocks:
            self._evictable.pop(b, None)
        self.allocator.share(blocks)
        self._tables[req_id] = list(blocks) + self._allocate(need)
        self._hashes[req_id] = list(hashes)
        self._roots[req_id] = self._root
        self.prefix_queries += len(token_ids)
        self.prefix_hits += cached_tokens
        return cached_tokens

    def _pages_needed(self, token_ids: Sequence[int], blocks: list[int], max_new_tokens: int,
                      reserve: int) -> int | None:
        """New pages a request served ``blocks`` from the cache needs for its first chunk, or ``None`` when
        they do not fit with ``reserve`` pages left over."""
        cached_tokens = len(blocks) * self.block_size
        chunk = min(max_new_tokens, len(token_ids) - cached_tokens)
        need = max(0, self.blocks_for(cached_tokens + chunk) - len(blocks))
        # Matched blocks that are evictable stop being evictable once taken: they do not count as free.
        reclaimable = self.num_free - sum(1 for b in blocks if b in self._evictable)
        return None if need + reserve > reclaimable else need

    def grow(self, req_id: object, num_tokens: int) -> bool:
        """Add pages so the request covers ``num_tokens`` tokens; ``False`` (nothing changed) when they do not fit."""
        table = self._tables[req_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        table.extend(self._allocate(need))
        return True

    # -- prefix registration and release ---------------------------------------------------------

    def register(self, req_id: object, token_ids: Sequence[int], num_computed: int) -> None:
        """Put the request's full blocks whose K/V are written or queued (the first ``num_computed``
        tokens, ids known) into the prefix cache, under the root of the epoch it was admitted in."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table, hashes = self._tables[req_id], self._hashes[req_id]
        full = min(num_computed, len(token_ids)) // bs
        for i in range(len(hashes), full):
            h = block_hash(hashes[-1] if hashes else self._roots[req_id], token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            b = table[i]
            if h in self._cached or b in self._hash_of:
                continue  # the same content is cached already (computed by another request), or b is cached
            self._cached[h] = b
            self._hash_of[b] = h
            self.allocator.share([b])  # the cache's own reference

    def uncache(self, req_ids: Iterable[object]) -> None:
        """Take the blocks of ``req_ids`` and every evictable block out of the prefix cache: a step
        writing some of them failed, so their K/V cannot be trusted (a request that finished while
        that step ran has given its blocks back already; they are among the evictable ones). The
        requests keep their own references until `free`."""
        suspect = [b for r in req_ids for b in self._tables.get(r, ())] + list(self._evictable)
        for b in suspect:
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._cached[h]
                self._evictable.pop(b, None)
                self.allocator.free([b])  # the cache's own reference

    def free(self, req_id: object) -> None:
        """Drop the request's references; its cached blocks stay in the cache (evictable when unshared).

        They become evictable last block first, so a prefix loses its tail before its head: a block
        is reachable only through the blocks before it, and evicting a first block would strand
        every cached block after it."""
        table = self._tables.pop(req_id)
        self._hashes.pop(req_id, None)
        self._roots.pop(req_id, None)
        self.allocator.free(table)
        for b in reversed(table):
            if b in self._hash_of and self.allocator.refcount(b) == 1:
                self._evictable[b] = None
                self._evictable.move_to_end(b)

    def _allocate(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        for _ in range(max(0, short)):
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(b)]
            self.allocator.free([b])
            self.evictions += 1
        return self.allocator.allocate(n)

    def new_epoch(self) -> int:
        """Start a new weights epoch: the model's weights changed, so no cached K/V may be served any
        more. Requests admitted from now on hash under a new root; every cached block leaves the
        lookup (evictable ones go back to the free list, held ones stay with their requests until
        `free`). Requests admitted before keep registering under their old root, where no new request
        looks. Returns how many cached blocks were dropped."""
        dropped = len(self._cached)
        self.epoch += 1
        self._root = epoch_root(self.epoch)
        self.uncache(list(self._tables))
        return dropped

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block; return how many went."""
        n = len(self._evictable)
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(b)]
            self.allocator.free([b])
        return n

    def check_invariants(self) -> None:
        """Raise `AssertionError` when the books do not balance (tests call this after every step)."""
        holders: dict[int, int] = dict.fromkeys(self.reserved, 1)
        for table in self._tables.values():
            assert not self.reserved.keys() & set(table), f"a request holds a reserved page ({self.reserved})"
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.num_blocks):
            want = holders.get(b, 0) + (1 if b in self._hash_of else 0)
            got = self.allocator.refcount(b)
            assert got == want, f"block {b}: refcount {got}, but {want} holders (tables + cache)"
            assert (b in self._evictable) == (b in self._hash_of and holders.get(b, 0) == 0), (
                f"block {b}: evictable={b in self._evictable} but cached={b in self._hash_of}, "
                f"held by {holders.get(b, 0)} request(s)"
            )
        assert self._roots.keys() == self._tables.keys() == self._hashes.keys()
        assert len(self._cached) == len(self._hash_of)
        assert all(self._hash_of[b] == h for h, b in self._cached.items())
