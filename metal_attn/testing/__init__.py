"""Testing tools for metal-attn and for third-party provider authors.

- `attention_oracle`: an independent float64 numpy implementation of paged attention;
- `make_case` / `AttentionCase`: random cases with scattered pages and garbage elsewhere;
- `CONFORMANCE_SPECS` (with `NONFINITE_SPECS`, the NaN contract's cases), `run_case`, `check_case`,
  `assert_close_to_oracle`, `TOLERANCES`: the conformance suite every provider runs (see
  `metal_attn.testing.conformance`); `check_cache_writer` for providers that write the cache.
"""

from __future__ import annotations

from metal_attn.testing.cases import AttentionCase, make_case
from metal_attn.testing.conformance import (
    BOUNDS_SPECS,
    CONFORMANCE_SPECS,
    NONFINITE_SPECS,
    TOLERANCES,
    Tolerance,
    admission_reasons,
    assert_close_to_oracle,
    check_bounds_case,
    check_cache_writer,
    check_case,
    conformance_ids,
    rel_l2,
    request_kwargs,
    run_case,
    spec_by_label,
)
from metal_attn.testing.oracle import attention_oracle
from metal_attn.testing.overrides import forced_mixed_threshold

__all__ = [
    "BOUNDS_SPECS",
    "CONFORMANCE_SPECS",
    "NONFINITE_SPECS",
    "TOLERANCES",
    "AttentionCase",
    "Tolerance",
    "admission_reasons",
    "assert_close_to_oracle",
    "attention_oracle",
    "check_bounds_case",
    "check_cache_writer",
    "check_case",
    "conformance_ids",
    "forced_mixed_threshold",
    "make_case",
    "rel_l2",
    "request_kwargs",
    "run_case",
    "spec_by_label",
]
