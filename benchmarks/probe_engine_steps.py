"""Every step of one generate-suite engine run, on the host's clock: where the generation time goes.

Runs the generate suite's engine workload (`metal_attn.bench.generate.suite_engine_config`: its pool
sizing, budget and defaults over random prompts of the same lengths; the ids themselves are drawn
from 1,000 values with the run's index as the seed, which does not change the timing) ``--runs``
times in one process and records, per step: its rows
(decode and prompt tokens), whether it ran compiled, the traces so far, its host phases
(`InFlight.timings`), whether its plan was built on the host (`StepRunner.plans_built`) and the gap
to the previous step's completion. Prints a summary per run: the
decode-only steps' median and mean gap, the time spent in steps that traced, the steps that built
their plan on the host, and the generation time against the steady steps' share of it.

    python benchmarks/probe_engine_steps.py OUT.json [--concurrency 64] [--prompt-len 512] [--gen 128] [--runs 2]
(on the GPU machine: ``source .device/setup.sh && python3 benchmarks/probe_engine_steps.py out.json``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model, suite_engine_config
from metal_attn.device import current_device
from metal_attn.engine import Engine


def one_run(model, c: int, prompt_len: int, gen: int, budget: int, seed: int) -> dict:
    prompts = _prompts(c, prompt_len, 1000, seed)
    eng = Engine(model, _NoStopTokenizer(), suite_engine_config(prompts, gen, budget=budget))
    for p in prompts:
        eng.add_request(p, max_tokens=gen)
    compiled = eng.runner.compiled
    steps = []
    t0 = last = time.perf_counter()
    while eng.has_unfinished():
        traces = compiled.traces if compiled else 0
        n_steps = compiled.steps if compiled else 0
        built = eng.runner.plans_built
        flights = len(eng.in_flight)
        eng.step()
        now = time.perf_counter()
        # The step launched by this call is the newest in flight (pipelined), if any was launched.
        launched = eng.in_flight
        fl = launched[-1] if launched and len(launched) >= flights else None
        rows = fl.output.rows if fl is not None else ()
        steps.append({
            "gap_ms": (now - last) * 1e3,
            "decode_rows": sum(1 for r in rows if r.num_tokens == 1),
            "prompt_tokens": sum(r.num_tokens for r in rows if r.num_tokens > 1),
            "compiled": bool(compiled and compiled.steps > n_steps),
            "traced": bool(compiled and compiled.traces > traces),
            "plan_built": eng.runner.plans_built > built,
            "timings_ms": {k: v * 1e3 for k, v in (fl.timings.items() if fl is not None else ())},
        })
        last = now
    wall = time.perf_counter() - t0
    prompt_s = eng.stats.prompt_seconds(t0)
    decode = [s for s in steps if s["decode_rows"] and not s["prompt_tokens"]]
    steady = [s for s in decode if s["compiled"] and not s["traced"]]
    summary = {
        "wall_s": wall, "prompt_s": prompt_s, "generation_s": wall - prompt_s,
        "generation_tps": eng.stats.generated_tokens / max(wall - prompt_s, 1e-9),
        "steps": len(steps), "decode_steps": len(decode), "traces": compiled.traces if compiled else 0,
        "shrunk_steps": compiled.shrunk_steps if compiled else 0,
        "traced_ms": sum(s["gap_ms"] for s in steps if s["traced"]),
        "eager_decode_ms": sum(s["gap_ms"] for s in decode if not s["compiled"]),
        "steady_median_ms": statistics.median(s["gap_ms"] for s in steady) if steady else None,
        "steady_mean_ms": statistics.fmean(s["gap_ms"] for s in steady) if steady else None,
        "steady_ms": sum(s["gap_ms"] for s in steady),
        "host_plan_steps": sum(1 for s in steady if s["plan_built"]),
    }
    del eng
    return {"summary": summary, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    model, label = load_bench_model(current_device().backend)
    print(f"{label} on {current_device().backend}: {args.concurrency} requests, prompts {args.prompt_len}, "
          f"{args.gen} generated each, budget {args.budget}")
    runs = []
    for i in range(args.runs):
        r = one_run(model, args.concurrency, args.prompt_len, args.gen, args.budget, seed=i)
        runs.append(r)
        s = r["summary"]
        print(f"run {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()),
              flush=True)
    Path(args.out).write_text(json.dumps({"label": label, "args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
