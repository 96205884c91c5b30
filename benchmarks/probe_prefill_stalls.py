"""Where a queued prefill call's occasional multi-millisecond stalls come from: samples of queued
``auto`` calls on one prefill batch, each with its host time (graph building, queueing), Python's full
collections and MLX's allocator figures, under MLX's default buffer
cache, one sample of each in turn with MLX SDPA on contiguous K/V (the peer), and with
``mx.set_cache_limit`` raised (does the allocator free and re-allocate?).

Usage (GPU): ``python benchmarks/probe_prefill_stalls.py OUT.json [--batch 4 --q-len 2048 | --shape PATTERN]``.
``--shape`` takes one shape of the ``prefill-gpu`` suite by its label instead (e.g. ``"mixed 32x1"``, the
host-bound mixed batch of issue #18).

``--trace`` instead takes the bench's own sampling (``--calls 13``: the pipelined bench's calibrated
count at b4 q2048) for ``auto``, ``sdpa_prefill`` forced (as the bench's named candidate calls it) and
the peer, untraced and then under torch.profiler (CUPTI, host CUDA API calls included), and for each
traced sample prints its wall time, the GPU's busy time in it, its longest GPU idle gap and the host's
CUDA API calls during that gap: whether a stall is the GPU working, the GPU waiting on a host call
(which one), or the host late. Also per sample: its slowest GPU activities, its host API time by call,
and with ``--stacks`` the Python callers of host calls over 1 ms; ``--cold`` first traces ``auto``
from the process's first call. (Thirty-second session: the stalls were MLX copying a recycled device
buffer into unified memory for a chain, ``Memcpy DtoD (Device -> Managed)``; docs/cuda-ops.md.)
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx
from probe_args import prefill_suite_shape

import metal_attn
from metal_attn.bench.peers import sdpa_per_group
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


def union_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted union of ``(start, end)`` spans."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def python_callers(events: list[dict], call: dict, depth: int = 5) -> list[str]:
    """The innermost ``depth`` Python functions (``python_function`` events of the same thread) around a host
    API ``call``, innermost first."""
    t = float(call["ts"])
    around = [e for e in events if e.get("cat") == "python_function" and e.get("tid") == call.get("tid")
              and float(e["ts"]) <= t <= float(e["ts"]) + float(e["dur"])]
    around.sort(key=lambda e: -float(e["ts"]))
    return [str(e["name"])[:80] for e in around[:depth]]


def traced_samples(fn, n: int, calls: int, *, stacks: bool = False) -> list[dict]:
    """`samples`' loop under torch.profiler, one annotated range a sample, read by `read_samples`."""
    import torch
    from kernel_trace import trace_events

    def run() -> None:
        for i in range(n):
            with torch.profiler.record_function(f"{SAMPLE_MARK}{i}"):
                for _ in range(calls):
                    mx.async_eval(fn())
                mx.synchronize()

    return read_samples(trace_events(run, stacks=stacks), stacks=stacks)


#: The name of each sample's annotated range in the trace (then its index).
SAMPLE_MARK = "stall-sample-"


def read_samples(events: list[dict], *, stacks: bool = False) -> list[dict]:
    """Per annotated sample of a torch.profiler trace: its wall µs, the GPU's busy µs in it (kernels, copies
    and memsets, overlaps once) and how many such activities started in it, its longest GPU idle gap and
    the host CUDA API calls overlapping that gap, its API calls over 100 µs, its API µs by call, its
    slowest GPU activities and (``stacks``) the Python callers of its API calls over 1 ms but the waits
    (``cudaStreamSynchronize``)."""
    marks = sorted((e for e in events if str(e.get("name", "")).startswith(SAMPLE_MARK)
                    and e.get("cat") == "user_annotation"), key=lambda e: float(e["ts"]))
    gpu_events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu_events]
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    out = []
    for m in marks:
        t0, t1 = float(m["ts"]), float(m["ts"]) + float(m["dur"])
        spans = union_spans([(max(a, t0), min(b, t1)) for a, b in gpu if b > t0 and a < t1])
        busy = sum(b - a for a, b in spans)
        edges = [t0, *[x for sp in spans for x in sp], t1]
        gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2)]
        g0, g1 = max(gaps, key=lambda g: g[1] - g[0])
        during = sorted(((e["name"], float(e["dur"])) for e in api
                         if float(e["ts"]) < g1 and float(e["ts"]) + float(e["dur"]) > g0), key=lambda x: -x[1])
        longest = sorted(((e["name"], round(float(e["dur"]))) for e in api if t0 <= float(e["ts"]) < t1
                          and float(e["dur"]) > 100), key=lambda x: -x[1])
        totals: dict[str, float] = {}
        for e in api:
            if t0 <= float(e["ts"]) < t1:
                totals[e["name"]] = totals.get(e["name"], 0.0) + float(e["dur"])
        slowest = sorted((e for e in gpu_events if t0 <= float(e["ts"]) < t1), key=lambda e: -float(e["dur"]))[:4]
        blocking = [e for e in api if t0 <= float(e["ts"]) < t1 and float(e["dur"]) > 1000
                    and e["name"] != "cudaStreamSynchronize"]
        out.append({"slowest_gpu": [(str(e["name"])[:60], round(float(e["dur"]))) for e in slowest],
                    "callers": [(e["name"], round(float(e["dur"])), python_callers(events, e)) for e in blocking[:3]]
                    if stacks else [],
                    "api_total_us": sorted(((k, round(v)) for k, v in totals.items()), key=lambda x: -x[1])[:6],
                    "wall_us": t1 - t0, "busy_us": busy, "gpu_activities": sum(1 for a, b in gpu if t0 <= a < t1),
                    "gap_us": g1 - g0, "gap_at_us": g0 - t0,
                    "api_in_gap": [(name, round(d)) for name, d in during[:4]], "api_over_100us": longest[:6]})
    return out


def describe(i: int, r: dict) -> str:
    """One traced sample of `traced_samples` as a line."""
    return (f"sample {i}: wall {r['wall_us']:.0f} us busy {r['busy_us']:.0f} GPU activities {r['gpu_activities']} "
            f"longest idle {r['gap_us']:.0f} us at +{r['gap_at_us']:.0f}; API in it {r['api_in_gap']}; "
            f"API over 100 us {r['api_over_100us']}; API totals {r['api_total_us']}; "
            f"slowest GPU {r['slowest_gpu']}; callers {r['callers']}")


def trace_main(args, ours, peer) -> dict:
    """``--trace``: the bench's sampling, untraced and traced (module docstring)."""
    forced = lambda: ours(provider="sdpa_prefill")  # noqa: E731
    result: dict = {"untraced": {}, "traced": {}}
    if args.cold:  # traced from the process's first call: the warm-up's stalls
        result["traced"]["auto, cold"] = rows = traced_samples(ours, args.samples, args.calls)
        for i, r in enumerate(rows[:12]):
            print("cold auto " + describe(i, r), flush=True)
    for label, fn in (("auto", ours), ("sdpa_prefill", forced), ("peer", peer)):
        mx.eval(fn())
        rows = samples(fn, args.samples, args.calls)
        result["untraced"][label] = rows
        ms = sorted(r["ms_per_call"] for r in rows)
        print(f"untraced {label:13s} median {ms[len(ms) // 2]:.3f} ms a call  max {ms[-1]:.3f}  "
              f"{[round(r['ms_per_call'], 2) for r in rows]}", flush=True)
    for label, fn in (("auto", ours), ("sdpa_prefill", forced), ("peer", peer)):
        rows = traced_samples(fn, args.samples, args.calls, stacks=args.stacks)
        result["traced"][label] = rows
        walls = sorted(r["wall_us"] for r in rows)
        med = walls[len(walls) // 2]
        print(f"traced {label:13s} median wall {med / args.calls:.0f} us a call, GPU busy "
              f"{sorted(r['busy_us'] for r in rows)[len(rows) // 2] / args.calls:.0f} us a call", flush=True)
        for i, r in enumerate(rows):
            if r["wall_us"] > 1.3 * med or i < 2:
                print("    " + describe(i, r), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--batch", type=int, default=None, help="prompts of the prefill batch (default 4)")
    ap.add_argument("--q-len", type=int, default=None, help="tokens a prompt (default 2048)")
    ap.add_argument("--shape", default=None, help="instead of --batch/--q-len: a prefill-gpu suite shape by label")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--calls", type=int, default=None, help="queued calls a sample (4; 13 with --trace)")
    ap.add_argument("--trace", action="store_true", help="the bench's sampling, traced (module docstring)")
    ap.add_argument("--cold", action="store_true", help="with --trace: first trace auto from its first call")
    ap.add_argument("--stacks", action="store_true",
                    help="with --trace: Python callers of host API calls over 1 ms (torch.profiler with_stack)")
    args = ap.parse_args()
    if args.calls is None:
        args.calls = 13 if args.trace else 4
    if args.shape is not None:
        if args.batch is not None or args.q_len is not None:
            ap.error(f"--shape {args.shape!r} with --batch or --q-len (allowed: one or the other)")
        try:
            shape = prefill_suite_shape(args.shape)
        except ValueError as exc:
            ap.error(str(exc))
    else:
        batch = 4 if args.batch is None else args.batch
        q_len = 2048 if args.q_len is None else args.q_len
        shape = Shape(batch, 32, 8, 128, q_len, q_len=q_len)
    case = build_case(shape)
    def ours(provider=None):
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale,
                                          provider=provider)

    peer = sdpa_per_group(case)

    if args.trace:
        result = {"device": mx.device_info().get("device_name"), "shape": case.shape.label,
                  **trace_main(args, ours, peer)}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        return
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
