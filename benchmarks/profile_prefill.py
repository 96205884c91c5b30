"""Where a gathered-SDPA prefill call's time goes on the CUDA backend (not a test): issue #18.

    python3 benchmarks/profile_prefill.py OUT.json [--shapes PATTERN ...]

For each prefill shape of the ``prefill-gpu`` suite (or those matching ``--shapes``), in one
process: the wall time of a blocking call (`metal_attn.bench.timing.time_fn`) and the GPU time of
every kernel it launches (CUPTI, `kernel_trace`), and the host time of building its graph, for

- ``route``: ``paged_attention(..., provider="sdpa_prefill")``, the whole public path;
- ``mlx_sdpa``: MLX SDPA on contiguous ``[n, H, L, D]`` q, K and V (the suite's peer);
- ``gather``: the ``gather_kv`` kernel alone;
- ``sdpa q_view``: MLX SDPA on already gathered K/V with q as the route passes it (a transposed
  view of the packed ``[rows, H, D]``), nothing else;
- ``sdpa q_copy``: the same with q copied to contiguous ``[n, H, L, D]`` first.

The gaps between them say what the route pays for: the gather, the query's layout, the NaN
contract's kernels, or host time between launches (docs/bench-h200-prefill.md has a run, and the
previous route's figures: run this script with ``PYTHONPATH`` on an older tree to compare).
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
from kernel_trace import profile_call, top_kernels
from metal_attn.providers import sdpa_prefill as sp

import metal_attn
from metal_attn.bench.shapes import build_case
from metal_attn.bench.suites import get_suite
from metal_attn.device import current_device


def variants(case):
    """(label, fn) pairs for one prefill case (a single run of equal sequences)."""
    s = case.shape
    md, kc, vc = case.metadata, case.k_pool, case.v_pool
    n, q_len = s.batch, s.q_len
    backend = current_device().backend
    qv = case.q.reshape(n, q_len, s.num_heads, s.head_size).transpose(0, 2, 1, 3)
    # The route's own gather: its chain on CUDA with chains on, else its mx.fast launches.
    plan = sp.run_launches(md, 0, case.q.shape, kc.shape, case.q.dtype, kc.dtype, 0, backend)
    if plan.chained is not None:
        def gather():
            return plan.chained.gather_flagged(kc, vc, md.block_tables)[0][:2]
    else:
        (run,) = plan.runs

        def gather():
            return run.gather_flagged(kc, vc, md.block_tables)[:2]
    k, v = gather()
    mx.eval(k, v)
    (kk, vv), = case.contiguous_kv()
    (qc,) = case.group_queries()

    def sdpa(q, keys, values):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=case.scale, mask="causal")

    yield "route", lambda: metal_attn.paged_attention(case.q, kc, vc, metadata=md, scale=case.scale,
                                                      provider="sdpa_prefill")
    yield "mlx_sdpa", lambda: sdpa(qc, kk, vv)
    yield "gather", gather
    yield "sdpa q_view", lambda: sdpa(qv, k, v)
    yield "sdpa q_copy", lambda: sdpa(mx.contiguous(qv), k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=None, help="label patterns (default: every prefill shape)")
    args = ap.parse_args()
    mx.set_cache_limit(1 << 34)
    shapes = [s for s in get_suite("prefill-gpu").select(args.shapes) if s.phase == "prefill"]
    results = []
    for shape in shapes:
        case = build_case(shape)
        for label, fn in variants(case):
            row = {"shape": shape.label, "variant": label, **profile_call(fn, shape.kv_bytes)}
            row["tflops_wall"] = shape.flops / (row["wall_ms"] * 1e-3) / 1e12
            results.append(row)
            print(f"{shape.label:44s} {label:12s} wall {row['wall_ms']:7.3f} ms ({row['tflops_wall']:5.0f} TF/s) "
                  f"build {row['build_ms']:6.3f} ms "
                  f"gpu {row['gpu_us_per_call']:7.0f} us | {top_kernels(row, 4, 38)}", flush=True)
        del case
    with open(args.out, "w") as f:
        json.dump({"device": current_device().describe(), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
