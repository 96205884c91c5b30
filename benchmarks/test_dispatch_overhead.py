"""Dispatch overhead: `metal_attn.paged_attention` versus the chosen provider called directly.

Both sides only *build* the lazy MLX graph and never evaluate it. The overhead
of dispatch is host-side Python (argument checks, the selection-cache lookup,
building `AttentionInputs`, recording diagnostics), and evaluating the graph
would bury those microseconds under kernel time and its noise. The provider's
own graph construction is on both sides, so the difference is the cost the
registry adds per call. Target (issue): at most 20 µs per call, median, on this CPU.

Run with ``pytest benchmarks/test_dispatch_overhead.py --benchmark-only``:

- ``test_dispatch_via_registry`` and ``test_dispatch_provider_direct`` (group
  ``dispatch``) are the two pytest-benchmark measurements; the difference of
  their medians is printed at the end of the module and stored in ``extra_info``.
  They run one after the other, so on a loaded machine that difference is
  noisy; ``test_dispatch_via_registry_noop_provider`` times the registry path
  with the provider's ``run`` replaced by a no-op, i.e. the overhead alone;
- ``test_dispatch_overhead_within_budget`` is the assertion: it times the two
  sides interleaved, round after round (so that load changes hit both alike),
  on the wall clock and on the thread's CPU clock, and requires the median
  added CPU time to stay under the budget (the wall-clock figure is reported
  too; on a loaded 2-core machine it inflates with everything else).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn.plugins import get_registry
from metal_attn.provider import AttentionInputs
from metal_attn.settings import get_settings

#: Added host time per call the registry may cost (median), in microseconds.
BUDGET_US = 20.0

#: Tiny decode batch: 4 sequences, 8 query / 2 KV heads, head size 64, float32, 16-token pages.
SEQ_LENS = (37, 64, 100, 129)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16

_medians: dict[str, float] = {}


def _build_batch() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    need = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(need)
    table = np.zeros((len(SEQ_LENS), max(need)), np.int32)
    ids = iter(rng.permutation(num_blocks))
    for i, n in enumerate(need):
        table[i, :n] = [next(ids) for _ in range(n)]
    pool = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    k = mx.array(rng.standard_normal(pool, np.float32))
    v = mx.array(rng.standard_normal(pool, np.float32))
    q = mx.array(rng.standard_normal((len(SEQ_LENS), NUM_HEADS, HEAD_SIZE), np.float32))
    md = ma.AttentionMetadata.build(
        mx.array(table), mx.array(np.array(SEQ_LENS, np.int32)), mx.array(np.arange(len(SEQ_LENS) + 1, dtype=np.int32))
    )
    mx.eval(q, k, v)
    return {"q": q, "k": k, "v": v, "md": md}


@pytest.fixture(scope="module")
def batch() -> Iterator[dict[str, Any]]:
    previous = mx.set_cache_limit(1 << 30)
    yield _build_batch()
    mx.set_cache_limit(previous)


@pytest.fixture
def sides(batch) -> tuple[Callable[[], Any], Callable[[], Any], dict[str, Any]]:
    """(via registry, direct provider call, facts about the chosen provider), warmed up."""
    q, k, v, md = batch["q"], batch["k"], batch["v"], batch["md"]

    def via_registry() -> mx.array:
        return ma.paged_attention(q, k, v, metadata=md)

    out = via_registry()
    rec = ma.diagnostics.last_dispatch()
    sel = get_registry().select(rec.request, ma.current_device(), get_settings())
    assert sel.provider.name == rec.provider
    # The page size is a kernel block size, so the registry passes the metadata and pools unchanged.
    assert BLOCK_SIZE in ma.api.KERNEL_BLOCK_SIZES
    inputs = AttentionInputs(q, k, v, md, HEAD_SIZE**-0.5)
    provider, plan = sel.provider, sel.plan

    def direct() -> mx.array:
        return provider.run(inputs, plan)

    ref = direct()
    np.testing.assert_array_equal(np.array(out), np.array(ref))  # same computation on both sides
    for _ in range(200):  # warm both paths (selection cache, MLX graph code, allocator)
        via_registry()
        direct()
    info = {"provider": rec.provider, "route": rec.route, "backend": rec.backend}
    return via_registry, direct, info


def _record(benchmark, name: str, info: dict[str, Any]) -> None:
    benchmark.extra_info.update(info)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        _medians[name] = stats.stats.median * 1e6
        benchmark.extra_info["median_us"] = round(_medians[name], 2)


@pytest.fixture(scope="module", autouse=True)
def _report_difference(request):
    """At the end of the module, print the difference of the two benchmark medians."""
    yield
    if {"registry", "direct"} <= _medians.keys():
        added = _medians["registry"] - _medians["direct"]
        line = (
            f"dispatch overhead (difference of pytest-benchmark medians, separate runs): registry "
            f"{_medians['registry']:.2f} µs, direct {_medians['direct']:.2f} µs, added {added:.2f} µs per call "
            f"(budget {BUDGET_US:g} µs)"
        )
        if "noop" in _medians:
            line += f"; registry with a no-op provider: {_medians['noop']:.2f} µs per call"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(line)
        else:  # pragma: no cover - terminal reporter disabled
            print(line)


@pytest.mark.benchmark(group="dispatch", disable_gc=True, min_rounds=2000)
def test_dispatch_via_registry(benchmark, sides):
    via_registry, _, info = sides
    benchmark(via_registry)
    _record(benchmark, "registry", info)


@pytest.mark.benchmark(group="dispatch", disable_gc=True, min_rounds=2000)
def test_dispatch_provider_direct(benchmark, sides):
    _, direct, info = sides
    benchmark(direct)
    _record(benchmark, "direct", info)
    if "registry" in _medians and "direct" in _medians:
        benchmark.extra_info["added_us_vs_registry"] = round(_medians["registry"] - _medians["direct"], 2)


@pytest.fixture
def noop_sides(sides, batch, monkeypatch) -> tuple[Callable[[], Any], Callable[[], Any], dict[str, Any]]:
    """`sides` with the chosen provider's `run` replaced by a no-op (both sides look `run` up at call time)."""
    via_registry, direct, info = sides
    monkeypatch.setattr(get_registry().get(info["provider"]), "run", lambda inputs, plan: inputs.q)
    assert via_registry() is batch["q"] and direct() is batch["q"]  # both sides run the no-op
    return via_registry, direct, info


@pytest.mark.benchmark(group="dispatch", disable_gc=True, min_rounds=2000)
def test_dispatch_via_registry_noop_provider(benchmark, noop_sides):
    """The registry path with the chosen provider's `run` replaced by a no-op: dispatch cost alone.

    Its median is the overhead itself, free of the provider's own graph-building
    noise, so it is the figure to compare between saved runs.
    """
    via_registry, _, info = noop_sides
    benchmark(via_registry)
    _record(benchmark, "noop", info)


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Medians over rounds, in µs per call: added = via registry - direct, on two clocks."""

    added_cpu: float
    added_wall: float
    via_wall: float
    direct_wall: float


def measure_added_us(
    via: Callable[[], Any], direct: Callable[[], Any], *, rounds: int = 41, calls: int = 200
) -> Overhead:
    """Time ``calls`` calls of each side per round, alternating sides (and their order) every round.

    Two clocks are read at every boundary: `time.perf_counter` (wall) and
    `time.thread_time` (CPU time of this thread). Building a lazy MLX graph runs
    entirely on the calling thread, so the CPU clock measures the same work
    while ignoring time this process spends descheduled when other processes
    compete for the cores; the wall clock is reported next to it.
    """
    added_cpu, added_wall, t_via, t_direct = [], [], [], []
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = (via, direct) if r % 2 == 0 else (direct, via)
            wall, cpu = {}, {}
            for f in order:
                w0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(calls):
                    f()
                c1, w1 = time.thread_time(), time.perf_counter()
                wall[f], cpu[f] = (w1 - w0) / calls * 1e6, (c1 - c0) / calls * 1e6
            t_via.append(wall[via])
            t_direct.append(wall[direct])
            added_wall.append(wall[via] - wall[direct])
            added_cpu.append(cpu[via] - cpu[direct])
    finally:
        if gc_was_on:
            gc.enable()
    med = statistics.median
    return Overhead(med(added_cpu), med(added_wall), med(t_via), med(t_direct))


@pytest.mark.benchmark(group="dispatch-budget")
def test_dispatch_overhead_within_budget(benchmark, noop_sides):
    """The registry adds less than `BUDGET_US` of host CPU time per call (median of interleaved rounds).

    Both sides call the chosen provider's `run` replaced by a no-op, so the difference is the registry's
    own work. With the provider's real `run` on both sides, its graph building (about 200 µs a call
    for the example decode provider CI installs, 3 µs for classic) put its own swings into the
    difference: with that provider installed the difference read 13-21 µs for the same code (20.25 µs,
    past the budget, in one CI run)."""
    via_registry, direct, info = noop_sides
    o = benchmark.pedantic(measure_added_us, args=(via_registry, direct), rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    benchmark.extra_info.update(
        added_cpu_us=round(o.added_cpu, 2),
        added_wall_us=round(o.added_wall, 2),
        via_wall_us=round(o.via_wall, 2),
        direct_wall_us=round(o.direct_wall, 2),
    )
    print(
        f"\n{info['provider']} ({info['route']}): wall via registry {o.via_wall:.2f} µs, "
        f"direct {o.direct_wall:.2f} µs; added per call: {o.added_cpu:.2f} µs CPU, "
        f"{o.added_wall:.2f} µs wall (budget {BUDGET_US:g} µs)"
    )
    assert o.added_cpu < BUDGET_US, (
        f"paged_attention adds {o.added_cpu:.2f} µs of CPU time per call over {info['provider']}.run "
        f"(wall: {o.added_wall:.2f} µs; {o.via_wall:.2f} vs {o.direct_wall:.2f} µs, median of interleaved rounds); "
        f"budget {BUDGET_US:g} µs"
    )
