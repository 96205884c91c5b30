"""The prefix cache and a model whose weights change: K/V computed with the old weights are never
served to a request admitted after the change (weights epochs, `BlockManager.new_epoch`); the
engine notices replaced weight arrays itself, and `Engine.reset_prefix_cache` covers the rest.
The oracle: stock mlx-lm's greedy tokens on the updated model."""

from __future__ import annotations

import gc
import random
import weakref

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from metal_attn.cache import BlockAllocator
from metal_attn.engine import Engine, EngineConfig
from metal_attn.engine.block_manager import BlockManager, block_hash, epoch_root
from metal_attn.engine.engine import same_weights, weight_refs
from metal_attn.testing.greedy import reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

EOS = WordTokenizer.eos_token_ids
MAX_TOKENS = 8


def _engine(model, **cfg) -> Engine:
    return Engine(model, WordTokenizer(), EngineConfig(**({"num_blocks": 64, "block_size": 16} | cfg)))


def _stock(model, prompt: list[int]) -> list[int]:
    return reference_greedy(model, prompt, MAX_TOKENS, EOS).tokens


@pytest.fixture()
def prompts():
    """Two prompts sharing a 48-token prefix (three full pages of 16)."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 256) for _ in range(48)]
    return shared, [*shared, 5, 6, 7], [*shared, 9, 10, 11]


@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager", "compiled"])
def test_a_prefix_cached_before_model_update_is_not_served_after_it(prompts, compile_decode):
    """The reviewer's case: a 48-token prefix cached, `model.update` with other weights, then a prompt
    sharing the prefix gave the old weights' tokens (its 48 cached positions were computed with them)."""
    shared, p1, p2 = prompts
    model = tiny_model("llama", seed=0)
    eng = _engine(model, compile_decode=compile_decode)
    eng.generate([p1], max_tokens=MAX_TOKENS)
    assert eng.blocks.num_cached == 3

    model.update(tiny_model("llama", seed=1).parameters())
    (c,) = eng.generate([p2], max_tokens=MAX_TOKENS)
    assert c.stats.cached_prompt_tokens == 0
    assert c.token_ids == _stock(model, p2)
    assert eng.blocks.epoch == 1
    eng.blocks.check_invariants()

    # The cache works again under the new weights: the prefix p2 computed is served, and right.
    p3 = [*shared, 21, 22]
    (c3,) = eng.generate([p3], max_tokens=MAX_TOKENS)
    assert c3.stats.cached_prompt_tokens == 48
    assert c3.token_ids == _stock(model, p3)
    assert eng.blocks.epoch == 1
    eng.blocks.check_invariants()


def test_compiled_traces_do_not_count_as_a_weight_update(prompts):
    """A compiled trace swaps the model's weights for tracers and back (MLX puts back new Python objects
    of the same arrays; `CompiledDecode` restores the objects themselves): the engine must not read
    that as new weights and drop its cache at every trace."""
    _, p1, p2 = prompts
    model = tiny_model("llama", seed=0)
    eng = _engine(model, compile_decode=True)
    before = weight_refs(model)
    eng.generate([p1], max_tokens=MAX_TOKENS)
    assert eng.runner.compiled.traces >= 1
    assert same_weights(model, before)
    (c,) = eng.generate([p2], max_tokens=MAX_TOKENS)
    assert c.stats.cached_prompt_tokens == 48 and eng.blocks.epoch == 0
    assert c.token_ids == _stock(model, p2)


def test_an_update_while_a_request_runs_keeps_its_blocks_out_of_the_new_epoch(prompts):
    """A request admitted before the update keeps registering its blocks under the old root: a request
    admitted after it shares nothing with it, and every later request gets the new weights' tokens."""
    _, p1, p2 = prompts
    model = tiny_model("llama", seed=0)
    eng = _engine(model)
    a = eng.add_request(p1, max_tokens=12)
    eng.step()
    eng.step()  # a prefilled (its prefix registered) and decoding
    model.update(tiny_model("llama", seed=1).parameters())
    b = eng.add_request(p2, max_tokens=MAX_TOKENS)
    while eng.has_unfinished():
        eng.step()
        eng.blocks.check_invariants()
    assert eng.completion(b).stats.cached_prompt_tokens == 0
    assert eng.completion(b).token_ids == _stock(model, p2)
    assert len(eng.completion(a).token_ids) == 12  # old weights' K/V and new weights' decode: not stock's
    # The prefix b computed with the new weights is the one served now.
    (c,) = eng.generate([p1], max_tokens=MAX_TOKENS)
    assert c.stats.cached_prompt_tokens == 48
    assert c.token_ids == _stock(model, p1)
    eng.blocks.check_invariants()
    usage = eng.kv_usage()
    assert usage["used"] == 0 and usage["free"] + usage["cached"] + usage["reserved"] == usage["blocks"]


def test_reset_prefix_cache_after_an_update_identity_cannot_see(prompts):
    """Assigning into the weight arrays (``w[...] = x``) keeps the arrays: the engine cannot see it, and
    `Engine.reset_prefix_cache` is the way to drop what was computed before."""
    _, p1, p2 = prompts
    model = tiny_model("llama", seed=0)
    other = dict(tree_flatten(tiny_model("llama", seed=1).parameters()))
    eng = _engine(model)
    eng.generate([p1], max_tokens=MAX_TOKENS)
    before = weight_refs(model)
    for name, w in tree_flatten(model.parameters()):
        w[...] = other[name]
    mx.eval(model.parameters())
    assert same_weights(model, before)  # nothing for the engine to notice

    assert eng.kv_usage()["cached"] == 3
    assert eng.reset_prefix_cache() == 3
    assert eng.kv_usage()["cached"] == 0 and eng.kv_usage()["free"] == 64
    eng.blocks.check_invariants()
    (c,) = eng.generate([p2], max_tokens=MAX_TOKENS)
    assert c.stats.cached_prompt_tokens == 0
    assert c.token_ids == _stock(model, p2)


def test_reset_prefix_cache_without_a_reset_serves_the_stale_prefix(prompts):
    """The control for the test above: the same assignment with no reset is served the cached prefix."""
    _, p1, p2 = prompts
    model = tiny_model("llama", seed=0)
    other = dict(tree_flatten(tiny_model("llama", seed=1).parameters()))
    eng = _engine(model)
    eng.generate([p1], max_tokens=MAX_TOKENS)
    for name, w in tree_flatten(model.parameters()):
        w[...] = other[name]
    (c,) = eng.generate([p2], max_tokens=MAX_TOKENS)
    assert c.stats.cached_prompt_tokens == 48


def test_the_engine_keeps_no_old_weights_alive():
    model = tiny_model("llama", seed=0)
    mx.eval(model.parameters())
    eng = _engine(model)
    eng.generate([list(range(1, 40))], max_tokens=4)
    old = weakref.ref(model.model.embed_tokens.weight)
    model.update(tiny_model("llama", seed=1).parameters())
    eng.generate([list(range(1, 40))], max_tokens=4)  # notices the update
    gc.collect()
    assert old() is None
    assert eng.blocks.epoch == 1


def test_the_weights_are_checked_only_when_cached_blocks_are_about_to_be_served(monkeypatch):
    """The walk over the model's tree runs when an admission would be served cached blocks: not on decode
    steps, not for a prompt with nothing cached, not for a head request that waits for pages (a pool
    that stays full would pay it every step), and never with prefix caching off."""
    import metal_attn.engine.engine as engine_module

    model = tiny_model("llama", seed=0)
    eng = _engine(model)
    calls = []
    real = engine_module.same_weights
    monkeypatch.setattr(engine_module, "same_weights", lambda *a: calls.append(1) or real(*a))
    prompt = list(range(1, 40))  # two full pages to cache
    eng.generate([prompt], max_tokens=10)
    assert calls == []  # nothing cached to serve
    eng.generate([prompt], max_tokens=10)
    assert len(calls) == 1  # served two cached pages: checked once
    # A pool too small for the second request while the first runs: it waits with a hit, unchecked.
    small = _engine(model, num_blocks=6)
    small.generate([prompt], max_tokens=2)  # caches the prompt's pages
    calls.clear()
    first = small.add_request(list(range(100, 160)), max_tokens=20)  # 5 pages: the pool's rest
    small.step()
    small.add_request(prompt, max_tokens=2)
    while not small.requests[first].finished:
        small.step()
    assert calls == [], "checked for a request that could not be admitted"
    while small.has_unfinished():
        small.step()
    off = _engine(model, enable_prefix_caching=False)
    calls.clear()
    off.generate([prompt, prompt], max_tokens=10)
    assert calls == []


def test_block_manager_new_epoch_drops_the_cache_and_balances():
    bm = BlockManager(BlockAllocator(16), block_size=4)
    ids = list(range(1, 14))  # 3 full blocks and a partial one
    other = list(range(50, 63))
    bm.admit("a", ids, 13)
    bm.register("a", ids, 13)
    bm.free("a")
    assert bm.admit("b", ids, 13) == 12  # holds the 3 cached blocks
    assert bm.admit("c", other, 13) == 0  # epoch 0, nothing registered yet
    assert bm.num_cached == 3

    assert bm.new_epoch() == 3
    bm.check_invariants()
    assert bm.num_cached == 0 and bm.num_evictable == 0
    assert bm.match_prefix(ids) == ([], [])
    # c registers under the root it was admitted with, where no new request looks.
    bm.register("c", other, 13)
    assert bm.num_cached == 3 and bm.match_prefix(other) == ([], [])
    bm.check_invariants()
    for r in ("b", "c"):
        bm.free(r)
        bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free == 16
    # The new epoch caches and serves as before.
    assert bm.admit("d", ids, 13) == 0
    bm.register("d", ids, 13)
    bm.free("d")
    assert bm.admit("e", ids, 13) == 12
    bm.check_invariants()


def test_epoch_roots_differ_and_epoch_0_keeps_the_plain_root():
    assert epoch_root(0) is None
    assert len({epoch_root(1), epoch_root(2), epoch_root(3)}) == 3
    assert block_hash(epoch_root(1), [1, 2]) != block_hash(None, [1, 2])
