"""The per-token kernel's partition size on small decode steps, against MLX SDPA (not a test).

    python3 benchmarks/sweep_partition.py OUT.json [--batches 1 4] [--contexts 600 1100 2048 4096 8192]

For each (batch, context): a 32-layer bf16 decode step, 32/8 heads, head 128, block 16, one
metadata shared by the layers, each layer's query the output before it, every call queued, one eval
per step (the ``decode-step`` suite's setup, `metal_attn.bench.decode_step`). In one process it times
``classic`` at every split partition size (``METAL_ATTN_PARTITION_SIZE``), ``classic`` at the rule's choice
(`gpu_common.PARTITION_RULES`), and MLX SDPA on contiguous K/V (the peer), and checks that every
partition size gives the same output as 512 within bf16 rounding. It prints a row per shape:
microseconds per layer, the fastest size, and the rule's pick.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from metal_attn.providers import gpu_common as gc

import metal_attn
from metal_attn.bench.decode_step import StepShape, chain
from metal_attn.bench.timing import time_fn
from metal_attn.settings import override_settings

SIZES = gc.PER_TOKEN_PARTITION_SIZES


def _time_step(case, forced: int | None) -> tuple[float, str, np.ndarray]:
    """Seconds per step (median), the route taken, and layer 0's output, with the partition size
    forced (``None``: the rule's)."""
    q, md, scale = case.q, case.metadata, case.scale

    def compute():
        return chain(q, case.pools, lambda x, kv: metal_attn.paged_attention(x, *kv, metadata=md, scale=scale,
                                                                             provider="classic"))

    with override_settings(partition_size=forced or 0):
        out = compute()
        mx.eval(out)
        route = metal_attn.diagnostics.last_dispatch().route
        t = time_fn(lambda: mx.eval(compute()), warmup=3, iters=10).median_s
    return t, route, np.array(out[0].astype(mx.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="*", default=[600, 1100, 2048, 4096, 8192])
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    rows = []
    print("| batch | context | " + " | ".join(f"P{p} us" for p in SIZES) + " | rule | mlx_sdpa us | fastest | "
          "rule / fastest | rule / mlx_sdpa |", flush=True)
    print("|---" * (len(SIZES) + 7) + "|", flush=True)
    for batch in args.batches:
        for context in args.contexts:
            shape = StepShape(batch, 32, 8, 128, context, "bfloat16", layers=args.layers)
            case = shape.build(seed=batch * 7 + context)
            per: dict[str, float] = {}
            ref = None
            for p in SIZES:
                t, route, out = _time_step(case, p)
                per[f"P{p}"] = t / args.layers * 1e6
                if ref is None:
                    ref = out
                err = float(np.max(np.abs(out - ref)))
                assert route in (gc.per_token_route(p), "per_token_ps0"), route
                assert err <= 0.05, f"P{p} differs from P{SIZES[0]} by {err} at b{batch} L{context}"
            t, rule_route, _ = _time_step(case, None)
            rule_us = t / args.layers * 1e6
            kv, q4 = case.contiguous_kv(), case.query4()
            peer = time_fn(lambda kv=kv, q4=q4, scale=case.scale: mx.eval(chain(
                q4, kv, lambda x, layer: mx.fast.scaled_dot_product_attention(x, *layer, scale=scale))),
                warmup=3, iters=10).median_s / args.layers * 1e6
            fastest = min(per, key=per.get)
            row = {"batch": batch, "context": context, "us_per_layer": per, "rule_route": rule_route,
                   "rule_us": rule_us, "mlx_sdpa_us": peer, "fastest": fastest,
                   "rule_over_fastest": rule_us / per[fastest], "rule_over_mlx_sdpa": rule_us / peer}
            rows.append(row)
            print(f"| {batch} | {context} | " + " | ".join(f"{per[f'P{p}']:.1f}" for p in SIZES)
                  + f" | {rule_route} {rule_us:.1f} | {peer:.1f} | {fastest} | {row['rule_over_fastest']:.2f}x | "
                  f"{row['rule_over_mlx_sdpa']:.2f}x |", flush=True)
            case.release()
            del case
    with open(args.out, "w") as f:
        json.dump({"device": metal_attn.current_device().describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
