"""The benchmark framework behind ``metal-attn bench`` and ``benchmarks/`` (pytest-benchmark).

- `core`: `Shape` (decode, causal prefill, mixed batches), `build_case`
  (paged inputs and contiguous copies for peers), `time_fn` (medians,
  synchronized loops), metrics, `run_suite`, `machine_info`;
- `peers`: MLX SDPA, the naive paged path, torch SDPA, the bandwidth ceiling,
  and `resolve` (candidate names to candidates);
- `suites`: the named suites, as data;
- `cli`: the ``bench`` subcommand (rich tables, Markdown, JSON, PNG).
"""

from __future__ import annotations

from metal_attn.bench.core import (
    CandidateResult,
    Case,
    Rows,
    Shape,
    ShapeResult,
    SuiteResult,
    Timing,
    build_case,
    machine_info,
    run_suite,
    time_fn,
)
from metal_attn.bench.peers import resolve
from metal_attn.bench.suites import SUITES, Suite, get_suite

__all__ = [
    "SUITES",
    "CandidateResult",
    "Case",
    "Rows",
    "Shape",
    "ShapeResult",
    "Suite",
    "SuiteResult",
    "Timing",
    "build_case",
    "get_suite",
    "machine_info",
    "resolve",
    "run_suite",
    "time_fn",
]
