"""Where a queued mixed batch's host time goes on the CUDA backend (not a test): issue #18.

    python3 benchmarks/probe_mixed_host.py OUT.json [--shapes PATTERN ...] [--calls N]

A mixed batch of the ``prefill-gpu`` suite through ``paged_attention`` (the registry's choice) is
host-bound where its peer, MLX SDPA on contiguous K/V, is not (docs/bench-h200-prefill.md, twenty-sixth
session: 0.20 ms a queued call for 90 us of GPU work). For ``auto`` and the peer, MLX SDPA on contiguous K/V
per group of sequences (``mlx_sdpa``) and from and to packed rows (``mlx_sdpa_packed``), in one process:

- ``build_us``: building one call's graph (Python and MLX's graph building), median;
- ``encode_us``: ``mx.async_eval`` of that graph (MLX's evaluation: its CUDA graphs, cuDNN, our
  primitives), median, the calls queued one after another with one wait every 20 calls;
- ``api``: the CUDA runtime and driver calls the host made in ``--calls`` queued calls (torch.profiler's
  CPU activity, `kernel_trace.trace_events`), per name: calls and host microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import mlx.core as mx
from kernel_trace import trace_events

import metal_attn
from metal_attn.bench.peers import sdpa_packed, sdpa_per_group
from metal_attn.bench.shapes import build_case
from metal_attn.bench.suites import get_suite

#: torch.profiler's categories of host-side CUDA API events.
API_CATS = ("cuda_runtime", "cuda_driver")


def builders(case):
    """(label, fn building one call's graph) for ``auto`` and the peers, MLX SDPA per group and from packed rows."""
    def auto():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale)

    return [("auto", auto), ("mlx_sdpa", sdpa_per_group(case)), ("mlx_sdpa_packed", sdpa_packed(case))]


def host_split(fn, calls: int, sync_every: int = 20) -> tuple[float, float]:
    """Median microseconds of building and of queueing (``mx.async_eval``) one call, over ``calls``, waiting
    for the GPU after every ``sync_every`` calls (1: each call finds the GPU idle)."""
    build, encode = [], []
    for i in range(calls):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        if i % sync_every == sync_every - 1:
            mx.synchronize()
    mx.synchronize()
    return statistics.median(build) * 1e6, statistics.median(encode) * 1e6


def api_calls(fn, calls: int) -> list[dict]:
    """The host's CUDA API calls per name over ``calls`` queued calls: calls and microseconds per call."""
    def run():
        for _ in range(calls):
            mx.async_eval(fn())

    by_name: dict[str, list[float]] = defaultdict(list)
    for e in trace_events(run, cpu=True):
        if e.get("cat") in API_CATS:
            by_name[e["name"]].append(float(e.get("dur", 0.0)))
    rows = [{"name": n, "calls_per_call": len(d) / calls, "us_per_call": sum(d) / calls} for n, d in by_name.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=None, help="label patterns (default: every mixed shape)")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls {args.calls} (allowed: an int >= 1)")
    results = []
    for shape in [s for s in get_suite("prefill-gpu").select(args.shapes) if s.phase == "mixed"]:
        case = build_case(shape)
        for label, fn in builders(case):
            for _ in range(5):
                mx.eval(fn())
            build_us, encode_us = host_split(fn, args.calls)
            api = api_calls(fn, args.calls)
            results.append({"shape": shape.label, "candidate": label, "build_us": build_us, "encode_us": encode_us,
                            "api": api})
            top = ", ".join(f"{r['name']} {r['calls_per_call']:g}x {r['us_per_call']:.1f}us" for r in api[:6])
            print(f"{shape.label[:40]:40} {label:15} build {build_us:6.1f} us  encode {encode_us:6.1f} us | "
                  f"{top}", flush=True)
        case.release()
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "calls": args.calls, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
