"""Any suite of `metal_attn.bench.suites` as pytest-benchmark groups, on request:

    pytest benchmarks/test_bench_suite.py --benchmark-only --bench-suite decode-cpu

Skipped unless a ``--bench-*`` option names what to measure (benchmarks/conftest.py).
"""

from __future__ import annotations


def test_paged_attention(run_bench, bench_shape, bench_candidate):
    run_bench(bench_shape, bench_candidate)
