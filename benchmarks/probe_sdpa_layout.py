"""Whether the query's layout changes MLX's fused SDPA time on a prefill chunk (not a test): issue #18.

    python3 benchmarks/probe_sdpa_layout.py OUT.json [--rows 2048] [--context 4096]

The gathered-SDPA route (``providers/sdpa_prefill.py``) hands MLX's fused SDPA the chunk's queries as
a transposed view of the packed rows (``[1, L, H, D]`` read as ``[1, H, L, D]``), so its output comes
back in packed row order without a copy; the bench's peer passes contiguous ``[1, H, L, D]`` queries.
On the H200 (twenty-fifth session) cuDNN took 221 us on the route's 2,048 x 4,096 chunk against 195 on
the peer's. Here, in one process, one chunk (32/8 heads, head 128, bf16, causal, keys contiguous
``[1, KVH, S, D]``), the GPU time of each kernel (CUPTI, `kernel_trace`) and the wall time of:

- ``view``: the route's call (queries a transposed view, output transposed back: no copy);
- ``contiguous``: the peer's call (queries contiguous ``[1, H, L, D]``, output as it comes);
- ``copied``: the route's queries copied to ``[1, H, L, D]`` first and the output copied back to
  packed rows, so the copies' cost is counted.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from kernel_trace import profile_call, top_kernels


def variants(rows: int, context: int, heads: int = 32, kv_heads: int = 8, head: int = 128):
    """(label, fn) for the three layouts of one causal chunk of ``rows`` queries after ``context - rows`` keys."""
    mx.random.seed(0)
    packed = mx.random.normal((rows, heads, head)).astype(mx.bfloat16)  # the route's packed rows
    k = mx.random.normal((1, kv_heads, context, head)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, context, head)).astype(mx.bfloat16)
    q_contig = mx.contiguous(packed.reshape(1, rows, heads, head).transpose(0, 2, 1, 3))
    mx.eval(packed, k, v, q_contig)
    scale = head ** -0.5

    def sdpa(q):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def view():
        return sdpa(packed.reshape(1, rows, heads, head).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3).reshape(
            rows, heads, head)

    def contiguous():
        return sdpa(q_contig)

    def copied():
        q = mx.contiguous(packed.reshape(1, rows, heads, head).transpose(0, 2, 1, 3))
        return mx.contiguous(sdpa(q).transpose(0, 2, 1, 3)).reshape(rows, heads, head)

    return [("view", view), ("contiguous", contiguous), ("copied", copied)], 2 * kv_heads * context * head * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    if args.rows < 1 or args.context < args.rows:
        ap.error(f"--rows {args.rows} / --context {args.context}: need 1 <= rows <= context")
    fns, kv_bytes = variants(args.rows, args.context)
    ref = None
    results = []
    for label, fn in fns:
        out = fn()
        if out.ndim == 4:  # the contiguous call's [1, H, L, D], compared in packed row order ("view" is first)
            out = out.transpose(0, 2, 1, 3).reshape(ref.shape)
        mx.eval(out)
        if ref is None:
            ref = out
        diff = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))).item())
        row = {"layout": label, "max_abs_diff_vs_view": diff, **profile_call(fn, kv_bytes)}
        results.append(row)
        print(f"{label:>10}: wall {row['wall_ms'] * 1e3:7.1f} us, gpu {row['gpu_us_per_call']:7.1f} us, "
              f"diff {diff:.3g}; {top_kernels(row, 3, 60)}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": args.rows, "context": args.context, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
