"""Where a decode step's host time goes in the engine, next to stock mlx-lm's ``generate_step``.

Runs the engine to steady decode at each concurrency, then times, per step: scheduling,
building the step plan (tables, slots, metadata), building the model's graph (the Python of
32 layers, our ``reshape_and_cache`` and ``paged_attention`` included), building the sampling,
``mx.async_eval`` (MLX encoding and launching the kernels) and the wait for the previous
step's tokens. Also one layer's paged calls in isolation. Prints medians in ms.

    python benchmarks/host_cost_engine.py --concurrency 1,64 [--layers 32]
(on the GPU machine: ``source .device/setup.sh && python3 benchmarks/host_cost_engine.py``)
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
from metal_attn.cache import build_step_plan
from metal_attn.device import current_device
from metal_attn.engine import Engine, EngineConfig
from metal_attn.engine.sampling import sample


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f}"


def engine_steps(model, c: int, prompt_len: int, steps: int) -> dict[str, list[float]]:
    eng = Engine(model, _NoStopTokenizer(), EngineConfig(num_blocks=c * (prompt_len + steps + 64) // 16 + 64,
                                                         max_num_seqs=c, max_num_batched_tokens=8192))
    for p in _prompts(c, prompt_len, 1000, c):
        eng.add_request(p, max_tokens=steps + 40)
    for _ in range(8):  # prefill and warm up
        eng.step()
    t: dict[str, list[float]] = {k: [] for k in ("schedule", "plan", "graph", "sample", "async_eval", "wait",
                                                  "complete", "total")}
    runner = eng.runner
    for _ in range(steps):
        a = time.perf_counter()
        out = eng.scheduler.schedule()
        b = time.perf_counter()
        rows = out.rows
        plan = build_step_plan([r.request.id for r in rows], [r.start for r in rows], [r.num_tokens for r in rows],
                               [eng.blocks.table(r.request.id) for r in rows], eng.blocks.block_size)
        prev = eng._inflight[-1] if eng._inflight else None
        tokens = runner._input_tokens(rows, prev)
        ends = np.cumsum([r.num_tokens for r in rows]) - 1
        c_ = time.perf_counter()
        logits = runner.model.forward(plan, tokens, [int(e) for e in ends])
        d = time.perf_counter()
        sampled, errors = sample(logits, [r.request for r in rows], [None] * len(rows))
        e = time.perf_counter()
        mx.async_eval(sampled)
        f = time.perf_counter()
        from metal_attn.engine.runner import InFlight

        flight = InFlight(out, plan, rows, sampled, {r.request.id: j for j, r in enumerate(rows)}, errors, a, f - a)
        for row in rows:
            row.request.num_computed = row.start + row.num_tokens
            row.request.pending += 1
        eng._inflight.append(flight)
        g = time.perf_counter()
        done = eng._inflight.popleft()
        done.tokens()
        h = time.perf_counter()
        eng._inflight.appendleft(done)
        eng._complete(eng._inflight.popleft())
        i = time.perf_counter()
        for k, v in (("schedule", b - a), ("plan", c_ - b), ("graph", d - c_), ("sample", e - d),
                     ("async_eval", f - e), ("wait", h - g), ("complete", i - h), ("total", i - a)):
            t[k].append(v)
    eng.synchronize()
    return t


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
    args = ap.parse_args()
    model, label = load_bench_model(current_device().backend, args.layers)
    print(f"{label} on {current_device().backend}; prompt {args.prompt_len}; medians of {args.steps} steps, ms")
    s = stock_steps(model, args.prompt_len, args.steps)
    print("stock generate_step: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in s.items()))
    for c in (int(x) for x in args.concurrency.split(",")):
        t = engine_steps(model, c, args.prompt_len, args.steps)
        print(f"engine c={c}: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in t.items()))


if __name__ == "__main__":
    main()
