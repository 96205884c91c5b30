"""What one layer's cache write costs on the GPU, by writer (not a test).

    python3 benchmarks/probe_cache_write.py OUT.json [--writes 64]

For pools of 2,048 and 32,768 pages of 16 x 8 x 128 bf16 (64 MiB and 1 GiB each) and 1, 64 and 512
new tokens, ``--writes`` writes in a row, each rebinding K and V to the write's result (as
`PagedKVCache` does), evaluated once; per write:

- ``MLX scatter``: `metal_attn.reshape_and_cache`, which on GPU backends the registry gives to the
  reference provider's in-place MLX scatter (two scatters a write, into the donated pools);
- ``whole-pool kernel``: classic's ``mx.fast`` kernel (`providers.classic.gpu.write_cache`, which
  the registry does not choose on GPUs), which makes both new pools in one pass over them.

Wall µs per write (queued writes, one evaluation) and the GPU µs of each kernel (CUPTI medians).
Needs MLX's CUDA backend and torch (CUPTI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from kernel_trace import record, summarise
from metal_attn.providers.classic import gpu as classic_gpu

import metal_attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--writes", type=int, default=64)
    args = ap.parse_args()
    dev = metal_attn.current_device()
    rows = []
    for pages in (2048, 32768):
        for tokens in (1, 64, 512):
            key = mx.ones((tokens, 8, 128), mx.bfloat16)
            slots = mx.array((np.random.default_rng(tokens).permutation(pages * 16)[:tokens]).astype(np.int64))
            mx.eval(key, slots)
            for writer in ("MLX scatter", "whole-pool kernel"):
                pools = [mx.zeros((pages, 16, 8, 128), mx.bfloat16) for _ in range(2)]
                mx.eval(pools)

                def write(pools=pools, writer=writer, key=key, slots=slots):
                    k, v = pools
                    pools.clear()
                    if writer == "whole-pool kernel":
                        out = classic_gpu.write_cache(key, key, k, v, slots, dev)
                    else:
                        out = metal_attn.reshape_and_cache(key, key, k, v, slots)
                    del k, v
                    pools.extend(out)

                def run(n, write=write, pools=pools):
                    for _ in range(n):
                        write()
                    mx.eval(pools)

                run(3)
                walls = []
                for _ in range(5):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    run(args.writes)
                    walls.append((time.perf_counter() - t0) / args.writes)
                events = record(lambda run=run: run(args.writes), cpu=False)
                last = metal_attn.diagnostics.last_cache_write().provider
                provider = "classic" if writer == "whole-pool kernel" else last
                kernels = {k["name"][:60]: {"median_us": k["median_us"], "per_write": k["launches_per_call"]}
                           for k in summarise(events, args.writes, 1)["kernels"]}
                gpu_us = sum(k["median_us"] * k["per_write"] for k in kernels.values())
                row = {"pages": pages, "pool_mib": pages * 16 * 8 * 128 * 2 / 2**20, "tokens": tokens, "writer": writer,
                       "provider": provider, "wall_us": statistics.median(walls) * 1e6, "gpu_us": gpu_us,
                       "kernels": kernels}
                rows.append(row)
                print(f"pool {row['pool_mib']:6.0f} MiB tokens {tokens:4d} {writer:18s} ({provider:9s}) wall "
                      f"{row['wall_us']:8.1f} us  gpu {gpu_us:8.1f} us | "
                      + "; ".join(f"{n[:30]} {k['median_us']:.1f}x{k['per_write']:g}" for n, k in kernels.items()),
                      flush=True)
                del pools
                mx.clear_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
