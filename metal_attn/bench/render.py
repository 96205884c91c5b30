"""How ``metal-attn bench`` shows its results: the terminal table (printed shape by shape as a run goes),
the Markdown matrix (``--markdown``) and the bar chart (``--plot``)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from metal_attn.bench.candidates import CandidateResult
from metal_attn.bench.core import ShapeResult, SuiteResult
from metal_attn.bench.ratios import SPEEDUP_PEERS

#: How a non-ok status is shown in tables.
STATUS_SHORT = {"refused": "refused", "not registered": "n/r", "unavailable": "n/a", "skipped": "skipped",
                "error": "ERROR"}


def _num(x: float | None, digits: int = 3) -> str:
    """A value with about ``digits`` significant digits and thousands separators."""
    if x is None or not math.isfinite(x):
        return "-"
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def _pct(fraction: float) -> str:
    p = 100 * fraction
    return f"{p:.0f}%" if p >= 10 else f"{p:.1f}%"


def _ms(r: CandidateResult) -> str:
    if not r.ok:
        return STATUS_SHORT.get(r.status, r.status)
    if r.kind == "ceiling" or r.timing is None:
        return "-"
    return _num(r.timing.median_s * 1e3)


def _auto_lag_text(lag: dict[str, Any]) -> str:
    return (f"route {lag['auto_route']} took {lag['lag']:.2f}x the time of {lag['fastest']}, the fastest admitted "
            f"provider of the run (limit {lag['limit']:.2f}x)")


def _note(r: CandidateResult) -> str:
    if not r.ok:
        return "; ".join(r.reasons)
    note = r.route or ""
    if r.check is not None and not r.check.get("ok", True):
        err = r.check.get("error") or f"rel_l2={r.check['rel_l2']:.2e} > {r.check['tolerance']:g}"
        note = f"MISMATCH vs {r.check['against']}: {err}; {note}"
    if r.kind == "ceiling" and r.details.get("mlx_copy_gbps"):
        parts = [f"MLX x*1 {_num(r.details['mlx_copy_gbps'], 4)}"]
        if r.details.get("torch_copy_gbps"):
            parts.append(f"torch copy {_num(r.details['torch_copy_gbps'], 4)}")
        note = f"{r.details['source']} ({', '.join(parts)} GB/s)"
    return note


def _columns(suite: SuiteResult) -> tuple[bool, bool, bool, list[str]]:
    return _planned_columns([sr.shape for sr in suite.results], suite.candidates)


def _planned_columns(shapes: Sequence[Any], candidates: Sequence[str]) -> tuple[bool, bool, bool, list[str]]:
    """Which metric and speedup columns a suite's table has, known before anything is measured (so
    that rows can be printed shape by shape): GB/s, TFLOP/s, % of the ceiling, vs each peer asked for."""
    metrics = {m for sh in shapes for m in sh.metrics}
    ceiling = "ceiling" in candidates and "GB/s" in metrics
    return "GB/s" in metrics, "TFLOP/s" in metrics, ceiling, [p for p in SPEEDUP_PEERS if p in candidates]


def _machine_line(machine: dict[str, Any]) -> str:
    dev = (machine.get("cpu_model") if machine["backend"] == "cpu" else None) or machine.get("device_name") or "?"
    cores = f", {machine['gpu_cores']} GPU cores" if machine.get("gpu_cores") else ""
    return f"{machine['backend']}: {dev}{cores}; mlx {machine['mlx_version']}; {machine['date']}"


class TableStream:
    """A suite's table printed shape by shape as each completes (an interrupted run keeps the rows it
    printed): the title and the header first, then one section per shape, then the caption. Every
    column but the last has a fixed width, so the sections line up as one table."""

    WIDTH = 160

    def __init__(self, name: str, description: str, shapes: Sequence[Any], candidates: Sequence[str],
                 file: TextIO) -> None:
        from metal_attn.terminal import console

        self.file = file
        self.console = console(file=file, min_width=self.WIDTH, highlight=False)
        self.gbps, self.tflops, self.ceiling, self.speed = _planned_columns(shapes, candidates)
        cand = max([len(c) for c in candidates] + [9])
        self.widths = ([32, cand, 7] + [8] * (self.gbps + self.tflops) + [6] * self.ceiling
                       + [len(f"vs {p}") for p in self.speed])
        self.names = (["shape", "candidate", "ms"] + ["GB/s"] * self.gbps + ["TFLOP/s"] * self.tflops
                      + ["% ceil"] * self.ceiling + [f"vs {p}" for p in self.speed] + ["route / reasons"])
        self.console.print(f"{name}: {description}", markup=False)
        self._printed = 0

    def _table(self, header: bool) -> Any:
        from rich import box
        from rich.table import Table

        table = Table(show_header=header, box=box.SIMPLE_HEAD, width=self.console.width, pad_edge=False,
                      padding=(0, 1), collapse_padding=True)
        for i, n in enumerate(self.names):
            if i < len(self.widths):
                table.add_column(n, width=self.widths[i], no_wrap=i != 0, overflow="fold",
                                 justify="left" if i < 2 else "right")
            else:
                table.add_column(n, overflow="fold", ratio=1)
        return table

    def shape(self, sr: ShapeResult) -> None:
        """Print one shape's rows (the header with the first)."""
        from rich.markup import escape

        table = self._table(self._printed == 0)
        for j, r in enumerate(sr.candidates):
            style = None if r.ok else ("red" if r.status == "error" else "dim")
            if r.check is not None and not r.check.get("ok", True):
                style = "red"
            cells = [sr.shape.label if j == 0 else "", r.name, _ms(r)]
            if self.gbps:
                cells.append(_num(r.gbps) if r.ok and ("GB/s" in sr.shape.metrics or r.kind == "ceiling") else "")
            if self.tflops:
                cells.append(_num(r.tflops) if r.ok and "TFLOP/s" in sr.shape.metrics and r.kind != "ceiling"
                             else "")
            if self.ceiling:
                cells.append(_pct(r.fraction_of_ceiling) if r.fraction_of_ceiling is not None else "")
            for p in self.speed:
                cells.append(f"{r.speedup[p]:.2f}x" if p in r.speedup else "")
            note = _note(r)
            if r.kind == "ceiling" and r.ok and r.gbps and not self.gbps:  # no GB/s column (a prefill suite)
                note = f"{_num(r.gbps)} GB/s; {note}"
            cells.append(note)
            table.add_row(*(escape(c) for c in cells), style=style)  # names hold [setting=value]
        self.console.print(table)
        lag = sr.auto_vs_fastest
        if lag and lag["marked"]:
            self.console.print(f"SLOW: auto {_auto_lag_text(lag)}", style="bold red", markup=False)
        self._printed += 1
        self.file.flush()

    def close(self, suite: SuiteResult, machine: dict[str, Any]) -> None:
        self.console.print(_caption(suite, machine), markup=False)
        self.file.flush()


def render_rich(suite: SuiteResult, machine: dict[str, Any], file: TextIO) -> None:
    """The whole table of a finished suite (what `TableStream` prints shape by shape)."""
    stream = TableStream(suite.name, suite.description, [sr.shape for sr in suite.results], suite.candidates, file)
    for sr in suite.results:
        stream.shape(sr)
    stream.close(suite, machine)


def _caption(suite: SuiteResult, machine: dict[str, Any]) -> str:
    mode = ("pipelined: queued calls, one wait per sample" if suite.mode == "pipelined"
            else "blocking: every timed call waits for its result")
    if suite.interleaved:
        mode += "; interleaved: a sample of each timed candidate per round"
    lines = [_machine_line(machine) + f"; warmup {suite.warmup}, iters {suite.iters}; {mode}"]
    c = suite.ceiling
    if c:
        torch = f", torch device-to-device copy {_num(c['torch_copy_gbps'], 4)}" if c.get("torch_copy_gbps") else ""
        lines.append(f"ceiling: {_num(c['gbps'], 4)} GB/s = {c['source']} (MLX x*1 {_num(c['mlx_copy_gbps'], 4)}"
                     f"{torch}; read + write bytes / median)")
    elif any(sr.ceiling_gbps for sr in suite.results):
        how = next((c.route for sr in suite.results for c in sr.candidates if c.kind == "ceiling" and c.ok), "")
        lines.append(f"ceiling: the CPU's read bandwidth over as many bytes as the shape's K+V: {how}")
    lines.append("GB/s: K+V bytes read once / median. TFLOP/s: 4 * heads * head_size * causal (query, key) "
                 "pairs / median. vs PEER: peer median / candidate median (> 1 is faster).")
    return "\n".join(lines)


def render_markdown(suite: SuiteResult, machine: dict[str, Any]) -> str:
    """A Markdown matrix: shapes down, candidates across, the shape's headline metric in each cell."""
    names = list(suite.candidates)
    out = [f"#### {suite.name}", "", f"{suite.description}. {_machine_line(machine)}; {suite.mode} calls.", ""]
    out.append("| shape | metric | " + " | ".join(names) + " |")
    out.append("|---|---|" + "---|" * len(names))
    for sr in suite.results:
        metric = sr.shape.metrics[0]
        cells = []
        for n in names:
            r = sr.get(n)
            if r is None:
                cells.append("")
            elif not r.ok:
                cells.append(STATUS_SHORT.get(r.status, r.status))
            else:
                v = r.gbps if metric == "GB/s" or r.kind == "ceiling" else r.tflops
                cell = _num(v) + (" GB/s" if r.kind == "ceiling" and metric != "GB/s" else "")
                if r.fraction_of_ceiling is not None:
                    cell += f" ({_pct(r.fraction_of_ceiling)})"
                if r.check is not None and not r.check.get("ok", True):
                    cell += " MISMATCH"
                if n == "auto" and sr.auto_vs_fastest and sr.auto_vs_fastest["marked"]:
                    cell += " SLOW"
                cells.append(cell)
        out.append(f"| {sr.shape.label} | {metric} | " + " | ".join(cells) + " |")
    out.append("")
    lags = [(sr, sr.auto_vs_fastest) for sr in suite.results if sr.auto_vs_fastest]
    if lags:
        marked = [f"{sr.shape.label} ({_auto_lag_text(lag)})" for sr, lag in lags if lag["marked"]]
        noise = [f"{sr.shape.label} {lag['lag']:.2f}x" for sr, lag in lags
                 if lag["same_route"] and lag["lag"] > lag["limit"]]
        out.append(f"auto vs the fastest admitted provider of the run: SLOW marks more than "
                   f"{lags[0][1]['limit']:.2f}x on another route; " + (f"marked: {'; '.join(marked)}." if marked else
                                                                       f"no shape marked ({len(lags)} compared).")
                   + (f" Same route, two measurements apart by more than the limit (noise): {', '.join(noise)}."
                      if noise else ""))
    out.append("GB/s: K+V bytes read once per second; TFLOP/s: 4 * heads * head_size * causal pairs per second; "
               "(n%): fraction of the ceiling measured in the same run; n/r: not registered; n/a: unavailable here.")
    c = suite.ceiling
    if c:
        out.append(f"Ceiling: {c['source']}, {_num(c['gbps'], 4)} GB/s (MLX x*1 {_num(c['mlx_copy_gbps'], 4)}"
                   + (f", torch copy {_num(c['torch_copy_gbps'], 4)}" if c.get("torch_copy_gbps") else "") + ").")
    return "\n".join(out) + "\n"


def _panels(suites: Sequence[SuiteResult]) -> list[tuple[SuiteResult, str, list[ShapeResult]]]:
    """One panel per (suite, metric): decode and mixed shapes in GB/s, prefill shapes in TFLOP/s."""
    out = []
    for suite in suites:
        for metric in ("GB/s", "TFLOP/s"):
            rows = [sr for sr in suite.results if sr.shape.metrics[0] == metric]
            if rows:
                out.append((suite, metric, rows))
    return out


def write_plot(suites: Sequence[SuiteResult], path: str) -> str | None:
    """Grouped bars, one group per shape and one bar per candidate, one panel per suite and metric
    (log scale); the ceiling is a black tick over each GB/s group. Returns an error message or ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return (f"--plot {path}: matplotlib is not importable ({exc}); install it (pip install matplotlib) "
                "to get the PNG. No plot was written.")
    panels = _panels(suites)
    if not panels:
        return f"--plot {path}: no results to plot. No plot was written."
    width_in = max(8.0, 1.4 * max(len(rows) for _, _, rows in panels))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 4.8 * len(panels)), squeeze=False)
    for ax, (suite, metric, rows) in zip(axes[:, 0], panels):
        names = [n for n in suite.candidates if n != "ceiling"
                 and any((r := sr.get(n)) is not None and r.ok for sr in rows)]
        width = 0.8 / max(len(names), 1)
        for k, n in enumerate(names):
            vals = []
            for sr in rows:
                r = sr.get(n)
                v = (r.gbps if metric == "GB/s" else r.tflops) if r is not None and r.ok else None
                vals.append(v or 0.0)
            ax.bar([i + k * width for i in range(len(rows))], vals, width, label=n)
        ceil = [(i, sr.ceiling_gbps) for i, sr in enumerate(rows) if metric == "GB/s" and sr.ceiling_gbps]
        for j, (i, c) in enumerate(ceil):
            ax.hlines(c, i - width / 2, i + 0.8 - width / 2, colors="black", linewidth=2,
                      label="ceiling" if j == 0 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([sr.shape.label for sr in rows], rotation=25, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(metric + (" (K+V read once)" if metric == "GB/s" else " (causal)"), fontsize=8)
        ax.set_title(f"{suite.name}: {suite.description}", fontsize=9, loc="left")
        ax.legend(fontsize=7)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=plot_format(path), dpi=120)
    plt.close(fig)
    Path(path).write_bytes(image.getvalue())  # the very path asked for; a write error (a full disk) is raised
    return None


#: The image formats ``--plot`` writes, by the file name's extension (none: PNG).
PLOT_FORMATS = ("png", "pdf", "svg")


def plot_format(path: str) -> str:
    """The image format of ``--plot path``: its extension, lower-cased, or ``png`` without one."""
    return Path(path).suffix[1:].lower() or "png"
