"""Where one engine decode step's time goes on a GPU: kernels by kind, GPU idle time, the roofline.

Two passes, one command each:

1. ``python3 benchmarks/step_breakdown.py --concurrency 64`` under ncu, which captures only
   the profiled range (whole decode steps, launch to tokens back; it prints how many):

       ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
           --log-file ncu.csv python3 benchmarks/step_breakdown.py --concurrency 64 --profile

   Without ncu the same script prints the step's wall time (median of unprofiled steady
   decode steps), the bytes it must read (all weights, every row's K/V once) and the copy
   ceiling measured in the same run, so ``--profile`` and the plain run agree on the workload.
2. ``python3 benchmarks/step_breakdown.py --parse ncu.csv --steps N --wall-ms W --roofline-ms R``
   sums the captured kernels by kind (attention, cache writes, matmuls, sampling, the rest) per
   step and sets the total against the wall time: GPU idle = wall - kernel time.

``--compile-decode`` runs the engine's decode steps compiled (`EngineConfig.compile_decode`);
without it they run eagerly, whatever the backend's default.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import statistics
import time
from collections import defaultdict

#: Kernel-name patterns, first match wins: how a kernel is counted in the breakdown.
KINDS: tuple[tuple[str, str], ...] = (
    # Our kernels (the split reducer is ``..._paged_attention_v2_reduce_...``).
    # Ours, and cuDNN's SDPA behind MLX SDPA (the peers' attention: its split kernel and reduction).
    ("attention", r"paged_attention|pagedattention|tiled_prefill|gqa_decode|nax_prefill|_sdpa_|flash_fprop"
                  r"|lean_reduction"),
    ("cache write", r"scatter|reshape_and_cache"),
    ("matmul", r"gemm|gemv|cutlass|sm90_|nvjet|matmul|qmm|qmv|splitkreduce"),
    ("sampling", r"argmax|arg_reduce|logsumexp|categorical"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other (norms, rope, elementwise, copies)")


def parse(path: str) -> dict[str, float]:
    """Kernel time (ms) by kind from ncu's CSV (metric gpu__time_duration.sum, ns or us)."""
    out: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "nsecond")
        v = float(row["Metric Value"].replace(",", ""))
        ms = v / {"nsecond": 1e6, "usecond": 1e3, "msecond": 1.0, "second": 1e-3}.get(unit, 1e6)
        k = kind_of(row.get("Kernel Name", ""))
        out[k] += ms
        counts[k] += 1
    return {f"{k} ({counts[k]} kernels)": v for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _profiler(call: str) -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    getattr(lib, call)()


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
    from metal_attn.device import current_device
    from metal_attn.engine import Engine, EngineConfig

    model, label = load_bench_model(current_device().backend, args.layers)
    c = args.concurrency
    eng = Engine(model, _NoStopTokenizer(), EngineConfig(num_blocks=c * ((args.prompt_len + 200) // 16 + 2) + 16,
                                                         max_num_seqs=c, max_num_batched_tokens=8192,
                                                         compile_decode=args.compile_decode))
    for p in _prompts(c, args.prompt_len, 1000, c):
        eng.add_request(p, max_tokens=150)
    while any(r.num_computed < len(r.prompt_ids) for r in eng.requests.values()):
        eng.step()
    for _ in range(10):
        eng.step()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    wall_ms = statistics.median(times) * 1e3
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    g = eng.model.geometry
    ctx = sum(r.num_tokens for r in eng.requests.values() if not r.finished)
    kv = ctx * 2 * eng.model.resolved.num_layers * g.num_kv_heads * g.head_size * g.dtype.size
    x = mx.zeros((1 << 30,), dtype=mx.bfloat16)
    mx.eval(x)
    for _ in range(3):
        mx.eval(x * 1)
    t = time.perf_counter()
    for _ in range(10):
        y = x * 1
        mx.eval(y)
    ceiling = 2 * x.nbytes * 10 / (time.perf_counter() - t)  # read + write bytes per second
    roofline_ms = (weights + kv) / ceiling * 1e3
    compiled = eng.runner.compiled
    mode = "eager" if compiled is None else f"compiled, refused: {compiled.disabled}" if compiled.disabled \
        else "compiled"
    print(f"{label}; decode steps {mode}; {c} decode rows, {ctx} tokens of context in all; "
          f"step wall {wall_ms:.2f} ms (median of 20, pipelined); "
          f"weights {weights / 1e9:.2f} GB + K/V {kv / 1e9:.2f} GB at the copy ceiling "
          f"{ceiling / 1e9:,.0f} GB/s (MLX x*1) = roofline {roofline_ms:.2f} ms; step / roofline "
          f"{wall_ms / roofline_ms:.2f}x")
    if args.profile:
        eng.synchronize()
        before = eng.stats.steps
        _profiler("cuProfilerStart")
        eng.step()  # with nothing in flight a pipelined step() launches two steps
        eng.synchronize()
        _profiler("cuProfilerStop")
        print(f"profiled {eng.stats.steps - before} decode step(s): pass --steps {eng.stats.steps - before} to --parse")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--compile-decode", action="store_true",
                    help="decode steps under mx.compile (EngineConfig.compile_decode; default: eager)")
    ap.add_argument("--profile", action="store_true", help="bracket one step with cuProfilerStart/Stop (for ncu)")
    ap.add_argument("--parse", metavar="NCU_CSV", help="sum an ncu CSV by kernel kind")
    ap.add_argument("--steps", type=int, default=1, help="decode steps the ncu capture held (the --profile run says)")
    ap.add_argument("--wall-ms", type=float, help="the step's wall time (from the plain run), for --parse")
    ap.add_argument("--roofline-ms", type=float, help="the step's roofline (from the plain run), for --parse")
    args = ap.parse_args()
    if args.parse:
        kinds = {k: v / args.steps for k, v in parse(args.parse).items()}
        print(f"kernel time per step (the capture held {args.steps} step(s)):")
        total = sum(kinds.values())
        for k, v in kinds.items():
            print(f"| {k} | {v:.3f} ms |")
        print(f"| all kernels | {total:.3f} ms |")
        if args.wall_ms:
            idle = max(0.0, args.wall_ms - total)
            share = 100 * idle / args.wall_ms
            print(f"| GPU idle (wall {args.wall_ms:.2f} ms - kernels) | {idle:.3f} ms ({share:.0f}%) |")
        if args.roofline_ms:
            print(f"| roofline | {args.roofline_ms:.3f} ms; wall / roofline {args.wall_ms / args.roofline_ms:.2f}x |")
        return
    run(args)


if __name__ == "__main__":
    main()
