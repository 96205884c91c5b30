"""Where a queued prefill call's occasional multi-millisecond stalls come from: samples of queued
``auto`` calls on one prefill batch, each with its host time (graph building, queueing), Python's full
collections and MLX's allocator figures, under MLX's default buffer
cache, one sample of each in turn with MLX SDPA on contiguous K/V (the peer), and with
``mx.set_cache_limit`` raised (does the allocator free and re-allocate?).

Usage (GPU): ``python benchmarks/probe_prefill_stalls.py OUT.json [--batch 4 --q-len 2048]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx

import metal_attn
from metal_attn.bench.shapes import Shape, build_case


def samples(fn, n: int, calls: int) -> list[dict]:
    """``n`` samples of ``calls`` queued calls and one wait: ms a call, and of it the host's graph building
    (``build_ms``) and ``mx.async_eval`` (``queue_ms``); Python's full collections during the sample; MLX's
    allocator figures after it. A stall with ``build_ms`` or ``queue_ms`` up is the host's; with both flat,
    the GPU's (or the wait's)."""
    out = []
    for _ in range(n):
        build = queue = 0.0
        collections = gc.get_stats()[2]["collections"]
        t0 = time.perf_counter()
        for _ in range(calls):
            a = time.perf_counter()
            result = fn()
            b = time.perf_counter()
            mx.async_eval(result)
            queue += time.perf_counter() - b
            build += b - a
        mx.synchronize()
        out.append({"ms_per_call": (time.perf_counter() - t0) * 1e3 / calls, "build_ms": build * 1e3 / calls,
                    "queue_ms": queue * 1e3 / calls, "full_gc": gc.get_stats()[2]["collections"] - collections,
                    "active_mb": mx.get_active_memory() / 2**20, "cache_mb": mx.get_cache_memory() / 2**20,
                    "peak_mb": mx.get_peak_memory() / 2**20})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    case = build_case(Shape(args.batch, 32, 8, 128, args.q_len, q_len=args.q_len))
    kv = case.contiguous_kv()

    def ours():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale)

    def peer():
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=case.scale, mask="causal")
                for q, (k, v) in zip(case.group_queries(), kv)]

    for fn in (ours, peer):
        mx.eval(fn())
    result = {"device": mx.device_info().get("device_name"), "shape": case.shape.label,
              "cache_limit_default": None, "runs": {}}
    for label, fn in (("ours", ours), ("peer", peer), ("ours again", ours)):
        result["runs"][label] = samples(fn, args.samples, args.calls)
    # One sample of each in turn, as `metal-attn bench --interleave` takes them: does the switch bring the stalls?
    alt = {"ours, alternating with peer": [], "peer, alternating with ours": []}
    for _ in range(args.samples):
        alt["ours, alternating with peer"] += samples(ours, 1, args.calls)
        alt["peer, alternating with ours"] += samples(peer, 1, args.calls)
    result["runs"].update(alt)
    old = mx.set_cache_limit(64 * 2**30)
    result["cache_limit_default"] = old
    for label, fn in (("ours, cache limit 64 GiB", ours), ("peer, cache limit 64 GiB", peer)):
        result["runs"][label] = samples(fn, args.samples, args.calls)
    for label, rows in result["runs"].items():
        ms = sorted(r["ms_per_call"] for r in rows)
        slow = sum(1 for r in rows if r["ms_per_call"] > 3 * ms[len(ms) // 2])
        print(f"{label:28s} median {ms[len(ms) // 2]:7.3f} ms  max {ms[-1]:7.3f}  slow samples {slow}/{len(ms)}  "
              f"cache MB {min(r['cache_mb'] for r in rows):.0f}-{max(r['cache_mb'] for r in rows):.0f}  "
              f"active MB {min(r['active_mb'] for r in rows):.0f}-{max(r['active_mb'] for r in rows):.0f}", flush=True)
        print("    ms a call", [round(r["ms_per_call"], 2) for r in rows], flush=True)
        print("    build ms  ", [round(r["build_ms"], 2) for r in rows], flush=True)
        print("    queue ms  ", [round(r["queue_ms"], 2) for r in rows], flush=True)
        if any(r["full_gc"] for r in rows):
            print("    full GC in samples", [i for i, r in enumerate(rows) if r["full_gc"]], flush=True)
    print("default cache limit (bytes):", old)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
