"""Where a mixed batch's time goes on the CUDA backend (not a test): issue #18's mixed target.

    python3 benchmarks/profile_mixed.py OUT.json [--shapes PATTERN ...]

For each mixed shape of the ``prefill-gpu`` suite (or those matching ``--shapes``), in one process:
the wall time of a blocking call (`metal_attn.bench.timing.time_fn`), the host time of building its
graph, and the GPU time of every kernel it launches (CUPTI, `kernel_trace`), for

- ``auto``: ``paged_attention`` with the registry's choice (the suite's ``auto``);
- ``tiled_prefill``: the tiles' mixed route (decode rows split off to the per-token kernel);
- ``sdpa_prefill``: the gathered-SDPA route with its rule opened to every chunk
  (``sdpa_prefill_decode``; the rule is opened once around every measurement of it);
- ``mlx_sdpa``: the suite's peer, MLX SDPA on contiguous K/V, one call per group of rows (its
  prepared call evaluates its result, so its build time is not taken: ``n/a``).

``gpu`` sums the kernels' durations; ``busy`` is the union of their intervals (MLX's CUDA graphs run
kernels without a data dependency at once: the tiles' route runs its per-token and tiled kernels
side by side). A route slower than the peer on wall time but not on busy time pays in launches and
host time; one slower on busy time pays in its kernels. Under each row, its ``timeline``: every launch of
one call with its median start and duration after the call's first event, which shows what ran beside what
(whether a batch's decode rows hide in the chunk kernel's tail, as the peer's seem to, or wait for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from kernel_trace import profile_call, timeline_lines, top_kernels

import metal_attn
from metal_attn.bench.peers import MlxSdpa
from metal_attn.bench.shapes import build_case
from metal_attn.bench.suites import get_suite
from metal_attn.device import current_device
from metal_attn.testing.overrides import opened_sdpa_prefill_rule


def variants(case):
    """(label, context manager to measure under, fn, whether fn only builds its graph) for one mixed case."""
    def route(provider=None):
        return lambda: metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                                  scale=case.scale, provider=provider)

    peer = MlxSdpa().prepare(case)
    yield "auto", contextlib.nullcontext, route(), True
    yield "tiled_prefill", contextlib.nullcontext, route("tiled_prefill"), True
    yield "sdpa_prefill", opened_sdpa_prefill_rule, route("sdpa_prefill"), True
    yield "mlx_sdpa", contextlib.nullcontext, peer.run, False  # the peer's call evaluates its result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=None, help="label patterns (default: every mixed shape)")
    args = ap.parse_args()
    shapes = [s for s in get_suite("prefill-gpu").select(args.shapes) if s.phase == "mixed"]
    results = []
    for shape in shapes:
        case = build_case(shape)
        for label, scope, fn, builds in variants(case):
            with scope():
                row = {"shape": shape.label, "variant": label, **profile_call(fn, shape.kv_bytes, builds=builds)}
            row["gbps_wall"] = shape.kv_bytes / (row["wall_ms"] * 1e-3) / 1e9
            results.append(row)
            build = "n/a" if row["build_ms"] is None else f"{row['build_ms']:.3f}"
            print(f"{shape.label:46s} {label:13s} wall {row['wall_ms']:7.3f} ms ({row['gbps_wall']:5.0f} GB/s) "
                  f"build {build:>6s} ms gpu {row['gpu_us_per_call']:6.0f} us "
                  f"busy {row['busy_us_per_call']:6.0f} us | {top_kernels(row, 5, 34)}", flush=True)
            for line in timeline_lines(row, 60):
                print(line, flush=True)
        del case
    with open(args.out, "w") as f:
        json.dump({"device": current_device().describe(), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
