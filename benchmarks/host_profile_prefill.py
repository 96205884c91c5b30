"""cProfile of ``paged_attention`` on one prefill shape (not a test): where a call's host time goes.

    python3 benchmarks/host_profile_prefill.py [--shape PATTERN] [--calls N] [--provider NAME] [--pipelined]

Builds and evaluates ``N`` blocking calls under cProfile and prints the 30 most expensive
functions by cumulative time (default: the 64-row chunk after 2K of the ``prefill-gpu`` suite,
``sdpa_prefill`` forced; ``--provider auto``: the registry's choice). ``--pipelined``: the calls are
queued (``mx.async_eval``, one wait at the end, outside the profile) and sorted by own time, so
``encode``'s line (``mx.async_eval``) is MLX's host cost of encoding the call's graph. MLX's own
functions are not profiled by name: their time is their Python caller's own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import mlx.core as mx
from probe_args import prefill_suite_shape

import metal_attn
from metal_attn.bench.shapes import build_case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="q64 ")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--provider", default="sdpa_prefill")
    ap.add_argument("--pipelined", action="store_true")
    args = ap.parse_args()
    provider = None if args.provider == "auto" else args.provider
    try:
        shape = prefill_suite_shape(args.shape)
    except ValueError as exc:
        ap.error(str(exc))
    case = build_case(shape)

    def call():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale,
                                          provider=provider)

    for _ in range(5):
        mx.eval(call())
    prof = cProfile.Profile()
    prof.enable()
    def encode(out):  # its own line: MLX's functions are not profiled by name, but count in their caller's time
        (mx.async_eval if args.pipelined else mx.eval)(out)

    for _ in range(args.calls):
        encode(call())
    prof.disable()
    mx.synchronize()
    print(f"{shape.label}, provider {args.provider}, {args.calls} {'queued' if args.pipelined else 'blocking'} calls")
    pstats.Stats(prof).sort_stats("tottime" if args.pipelined else "cumulative").print_stats(30)


if __name__ == "__main__":
    main()
