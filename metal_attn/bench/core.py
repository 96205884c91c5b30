"""The suite runner: `run_suite` puts every candidate of a suite (`metal_attn.bench.candidates`) next to the
others on the same shapes (`metal_attn.bench.shapes`), in one run, one after another or interleaved, and
checks their outputs against each other; `machine_info` says where it ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn.bench.candidates import Candidate, CandidateResult, Opened, SettingsVariant, TimedCandidate, rates
from metal_attn.bench.ratios import SPEEDUP_PEERS
from metal_attn.bench.shapes import CHECK_TOLERANCE, Case, Shape
from metal_attn.device import current_device
from metal_attn.errors import NoProviderError

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapeResult:
        """The result `to_dict` wrote (a run saved with ``--json``)."""
        return cls(Shape.from_dict(data["shape"]), [CandidateResult.from_dict(c) for c in data["candidates"]],
                   ceiling_gbps=data.get("ceiling_gbps"), check_against=data.get("check_against"),
                   auto_vs_fastest=data.get("auto_vs_fastest"))


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SuiteResult:
        """The suite `to_dict` wrote (a run saved with ``--json``): what its tables and plot need."""
        return cls(name=data["name"], description=data["description"], candidates=tuple(data["candidates"]),
                   warmup=int(data["warmup"]), iters=int(data["iters"]),
                   results=[ShapeResult.from_dict(r) for r in data["results"]], ceiling=data.get("ceiling"),
                   mode=data.get("mode", "blocking"), interrupted=bool(data.get("interrupted")),
                   interleaved=bool(data.get("interleaved")))


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
    GPU's clocks) spreads over them; interleaved, it is the order candidates are opened and
    calibrated in, and the list each round's `round_order` permutes. On the H200 two measurements of
    one route in one run have read 1.19-1.71x apart, measured first or last
    (docs/bench-h200-prefill.md, thirteenth session).
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


def round_order(count: int, round_index: int) -> list[int]:
    """The order in which round ``round_index`` of an interleaved run samples ``count`` candidates: a
    Williams design, ``0, 1, count - 1, 2, count - 2, ...`` shifted by ``round_index // 2`` (mod
    ``count``), reversed in odd rounds. Over ``2 * count`` rounds every candidate leads twice and directly
    follows every other one twice. In a fixed order each candidate always follows the same one, and what
    that one leaves behind lands on it alone: on an H100 (prefill-gpu --pipelined --interleave,
    forty-second session) ``auto``, sampled right after torch in every round, read 2-5% under
    ``sdpa_prefill``, the same route, on 8 of 9 prefill shapes."""
    zigzag = [0]
    low, high = 1, count - 1
    while len(zigzag) < count:
        zigzag.append(low)
        low += 1
        if len(zigzag) < count:
            zigzag.append(high)
            high -= 1
    shift = round_index // 2
    order = [(k + shift) % count for k in zigzag] if count else []
    return order[::-1] if round_index % 2 else order


def measure_interleaved(cands: Sequence[Any], case: Case, *, warmup: int, iters: int,
                        pipelined: bool = False) -> list[CandidateResult]:
    """Results of ``cands`` (each `can_interleave`) on ``case``, their samples taken in turn: every
    candidate is opened and warmed up, then each is calibrated again once all are warm (so none is
    sized in the wake of another's first calls), then one round is taken and dropped (the first sample
    after the others' warm-up read up to 14x the median on an H100), then each of ``iters`` rounds takes
    one sample of each, in the order `round_order` gives (a permutation of ``cands``' order). A drift of
    the machine over the run (the GPU's clocks, the host's state) then lands on every candidate alike,
    where one candidate's samples after another's would put it between them. Every candidate's prepared
    state is held at once."""
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
        def each(step: Callable[[Opened], None], order: Sequence[int]) -> None:
            for i in order:
                if i not in live:
                    continue
                try:
                    step(live[i])
                except Exception as exc:
                    results[i] = failed_result(cands[i], exc)
                    del live[i]

        everyone = list(live)
        each(Opened.calibrate, everyone)
        each(Opened.sample, everyone)
        for opened in live.values():
            opened.samples.clear()  # the dropped round
        for r in range(iters):
            each(Opened.sample, [everyone[k] for k in round_order(len(everyone), r)])
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
