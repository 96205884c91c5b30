"""The headline metrics of ncu ``--csv`` logs, one line per kernel and metric (not a test).

    python3 benchmarks/ncu_summary.py ours.csv torch.csv

For the logs `benchmarks/device/session.sh ncu` writes (the sections it asks for: speed of light,
occupancy, launch statistics, warp states, schedulers, memory workload): duration, DRAM and memory
throughput, occupancy (theoretical and achieved), the launch's grid, block, registers and shared
memory, its waves per SM, and the schedulers' issue figures, so two kernels' structure can be read
side by side in a device call's output.
"""

from __future__ import annotations

import csv
import sys

METRICS = (
    "Duration", "DRAM Throughput", "Memory Throughput", "Max Bandwidth", "Mem Busy", "L2 Hit Rate",
    "Theoretical Occupancy", "Achieved Occupancy", "Achieved Active Warps Per SM", "Block Limit Registers",
    "Block Limit Shared Mem", "Grid Size", "Block Size", "Registers Per Thread", "Dynamic Shared Memory Per Block",
    "Static Shared Memory Per Block", "Waves Per SM", "Issue Slots Busy", "No Eligible", "One or More Eligible",
    # the same figures by their raw names, in logs taken with --metrics (../shared/bench/ncu-decode-b8-l4096)
    "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
    "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)


def rows(path: str) -> list[tuple[str, str, str, str]]:
    """``(kernel, metric, value, unit)`` of every `METRICS` row of one ncu ``--csv`` log (its non-CSV
    lines, the profiled program's output, are skipped)."""
    with open(path, newline="") as f:
        table = list(csv.reader(line for line in f if line.startswith('"')))
    if not table:
        return []
    col = {name: i for i, name in enumerate(table[0])}
    return [(r[col["Kernel Name"]], r[col["Metric Name"]], r[col["Metric Value"]], r[col["Metric Unit"]])
            for r in table[1:] if r[col["Metric Name"]] in METRICS]


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in paths:
        print(f"== {path}")
        for kernel, metric, value, unit in rows(path):
            print(f"  {kernel[:40]:40} {metric:34} {value:>12} {unit}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        sys.stderr.close()
        sys.exit(0)
