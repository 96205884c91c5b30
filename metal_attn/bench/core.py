"""Benchmark core: shapes, inputs, candidates, metrics and the suite runner (timing: `metal_attn.bench.timing`).

A `Shape` describes one batch (decode rows, a causal prefill, or a mixed
batch of both); `build_case` makes its inputs once (random query, paged
pools with non-contiguous random block tables, `AttentionMetadata`) and the
equivalent contiguous K/V on demand for the peers. A `Candidate` (a provider
forced by name, a peer, the bandwidth ceiling) is measured on a case with
`time_fn`, and `run_suite` puts every candidate of a suite next to the others
on the same shapes, in one run.

Metrics (one formula each, used everywhere):

- decode bandwidth: ``kv_bytes / median``, where ``kv_bytes = sum over sequences
  of context * num_kv_heads * head_size * 2 (K and V) * itemsize`` (K+V read once);
- prefill compute: ``flops / median``, where ``flops = 4 * num_heads * head_size *
  attended_pairs`` (2 for Q.K^T and 2 for P.V per query-key pair), and
  ``attended_pairs`` counts the causal rule exactly: a sequence of ``q_len`` new
  rows on ``context`` tokens contributes ``q_len * (context - q_len) +
  q_len * (q_len + 1) / 2``, i.e. ``q_len * ctx_avg`` with ``ctx_avg = context -
  (q_len - 1) / 2``;
- fraction of ceiling: decode bandwidth / the ceiling measured in the same run;
- speedup vs a peer: peer median / candidate median (> 1: faster than the peer).

Both are also given as named ratios (`metal_attn.bench.ratios`: higher is better, keys end in
``ratio``), the numbers baselines store and ``metal-attn bench --compare`` checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn.api import kernel_block_size
from metal_attn.bench.ratios import SPEEDUP_PEERS, ratios_of
from metal_attn.bench.timing import Timing, mlx_sync, one_sample, time_fn, timing_of, warm_up
from metal_attn.checks import int_at_least
from metal_attn.device import current_device
from metal_attn.errors import NoProviderError
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


# -- candidates -------------------------------------------------------------------------------------


class Skip(Exception):
    """A candidate cannot run a shape here: ``status`` and every reason."""

    def __init__(self, status: str, reasons: Sequence[str]) -> None:
        self.status = status
        self.reasons = tuple(reasons)
        super().__init__(f"{status}: {'; '.join(self.reasons)}")


@dataclasses.dataclass
class Prepared:
    """A candidate ready to time on one case."""

    run: Callable[[], Any]  # does the work and finishes it (mx.eval inside); returns the output
    sync: Callable[[], None] = mlx_sync
    launch: Callable[[], Any] | None = None  # the same work, queued without waiting (pipelined mode)
    to_rows: Callable[[Any], np.ndarray] | None = None  # output -> float32 [total_q_tokens, heads, head]
    route: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    close: Callable[[], None] | None = None


@dataclasses.dataclass
class CandidateResult:
    """One candidate on one shape: the raw median and everything derived from it."""

    name: str
    kind: str  # provider | peer | ceiling
    status: str  # ok | refused | unavailable | not registered | skipped | error
    reasons: tuple[str, ...] = ()
    timing: Timing | None = None
    gbps: float | None = None
    tflops: float | None = None
    fraction_of_ceiling: float | None = None
    speedup: dict[str, float] = dataclasses.field(default_factory=dict)
    route: str | None = None
    check: dict[str, Any] | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    output: np.ndarray | None = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ratios(self) -> dict[str, float]:
        """Speedups and the fraction of the ceiling as named ratios (`metal_attn.bench.ratios`)."""
        return ratios_of(self.speedup, self.fraction_of_ceiling) if self.ok else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "status": self.status, "reasons": list(self.reasons),
            "median_s": self.timing.median_s if self.timing else None,
            "timing": self.timing.to_dict() if self.timing else None,
            "gbps": self.gbps, "tflops": self.tflops, "fraction_of_ceiling": self.fraction_of_ceiling,
            "speedup": dict(self.speedup), "ratios": self.ratios, "route": self.route, "check": self.check,
            "details": self.details,
        }


@dataclasses.dataclass
class Opened:
    """A `TimedCandidate` prepared on one case and called once, between its preparation and its
    result: what the runner times, one candidate after another (`TimedCandidate.measure`) or a
    sample of each in turn (`measure_interleaved`)."""

    prep: Prepared
    #: The call a sample repeats: the prepared call, or its queued form in pipelined mode.
    fn: Callable[[], Any]
    #: The first call's output as float32 rows, for the check against the reference.
    rows: np.ndarray | None
    #: Entered around every call of this candidate (a settings variant's overrides).
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    inner: int = 0
    route: str | None = None
    samples: list[float] = dataclasses.field(default_factory=list)

    def warm_up(self, warmup: int) -> None:
        """`time_fn`'s warm-up (the first call already made) and calibration: sets ``inner``."""
        self.inner = warm_up(self.fn, self.prep.sync, max(warmup - 1, 1))

    def sample(self) -> None:
        """One more sample, under this candidate's scope."""
        with self.scope():
            self.samples.append(one_sample(self.fn, self.prep.sync, self.inner))

    @contextlib.contextmanager
    def closing(self) -> Iterator[Opened]:
        """Close the prepared call (its ``close``) on leaving, whatever happened."""
        try:
            yield self
        finally:
            if self.prep.close:
                self.prep.close()

    def result(self, candidate: Any, shape: Shape) -> CandidateResult:
        """``candidate``'s result from the samples taken."""
        res = CandidateResult(candidate.name, candidate.kind, "ok", timing=timing_of(self.samples, self.inner),
                              route=self.route, details=dict(self.prep.details), output=self.rows)
        apply_metrics(res, shape)
        return res


class Candidate(Protocol):
    """Anything the runner can measure on a case."""

    name: str
    kind: str

    def measure(self, case: Case, *, warmup: int, iters: int, pipelined: bool = False) -> CandidateResult: ...


def pipelined_median_s(compute: Callable[[], Any], *, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call of ``compute`` queued with ``mx.async_eval`` (one wait per sample,
    `time_fn` around it): the sweeps' bare-launch timing."""
    return time_fn(lambda: mx.async_eval(compute()), warmup=warmup, iters=iters).median_s


def mlx_prepared(compute: Callable[[], Any], to_rows: Callable[[Any], np.ndarray], route: str) -> Prepared:
    """`Prepared` for an MLX computation: ``run`` evaluates it (``mx.eval``), ``launch`` queues it
    (``mx.async_eval``)."""

    def run() -> Any:
        out = compute()
        mx.eval(out)
        return out

    return Prepared(run=run, launch=lambda: mx.async_eval(compute()), to_rows=to_rows, route=route)


class TimedCandidate:
    """Base for candidates measured by timing a `Prepared` call (providers and peers)."""

    name: str = ""
    kind: str = "peer"

    def prepare(self, case: Case) -> Prepared:
        """Everything untimed: checks (raise `Skip`), input conversion, the call to time."""
        raise NotImplementedError

    def measure(self, case: Case, *, warmup: int, iters: int, pipelined: bool = False) -> CandidateResult:
        opened = self.open(case, pipelined=pipelined)
        if isinstance(opened, CandidateResult):
            return opened
        with opened.closing():
            try:
                opened.warm_up(warmup)
                opened.route = self.route_after(opened.prep)
                for _ in range(iters):
                    opened.sample()
            except NoProviderError as exc:  # e.g. a forced provider whose kernel failed to build
                return CandidateResult(self.name, self.kind, "refused", (str(exc),))
            return opened.result(self, case.shape)

    def open(self, case: Case, *, pipelined: bool = False) -> Opened | CandidateResult:
        """This candidate prepared on ``case`` and called once (the call compiles; its output is kept for
        the check), ready for samples; or the result that says why it cannot run here. The caller
        closes what it opened (`Opened.closing`)."""
        try:
            prep = self.prepare(case)
        except Skip as skip:
            return CandidateResult(self.name, self.kind, skip.status, skip.reasons)
        try:
            first = prep.run()
            prep.sync()
            rows = prep.to_rows(first) if prep.to_rows else None
            del first
        except BaseException as exc:
            if prep.close:
                prep.close()
            if isinstance(exc, NoProviderError):
                return CandidateResult(self.name, self.kind, "refused", (str(exc),))
            raise
        return Opened(prep, prep.launch if pipelined and prep.launch is not None else prep.run, rows)

    def route_after(self, prep: Prepared) -> str | None:
        return prep.route


def rates(shape: Shape, median_s: float) -> tuple[float, float]:
    """(GB/s of K+V read once, TFLOP/s) of ``shape`` at a median of ``median_s`` seconds."""
    return shape.kv_bytes / median_s / 1e9, shape.flops / median_s / 1e12


def apply_metrics(res: CandidateResult, shape: Shape) -> None:
    """Fill GB/s and TFLOP/s from the median (both always; the table shows the shape's headline)."""
    if res.timing is None or res.timing.median_s <= 0:
        return
    res.gbps, res.tflops = rates(shape, res.timing.median_s)


#: ``NAME[setting=value;...]``: candidate NAME measured under those settings (`SettingsVariant`).
_VARIANT = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<changes>[^\[\]]*)\]$")


class SettingsVariant:
    """A candidate measured under other settings, for same-run A/B figures: ``auto[cuda_chains=0]``
    is ``auto`` with ``METAL_ATTN_CUDA_CHAINS=0`` for its preparation, calls and cleanup only (an
    `override_settings` block, so dispatch caches keep the two apart). Its kind is ``variant``:
    never a route ``auto`` is held to, never stored in baselines."""

    kind = "variant"

    def __init__(self, name: str, base: Any, changes: dict[str, str]) -> None:
        self.name, self.base, self.changes = name, base, changes

    def measure(self, case: Case, **kwargs: Any) -> CandidateResult:
        with self.scope():
            res = self.base.measure(case, **kwargs)
        res.name, res.kind = self.name, self.kind
        return res

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """The variant's settings, for a block."""
        from metal_attn.settings import override_settings

        return override_settings(**self.changes)

    def open(self, case: Case, **kwargs: Any) -> Opened | CandidateResult:
        """The base candidate opened under the variant's settings; its calls keep them (`Opened.scope`)."""
        with self.scope():
            opened = self.base.open(case, **kwargs)
        if isinstance(opened, CandidateResult):
            opened.name, opened.kind = self.name, self.kind
            return opened
        opened.scope = self.scope
        return opened

    def route_after(self, prep: Prepared) -> str | None:
        with self.scope():
            return self.base.route_after(prep)


def parse_variant(name: str) -> tuple[str, dict[str, str]] | None:
    """``("auto", {"cuda_chains": "0"})`` for ``"auto[cuda_chains=0]"``; ``None`` for a plain name. Changes
    are separated by ``;`` or ``,``. Raises ValueError naming the candidate when a change is not
    ``setting=value`` or the brackets do not close."""
    m = _VARIANT.match(name.strip())
    if m is None:
        if "[" in name or "]" in name:
            raise ValueError(f"candidate {name!r} is not NAME[setting=value;...] (e.g. auto[cuda_chains=0])")
        return None
    changes: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in re.split(r"[;,]", m.group("changes")))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"candidate {name!r}: {part!r} is not setting=value (e.g. auto[cuda_chains=0])")
        changes[key.strip()] = value.strip()
    if not changes:
        raise ValueError(f"candidate {name!r}: no settings between the brackets (e.g. auto[cuda_chains=0])")
    return m.group("base").strip(), changes


def with_variants(resolve: Callable[[Sequence[str]], list[Any]]) -> Callable[[Sequence[str]], list[Any]]:
    """``resolve`` extended to ``NAME[setting=value;...]`` names (`SettingsVariant` of NAME's candidate)."""

    def resolve_all(names: Sequence[str]) -> list[Any]:
        from metal_attn.errors import SettingsError
        from metal_attn.settings import override_settings

        out: list[Any] = []
        for raw in dict.fromkeys(n.strip() for n in names if n.strip()):
            parsed = parse_variant(raw)
            if parsed is None:
                out.extend(resolve([raw]))
                continue
            base, changes = parsed
            try:  # refused now, before any shape is measured
                with override_settings(**changes):
                    pass
            except SettingsError as exc:
                raise ValueError(f"candidate {raw!r}: {exc}") from None
            cands = resolve([base])
            if len(cands) != 1:
                raise ValueError(f"candidate {raw!r}: {base!r} names {len(cands)} candidates (a variant takes one)")
            out.append(SettingsVariant(raw, cands[0], changes))
        return out

    return resolve_all


class ProviderCandidate(TimedCandidate):
    """A registered provider, forced by name (``auto``: the registry's own choice)."""

    kind = "provider"

    def __init__(self, name: str) -> None:
        self.name = name

    def admit(self, shape: Shape) -> tuple[str | None, str]:
        """``(forced provider or None for auto, the planned route)``; raises `Skip` when this provider is
        not registered or (auto: every provider) refuses ``shape``, with every reason."""
        from metal_attn.plugins import get_registry

        forced = None if self.name == "auto" else self.name
        registered = get_registry().names
        if forced is not None and forced not in registered:
            raise Skip("not registered",
                       [f"provider={forced!r} is not registered (registered: {', '.join(registered) or 'none'})"])
        exp = metal_attn.explain(shape.request(), provider=forced)
        chosen = exp.chosen
        if chosen is None:
            reasons = [f"{r.name}: {x}" if forced is None else x for r in exp.rows for x in r.reasons]
            raise Skip("refused", reasons or ["no provider admits this shape"])
        return forced, f"{chosen.name}: {chosen.plan.describe()}" if chosen.plan else chosen.name

    def prepare(self, case: Case) -> Prepared:
        forced, route = self.admit(case.shape)
        q, k, v, md, scale = case.q, case.k_pool, case.v_pool, case.metadata, case.scale

        def compute() -> mx.array:
            return metal_attn.paged_attention(q, k, v, metadata=md, scale=scale, provider=forced)

        return mlx_prepared(compute, lambda out: np.array(out.astype(mx.float32)), route)

    def route_after(self, prep: Prepared) -> str | None:
        rec = metal_attn.diagnostics.last_dispatch()
        if rec is None:
            return prep.route
        route = f"{rec.provider}: route={rec.route}"
        if rec.partition_size:
            route += f" partition={rec.partition_size}"
        if rec.fallbacks:
            route += " (fallbacks: " + "; ".join(f"{p}: {r}" for p, r in rec.fallbacks) + ")"
        return route


# -- the runner -------------------------------------------------------------------------------------


@dataclasses.dataclass
class ShapeResult:
    shape: Shape
    candidates: list[CandidateResult]
    ceiling_gbps: float | None = None
    check_against: str | None = None
    #: ``auto`` against the fastest admitted provider of the same run (`auto_lag`), when both ran.
    auto_vs_fastest: dict[str, Any] | None = None

    def get(self, name: str) -> CandidateResult | None:
        return next((c for c in self.candidates if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape.to_dict(), "ceiling_gbps": self.ceiling_gbps,
                "check_against": self.check_against, "auto_vs_fastest": self.auto_vs_fastest,
                "candidates": [c.to_dict() for c in self.candidates]}


@dataclasses.dataclass
class SuiteResult:
    name: str
    description: str
    candidates: tuple[str, ...]
    warmup: int
    iters: int
    results: list[ShapeResult]
    ceiling: dict[str, Any] | None = None
    mode: str = "blocking"  # blocking: each timed call waits for its result; pipelined: queued calls
    #: The run was interrupted (Ctrl-C): ``results`` holds the shapes that completed.
    interrupted: bool = False
    #: The timed candidates took their samples in turn (`measure_interleaved`).
    interleaved: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "candidates": list(self.candidates),
                "warmup": self.warmup, "iters": self.iters, "mode": self.mode, "interleaved": self.interleaved,
                "ceiling": self.ceiling, "interrupted": self.interrupted,
                "results": [r.to_dict() for r in self.results]}


def is_gpu() -> bool:
    """Whether MLX computes on a GPU here (Metal or CUDA)."""
    return current_device().backend != "cpu"


def available_memory() -> int | None:
    """Bytes a benchmark may use: GPU memory on GPUs, ``MemAvailable`` on the CPU."""
    dev = current_device()
    if dev.backend != "cpu":
        return dev.memory_bytes
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@contextlib.contextmanager
def cpu_cache_limit() -> Iterator[None]:
    """On the CPU backend, raise MLX's buffer-cache limit so large buffers are not re-mapped every call."""
    if is_gpu():
        yield
        return
    mem = available_memory() or (16 << 30)
    previous = mx.set_cache_limit(int(mem * 0.75))
    try:
        yield
    finally:
        mx.set_cache_limit(previous)


def record_rates(benchmark: Any, shape: Shape) -> None:
    """Add the GB/s (K+V read once) and TFLOP/s of a pytest-benchmark fixture's median to its
    ``extra_info`` (nothing when it did not time, e.g. under ``--benchmark-disable``)."""
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.median > 0:
        gbps, tflops = rates(shape, stats.stats.median)
        benchmark.extra_info["gbps_median"] = gbps
        benchmark.extra_info["tflops_median"] = tflops


def _check(results: list[CandidateResult], shape: Shape) -> str | None:
    """Compare every candidate's output with a baseline (mlx_sdpa, else reference, else the first)."""
    have = [r for r in results if r.ok and r.output is not None]
    if len(have) < 2:
        return None
    base = next((r for name in ("mlx_sdpa", "reference") for r in have if r.name == name), have[0])
    ref = base.output.astype(np.float64)
    norm = float(np.linalg.norm(ref)) or 1.0
    tol = CHECK_TOLERANCE[shape.dtype]
    for r in have:
        if r is base:
            continue
        diff = r.output.astype(np.float64) - ref
        if diff.shape != ref.shape:
            r.check = {"against": base.name, "ok": False, "error": f"output shape {diff.shape} != {ref.shape}"}
            continue
        rel = float(np.linalg.norm(diff)) / norm
        finite = bool(np.isfinite(r.output).all())
        r.check = {"against": base.name, "rel_l2": rel, "max_abs": float(np.abs(diff).max()), "tolerance": tol,
                   "ok": finite and rel <= tol}
    return base.name


def finish_shape(sr: ShapeResult) -> None:
    """Derived numbers: fraction of the ceiling, speedups vs peers, output check."""
    ceiling = sr.get("ceiling")
    if ceiling is not None and ceiling.ok:
        sr.ceiling_gbps = ceiling.gbps
    peers = {n: sr.get(n) for n in SPEEDUP_PEERS}
    for r in sr.candidates:
        if not r.ok or r.kind == "ceiling" or r.timing is None:
            continue
        if sr.ceiling_gbps and "GB/s" in sr.shape.metrics and r.gbps is not None:
            r.fraction_of_ceiling = r.gbps / sr.ceiling_gbps
        for name, p in peers.items():
            if p is not None and p.ok and p is not r and p.timing is not None:
                r.speedup[name] = p.timing.median_s / r.timing.median_s
    sr.check_against = _check(sr.candidates, sr.shape)
    sr.auto_vs_fastest = auto_lag(sr.candidates)
    for r in sr.candidates:
        r.output = None


#: ``auto`` is marked when it is this much slower than the fastest admitted provider of the run.
AUTO_LAG_LIMIT = 1.10


def auto_lag(results: Sequence[CandidateResult]) -> dict[str, Any] | None:
    """``auto``'s median over the fastest provider that admitted the shape and ran in the same run
    (peers are not routes ``auto`` could take); ``marked`` when above `AUTO_LAG_LIMIT` on another
    route than auto's. When auto took the fastest candidate's own route, the lag is the run's
    noise between two measurements of one kernel (``same_route``), not a routing mistake."""
    auto = next((r for r in results if r.name == "auto" and r.ok and r.timing is not None), None)
    ran = [r for r in results if r.kind == "provider" and r.name != "auto" and r.ok and r.timing is not None]
    if auto is None or not ran:
        return None
    fastest = min(ran, key=lambda r: r.timing.median_s)
    lag = auto.timing.median_s / fastest.timing.median_s
    same_route = auto.route == fastest.route
    return {"fastest": fastest.name, "auto_route": auto.route, "fastest_route": fastest.route, "lag": lag,
            "limit": AUTO_LAG_LIMIT, "same_route": same_route, "marked": lag > AUTO_LAG_LIMIT and not same_route}


def run_suite(
    name: str,
    shapes: Sequence[Shape],
    candidates: Sequence[Candidate],
    *,
    warmup: int,
    iters: int,
    description: str = "",
    seed: int = 0,
    pipelined: bool = False,
    progress: Callable[[str], None] | None = None,
    on_shape: Callable[[ShapeResult], None] | None = None,
    rotate: int = 0,
    interleave: bool = False,
) -> SuiteResult:
    """Measure every candidate on every shape (one case built per shape), in one process and run.

    ``pipelined=False`` (default): every timed call waits for its result (``mx.eval``; torch synchronizes).
    ``pipelined=True``: calls are queued (``mx.async_eval``; torch launches) and each sample waits once.
    ``on_shape`` receives each shape's result as soon as it is complete (to print it). A Ctrl-C
    (KeyboardInterrupt) ends the run early: the shapes completed so far are returned, with
    ``interrupted`` set. ``rotate``: each shape measures its candidates starting ``rotate`` places
    further along their list (results keep the list's order). ``--repeat`` passes the run's index,
    so no candidate holds the same place in every run and an order effect (a first-use cost, the
    GPU's clocks) spreads over them. On the H200 two measurements of one route in one run have read
    1.19-1.71x apart, measured first or last (docs/bench-h200-prefill.md, thirteenth session).
    ``interleave``: the timed candidates (providers, peers and their variants) take their samples in
    turn, a sample of each per round (`measure_interleaved`); the ceiling and other candidates are
    measured on their own as before.
    """
    say = progress or (lambda _msg: None)
    out: list[ShapeResult] = []
    mem = available_memory()
    interrupted = False
    with cpu_cache_limit():
        try:
            _run_shapes(shapes, candidates, warmup, iters, seed, pipelined, say, on_shape, mem, out, rotate,
                        interleave)
        except KeyboardInterrupt:
            interrupted = True
    ceiling = next((getattr(c, "summary", None) for c in candidates if c.kind == "ceiling"), None)
    return SuiteResult(name, description, tuple(c.name for c in candidates), warmup, iters, out,
                       ceiling() if callable(ceiling) else None, "pipelined" if pipelined else "blocking",
                       interrupted, interleave)


def _run_shapes(shapes, candidates, warmup, iters, seed, pipelined, say, on_shape, mem, out, rotate,
                interleave) -> None:
    """`run_suite`'s loop: appends each completed `ShapeResult` to ``out`` (and hands it to ``on_shape``)."""
    first = rotate % len(candidates) if candidates else 0
    order = [*range(first, len(candidates)), *range(first)]
    for shape in shapes:
        need = shape.memory_estimate()
        if mem is not None and need > 0.85 * mem:
            reason = f"needs about {need / 2**30:.1f} GiB, {mem / 2**30:.1f} GiB available"
            sr = ShapeResult(shape, [CandidateResult(c.name, c.kind, "skipped", (reason,)) for c in candidates])
            out.append(sr)
            say(f"{shape.label}: skipped ({reason})")
            if on_shape is not None:
                on_shape(sr)
            continue
        case = shape.build(seed=seed)
        results: list[CandidateResult | None] = [None] * len(candidates)
        together = [i for i in order if interleave and can_interleave(candidates[i])]
        for i in order:
            if i in together:
                continue
            cand = candidates[i]
            say(f"{shape.label}: {cand.name}")
            try:
                results[i] = cand.measure(case, warmup=warmup, iters=iters, pipelined=pipelined)
            except Exception as exc:
                results[i] = failed_result(cand, exc)
        if together:
            say(f"{shape.label}: {', '.join(candidates[i].name for i in together)} (interleaved)")
            for i, res in zip(together, measure_interleaved([candidates[i] for i in together], case, warmup=warmup,
                                                            iters=iters, pipelined=pipelined)):
                results[i] = res
        sr = ShapeResult(shape, results)
        finish_shape(sr)
        out.append(sr)
        if on_shape is not None:
            on_shape(sr)
        case.release()
        del case
        gc.collect()
        mx.clear_cache()


def failed_result(cand: Any, exc: Exception) -> CandidateResult:
    """The result of a candidate whose measurement raised ``exc``: refused when no provider could run it,
    else an error naming the exception."""
    if isinstance(exc, NoProviderError):
        return CandidateResult(cand.name, getattr(cand, "kind", "peer"), "refused", (str(exc),))
    return CandidateResult(cand.name, getattr(cand, "kind", "peer"), "error", (f"{type(exc).__name__}: {exc}",))


def can_interleave(cand: Any) -> bool:
    """Whether ``cand`` can be timed a sample at a time next to others (`measure_interleaved`): a
    `TimedCandidate` that measures as the base class does (one with a ``measure`` of its own is
    measured on its own), or a settings variant of one."""
    if isinstance(cand, SettingsVariant):
        return can_interleave(cand.base)
    return isinstance(cand, TimedCandidate) and type(cand).measure is TimedCandidate.measure


def measure_interleaved(cands: Sequence[Any], case: Case, *, warmup: int, iters: int,
                        pipelined: bool = False) -> list[CandidateResult]:
    """Results of ``cands`` (each `can_interleave`) on ``case``, their samples taken in turn: every
    candidate is opened, warmed up and calibrated first, then each of ``iters`` rounds takes one
    sample of each, in the list's order. A drift of the machine over the run (the GPU's clocks, the
    host's state) then lands on every candidate alike, where one candidate's samples after
    another's would put it between them. Every candidate's prepared state is held at once."""
    results: list[CandidateResult | None] = [None] * len(cands)
    live: dict[int, Opened] = {}
    with contextlib.ExitStack() as stack:
        for i, cand in enumerate(cands):
            try:
                opened = cand.open(case, pipelined=pipelined)
                if isinstance(opened, CandidateResult):
                    results[i] = opened
                    continue
                stack.enter_context(opened.closing())
                with opened.scope():
                    opened.warm_up(warmup)
                opened.route = cand.route_after(opened.prep)
                live[i] = opened
            except Exception as exc:
                results[i] = failed_result(cand, exc)
        for _ in range(iters):
            for i in list(live):
                try:
                    live[i].sample()
                except Exception as exc:
                    results[i] = failed_result(cands[i], exc)
                    del live[i]
        for i, opened in live.items():
            results[i] = opened.result(cands[i], case.shape)
    return results


# -- machine info -----------------------------------------------------------------------------------


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    """Backend, device, GPU core count, versions and date, for JSON and pytest-benchmark."""
    dev = current_device()
    info: dict[str, Any] = {
        "backend": dev.backend,
        "device_name": dev.name,
        "architecture": dev.architecture,
        "gpu_cores": dev.gpu_cores,
        "memory_bytes": dev.memory_bytes,
        "cpu_threads": dev.cpu_threads,
        "cpu_model": _cpu_model(),
        "mlx_version": mx.__version__,
        "metal_attn_version": metal_attn.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_version"] = torch.__version__
        if dev.backend == "cuda" and torch.cuda.is_available():
            info["torch_device"] = torch.cuda.get_device_name(0)
    return info
