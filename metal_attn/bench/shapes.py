"""What a benchmark runs on: `Shape` (decode rows, a causal prefill, or a mixed batch of both) and
`build_case`, which makes a shape's inputs once (random query, paged pools with non-contiguous random block
tables, `AttentionMetadata`) and the equivalent contiguous K/V on demand for the peers.

A shape's metrics (one formula each, used everywhere):

- decode bandwidth: ``kv_bytes / median``, where ``kv_bytes = sum over sequences
  of context * num_kv_heads * head_size * 2 (K and V) * itemsize`` (K+V read once);
- prefill compute: ``flops / median``, where ``flops = 4 * num_heads * head_size *
  attended_pairs`` (2 for Q.K^T and 2 for P.V per query-key pair), and
  ``attended_pairs`` counts the causal rule exactly: a sequence of ``q_len`` new
  rows on ``context`` tokens contributes ``q_len * (context - q_len) +
  q_len * (q_len + 1) / 2``, i.e. ``q_len * ctx_avg`` with ``ctx_avg = context -
  (q_len - 1) / 2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn.api import kernel_block_size
from metal_attn.checks import int_at_least
from metal_attn.device import current_device
from metal_attn.metadata import AttentionMetadata
from metal_attn.request import AttentionRequest

#: Supported dtypes by name, their MLX dtype, their short label and item size.
DTYPES: dict[str, tuple[Any, str, int]] = {
    "float32": (mx.float32, "f32", 4),
    "float16": (mx.float16, "f16", 2),
    "bfloat16": (mx.bfloat16, "bf16", 2),
}

#: Output agreement bound (relative L2 vs the check baseline) per dtype. float32 allows for
#: TF32 matmuls on NVIDIA GPUs (MLX SDPA prefill differs from exact float32 by ~3e-4 there);
#: a broken kernel is off by O(1).
CHECK_TOLERANCE: dict[str, float] = {"float32": 2e-3, "float16": 5e-3, "bfloat16": 2e-2}

#: Random data is generated for at most this many pool elements and tiled beyond
#: (generation is slow on one CPU core; the period is thousands of pages).
_RANDOM_PERIOD_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class Rows:
    """``count`` identical sequences of a batch: ``q_len`` new rows on ``context`` KV tokens."""

    count: int
    q_len: int
    context: int

    def __post_init__(self) -> None:
        for name in ("count", "q_len", "context"):
            int_at_least(f"Rows.{name}", getattr(self, name))
        if self.q_len > self.context:
            raise ValueError(f"Rows.q_len={self.q_len} > context={self.context} (context counts the new rows too)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark batch.

    ``q_len=1``: decode (``batch`` rows, each on ``context`` tokens). ``q_len > 1``:
    causal prefill of ``q_len`` new tokens on ``context`` total tokens per
    sequence. ``mixed``: a batch of decode rows and prefill chunks (decode rows
    first); build it with `Shape.mix`, which fills ``batch``/``context``/``q_len``.
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    context: int
    dtype: str = "bfloat16"
    block_size: int = 16
    q_len: int = 1
    mixed: tuple[Rows, ...] | None = None
    label: str = ""

    def __post_init__(self) -> None:
        for name in ("batch", "num_heads", "num_kv_heads", "head_size", "context", "block_size", "q_len"):
            int_at_least(f"Shape.{name}", getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape.dtype={self.dtype!r} (allowed: {', '.join(DTYPES)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Shape.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if kernel_block_size(self.block_size) is None:
            raise ValueError(f"Shape.block_size={self.block_size} (allowed: a multiple of 8)")
        if self.q_len > self.context:
            raise ValueError(f"Shape.q_len={self.q_len} > context={self.context} (context counts the new rows too)")
        if self.mixed is not None:
            rows = self.mixed
            if not rows or not all(isinstance(r, Rows) for r in rows):
                raise ValueError(f"Shape.mixed={rows!r} (allowed: a non-empty tuple of Rows)")
            qs = [r.q_len for r in rows]
            if qs != sorted(qs, key=lambda q: q > 1):
                raise ValueError(f"Shape.mixed: decode rows (q_len=1) must come first (got q_lens {qs})")
            want = (sum(r.count for r in rows), max(r.context for r in rows), max(qs))
            if (self.batch, self.context, self.q_len) != want:
                raise ValueError(
                    f"Shape.mixed needs batch, context, q_len = {want} (got {(self.batch, self.context, self.q_len)}); "
                    "build mixed shapes with Shape.mix"
                )
        if not self.label:
            object.__setattr__(self, "label", self._auto_label())

    @classmethod
    def mix(cls, rows: Sequence[Rows], num_heads: int, num_kv_heads: int, head_size: int, *,
            dtype: str = "bfloat16", block_size: int = 16, label: str = "") -> Shape:
        """A mixed batch: ``rows`` groups, decode rows (``q_len=1``) first."""
        rows = tuple(rows)
        if not rows:
            raise ValueError("Shape.mix: rows must not be empty")
        return cls(
            batch=sum(r.count for r in rows), num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, context=max(r.context for r in rows), dtype=dtype, block_size=block_size,
            q_len=max(r.q_len for r in rows), mixed=rows, label=label,
        )

    # -- the batch, sequence by sequence --------------------------------------------------------

    @property
    def rows(self) -> tuple[Rows, ...]:
        """The batch as groups of identical sequences, in batch order."""
        return self.mixed if self.mixed is not None else (Rows(self.batch, self.q_len, self.context),)

    @property
    def q_lens(self) -> list[int]:
        return [r.q_len for r in self.rows for _ in range(r.count)]

    @property
    def seq_lens(self) -> list[int]:
        return [r.context for r in self.rows for _ in range(r.count)]

    @property
    def phase(self) -> str:
        """``decode``, ``prefill`` or ``mixed`` (what the metrics are about)."""
        decode = [r.q_len == 1 for r in self.rows]
        return "decode" if all(decode) else ("prefill" if not any(decode) else "mixed")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][2]

    @property
    def total_q_tokens(self) -> int:
        return sum(r.count * r.q_len for r in self.rows)

    @property
    def kv_bytes(self) -> int:
        """K+V bytes read once: sum of context * num_kv_heads * head_size * 2 * itemsize."""
        return sum(r.count * r.context for r in self.rows) * self.num_kv_heads * self.head_size * 2 * self.itemsize

    @property
    def attended_pairs(self) -> int:
        """Query-key pairs the causal rule admits, summed over the batch (per head)."""
        return sum(r.count * (r.q_len * (r.context - r.q_len) + r.q_len * (r.q_len + 1) // 2) for r in self.rows)

    @property
    def flops(self) -> int:
        """4 * num_heads * head_size * attended_pairs (QK^T and PV, 2 flops per multiply-add)."""
        return 4 * self.num_heads * self.head_size * self.attended_pairs

    @property
    def metrics(self) -> tuple[str, ...]:
        """Headline metrics: decode GB/s, prefill TFLOP/s, mixed both."""
        return {"decode": ("GB/s",), "prefill": ("TFLOP/s",), "mixed": ("GB/s", "TFLOP/s")}[self.phase]

    def _auto_label(self) -> str:
        geo = f"h{self.num_heads}/{self.num_kv_heads} d{self.head_size}"
        tail = DTYPES[self.dtype][1] + ("" if self.block_size == 16 else f" bs{self.block_size}")
        if self.phase == "decode":
            return f"decode b{self.batch} {geo} L{self.context} {tail}"
        if self.phase == "prefill":
            b = "" if self.batch == 1 else f"b{self.batch} "
            return f"prefill {b}q{self.q_len} L{self.context} {geo} {tail}"
        parts = "+".join(f"{r.count}x{r.q_len}@{r.context}" for r in self.rows)
        return f"mixed {parts} {geo} {tail}"

    def request(self, backend: str | None = None) -> AttentionRequest:
        """The `AttentionRequest` `paged_attention` builds for this shape (for `metal_attn.explain`)."""
        return AttentionRequest.from_lengths(
            q_lens=self.q_lens, seq_lens=self.seq_lens, backend=backend or current_device().backend,
            dtype=self.dtype, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, block_size=kernel_block_size(self.block_size) or self.block_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "phase": self.phase, "batch": self.batch, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_size": self.head_size, "context": self.context,
            "q_len": self.q_len, "dtype": self.dtype, "block_size": self.block_size,
            "rows": [dataclasses.asdict(r) for r in self.rows], "total_q_tokens": self.total_q_tokens,
            "kv_bytes": self.kv_bytes, "attended_pairs": self.attended_pairs, "flops": self.flops,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Shape:
        """The shape `to_dict` wrote (a run saved with ``--json``), under its saved label: its batch, heads,
        dtype and rows, which give its phase and metrics (a decode step reads as its decode batch)."""
        rows = tuple(Rows(int(r["count"]), int(r["q_len"]), int(r["context"])) for r in data["rows"])
        geometry = {"num_heads": int(data["num_heads"]), "num_kv_heads": int(data["num_kv_heads"]),
                    "head_size": int(data["head_size"]), "dtype": data["dtype"],
                    "block_size": int(data["block_size"]), "label": str(data["label"])}
        if len(rows) > 1:
            return Shape.mix(rows, **geometry)
        (r,) = rows
        return Shape(batch=r.count, context=r.context, q_len=r.q_len, **geometry)

    def memory_estimate(self) -> int:
        """Peak bytes a benchmark of this shape may hold: pools, contiguous copies, a gathered copy, slack."""
        return 4 * self.kv_bytes + 4 * _RANDOM_PERIOD_ELEMENTS * self.itemsize + (64 << 20)

    def build(self, *, seed: int = 0) -> Case:
        """This shape's inputs (`build_case`; a subclass may build other inputs for its own candidates)."""
        return build_case(self, seed=seed)


# -- inputs ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """A run of identical sequences in batch order, with its index ranges."""

    rows: Rows
    seq_start: int
    token_start: int

    @property
    def seqs(self) -> slice:
        return slice(self.seq_start, self.seq_start + self.rows.count)

    @property
    def tokens(self) -> slice:
        return slice(self.token_start, self.token_start + self.rows.count * self.rows.q_len)


@dataclasses.dataclass(eq=False)
class Case:
    """The inputs of one shape: query, paged pools, metadata; contiguous K/V for peers on demand."""

    shape: Shape
    q: mx.array  # [total_q_tokens, num_heads, head_size]
    k_pool: mx.array  # [num_blocks, block_size, num_kv_heads, head_size]
    v_pool: mx.array
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, random and non-contiguous
    metadata: AttentionMetadata
    scale: float
    _contiguous: list[tuple[mx.array, mx.array]] | None = dataclasses.field(default=None, repr=False)
    _queries: list[mx.array] | None = dataclasses.field(default=None, repr=False)

    @property
    def groups(self) -> list[Group]:
        out, seq, tok = [], 0, 0
        for r in self.shape.rows:
            out.append(Group(r, seq, tok))
            seq += r.count
            tok += r.count * r.q_len
        return out

    def group_tables(self, g: Group) -> mx.array:
        """Block-table rows of group ``g``, cut to the blocks its context needs."""
        nblk = -(-g.rows.context // self.shape.block_size)
        return mx.array(self.block_tables[g.seqs, :nblk])

    def gather(self, pool: mx.array, g: Group) -> mx.array:
        """Pages of ``g`` gathered to ``[count, num_kv_heads, context, head_size]`` (lazy, not contiguous)."""
        s = self.shape
        pages = mx.take(pool, self.group_tables(g), axis=0)  # [n, nblk, bs, kvh, d]
        n, nblk = pages.shape[:2]
        flat = pages.reshape(n, nblk * s.block_size, s.num_kv_heads, s.head_size)[:, : g.rows.context]
        return flat.transpose(0, 2, 1, 3)

    def contiguous_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per group, K and V as contiguous ``[count, num_kv_heads, context, head_size]`` (built once)."""
        if self._contiguous is None:
            out = []
            for g in self.groups:
                k = mx.contiguous(self.gather(self.k_pool, g))
                v = mx.contiguous(self.gather(self.v_pool, g))
                mx.eval(k, v)
                out.append((k, v))
            self._contiguous = out
        return self._contiguous

    def group_queries(self) -> list[mx.array]:
        """Per group, the query as contiguous ``[count, num_heads, q_len, head_size]`` (built once)."""
        if self._queries is None:
            s = self.shape
            out = []
            for g in self.groups:
                qg = self.q[g.tokens].reshape(g.rows.count, g.rows.q_len, s.num_heads, s.head_size)
                out.append(mx.contiguous(qg.transpose(0, 2, 1, 3)))
            mx.eval(out)
            self._queries = out
        return self._queries

    def release(self) -> None:
        """Drop the peers' copies (the case itself is dropped by its owner)."""
        self._contiguous = None
        self._queries = None


def _random_pool(num_blocks: int, shape: Shape, rng: np.random.Generator) -> mx.array:
    """A pool of ``num_blocks`` pages: uniform(-1, 1) data, one random period tiled (``num_blocks`` is a multiple)."""
    s = shape
    page = s.block_size * s.num_kv_heads * s.head_size
    period = max(1, min(num_blocks, _RANDOM_PERIOD_ELEMENTS // page))
    base = rng.random((period, s.block_size, s.num_kv_heads, s.head_size), dtype=np.float32)
    base = mx.array(base * 2 - 1).astype(DTYPES[s.dtype][0])
    reps = num_blocks // period
    pool = mx.tile(base, (reps, 1, 1, 1)) if reps > 1 else base
    mx.eval(pool)
    return pool


def build_case(shape: Shape, *, seed: int = 0) -> Case:
    """Random inputs for ``shape``: query, K/V pools, random non-contiguous block tables, metadata."""
    s = shape
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-ctx // s.block_size) for ctx in s.seq_lens]
    needed = sum(blocks_per_seq)
    page = s.block_size * s.num_kv_heads * s.head_size
    period = max(1, min(needed, _RANDOM_PERIOD_ELEMENTS // page))
    num_blocks = -(-needed // period) * period  # whole periods; the spare pages stay unused
    ids = rng.permutation(num_blocks)[:needed].astype(np.int32)
    tables = np.zeros((s.batch, max(blocks_per_seq)), dtype=np.int32)
    at = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = ids[at : at + n]
        at += n
    q = mx.array(rng.random((s.total_q_tokens, s.num_heads, s.head_size), dtype=np.float32) * 2 - 1)
    q = q.astype(DTYPES[s.dtype][0])
    k_pool = _random_pool(num_blocks, s, rng)
    v_pool = _random_pool(num_blocks, s, rng)
    mx.eval(q)
    cu = np.concatenate([[0], np.cumsum(s.q_lens)]).astype(np.int32)
    md = AttentionMetadata.build(mx.array(tables), mx.array(np.array(s.seq_lens, dtype=np.int32)), mx.array(cu))
    return Case(s, q, k_pool, v_pool, tables, md, s.head_size**-0.5)
