"""Whether one masked MLX SDPA call can stand in for a mixed batch's several runs of chunks (not a test): #18.

    python3 benchmarks/probe_sdpa_bias.py OUT.json [--runs 256@1024,256@2048] [--heads 32/8] [--head 128]

The prefill suite's second mixed batch is host-bound (docs/bench-h200-prefill.md, forty-eighth session:
busy 92 µs a call for 0.19-0.35 ms of queued wall time), and each of its runs of chunks is a fused SDPA
call of its own, since the runs' contexts differ (256 rows after 1,024 and after 2,048 keys). MLX 0.32.4's
CUDA SDPA hands an array mask to cuDNN as its bias tensor (upstream's ``sdpa_cudnn``; the library holds the
``BIAS`` name), so runs of one query length could be one call: their keys and values padded with zeros to
the longest context, the mask keeping each run's own bottom-right causal pairs. One MLX operation a run
fewer, against a mask to read and the padded pairs to compute. Before building that, this measures it
on random bf16 data, in one process, with the queries as the route holds them (packed rows, each call taking
a view of them and giving its output back as packed rows):

- ``per_run``: one causal call per run (what `providers/sdpa_prefill.py` does);
- ``masked``: one call over the runs stacked, with an additive mask, 0 where a pair is attended and -inf
  elsewhere, broadcast over the heads and evaluated once outside the timed calls (as a route would build it
  once per metadata). A boolean mask is not probed: on CUDA, MLX turns it into an additive one of the full
  ``[runs, heads, rows, keys]`` shape on every call.

Both go through ``force_fused`` (as the route does), so a configuration cuDNN refuses is an error here, not
MLX's unfused fallback timed by mistake. Per variant, in ``--rounds`` interleaved rounds: the blocking and
the queued time of a call (`metal_attn.bench.timing.time_calls`, as the suites time them), and once
CUPTI's kernels (`kernel_trace`: which kernel cuDNN chose, the GPU's busy time) and the host's build time.
The largest difference from ``per_run`` over every row is checked: above `TOLERANCE` the probe exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
from kernel_trace import profile_call, top_kernels

from metal_attn.bench.timing import time_calls

#: The largest difference from ``per_run`` the masked call may show (bf16 outputs of magnitude below 1).
TOLERANCE = 2e-2


def parse_runs(text: str) -> list[tuple[int, int]]:
    """``"256@1024,256@2048"`` -> [(256, 1024), (256, 2048)]: (query rows, keys including them) per run."""
    runs = []
    for part in text.split(","):
        rows, _, keys = part.partition("@")
        if not (rows.isdigit() and keys.isdigit()) or not 1 <= int(rows) <= int(keys):
            raise ValueError(f"--runs part {part!r} (allowed: ROWS@KEYS with 1 <= ROWS <= KEYS, e.g. 256@1024)")
        runs.append((int(rows), int(keys)))
    if len(runs) < 2 or len({r for r, _ in runs}) != 1:
        raise ValueError(f"--runs {text!r} (allowed: two or more runs of one query length, e.g. 256@1024,256@2048)")
    return runs


def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> (32, 8): query heads and KV heads, the first a multiple of the second."""
    q, _, kv = text.partition("/")
    if not (q.isdigit() and kv.isdigit()) or int(kv) < 1 or int(q) % int(kv):
        raise ValueError(f"--heads {text!r} (allowed: QUERY/KV heads, QUERY a multiple of KV, e.g. 32/8)")
    return int(q), int(kv)


def attended(runs: list[tuple[int, int]]) -> mx.array:
    """``[runs, 1, rows, longest]`` booleans: row ``r`` of a run with ``keys`` keys attends key ``j`` where
    ``j <= keys - rows + r`` (bottom-right causal within the run's own keys; the padding never)."""
    rows, longest = runs[0][0], max(k for _, k in runs)
    r = mx.arange(rows).reshape(1, 1, rows, 1)
    j = mx.arange(longest).reshape(1, 1, 1, longest)
    last = mx.array([k - rows for _, k in runs]).reshape(len(runs), 1, 1, 1) + r
    return j <= last


def operands(runs: list[tuple[int, int]], heads: int, kv_heads: int, head: int):
    """Random bf16 operands (seed 0): per run ``q [1, H, rows, D]``, ``k`` and ``v [1, KVH, keys, D]``; and the
    runs stacked, K and V padded with zeros to the longest run's keys."""
    mx.random.seed(0)
    rows, longest = runs[0][0], max(k for _, k in runs)
    qs = [mx.random.normal((1, heads, rows, head)).astype(mx.bfloat16) for _ in runs]
    ks = [mx.random.normal((1, kv_heads, k, head)).astype(mx.bfloat16) for _, k in runs]
    vs = [mx.random.normal((1, kv_heads, k, head)).astype(mx.bfloat16) for _, k in runs]
    pad = [((0, 0), (0, 0), (0, longest - k), (0, 0)) for _, k in runs]
    stacked = (mx.concatenate(qs, axis=0), mx.concatenate([mx.pad(k, p) for k, p in zip(ks, pad)], axis=0),
               mx.concatenate([mx.pad(v, p) for v, p in zip(vs, pad)], axis=0))
    return (qs, ks, vs), stacked


def variants(runs: list[tuple[int, int]], heads: int, kv_heads: int, head: int, *, force_fused: bool = True):
    """(label, fn) for the two variants, each giving packed rows (``per_run`` a list, one array a run), and the
    K+V bytes the runs read. ``force_fused=False`` lets MLX's CPU backend run them (the tests)."""
    (_, ks, vs), (q_all, k_all, v_all) = operands(runs, heads, kv_heads, head)
    rows = runs[0][0]
    packed = mx.contiguous(q_all.transpose(0, 2, 1, 3)).reshape(len(runs) * rows, heads, head)
    mask = attended(runs)
    additive = mx.broadcast_to(mx.where(mask, mx.array(0.0, mx.bfloat16), mx.array(-float("inf"), mx.bfloat16)),
                               (len(runs), heads, rows, mask.shape[-1]))
    mx.eval(*ks, *vs, k_all, v_all, packed, additive)
    scale = head ** -0.5

    def sdpa(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, force_fused=force_fused)

    def per_run():  # the route's calls: a view of each run's rows in, its rows out, no concatenation
        return [sdpa(packed[i * rows:(i + 1) * rows].reshape(1, rows, heads, head).transpose(0, 2, 1, 3),
                     k, v, "causal").transpose(0, 2, 1, 3).reshape(rows, heads, head)
                for i, (k, v) in enumerate(zip(ks, vs))]

    def masked():
        q = packed.reshape(len(runs), rows, heads, head).transpose(0, 2, 1, 3)
        return sdpa(q, k_all, v_all, additive).transpose(0, 2, 1, 3).reshape(len(runs) * rows, heads, head)

    kv_bytes = sum(2 * kv_heads * k * head * 2 for _, k in runs)
    return [("per_run", per_run), ("masked", masked)], kv_bytes


def stacked_output(out) -> mx.array:
    """A variant's output as one ``[runs * rows, H, D]`` array of packed rows (``per_run`` gives one a run)."""
    return mx.concatenate(out, axis=0) if isinstance(out, list) else out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--runs", default="256@1024,256@2048", help="ROWS@KEYS per run, one query length (default: "
                                                                "the suite's second mixed batch)")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads (default 32/8)")
    ap.add_argument("--head", type=int, default=128, help="head size, a multiple of 8 (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    args = ap.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
        heads, kv_heads = parse_heads(args.heads)
    except ValueError as exc:
        ap.error(str(exc))
    if args.head < 8 or args.head % 8:
        ap.error(f"--head {args.head} (allowed: a positive multiple of 8, as cuDNN's SDPA takes)")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} (allowed: 1 or more)")
    fns, kv_bytes = variants(runs, heads, kv_heads, args.head)
    ref = stacked_output(fns[0][1]()).astype(mx.float32)
    mx.eval(ref)
    results = {}
    for label, fn in fns:
        diff = float(mx.max(mx.abs(stacked_output(fn()).astype(mx.float32) - ref)).item())
        results[label] = {"variant": label, "max_abs_diff_vs_per_run": diff, "blocking_us": [], "queued_us": [],
                          **profile_call(fn, kv_bytes)}
    for r in range(args.rounds):  # interleaved, the order turned each round
        for label, fn in fns[::-1] if r % 2 else fns:
            results[label]["blocking_us"].append(time_calls(fn, pipelined=False).median_s * 1e6)
            results[label]["queued_us"].append(time_calls(fn, pipelined=True).median_s * 1e6)
    for row in results.values():
        print(f"{row['variant']:>8}: queued {_us(row['queued_us'])}, blocking {_us(row['blocking_us'])}, build "
              f"{row['build_ms'] * 1e3:5.1f} us, busy {row['busy_us_per_call']:6.1f} us, diff "
              f"{row['max_abs_diff_vs_per_run']:.3g}; {top_kernels(row, 3, 60)}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"runs": args.runs, "heads": args.heads, "head": args.head, "tolerance": TOLERANCE,
                   "results": list(results.values())}, f, indent=1)
    bad = [row["variant"] for row in results.values() if not row["max_abs_diff_vs_per_run"] <= TOLERANCE]
    if bad:
        print(f"probe_sdpa_bias: {', '.join(bad)} differs from per_run by more than {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


def _us(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) + " us"


if __name__ == "__main__":
    sys.exit(main())
