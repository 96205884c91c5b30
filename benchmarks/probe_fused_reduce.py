"""The split per-token call with the fused reducer against the kernel + reducer pair, kernel by kernel
(not a test).

    python3 benchmarks/probe_fused_reduce.py OUT.json [--calls 10] [--shapes b8:32:8:128:4096,...]

For each decode shape (batch:heads:kv_heads:head_size:context, bf16, block 16), the shipped route
(``classic``, `auto`'s choice on the peer shapes) with ``METAL_ATTN_CUDA_FUSED_REDUCE`` on and off:
each kernel's median GPU time over ``--calls`` traced calls (CUPTI, `kernel_trace`), its registers
per thread, shared memory and blocks per SM, and the GPU time a call spans (`kernel_trace.busy_us`).
A fused kernel slower than the pair's per-token kernel plus reducer pays for its last
threadgroups' serial reduction (or for registers the tail takes from the main loop): that is what
this separates. Needs MLX's CUDA backend, torch and the CUDA chains module (`docs/cuda-ops.md`).
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
from kernel_trace import busy_us, trace
from probe_args import decode_shapes

import metal_attn
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.settings import override_settings

#: The decode peer shapes of the decode-gpu suite: (batch, heads, kv heads, head size, context).
SHAPES = ((1, 32, 8, 128, 32768), (8, 32, 8, 128, 4096), (32, 32, 8, 128, 4096), (64, 32, 8, 128, 8192),
          (8, 32, 8, 128, 32768), (1, 24, 4, 256, 65536), (16, 16, 2, 128, 16384), (128, 32, 8, 128, 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    args = ap.parse_args()
    rows = []
    for batch, heads, kv_heads, head, context in args.shapes:
        case = build_case(Shape(batch, heads, kv_heads, head, context, "bfloat16"), seed=context)
        kv_bytes = 2 * case.k_pool.dtype.size * batch * context * kv_heads * head

        def call(case=case):
            return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                              scale=case.scale, provider="classic")

        for fused in (True, False):
            with override_settings(cuda_fused_reduce=fused):
                mx.eval(call())
                route = metal_attn.diagnostics.last_dispatch().route
                events = trace(call, args.calls)
            by_name: dict[str, list[dict]] = {}
            for e in events:
                by_name.setdefault(e["name"], []).append(e)
            kernels = []
            for name, evs in by_name.items():
                a = evs[0].get("args", {})
                kernels.append({"name": name[:80], "median_us": statistics.median(float(e["dur"]) for e in evs),
                                "registers": a.get("registers per thread"), "shared": a.get("shared memory"),
                                "blocks_per_sm": a.get("blocks per SM"), "grid": a.get("grid")})
            span = busy_us(events) / args.calls
            row = {"shape": f"b{batch} h{heads}/{kv_heads} d{head} L{context}", "fused": fused, "route": route,
                   "busy_us_per_call": span, "gbps_busy": kv_bytes / (span * 1e-6) / 1e9, "kernels": kernels}
            rows.append(row)
            desc = "; ".join(f"{k['name'][:36]} {k['median_us']:.1f}us r{k['registers']} smem{k['shared']} "
                             f"b/sm{k['blocks_per_sm']}" for k in kernels)
            print(f"{row['shape']:28s} fused={int(fused)} {route:16s} busy {span:7.1f}us "
                  f"{row['gbps_busy']:6.0f} GB/s | {desc}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
