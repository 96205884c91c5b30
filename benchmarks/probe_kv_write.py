"""What one decode token's K (or V) write costs on the GPU, by the ways MLX can write it (not a test).

    python3 benchmarks/probe_kv_write.py OUT.json [--calls 30] [--blocks 2048]

A single stream writes one token of ``[kv_heads, head]`` per layer into K and into V. Stock
mlx-lm's `KVCache` does it with a slice assignment at a Python offset (a copy kernel); the paged
cache scatters to a slot (`metal_attn.provider.scatter_slots`), because the slot is data.
Each row is the median GPU time of the kernels one write launches (CUPTI, `kernel_trace`), every
write in place on a donated buffer (a copy of the pool would show as a kernel or memcpy of its own):

- ``scatter, slot padded``: the shipped write (the slot a view of a 16-byte buffer);
- ``scatter, slot in the small pool``: the slot a 4-byte array (MLX CUDA's small-allocation pool);
- ``scatter, rows as [n, kv_heads * head]``: the same on a 2-D view of the pool;
- ``scatter, K and V as one pool``: one scatter into ``[slots, 2, kv_heads, head]`` for both
  (what a combined pool would cost, for both writes);
- ``slice_update, static offset``: mlx-lm's `KVCache` write (the offset baked into the graph);
- ``slice_update, dynamic offset``: `mx.slice_update` with the offset an array (traceable).
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
import numpy as np


def _medians(events: list[dict]) -> dict[str, float]:
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"][:70], []).append(float(e["dur"]))
    return {n: round(statistics.median(d), 2) for n, d in by_name.items()}


def main() -> None:
    from kernel_trace import trace

    from metal_attn.host_arrays import device_array
    from metal_attn.provider import scatter_slots

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=2048, help="pages of 16 tokens in the pool")
    args = ap.parse_args()
    kvh, head, bs = 8, 128, 16
    slots_total = args.blocks * bs
    slot = slots_total // 3 + 5
    rows: list[dict] = []
    row = mx.random.normal((1, kvh, head)).astype(mx.bfloat16)
    mx.eval(row)

    def measure(label: str, make, write, read) -> None:
        written = write(make())
        assert mx.array_equal(read(written), row[0]).item(), f"{label}: the token is not where it was written"
        del written
        state = {"pool": make()}
        mx.eval(state["pool"])

        def once():
            state["pool"] = write(state.pop("pool"))
            return state["pool"]

        kernels = _medians(trace(once, args.calls))
        rows.append({"label": label, "kernel_median_us": kernels, "total_us": round(sum(kernels.values()), 2)})
        print(f"{label:40s} total {sum(kernels.values()):6.2f}us  "
              + "  ".join(f"{n[:50]} {us:.2f}" for n, us in kernels.items()), flush=True)

    def pool4():
        return mx.zeros((args.blocks, bs, kvh, head), dtype=mx.bfloat16)

    padded = device_array([slot], np.int32)
    small = mx.array([slot], dtype=mx.int32)
    mx.eval(padded, small)
    at_slot = lambda p: p.reshape(slots_total, kvh, head)[slot]  # noqa: E731
    measure("scatter, slot padded", pool4, lambda p: scatter_slots(p, row, padded), at_slot)
    measure("scatter, slot in the small pool", pool4, lambda p: scatter_slots(p, row, small), at_slot)

    def flat2(p):
        f = p.reshape(slots_total, kvh * head)
        f[padded] = row.reshape(1, kvh * head)
        return f.reshape(args.blocks, bs, kvh, head)

    measure("scatter, rows as [n, kv_heads * head]", pool4, flat2, at_slot)
    both = mx.stack([row, row], axis=1)  # [1, 2, kvh, head]
    mx.eval(both)

    def kv_pool(p):
        p[padded] = both
        return p

    measure("scatter, K and V as one pool", lambda: mx.zeros((slots_total, 2, kvh, head), dtype=mx.bfloat16),
            kv_pool, lambda p: p[slot, 1])
    # mlx-lm's KVCache layout: [batch, kv_heads, steps, head], the token at a Python offset.
    upd = row.reshape(1, kvh, 1, head)
    mx.eval(upd)

    def static(p):
        p[..., slot : slot + 1, :] = upd
        return p

    contiguous = lambda: mx.zeros((1, kvh, slots_total, head), dtype=mx.bfloat16)  # noqa: E731
    in_steps = lambda p: p[0, :, slot, :]  # noqa: E731
    measure("slice_update, static offset", contiguous, static, in_steps)
    start = device_array([0, 0, slot, 0], np.int32)
    mx.eval(start)
    measure("slice_update, dynamic offset", contiguous,
            lambda p: mx.slice_update(p, upd, start_indices=start, axes=(0, 1, 2, 3)), in_steps)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
