"""Where splitting the tiled kernel's keys pays, and against the gathered-SDPA route (not a test).

The measurements behind ``providers/tiled_prefill.py``'s ``TILED_SPLIT_RULES`` and, on CUDA, the
``min_chunk_pairs`` of ``SDPA_PREFILL_RULES``: prefill chunks after context (32/8 heads, head 128,
bf16, block 16, one sequence unless marked) through ``paged_attention(provider="tiled_prefill")``
unsplit, split at each partition size and at the rule's choice, and through ``sdpa_prefill`` with
its rule opened to every chunk. Per variant: the median wall time of a blocking call (the
``prefill-gpu`` suite's blocking measure; ``--pipelined``: of a queued call, one wait per sample of
at least 50 ms, as in the suite's ``--pipelined`` runs; `metal_attn.bench.timing.time_calls`) and
the GPU busy time of five traced calls (CUPTI through torch, `kernel_trace`; skipped without torch).

    python3 benchmarks/probe_tiled_split.py OUT.json [--chunks Q:L[:N],...] [--pipelined]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import mlx.core as mx

import metal_attn
from metal_attn import diagnostics
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.bench.timing import time_calls
from metal_attn.device import current_device
from metal_attn.errors import ProviderRefusedError
from metal_attn.settings import override_settings
from metal_attn.testing.overrides import opened_sdpa_prefill_rule

#: (query rows, context, sequences): verification windows, short chunks, the suite's q64 after 2K,
#: and longer chunks where the tiles fill the GPU without a split.
CHUNKS = ((4, 4096, 1), (16, 4096, 1), (4, 2048, 8), (32, 2048, 1), (64, 2112, 1), (128, 4096, 1), (256, 4096, 1),
          (512, 8192, 1), (1024, 8192, 1))
#: (label, settings, scope, provider)
VARIANTS = (
    ("unsplit", {"tiled_partition_size": -1}, contextlib.nullcontext, "tiled_prefill"),
    ("ps128", {"tiled_partition_size": 128}, contextlib.nullcontext, "tiled_prefill"),
    ("ps256", {"tiled_partition_size": 256}, contextlib.nullcontext, "tiled_prefill"),
    ("ps512", {"tiled_partition_size": 512}, contextlib.nullcontext, "tiled_prefill"),
    ("rule", {"tiled_partition_size": 0}, contextlib.nullcontext, "tiled_prefill"),
    ("sdpa_prefill", {}, opened_sdpa_prefill_rule, "sdpa_prefill"),
)


def _parse(text: str) -> tuple[tuple[int, int, int], ...]:
    out = []
    for item in text.split(","):
        try:
            parts = [int(x) for x in item.split(":")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or min(parts) < 1 or parts[0] > parts[1]:
            raise argparse.ArgumentTypeError(f"--chunks item {item!r} (allowed: Q:L or Q:L:N, positive integers, "
                                             "Q rows at most L tokens of context)")
        out.append((*parts, 1)[:3])
    return tuple(out)


def _busy_us(fn) -> float | None:
    """The GPU busy time of five traced calls, or ``None`` without torch (the wall time stands alone)."""
    from kernel_trace import summarise, trace

    try:
        import torch  # noqa: F401  (the tracer's CUPTI)
    except ImportError:
        return None
    return summarise(trace(fn, calls=5), 5, 0)["busy_us_per_call"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--chunks", type=_parse, default=CHUNKS, help="Q:L[:N],... (query rows, context, sequences)")
    ap.add_argument("--pipelined", action="store_true",
                    help="time queued calls, one wait per sample (default: every call waited for)")
    args = ap.parse_args()
    rows = []
    for q_len, ctx, n in args.chunks:
        shape = Shape(n, 32, 8, 128, ctx, "bfloat16", q_len=q_len)
        case = build_case(shape)
        entry = {"q_len": q_len, "context": ctx, "seqs": n, "tflop": shape.flops / 1e12}
        for label, settings, scope, provider in VARIANTS:
            def call(p=provider, c=case):
                return metal_attn.paged_attention(c.q, c.k_pool, c.v_pool, metadata=c.metadata, scale=c.scale,
                                                  provider=p)

            with override_settings(**settings), scope():
                try:
                    mx.eval(call())
                except ProviderRefusedError as exc:  # sdpa_prefill takes no verification batches
                    entry[label] = {"refused": str(exc).splitlines()[-1].strip()}
                    continue
                route = diagnostics.last_dispatch().route
                wall = time_calls(call, pipelined=args.pipelined, warmup=3, iters=7).median_s * 1e3
                busy = _busy_us(call)
            entry[label] = {"route": route, "wall_ms": wall, "busy_us": busy,
                            "tflops_wall": shape.flops / (wall * 1e-3) / 1e12}
        rows.append(entry)
        timed = {k: v for k, v in entry.items() if isinstance(v, dict) and "wall_ms" in v}
        best = min(timed, key=lambda k: timed[k]["wall_ms"])
        cells = "  ".join(f"{k} {v['wall_ms']:.3f}" + (f"/{v['busy_us']:.0f}us" if v["busy_us"] else "")
                          for k, v in timed.items())
        print(f"q{q_len:<5d} L{ctx:<6d} x{n}: {cells}  | fastest {best} ({entry['rule']['route']} by the rule)",
              flush=True)
        del case
    with open(args.out, "w") as f:
        json.dump({"device": current_device().describe(), "mode": "pipelined" if args.pipelined else "blocking",
                   "chunks": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
