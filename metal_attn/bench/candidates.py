"""What a benchmark measures: a `Candidate` (a provider forced by name, a settings variant of one, a peer,
the bandwidth ceiling) prepares its call on a case, is timed (`metal_attn.bench.timing`) and gives a
`CandidateResult` with its metrics:

- fraction of ceiling: decode bandwidth / the ceiling measured in the same run;
- speedup vs a peer: peer median / candidate median (> 1: faster than the peer).

Both are also given as named ratios (`metal_attn.bench.ratios`: higher is better, keys end in
``ratio``), the numbers baselines store and ``metal-attn bench --compare`` checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn.bench.ratios import ratios_of
from metal_attn.bench.shapes import Case, Shape
from metal_attn.bench.timing import (
    MIN_SAMPLE_S,
    PIPELINED_MIN_SAMPLE_S,
    Timing,
    mlx_sync,
    one_sample,
    time_calls,
    timing_of,
    warm_up,
)
from metal_attn.errors import NoProviderError


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CandidateResult:
        """The result `to_dict` wrote (a run saved with ``--json``; the output rows are not saved)."""
        timing = data.get("timing")
        return cls(name=data["name"], kind=data["kind"], status=data["status"], reasons=tuple(data["reasons"]),
                   timing=Timing.from_dict(timing) if timing else None, gbps=data.get("gbps"),
                   tflops=data.get("tflops"), fraction_of_ceiling=data.get("fraction_of_ceiling"),
                   speedup=dict(data.get("speedup") or {}), route=data.get("route"), check=data.get("check"),
                   details=dict(data.get("details") or {}))


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
    #: ``fn`` queues its work without waiting (pipelined mode and a ``launch`` to queue): its samples are
    #: sized for `PIPELINED_MIN_SAMPLE_S` (up to `MAX_INNER` calls: 20 ms for a 20 µs call).
    queued: bool = False

    @property
    def min_sample_s(self) -> float:
        """The shortest sample this call's ``inner`` is sized for."""
        return PIPELINED_MIN_SAMPLE_S if self.queued else MIN_SAMPLE_S

    def warm_up(self, warmup: int) -> None:
        """`time_fn`'s warm-up (the first call already made) and calibration: sets ``inner``."""
        self.inner = warm_up(self.fn, self.prep.sync, max(warmup - 1, 1), self.min_sample_s)

    def calibrate(self) -> None:
        """Size ``inner`` again (two calibration loops, no further warm-up calls), under this candidate's
        scope: after every candidate of an interleaved run is warm, none is sized in another's wake."""
        with self.scope():
            self.inner = warm_up(self.fn, self.prep.sync, 1, self.min_sample_s)

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
    """Median seconds per call of ``compute`` queued with ``mx.async_eval`` (one wait per sample of at
    least `PIPELINED_MIN_SAMPLE_S`, `time_calls`): the sweeps' bare-launch timing."""
    return time_calls(compute, pipelined=True, warmup=warmup, iters=iters).median_s


def f32_rows(out: mx.array) -> np.ndarray:
    """Packed ``[total_q_tokens, heads, head]`` output rows as float32 numpy (a `Prepared`'s ``to_rows``)."""
    return np.array(out.astype(mx.float32))


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
        queued = pipelined and prep.launch is not None
        return Opened(prep, prep.launch if queued else prep.run, rows, queued=queued)

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

        return mlx_prepared(compute, f32_rows, route)

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
