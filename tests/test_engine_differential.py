"""The engine against stock mlx-lm on random small workloads (hypothesis): every request's greedy tokens
equal its single-stream `generate_step` tokens, whatever the pool, page size, budget, running cap,
prefix caching, compiled decode steps and arrival order, and every run ends within a bound.

The workloads are built to reach the engine's edges: identical prompts (whole prompts from the prefix
cache), prompts that are prefixes or extensions of another, pools from exactly what the largest request
needs (preemption) to three times that, budgets of 8 tokens (chunked prefill) and caps of one. Such a
run found that a request needing the page compiled decode steps reserve was accepted and then never
admitted (`test_engine.py::test_the_pages_the_engine_reserves_are_not_counted_as_room`).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metal_attn.engine import Engine, EngineConfig
from metal_attn.errors import InvalidInputError
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

TOL = 1e-4  # float32 on the CPU: a token may differ only at a near-tie of stock mlx-lm's logits


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def stock(llama):
    """Stock mlx-lm's greedy continuation of a prompt, computed once per (prompt, max_tokens)."""
    cache: dict[tuple, object] = {}

    def ref(prompt: list[int], n: int):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = reference_greedy(llama, prompt, n, WordTokenizer.eos_token_ids)
        return cache[key]

    return ref


_token = st.integers(1, 255)


@st.composite
def workloads(draw):
    base = draw(st.lists(_token, min_size=1, max_size=60))
    prompts = []
    for kind in draw(st.lists(st.sampled_from(["same", "prefix", "longer", "fresh"]), min_size=1, max_size=6)):
        if kind == "same":
            prompts.append(list(base))
        elif kind == "prefix":
            prompts.append(base[: draw(st.integers(1, len(base)))])
        elif kind == "longer":
            prompts.append(base + draw(st.lists(_token, min_size=1, max_size=30)))
        else:
            prompts.append(draw(st.lists(_token, min_size=1, max_size=50)))
    max_tokens = [draw(st.sampled_from([1, 2, 5, 9])) for _ in prompts]
    steps_before = [draw(st.integers(0, 2)) for _ in prompts]  # arrivals between steps
    return prompts, max_tokens, steps_before


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(work=workloads(), block_size=st.sampled_from([8, 16, 32]), spare=st.sampled_from([0, 0, 1, 2, 5, 8]),
       cap=st.integers(1, 5), budget=st.sampled_from([8, 16, 33, 512]), prefix_caching=st.booleans(),
       compile_decode=st.booleans())
# A tight pool with compiled decode steps: the reserved padding page leaves 24 tokens for a 29-token
# request (before the fix: accepted, then preempted again and again, never finished).
@example(work=([list(range(3, 23))], [9], [0]), block_size=8, spare=0, cap=1, budget=512, prefix_caching=True,
         compile_decode=True)
def test_random_workloads_match_stock_greedy(llama, stock, work, block_size, spare, cap, budget, prefix_caching,
                                             compile_decode):
    prompts, max_tokens, steps_before = work
    need = max(-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_tokens))
    eng = Engine(llama, WordTokenizer(), EngineConfig(
        num_blocks=need + spare, block_size=block_size, max_num_seqs=cap, max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching, compile_decode=compile_decode))
    steps, added = 0, []
    for prompt, n, before in zip(prompts, max_tokens, steps_before):
        for _ in range(before):
            eng.step()
            steps += 1
        if len(prompt) + n > eng.pool_tokens:  # only where the reserved padding page is the difference
            assert eng.blocks.reserved and spare == 0
            with pytest.raises(InvalidInputError, match="can never fit"):
                eng.add_request(prompt, max_tokens=n)
            continue
        added.append((eng.add_request(prompt, max_tokens=n), prompt, n))
    bound = steps + 3 * sum(len(p) + n for _, p, n in added) + 10
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps <= bound, f"not finished after {steps} steps (bound {bound})"
    for rid, prompt, n in added:
        assert_same_greedy(eng.completion(rid).token_ids, stock(prompt, n), TOL, f"request {rid}")
    assert eng.blocks.num_used == 0
    eng.blocks.check_invariants()
