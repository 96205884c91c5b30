"""Kernel tuning sweep on a GPU (not a test): load pipelining of the two decode kernels.

    python3 benchmarks/sweep_gpu_tuning.py OUT.json

- ``gqa_decode``: ``(CHUNK, PREFETCH)`` variants (tokens whose K/V loads are issued
  together; L2 prefetch of the next page) at each partition size, on the
  geometries of the CUDA table;
- ``classic``: geometry variants of the per-token kernel (lanes per token, unroll, heads
  per threadgroup and per simdgroup, direct or staged loads, the matrix path's launches and
  row layouts), split and unsplit; ``matrix``: the matrix paths' variants alone (heads as rows, and
  keys as rows); ``matrix-auto``: those at the partition size the plan takes for each shape.

Bare kernel launches (no dispatch), timed pipelined (calls queued with
``mx.async_eval``, one wait per sample), medians of 10 samples. Every variant's
output is compared with the shipped tuning's (relative L2 <= 1e-2), so a fast wrong
variant cannot win. The winners go into ``providers/gqa_decode.py::KERNEL_TUNING`` and
``providers/gpu_common/per_token_geometry.py`` and ``per_token.py`` (tables), with the figures in docs/bench-h200-*.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import mlx.core as mx
import numpy as np
from metal_attn.providers import gpu_common as gc
from metal_attn.providers import gqa_decode as gq

from metal_attn.bench.candidates import pipelined_median_s, rates
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.device import current_device
from metal_attn.testing.conformance import rel_l2

GQA_SHAPES = (  # (batch, heads, kv_heads, head, context, block)
    (1, 32, 8, 128, 32768, 16),
    (8, 32, 8, 128, 32768, 16),
    (32, 32, 8, 128, 4096, 16),
    (16, 16, 2, 128, 16384, 16),
    (1, 24, 4, 256, 65536, 16),
    (1, 16, 2, 256, 32768, 32),
)
GQA_TUNINGS = ((4, 0), (4, 1), (8, 1), (16, 1))
CLASSIC_SHAPES = (  # (batch, heads, kv_heads, head, context, split)
    (8, 32, 8, 128, 4096, True),
    (32, 32, 8, 128, 4096, True),
    (8, 32, 8, 128, 32768, True),
    (64, 32, 8, 128, 8192, False),
    (16, 16, 2, 128, 16384, True),
    (128, 32, 8, 128, 1024, False),
    (1, 32, 8, 128, 32768, True),
    (1, 24, 4, 256, 65536, True),
)
G = gc.Geometry
#: (geometry, PREFETCH): direct loads (stage 0) and chunks staged through threadgroup memory
#: (stage = tokens per chunk, stages = chunks in flight); variants a shape's group or head
#: size cannot take are skipped.
CLASSIC_TUNINGS = (
    (G(8, 1, 2), 1), (G(8, 2, 2), 1), (G(16, 1, 2), 1),
    (G(8, 2, 4, 1, 32, 2), 0), (G(8, 4, 4, 1, 32, 2), 0), (G(8, 2, 4, 1, 16, 4), 0), (G(8, 4, 4, 1, 16, 4), 0),
    (G(8, 2, 4, 2, 32, 2), 0), (G(8, 1, 4, 1, 32, 2), 0),
    (G(8, 2, 8, 2, 32, 2), 0), (G(8, 4, 8, 2, 32, 2), 0), (G(8, 2, 8, 2, 16, 4), 0), (G(8, 2, 8, 4, 32, 2), 0),
    (G(16, 2, 6, 3, 16, 2), 0), (G(16, 2, 2, 1, 16, 2), 0), (G(16, 1, 2, 1, 16, 2), 0),
    # the matrix path: (..., mma=1, threads), the whole group (4, 6 or 8 heads) a threadgroup
    (G(8, 1, 4, 4, 32, 2, 1, 128), 0), (G(8, 1, 4, 4, 16, 2, 1, 64), 0), (G(8, 1, 4, 4, 16, 4, 1, 64), 0),
    (G(8, 1, 8, 8, 32, 2, 1, 128), 0), (G(8, 1, 8, 8, 16, 2, 1, 64), 0), (G(16, 1, 6, 6, 16, 2, 1, 64), 0),
    # its rows unpadded and swizzled (CUDA's default since the nineteenth session): the launches the
    # 40 KiB budget leaves (hpw == hps; 128 threads take chunks of 32, 64 threads of 16 or 32)
    (G(8, 1, 4, 4, 32, 2, 1, 64, swizzle=1), 0), (G(8, 1, 4, 4, 16, 4, 1, 64, swizzle=1), 0),
    (G(8, 1, 4, 4, 16, 3, 1, 64, swizzle=1), 0), (G(8, 1, 8, 8, 32, 2, 1, 64, swizzle=1), 0),
    (G(8, 1, 8, 8, 16, 4, 1, 64, swizzle=1), 0), (G(8, 1, 8, 8, 16, 3, 1, 64, swizzle=1), 0),
    # the keys-as-rows path (mma=2, METAL_ATTN_MMA_KEY_ROWS): 64 threads, chunks of 32, 2 in flight (3 would
    # take 48 KiB, over the 40 KiB stage budget that leaves room for the fused reducer's scratch)
    (G(8, 1, 4, 4, 32, 2, 2, 64, swizzle=1), 0), (G(8, 1, 8, 8, 32, 2, 2, 64, swizzle=1), 0),
)


def sweep_gqa(backend: str) -> list[dict]:
    rows = []
    for batch, h, kvh, d, n, bs in GQA_SHAPES:
        case = build_case(Shape(batch, h, kvh, d, n, "bfloat16", block_size=bs))
        shipped = gq.kernel_tuning(backend, d, bs)
        for p in (512, 256):
            def launch(t, p=p, case=case):
                return gq.launch(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale,
                                 partition_size=p, backend=backend, tuning=t)

            ref = np.array(launch(shipped).astype(mx.float32))
            for t in GQA_TUNINGS:
                if bs % t[0]:
                    continue
                err = rel_l2(launch(t), ref)
                sec = pipelined_median_s(lambda t=t: launch(t))
                row = {"kernel": "gqa_decode", "batch": batch, "heads": h, "kv_heads": kvh, "head": d,
                       "context": n, "block": bs, "partition": p, "chunk": t[0], "prefetch": t[1],
                       "shipped": t == shipped, "us": sec * 1e6,
                       "gbps": rates(case.shape, sec)[0], "rel_l2_vs_shipped": err}
                assert err <= 1e-2, row
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def sweep_classic(backend: str, matrix_only: bool = False, auto_partitions: bool = False) -> list[dict]:
    """The per-token kernel's variants on `CLASSIC_SHAPES` (``matrix_only``: its matrix paths' alone;
    ``auto_partitions``: at the route and partition size `paged_attention`'s plan takes for the shape,
    not 512 or unsplit)."""
    import metal_attn as ma

    rows = []
    for batch, h, kvh, d, n, split in CLASSIC_SHAPES:
        case = build_case(Shape(batch, h, kvh, d, n, "bfloat16"))
        psize = 512 if split else 0
        if auto_partitions:
            mx.eval(ma.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata))
            psize = ma.diagnostics.last_dispatch().partition_size

        def launch(geo=None, prefetch=None, case=case, psize=psize):
            return gc.launch_paged(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale,
                                   sinks=None, sliding_window=None, softcap=None,
                                   partition_size=psize, backend=backend,
                                   geometry_override=geo, prefetch=prefetch)

        ref = np.array(launch().astype(mx.float32))
        shipped = (gc.launch_geometry(case.q, case.k_pool, case.metadata, partition_size=psize, backend=backend),
                   gc.PREFETCH_NEXT.get(backend, 0))
        for g, pf in dict.fromkeys((*CLASSIC_TUNINGS, shipped)):
            if gc.geometry_problem(g, d, h // kvh, 2, backend) or (matrix_only and not g.mma):
                continue
            err = rel_l2(launch(g, pf), ref)
            sec = pipelined_median_s(lambda g=g, pf=pf: launch(g, pf))
            row = {"kernel": "classic", "batch": batch, "heads": h, "kv_heads": kvh, "head": d, "context": n,
                   "split": psize > 0, "partition": psize, "geometry": list(dataclasses.astuple(g)), "prefetch": pf,
                   "shipped": (g, pf) == shipped, "us": sec * 1e6,
                   "gbps": rates(case.shape, sec)[0], "rel_l2_vs_shipped": err}
            assert err <= 1e-2, row
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(out_path: str, which: str = "all") -> None:
    mx.set_cache_limit(1 << 34)
    dev = current_device()
    rows = []
    if which in ("all", "gqa"):
        rows += sweep_gqa(dev.backend)
    if which in ("all", "classic", "matrix"):
        rows += sweep_classic(dev.backend, matrix_only=which == "matrix")
    if which == "matrix-auto":  # the matrix paths at the plan's own partitions
        rows += sweep_classic(dev.backend, matrix_only=True, auto_partitions=True)
    with open(out_path, "w") as f:
        json.dump({"device": dev.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python3 benchmarks/sweep_gpu_tuning.py OUT.json [all|gqa|classic|matrix]")
    main(*sys.argv[1:])
