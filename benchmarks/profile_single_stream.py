"""One request's decode steps on a GPU, the engine against stock ``mlx_lm.generate_step`` (not a test).

    python3 benchmarks/profile_single_stream.py OUT.json [--prompt-len 512] [--tokens 64] [--layers 32]

Both run the generate suite's model (the 8B-shaped random llama on CUDA) on one prompt in one
process, alternating: stock ``generate_step`` (mlx-lm's KV cache, MLX SDPA), then the engine at its
defaults (compiled decode steps on CUDA). After a warm-up, ``--tokens`` steady decode tokens of each
are traced with torch.profiler (CUPTI, `kernel_trace`). Per token it reports:

- wall time (host clock over the traced tokens, profiler on);
- GPU busy time (the union of kernel intervals) and the GPU idle rest;
- kernel launches, and kernel time by kind (the kinds of `step_breakdown`; sums of kernel
  durations, which exceed the busy time where kernels overlap: MLX runs some concurrently);
- the kernels whose time or count differs most between the two.

So a gap between the two says whether it is GPU work (more or slower kernels) or host time (the
GPU idle while the host builds the next step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import mlx.core as mx
from kernel_trace import record
from step_breakdown import kind_of


def _trace(step: Callable[[], object], tokens: int) -> tuple[list[dict], float]:
    """Kernel events and wall seconds of ``tokens`` calls of ``step`` (each yields one token)."""
    wall = 0.0

    def run() -> None:
        nonlocal wall
        t0 = time.perf_counter()
        for _ in range(tokens):
            step()
        mx.synchronize()
        wall = time.perf_counter() - t0

    return record(run, cpu=False), wall


def _summary(events: list[dict], wall: float, tokens: int) -> dict:
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_kind[kind_of(e["name"])] += float(e["dur"])
        by_name[e["name"][:100]].append(float(e["dur"]))
    wall_us = wall * 1e6 / tokens
    busy_us = busy / tokens
    return {
        "wall_us_per_token": wall_us, "tokens_per_s_profiled": tokens / wall,
        "gpu_busy_us_per_token": busy_us, "gpu_idle_us_per_token": max(0.0, wall_us - busy_us),
        "gpu_idle_share": max(0.0, wall_us - busy_us) / wall_us,
        "launches_per_token": len(events) / tokens,
        "kind_us_per_token": {k: v / tokens for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels": {n: {"launches_per_token": len(d) / tokens, "us_per_token": sum(d) / tokens,
                        "median_us": statistics.median(d)} for n, d in by_name.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()

    from mlx_lm.generate import generate_step

    from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
    from metal_attn.device import current_device
    from metal_attn.engine import Engine, EngineConfig

    model, label = load_bench_model(current_device().backend, args.layers)
    (prompt,) = _prompts(1, args.prompt_len, 1000, 7)
    total = args.warmup + args.tokens + 4
    results: dict[str, dict] = {}

    stock = generate_step(mx.array(prompt), model, max_tokens=total)
    for _ in range(args.warmup):
        next(stock)
    events, wall = _trace(lambda: next(stock), args.tokens)
    stock.close()
    results["generate_step"] = _summary(events, wall, args.tokens)
    print(f"generate_step: {results['generate_step']['wall_us_per_token']:.0f} us/token", flush=True)

    eng = Engine(model, _NoStopTokenizer(), EngineConfig(num_blocks=(args.prompt_len + total) // 16 + 8,
                                                         max_num_seqs=1, max_num_batched_tokens=4096))
    eng.add_request(prompt, max_tokens=total)
    produced = 0
    while produced < args.warmup:
        produced += sum(len(o.new_token_ids) for o in eng.step())
    events, wall = _trace(eng.step, args.tokens)
    results["engine"] = _summary(events, wall, args.tokens)
    compiled = eng.runner.compiled
    results["engine"]["compiled"] = None if compiled is None else {
        "steps": compiled.steps, "traces": compiled.traces, "disabled": compiled.disabled}
    print(f"engine: {results['engine']['wall_us_per_token']:.0f} us/token", flush=True)

    out = {"model": label, "prompt_len": args.prompt_len, "tokens": args.tokens, "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    a, b = results["generate_step"], results["engine"]
    print(f"{label}, prompt {args.prompt_len}, {args.tokens} traced tokens each (profiler on)")
    print("| per token | generate_step | engine |")
    print("|---|---|---|")
    for key in ("wall_us_per_token", "gpu_busy_us_per_token", "gpu_idle_us_per_token", "launches_per_token"):
        print(f"| {key} | {a[key]:.1f} | {b[key]:.1f} |")
    for kind in sorted(set(a["kind_us_per_token"]) | set(b["kind_us_per_token"])):
        print(f"| {kind} us | {a['kind_us_per_token'].get(kind, 0):.1f} | {b['kind_us_per_token'].get(kind, 0):.1f} |")
    print("kernels (us per token: generate_step / engine; launches):")
    names = set(a["kernels"]) | set(b["kernels"])
    zero = {"us_per_token": 0.0, "launches_per_token": 0.0}
    rows = sorted(names, key=lambda n: -abs(a["kernels"].get(n, zero)["us_per_token"]
                                             - b["kernels"].get(n, zero)["us_per_token"]))
    for n in rows[:20]:
        ka, kb = a["kernels"].get(n, zero), b["kernels"].get(n, zero)
        print(f"  {ka['us_per_token']:8.1f} / {kb['us_per_token']:8.1f} us  "
              f"({ka['launches_per_token']:.0f} / {kb['launches_per_token']:.0f})  {n}")


if __name__ == "__main__":
    main()
