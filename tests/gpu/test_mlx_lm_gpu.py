"""mlx-lm models on the paged path on a GPU backend, in bf16: every served architecture (tiny,
random weights) token-identical to the same instance on mlx-lm's own cache, through the engine
(packed prefill, chunked prefill, a prompt joining while others decode, preemption).

bf16 rounds each attention implementation differently in the last bits; a greedy choice whose
top-2 log-prob margin is below ``TOL`` is a near-tie (`metal_attn.testing.greedy`).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from metal_attn import diagnostics
from metal_attn.engine import Engine, EngineConfig
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import TINY_CONFIGS, WordTokenizer, tiny_model

pytestmark = pytest.mark.gpu

#: bf16 logits of magnitude ~10-60 are quantized in steps of 0.06-0.25, and a bf16 difference in attention can
#: flip a MoE router (gpt_oss); a top-2 log-prob margin below this is a near-tie.
TOL = 0.5
MAX_TOKENS = 24
EOS = WordTokenizer.eos_token_ids


def _prompts(seed: int, lens) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def arch(request):
    name = request.param
    model = tiny_model(name, dtype=mx.bfloat16)
    prompts = _prompts(1, (5, 41, 70, 130))
    refs = [reference_greedy(model, p, MAX_TOKENS, EOS) for p in prompts]
    return name, model, prompts, refs


@pytest.mark.parametrize("budget", [512, 32])
def test_engine_matches_stock_mlx_lm_in_bf16(arch, budget):
    name, model, prompts, refs = arch
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=128, max_num_batched_tokens=budget))
    with diagnostics.collect() as records:
        ids = [eng.add_request(p, max_tokens=MAX_TOKENS) for p in prompts[:3]]
        for _ in range(3):
            eng.step()
        ids.append(eng.add_request(prompts[3], max_tokens=MAX_TOKENS))
        while eng.has_unfinished():
            eng.step()
    assert {r.backend for r in records} <= {"cuda", "metal"}
    phases = {r.request.phase.value for r in records if r.op == "paged_attention"}
    assert "mixed" in phases and "decode" in phases
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"gpu {name} budget={budget} req {rid}")


def test_preemption_and_prefix_sharing_on_the_gpu():
    model = tiny_model("llama", dtype=mx.bfloat16)
    rng = random.Random(3)
    shared = [rng.randrange(1, 256) for _ in range(48)]
    prompts = [shared + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))] for _ in range(16)]
    refs = [reference_greedy(model, p, 16, EOS) for p in prompts]
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=20, max_num_batched_tokens=96))
    ids = []
    for i, p in enumerate(prompts):
        ids.append(eng.add_request(p, max_tokens=16))
        if i % 3 == 0:
            eng.step()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.preemptions > 0 and eng.blocks.prefix_hits > 0
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"gpu preempt req {rid}")
    eng.blocks.check_invariants()

