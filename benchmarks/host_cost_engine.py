"""Where a decode step's host time goes in the engine, next to stock mlx-lm's ``generate_step``.

Runs the engine to steady decode at each concurrency and reads the phases every step records
(`InFlight.timings`): scheduling, the step plan (tables, slots, metadata), the model's graph
(the Python of every layer, our ``reshape_and_cache`` and ``paged_attention`` included), the
sampling, ``mx.async_eval`` (MLX encoding and launching the kernels, bounded by how far MLX lets
the host run ahead) and the wait for the step's tokens; and the same for stock ``generate_step``.
Prints medians in ms.

    python benchmarks/host_cost_engine.py --concurrency 1,64 [--layers 32] [--compile-decode]
(on the GPU machine: ``source .device/setup.sh && python3 benchmarks/host_cost_engine.py``)
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
from metal_attn.device import current_device
from metal_attn.engine import Engine, EngineConfig


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f}"


def engine_steps(model, c: int, prompt_len: int, steps: int, compile_decode: bool = False) -> dict[str, list[float]]:
    """Steady decode at ``c`` rows: the phases each step's `InFlight.timings` recorded, and the whole step."""
    eng = Engine(model, _NoStopTokenizer(), EngineConfig(num_blocks=c * (prompt_len + steps + 64) // 16 + 64,
                                                         max_num_seqs=c, max_num_batched_tokens=8192,
                                                         compile_decode=compile_decode))
    for p in _prompts(c, prompt_len, 1000, c):
        eng.add_request(p, max_tokens=steps + 40)
    for _ in range(8):  # prefill and warm up
        eng.step()
    eng.stats.step_timings.clear()
    total = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        total.append(time.perf_counter() - t)
    eng.synchronize()
    out: dict[str, list[float]] = {}
    for phases in eng.stats.step_timings:
        for k, v in phases.items():
            out.setdefault(k, []).append(v)
    out["step (wall)"] = total
    return out


def stock_steps(model, prompt_len: int, steps: int) -> dict[str, list[float]]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array(_prompts(1, prompt_len, 1000, 0)[0])
    mx.eval(model(prompt[None], cache=cache))
    y = mx.array([[1]])
    t: dict[str, list[float]] = {"graph": [], "async_eval": [], "wait": [], "total": []}
    prev = None
    for _ in range(steps):
        a = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        nxt = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)[None]
        b = time.perf_counter()
        mx.async_eval(nxt)
        c = time.perf_counter()
        if prev is not None:
            prev.item()
        d = time.perf_counter()
        prev, y = nxt, nxt
        t["graph"].append(b - a)
        t["async_eval"].append(c - b)
        t["wait"].append(d - c)
        t["total"].append(d - a)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--compile-decode", action="store_true",
                    help="also run the engine with decode steps compiled (EngineConfig.compile_decode)")
    args = ap.parse_args()
    model, label = load_bench_model(current_device().backend, args.layers)
    print(f"{label} on {current_device().backend}; prompt {args.prompt_len}; medians of {args.steps} steps, ms")
    s = stock_steps(model, args.prompt_len, args.steps)
    print("stock generate_step: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in s.items()))
    for c in (int(x) for x in args.concurrency.split(",")):
        for compiled in (False, True) if args.compile_decode else (False,):
            t = engine_steps(model, c, args.prompt_len, args.steps, compiled)
            label = "engine, compiled decode" if compiled else "engine, eager"
            print(f"{label} c={c}: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
