"""``metal-attn bench``: providers side by side with their peers, on the same shapes, in one run.

Wired into the ``metal-attn`` command through `add_arguments` and `run`; also
runnable alone: ``python -m metal_attn.bench.cli --suite smoke``.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from metal_attn.bench import baselines
from metal_attn.bench.candidates import ProviderCandidate, with_variants
from metal_attn.bench.core import ShapeResult, SuiteResult, machine_info, run_suite
from metal_attn.bench.ratios import CEILING_RATIO, RATIO_NAMES, SPEEDUP_PEERS, peer_ratio_key
from metal_attn.bench.render import PLOT_FORMATS, TableStream, plot_format, render_markdown, render_rich, write_plot
from metal_attn.bench.shapes import Shape
from metal_attn.bench.suites import SUITES, Suite, default_suite, get_suite
from metal_attn.bench.timing import MAX_INNER, MIN_SAMPLE_S, PIPELINED_MIN_SAMPLE_S
from metal_attn.cli_common import guarded, int_flag
from metal_attn.device import current_device, detect_backend
from metal_attn.plugins import check_provider_setting, get_registry
from metal_attn.settings import get_settings

SCHEMA = baselines.RUN_SCHEMA

#: The margin `--write-baseline` states when no `--margin` is given.
DEFAULT_MARGIN = 0.5


def _csv(value: str) -> list[str]:
    """Comma-separated names; a comma between brackets belongs to a variant (``auto[a=1,b=2]``)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            out.append(value[start:i].strip())
            start = i + 1
    out.append(value[start:].strip())  # the last name, brackets closed or not (a variant check names it)
    return [x for x in out if x]


#: `_csv` for other modules (benchmarks/conftest.py splits its options as the flags are split).
split_names = _csv




#: How long ``--suite generate`` takes (its own module loads mlx-lm, so it is described here).
GENERATE_RUNTIME = "a model against mlx-lm: about 3 minutes on an H200, 25 minutes on a 2-core CPU with its defaults"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` flags to ``parser``."""
    parser.add_argument("--suite", action="append", metavar="NAME",
                        help="suite(s) to run, repeatable or comma-separated; default: decode-cpu on the CPU, "
                             "decode-gpu on GPUs. How long each takes: "
                             + "; ".join(f"{s.name} ({s.runtime})" for s in SUITES.values())
                             + f"; generate ({GENERATE_RUNTIME}; --candidates engine_eager,engine_compiled,... "
                               "adds the engine with compiled decode steps forced off / on). Each shape's rows are "
                               "printed as it completes")
    parser.add_argument("--candidates", metavar="A,B,...",
                        help="providers by name (auto = the registry's choice) and peers (gather_sdpa, mlx_sdpa, "
                             "mlx_sdpa_packed: not in decode-step, torch_sdpa, ceiling); default: the suite's")
    parser.add_argument("--shapes", metavar="PATTERN,...",
                        help="only shapes whose label contains a pattern (or matches a glob), case-insensitive")
    parser.add_argument("--warmup", type=int_flag(0), metavar="N",
                        help="untimed calls before timing (the first compiles and gives the checked output); "
                             "default: the suite's")
    parser.add_argument("--iters", type=int_flag(1), metavar="N",
                        help=f"timed samples, each a synchronized loop lasting >= {MIN_SAMPLE_S * 1e3:g} ms "
                             f"(>= {PIPELINED_MIN_SAMPLE_S * 1e3:g} ms with --pipelined; at most {MAX_INNER} calls); "
                             "the median is reported; default: the suite's")
    parser.add_argument("--pipelined", action="store_true",
                        help="queue the timed calls (mx.async_eval, torch without a sync per call) and wait once "
                             "per sample: kernel throughput; default: every call waits for its result (mx.eval)")
    parser.add_argument("--interleave", action="store_true",
                        help="take the timed candidates' samples in turn, one of each per round, so a drift of the "
                             "machine lands on all alike; default: each candidate's samples in a row")
    parser.add_argument("--seed", type=int_flag(0), metavar="N", help="random seed of the inputs (default 0)")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="every raw median and machine info as JSON: on stdout (tables then go to stderr), "
                             "or into PATH")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a bar chart: PNG, or PDF or SVG by PATH's extension (needs matplotlib)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables to paste into docs")
    parser.add_argument("--list", action="store_true",
                        help="list the suites, their shapes and candidates, and exit (reads --suite and --json only)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or progress lines on stderr")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every flag and name, print what would run (suites, shapes, candidates; the "
                             "generate suite's workloads) and exit 0, timing nothing and loading no model; exit 2 "
                             "where the run would. It exits 0 where the run itself would stop: a GPU suite is "
                             "checked on any backend (a plan for a device call, checked before it), and a --compare "
                             "baseline of another machine class is said on stderr (the run would exit 1)")
    b = parser.add_argument_group("regression tracking by ratios (benchmarks/baselines/, benchmarks/README.md)")
    b.add_argument("--compare", metavar="BASELINE.json",
                   help="print every ratio of the baseline against this run (default suites: the baseline's); "
                        "exit 1 when one falls below baseline * (1 - the file's margin), when a baseline case is "
                        "missing from the run or when the machine class differs")
    b.add_argument("--write-baseline", metavar="FILE",
                   help="write this run's ratios (every provider result: speedup vs each peer, fraction of the "
                        "ceiling) as a baseline for this machine class; refused before the run when FILE is an "
                        "input or another output, holds another machine class's baseline, or the candidates "
                        "cannot give one; not written when --compare fails")
    b.add_argument("--from-json", metavar="RUN.json", nargs="+",
                   help="take the results of a run saved with --json instead of measuring: with --write-baseline "
                        "or --compare (its machine class is the run's; several runs of one machine class and suites "
                        "count as one whose repeats are all of theirs, each ratio its median over them), or alone "
                        "to print each run's tables again (--markdown, --plot)")
    b.add_argument("--repeat", type=int_flag(1), metavar="N",
                   help="run the suites N times (default 1); --compare and --write-baseline take each ratio's "
                        "median over the runs; --suite generate runs each concurrency's candidates N times in "
                        "alternating order and reports the median of the rounds' ratios")
    b.add_argument("--ratios", metavar="PATTERN,...",
                   help="with --write-baseline: store only the ratios whose names match a glob "
                        "(e.g. 'speedup_vs_*'); default: all")
    b.add_argument("--margin", type=_margin_flag, metavar="M",
                   help=f"with --write-baseline: the fraction a ratio may fall below its baseline, 0 <= M < 1 "
                        f"(default {DEFAULT_MARGIN})")
    g = parser.add_argument_group("--suite generate (model generation throughput against mlx-lm)")
    g.add_argument("--concurrency", metavar="N,...", help="requests at once (default 1,8,32,64 on GPUs, 1,8,32 on "
                                                          "the CPU)")
    g.add_argument("--prompt-len", type=int_flag(1), metavar="N", help="prompt tokens (default 512; CPU 32)")
    g.add_argument("--gen-tokens", type=int_flag(1), metavar="N", help="tokens generated per request "
                                                                            "(default 128; CPU 32)")
    g.add_argument("--shared-prefix", type=int_flag(0), metavar="N",
                   help="tokens of the shared system prompt of the prefix-caching workload (default 2048 on GPUs, "
                        "0 = off on the CPU)")
    g.add_argument("--num-layers", type=int_flag(1), metavar="N", help="layers of the GPU model (default 32)")


def _margin_flag(text: str) -> float:
    """An argparse type: a number (its range, ``[0, 1)``, is checked with the baseline, `baselines.check_margin`)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r} (allowed: a number >= 0 and < 1, the fraction "
                                         "a ratio may fall below its baseline)") from None


def to_json(suites: Sequence[SuiteResult], machine: dict[str, Any], argv: Sequence[str] | None,
            comparison: baselines.Comparison | None = None) -> dict[str, Any]:
    out = {"schema": SCHEMA, "machine": machine, "argv": list(argv) if argv is not None else None,
           "suites": [s.to_dict() for s in suites]}
    if comparison is not None:
        out["comparison"] = comparison.to_dict()
    return out


#: The generate suite's entry in a listing (its workload is flags, not shapes).
GENERATE_DESCRIPTION = ("the engine against mlx-lm's BatchGenerator and generate_step on one model (SmolLM2 on the "
                        "CPU, an 8B-shaped random llama on GPUs)")
GENERATE_WORKLOAD = ("--concurrency 1,8,32,64 (CPU 1,8,32), --prompt-len 512 (CPU 32), --gen-tokens 128 (CPU 32), "
                     "--shared-prefix 2048 (CPU 0: off)")


def suites_as_dict(names: Sequence[str] | None = None) -> dict[str, Any]:
    """The suites (``names`` only, when given): what ``--list --json`` prints and ``--list`` shows as text.
    Each kernel suite with its target, timing, candidates and shape labels; the generate suite with its
    candidates (the default ones first) and its workload flags."""
    out: dict[str, Any] = {"suites": [
        {"name": s.name, "target": s.target, "warmup": s.warmup, "iters": s.iters, "runtime": s.runtime,
         "description": s.description, "candidates": list(s.candidates), "shapes": [sh.label for sh in s.shapes]}
        for s in SUITES.values() if names is None or s.name in names]}
    if names is None or "generate" in names:
        from metal_attn.bench import generate

        out["suites"].append({"name": "generate", "target": "any", "runtime": GENERATE_RUNTIME,
                              "description": GENERATE_DESCRIPTION, "candidates": list(generate.RUNNERS),
                              "default_candidates": list(generate.DEFAULT_CANDIDATES), "workload": GENERATE_WORKLOAD})
    return out


def list_suites(file: TextIO, names: Sequence[str] | None = None) -> None:
    """`suites_as_dict` as text: each suite's header, candidates and shapes."""
    for s in suites_as_dict(names)["suites"]:
        if "shapes" in s:
            print(f"{s['name']} ({s['target']}; warmup {s['warmup']}, iters {s['iters']}; {s['runtime']}): "
                  f"{s['description']}", file=file)
            print(f"  candidates: {', '.join(s['candidates'])}", file=file)
            for label in s["shapes"]:
                print(f"  - {label}", file=file)
            continue
        defaults = s["default_candidates"]
        print(f"{s['name']} ({s['target']}; {s['runtime']}): {s['description']}", file=file)
        print(f"  candidates: {', '.join(defaults)} (also: "
              f"{', '.join(n for n in s['candidates'] if n not in defaults)})", file=file)
        print(f"  - {s['workload']}", file=file)


def print_plan(plan: Sequence[tuple[Any, Sequence[Any], Sequence[Any]]], repeat: int, backend: str,
               needs_gpu: Sequence[str], compare_to: baselines.Baseline | None, file: TextIO,
               write_to: str | None = None, write_class: str | None = None) -> None:
    """What a ``--dry-run`` would have measured: each suite's shapes and candidates, in run order."""
    for s, shapes, cands in plan:
        where = f"; needs a GPU backend (this is {backend})" if s.name in needs_gpu else ""
        print(f"would run {s.name}: {len(shapes)} shapes x {len(cands)} candidates, {repeat} time(s){where}",
              file=file)
        print(f"  candidates: {', '.join(c.name for c in cands)}", file=file)
        for sh in shapes:
            print(f"  - {sh.label}", file=file)
    if compare_to is not None:
        print(f"would compare against {compare_to.path} ({compare_to.machine_class}, {len(compare_to.entries)} "
              f"cases, margin {compare_to.margin:g})", file=file)
    if write_to is not None:
        where = f"machine class {write_class}" if write_class else "the machine class of the GPU that runs it"
        print(f"would write baseline {write_to} ({where})"
              + (", if the comparison passes" if compare_to is not None else ""), file=file)
    print("dry run: every flag and name checked; nothing timed", file=file)


# -- the command -------------------------------------------------------------------------------------


def _problems(results: Sequence[SuiteResult]) -> list[str]:
    out = []
    for s in results:
        for sr in s.results:
            for r in sr.candidates:
                if r.status == "error":
                    out.append(f"{s.name} / {sr.shape.label} / {r.name}: {'; '.join(r.reasons)}")
                elif r.check is not None and not r.check.get("ok", True):
                    out.append(f"{s.name} / {sr.shape.label} / {r.name}: output differs from {r.check['against']} "
                               f"({r.check.get('error') or format(r.check['rel_l2'], '.2e')})")
    return out


def _cannot_write(path: str) -> str | None:
    """Why ``path`` cannot be written, or ``None``: tried now (opened for appending, and removed
    again if this made it), so a run never measures for minutes and then fails to save."""
    if not path:
        return "is empty"
    p = Path(path)
    if p.is_dir():
        return "is a folder"
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    if not existed:
        p.unlink(missing_ok=True)
    return None


def _check_usage(args: argparse.Namespace, err: TextIO) -> int | None:
    """Exit 2 naming the flag, before anything runs: an output path that cannot be written, or an
    empty value where a file or a name is needed (an unset ``--compare "$BASE"`` must not pass)."""
    for flag, attr in (("--json", "json"), ("--plot", "plot"), ("--write-baseline", "write_baseline")):
        value = getattr(args, attr, None)
        if value is None or (attr == "json" and value == "-"):
            continue
        why = _cannot_write(value)
        if why:
            print(f"metal-attn bench: error: {flag} {value!r} {why} (allowed: a file path in a writable folder)",
                  file=err)
            return 2
        if attr == "plot" and plot_format(value) not in PLOT_FORMATS:
            print(f"metal-attn bench: error: --plot {value!r} names a .{plot_format(value)} file (allowed: a file "
                  f"name ending in {', '.join('.' + f for f in PLOT_FORMATS)}, or without an extension: PNG)", file=err)
            return 2
    if getattr(args, "compare", None) == "":
        print("metal-attn bench: error: --compare '' names no file (allowed: a baseline JSON file)", file=err)
        return 2
    for flag, attr in (("--suite", "suite"), ("--candidates", "candidates")):
        values = getattr(args, attr, None)
        values = [values] if isinstance(values, str) else values
        if values and not [n for v in values for n in _csv(v)]:
            print(f"metal-attn bench: error: {flag} {' '.join(map(repr, values))} names nothing (allowed: names, "
                  "comma-separated; --list shows them)", file=err)
            return 2
    clash = _path_clash(args)
    if clash:
        print(f"metal-attn bench: error: {clash}", file=err)
        return 2
    return None


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same file on disk where both exist (a link, another spelling),
    else the same absolute path once resolved."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _path_clash(args: argparse.Namespace) -> str | None:
    """An output path that is an input or another output (``--compare X --write-baseline X`` wrote the new
    baseline over the one it compared against; ``--json P --write-baseline P`` kept only the second), naming
    both flags; or ``None``."""
    inputs = [("--compare", getattr(args, "compare", None))]
    inputs += [("--from-json", p) for p in getattr(args, "from_json", None) or ()]
    json_path = getattr(args, "json", None)
    outputs = [("--json", None if json_path == "-" else json_path), ("--plot", getattr(args, "plot", None)),
               ("--write-baseline", getattr(args, "write_baseline", None))]
    inputs, outputs = [(f, v) for f, v in inputs if v], [(f, v) for f, v in outputs if v]
    for i, (flag, value) in enumerate(outputs):
        for other, theirs, does in [*((f, v, "reads") for f, v in inputs),
                                    *((f, v, "writes") for f, v in outputs[:i])]:
            if _same_file(value, theirs):
                return (f"{flag} {value!r} is the file {other} {does} ({theirs!r}); one would be lost (allowed: "
                        f"another path for {flag})")
    return None


def _unknown_providers(cands: Sequence[Any], registered: Sequence[str]) -> list[str]:
    """The names among ``cands`` that force a provider no plugin registered (``auto``, peers and the decode
    step's ``auto_compiled``, a provider candidate of another kind, pass)."""
    known = {*registered, "auto"}
    forcing = [getattr(c, "base", c) for c in cands]
    return [c.name for c, base in zip(cands, forcing, strict=True)
            if isinstance(base, ProviderCandidate) and base.kind == "provider" and base.name not in known]


#: Flags only the kernel suites read, and flags only the generate suite reads (argparse attribute names).
_KERNEL_SUITE_FLAGS = ("shapes", "markdown", "plot", "iters", "warmup", "pipelined", "interleave")
_GENERATE_SUITE_FLAGS = ("concurrency", "prompt_len", "gen_tokens", "shared_prefix", "num_layers")


def _given(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The flags among ``names`` (argparse attribute names) given on this command line, as ``--flag``."""
    return [f"--{n.replace('_', '-')}" for n in names
            if getattr(args, n, None) is not None and getattr(args, n) is not False]  # 0 is given, False is not


def _ignored_with_from_json(args: argparse.Namespace, names: Sequence[str], does: str, allowed: str,
                            err: TextIO) -> bool:
    """Print why the given flags among ``names`` would be ignored by ``--from-json``, which ``does`` that
    (``allowed``: the flags it reads); True when any was given."""
    unused = _given(args, names)
    if unused:
        print(f"metal-attn bench: error: --from-json {' '.join(args.from_json)} {does}, so {', '.join(unused)} "
              f"would be ignored ({allowed})", file=err)
    return bool(unused)


def _unused_flags(args: argparse.Namespace, names: Sequence[str], suites: str, err: TextIO) -> int | None:
    """Exit 2 naming the given flags that ``suites`` would ignore (they were silently dropped)."""
    given = _given(args, names)
    if given:
        whose = "the kernel suites" if names is _KERNEL_SUITE_FLAGS else "--suite generate"
        print(f"metal-attn bench: error: {suites} does not read {', '.join(given)} (they are flags of {whose})",
              file=err)
        return 2
    return None


#: Flags ``--list`` does not read (argparse attribute names): given with it, they were silently ignored.
_IGNORED_BY_LIST = ("candidates", "shapes", "warmup", "iters", "pipelined", "interleave", "seed", "plot", "markdown",
                    "dry_run", "compare", "write_baseline", "from_json", "repeat", "ratios", "margin",
                    *_GENERATE_SUITE_FLAGS)


class UsageError(ValueError):
    """A flag's value the bench refuses before measuring; the message names the flag, its value and what is
    allowed (`metal-attn bench` exits 2 with it; benchmarks/conftest.py raises ``pytest.UsageError``)."""


def check_backend(suites: Sequence[Suite], backend: str, flag: str = "--suite") -> None:
    """`UsageError` when a GPU suite is asked for on the CPU backend (its GPU-sized shapes would run on the CPU's
    reference paths for minutes)."""
    misplaced = [s.name for s in suites if s.target == "gpu" and backend == "cpu"]
    if misplaced:
        raise UsageError(f"{flag} {','.join(misplaced)} needs a GPU backend (this is {backend}; allowed here: "
                         f"{', '.join(s.name for s in SUITES.values() if s.target != 'gpu')})")


def select_shapes(suite: Suite, text: str | None, flag: str = "--shapes") -> tuple[Shape, ...]:
    """The shapes of ``suite`` a ``--shapes`` value selects (``None``: all); `UsageError` when it holds no pattern
    (``,`` used to select every shape) or matches no shape of the suite."""
    if text is None:
        return suite.shapes
    patterns = _csv(text)
    if not patterns:
        raise UsageError(f"{flag} {text!r} holds no pattern (allowed: labels or globs, comma-separated, "
                         "e.g. decode,b8)")
    shapes = suite.select(patterns)
    if not shapes:
        raise UsageError(f"{flag} {text!r} matches no shape of suite {suite.name!r} (its shapes: "
                         f"{'; '.join(x.label for x in suite.shapes)})")
    return shapes


def resolve_candidates(suite: Suite, names: Sequence[str], *, typed: bool, flag: str = "--candidates") -> list[Any]:
    """The candidates ``names`` name on ``suite``, ``NAME[setting=value;...]`` variants included; `UsageError`
    for none, a malformed variant, or (``typed``: the names were given by the user) a provider no plugin
    registered, which would measure nothing and pass. A name from elsewhere (a suite's defaults, a baseline's
    list) of a plugin this machine lacks stays: it is measured as ``not registered``."""
    if not names:
        raise UsageError(f"{flag} names nothing (allowed: names, comma-separated; --list shows them)")
    try:
        cands = with_variants(suite.resolve)(names)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if typed:
        registered = get_registry().names
        unknown = _unknown_providers(cands, registered)
        if unknown:
            peers = [n for n in suite.candidates if n not in registered and n != "auto"]
            raise UsageError(f"{flag} {unknown[0]!r} is neither a registered provider nor a candidate of suite "
                             f"{suite.name!r} (allowed: auto, {', '.join(registered)}, or the suite's peers: "
                             f"{', '.join(peers)})")
    return cands


def baseline_plan_problem(plan: Sequence[tuple[Suite, Sequence[Shape], Sequence[Any]]],
                          ratios: Sequence[str] | None) -> str | None:
    """Why a run of ``plan`` could not write a baseline (``ratios``: the ``--ratios`` globs), or ``None``: a
    baseline stores the ratios of candidates of `baselines.TRACKED_KINDS` (providers, ``auto``, the decode step's
    ``auto_compiled``), and a ratio needs a peer of `SPEEDUP_PEERS` or the ceiling (on a shape with GB/s) among
    the candidates. What only the run can tell (a peer unavailable here, a provider refusing) is found after it."""
    tracked_any = False
    for _, shapes, cands in plan:
        tracked = [c for c in cands if c.kind in baselines.TRACKED_KINDS]
        tracked_any = tracked_any or bool(tracked)
        names = {c.name for c in cands}
        can = [peer_ratio_key(p) for p in SPEEDUP_PEERS if p in names]
        if "ceiling" in names and any("GB/s" in sh.metrics for sh in shapes):
            can.append(CEILING_RATIO)
        if ratios is not None:
            can = [k for k in can if any(fnmatch.fnmatchcase(k, pat) for pat in ratios)]
        if tracked and can:
            return None
    if not tracked_any:
        return (f"no candidate whose ratios a baseline stores (allowed: a provider, auto, auto_compiled or auto_staged "
                f"among the candidates, kinds {', '.join(baselines.TRACKED_KINDS)}; peers and variants are not stored)")
    which = f" matching --ratios {','.join(ratios)}" if ratios else ""
    return (f"no ratio{which} a provider could carry (allowed: a peer among {', '.join(SPEEDUP_PEERS)}, or the "
            "ceiling on shapes with GB/s, among the candidates)")


def run(args: argparse.Namespace) -> int:
    """Run the ``bench`` command; returns the exit code (0 ok, 1 a candidate failed or disagreed, 2 bad usage)."""
    err = sys.stderr
    if getattr(args, "list", False):
        ignored = _given(args, _IGNORED_BY_LIST)
        if ignored:
            print(f"metal-attn bench: error: --list prints the suites and exits, so {', '.join(ignored)} would be "
                  "ignored (allowed with --list: --suite, --json, --quiet)", file=err)
            return 2
        names = [n for v in args.suite for n in _csv(v)] if args.suite else None
        unknown = [n for n in names or () if n not in SUITES and n != "generate"]
        if unknown or names == []:
            print(f"metal-attn bench: error: --list --suite {unknown[0] if unknown else ''!r}: no such suite (known: "
                  f"{', '.join([*SUITES, 'generate'])})", file=err)
            return 2
        if args.json == "-":
            print(json.dumps(suites_as_dict(names)))
        else:
            list_suites(sys.stdout, names)
            if args.json and not _write_json_file(args.json, suites_as_dict(names), err):
                return 2
        return 0
    early = _check_usage(args, err)
    if early is not None:
        return early
    dry_run = getattr(args, "dry_run", False)
    if getattr(args, "from_json", None):
        if dry_run:
            print("metal-attn bench: error: --dry-run checks a measuring run; --from-json measures nothing "
                  "(run it without --dry-run)", file=err)
            return 2
        return _from_saved_run(args, err)
    if not dry_run:
        early = _check_backend_override(err)
        if early is not None:
            return early
    check_provider_setting()  # METAL_ATTN_PROVIDER naming no provider: every candidate would be refused
    typed_candidates = args.candidates  # before a --compare baseline's own list may stand in for it
    compare_to, early = _baseline_options(args, err)
    if early is not None:
        return early
    default = list(compare_to.suites) if compare_to is not None else [default_suite(current_device().backend)]
    names = [n for v in (args.suite or default) for n in _csv(v)]
    if "generate" in names:
        if compare_to is not None or args.write_baseline:
            print("metal-attn bench: error: --compare and --write-baseline take kernel suites; --suite generate "
                  "writes its ratios to its own JSON", file=err)
            return 2
        if len(names) > 1:
            print("metal-attn bench: error: --suite generate runs alone (it loads a model)", file=err)
            return 2
        early = _unused_flags(args, _KERNEL_SUITE_FLAGS, "--suite generate", err)
        if early is not None:
            return early
        from metal_attn.bench import generate

        rc = generate.run(args)
        _report_idle_commits(err)
        return rc
    try:
        suites = [get_suite(n) for n in dict.fromkeys(names)]
    except ValueError as exc:
        print(f"metal-attn bench: error: {exc}", file=err)
        return 2
    early = _unused_flags(args, _GENERATE_SUITE_FLAGS, f"--suite {','.join(names)}", err)
    if early is not None:
        return early
    if compare_to is not None:
        left_out = [x for x in compare_to.suites if x not in names]
        if left_out:  # the run measured for minutes, then failed with every such case missing
            print(f"metal-attn bench: error: --suite {','.join(names)} leaves out suite(s) {', '.join(left_out)} of "
                  f"--compare {compare_to.path}, whose entries are of {', '.join(compare_to.suites)} (allowed: "
                  f"--suite {','.join(compare_to.suites)}, or no --suite: the baseline's suites)", file=err)
            return 2
    backend = current_device().backend
    misplaced = [s.name for s in suites if s.target == "gpu" and backend == "cpu"]
    try:
        if not dry_run:
            check_backend(suites, backend)  # they used to run here for minutes, timing GPU-sized shapes on the CPU
        chosen = [(s, select_shapes(s, args.shapes)) for s in suites]
    except UsageError as exc:
        print(f"metal-attn bench: error: {exc}", file=err)
        return 2
    json_to_stdout = args.json == "-"
    out = err if json_to_stdout else sys.stdout
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"metal-attn bench: note: matplotlib is not importable; --plot {args.plot} will be skipped",
                  file=err)
    machine = machine_info()
    results: list[SuiteResult] = []
    plan = []
    for s, shapes in chosen:
        cand_names = _csv(args.candidates) if args.candidates else list(s.candidates)
        try:
            # A name typed on this command line must be a registered provider or a candidate of the suite; one of
            # a --compare baseline's list from a plugin this machine lacks is measured as `not registered`.
            cands = resolve_candidates(s, cand_names, typed=bool(typed_candidates))
        except UsageError as exc:
            print(f"metal-attn bench: error: {exc}", file=err)
            return 2
        plan.append((s, shapes, cands))
    if args.write_baseline:
        why = baseline_plan_problem(plan, _csv(args.ratios) if args.ratios else None)
        if why:  # it used to be found after the whole run, which then wrote nothing
            print(f"metal-attn bench: error: --write-baseline {args.write_baseline}: {why}", file=err)
            return 2
        # Another machine class's file (a CPU run over cuda-nvidia-h200.json). Not where a dry run plans a GPU suite on
        # the CPU: the run's machine class is then the GPU's, known only there (where the run checks it again).
        why = None if misplaced else baselines.replace_problem(args.write_baseline, baselines.machine_class(machine))
        if why:
            print(f"metal-attn bench: error: --write-baseline {args.write_baseline!r} {why}", file=err)
            return 2
    repeat = getattr(args, "repeat", None) or 1
    if dry_run:
        # --json on stdout: the plan as JSON there, its text on stderr (as a measuring run's tables go).
        print_plan(plan, repeat, backend, misplaced, compare_to, err if json_to_stdout else sys.stdout,
                   args.write_baseline, None if misplaced else baselines.machine_class(machine))
        data = {"dry_run": True, "repeat": repeat, "backend": backend, "suites": [
            {"name": s.name, "needs_gpu": s.name in misplaced, "candidates": [c.name for c in cands],
             "shapes": [sh.label for sh in shapes]} for s, shapes, cands in plan]}
        if json_to_stdout:  # a --json PATH is the measuring run's: a dry run checks it and writes nothing there
            print(json.dumps(data))
        return 0
    runs: list[list[SuiteResult]] = []
    total = repeat * sum(len(shapes) * len(c) for _, shapes, c in plan)
    with _Progress(total, quiet=args.quiet, file=err) as bar:
        for i in range(repeat):
            runs.append(this_run := [])
            if repeat > 1:
                with bar.hidden(out):
                    print(f"run {i + 1} of {repeat} (--repeat {repeat})", file=out)
            for s, shapes, cands in plan:
                with bar.hidden(out):
                    stream = TableStream(s.name, s.description, shapes, [c.name for c in cands], out)

                def on_shape(sr: ShapeResult, _stream: TableStream = stream) -> None:
                    with bar.hidden(out):
                        _stream.shape(sr)

                suite = run_suite(
                    s.name, shapes, cands, warmup=s.warmup if args.warmup is None else args.warmup,
                    iters=s.iters if args.iters is None else args.iters, description=s.description, seed=args.seed or 0,
                    pipelined=getattr(args, "pipelined", False), progress=lambda msg, _s=s: bar.step(_s.name, msg),
                    on_shape=on_shape, rotate=i, interleave=getattr(args, "interleave", False),
                )
                this_run.append(suite)
                results.append(suite)
                with bar.hidden(out):
                    stream.close(suite, machine)
                if suite.interrupted:
                    print(f"metal-attn bench: interrupted: {len(suite.results)} of {len(shapes)} shapes of "
                          f"{s.name} completed (their rows are above)", file=err)
                    break
            if any(r.interrupted for r in this_run):
                break
    interrupted = any(r.interrupted for r in results)
    machine = machine_info() | {"date": machine["date"]}  # torch may have been imported by now
    if args.markdown:
        for r in results:
            print(render_markdown(r, machine), file=out)
    _report_idle_commits(err)
    argv = getattr(args, "argv", None) or sys.argv[1:]
    comparison = None
    if compare_to is not None:
        comparison = baselines.compare(compare_to, baselines.run_cases(runs), baselines.machine_class(machine))
        baselines.render(comparison, out)
    if args.json:
        text = json.dumps(to_json(results, machine, argv, comparison), indent=1)
        if json_to_stdout:
            print(text)
        else:
            try:
                Path(args.json).write_text(text + "\n")
                print(f"wrote {args.json}", file=err)
            except OSError as exc:
                print(f"metal-attn bench: error: --json {args.json!r}: not written ({exc.strerror or exc})", file=err)
                return 1
    if args.plot:
        try:
            msg = write_plot(results, args.plot)
        except OSError as exc:
            print(f"metal-attn bench: error: --plot {args.plot!r}: not written ({exc.strerror or exc})", file=err)
            return 1
        print(msg or f"wrote {args.plot}", file=err)
    problems = _problems(results)
    for p in problems:
        print(f"metal-attn bench: problem: {p}", file=err)
    failed = comparison is not None and comparison.failed
    written = (_write_baseline(args, runs, machine, argv, problems, interrupted, err, compare_failed=failed)
               if args.write_baseline else True)
    if comparison is not None:
        for p in comparison.problems():
            print(f"metal-attn bench: compare: {p}", file=err)
    if interrupted:
        return 130
    return 1 if problems or not written or (comparison is not None and comparison.failed) else 0


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The measurement options of `baselines.RUN_OPTIONS` given on this command line (None: not given)."""
    return {"candidates": args.candidates, "warmup": args.warmup, "iters": args.iters,
            "repeat": getattr(args, "repeat", None), "pipelined": True if getattr(args, "pipelined", False) else None,
            "interleave": True if getattr(args, "interleave", False) else None}


def _apply_baseline_run(args: argparse.Namespace, base: baselines.Baseline, err: TextIO) -> None:
    """Measure as the baseline was measured where this command line says nothing else, and say so."""
    given = _run_options(args)
    taken = {k: v for k, v in base.run.items() if given.get(k) is None}
    for k, v in taken.items():
        setattr(args, k, v)
    if taken:
        flags = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in taken.items())
        print(f"metal-attn bench: compare: measuring with the baseline's options: {flags}", file=err)


def _baseline_options(args: argparse.Namespace, err: TextIO) -> tuple[baselines.Baseline | None, int | None]:
    """``(the --compare baseline or None, an exit code to stop with or None)``: bad files and usage exit 2,
    a baseline of another machine class exits 1 before anything runs."""
    compare, write, margin = (getattr(args, k, None) for k in ("compare", "write_baseline", "margin"))
    for flag, value in (("--margin", margin), ("--ratios", getattr(args, "ratios", None))):
        if value is not None and not write:
            print(f"metal-attn bench: error: {flag} goes with --write-baseline (a comparison uses what its baseline "
                  "file states)", file=err)
            return None, 2
    if margin is not None:
        try:
            baselines.check_margin(margin, "--margin")
        except baselines.BaselineError as exc:
            print(f"metal-attn bench: error: {exc}", file=err)
            return None, 2
    if getattr(args, "ratios", None) and not _ratio_patterns_known(args.ratios, err):
        return None, 2
    if not compare:
        return None, None
    try:
        base = baselines.load(compare)
    except baselines.BaselineError as exc:
        print(f"metal-attn bench: error: --compare {exc}", file=err)
        return None, 2
    here = baselines.machine_class(machine_info())
    if here != base.machine_class:
        print(f"metal-attn bench: compare: {baselines.machine_mismatch_message(base, here)}", file=err)
        if not getattr(args, "dry_run", False):
            return base, 1
        print("metal-attn bench: compare: --dry-run goes on (a run here would stop with exit 1)", file=err)
    _apply_baseline_run(args, base, err)
    return base, None


def _from_saved_run(args: argparse.Namespace, err: TextIO) -> int:
    """``--from-json RUN.json``: write a baseline from a saved run, compare one against a baseline, or print its
    tables again, measuring nothing. 0 ok, 1 a comparison failed or the run cannot make a baseline, 2 bad usage
    or files."""
    compare, write = getattr(args, "compare", None), getattr(args, "write_baseline", None)
    sources = " ".join(args.from_json)
    if compare and write:
        print(f"metal-attn bench: error: --from-json {sources} goes with one of --write-baseline and --compare, "
              "or with neither (to print its tables)", file=err)
        return 2
    measuring = [f for f, v in (("--suite", args.suite), ("--shapes", args.shapes), ("--candidates", args.candidates),
                                ("--repeat", getattr(args, "repeat", None)),
                                ("--seed", getattr(args, "seed", None))) if v is not None]
    if measuring:
        print(f"metal-attn bench: error: --from-json {sources} measures nothing, so {', '.join(measuring)} "
              "cannot apply (the saved run's suites, shapes and candidates are used)", file=err)
        return 2
    if not (compare or write):
        return _show_saved_runs(args, err)
    if _ignored_with_from_json(args, ("json", "plot", "markdown", "iters", "warmup", "pipelined", "interleave",
                                      *_GENERATE_SUITE_FLAGS), "writes only a baseline or a comparison table",
                               "allowed with --from-json: --compare or --write-baseline, --ratios, --margin", err):
        return 2
    if compare and (args.ratios or args.margin is not None):
        print("metal-attn bench: error: --ratios and --margin go with --write-baseline", file=err)
        return 2
    if args.ratios and not _ratio_patterns_known(args.ratios, err):
        return 2
    try:
        if args.margin is not None:
            baselines.check_margin(args.margin, "--margin")
        saved = baselines.load_runs(args.from_json)
        base = baselines.load(compare) if compare else None
    except baselines.BaselineError as exc:
        print(f"metal-attn bench: error: {exc}", file=err)
        return 2
    if base is not None:
        if saved.interrupted:  # as --write-baseline refuses it: its missing cases are not a regression's
            print(f"metal-attn bench: error: --compare {compare}: not compared, the run {sources} was interrupted "
                  "(allowed: a complete run saved with --json)", file=err)
            return 1
        comparison = baselines.compare(base, saved.cases(), baselines.machine_class(saved.machine))
        baselines.render(comparison, sys.stdout)
        for p in comparison.problems():
            print(f"metal-attn bench: compare: {p}", file=err)
        # As a live --compare: a result that errored or whose output was wrong fails, whatever its ratios.
        for p in saved.problems:
            print(f"metal-attn bench: compare: the saved run had a problem: {p}", file=err)
        for key in ("pipelined", "interleave", "iters", "warmup"):  # a live --compare measures as the baseline did
            if (key in base.run or key in ("pipelined", "interleave")) and saved.run.get(key) != base.run.get(key):
                print(f"metal-attn bench: compare: warning: the saved run was measured with {key}="
                      f"{saved.run.get(key)!r}, the baseline with {key}={base.run.get(key)!r}: its ratios may not "
                      "be comparable (a live --compare measures as the baseline did)", file=err)
        return 1 if comparison.failed or saved.problems else 0
    why_not = None
    if saved.interrupted:
        why_not = "the run was interrupted"
    elif saved.problems:
        why_not = f"the run had {len(saved.problems)} problem(s): " + "; ".join(saved.problems)
    why = baselines.replace_problem(write, baselines.machine_class(saved.machine))
    if why:
        print(f"metal-attn bench: error: --write-baseline {write!r} {why}", file=err)
        return 2
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    argv = " ".join(saved.argv or ["(argv not recorded)"])
    runs = ("a run of" if len(args.from_json) == 1
            else f"{len(args.from_json)} runs ({saved.repeats} repeats in all), the first of them")
    given = "".join(f" {flag} {shlex.quote(str(v))}" for flag, v in (("--margin", args.margin),
                                                                     ("--ratios", args.ratios)) if v is not None)
    note = (f"written by `metal-attn bench --from-json {sources} --write-baseline {write}{given}` from {runs} "
            f"`metal-attn bench {argv}` on {saved.machine.get('date')}; a ratio may fall {margin:.0%} below its "
            "value here")
    stored = _store_baseline(write, margin, why_not, lambda: baselines.build_from_saved(
        saved, margin=margin, note=note, ratios=_csv(args.ratios) if args.ratios else None), err)
    return 0 if stored else 1


def _write_json_file(path: str, data: Any, err: TextIO) -> bool:
    """``--json PATH`` of ``--list``: ``data`` written there (said on stderr); False, with the reason, when it
    cannot be."""
    try:
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"metal-attn bench: error: --json {path}: cannot write it ({exc.strerror or exc})", file=err)
        return False
    print(f"wrote {path}", file=err)
    return True


def _ratio_patterns_known(text: str, err: TextIO) -> bool:
    """Whether every ``--ratios`` pattern names at least one ratio a result can carry (else say which does not,
    before anything is measured): a pattern matching nothing used to be dropped silently."""
    unknown = [p for p in _csv(text) if not any(fnmatch.fnmatchcase(n, p) for n in RATIO_NAMES)]
    if unknown:
        print(f"metal-attn bench: error: --ratios {', '.join(map(repr, unknown))} matches no ratio (allowed: names "
              f"or globs of {', '.join(RATIO_NAMES)}; every name ends in _ratio)", file=err)
    return not unknown


def _show_saved_runs(args: argparse.Namespace, err: TextIO) -> int:
    """``--from-json RUN.json ...`` alone: each saved run's tables as the run printed them (``--markdown``: its
    Markdown matrices; ``--plot``: one chart of every suite), each run under its path when there are several."""
    if _ignored_with_from_json(args, ("json", "iters", "warmup", "pipelined", "interleave", "ratios", "margin",
                                      *_GENERATE_SUITE_FLAGS),
                               "without --compare or --write-baseline prints the saved runs' tables",
                               "allowed: --markdown, --plot", err):
        return 2
    shown: list[tuple[str, dict[str, Any], list[SuiteResult]]] = []
    for path in args.from_json:
        try:
            data = baselines.read_run(path)  # its errors named as --compare and --write-baseline name them
            machine, suites = data["machine"], [SuiteResult.from_dict(s) for s in data["suites"]]
            for suite in suites:  # every field the tables read, before anything is printed
                if args.markdown:
                    render_markdown(suite, machine)
                else:
                    render_rich(suite, machine, io.StringIO())
            shown.append((path, machine, suites))
        except baselines.BaselineError as exc:
            print(f"metal-attn bench: error: {exc}", file=err)
            return 2
        except (KeyError, TypeError, ValueError) as exc:
            print(f"metal-attn bench: error: {path}: a result cannot be read back ({type(exc).__name__}: {exc}; "
                  "allowed: a run saved by `metal-attn bench --json`)", file=err)
            return 2
    for path, machine, suites in shown:
        if len(shown) > 1:
            print(f"from {path}:")
        for suite in suites:
            if args.markdown:
                print(render_markdown(suite, machine))
            else:
                render_rich(suite, machine, sys.stdout)
    if args.plot:
        try:
            msg = write_plot([s for _, _, suites in shown for s in suites], args.plot)
        except OSError as exc:
            print(f"metal-attn bench: error: --plot {args.plot!r}: not written ({exc.strerror or exc})", file=err)
            return 1
        print(msg or f"wrote {args.plot}", file=err)
    return 0


def _store_baseline(path: str, margin: float, why_not: str | None, build: Callable[[], dict[str, Any]],
                    err: TextIO) -> bool:
    """Write the baseline ``build()`` makes to ``path``, unless ``why_not`` says why the run cannot make
    one or building it raises `BaselineError` (each said on ``err``); whether it was written."""
    if why_not:
        print(f"metal-attn bench: error: --write-baseline {path}: not written, {why_not}", file=err)
        return False
    try:
        data = build()
    except baselines.BaselineError as exc:
        print(f"metal-attn bench: error: --write-baseline {path}: {exc}", file=err)
        return False
    try:
        baselines.write(path, data)
    except OSError as exc:
        print(f"metal-attn bench: error: --write-baseline {path}: not written ({exc.strerror or exc})", file=err)
        return False
    print(f"wrote baseline {path}: {len(data['entries'])} cases, machine class {data['machine_class']}, "
          f"margin {margin:g}", file=err)
    return True


def _write_baseline(args: argparse.Namespace, runs: Sequence[Sequence[SuiteResult]], machine: dict[str, Any],
                    argv: Sequence[str], problems: Sequence[str], interrupted: bool, err: TextIO, *,
                    compare_failed: bool = False) -> bool:
    """Write ``--write-baseline`` from a complete run without problems whose ``--compare`` (if any) passed (else
    say why not); whether it was."""
    why_not = None
    if interrupted:
        why_not = "the run was interrupted"
    elif problems:
        why_not = f"the run had {len(problems)} problem(s), listed above"
    elif compare_failed:  # a regression would have become the new baseline
        why_not = f"the comparison against {args.compare} failed (its problems are listed below)"
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    note = (f"written by `metal-attn bench {' '.join(argv)}` on {machine.get('date')}; "
            f"a ratio may fall {margin:.0%} below its value here")
    return _store_baseline(args.write_baseline, margin, why_not, lambda: baselines.build(
        runs, machine, margin=margin, argv=argv, note=note, ratios=_csv(args.ratios) if args.ratios else None,
        run=_run_options(args)), err)


class _Progress:
    """A progress bar on stderr (a terminal), or one line per step (a pipe or a log); nothing with
    ``quiet``. ``step(suite, msg)`` announces the measurement starting now."""

    def __init__(self, total: int, *, quiet: bool, file: TextIO) -> None:
        self.total, self.quiet, self.file = total, quiet, file
        self.done = 0
        self._bar = None

    def __enter__(self) -> _Progress:
        if not self.quiet and self.file.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from metal_attn.terminal import console

            self._bar = Progress(TextColumn("{task.description}", justify="left"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console(file=self.file), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self.total)
        return self

    def step(self, suite: str, msg: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=f"{suite}: {msg}"[:70])
        else:
            print(f"[{suite} {self.done + 1}/{self.total}] {msg}", file=self.file, flush=True)
        self.done += 1

    @contextlib.contextmanager
    def hidden(self, file: TextIO) -> Iterator[None]:
        """The bar off its terminal while the block prints to ``file`` there too (its redraws landed
        between a table's rows); as it was after."""
        if self._bar is None or not file.isatty():
            yield
            return
        self._bar.stop()
        try:
            yield
        finally:
            self._bar.start()

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _report_idle_commits(err: TextIO) -> None:
    """Where the process built CUDA chains: the graphs they launched for the GPU (``METAL_ATTN_CUDA_COMMIT_WHEN_IDLE``
    and its rule, docs/cuda-ops.md), counted over the whole process: an A/B in one process sums both sides."""
    from metal_attn import cuda_ops

    count = cuda_ops.idle_commits() if cuda_ops.chains_built else None
    if count is not None:
        print(f"CUDA chains: graphs launched for the GPU (commit_when_idle), this process: {count['idle']} on an "
              f"idle GPU, {count['ahead']} ahead of it; {count['direct']} chains launched straight onto the "
              "stream (cuda_idle_direct_chains)", file=err)


def _check_backend_override(err: TextIO) -> int | None:
    """Exit code 2 when ``METAL_ATTN_BACKEND_OVERRIDE`` names another backend than the one MLX computes on:
    the override is for routing inspection; a bench run under it timed the CPU under a GPU's suites and wrote
    baselines of a ``cuda-cpu`` machine class."""
    override, real = get_settings().backend_override, detect_backend()
    if override is None or override == real:
        return None
    print(f"metal-attn bench: error: METAL_ATTN_BACKEND_OVERRIDE={override!r}, but bench times the backend MLX "
          f"computes on here, {real!r} (allowed: the variable unset or {real!r}; the override is for routing "
          "inspection: metal-attn explain --device, or --dry-run)", file=err)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m metal_attn.bench.cli``: the same command without the ``metal-attn`` wrapper."""
    parser = argparse.ArgumentParser(prog="python -m metal_attn.bench.cli", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output on stderr (-v info, -vv debug); default from METAL_ATTN_LOG_LEVEL")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    return guarded("python -m metal_attn.bench.cli", lambda: run(args), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
