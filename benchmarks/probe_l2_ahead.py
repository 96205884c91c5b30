"""How far ahead of its copies should the staged per-token kernel ask L2 for K/V? (not a test)

    python3 benchmarks/probe_l2_ahead.py OUT.json [--calls 20] [--ahead 0,1,2,3,4] [--shapes b8:32:8:128:4096,...]

The staged kernel keeps ``STAGES`` chunks of ``STAGE`` tokens in flight through threadgroup memory
(`StagingRule`): at 32 tokens and two stages, 16 KB of K+V per threadgroup at head 128. Its
``PREFETCH`` template argument asks L2 for the next ``A`` chunks beyond those, which costs no
threadgroup memory (`StagingRule.l2_ahead`). For each decode shape (batch:heads:kv_heads:head:context,
bf16, block 16) and each ``A``, the route the `classic` plan takes (its geometry and partition size)
is launched with ``PREFETCH = A``: each kernel's median GPU time over ``--calls`` traced calls
(CUPTI), and the output against ``A = 0``'s (it must be equal bit for bit: the prefetch moves no
arithmetic). torch SDPA on contiguous K/V, the peer, is timed in the same process. Needs MLX's CUDA
backend and torch.
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
import numpy as np
from kernel_trace import busy_us, record, trace
from probe_block_order import SHAPES, _shapes

import metal_attn
from metal_attn.bench.core import Shape, build_case
from providers import gpu_common as gc


def _kernel_us(events: list[dict], calls: int) -> tuple[float, list[dict]]:
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    ks = [{"name": n[:60], "median_us": statistics.median(d), "launches_per_call": len(d) / calls}
          for n, d in by_name.items()]
    return sum(k["median_us"] * k["launches_per_call"] for k in ks), ks


def _torch_us(shape: Shape, calls: int) -> float:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    q = torch.rand(shape.batch, shape.num_heads, 1, shape.head_size, device=dev, dtype=torch.bfloat16)
    k = torch.rand(shape.batch, shape.num_kv_heads, shape.seq_lens[0], shape.head_size, device=dev,
                   dtype=torch.bfloat16)
    v = torch.rand_like(k)

    def run() -> None:
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    run()
    torch.cuda.synchronize()
    return _kernel_us(record(run, cpu=False), calls)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--ahead", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2, 3, 4])
    ap.add_argument("--shapes", type=_shapes, default=SHAPES)
    args = ap.parse_args()
    rows = []
    for batch, heads, kv_heads, head, context in args.shapes:
        shape = Shape(batch, heads, kv_heads, head, context, "bfloat16")
        case = build_case(shape, seed=context)
        kv_bytes = 2 * case.k_pool.dtype.size * batch * context * kv_heads * head
        label = f"b{batch} h{heads}/{kv_heads} d{head} L{context}"
        mx.eval(metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                           scale=case.scale, provider="classic"))
        route = metal_attn.diagnostics.last_dispatch().route
        part = int(route.removeprefix("per_token_ps"))
        geo = gc.launch_geometry(case.q, case.k_pool, case.metadata, partition_size=part, backend="cuda")
        torch_us = _torch_us(shape, args.calls)
        print(f"{label:26s} {route} {gc.describe_geometry(geo, None)} torch {torch_us:.1f}us", flush=True)
        ref = None
        for ahead in args.ahead if geo.stage else [gc.prefetch_for(geo, "cuda")]:
            def call(ahead=ahead, case=case, part=part):
                return gc.launch_paged(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale,
                                       sinks=None, sliding_window=None, softcap=None, partition_size=part,
                                       backend="cuda", prefetch=ahead)

            out = np.array(call().astype(mx.float32))
            ref = out if ref is None else ref
            events = trace(call, args.calls)
            us, ks = _kernel_us(events, args.calls)
            row = {"shape": label, "route": route, "geometry": gc.describe_geometry(geo, None), "ahead": ahead,
                   "kernel_us": us, "busy_us": busy_us(events) / args.calls, "kernels": ks,
                   "gbps_kernel": kv_bytes / (us * 1e-6) / 1e9, "torch_us": torch_us,
                   "torch_over_ours": torch_us / us, "equal_to_first": bool(np.array_equal(out, ref, equal_nan=True))}
            rows.append(row)
            print(f"  ahead={ahead} kernels {us:7.1f}us {row['gbps_kernel']:6.0f} GB/s torch/ours "
                  f"{row['torch_over_ours']:.3f} equal={row['equal_to_first']} | "
                  + "; ".join(f"{k['name'][-12:]} {k['median_us']:.1f}" for k in ks), flush=True)
        del case
        mx.clear_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
