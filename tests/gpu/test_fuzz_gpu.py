"""2,000 seeded random requests on the GPU providers against the float64 oracle (`metal_attn.testing.fuzz`,
profile ``gpu``): the kernels' head sizes and GQA-decode geometries (and a few head sizes only the
reference provider takes), page sizes 8 to 128, every dtype; decode rows, verification and prefill
chunks in one batch, lengths at page and partition edges, shared prefix blocks, sinks, windows,
softcap, scale, NaN/Inf planted in a quarter of them and NaN in every unread slot.

Each seed also draws how it runs: the automatic choice (half of them), or one of the GPU
providers that admits it, forced; classic's occupancy gate forced either way in a third of those.
``MA_TEST_FUZZ_GPU_CASES`` / ``MA_TEST_FUZZ_GPU_SEED`` choose other seeds;
``MA_TEST_FUZZ_SUMMARY=PATH`` writes the providers and routes that ran (the last test, in one process).

Under pytest-xdist run it with ``--dist loadgroup``: each seed is grouped by its head size, dtype
and page size, so one worker JIT-compiles a group's kernels once instead of every worker
compiling them all (that compile time dominated: 500 seeds took over 150 s on 11 workers).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os

import numpy as np
import pytest

from metal_attn.testing import admission_reasons, check_case, make_case
from metal_attn.testing.fuzz import random_specs
from metal_attn.testing.overrides import forced_per_token_route, opened_sdpa_prefill_rule, rule_opened_for

pytestmark = pytest.mark.gpu

COUNT = int(os.environ.get("MA_TEST_FUZZ_GPU_CASES", "2000"))
FIRST = int(os.environ.get("MA_TEST_FUZZ_GPU_SEED", "0"))
SPECS = random_specs(COUNT, "gpu", FIRST)
GPU_PROVIDERS = ("classic", "gqa_decode", "tiled_prefill", "sdpa_prefill")
RAN: collections.Counter = collections.Counter()


@contextlib.contextmanager
def _gate(route: str | None):
    """classic's occupancy gate forced to ``route`` (None: left alone)."""
    if route is None:
        yield
        return
    with forced_per_token_route(route):
        yield


def _param(spec: dict) -> object:
    group = f"{spec['dtype']}-h{spec['head_size']}-b{spec['block_size']}"
    return pytest.param(spec, id=spec["label"], marks=pytest.mark.xdist_group(group))


@pytest.mark.parametrize("spec", [_param(s) for s in SPECS])
def test_fuzz_gpu(spec):
    rng = np.random.default_rng([spec["seed"], 0x6B0])
    provider = None
    if rng.random() >= 0.5:
        # sdpa_prefill's rule opened: its measured rule leaves the fuzz's small batches to the tiles
        with opened_sdpa_prefill_rule():
            admitted = [p for p in GPU_PROVIDERS if not admission_reasons(spec, p)]
        provider = str(rng.choice(admitted)) if admitted else None
    gate = str(rng.choice(["per_token_ps0", "per_token_ps512"])) if provider == "classic" and rng.random() < 0.33 \
        else None
    with _gate(gate), rule_opened_for(provider):
        record = check_case(make_case(**spec), provider=provider)
    if provider is not None:
        assert record.provider == provider
    RAN[(record.provider, record.route)] += 1


def test_zz_fuzz_summary():
    """What ran (written to MA_TEST_FUZZ_SUMMARY when set); every GPU provider took some."""
    if sum(RAN.values()) < COUNT:
        pytest.skip(f"only {sum(RAN.values())} of {COUNT} fuzz cases ran in this session")
    summary = {f"{p}/{r}": n for (p, r), n in sorted(RAN.items())}
    print(json.dumps(summary, indent=1))
    path = os.environ.get("MA_TEST_FUZZ_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump({"cases": COUNT, "first_seed": FIRST, "ran": summary}, f, indent=1)
    assert {p for p, _ in RAN} >= set(GPU_PROVIDERS)
