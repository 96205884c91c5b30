"""Tile-shape sweep of the tiled prefill kernel on a GPU (not a test).

    python3 benchmarks/sweep_tiled.py OUT.json

Bare launches of ``tiled_prefill.launch`` with each ``(BQ, BKV)`` on causal prefill
shapes (a 4K prompt, a 512-row chunk after 1.5K tokens of context as in the mixed
benchmark batch, head 256), timed pipelined (medians of 10 samples). Every variant's
output is compared with the shipped configuration's (relative L2 <= 1e-2), so a fast
wrong variant cannot win. Winners go into ``providers/tiled_prefill.py::TILE_CONFIGS``
with the figures in docs/bench-h200-tiled.md.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from metal_attn.providers import tiled_prefill as tp

from metal_attn.bench.core import Rows, Shape, build_case, pipelined_median_s, rates
from metal_attn.device import current_device
from metal_attn.testing.conformance import rel_l2

SHAPES = (
    Shape(1, 32, 8, 128, 4096, "bfloat16", q_len=4096),
    Shape.mix((Rows(1, 512, 2048),), 32, 8, 128),
    Shape(1, 16, 2, 256, 4096, "bfloat16", q_len=2048),
)
#: (BQ, BKV, RB) per head size.
CONFIGS = {
    128: ((32, 32, 1), (64, 32, 2), (128, 32, 2), (64, 64, 2), (128, 64, 2), (256, 32, 2), (128, 32, 1)),
    256: ((16, 16, 1), (32, 16, 2), (64, 16, 2), (64, 32, 2), (128, 16, 2), (128, 32, 2)),
}


def main(path: str) -> None:
    backend = current_device().backend
    rows = []
    for shape in SHAPES:
        case = build_case(shape)
        shipped = tp.tile_config(backend, shape.head_size)

        def launch(cfg, case=case):
            return tp.launch(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale, sinks=None,
                             sliding_window=None, softcap=None, backend=backend, config=cfg)

        ref = np.array(launch(shipped).astype(mx.float32))
        for bq, bkv, rb in CONFIGS[shape.head_size]:
            cfg = tp.TileConfig(bq, bkv, rb)
            try:
                got = launch(cfg)
                mx.eval(got)
                sec = pipelined_median_s(lambda cfg=cfg: launch(cfg))
            except RuntimeError as exc:  # e.g. more registers than the SM has for this many threads
                print(json.dumps({"shape": shape.label, "config": [bq, bkv, rb], "error": str(exc)}))
                continue
            err = rel_l2(got, ref)
            row = {"shape": shape.label, "bq": bq, "bkv": bkv, "rb": rb, "shipped": cfg == shipped, "us": sec * 1e6,
                   "tflops": rates(shape, sec)[1], "rel_l2": err}
            print(json.dumps(row), flush=True)
            assert err <= 1e-2, row
            rows.append(row)
    with open(path, "w") as f:
        json.dump({"backend": backend, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
