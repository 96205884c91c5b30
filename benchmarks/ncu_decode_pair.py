"""One decode shape, ours or the anchor's, called a few times for a profiler to compare (not a test).

    ncu --csv --kernel-name regex:'paged_attention|flash|fmha|sdpa|lean_reduction' --launch-skip 6 \\
        --launch-count 2 python3 benchmarks/ncu_decode_pair.py ours|torch BATCH HEADS KV_HEADS HEAD_SIZE CONTEXT [CALLS]

``ours``: ``metal_attn.paged_attention`` with the registry's choice (what a user runs) over 16-token
pages in a shuffled block table; ``torch``: torch SDPA on contiguous K/V with ``enable_gqa`` (the
peer of the decode suites). bfloat16, one query row per sequence, ``CALLS`` calls (default 4), each
waited for, so a profiler's ``--launch-skip`` can pass the first calls' compilation and warm-up (each
call is two kernels on both sides, a split kernel and its reduction: skip 6, count 2 is the fourth call).
`benchmarks/device/session.sh ncu` runs both sides at the shapes issue #17 still misses.
"""

from __future__ import annotations

import sys

import numpy as np

BLOCK_SIZE = 16


def ours(batch: int, heads: int, kv_heads: int, head: int, context: int, calls: int) -> None:
    import mlx.core as mx

    import metal_attn as ma

    pages = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages + 8
    table = np.random.default_rng(0).permutation(num_blocks)[: batch * pages].astype(np.int32).reshape(batch, pages)
    k = mx.random.normal((num_blocks, BLOCK_SIZE, kv_heads, head)).astype(mx.bfloat16)
    v = mx.random.normal((num_blocks, BLOCK_SIZE, kv_heads, head)).astype(mx.bfloat16)
    q = mx.random.normal((batch, heads, head)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    md = ma.AttentionMetadata.build(table, [context] * batch, list(range(batch + 1)))
    for _ in range(calls):
        mx.eval(ma.paged_attention(q, k, v, metadata=md))
    mx.synchronize()
    print(f"ours: {ma.diagnostics.last_dispatch()}", file=sys.stderr)


def torch_sdpa(batch: int, heads: int, kv_heads: int, head: int, context: int, calls: int) -> None:
    import torch

    q = torch.randn(batch, heads, 1, head, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, context, head, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, context, head, device="cuda", dtype=torch.bfloat16)
    for _ in range(calls):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()


SIDES = {"ours": ours, "torch": torch_sdpa}


def main(argv: list[str]) -> int:
    if len(argv) not in (6, 7) or argv[0] not in SIDES:
        print(__doc__, file=sys.stderr)
        return 2
    numbers = [int(x) for x in argv[1:]]
    if min(numbers) < 1 or numbers[1] % numbers[2]:
        print(f"BATCH HEADS KV_HEADS HEAD_SIZE CONTEXT [CALLS]={argv[1:]}: positive integers with HEADS a "
              f"multiple of KV_HEADS", file=sys.stderr)
        return 2
    batch, heads, kv_heads, head, context = numbers[:5]
    SIDES[argv[0]](batch, heads, kv_heads, head, context, numbers[5] if len(numbers) > 5 else 4)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
