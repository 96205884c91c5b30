"""The per-token kernel's GPU time on one request's decode, by context and partition size (not a test).

    python3 benchmarks/probe_per_token_small.py OUT.json [--calls 20] [--variants B:L:P,...]

Decode rows (batch 1, 4 and 8), 32/8 heads, head 128, bf16, block 16: contexts from one page to
8K, by the shipped rule and with forced partition sizes (``METAL_ATTN_PARTITION_SIZE``). Each
kernel's median GPU time over ``--calls`` traced calls (CUPTI, `kernel_trace`). A kernel
whose time does not shrink with its work per threadgroup has a fixed cost: that is what this
separates. ``--ncu`` runs each variant a few times with no tracing, for Nsight Compute.
``--variants`` replaces the table below with (batch, context, partition size) triples, e.g.
``64:545:0,64:545:256`` (an engine step's rows just past one partition).
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx

import metal_attn
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.settings import override_settings

#: (batch, context, forced partition size; 0: the shipped rule, the unsplit route at short contexts).
VARIANTS = ((1, 16, 0), (1, 100, 0), (1, 600, 0), (1, 600, 512), (1, 600, 64), (1, 2048, 0), (1, 2048, 512),
            (1, 2048, 128), (1, 2048, 64), (1, 8192, 0), (1, 8192, 512), (1, 8192, 64), (4, 600, 0), (4, 600, 512),
            (4, 600, 64), (4, 2048, 0), (4, 2048, 512), (4, 2048, 64), (8, 4096, 0), (8, 4096, 256),
            (8, 4096, 64))


def _variants(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        out = tuple(tuple(int(x) for x in item.split(":")) for item in text.split(","))
    except ValueError:
        out = ()
    if not out or any(len(v) != 3 or v[0] < 1 or v[1] < 1 or v[2] not in (0, 64, 128, 256, 512) for v in out):
        raise argparse.ArgumentTypeError(f"--variants={text!r} (allowed: batch:context:partition triples, "
                                         "comma-separated, partition one of 0, 64, 128, 256, 512)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--variants", type=_variants, default=VARIANTS,
                    help="comma-separated batch:context:partition (partition 0: the shipped rule)")
    args = ap.parse_args()
    rows = []
    for batch, context, psize in args.variants:
        case = build_case(Shape(batch, 32, 8, 128, context, "bfloat16"), seed=context)

        def call(case=case):
            return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                              scale=case.scale, provider="classic")

        with override_settings(partition_size=psize):
            mx.eval(call())
            route = metal_attn.diagnostics.last_dispatch().route
            if args.ncu:
                for _ in range(3):
                    mx.eval(call())
                continue
            from kernel_trace import trace

            events = trace(call, args.calls)
        by_name: dict[str, list[float]] = {}
        for e in events:
            by_name.setdefault(e["name"][:60], []).append(float(e["dur"]))
        kernels = {n: statistics.median(d) for n, d in by_name.items()}
        rows.append({"batch": batch, "context": context, "partition_size": psize, "route": route,
                     "kernel_median_us": kernels})
        label = "rule" if psize == 0 else f"P{psize}"
        times = "  ".join(f"{n[:44]} {us:.1f}us" for n, us in kernels.items())
        print(f"b{batch} L{context:5d} {label:5s} {route:16s} {times}", flush=True)
    if not args.ncu:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
