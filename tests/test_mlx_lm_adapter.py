"""The mlx-lm adapter: unmodified mlx-lm models on the paged cache, token-identical to stock mlx-lm.

Every served architecture is built tiny with random weights (no download) and
compared, greedy, with the same instance on mlx-lm's own cache (`generate_step`),
in float32 on the CPU: single stream, several prompts prefilled in one packed step,
and a prompt joining while others decode. Near-ties follow `metal_attn.testing.greedy`.
"""

from __future__ import annotations

import random
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metal_attn import diagnostics
from metal_attn.cache import PagedKVCache
from metal_attn.engine import Engine, EngineConfig
from metal_attn.errors import InvalidInputError, ModelError
from metal_attn.mlx_lm import PagedModel, hook, resolve, supported_model_types
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import TINY_CONFIGS, WordTokenizer, tiny_model

ARCHS = sorted(TINY_CONFIGS)
#: float32 on the CPU: a top-2 margin below this is a near-tie (see metal_attn.testing.greedy).
TOL = 1e-4
MAX_TOKENS = 24
#: Lengths chosen to cross pages, the tiny models' 24-token windows, and chunk boundaries.
PROMPT_LENS = (5, 41, 70)


def _prompts(seed: int = 1, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    """(name, model, prompts, stock mlx-lm greedy references)."""
    name = request.param
    model = tiny_model(name)
    prompts = _prompts()
    refs = [reference_greedy(model, p, MAX_TOKENS, WordTokenizer.eos_token_ids) for p in prompts]
    return name, model, prompts, refs


def _engine(model, **cfg) -> Engine:
    return Engine(model, WordTokenizer(), EngineConfig(**({"num_blocks": 64, "block_size": 16} | cfg)))


def test_every_tiny_models_tokens_vary(arch):
    """A model that greedily repeats one token passes every identity test whatever the attention does
    (the random gemma2 echoed its last prompt token: `metal_attn.testing.models._ECHOES`)."""
    name, _, prompts, refs = arch
    for p, ref in zip(prompts, refs):
        if len(ref.tokens) == MAX_TOKENS:  # not ended by the end token
            assert len(set(ref.tokens)) >= MAX_TOKENS // 3, f"{name} len={len(p)}: {ref.tokens}"


def test_single_stream_matches_stock_mlx_lm(arch):
    name, model, prompts, refs = arch
    for p, ref in zip(prompts, refs):
        (c,) = _engine(model).generate([p], max_tokens=MAX_TOKENS)
        assert_same_greedy(c.token_ids, ref, TOL, f"{name} single len={len(p)}")


def test_packed_prefill_then_joint_decode_matches(arch):
    """All prompts in one packed step ([T, 1] batch), then decoded together, on PagedModel directly."""
    name, model, prompts, refs = arch
    pm = PagedModel(model, num_blocks=64, block_size=16)
    for i in range(len(prompts)):
        pm.kv.add_sequence(i)
    with diagnostics.collect() as records:
        plan = pm.kv.prepare_step([(i, len(p)) for i, p in enumerate(prompts)])
        logits = pm.forward(plan, mx.array(np.concatenate(prompts).astype(np.int32)))
    assert logits.shape == (len(prompts), pm.vocab_size)  # the head ran on the sampled rows only
    first = next(r.request for r in records if r.op == "paged_attention")
    assert (first.phase.value, first.num_seqs, first.total_q_tokens) == ("prefill", 3, sum(map(len, prompts)))
    outs = [[t] for t in mx.argmax(logits, axis=-1).tolist()]
    for _ in range(MAX_TOKENS - 1):
        plan = pm.kv.prepare_step([(i, 1) for i in range(len(prompts))])
        logits = pm.forward(plan, mx.array([o[-1] for o in outs], dtype=mx.int32))
        for o, t in zip(outs, mx.argmax(logits, axis=-1).tolist()):
            o.append(t)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert_same_greedy(o[: len(ref.tokens)], ref, TOL, f"{name} packed seq {i}")


def test_prompt_joining_while_others_decode_matches(arch):
    """Two prompts decode; a third joins, so a step mixes decode rows with a prefill chunk."""
    name, model, prompts, refs = arch
    eng = _engine(model, max_num_batched_tokens=32)
    ids = [eng.add_request(p, max_tokens=MAX_TOKENS) for p in prompts[:2]]
    with diagnostics.collect() as records:
        for _ in range(4):
            eng.step()
        ids.append(eng.add_request(prompts[2], max_tokens=MAX_TOKENS))
        while eng.has_unfinished():
            eng.step()
    phases = {r.request.phase.value for r in records if r.op == "paged_attention"}
    assert "mixed" in phases, phases
    for i, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(i).token_ids, ref, TOL, f"{name} join req {i}")


def test_features_reach_paged_attention(arch):
    """Sliding-window layers, soft caps and sinks arrive as paged_attention's arguments."""
    name, model, prompts, _ = arch
    with diagnostics.collect() as records:
        _engine(model).generate(prompts[:1], max_tokens=2)
    reqs = [r.request for r in records if r.op == "paged_attention"]
    windows = {r.sliding_window for r in reqs}
    want_windows = {"gemma3_text": {24, None}, "gpt_oss": {24, None}}.get(name, {None})
    assert windows == want_windows
    assert {r.softcap for r in reqs} == ({8.0} if name == "gemma2" else {None})
    assert {r.sinks for r in reqs} == {name == "gpt_oss"}


def test_windows_matter_for_the_identity_check(monkeypatch):
    """Negative control: dropping gemma3's window breaks token identity past the window."""
    model = tiny_model("gemma3_text")
    prompt = _prompts(lens=(70,))[0]
    ref = reference_greedy(model, prompt, MAX_TOKENS, WordTokenizer.eos_token_ids)
    import metal_attn.mlx_lm.layer_cache as lc

    init = lc.PagedLayerCache.__init__
    def without_window(self, kv, layer, sliding_window=None):
        init(self, kv, layer)

    monkeypatch.setattr(lc.PagedLayerCache, "__init__", without_window)
    (c,) = _engine(model).generate([prompt], max_tokens=MAX_TOKENS)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_greedy(c.token_ids, ref, TOL, "gemma3 without window")


def test_float16_pool_follows_the_model_dtype():
    model = tiny_model("llama", dtype=mx.float16)
    pm = PagedModel(model, num_blocks=8)
    assert pm.kv.dtype == mx.float16 and pm.geometry.head_size == 64 and pm.geometry.num_kv_heads == 2


# -- the hook ------------------------------------------------------------------------------------


def test_import_metal_attn_installs_no_hook():
    code = (
        "import metal_attn, metal_attn.mlx_lm, mlx_lm.models.llama as l, mlx_lm.models.base as b;"
        "assert l.scaled_dot_product_attention is b.scaled_dot_product_attention"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"METAL_ATTN_PLUGIN_AUTOLOAD": "0",
                                                                   "PATH": "/usr/bin:/bin"})


def test_install_is_idempotent_and_uninstall_restores(monkeypatch):
    import mlx_lm.models.base as base
    import mlx_lm.models.gemma2 as gemma2
    import mlx_lm.models.llama as llama

    was = hook.is_installed()
    hook.uninstall()
    try:
        original_call = gemma2.Attention.__call__
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
        hook.install()
        first = llama.scaled_dot_product_attention
        hook.install()
        assert llama.scaled_dot_product_attention is first is not base.scaled_dot_product_attention
        assert gemma2.Attention.__call__ is not original_call
        hook.uninstall()
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
        assert gemma2.Attention.__call__ is original_call
        with hook.installed(["mlx_lm.models.llama"]):
            assert hook.is_installed(["mlx_lm.models.llama"])
            assert not hook.is_installed(["mlx_lm.models.qwen2"])
        assert not hook.is_installed(["mlx_lm.models.llama"])
    finally:
        if was:
            hook.install()


def test_calls_whose_cache_is_not_paged_are_unchanged():
    """With the hook installed, mlx-lm's own cache path gives bit-identical logits."""
    from mlx_lm.models.cache import make_prompt_cache

    for name in ("llama", "gemma2", "gpt_oss"):
        model = tiny_model(name)
        x = mx.array([_prompts(lens=(30,))[0]])
        with hook.installed():
            pass
        hook.uninstall()
        plain = model(x, cache=make_prompt_cache(model))
        with hook.installed():
            hooked = model(x, cache=make_prompt_cache(model))
        assert np.array_equal(np.array(plain), np.array(hooked)), name


def test_forward_without_the_hook_is_refused():
    model = tiny_model("llama")
    pm = PagedModel(model, num_blocks=8)
    pm.kv.add_sequence("a")
    plan = pm.kv.prepare_step([("a", 3)])
    hook.uninstall(["mlx_lm.models.llama"])
    try:
        with pytest.raises(ModelError, match="hook is not installed"):
            pm.forward(plan, mx.array([1, 2, 3], dtype=mx.int32))
    finally:
        hook.install(["mlx_lm.models.llama"])


@pytest.mark.parametrize(("modules", "message"), [
    ("mlx_lm.models.llama", r"modules='mlx_lm.models.llama' \(allowed: a list of module names"),  # read per letter
    (["llama"], r"modules holds 'llama', which no served architecture runs"),  # ModuleNotFoundError
    (["mlx_lm.models.mamba"], r"modules holds 'mlx_lm.models.mamba'"),  # "installed" with nothing hooked
])
def test_hook_modules_outside_the_served_ones_are_refused(modules, message):
    for call in (hook.install, hook.uninstall, hook.is_installed):
        with pytest.raises(InvalidInputError, match=message):
            call(modules)


# -- refusals ------------------------------------------------------------------------------------


def test_unsupported_architecture_is_refused_with_the_list():
    from mlx_lm.models import starcoder2

    args = starcoder2.ModelArgs(model_type="starcoder2", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    with pytest.raises(ModelError) as e:
        PagedModel(starcoder2.Model(args), num_blocks=4)
    msg = str(e.value)
    assert "model_type='starcoder2'" in msg and "supported model types:" in msg
    for t in supported_model_types():
        assert t in msg


def test_non_mlx_lm_module_is_refused():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = []

    with pytest.raises(ModelError, match="not supported on the paged path"):
        resolve(Custom())
    with pytest.raises(ModelError, match="allowed: an mlx-lm model"):
        resolve(object())


def test_rotating_cache_with_kept_tokens_is_refused():
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_model("llama")
    model.make_cache = lambda: [RotatingKVCache(max_size=64, keep=4) for _ in model.layers]
    with pytest.raises(ModelError, match="layer 0 uses a RotatingKVCache \\(keep=4\\)"):
        resolve(model)


def test_a_sliding_layer_without_a_window_is_refused_by_name():
    """``layer_types`` naming a sliding layer with ``sliding_window`` unset: a bare TypeError before (stock
    mlx-lm cannot run it either)."""
    from mlx_lm.models import llama

    cfg = dict(TINY_CONFIGS["llama"]) | {"layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ModelError, match="layer 0 is a sliding layer whose window is None"):
        resolve(llama.Model(llama.ModelArgs.from_dict(cfg)))


def test_int_only_rope_is_refused():
    from mlx_lm.models import llama

    cfg = dict(TINY_CONFIGS["llama"]) | {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(ModelError, match="DynamicNTKScalingRoPE"):
        resolve(llama.Model(llama.ModelArgs.from_dict(cfg)))


def test_attention_that_bypasses_the_hook_is_refused(monkeypatch):
    """A layer that writes its cache but computes attention elsewhere would be served wrongly."""
    from mlx_lm.models import llama

    def bypass(self, x, mask=None, cache=None):
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    monkeypatch.setattr(llama.Attention, "__call__", bypass)
    with pytest.raises(ModelError, match="reached the attention hook 0 time"):
        PagedModel(tiny_model("llama"), num_blocks=4)


def test_a_wrong_kv_cache_or_plan_is_named():
    """A dict as kv_cache and None as plan raised AttributeError; num_blocks with a kv_cache was ignored."""
    from metal_attn.mlx_lm.runner import inspect_model

    model = tiny_model("llama")
    with pytest.raises(InvalidInputError, match=r"kv_cache=\{\} \(a dict\) \(allowed: a PagedKVCache, or None"):
        PagedModel(model, kv_cache={})
    shape = inspect_model(model)
    g = shape.geometry
    cache = PagedKVCache(shape.resolved.num_layers, 4, 16, g.num_kv_heads, g.head_size, g.dtype)
    with pytest.raises(InvalidInputError, match=r"num_blocks=999 given with a kv_cache of 4 blocks of 16 tokens "
                                                r"\(allowed: num_blocks left out, or 4"):
        PagedModel(model, num_blocks=999, kv_cache=cache)
    with pytest.raises(InvalidInputError, match=r"block_size=32 given with a kv_cache of 4 blocks of 16 tokens "
                                                r"\(allowed: block_size left out, or 16"):
        PagedModel(model, block_size=32, kv_cache=cache)
    assert PagedModel(model, kv_cache=cache).kv is cache
    pm = PagedModel(model, num_blocks=4, block_size=16, kv_cache=cache)  # what the cache has: no conflict
    assert pm.kv is cache
    pm.kv.add_sequence("a")
    plan = pm.kv.prepare_step([("a", 3)])
    for bad, shown in ((None, r"None \(a NoneType\)"), ({}, r"\{\} \(a dict\)"), ([3], r"\[3\] \(a list\)")):
        with pytest.raises(InvalidInputError, match=rf"plan={shown} \(allowed: a StepPlan"):
            pm.forward(bad, [1, 2, 3])
    assert pm.forward(plan, [1, 2, 3]).shape == (1, pm.vocab_size)


def test_load_refuses_keywords_it_would_drop(tmp_path, monkeypatch):
    """load('smollm2', ...) and load('x.gguf', ...) dropped every keyword without a word."""
    from metal_attn.mlx_lm import default_model, gguf, load

    monkeypatch.setattr(default_model, "load_default", lambda *a, **k: pytest.fail("the default model was loaded"))
    monkeypatch.setattr(gguf, "load_gguf", lambda *a, **k: pytest.fail("the .gguf was read"))
    with pytest.raises(ModelError, match=r"load\(model='smollm2' \(the default model\)\) got keyword\(s\) "
                                         r"no_such_option, tokenizer_config, which it does not use \(allowed: only "
                                         r"cache_dir, fetch, pip_args; mlx_lm.utils.load's keywords apply to model"):
        load("smollm2", tokenizer_config={"eos_token": "<|im_end|>"}, no_such_option=123)
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match=r"\(a \.gguf file\)\) got keyword\(s\) lazy, model_config, which it does not "
                                         r"use \(allowed: no keywords"):
        load(path, lazy=True, model_config={})


def test_load_honours_the_default_model_s_own_keywords(tmp_path):
    """``cache_dir`` and ``fetch`` reach `load_default`: an empty cache with fetch=False is refused (the
    keywords were dropped, and the model in the usual cache loaded)."""
    from metal_attn.mlx_lm import load

    with pytest.raises(ModelError, match=r"is not in the cache \(.*\) and fetch=False"):
        load("smollm2", cache_dir=tmp_path, fetch=False)
    assert not list(tmp_path.rglob("*.gguf"))


def test_load_passes_a_folder_s_keywords_to_mlx_lm(tmp_path, monkeypatch):
    import mlx_lm.utils

    from metal_attn.mlx_lm import load, loading

    seen = {}
    monkeypatch.setattr(loading, "_check_folder", lambda path: None)
    monkeypatch.setattr(mlx_lm.utils, "load", lambda path, **kw: seen.update(kw) or ("model", "tokenizer"))
    assert load(tmp_path, tokenizer_config={"a": 1}, lazy=True) == ("model", "tokenizer")
    assert seen == {"tokenizer_config": {"a": 1}, "lazy": True}


def test_bad_arguments_are_named():
    model = tiny_model("llama")
    with pytest.raises(InvalidInputError, match="num_blocks is required"):
        PagedModel(model)
    wrong = PagedKVCache(2, 8, 16, 2, 32, mx.float32)
    with pytest.raises(InvalidInputError, match=r"kv_cache has .* but the model needs"):
        PagedModel(model, kv_cache=wrong)
    pm = PagedModel(model, num_blocks=8)
    pm.kv.add_sequence("a")
    plan = pm.kv.prepare_step([("a", 3)])
    with pytest.raises(InvalidInputError, match=r"tokens.shape=\(2,\) \(allowed: \[3\]"):
        pm.forward(plan, mx.array([1, 2], dtype=mx.int32))
    # A list raised AttributeError, float ids MLX's unnamed gather error; an id past the vocabulary gave finite
    # garbage (a far one crashed the process). Host ids are checked against the vocabulary.
    vocab = pm.vocab_size
    for bad, message in (([1.0, 2.0, 3.0], r"tokens: dtype float64 \(allowed: integer token ids\)"),
                         (mx.array([1.0, 2.0, 3.0]), r"tokens: dtype float32 \(allowed: integer token ids\)"),
                         ([1, 2, vocab], rf"tokens holds id {vocab} \(allowed: 0..{vocab - 1}, the model's vocab"),
                         (np.array([-1, 2, 3]), r"tokens holds id -1 \(allowed: 0\.\."),
                         ([[1, 2, 3]], r"tokens.shape=\(1, 3\) \(allowed: \[3\]")):
        with pytest.raises(InvalidInputError, match=message):
            pm.forward(plan, bad)
    same = pm.forward(plan, [1, 2, 3]), pm.forward(plan, np.array([1, 2, 3])), pm.forward(plan, mx.array([1, 2, 3]))
    assert all(mx.array_equal(same[0], x).item() for x in same[1:])
    # Rows past the step (a gather there read other memory: finite garbage, no error) or not integers.
    tokens = mx.array([1, 2, 3], dtype=mx.int32)
    for rows in ([3], [-1], [1.5], [], [[2]]):
        with pytest.raises(InvalidInputError, match=r"logit_rows=.* \(allowed: one or more row indices in 0..2"):
            pm.forward(plan, tokens, rows)
    with pytest.raises(InvalidInputError, match=r"logit_rows: an mx.array .* dtype float32 \(allowed: 1-D integer"):
        pm.forward(plan, tokens, mx.array([2.0]))
    assert pm.forward(plan, tokens, np.array([0, 2])).shape[0] == 2
