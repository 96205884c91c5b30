"""Timing MLX (and torch) calls for the benchmarks: one sample is a synchronized loop of calls.

`time_fn` warms a call up, calibrates how many calls a sample holds (so a short GPU call is not
measured on launch and synchronization latency), and takes the samples; `time_calls` times MLX work
blocking or queued with the suites' sample sizes; `warm_up`, `one_sample` and `timing_of` are
`time_fn`'s three steps, for a runner that interleaves the samples of several calls
(`metal_attn.bench.core.measure_interleaved`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from metal_attn.checks import int_at_least


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call seconds: one sample is a synchronized loop of ``inner`` calls, divided by ``inner``."""

    median_s: float
    min_s: float
    mean_s: float
    stdev_s: float
    samples_s: tuple[float, ...]
    inner: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"samples_s": list(self.samples_s)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timing:
        """The timing `to_dict` wrote (a run saved with ``--json``)."""
        return cls(float(data["median_s"]), float(data["min_s"]), float(data["mean_s"]), float(data["stdev_s"]),
                   tuple(float(x) for x in data["samples_s"]), int(data["inner"]))


def mlx_sync() -> None:
    """Wait for MLX's default stream (a no-op in effect on the CPU backend)."""
    mx.synchronize()


#: The shortest sample `time_fn` takes (seconds), and the most calls one sample holds.
MIN_SAMPLE_S = 5e-3
MAX_INNER = 1000

#: The shortest sample of queued calls (pipelined mode: ``sync(); t0; inner queued calls; sync(); t1``).
#: A pipelined sample starts on an idle GPU and ends waiting for the last call, so it holds one blocking
#: boundary whatever ``inner`` is: about 0.3 ms for a 32-layer decode step and 0.7 ms for a mixed batch on
#: an H100 (forty-second session). Sized by `MIN_SAMPLE_S`, a 2 ms step sampled 3 calls and a 6 ms one 1,
#: so the "queued" figure was mostly the blocking one, and one route measured twice in one run read 1.46x
#: apart where calibration gave it 5 calls a sample in one place and 15 in the other. At 50 ms a 0.7 ms
#: boundary is under 1.5% of any sample.
PIPELINED_MIN_SAMPLE_S = 50e-3


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    iters: int = 10,
    sync: Callable[[], None] = mlx_sync,
    min_sample_s: float = MIN_SAMPLE_S,
    max_inner: int = MAX_INNER,
) -> Timing:
    """Median per-call time of ``fn`` (``mx.eval`` inside for MLX, so the call's work is done).

    ``warmup`` calls first (at least one: MLX compiles each kernel on its first
    call); the last of them is two calibration loops (`_calibrate`), each growing until
    it lasts a fifth of ``min_sample_s`` over at least `MIN_CALIBRATION_CALLS` calls.
    Then ``iters`` samples; each is ``sync(); t0;
    inner calls; sync(); t1`` divided by ``inner``, with ``inner`` chosen so a
    sample lasts at least ``min_sample_s``: on GPUs a lone call is dominated by
    launch and synchronization latency (measured on the H200: one blocking MLX
    SDPA call per sample reads 0.32 ms, twenty per sample 0.13 ms each).

    ``inner`` comes from the faster of the two loops' per-call times: one slow call (a
    kernel variant or a plan built on first use) ends a loop early, and sized from it
    the samples would hold two or three calls, so a pipelined sample would time the
    wait more than the queue. On the H200 (prefill-gpu --pipelined, the 1,024-row chunk
    after 7K), ``auto``, measured first, sampled 2-3 calls and read 288-378 TFLOP/s; the
    same route measured right after it sampled 4-7 and read 368-454. A loop of one call
    sizes the samples from the call's latency rather than its rate, so a loop holds at
    least four calls unless one call alone fills a sample.
    """
    _check_timing_args(warmup, iters, max_inner)
    inner = warm_up(fn, sync, warmup, min_sample_s, max_inner)
    return timing_of([one_sample(fn, sync, inner) for _ in range(iters)], inner)


def time_calls(compute: Callable[[], Any], *, pipelined: bool, warmup: int = 3, iters: int = 10) -> Timing:
    """Per-call timing of the MLX work ``compute()`` returns, measured as the suites measure it: every
    call waited for (``mx.eval``, samples of at least `MIN_SAMPLE_S`), or with ``pipelined`` every call
    queued (``mx.async_eval``) and each sample waited for once, samples of at least
    `PIPELINED_MIN_SAMPLE_S` so the wait at a sample's end is a small part of it. The probes and
    sweeps that time queued calls go through here, so their figures compare with ``--pipelined``
    suite runs."""
    if type(pipelined) is not bool:
        raise ValueError(f"pipelined={pipelined!r} (allowed: True or False)")
    if pipelined:
        return time_fn(lambda: mx.async_eval(compute()), warmup=warmup, iters=iters,
                       min_sample_s=PIPELINED_MIN_SAMPLE_S)
    return time_fn(lambda: mx.eval(compute()), warmup=warmup, iters=iters)


def _check_timing_args(warmup: int, iters: int, max_inner: int) -> None:
    int_at_least("iters", iters)
    int_at_least("max_inner", max_inner)
    if type(warmup) is not int or warmup < 0:
        raise ValueError(f"warmup={warmup!r} (allowed: an int >= 0)")


def warm_up(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, min_sample_s: float = MIN_SAMPLE_S,
            max_inner: int = MAX_INNER) -> int:
    """`time_fn`'s warm-up and calibration of ``fn``: the calls per sample (``inner``)."""
    for _ in range(max(warmup - 1, 0)):
        fn()
    per_call = min(_calibrate(fn, sync, min_sample_s, max_inner) for _ in range(2))
    return max(1, min(max_inner, math.ceil(min_sample_s / per_call) if per_call > 0 else max_inner))


def one_sample(fn: Callable[[], Any], sync: Callable[[], None], inner: int) -> float:
    """Seconds per call of one sample: ``sync(); t0; inner calls; sync(); t1``, divided by ``inner``."""
    sync()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - t0) / inner


def timing_of(samples: Sequence[float], inner: int) -> Timing:
    """The `Timing` of per-call ``samples`` of ``inner`` calls each."""
    return Timing(
        median_s=statistics.median(samples), min_s=min(samples), mean_s=statistics.fmean(samples),
        stdev_s=statistics.stdev(samples) if len(samples) > 1 else 0.0, samples_s=tuple(samples), inner=inner,
    )


#: Fewest calls a calibration loop times unless one call alone lasts a whole sample: a lone call
#: and its wait time a queued call's latency, not its rate.
MIN_CALIBRATION_CALLS = 4


def _calibrate(fn: Callable[[], Any], sync: Callable[[], None], min_sample_s: float, max_inner: int) -> float:
    """Seconds per call of ``fn`` over a loop of 1, 4, 16 ... calls grown until it lasts a fifth of
    ``min_sample_s`` with at least `MIN_CALIBRATION_CALLS` calls (or one call lasts ``min_sample_s``,
    or the loop reaches ``max_inner`` calls)."""
    n = 1
    while True:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        long_enough = elapsed >= min_sample_s / 5 and (n >= MIN_CALIBRATION_CALLS or elapsed >= min_sample_s)
        if long_enough or n >= max_inner:
            return elapsed / n
        n = min(n * 4, max_inner)
