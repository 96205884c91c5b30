"""Launch the classic per-token kernel a few times on one shape, for a profiler (not a test).

    ncu --kernel-name regex:paged_attention --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/profile_classic.py BATCH CONTEXT SPLIT [GEOMETRY [PREFETCH]]

32/8 heads, head 128, bf16 decode; GEOMETRY is `Geometry`'s fields comma-separated
(lanes,unroll,hps,hpw,stage,stages,mma,threads; e.g. 8,1,4,4,32,2,1,128), by default the
shipped one.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from metal_attn.providers import gpu_common as gc

from metal_attn.bench.shapes import Shape, build_case
from metal_attn.device import current_device


def main(argv: list[str]) -> None:
    backend = current_device().backend
    batch, context, split = int(argv[0]), int(argv[1]), bool(int(argv[2]))
    geo = gc.Geometry(*map(int, argv[3].split(","))) if len(argv) > 3 else None
    prefetch = int(argv[4]) if len(argv) > 4 else None
    case = build_case(Shape(batch, 32, 8, 128, context, "bfloat16"))
    for _ in range(4):
        out = gc.launch_paged(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale, sinks=None,
                              sliding_window=None, softcap=None, partition_size=512 if split else 0,
                              backend=backend,
                              geometry_override=geo, prefetch=prefetch)
        mx.eval(out)


if __name__ == "__main__":
    main(sys.argv[1:])
