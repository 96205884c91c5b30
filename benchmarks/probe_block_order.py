"""Does the order of a block table change the decode kernel's GPU time? (not a test)

    python3 benchmarks/probe_block_order.py OUT.json [--calls 20] [--shapes b8:32:8:128:4096,...]

The decode suites build random block tables: a random permutation of the pool, so each threadgroup's
512-token partition reads 32 pages scattered over the whole pool. cuDNN's kernel, the peer, reads
contiguous K/V. For each decode shape (batch:heads:kv_heads:head_size:context, bf16, block 16) this
times the shipped `classic` route's kernels (CUPTI, median of ``--calls`` traced calls) on the same
pools under three tables:

- ``random``: the suite's table;
- ``runs``: whole runs of 2 MiB of consecutive pages, the runs in random order (pages in a run stay
  in order, so a partition's reads touch one or two 2 MiB ranges of each pool);
- ``sequential``: every sequence's pages consecutive, sequences one after another.

and torch SDPA on K/V of the same shape, contiguous per head and in the pools' token-major layout
(each head's keys ``kv heads x head`` elements apart). If ``runs`` and ``sequential`` match
``random``, the kernel's gap to cuDNN is not where its reads land; if they are faster, the address
spread (translation or DRAM locality) is part of it. Needs MLX's CUDA backend and torch.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from kernel_trace import busy_us, kernel_us, summarise, torch_decode_sdpa, trace
from probe_args import decode_shapes

import metal_attn
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.metadata import AttentionMetadata

SHAPES = ((8, 32, 8, 128, 4096), (1, 32, 8, 128, 32768), (16, 16, 2, 128, 16384), (1, 24, 4, 256, 65536),
          (32, 32, 8, 128, 4096), (8, 32, 8, 128, 32768))

RUN_BYTES = 2 << 20


def _tables(order: str, case, rng: np.random.Generator) -> np.ndarray:
    """The case's table re-laid: the same number of pages a sequence, ids by ``order``."""
    tables = case.block_tables
    counts = [-(-n // case.shape.block_size) for n in case.shape.seq_lens]
    needed = sum(counts)
    num_blocks = case.k_pool.shape[0]
    if order == "sequential":
        ids = np.arange(needed)
    elif order == "runs":
        s = case.shape
        page_bytes = s.block_size * s.num_kv_heads * s.head_size * case.k_pool.dtype.size
        run = max(1, RUN_BYTES // page_bytes)
        starts = rng.permutation(np.arange(0, num_blocks - run + 1, run))
        ids = np.concatenate([np.arange(a, a + run) for a in starts])[:needed]
    else:
        return tables
    out = np.zeros_like(tables)
    at = 0
    for i, n in enumerate(counts):
        out[i, :n] = ids[at:at + n]
        at += n
    return out


def _kernels(events: list[dict], calls: int) -> list[dict]:
    """Per kernel: its name, median µs and launches per call (`kernel_trace.summarise`)."""
    return summarise(events, calls, 1)["kernels"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    ap.add_argument("--orders", type=lambda t: t.split(","), default=["random", "runs", "sequential"])
    args = ap.parse_args()
    rows = []
    for batch, heads, kv_heads, head, context in args.shapes:
        shape = Shape(batch, heads, kv_heads, head, context, "bfloat16")
        case = build_case(shape, seed=context)
        kv_bytes = case.shape.kv_bytes
        rng = np.random.default_rng(1)
        label = f"b{batch} h{heads}/{kv_heads} d{head} L{context}"
        for order in args.orders:
            tables = _tables(order, case, rng)
            md = AttentionMetadata.build(mx.array(tables), case.metadata.seq_lens, case.metadata.cu_seqlens_q)

            def call(md=md, case=case):
                return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=md,
                                                  scale=case.scale, provider="classic")

            mx.eval(call())
            route = metal_attn.diagnostics.last_dispatch().route
            events = trace(call, args.calls)
            kernels = _kernels(events, args.calls)
            gpu_us = kernel_us(kernels)
            row = {"shape": label, "order": order, "route": route, "kernels": kernels, "kernel_us_per_call": gpu_us,
                   "busy_us_per_call": busy_us(events) / args.calls, "gbps_kernel": kv_bytes / (gpu_us * 1e-6) / 1e9}
            rows.append(row)
            print(f"{label:26s} {order:10s} {route:16s} kernels {gpu_us:7.1f}us {row['gbps_kernel']:6.0f} GB/s | "
                  + "; ".join(f"{k['name'][:28]} {k['median_us']:.1f}" for k in kernels), flush=True)
        for token_major in (False, True):
            t = torch_decode_sdpa(case, args.calls, token_major=token_major)
            gpu_us = kernel_us(t["kernels"])
            order = "torch token-major" if token_major else "torch contiguous"
            rows.append({"shape": label, "order": order, **t, "kernel_us_per_call": gpu_us,
                         "gbps_kernel": kv_bytes / (gpu_us * 1e-6) / 1e9})
            print(f"{label:26s} {order:27s} kernels {gpu_us:7.1f}us {kv_bytes / gpu_us / 1e3:6.0f} GB/s | "
                  + "; ".join(f"{k['name'][:28]} {k['median_us']:.1f}" for k in t["kernels"]), flush=True)
        del case
        mx.clear_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
