"""A/B of two versions of the kernel texts: `metal-attn bench` runs alternating between processes that
read ``kernels_v2`` from BASE_DIR and processes that read the package's own, each with its peer in the
same run (``--new-dir``: the new side's texts from DIR instead).

    python3 benchmarks/ab_kernel_text.py BASE_DIR OUT_DIR [--rounds N] [--candidate auto] [--peer torch_sdpa]
        [--new-dir DIR] -- BENCH_ARGS...

BASE_DIR holds the other version's kernel files (e.g. ``git archive HEAD~1 kernels_v2 | tar -x -C /tmp/base``
gives ``/tmp/base/kernels_v2``). Each round runs the bench once per side, the order flipped every round
(base, new; new, base; ...) so that a drift of the machine over the rounds lands on both sides alike. A
run's figure per shape is the candidate's speed against the peer measured in that run (peer median /
candidate median, above 1: the candidate is faster), and its fraction of the copy ceiling. Printed per
shape: every run's ratio, each side's median over its runs, and new / base. The runs' JSON stays in
OUT_DIR (``base-R.json``, ``new-R.json``). A kernel text that changes no launch shape needs no code
change to compare; the kernels are named by a hash of their text, so the two never share a cache entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: Runs the bench CLI with the kernel texts read from argv[1] ('' : the package's own).
RUNNER = ("import sys\n"
          "from metal_attn import kernels\n"
          "from metal_attn.bench.cli import main\n"
          "if sys.argv[1]:\n"
          "    kernels.use_source_dir(sys.argv[1])\n"
          "raise SystemExit(main(sys.argv[2:]))\n")
SIDES = ("base", "new")


def order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in run order: base first in even rounds, new first in odd ones."""
    return [(r, side) for r in range(rounds) for side in (SIDES if r % 2 == 0 else SIDES[::-1])]


def shape_figures(run: dict, candidate: str, peer: str) -> dict[str, tuple[float | None, float | None]]:
    """Per shape label of a bench JSON: (peer median / candidate median, the candidate's fraction of the
    ceiling); None where either did not give a time."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for suite in run["suites"]:
        for res in suite["results"]:
            by_name = {c["name"]: c for c in res["candidates"]}
            cand, other = by_name.get(candidate, {}), by_name.get(peer, {})
            c_s, p_s = cand.get("median_s"), other.get("median_s")
            ratio = p_s / c_s if c_s and p_s else None
            out[res["shape"]["label"]] = (ratio, cand.get("fraction_of_ceiling"))
    return out


def summarize(runs: dict[tuple[int, str], dict], candidate: str, peer: str) -> list[str]:
    """The table's lines: per shape, each side's ratios in run order, their medians, and new / base."""
    figures = {key: shape_figures(run, candidate, peer) for key, run in runs.items()}
    labels = list(dict.fromkeys(label for f in figures.values() for label in f))
    lines = [f"{candidate} vs {peer} (peer median / {candidate} median; above 1: {candidate} faster), "
             f"and {candidate}'s % of the ceiling, per run:"]
    for label in labels:
        meds = {}
        parts = []
        for side in SIDES:
            got = [figures[k][label] for k in sorted(figures) if k[1] == side and label in figures[k]]
            ratios = [r for r, _ in got if r is not None]
            ceil = [f for _, f in got if f is not None]
            meds[side] = statistics.median(ratios) if ratios else None
            shown = ", ".join(f"{r:.3f}" for r in ratios) or "-"
            pct = (f"; {statistics.median(ceil) * 100:.1f}% of the ceiling" if ceil else "")
            parts.append(f"{side} [{shown}] median {meds[side]:.3f}{pct}" if meds[side] else f"{side} [-]")
        gain = (f"new / base {meds['new'] / meds['base']:.3f}" if meds["new"] and meds["base"] else "new / base -")
        lines.append(f"  {label}: {' | '.join(parts)} | {gain}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    bench = args[args.index("--") + 1:] if "--" in args else []
    own = args[:args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s BASE_DIR OUT_DIR [options] -- BENCH_ARGS...")
    p.add_argument("base_dir", type=Path, help="the other version's kernels_v2 folder")
    p.add_argument("out_dir", type=Path, help="where each run's JSON goes")
    p.add_argument("--rounds", type=int, default=2, help="runs per side (default 2)")
    p.add_argument("--candidate", default="auto", help="the candidate whose speed is compared (default auto)")
    p.add_argument("--peer", default="torch_sdpa", help="the same-run peer it is measured against")
    p.add_argument("--new-dir", type=Path, help="the new side's kernels_v2 folder (default: the package's own)")
    a = p.parse_args(own)
    for flag, folder in (("BASE_DIR", a.base_dir), ("--new-dir", a.new_dir)):
        if folder is not None and not (folder / "pagedattention.metal").is_file():
            p.error(f"{flag}={str(folder)!r} holds no kernel texts (no pagedattention.metal there)")
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds}: must be at least 1")
    if not bench or any(x == "--json" or x.startswith("--json=") for x in bench):
        p.error("give the bench's arguments after '--' (without --json: each run's JSON goes to OUT_DIR)")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str], dict] = {}
    for rnd, side in order(a.rounds):
        path = a.out_dir / f"{side}-{rnd}.json"
        folder = a.base_dir if side == "base" else a.new_dir
        src = str(folder.resolve()) if folder is not None else ""
        print(f"==> round {rnd + 1}/{a.rounds}, {side} kernel texts", flush=True)
        rc = subprocess.call([sys.executable, "-c", RUNNER, src, *bench, "--json", str(path)])
        if rc != 0 or not path.is_file():
            print(f"round {rnd + 1}, {side}: the bench exited {rc}; its run is left out", flush=True)
            continue
        runs[(rnd, side)] = json.loads(path.read_text())
    if not any(k[1] == "base" for k in runs) or not any(k[1] == "new" for k in runs):
        print("no run of one side finished: nothing to compare")
        return 1
    print("\n".join(summarize(runs, a.candidate, a.peer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
