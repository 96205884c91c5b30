"""cProfile of ``paged_attention`` on one prefill shape (not a test): where a call's host time goes.

    python3 benchmarks/host_profile_prefill.py [--shape PATTERN] [--calls N] [--provider NAME]

Builds and evaluates ``N`` blocking calls under cProfile and prints the 30 most expensive
functions by cumulative time (default: the 64-row chunk after 2K of the ``prefill-gpu`` suite,
``sdpa_prefill`` forced).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import mlx.core as mx

import metal_attn
from metal_attn.bench.core import build_case
from metal_attn.bench.suites import get_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="q64 ")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--provider", default="sdpa_prefill")
    args = ap.parse_args()
    shape = get_suite("prefill-gpu").select([args.shape])[0]
    case = build_case(shape)

    def call():
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale,
                                          provider=args.provider)

    for _ in range(5):
        mx.eval(call())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        mx.eval(call())
    prof.disable()
    print(f"{shape.label}, provider {args.provider}, {args.calls} blocking calls")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
