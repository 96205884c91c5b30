"""The benchmark framework behind ``metal-attn bench`` and ``benchmarks/`` (pytest-benchmark).

- `shapes`: `Shape` (decode, causal prefill, mixed batches) and `build_case`
  (paged inputs and contiguous copies for peers);
- `timing`: `time_fn` (medians of synchronized loops);
- `candidates`: what is timed (a provider forced by name, a settings variant) and
  its `CandidateResult` with the metrics;
- `core`: `run_suite` (every candidate on the same shapes, outputs checked against
  each other) and `machine_info`;
- `peers`: MLX SDPA, the naive paged path, torch SDPA, the bandwidth ceiling,
  and `resolve` (candidate names to candidates);
- `suites`: the named suites, as data;
- `cli`: the ``bench`` subcommand (rich tables, Markdown, JSON, PNG).
"""

from __future__ import annotations

from metal_attn.bench.candidates import CandidateResult
from metal_attn.bench.core import ShapeResult, SuiteResult, machine_info, run_suite
from metal_attn.bench.peers import resolve
from metal_attn.bench.shapes import Case, Rows, Shape, build_case
from metal_attn.bench.suites import SUITES, Suite, get_suite
from metal_attn.bench.timing import Timing, time_fn

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
