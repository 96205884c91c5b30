"""`AttentionMetadata`: the per-step batch description, built once on the host.

An engine builds one per scheduler step and passes it to every layer's
`paged_attention` call. Host-side facts (lengths, phase, the per-partition
length plan) and the value checks on the small metadata arrays are computed
here once, never per layer; the selection cache per layer geometry lives here
too, so a step's later layers dispatch with a dictionary lookup, and so do the GPU providers'
launch descriptors (`_launches`). The caches assume what the engine guarantees: a metadata and
its arrays are not changed after `AttentionMetadata.build` (a new step builds a new one).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn.checks import is_integer
from metal_attn.errors import InvalidInputError
from metal_attn.host_arrays import device_array, kernel_input
from metal_attn.request import Phase, classify_phase, leading_decode_rows, length_plan


def _to_host_int(name: str, value: Any, ndim: int) -> np.ndarray:
    """Convert an mx/numpy array or a (nested) list to an int64 numpy array, checking rank."""
    if value is None:
        raise InvalidInputError(f"{name} is required (got None): pass it or pass metadata=")
    try:
        arr = np.asarray(value) if not isinstance(value, mx.array) else np.array(value, copy=False)
    except Exception as exc:
        raise InvalidInputError(f"{name} could not be read as an integer array: {exc}") from None
    if arr.ndim != ndim:
        raise InvalidInputError(f"{name} must have rank {ndim} (got shape {tuple(arr.shape)})")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"{name} must hold integers (got dtype {arr.dtype})")
    _check_int32(name, arr)  # before the int64 copy, which would wrap an unsigned 2**64 - 1 to -1
    return np.array(arr, dtype=np.int64)  # a copy: the caller may change its own array afterwards


def _check_int32(name: str, arr: np.ndarray) -> None:
    """`InvalidInputError` naming the first entry of ``arr`` that int32, the kernels' index type, cannot hold."""
    if arr.size == 0:
        return
    if arr.dtype.kind == "u":
        past = arr > 2**31 - 1
    else:
        past = (arr > 2**31 - 1) | (arr < -(2**31))
    if past.any():
        at = np.unravel_index(int(np.argmax(past)), arr.shape)
        index = "".join(f"[{i}]" for i in at)
        raise InvalidInputError(f"{name}{index}={int(arr[at])} (allowed: values that fit in int32, the kernels' "
                                f"index type: {-(2**31)} to {2**31 - 1})")


#: The widest block table `padded_block_tables` makes: 2^28 pages of the smallest block (8 tokens)
#: already address 2^31 tokens, past what the kernels' int32 positions hold.
MAX_TABLE_WIDTH = 2**28


def _own(value: Any) -> Any:
    """A new handle on an MLX array (the caller's in-place updates rebind theirs, not ours); else ``value``."""
    return mx.array(value) if isinstance(value, mx.array) else value


@dataclasses.dataclass(eq=False)
class AttentionMetadata:
    """Block tables, lengths and everything derived from them, for one batch."""

    block_tables: mx.array  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: mx.array  # [num_seqs] int32
    cu_seqlens_q: mx.array  # [num_seqs + 1] int32
    seq_lens_host: tuple[int, ...]
    q_lens_host: tuple[int, ...]
    phase: Phase
    num_decode_seqs: int
    length_plan: tuple[tuple[int, int], ...]
    max_blocks_per_seq: int
    validate: bool = True
    _block_tables_host: np.ndarray | None = dataclasses.field(default=None, repr=False)
    #: The host lengths are bounds, not the lengths (`decode_bounds`): the device arrays hold the
    #: real ones. Only providers with ``reads_lengths_on_device`` may run such a batch.
    lengths_are_bounds: bool = False
    # Caches: init=False, so every instance (`dataclasses.replace` too) starts them empty.
    #: Per (num_blocks, block_size): the metadata to run with and the rows to poison (`pool_guard`).
    _guards: dict = dataclasses.field(default_factory=dict, repr=False, init=False)
    #: Selection cache (filled by `paged_attention`): per-layer key -> (selection, metadata, ratio, record).
    _selections: dict = dataclasses.field(default_factory=dict, repr=False, init=False)
    #: Block tables re-expressed for smaller kernel blocks: ratio -> metadata.
    _split: dict = dataclasses.field(default_factory=dict, repr=False, init=False)
    #: Query-tile maps of the tiled kernels: (rows per tile, first sequence) -> array.
    _tiles: dict = dataclasses.field(default_factory=dict, repr=False, init=False)
    #: Launch descriptors of the GPU providers (`metal_attn.providers.gpu_common.cached_launch`):
    #: key -> what a launch over this batch derives from its plan, shared by the layers of a step.
    _launches: dict = dataclasses.field(default_factory=dict, repr=False, init=False)
    #: `padded_block_tables` by width (a decode step's successor shares them: `next_decode_step`).
    _padded_tables: dict = dataclasses.field(default_factory=dict, repr=False, init=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @functools.cached_property
    def total_q_tokens(self) -> int:
        """Query rows of the batch (``cu_seqlens_q[-1]``); read on every call, so computed once."""
        return sum(self.q_lens_host)

    @functools.cached_property
    def max_q_len(self) -> int:
        return max(self.q_lens_host)

    @functools.cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @functools.cached_property
    def max_decode_seq_len(self) -> int:
        return max(self.seq_lens_host[: self.num_decode_seqs], default=0)

    @classmethod
    def build(
        cls,
        block_tables: Any,
        seq_lens: Any,
        cu_seqlens_q: Any,
        *,
        validate: bool | None = None,
    ) -> AttentionMetadata:
        """Build from the three arrays (mx arrays, numpy arrays or lists).

        Structural checks (ranks, integer dtypes, one table row per sequence,
        ``cu_seqlens_q`` starting at 0 and non-decreasing, ``1 <= q_len <= seq_len``)
        always run; they cost microseconds on host copies the call needs anyway.
        Block-id range and table-length checks need the pool and run on first use
        (`pool_guard`): with ``validate`` (default: the ``METAL_ATTN_VALIDATE_METADATA``
        setting) on, a bad table raises; off, the sequences it concerns give NaN rows and
        nothing is read outside the pool.
        """
        if validate is None:
            from metal_attn.settings import get_settings

            validate = get_settings().validate_metadata
        elif not isinstance(validate, bool):  # "no" would read as on
            raise InvalidInputError(f"validate={validate!r} (allowed: True, False, or None for the setting)")
        bt = _to_host_int("block_tables", block_tables, 2)
        sl = _to_host_int("seq_lens", seq_lens, 1)
        cu = _to_host_int("cu_seqlens_q", cu_seqlens_q, 1)
        n = sl.shape[0]
        if n == 0:
            raise InvalidInputError("seq_lens is empty: a batch needs at least one sequence")
        if bt.shape[0] != n:
            raise InvalidInputError(
                f"block_tables has {bt.shape[0]} rows but seq_lens has {n} sequences (need one row per sequence)"
            )
        if cu.shape[0] != n + 1:
            raise InvalidInputError(
                f"cu_seqlens_q has {cu.shape[0]} entries; with {n} sequences it needs {n + 1} (prefix sums from 0)"
            )
        if cu[0] != 0:
            raise InvalidInputError(f"cu_seqlens_q[0]={int(cu[0])} (must be 0)")
        q_lens = np.diff(cu)
        bad = np.nonzero(q_lens < 1)[0]
        if bad.size:
            i = int(bad[0])
            raise InvalidInputError(
                f"cu_seqlens_q must be strictly increasing: cu_seqlens_q[{i}]={int(cu[i])}, "
                f"cu_seqlens_q[{i + 1}]={int(cu[i + 1])} gives q_len={int(q_lens[i])} for sequence {i} (need >= 1)"
            )
        bad = np.nonzero(sl < q_lens)[0]
        if bad.size:
            # Either array may be the wrong one (e.g. cu_seqlens_q=[0, 1, 30] meant for 30 decode
            # rows of 30 sequences): name both, with the values that disagree.
            i = int(bad[0])
            raise InvalidInputError(
                f"sequence {i} has q_len={int(q_lens[i])} query rows (cu_seqlens_q[{i}]={int(cu[i])} to "
                f"cu_seqlens_q[{i + 1}]={int(cu[i + 1])}) but seq_lens[{i}]={int(sl[i])} KV tokens; seq_lens "
                f"counts this step's tokens too, so seq_len >= q_len: check cu_seqlens_q (prefix sums of the query "
                f"rows per sequence, {n + 1} entries) and seq_lens ({n} sequences)"
            )
        if bt.shape[1] == 0:
            raise InvalidInputError("block_tables has 0 columns: each sequence needs at least one block")
        q_list = tuple(int(x) for x in q_lens)
        s_list = tuple(int(x) for x in sl)
        n_dec = leading_decode_rows(q_list)
        return cls(
            # The caller's MLX arrays through handles of our own (no data copy): an in-place update of
            # theirs (``bt[0, 0] = x``) then leaves this metadata, checked above, as it was.
            block_tables=kernel_input(_own(block_tables), bt, mx.int32),
            seq_lens=kernel_input(_own(seq_lens), sl, mx.int32),
            cu_seqlens_q=kernel_input(_own(cu_seqlens_q), cu, mx.int32),
            seq_lens_host=s_list,
            q_lens_host=q_list,
            phase=classify_phase(q_list, s_list),
            num_decode_seqs=n_dec,
            length_plan=length_plan(s_list),
            max_blocks_per_seq=int(bt.shape[1]),
            validate=validate,
            _block_tables_host=bt,
        )

    @classmethod
    def decode_bounds(cls, block_tables: mx.array, seq_lens: mx.array, *, max_seq_len: int) -> AttentionMetadata:
        """A decode batch (one query row per sequence) whose lengths are known only on the device.

        For a step traced once under ``mx.compile`` and replayed with other lengths: the host
        view says every sequence has ``max_seq_len`` tokens (a bound every real length must stay
        within, and that the table's width covers), so launch shapes derived from it hold for
        every replay, while the kernels read the real ``seq_lens`` and ``block_tables`` (which may
        be lazy, even tracers). The table is trusted: it is never read on the host, so it is not
        checked against the pool (the engine built it), and neither are the slots a step writes
        with it (`PagedKVCache.write_step` scatters them unchecked: every one must be a slot of the
        pool; a compiled step's padding rows write to a page the engine reserves for them). Only
        providers that read their lengths on the device admit such a batch
        (`Provider.reads_lengths_on_device`); a sliding window and re-split pages are refused.
        """
        for name, arr, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
            if not isinstance(arr, mx.array) or arr.ndim != ndim or not mx.issubdtype(arr.dtype, mx.integer):
                got = (f"{str(arr.dtype).removeprefix('mlx.core.')} {tuple(arr.shape)}" if isinstance(arr, mx.array)
                       else type(arr).__name__)
                raise InvalidInputError(f"{name}: {got} (allowed for decode_bounds: a {ndim}-d integer mx.array)")
        n, width = (int(x) for x in block_tables.shape)
        if seq_lens.shape != (n,):
            raise InvalidInputError(f"seq_lens.shape={tuple(seq_lens.shape)} (need ({n},), one length per table row)")
        block_tables = block_tables if block_tables.dtype == mx.int32 else block_tables.astype(mx.int32)
        seq_lens = seq_lens if seq_lens.dtype == mx.int32 else seq_lens.astype(mx.int32)
        if not (is_integer(max_seq_len) and 1 <= max_seq_len <= 2**31 - 1):
            raise InvalidInputError(f"max_seq_len={max_seq_len!r} (allowed: an int in 1..2^31-1)")
        lens = (int(max_seq_len),) * n
        return cls(
            block_tables=block_tables,
            seq_lens=seq_lens,
            cu_seqlens_q=decode_query_starts(n),
            seq_lens_host=lens,
            q_lens_host=(1,) * n,
            phase=classify_phase((1,) * n, lens),
            num_decode_seqs=n,
            length_plan=length_plan(lens),
            max_blocks_per_seq=width,
            validate=False,
            _block_tables_host=np.zeros((n, width), dtype=np.int32),
            lengths_are_bounds=True,
        )

    def padded_block_tables(self, width: int) -> mx.array:
        """The block tables right-padded with block 0 to ``width`` columns (``block_tables`` itself
        when already that wide)."""
        if self.lengths_are_bounds:
            raise InvalidInputError("padded_block_tables: decode_bounds metadata has no host copy of its table "
                                    "to pad (pad the device table before building it)")
        have = self.max_blocks_per_seq
        if not (is_integer(width) and have <= width <= MAX_TABLE_WIDTH):
            raise InvalidInputError(f"width={width!r} (allowed: an int from the table's {have} columns to "
                                    f"{MAX_TABLE_WIDTH})")
        width = int(width)
        if width == have:
            return self.block_tables
        got = self._padded_tables.get(width)
        if got is None:
            got = self._padded_tables[width] = device_array(
                np.pad(self._block_tables_host, ((0, 0), (0, width - have))), np.int32)
        return got

    def with_new_pages(self, pages: Mapping[int, tuple[int, int]]) -> AttentionMetadata:
        """This metadata with block-table entries set: ``pages`` maps a row to ``(column, block
        id)``, a column at most one past the table's last widening it (a sequence starts one page a
        step; `next_decode_plan`'s page starts). One
        host array is made, the widest of the padded tables this metadata had handed out
        (`padded_block_tables`), the others and ``block_tables`` views of it: column slices, not
        row-contiguous, which the kernels copy on read (`kernels.load_kernel` keeps MLX's
        ``ensure_row_contiguous``). The pool checks (`pool_guard`) run again on first use."""
        if self.lengths_are_bounds:
            raise InvalidInputError("with_new_pages: decode_bounds metadata has no host copy of its table")
        n = self.num_seqs
        if not isinstance(pages, Mapping):
            raise InvalidInputError(f"with_new_pages: pages={pages!r} (allowed: a mapping row -> (column, block id))")

        host = self._block_tables_host
        last = host.shape[1]
        for row, entry in pages.items():
            ok = isinstance(entry, (tuple, list)) and len(entry) == 2 and all(is_integer(x) for x in (row, *entry))
            if not (ok and 0 <= row < n and 0 <= entry[0] <= last and 0 <= entry[1] < 2**31):
                raise InvalidInputError(f"with_new_pages: row {row!r} -> {entry!r} (allowed: a row in 0..{n - 1} "
                                        f"-> (a column in 0..{last}, a block id in 0..2^31-1), whole numbers)")
        width = max([host.shape[1]] + [col + 1 for col, _ in pages.values()])
        widest = max([width, *self._padded_tables])
        table = np.zeros((n, widest), dtype=host.dtype)
        table[:, : host.shape[1]] = host
        for row, (col, block) in pages.items():
            table[row, col] = block
        dev = device_array(table, np.int32)
        out = dataclasses.replace(self, block_tables=dev if widest == width else dev[:, :width],
                                  max_blocks_per_seq=width, _block_tables_host=table[:, :width])
        out._padded_tables.update({w: dev if w == widest else dev[:, :w] for w in self._padded_tables if w >= width})
        return out

    def next_decode_step(self, seq_lens: mx.array, seq_lens_host: Sequence[int]) -> AttentionMetadata:
        """This decode batch (one query row per sequence) one token later: the same tables and query
        starts, the lengths ``seq_lens`` (``[num_seqs]`` int32 on the device, derived by the caller,
        `metal_attn.cache.next_decode_plan`) and their host copy ``seq_lens_host``, each one more than
        before. Every sequence must stay within the pages its table row already names (the pool
        checks of `pool_guard` run again on first use)."""
        n = self.num_seqs
        if isinstance(seq_lens_host, (str, bytes)) or not all(is_integer(x) for x in seq_lens_host):
            raise InvalidInputError(f"next_decode_step: seq_lens_host={seq_lens_host!r} (allowed: ints, each of "
                                    f"{self.seq_lens_host[:8]} plus one)")
        lens = tuple(int(x) for x in seq_lens_host)
        if self.lengths_are_bounds or self.q_lens_host != (1,) * n:
            raise InvalidInputError("next_decode_step: needs a decode batch with host lengths (one query row per "
                                    f"sequence; got q_lens {self.q_lens_host[:8]}, bounds {self.lengths_are_bounds})")
        if len(lens) != n or any(b != a + 1 for a, b in zip(self.seq_lens_host, lens)):
            raise InvalidInputError(f"next_decode_step: seq_lens_host={lens[:8]} (allowed: each of "
                                    f"{self.seq_lens_host[:8]} plus one, {n} in all)")
        if type(seq_lens) is not mx.array or tuple(seq_lens.shape) != (n,) or seq_lens.dtype != mx.int32:
            dtype = str(getattr(seq_lens, "dtype", "?")).removeprefix("mlx.core.")
            got = f"{type(seq_lens).__name__} of {dtype} {tuple(getattr(seq_lens, 'shape', ()))}"
            raise InvalidInputError(f"next_decode_step: seq_lens is an {got} (allowed: an int32 mx.array of shape "
                                    f"({n},))")
        out = dataclasses.replace(self, seq_lens=seq_lens, seq_lens_host=lens,
                                  phase=classify_phase(self.q_lens_host, lens), length_plan=length_plan(lens))
        out._padded_tables.update(self._padded_tables)
        return out

    def check_against_pool(self, num_blocks: int, block_size: int) -> None:
        """Raise `InvalidInputError` if a table is too short for its ``seq_len`` or a block id it
        uses is outside the pool (once per pool geometry; nothing when ``validate`` is off)."""
        if self.validate:
            self.pool_guard(num_blocks, block_size)

    def pool_guard(self, num_blocks: int, block_size: int) -> tuple[AttentionMetadata, mx.array | None]:
        """The metadata to run against a pool of ``num_blocks`` blocks of ``block_size`` tokens, and
        the query rows to make NaN (``[total_q_tokens, 1, 1]`` bool, or ``None``), computed once per
        pool geometry with vectorized checks on the host copy of the table.

        A sequence is *bad* when its table row is shorter than ``ceil(seq_len / block_size)`` or an
        entry it uses is outside ``0..num_blocks-1``. With ``validate`` on, the first bad sequence
        raises `InvalidInputError` naming the entry; with it off, the bad sequences' rows are
        returned for poisoning and the table is re-expressed so that no provider can read outside
        the pool: out-of-range entries (table padding included) become block 0 and short rows are
        padded with it. Out-of-range padding alone (e.g. ``-1`` past a sequence's blocks) is not an
        error either way; the providers get the sanitized table then too.
        """
        key = (num_blocks, block_size)
        got = self._guards.get(key)
        if got is not None:
            return got
        if self.lengths_are_bounds:  # the table is the engine's, on the device only (`decode_bounds`)
            need = -(-self.max_seq_len // block_size)
            if need > self.max_blocks_per_seq:
                raise InvalidInputError(
                    f"max_seq_len={self.max_seq_len} needs {need} blocks of {block_size} but the table has "
                    f"{self.max_blocks_per_seq} columns"
                )
            got = self._guards[key] = (self, None)
            return got
        bt = self._block_tables_host
        lens = np.asarray(self.seq_lens_host, dtype=np.int64)
        need = -(-lens // block_size)
        width = bt.shape[1]
        short = need > width
        out_of_range = (bt < 0) | (bt >= num_blocks)
        used = np.arange(width)[None, :] < need[:, None]
        bad_used = out_of_range & used
        bad_seq = short | bad_used.any(axis=1)
        if self.validate and bad_seq.any():
            i = int(np.argmax(bad_seq))
            if short[i]:
                raise InvalidInputError(
                    f"block_tables row {i} has {width} entries but seq_lens[{i}]={int(lens[i])} "
                    f"with block_size={block_size} needs {int(need[i])}"
                )
            j = int(np.argmax(bad_used[i]))
            raise InvalidInputError(
                f"block_tables[{i}][{j}]={int(bt[i, j])} is out of range "
                f"(pool has {num_blocks} blocks: 0..{num_blocks - 1})"
            )
        md, poison = self, None
        if short.any() or out_of_range.any():
            q_lens = np.asarray(self.q_lens_host, dtype=np.int64)
            safe = np.where(out_of_range, 0, bt)
            if short.any():
                # A bad sequence's rows become NaN anyway: it runs over its own query rows only, so a wild
                # seq_len (2**31 - 1, say) costs no table of that many columns and no pass over it.
                lens = np.where(bad_seq, q_lens, lens)
                safe = np.pad(safe, ((0, 0), (0, max(0, int((-(-lens // block_size)).max()) - width))))
                md = AttentionMetadata.build(safe, lens, np.concatenate([[0], np.cumsum(q_lens)]), validate=False)
            else:
                md = self._with_table(safe)
            if bad_seq.any():
                poison = device_array(np.repeat(bad_seq, q_lens)[:, None, None])
        got = self._guards[key] = (md, poison)
        return got

    def _with_table(self, table: np.ndarray) -> AttentionMetadata:
        """The same batch over another host block table (its caches, init=False fields, start empty)."""
        return dataclasses.replace(
            self,
            block_tables=device_array(table, np.int32),
            max_blocks_per_seq=int(table.shape[1]),
            _block_tables_host=table,
        )

    def split_blocks(self, ratio: int) -> AttentionMetadata:
        """The same batch with every page ``b`` seen as kernel blocks ``b*ratio .. b*ratio+ratio-1``."""
        if ratio == 1:
            return self
        if self.lengths_are_bounds:
            raise InvalidInputError(
                f"a batch of decode_bounds metadata cannot be re-split into kernel blocks (ratio {ratio}): its "
                "table is on the device only; use a page size that is a kernel block size (8, 16 or 32)"
            )
        cached = self._split.get(ratio)
        if cached is not None:
            return cached
        bt = self._block_tables_host
        expanded = (bt[:, :, None] * ratio + np.arange(ratio)[None, None, :]).reshape(bt.shape[0], -1)
        out = self._with_table(expanded)
        self._split[ratio] = out
        return out

    def query_tiles(self, rows_per_tile: int, first_seq: int = 0) -> mx.array:
        """``[num_tiles, 2]`` int32: ``(sequence, first query row within it)`` of every tile of
        ``rows_per_tile`` query rows, for the sequences from ``first_seq`` on, in batch order
        (a sequence of ``q_len`` rows has ``ceil(q_len / rows_per_tile)`` tiles). Built once per
        (rows_per_tile, first_seq) and kept: every layer of a step launches the same grid."""
        key = (int(rows_per_tile), int(first_seq))
        got = self._tiles.get(key)
        if got is not None:
            return got
        if rows_per_tile < 1 or not 0 <= first_seq < self.num_seqs:
            raise ValueError(f"query_tiles(rows_per_tile={rows_per_tile}, first_seq={first_seq}) "
                             f"(allowed: rows_per_tile >= 1, 0 <= first_seq < num_seqs={self.num_seqs})")
        q_lens = np.asarray(self.q_lens_host[first_seq:], dtype=np.int64)
        counts = -(-q_lens // rows_per_tile)
        seqs = np.repeat(np.arange(first_seq, self.num_seqs, dtype=np.int64), counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        rows = (np.arange(int(counts.sum()), dtype=np.int64) - first_tile) * rows_per_tile
        got = device_array(np.stack([seqs, rows], axis=1), np.int32)
        mx.eval(got)
        self._tiles[key] = got
        return got


@functools.lru_cache(maxsize=256)
def decode_query_starts(n: int) -> mx.array:
    """``cu_seqlens_q`` of ``n`` decode rows, ``[0, 1, .., n]``: built and evaluated once per ``n``, so a
    decode step (a compiled one too) reads a constant instead of computing it on the device every step."""
    got = device_array(np.arange(n + 1), np.int32)
    mx.eval(got)
    return got
