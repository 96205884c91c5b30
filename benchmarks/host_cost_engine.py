"""Where a decode step's host time goes in the engine, next to stock mlx-lm's ``generate_step``.

Runs the engine to steady decode at each concurrency and reads the phases every step records
(`InFlight.timings`): scheduling, the step plan (tables, slots, metadata), the model's graph
(the Python of every layer, our ``reshape_and_cache`` and ``paged_attention`` included), the
sampling, ``mx.async_eval`` (MLX encoding and launching the kernels, bounded by how far MLX lets
the host run ahead) and the wait for the step's tokens; and the same for stock ``generate_step``.
Prints medians in ms. ``--trace N`` then records N more steady steps of each engine run under
torch.profiler (CUPTI) and prints, per step, the GPU's busy time (the union of its kernels), the
step's wall time, and the host's CUDA runtime and driver calls by name (count and host µs): where
MLX's encoding spends its time, and whether the host waits on the GPU.

    python benchmarks/host_cost_engine.py --concurrency 1,64 [--layers 32] [--compile-decode] [--trace 8]
(on the GPU machine: ``source .device/setup.sh && python3 benchmarks/host_cost_engine.py``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
from metal_attn.device import current_device
from metal_attn.engine import Engine, EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_trace, next to this script


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f}"


def engine_steps(model, c: int, prompt_len: int, steps: int, compile_decode: bool = False,
                 trace_steps: int = 0) -> dict[str, list[float]]:
    """Steady decode at ``c`` rows: the phases each step's `InFlight.timings` recorded, and the whole step;
    with ``trace_steps``, also `trace_engine` of that many more steps (under the key ``"trace"``)."""
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
    out: dict[str, list[float]] = {}
    for phases in eng.stats.step_timings:
        for k, v in phases.items():
            out.setdefault(k, []).append(v)
    out["step (wall)"] = total
    if trace_steps:
        out["trace"] = trace_engine(eng, trace_steps)
    eng.synchronize()
    return out


def trace_engine(eng: Engine, steps: int) -> dict:
    """``steps`` pipelined engine steps under torch.profiler: per step, the GPU's busy time, the wall
    time, the host's CUDA runtime/driver calls by name (calls and µs per step, largest first), and the
    GPU's kernels by name (launches and µs per step, most launched first)."""
    from kernel_trace import busy_us, trace_events

    wall = 0.0

    def run() -> None:
        nonlocal wall
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t

    events = trace_events(run)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    calls = _per_step([e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e], steps)
    per_kernel = sorted(_per_step(kernels, steps, name_chars=120), key=lambda x: -x[1])
    return {"wall_us_per_step": wall / steps * 1e6, "busy_us_per_step": busy_us(kernels) / steps if kernels else 0.0,
            "kernels_per_step": len(kernels) / steps,
            "api_us_per_step": sum(c[2] for c in calls),
            "api": [{"name": n, "calls_per_step": k, "us_per_step": u} for n, k, u in calls[:15]],
            "kernels": [{"name": n, "per_step": k, "us_per_step": u} for n, k, u in per_kernel[:40]]}


def _per_step(events: list[dict], steps: int, name_chars: int | None = None) -> list[tuple[str, float, float]]:
    """``(name, events a step, µs a step)`` per event name (its first ``name_chars`` characters),
    most µs first."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"][:name_chars], []).append(float(e.get("dur", 0.0)))
    return sorted(((n, len(d) / steps, sum(d) / steps) for n, d in by_name.items()), key=lambda x: -x[2])


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
    ap.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, in turn")
    ap.add_argument("--compiled-only", action="store_true", help="with --compile-decode: leave the eager runs out")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="also trace N steady steps of each engine run (torch.profiler: GPU busy, CUDA API calls)")
    ap.add_argument("--skip-stock", action="store_true", help="leave stock generate_step out")
    ap.add_argument("--json", default=None, help="write every run's medians (and traces) here")
    args = ap.parse_args()
    model, label = load_bench_model(current_device().backend, args.layers)
    print(f"{label} on {current_device().backend}; prompt {args.prompt_len}; medians of {args.steps} steps, ms")
    results: dict[str, dict] = {}
    if not args.skip_stock:
        s = stock_steps(model, args.prompt_len, args.steps)
        results["stock generate_step"] = {k: statistics.median(v) * 1e3 for k, v in s.items()}
        print("stock generate_step: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in s.items()))
    modes = ((True,) if args.compiled_only else (False, True)) if args.compile_decode else (False,)
    configs = [(int(x), compiled) for x in args.concurrency.split(",") for compiled in modes]

    def name(c: int, compiled: bool) -> str:
        return f"engine, {'compiled decode' if compiled else 'eager'}, c={c}"

    # Every timing first: once CUPTI is attached, each CUDA call costs the host more.
    for r in range(args.rounds):
        for c, compiled in configs:
            t = engine_steps(model, c, args.prompt_len, args.steps, compiled)
            label = name(c, compiled) + (f", round {r}" if args.rounds > 1 else "")
            results[label] = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            print(f"{label}: " + ", ".join(f"{k} {_median_ms(v)}" for k, v in t.items()), flush=True)
    for c, compiled in configs if args.trace else ():
        label = name(c, compiled)
        tr = engine_steps(model, c, args.prompt_len, 4, compiled, args.trace)["trace"]
        results.setdefault(label, {})["trace"] = tr
        print(f"{label}, traced: wall {tr['wall_us_per_step']:.0f} us/step, GPU busy {tr['busy_us_per_step']:.0f}, "
              f"{tr['kernels_per_step']:.0f} kernels, CUDA API {tr['api_us_per_step']:.0f} us of host time")
        for a in tr["api"][:10]:
            print(f"    {a['name'][:40]:40s} {a['calls_per_step']:7.1f} calls {a['us_per_step']:9.1f} us")
        print("  kernels a step, by count:")
        for k in tr["kernels"][:25]:
            print(f"    {k['name'][:90]:90s} {k['per_step']:6.1f} x {k['us_per_step']:8.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
