"""Host time of one classic call on a GPU, next to its GPU work (a profiling aid, not a test).

    python3 benchmarks/host_cost_classic.py [BATCH CONTEXT ...]   # default: 1 4096  8 4096  32 4096

32/8 heads, head 128, bf16 decode, split route. Per call, medians (µs):

- ``trivial``: ``mx.async_eval(x * 1)`` on 16 floats, MLX's own floor for one queued op;
- ``build``: building the call's lazy graph through `metal_attn.paged_attention` (no evaluation);
- ``api``: the same call queued (``mx.async_eval``), one wait per sample: what the suite's
  pipelined figure measures;
- ``per_token`` / ``reduce``: each of the call's two kernels alone, queued the same way;
- ``layer_build`` / ``layer_queued`` / ``layer_wall``: a 32-layer decode step of a `PagedKVCache`
  (per layer, ``write_step`` then ``paged_attention`` with the step's metadata, a new step plan
  each step, as the mlx-lm adapter runs it), per layer: graph building only, building plus
  ``mx.async_eval`` of the step's outputs, and all of it plus the wait (median of 15 steps). The
  issue's target is ``layer_queued`` of about 10 µs or less at one request.

When ``api`` is well above the GPU time of the two kernels (ncu), the suite's per-call figure
measures the host, not the kernels.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from metal_attn.providers import gpu_common as gc

import metal_attn
from metal_attn.bench.candidates import pipelined_median_s
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.cache import PagedKVCache
from metal_attn.constants import PARTITION_SIZE
from metal_attn.device import current_device


def build_us(fn, calls: int = 200, reps: int = 5) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        mx.eval(outs)
    return statistics.median(samples)


def measure(batch: int, context: int) -> dict[str, float]:
    backend = current_device().backend
    case = build_case(Shape(batch, 32, 8, 128, context, "bfloat16"))
    md = case.metadata

    def api() -> mx.array:
        return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=md, scale=case.scale,
                                          provider="classic")

    mx.eval(api())
    route = metal_attn.diagnostics.last_dispatch().route
    if route != f"per_token_ps{PARTITION_SIZE}":
        raise SystemExit(f"b{batch} L{context}: classic takes route {route}; this script times the split route's "
                         "two kernels (pick a shorter grid or a longer context)")
    geo = gc.launch_geometry(case.q, case.k_pool, md, partition_size=512, backend=backend)
    parts = -(-context // PARTITION_SIZE)
    params = gc.pack_int32((md.num_seqs, 32, 8, md.max_blocks_per_seq, 0, parts, 0))
    fparams = gc.pack_scale(case.scale, None)
    x = mx.zeros((16,))
    mx.eval(x)

    def per_token() -> list[mx.array]:
        return gc.per_token_kernel(backend, True, geo)(
            inputs=[case.q, case.k_pool, case.v_pool, md.block_tables, md.seq_lens, md.cu_seqlens_q,
                    gc.zeros_f32(32), params, fparams],
            template=gc.paged_template(case.q.dtype, 128, 16, 512, geo, gc.PREFETCH_NEXT.get(backend, 0)),
            grid=(geo.grid_x(32), batch, parts), threadgroup=(geo.threads, 1, 1),
            output_shapes=[(batch, 32, parts), (batch, 32, parts), (batch, 32, parts, 128)],
            output_dtypes=[mx.float32] * 3)

    partials = per_token()
    mx.eval(partials)

    def reduce() -> mx.array:
        return gc.reduce_partitions(*partials, md, None, PARTITION_SIZE,
                                    out_dtype=case.q.dtype, backend=backend)

    return {
        "route": route,
        **step_us(batch, context),
        "trivial": pipelined_median_s(lambda: x * 1, iters=15) * 1e6,
        "build": build_us(api),
        "api": pipelined_median_s(api, iters=15) * 1e6,
        "per_token": pipelined_median_s(per_token, iters=15) * 1e6,
        "reduce": pipelined_median_s(reduce, iters=15) * 1e6,
    }


def step_us(batch: int, context: int, layers: int = 32, steps: int = 15) -> dict[str, float]:
    """Per-layer µs of a ``layers``-layer decode step over a `PagedKVCache` (medians over ``steps``)."""
    block = 16
    cache = PagedKVCache(layers, batch * (-(-(context + steps + 4) // block)) + 1, block, 8, 128, mx.bfloat16)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    cache.prepare_step([(s, context - 1) for s in seqs])  # the context, as one prefill (never computed)
    q = mx.zeros((batch, 32, 128), mx.bfloat16)
    kv = mx.zeros((batch, 8, 128), mx.bfloat16)
    mx.eval(q, kv)
    samples: dict[str, list[float]] = {"layer_build": [], "layer_queued": [], "layer_wall": []}
    for i in range(steps + 3):
        plan = cache.prepare_step([(s, 1) for s in seqs])
        t0 = time.perf_counter()
        outs = []
        for layer in range(layers):
            cache.write_step(layer, kv, kv, plan)
            k_pool, v_pool = cache.pools(layer)
            outs.append(metal_attn.paged_attention(q, k_pool, v_pool, metadata=plan.metadata, scale=128**-0.5))
        t1 = time.perf_counter()
        mx.async_eval(outs, *(cache.pools(layer) for layer in range(layers)))
        t2 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t3 = time.perf_counter()
        if i >= 3:  # warm-up steps: first compiles, first selections
            for key, t in (("layer_build", t1), ("layer_queued", t2), ("layer_wall", t3)):
                samples[key].append((t - t0) / layers * 1e6)
    return {key: statistics.median(v) for key, v in samples.items()}


def main(argv: list[str]) -> None:
    nums = [int(x) for x in argv] or [1, 4096, 8, 4096, 32, 4096]
    if len(nums) % 2:
        raise SystemExit("arguments: BATCH CONTEXT pairs")
    for batch, context in zip(nums[::2], nums[1::2]):
        res = measure(batch, context)
        route = res.pop("route")
        print(f"b{batch} h32/8 d128 L{context} ({route}), µs per call: "
              + "  ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
