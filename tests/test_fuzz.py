"""Seeded random requests through the public API against the float64 oracle (`metal_attn.testing.fuzz`).

500 requests per run (``MA_TEST_FUZZ_CASES`` for more, ``MA_TEST_FUZZ_SEED`` for another
stretch of seeds): random geometry, page size and dtype; decode rows, verification and prefill
chunks mixed in one batch; lengths at page and partition edges; shared prefix blocks; sinks,
windows, softcap, scale; NaN/Inf planted in a quarter of them; NaN in every unread slot. Each
runs through `paged_attention` with the automatic choice, every fifth also forced on
``reference`` (the fallback every backend has). A failure names its seed: ``random_spec(seed)``
rebuilds the case. The GPU version is tests/gpu/test_fuzz_gpu.py.
"""

from __future__ import annotations

import collections
import os

import pytest

import metal_attn
from metal_attn import native
from metal_attn.testing import check_case, make_case, request_kwargs
from metal_attn.testing.fuzz import random_specs

COUNT = int(os.environ.get("MA_TEST_FUZZ_CASES", "500"))
FIRST = int(os.environ.get("MA_TEST_FUZZ_SEED", "0"))
SPECS = random_specs(COUNT, "cpu", FIRST)


@pytest.mark.parametrize("spec", SPECS, ids=[s["label"] for s in SPECS])
def test_fuzz_auto(spec):
    chosen = metal_attn.explain(**_request(spec)).chosen
    record = check_case(make_case(**spec))
    assert (record.provider, record.route) == (chosen.name, chosen.plan.route)


@pytest.mark.parametrize("spec", SPECS[::5], ids=[s["label"] for s in SPECS[::5]])
def test_fuzz_reference(spec):
    check_case(make_case(**spec), provider="reference")


def _request(spec):
    return request_kwargs(spec)


def test_fuzz_covers_what_it_promises():
    """The draw is not degenerate: every phase, dtype, feature and route the CPU has, poisoned cases,
    page sizes served by smaller kernel blocks, and head sizes only the reference provider takes."""
    if COUNT < 500:
        pytest.skip(f"MA_TEST_FUZZ_CASES={COUNT}: the coverage bounds are for 500 cases or more")
    routes = collections.Counter()
    phases = collections.Counter()
    for s in SPECS:
        exp = metal_attn.explain(**_request(s))
        routes[(exp.chosen.name, exp.chosen.plan.route)] += 1
        phases[exp.request.phase.value] += 1
    assert set(phases) == {"decode", "prefill", "mixed", "verify"} and min(phases.values()) >= 20, phases
    if metal_attn.current_device().backend == "cpu" and native.load() is not None:
        assert {("classic", "per_token_ps0"), ("classic", "per_token_ps512"), ("reference", "reference")} <= set(routes)
    assert {s["dtype"] for s in SPECS} == {"float32", "float16", "bfloat16"}
    for key in ("sinks", "sliding_window", "softcap", "shared_prefix_blocks", "poison", "scale"):
        assert sum(1 for s in SPECS if s.get(key)) >= 25, key
    assert {64, 128} <= {s["block_size"] for s in SPECS}
    assert sum(1 for s in SPECS if max(s["seq_lens"]) > 512) >= 50


def test_an_unknown_fuzz_profile_is_named():
    """`random_specs(3, profile="cuda")` raised a bare KeyError: 'cuda'."""
    with pytest.raises(ValueError, match=r"^profile='cuda' \(allowed: 'cpu', 'gpu'\)$"):
        random_specs(3, "cuda")
