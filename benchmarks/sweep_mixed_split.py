"""Mixed-batch split sweep on a GPU (not a test): where should decode rows leave the tiles?

    python3 benchmarks/sweep_mixed_split.py OUT.json

For mixed batches (N decode rows of context L, then one prefill chunk), times the
``tiled_prefill`` provider with the decode rows riding in the tiles and with them split
off to the per-token kernel (``mixed_prefill_decode``), through ``paged_attention`` with
the provider forced and the threshold table patched. Pipelined medians of 10 samples;
both outputs are compared (relative L2 <= 1e-2) so a fast wrong route cannot win. The
smallest L at which splitting wins for every N is the backend's
``MIXED_DECODE_MIN_CONTEXT`` (metal_attn/constants.py; figures in docs/bench-h200-tiled.md).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

import metal_attn
from metal_attn.bench.candidates import pipelined_median_s
from metal_attn.bench.shapes import Rows, Shape, build_case
from metal_attn.device import current_device
from metal_attn.testing import forced_mixed_threshold
from metal_attn.testing.conformance import rel_l2

DECODE_ROWS = (8, 32, 128)
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
PREFILL = Rows(1, 512, 2048)


def _run(case, threshold: int) -> tuple[mx.array, float]:
    def call():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                          scale=case.scale, provider="tiled_prefill")

    with forced_mixed_threshold(threshold):
        out = call()
        mx.eval(out)
        route = metal_attn.diagnostics.last_dispatch().route
        assert route == ("mixed_prefill_decode" if threshold == 0 else "tiled_prefill"), route
        t = pipelined_median_s(call)
    return out, t


def main(path: str) -> None:
    backend = current_device().backend
    rows = []
    for n in DECODE_ROWS:
        for ctx in CONTEXTS:
            shape = Shape.mix((Rows(n, 1, ctx), PREFILL), 32, 8, 128)
            case = build_case(shape)
            ride, t_ride = _run(case, 1 << 30)
            split, t_split = _run(case, 0)
            err = rel_l2(split, ride)
            row = {"decode_rows": n, "context": ctx, "ride_us": t_ride * 1e6, "split_us": t_split * 1e6,
                   "split_speedup": t_ride / t_split, "rel_l2": err}
            print(json.dumps(row), flush=True)
            assert err <= 1e-2, row
            rows.append(row)
    with open(path, "w") as f:
        json.dump({"backend": backend, "prefill": [PREFILL.count, PREFILL.q_len, PREFILL.context], "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
