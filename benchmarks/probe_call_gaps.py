"""Where a queued decode call's time goes between its kernels on the GPU (not a test): issue #17.

    python3 benchmarks/probe_call_gaps.py OUT.json [--shapes b8:32:8:128:4096,...] [--calls 40]
        [--candidates auto,step_compiled,...]

On an H100 (twenty-seventh session) our decode call took 10-36 µs longer per call than its kernels,
torch's 4-12 µs longer than cuDNN's, with MLX's CUDA graphs on or off. Nsight Systems does not run on
the GPU machines, so this reads the same timeline from CUPTI (torch.profiler, `kernel_trace`). Per
shape (batch:heads:kv_heads:head_size:context, bf16, 16-token pages) and per candidate, ``--calls``
calls queued back to back, as the pipelined bench queues them (MLX: ``mx.async_eval`` per call;
torch: its launches), traced twice:

- without host activity: the GPU's ``period_us`` per call (first activity's start to the last's end,
  over the calls), ``busy_us`` (the union of its kernels and copies) and ``idle_us`` (the rest);
- with the host's CUDA API calls: each idle span between two GPU activities, named by the activities
  on either side, and how much of it came before the host had made the next activity's launch call
  (``host_late``: from the launch call's start, a lower bound; ``host_late_end``: from its return, an
  upper bound; host tracing slows the host, so these overstate it) and how much with the launch
  already made (``queued``: the driver's or GPU's own time);
- ``api``: the host's CUDA API calls per call, by name;
- ``host_us``: the host's time in one queueing (building and queueing the work) with the GPU idle before
  it, per call.

Candidates (`NAMES`, ``--help`` lists them): ``auto`` (`metal_attn.paged_attention`, the registry's
choice), two of them per evaluation, MLX SDPA and torch SDPA on contiguous K/V, MLX's own cost of one
evaluation and of one operation, and 32-layer chained steps (ours eager and compiled, MLX SDPA's, torch's;
queued, and waited for). Every figure is per call (per layer for a step). Needs MLX's CUDA backend and torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from probe_args import decode_shapes

#: Shapes by default: the decode shapes whose calls lost the most to their kernels on the H100.
SHAPES = ((8, 32, 8, 128, 4096), (1, 32, 8, 128, 32768), (16, 16, 2, 128, 16384), (1, 24, 4, 256, 65536),
          (8, 32, 8, 128, 32768))

#: torch.profiler's categories of GPU activity, and of the host's CUDA API calls.
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def gpu_activity(events: list[dict]) -> list[dict]:
    """The GPU's kernels and copies among ``events``, by start time."""
    return sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: float(e["ts"]))


def correlation(event: dict) -> int | None:
    """The CUPTI correlation id linking a GPU activity to the host call that launched it."""
    return event.get("args", {}).get("correlation")


def short(name: str, width: int = 40) -> str:
    """A kernel's name cut to ``width`` characters (templates and argument lists dropped first)."""
    return name.split("(")[0].split("<")[0][:width] or name[:width]


def timeline(events: list[dict], calls: int) -> dict:
    """Per call: the GPU's period (first start to last end), busy time (union of activities) and idle time,
    in µs."""
    from kernel_trace import busy_us

    gpu = gpu_activity(events)
    if not gpu:
        return {"period_us": None, "busy_us": None, "idle_us": None}
    span = max(float(e["ts"]) + float(e["dur"]) for e in gpu) - float(gpu[0]["ts"])
    busy = busy_us(gpu)
    return {"period_us": span / calls, "busy_us": busy / calls, "idle_us": (span - busy) / calls}


def gaps(events: list[dict], calls: int) -> dict:
    """The idle spans between consecutive GPU activities of a trace with host activity, per call.

    A span runs from the latest end so far to the next activity's start. Its launch call (the host API
    event with the activity's correlation id) splits it: the part before that call started
    (``host_late``), before it returned (``host_late_end``), and the rest (``queued``). ``pairs``: per
    (activity before, activity after) the spans' count per call, median and µs per call."""
    gpu = gpu_activity(events)
    api = {correlation(e): e for e in events if e.get("cat") in API_CATS and correlation(e) is not None}
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    late = late_end = queued = 0.0
    end, before = None, None
    for e in gpu:
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end is not None and start > end:
            gap = start - end
            pairs[(before, short(e["name"]))].append(gap)
            launch = api.get(correlation(e))
            if launch is not None:
                call_start = float(launch["ts"])
                call_end = call_start + float(launch.get("dur", 0.0))
                before_return = min(max(call_end - end, 0.0), gap)
                late += min(max(call_start - end, 0.0), gap)
                late_end += before_return
                queued += gap - before_return
        if end is None or stop >= end:
            end, before = stop, short(e["name"])
    rows = [{"before": a, "after": b, "per_call": len(g) / calls, "median_us": statistics.median(g),
             "us_per_call": sum(g) / calls} for (a, b), g in pairs.items()]
    rows.sort(key=lambda r: -r["us_per_call"])
    return {"idle_us": sum(r["us_per_call"] for r in rows), "host_late_us": late / calls,
            "host_late_end_us": late_end / calls, "queued_us": queued / calls, "pairs": rows}


def api_calls(events: list[dict], calls: int) -> list[dict]:
    """The host's CUDA API calls per name: calls and host µs per call, the costliest first."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in API_CATS:
            by_name[e["name"]].append(float(e.get("dur", 0.0)))
    rows = [{"name": n, "calls_per_call": len(d) / calls, "us_per_call": sum(d) / calls} for n, d in by_name.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def line(shape: str, name: str, row: dict) -> str:
    """One candidate's figures as one printed line."""
    t, g = row["timeline"], row["gaps"]
    wall = f"wall {row['wall_us']:.1f} | " if row.get("wall_us") is not None else ""
    wall += f"host {row['host_us']:.1f} | " if row.get("host_us") is not None else ""
    top = ", ".join(f"{p['before'][:22]}→{p['after'][:22]} {p['per_call']:g}x {p['median_us']:.1f}"
                    for p in g["pairs"][:3])
    return (f"{shape} {name:10} {wall}period {t['period_us']:.1f} busy {t['busy_us']:.1f} idle {t['idle_us']:.1f} µs"
            f" | traced idle {g['idle_us']:.1f}: host late {g['host_late_us']:.1f}-{g['host_late_end_us']:.1f},"
            f" queued {g['queued_us']:.1f} | {top}")


#: A candidate: (name, queue its work once, wait for the queue, calls per queueing).
Candidate = tuple[str, Callable[[], None], Callable[[], None], int]

#: Layers of the chained steps (``step_*`` candidates).
STEP_LAYERS = 32

#: The candidates by name, in the order they run, and what each queues at a time.
NAMES: dict[str, str] = {
    "auto": "one `metal_attn.paged_attention` call (the registry's choice) per mx.async_eval",
    "mlx_sdpa": "one MLX SDPA call on contiguous K/V per mx.async_eval",
    "auto_x2": "two independent `auto` calls per mx.async_eval (MLX may run their kernels at once)",
    "torch_sdpa": "one torch SDPA call on contiguous K/V",
    "mlx_tiny": "MLX adding one to 16 floats per mx.async_eval: MLX's own cost of one evaluation",
    "step_tiny": f"{STEP_LAYERS} chained `x * 1.5` on 16 floats, eager, one mx.async_eval: MLX's own cost an operation",
    "step_mlx_sdpa_compiled": f"MLX SDPA's {STEP_LAYERS} chained layers under mx.compile, one mx.async_eval",
    "step_auto": f"{STEP_LAYERS} chained `auto` layers, eager, one mx.async_eval",
    "step_compiled": f"{STEP_LAYERS} chained `auto` layers under mx.compile, one mx.async_eval",
    "step_torch": f"torch's {STEP_LAYERS} chained layers, one stream of launches",
    "step_compiled_blocking": "`step_compiled` waited for (mx.eval), as the decode-step bench and an engine run a step",
    "step_torch_blocking": "`step_torch` waited for (torch.cuda.synchronize)",
}


def parse_names(text: str) -> tuple[str, ...]:
    """``--candidates NAME,...`` as names of `NAMES`; refuses an unknown name."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--candidates={text!r} (allowed: a comma-separated subset of "
                                         f"{', '.join(NAMES)})")
    return names


def candidates(case, names: tuple[str, ...] = tuple(NAMES)) -> list[Candidate]:
    """The ``names`` of `NAMES` for a bench case, in `NAMES`' order. A step's layers all read the case's K/V,
    chained as a model's layers are: each query the output before it (`metal_attn.bench.decode_step.chain`)."""
    import mlx.core as mx
    import torch
    import torch.nn.functional as F
    from kernel_trace import torch_decode_inputs
    from probe_mixed_host import builders

    import metal_attn
    from metal_attn.bench.decode_step import chain

    layers = range(STEP_LAYERS)
    built = dict(builders(case))
    auto, mlx_sdpa = built["auto"], built["mlx_sdpa"]
    tq, tk, tv = torch_decode_inputs(case)
    (k, v), q4 = case.contiguous_kv()[0], case.group_queries()[0]
    tiny = mx.zeros((16,), mx.float32)

    def layer(x, _):
        return metal_attn.paged_attention(x, case.k_pool, case.v_pool, metadata=case.metadata, scale=case.scale)

    def torch_step():
        return chain(tq, layers, lambda x, _: F.scaled_dot_product_attention(x, tk, tv, enable_gqa=True))

    compiled = mx.compile(lambda: chain(case.q, layers, layer))
    sdpa_step = mx.compile(lambda: chain(q4, layers, lambda x, _: mx.fast.scaled_dot_product_attention(
        x, k, v, scale=case.scale)))
    table: dict[str, tuple[Callable[[], None], Callable[[], None], int]] = {
        "auto": (lambda: mx.async_eval(auto()), mx.synchronize, 1),
        "mlx_sdpa": (lambda: mx.async_eval(mlx_sdpa()), mx.synchronize, 1),
        "auto_x2": (lambda: mx.async_eval(auto(), auto()), mx.synchronize, 2),
        "torch_sdpa": (lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True), torch.cuda.synchronize, 1),
        "mlx_tiny": (lambda: mx.async_eval(tiny + 1), mx.synchronize, 1),
        "step_tiny": (lambda: mx.async_eval(chain(tiny, layers, lambda x, _: x * 1.5)), mx.synchronize, STEP_LAYERS),
        "step_mlx_sdpa_compiled": (lambda: mx.async_eval(sdpa_step()), mx.synchronize, STEP_LAYERS),
        "step_auto": (lambda: mx.async_eval(chain(case.q, layers, layer)), mx.synchronize, STEP_LAYERS),
        "step_compiled": (lambda: mx.async_eval(compiled()), mx.synchronize, STEP_LAYERS),
        "step_torch": (torch_step, torch.cuda.synchronize, STEP_LAYERS),
        "step_compiled_blocking": (lambda: mx.eval(compiled()), mx.synchronize, STEP_LAYERS),
        "step_torch_blocking": (lambda: (torch_step(), torch.cuda.synchronize()), torch.cuda.synchronize, STEP_LAYERS),
    }
    assert list(table) == list(NAMES), "NAMES and the table must list the same candidates"
    return [(name, *table[name]) for name in NAMES if name in names]


def measure(queue: Callable[[], None], wait: Callable[[], None], queues: int, per_queue: int = 1) -> dict:
    """Untraced wall µs per call, the timeline without host tracing, and the gaps and API calls with it,
    over ``queues`` queueings of ``per_queue`` calls each; every figure per call."""
    from kernel_trace import trace_events

    from metal_attn.bench.timing import time_fn

    def run() -> None:
        for _ in range(queues):
            queue()

    for _ in range(3):
        queue()
    wait()
    wall = time_fn(queue, warmup=2, iters=7, sync=wait).median_s * 1e6 / per_queue
    plain = trace_events(run, cpu=False)
    hosted = trace_events(run, cpu=True)
    calls = queues * per_queue
    return {"wall_us": wall, "host_us": host_us(queue, wait) / per_queue, "timeline": timeline(plain, calls),
            "gaps": gaps(hosted, calls), "api": api_calls(hosted, calls)}


def host_us(queue: Callable[[], None], wait: Callable[[], None], samples: int = 9) -> float:
    """Median µs the host spends in one ``queue()`` with the GPU idle before it: building and queueing the
    work (for a candidate that waits for its own result, its whole call)."""
    out = []
    for _ in range(samples):
        wait()
        t0 = time.perf_counter()
        queue()
        out.append(time.perf_counter() - t0)
    wait()
    return statistics.median(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--candidates", type=parse_names, default=tuple(NAMES),
                    help="comma-separated names (default: all): " + "; ".join(f"{n}: {d}" for n, d in NAMES.items()))
    args = ap.parse_args()
    if args.calls < 2:
        ap.error(f"--calls={args.calls} (allowed: an int >= 2; gaps lie between calls)")

    import mlx.core as mx

    import metal_attn
    from metal_attn.bench.shapes import Shape, build_case

    rows = []
    for batch, heads, kv_heads, head, context in args.shapes:
        label = f"b{batch} h{heads}/{kv_heads} d{head} L{context}"
        case = build_case(Shape(batch, heads, kv_heads, head, context, "bfloat16"), seed=context)
        for name, queue, wait, per_queue in candidates(case, args.candidates):
            queues = max(4, args.calls // per_queue)
            row = {"shape": label, "candidate": name, **measure(queue, wait, queues, per_queue)}
            if name == "auto":
                row["route"] = metal_attn.diagnostics.last_dispatch().route
            rows.append(row)
            print(line(label, name, row), flush=True)
        case.release()
        del case
        mx.clear_cache()
    Path(args.out).write_text(json.dumps({"calls": args.calls, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
