"""Launch the tiled prefill kernel a few times on one shape, for a profiler (not a test).

    ncu --kernel-name regex:tiled_prefill --launch-skip 2 --launch-count 1 \
        python3 benchmarks/profile_tiled.py [BQ BKV]

A 4K-token causal prompt, 32/8 heads, head 128, bf16; ``BQ BKV`` override the tile.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from metal_attn.providers import tiled_prefill as tp

from metal_attn.bench.shapes import Shape, build_case
from metal_attn.device import current_device


def main(argv: list[str]) -> None:
    backend = current_device().backend
    cfg = tp.TileConfig(int(argv[0]), int(argv[1])) if argv else None
    case = build_case(Shape(1, 32, 8, 128, 4096, "bfloat16", q_len=4096))
    for _ in range(4):
        out = tp.launch(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale, sinks=None,
                        sliding_window=None, softcap=None, backend=backend, config=cfg)
        mx.eval(out)


if __name__ == "__main__":
    main(sys.argv[1:])
