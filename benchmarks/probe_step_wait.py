"""How a blocking step is waited for, and what the wait costs (not a test): issue #17, the step boundary.

    python3 benchmarks/probe_step_wait.py OUT.json [--shapes b8:32:8:128:4096,...] [--steps 40]

The blocking 32-layer step loses one idle span a step between the last kernel of step n and the first
of step n+1 (docs/bench-h200-decode-step.md). The host's build and encoding of the step explain part
of it; this probe measures the rest: the wait itself. MLX waits for an evaluation on a CUDA event
(`cudaEventSynchronize`); an event made with ``cudaEventBlockingSync`` puts the thread to sleep until
the GPU's interrupt wakes it, while ``torch.cuda.synchronize`` spins under the context's default
schedule. Per shape (batch:heads:kv_heads:head_size:context, bf16, 32 chained layers, each over its
own pools, as the decode-step suite builds them), wall µs a step, medians over ``--steps`` steps:

- ``mlx_eval``: the compiled step, ``mx.eval`` (the suite's blocking candidate);
- ``mlx_spin``: the same, ``mx.async_eval``, then the driver's ``cuCtxSynchronize`` (the context's
  schedule), then ``mx.eval``, which finds the work done;
- ``mlx_stream_spin``: the same, with `metal_attn.cuda_ops.spin_until_idle` (cuStreamQuery in a loop on
  MLX's stream) in place of ``cuCtxSynchronize``;
- ``mlx_queued``: the steps queued back to back (the next before the one before is waited for): the GPU's
  time a step;
- ``mlx_prebuilt_eval``, ``mlx_prebuilt_stream_spin``: ``mx.eval`` or the spin of a step whose graph was built
  (the compiled step's call) before the clock started: the build's share of a blocking step;
- ``torch_sync``: torch SDPA's step, ``torch.cuda.synchronize`` (the suite's peer);
- ``torch_event``: the same, waited for on a blocking torch event (``torch.cuda.Event(blocking=True)``):
  torch with MLX's way of waiting, if MLX's event blocks.

Also the context's scheduling flags (``cuCtxGetFlags``: 0 auto, 1 spin, 2 yield, 4 blocking sync).
Needs MLX's CUDA backend, torch and the driver library. Measured on an H100 (forty-first session,
docs/cuda-ops.md): the three MLX waits read within noise of each other; the boundary is the encoding.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

from probe_args import decode_shapes

SHAPES = ((8, 32, 8, 128, 4096), (16, 16, 2, 128, 16384), (1, 32, 8, 128, 32768))
SCHEDULES = {0: "auto", 1: "spin", 2: "yield", 4: "blocking sync"}


def driver():
    """libcuda with the two calls this probe makes; raises when a call fails."""
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name: str, *args) -> None:
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed (CUresult {rc})")

    return call


def timed(fn, steps: int) -> float:
    """Median wall µs of ``fn`` over ``steps`` calls, each call one blocking step."""
    return timed_prebuilt(lambda: None, lambda _: fn(), steps)


def timed_prebuilt(build, wait, steps: int) -> float:
    """Median wall µs of ``wait(build())`` with ``build()`` outside the timing (the wait and encoding alone),
    over ``steps`` calls after 3 untimed ones."""
    walls = []
    for i in range(steps + 3):
        out = build()
        t0 = time.perf_counter()
        wait(out)
        if i >= 3:
            walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e6


def timed_queued(build, steps: int) -> float:
    """Wall µs a step with the steps queued back to back (the next queued before the one before is waited
    for), as the engine runs them: the GPU's time a step, the host hidden."""
    import mlx.core as mx

    prev = build()
    mx.async_eval(prev)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = build()
        mx.async_eval(nxt)
        mx.eval(prev)
        prev = nxt
    mx.eval(prev)
    return (time.perf_counter() - t0) / (steps + 1) * 1e6


def waits(cu) -> dict[str, object]:
    """The three ways of waiting for MLX's outputs, by name: ``eval`` (``mx.eval``, MLX's wait), ``spin``
    (queued, then the driver's ``cuCtxSynchronize``, then ``mx.eval``) and ``stream_spin`` (queued, then
    `metal_attn.cuda_ops.spin_until_idle`, then ``mx.eval``). Raises where the stream spin cannot run (the
    module not loaded, the GPU not MLX's default device): it would be ``mx.eval`` under another name."""
    import mlx.core as mx

    from metal_attn import cuda_ops

    if cuda_ops.spin_until_idle() is None:
        raise RuntimeError("metal_attn.cuda_ops.spin_until_idle() cannot run here (the CUDA module is not loaded "
                           "or the GPU is not MLX's default device): build it with "
                           "benchmarks/device/build_cuda_ops.sh and carry it")

    def spin(out):
        mx.async_eval(out)
        cu("cuCtxSynchronize")
        mx.eval(out)

    def stream_spin(out):
        mx.async_eval(out)
        cuda_ops.spin_until_idle()
        mx.eval(out)

    return {"eval": mx.eval, "spin": spin, "stream_spin": stream_spin}


def measure(spec: tuple[int, ...], steps: int, cu) -> dict[str, float]:
    import mlx.core as mx
    import torch

    from metal_attn.bench.decode_step import StepTorchSdpa, build_step_case, step_shapes
    from metal_attn.bench.shapes import Shape

    shape = step_shapes([Shape(*spec, "bfloat16")])[0]
    case = build_step_case(shape, seed=spec[-1])
    try:
        compiled = mx.compile(lambda: _chain(case))
        wait = waits(cu)
        peer = StepTorchSdpa().prepare(case)
        event = torch.cuda.Event(blocking=True)

        def torch_event():
            peer.launch()
            event.record()
            event.synchronize()

        out = {"mlx_queued": timed_queued(compiled, steps),
               "mlx_prebuilt_eval": timed_prebuilt(compiled, wait["eval"], steps),
               "mlx_prebuilt_stream_spin": timed_prebuilt(compiled, wait["stream_spin"], steps)}
        for again in ("", "_again"):  # each way twice, interleaved with the others
            for name, w in wait.items():
                out[f"mlx_{name}{again}"] = timed(lambda w=w: w(compiled()), steps)
            if not again:
                out["torch_sync"] = timed(peer.run, steps)
                out["torch_event"] = timed(torch_event, steps)
        if peer.close:
            peer.close()
        return out
    finally:
        case.release()


def wake_only(steps: int, cu) -> dict[str, float]:
    """The wait alone: one long GPU operation (a bf16 matmul of 8192^2, about 1 ms), waited for each way."""
    import mlx.core as mx

    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(a)
    return {f"mlx_{name}": timed(lambda w=w: w(a @ a), steps) for name, w in waits(cu).items()}


def _chain(case):
    import metal_attn
    from metal_attn.bench.decode_step import chain

    return chain(case.q, case.pools, lambda x, kv: metal_attn.paged_attention(x, *kv, metadata=case.metadata,
                                                                              scale=case.scale))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    import mlx.core as mx

    mx.eval(mx.zeros(1) + 1)  # MLX's context current on this thread
    cu = driver()
    flags = ctypes.c_uint(0)
    cu("cuCtxGetFlags", ctypes.byref(flags))
    schedule = SCHEDULES.get(flags.value & 0x7, str(flags.value & 0x7))
    print(f"context flags {flags.value:#x}: schedule {schedule}", flush=True)
    rows = [{"shape": "one matmul 8192^2 bf16", **wake_only(args.steps, cu)}]
    print(f"{rows[0]['shape']}: " + ", ".join(f"{k} {v:.0f}" for k, v in rows[0].items() if k != "shape") + " µs",
          flush=True)
    for spec in args.shapes:
        r = measure(spec, args.steps, cu)
        label = f"b{spec[0]} h{spec[1]}/{spec[2]} d{spec[3]} L{spec[4]} x32"
        print(label + ": " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) + " µs a step", flush=True)
        rows.append({"shape": label, **r})
    with open(args.out, "w") as f:
        json.dump({"context_flags": flags.value, "schedule": schedule, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
