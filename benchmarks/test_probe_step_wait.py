"""`benchmarks/probe_step_wait.py` without a GPU: its three clocks on the CPU backend, on a step whose build
is made slow on purpose, so each clock's share of the build shows."""

from __future__ import annotations

import time

import mlx.core as mx
import probe_step_wait as pw
import pytest

BUILD_S = 0.02


def slow_build():
    """A step whose graph takes BUILD_S of host time to build."""
    time.sleep(BUILD_S)
    return [mx.arange(8) * 2]


def test_the_blocking_clock_counts_the_build_and_the_prebuilt_clock_does_not():
    blocking = pw.timed(lambda: mx.eval(slow_build()), 5)
    prebuilt = pw.timed_prebuilt(slow_build, mx.eval, 5)
    assert blocking >= BUILD_S * 1e6
    assert prebuilt < BUILD_S * 1e6 / 2


def test_the_queued_clock_divides_by_every_step_it_ran():
    calls = []

    def build():
        calls.append(1)
        return slow_build()

    per_step = pw.timed_queued(build, 4)
    assert len(calls) == 5  # the first, queued before the clock, and one more a step
    assert BUILD_S * 1e6 * 4 / 5 <= per_step < BUILD_S * 1e6 * 3


def test_the_waits_refuse_where_the_stream_spin_cannot_run():
    # On the CPU (no CUDA module, the CPU MLX's default device) the stream spin would be mx.eval under another
    # name, so the probe stops rather than report it.
    with pytest.raises(RuntimeError, match="spin_until_idle"):
        pw.waits(lambda *a: None)
