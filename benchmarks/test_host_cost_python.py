"""pytest-benchmark group ``host-cost-python``: the Python host cost of the CUDA launch path, on any machine.

    pytest benchmarks/test_host_cost_python.py --benchmark-only

The cases and the method are `host_cost_python`'s (fake ``cuda_kernel`` objects, the H200 preset):
one benchmark per case for the steady-state ``paged_attention`` call (layers 2..32 of a step) and
one for the cache write. Only graph building is timed; nothing is evaluated. Compare saved runs
with ``--benchmark-compare-fail=median:10%``.
"""

from __future__ import annotations

import pytest
from host_cost_python import Case, bind, cases

from metal_attn.testing.fake_cuda import fake_cuda

CASES = {c.label: c for c in cases()}


@pytest.fixture(params=list(CASES), ids=[label.split(" (")[0].replace(" ", "-") for label in CASES])
def bound(request):
    case: Case = CASES[request.param]
    with fake_cuda(case.device()) as fake:
        b = bind(case, fake)
        fake.record = False
        yield b


@pytest.mark.benchmark(group="host-cost-python", disable_gc=True, min_rounds=2000)
def test_paged_attention_host_cost(benchmark, bound):
    benchmark.extra_info["route"] = bound.route
    benchmark.extra_info["launches"] = bound.launches
    benchmark(bound.attn)


@pytest.mark.benchmark(group="host-cost-python", disable_gc=True, min_rounds=2000)
def test_cache_write_host_cost(benchmark, bound):
    benchmark(bound.write)
