"""Whether one masked MLX SDPA call can stand in for a mixed batch's several runs of chunks (not a test): #18.

    python3 benchmarks/probe_sdpa_bias.py OUT.json [--runs 256@1024,256@2048] [--heads 32/8] [--head 128]

The prefill suite's second mixed batch is host-bound (docs/bench-h200-prefill.md, forty-eighth session:
busy 92 µs a call for 0.19-0.35 ms of queued wall time), and each of its runs of chunks is a fused SDPA
call of its own, since the runs' contexts differ (256 rows after 1,024 and after 2,048 keys). MLX 0.32.4's
CUDA SDPA hands an array mask to cuDNN as its bias tensor (upstream's ``sdpa_cudnn``; the library holds the
``BIAS`` name), so runs of one query length could be one call: their keys and values padded with zeros to
the longest context, the mask keeping each run's own bottom-right causal pairs. One MLX operation a run
fewer, against a mask to read and the padded pairs to compute. Before building that, this measures it
on random bf16 data, in one process:

- ``per_run``: one causal call per run (what `providers/sdpa_prefill.py` does);
- ``additive``: one call over the runs stacked, the mask 0 where a pair is attended and -inf elsewhere;
- ``boolean``: the same with a boolean mask (True: attended).

Per variant: the largest difference from ``per_run`` over every row, the blocking and the queued time of a
call (`metal_attn.bench.timing.time_calls`, as the suites time them), and CUPTI's kernels (`kernel_trace`:
which kernel cuDNN chose, the GPU's busy time). The masks are built once, outside the timed calls, as a
route would build them once per metadata.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
from kernel_trace import profile_call, top_kernels

from metal_attn.bench.timing import time_calls


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


def variants(runs: list[tuple[int, int]], heads: int, kv_heads: int, head: int):
    """(label, fn) for the three variants, and the K+V bytes the runs read."""
    (qs, ks, vs), (q_all, k_all, v_all) = operands(runs, heads, kv_heads, head)
    keep = attended(runs)
    additive = mx.where(keep, mx.array(0.0, mx.bfloat16), mx.array(-float("inf"), mx.bfloat16))
    mx.eval(*qs, *ks, *vs, q_all, k_all, v_all, keep, additive)
    scale = head ** -0.5

    def per_run():  # a list, as the route's calls are: no concatenation timed
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
                for q, k, v in zip(qs, ks, vs)]

    def masked(mask):
        return lambda: mx.fast.scaled_dot_product_attention(q_all, k_all, v_all, scale=scale, mask=mask)

    kv_bytes = sum(2 * kv_heads * k * head * 2 for _, k in runs)
    return [("per_run", per_run), ("additive", masked(additive)), ("boolean", masked(keep))], kv_bytes


def stacked_output(out) -> mx.array:
    """A variant's output as ``[runs, H, rows, D]`` (``per_run`` gives one array a run)."""
    return mx.concatenate(out, axis=0) if isinstance(out, list) else out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--runs", default="256@1024,256@2048", help="ROWS@KEYS per run, one query length (default: "
                                                                "the suite's second mixed batch)")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads (default 32/8)")
    ap.add_argument("--head", type=int, default=128, help="head size (default 128)")
    args = ap.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
        heads, kv_heads = parse_heads(args.heads)
    except ValueError as exc:
        ap.error(str(exc))
    fns, kv_bytes = variants(runs, heads, kv_heads, args.head)
    ref = stacked_output(fns[0][1]()).astype(mx.float32)
    mx.eval(ref)
    results = []
    for label, fn in fns:
        diff = float(mx.max(mx.abs(stacked_output(fn()).astype(mx.float32) - ref)).item())
        queued = time_calls(fn, pipelined=True).median_s
        row = {"variant": label, "max_abs_diff_vs_per_run": diff, "queued_us": queued * 1e6,
               **profile_call(fn, kv_bytes)}
        results.append(row)
        print(f"{label:>9}: queued {queued * 1e6:7.1f} us, blocking {row['wall_ms'] * 1e3:7.1f} us, build "
              f"{row['build_ms'] * 1e3:5.1f} us, busy {row['busy_us_per_call']:6.1f} us, diff {diff:.3g}; "
              f"{top_kernels(row, 3, 60)}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"runs": args.runs, "heads": args.heads, "head": args.head, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
