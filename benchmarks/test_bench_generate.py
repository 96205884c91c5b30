"""Generation throughput under pytest-benchmark: the engine against mlx-lm's ``BatchGenerator``
and ``generate_step``, same model, same prompts, one run (`metal_attn.bench.generate`).

    python -m pytest benchmarks/test_bench_generate.py --benchmark-only --benchmark-json gen.json

One group per concurrency (``generate c=N``); each benchmark is one whole workload (N prompts of
random ids, every one generating the same number of tokens, no stop token), timed once after a
warm-up run. ``extra_info`` holds generation and end-to-end tokens/s, TTFT, peak memory, and the
engine/peer ratios, so a saved run is compared by ratio, not only by time. The model: SmolLM2 on
the CPU (prompts of 32 tokens, 16 generated: the CPU's quantized matmul runs ~10 tokens/s), the
8B-shaped random llama on GPUs (512 / 64).
"""

from __future__ import annotations

import pytest

from metal_attn.bench import generate as gen
from metal_attn.device import detect_backend

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed")

BACKEND = detect_backend()
CONCURRENCY = (1, 8) if BACKEND == "cpu" else (1, 8, 32, 64)
PROMPT, TOKENS = (32, 16) if BACKEND == "cpu" else (512, 64)
CANDIDATES = ("engine", "engine_eager", "engine_compiled", "batch_generator", "generate_step")


@pytest.fixture(scope="module")
def model():
    m, _label = gen.load_bench_model(BACKEND)
    # Warm-up: every candidate once on full-length prompts, so no kernel compiles while timed.
    gen.bench_generate(m, concurrencies=(2,), prompt_len=PROMPT, gen_tokens=2, candidates=CANDIDATES[:2])
    return m


_results: dict[tuple[int, str], gen.GenerateResult] = {}


@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_generate(benchmark, model, concurrency, candidate):
    if candidate == "generate_step" and concurrency != 1:
        pytest.skip("generate_step is single stream: concurrency 1 only")
    benchmark.group = f"generate c={concurrency}"
    out: list[gen.GenerateResult] = []

    def once():
        out[:] = gen.bench_generate(model, concurrencies=(concurrency,), prompt_len=PROMPT, gen_tokens=TOKENS,
                                    candidates=(candidate,), warm=False)

    benchmark.pedantic(once, rounds=1, iterations=1)
    (r,) = out
    assert r.generated == concurrency * TOKENS
    _results[(concurrency, candidate)] = r
    info = {"generation_tps": r.generation_tps, "e2e_tps": r.e2e_tps, "mean_ttft_s": r.mean_ttft_s,
            "peak_memory_bytes": r.peak_memory_bytes}
    eng = _results.get((concurrency, "engine"))
    if candidate != "engine" and eng is not None:
        info[f"engine_vs_{candidate}_generation_ratio"] = eng.generation_tps / r.generation_tps
        info[f"engine_vs_{candidate}_e2e_ratio"] = eng.e2e_tps / r.e2e_tps
    benchmark.extra_info.update(info)
