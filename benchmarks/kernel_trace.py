"""GPU kernel events of MLX calls through torch.profiler (CUPTI activity tracing), for the profile
scripts in this folder (not a test).

CUPTI records every kernel launched in the process, MLX's included, with its GPU duration and
launch facts (registers per thread, blocks per SM, estimated achieved occupancy). It needs torch
with CUDA next to MLX's CUDA backend (the H200 image has both).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def trace(fn: Callable[[], Any], calls: int) -> list[dict]:
    """GPU kernel and memcpy events of ``calls`` evaluated calls of ``fn`` (after two untraced
    warm-up calls)."""
    for _ in range(2):
        mx.eval(fn())

    def run() -> None:
        for _ in range(calls):
            mx.eval(fn())

    return record(run)


def record(run: Callable[[], Any], *, cpu: bool = True) -> list[dict]:
    """GPU kernel and memcpy events of whatever ``run`` launches (MLX synchronized before and after);
    ``cpu=False`` leaves the profiler's host-side activity off."""
    return [e for e in trace_events(run, cpu=cpu) if e.get("cat") in ("kernel", "gpu_memcpy")]


def trace_events(run: Callable[[], Any], *, cpu: bool = True, stacks: bool = False) -> list[dict]:
    """Every event torch.profiler records while ``run`` runs (MLX synchronized before and after): the
    GPU's kernels and copies, and with ``cpu`` the host's CUDA runtime and driver calls, whoever makes them;
    with ``stacks`` also every Python function call (``python_function`` events: who made a host call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    mx.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=stacks) as prof:
        run()
        mx.synchronize()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            return json.load(g).get("traceEvents", [])


def summarise(events: list[dict], calls: int, kv_bytes: int) -> dict:
    """Per kernel name: launches and GPU microseconds per call, and its launch facts; the total GPU
    time per call, and ``kv_bytes`` over it."""
    by_name: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by_name[e["name"]].append(e)
    kernels = []
    total_us = 0.0
    for name, evs in by_name.items():
        durs = [float(e["dur"]) for e in evs]
        per_call = sum(durs) / calls
        total_us += per_call
        args = evs[0].get("args", {})
        kernels.append({
            "name": name[:90], "launches_per_call": len(evs) / calls, "median_us": statistics.median(durs),
            "us_per_call": per_call, "registers_per_thread": args.get("registers per thread"),
            "blocks_per_sm": args.get("blocks per SM"), "warps_per_sm": args.get("warps per SM"),
            "occupancy_pct": args.get("est. achieved occupancy %"), "grid": args.get("grid"),
            "block": args.get("block"), "shared_memory": args.get("shared memory"),
        })
    kernels.sort(key=lambda k: -k["us_per_call"])
    return {"gpu_us_per_call": total_us, "gbps_gpu_time": kv_bytes / (total_us * 1e-6) / 1e9 if total_us else None,
            "busy_us_per_call": busy_us(events) / calls, "kernels": kernels, "timeline": timeline(events, calls)}


def timeline(events: list[dict], calls: int) -> list[dict] | None:
    """When each launch of one call runs, relative to the call's first event: per launch (its kernel's or
    copy's name and ``launch``, its place by start among that name's launches in the call), the median
    ``start_us`` and the median duration over the ``calls`` traced calls (``end_us`` is their sum), ordered
    by start. Which kernels ran side by side, and which waited for which, shows here where `busy_us` only
    gives the union. Two launches of one name that run side by side may swap places between calls; their
    rows then mix the two.

    The calls are told apart by the GPU's idle time (`trace` waits for each call): the ``calls - 1``
    longest gaps in which nothing ran cut the events into calls. ``None`` where that cannot hold: fewer
    events than calls, or calls that launched different kernels (a stray copy, an extra memset)."""
    if calls <= 0 or len(events) < calls:
        return None
    ordered = sorted(events, key=lambda e: float(e["ts"]))
    gaps, end = [], float("-inf")
    for i, e in enumerate(ordered):
        if i:
            gaps.append((float(e["ts"]) - end, i))
        end = max(end, float(e["ts"]) + float(e["dur"]))
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:calls - 1])
    groups = [ordered[a:b] for a, b in zip([0, *cuts], [*cuts, len(ordered)])]
    if len({tuple(sorted(e["name"] for e in g)) for g in groups}) != 1:
        return None
    spans: dict[tuple[str, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for group in groups:
        t0 = float(group[0]["ts"])
        seen: Counter[str] = Counter()
        for e in group:
            starts, durs = spans[(e["name"], seen[e["name"]])]
            seen[e["name"]] += 1
            starts.append(float(e["ts"]) - t0)
            durs.append(float(e["dur"]))
    rows = []
    for (name, i), (starts, durs) in spans.items():
        start = statistics.median(starts)
        rows.append({"name": name[:90], "launch": i, "start_us": start, "end_us": start + statistics.median(durs)})
    return sorted(rows, key=lambda r: (r["start_us"], r["end_us"]))


def timeline_lines(row: dict, width: int) -> list[str]:
    """`timeline` of a `summarise` row as text, a launch a line (``[]`` where it is ``None``)."""
    return [f"    {t['start_us']:7.1f} -> {t['end_us']:7.1f} us  {t['name'][:width]}"
            + (f" #{t['launch'] + 1}" if t["launch"] else "")
            for t in row.get("timeline") or []]


def kernel_us(kernels: list[dict]) -> float:
    """GPU µs per call of `summarise`'s ``kernels``: each kernel's median duration times its launches per call
    (medians, so one slow launch does not move it; overlapping kernels counted in full, unlike `busy_us`)."""
    return sum(k["median_us"] * k["launches_per_call"] for k in kernels)


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one of ``events`` ran: the union of their intervals (MLX's
    CUDA graphs run kernels without a data dependency between them at once, so their durations
    overlap and their sum overstates the GPU time)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def build_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    """Median host time of building one call's graph (``fn()`` without evaluating it), in ms."""
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
        mx.eval(out)
    return statistics.median(samples) * 1e3


def profile_call(fn: Callable[[], Any], kv_bytes: int, *, builds: bool = True, calls: int = 5) -> dict:
    """One variant of a profile script: the median wall time of a blocking call of ``fn``
    (`metal_attn.bench.timing.time_fn`), the host time of building its graph (`build_ms`; ``None`` when
    ``builds`` is false: ``fn`` evaluates its own result, so its call is no graph building) and
    `summarise` of ``calls`` traced calls."""
    from metal_attn.bench.timing import time_fn

    timing = time_fn(lambda: mx.eval(fn()), warmup=3, iters=7)
    host_ms = build_ms(fn) if builds else None
    return {"wall_ms": timing.median_s * 1e3, "build_ms": host_ms, **summarise(trace(fn, calls), calls, kv_bytes)}


def top_kernels(row: dict, n: int, width: int) -> str:
    """The ``n`` kernels of a `profile_call` row taking the most GPU time, as one line."""
    return ", ".join(f"{k['name'][:width]} {k['us_per_call']:.0f}us x{k['launches_per_call']:g}"
                     for k in row["kernels"][:n])


def torch_decode_inputs(case: Any, *, token_major: bool = False) -> tuple[Any, Any, Any]:
    """torch's (q, k, v) for the decode peer on a bench case's shape (`metal_attn.bench.shapes.build_case`;
    one query row a sequence, every sequence as long as the first, bf16): q [batch, heads, 1, head]; K/V
    [batch, kv heads, context, head] (contiguous), or with ``token_major`` a view of [batch, context, kv
    heads, head] storage: the pools' token-major layout, each head's keys ``kv heads x head`` elements apart."""
    import torch

    s = case.shape
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.rand(s.batch, s.num_heads, 1, s.head_size, device=dev, generator=gen, dtype=torch.bfloat16)
    ctx = s.seq_lens[0]
    dims = (s.batch, ctx, s.num_kv_heads, s.head_size) if token_major else (s.batch, s.num_kv_heads, ctx, s.head_size)
    k = torch.rand(*dims, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.rand_like(k)
    if token_major:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v


def torch_decode_sdpa(case: Any, calls: int, *, token_major: bool = False) -> dict:
    """The GPU kernels of torch SDPA on `torch_decode_inputs` over ``calls`` traced calls: per kernel its
    median µs and launches per call, and the busy µs per call."""
    import torch
    import torch.nn.functional as F

    q, k, v = torch_decode_inputs(case, token_major=token_major)

    def run() -> None:
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    run()
    torch.cuda.synchronize()
    events = record(run, cpu=False)
    return {"kernels": summarise(events, calls, 1)["kernels"], "busy_us_per_call": busy_us(events) / calls}
