"""Compiled decode steps on a GPU backend: classic on `AttentionMetadata.decode_bounds` batches
against the float64 oracle (both of its routes), and the engine with ``compile_decode`` on,
token-identical to stock mlx-lm in bf16 (near-ties as in test_mlx_lm_gpu.py).

On the H200 (2026-12-01, fourth session) with `test_mlx_lm_gpu.py`: 22 passed (docs/kernels.md).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from metal_attn.engine import Engine, EngineConfig
from metal_attn.testing import BOUNDS_SPECS, admission_reasons, check_bounds_case, make_case
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

pytestmark = pytest.mark.gpu

TOL = 0.5  # bf16 log-prob near-tie, as in test_mlx_lm_gpu.py


@pytest.mark.parametrize("spec", BOUNDS_SPECS, ids=[s["label"] for s in BOUNDS_SPECS])
def test_classic_runs_bounds_metadata(spec):
    assert not admission_reasons(spec, "classic")  # classic admits every bounds spec on a GPU: no skip
    assert check_bounds_case(make_case(**spec), "classic").provider == "classic"


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_engine_with_compiled_decode_matches_stock(name):
    model = tiny_model(name, dtype=mx.bfloat16)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (5, 41, 70, 130)]
    refs = [reference_greedy(model, p, 24, WordTokenizer.eos_token_ids) for p in prompts]
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=128, compile_decode=True))
    outs = eng.generate(prompts, max_tokens=24)
    for out, ref, p in zip(outs, refs, prompts):
        assert_same_greedy(out.token_ids, ref, TOL, f"{name} compiled decode, prompt of {len(p)}")
    compiled = eng.runner.compiled
    assert compiled.disabled is None and compiled.steps > 0
