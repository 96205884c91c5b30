"""The host's share of a compiled 32-layer decode step, before and while the GPU gets it (not a test): issue #17.

    python3 benchmarks/probe_step_host.py [--shapes b8:32:8:128:4096,...] [--steps 30] [--queued]

A blocking step (`mx.eval` of the compiled step, as the decode-step suite waits for one) leaves the GPU
idle from the end of one step to the first kernel of the next; torch launches its first kernel as its
Python call runs. Per shape (batch:heads:kv_heads:head_size:context, bf16, 16-token pages) and per
step, with the GPU idle before it (`mx.synchronize()`), this times apart:

- ``build``: the compiled step's call, which builds the 32 chained layers' graph before any evaluation;
- ``queue``: `mx.async_eval` of it, MLX's encoding and the graph launches (the chains' idle-GPU and
  launch-ahead commits, counted by `metal_attn.cuda_ops.idle_commits`, included);
- ``tiny``: one evaluation of a compiled trivial function, MLX's floor for an evaluation.

Medians over ``--steps`` steps, in µs a step. ``--queued`` times the steps queued back to back instead, one
wait after the last, as the engine runs them (the GPU busy while the host builds and encodes). There
``queue`` is not the host's work: MLX's ``async_eval`` waits for the GPU once about a step is in flight, so
it reads the GPU's step time (1,733-1,738 µs at b8 L4096 on an H100, forty-second session), which shows
that the host stays about one step ahead and no further. Needs MLX's CUDA backend and the CUDA chains'
module.
"""

from __future__ import annotations

import argparse
import statistics
import time

from probe_args import decode_shapes
from probe_mixed_host import host_split

STEP_LAYERS = 32
SHAPES = ((8, 32, 8, 128, 4096), (16, 16, 2, 128, 16384), (1, 32, 8, 128, 32768))


def measure(spec: tuple[int, ...], steps: int, queued: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """``build``, ``queue`` and ``tiny`` (µs a step, medians), and the chains' commits a step by kind, for one
    shape."""
    import mlx.core as mx

    import metal_attn
    from metal_attn import cuda_ops
    from metal_attn.bench.decode_step import chain
    from metal_attn.bench.shapes import Shape, build_case

    case = build_case(Shape(*spec, "bfloat16"), seed=spec[-1])
    try:
        def layer(x, _):
            return metal_attn.paged_attention(x, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale)

        step = mx.compile(lambda: chain(case.q, range(STEP_LAYERS), layer))
        tiny = mx.compile(lambda: case.q * 1.5)
        for _ in range(5):  # the trace, the kernels' builds and the graph cache
            mx.eval(step(), tiny())
        before = cuda_ops.idle_commits() or {}  # None without the CUDA chains' module
        build, queue = host_split(step, steps, sync_every=steps if queued else 1)
        after_steps = cuda_ops.idle_commits() or {}
        floor = []
        for _ in range(steps):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(tiny())
            floor.append(time.perf_counter() - t0)
        times = {"build": build, "queue": queue, "tiny": statistics.median(floor) * 1e6}
        return times, {k: (n - before.get(k, 0)) / steps for k, n in after_steps.items()}
    finally:
        case.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--queued", action="store_true", help="queue the steps back to back (one wait at the end)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps} (allowed: an int >= 1)")
    for spec in args.shapes:
        r, per_step = measure(spec, args.steps, args.queued)
        commits = ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()) or "-"
        # Queued, ``queue`` is MLX waiting for the GPU (the docstring), so no host time a layer is derived.
        per_layer = ("queued: the GPU's pace" if args.queued
                     else f"idle GPU: {(r['build'] + r['queue']) / STEP_LAYERS:.1f} µs a layer")
        print(f"b{spec[0]} h{spec[1]}/{spec[2]} d{spec[3]} L{spec[4]} x{STEP_LAYERS}: build {r['build']:.0f} µs, "
              f"queue {r['queue']:.0f} µs a step ({per_layer}; commits a step: {commits}); one trivial evaluation "
              f"{r['tiny']:.1f} µs", flush=True)


if __name__ == "__main__":
    main()
