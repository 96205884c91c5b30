"""Whether a mixed batch's decode rows should run on a second GPU stream: the evidence behind
``providers/gpu_common.DECODE_ROWS_STREAM_RULES``.

A mixed batch's decode rows leave the prefill kernel for the per-token kernel (bandwidth-bound);
its chunks go through the tiles or through gathered pages and cuDNN (compute-bound). On one stream
the two run one after the other; with ``METAL_ATTN_DECODE_ROWS_STREAM=1`` the rows are queued on a
second stream and can overlap the chunks. For each batch and route (``sdpa_prefill_decode`` with
its rule opened, and the tiles' ``mixed_prefill_decode``) this times both settings in the same
process, in alternating rounds (a drift of the machine lands on both), every call waited for
(``--pipelined``: queued, one wait per sample of at least 50 ms), and checks that both give the same bytes.

Usage (GPU): ``python benchmarks/probe_decode_rows_stream.py OUT.json [--pipelined] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn.bench.shapes import Rows, Shape, build_case
from metal_attn.bench.timing import time_calls
from metal_attn.settings import override_settings
from metal_attn.testing.overrides import opened_sdpa_prefill_rule

#: (decode rows, their context), then the chunks as (rows, sequence length): the prefill-gpu suite's
#: three batches and probe_sdpa_fused.py's mixed batches around them.
BATCHES = (
    ((8, 4096), ((512, 2048),)),
    ((32, 1024), ((256, 1024), (256, 2048))),
    ((8, 4096), ((2048, 4096),)),
    ((8, 4096), ((32, 2048),)),
    ((8, 4096), ((128, 2048),)),
    ((8, 4096), ((1024, 4096),)),
    ((32, 1024), ((32, 1024),)),
    ((32, 1024), ((128, 2048),)),
    ((32, 1024), ((1024, 2048),)),
    ((64, 8192), ((512, 8192),)),
    ((1, 32768), ((2048, 2048),)),
)


def _case(batch):
    (dec, ctx), chunks = batch
    return build_case(Shape.mix((Rows(dec, 1, ctx), *(Rows(1, q, s) for q, s in chunks)), 32, 8, 128))


def _timed(case, provider: str, on: bool, pipelined: bool) -> tuple[float, np.ndarray, str]:
    def call():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale,
                                          provider=provider)

    with override_settings(decode_rows_stream=on):
        out = call()
        mx.eval(out)
        route = metal_attn.diagnostics.last_dispatch().route
        t = time_calls(call, pipelined=pipelined, warmup=3, iters=15)
    return t.median_s * 1e6, np.array(out.astype(mx.float32)), route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="write the measurements here")
    ap.add_argument("--pipelined", action="store_true", help="queued calls, one wait per sample")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of off/on per batch and route")
    args = ap.parse_args()
    rows = []
    for batch in BATCHES:
        case = _case(batch)
        for provider in ("sdpa_prefill", "tiled_prefill"):
            times = {False: [], True: []}
            outs, routes = {}, {}
            with opened_sdpa_prefill_rule():  # once around all rounds: the plan is kept between calls
                for _ in range(args.rounds):
                    for on in (False, True):
                        us, outs[on], routes[on] = _timed(case, provider, on, args.pipelined)
                        times[on].append(us)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            r = {"label": case.shape.label, "provider": provider, "route": routes[True], "off_us": times[False],
                 "on_us": times[True], "speedup": off / on, "same_bytes": bool(np.array_equal(outs[False], outs[True]))}
            rows.append(r)
            print(f"{r['label']:56s} {routes[True]:22s} one stream {off:8.1f} us  two {on:8.1f} us  "
                  f"{r['speedup']:5.2f}x  rounds {[round(a / b, 2) for a, b in zip(times[False], times[True])]}"
                  f"{'' if r['same_bytes'] else '  BYTES DIFFER'}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": mx.device_info().get("device_name"), "mlx": mx.__version__,
                   "mode": "pipelined" if args.pipelined else "blocking", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
