"""Baselines of same-run ratios per machine class, and the comparison of a run against one.

A baseline (``benchmarks/baselines/<machine class>.json``) stores, for each case (``suite / shape
label / candidate``), the ratios of `metal_attn.bench.ratios` measured on one machine class,
and the margin by which a later run may fall below them::

    {"schema": "metal-attn-baseline/1",
     "machine_class": "cpu-2core",            # `machine_class` of the machine that wrote it
     "suites": ["smoke"],                     # the suites of the entries: what `--compare` runs by default
     "margin": 0.6,                           # a ratio may fall to (1 - margin) * its baseline
     "note": "...",                           # free text: how it was made
     "run": {"candidates": "auto,classic,...", "iters": 9, "repeat": 3, ...},  # options given when writing
     "created": {"date", "argv", "repeat", "mode", "iters", "machine": {...}},
     "entries": {"smoke / decode b3 h4/2 d64 L100 f32 / auto":
                     {"speedup_vs_mlx_sdpa_ratio": 2.77, "ceiling_fraction_ratio": 0.17, ...}, ...}}

Every ratio's key ends in ``ratio`` and higher is better. A comparison fails when the machine
class differs, when a baseline case or ratio is missing from the run, or when a ratio is below
``baseline * (1 - margin)``. A file is checked whole when read (`parse`): every field of the
schema, each key once, ``suites`` the suites of the entries. Only providers' results (``kind``
``"provider"``, ``auto`` included, or ``"compiled"``) are written: the peers are what they are
measured against. A run saved with ``--json`` can make a baseline or be compared later
(`load_run`, ``metal-attn bench --from-json RUN.json``), and several saved runs as one
(`load_runs`: their repeats pooled, ``--from-json A.json B.json ...``). A run of several repeats
(``--repeat N``) gives each ratio as its median over the repeats, both when writing and when
comparing. ``run`` keeps the measurement options given when the baseline was written
(`RUN_OPTIONS`); ``--compare`` uses them where its own command line gives none. A baseline is
written over a file only where that file is empty or a baseline of the same machine class
(`replace_problem`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from metal_attn.bench.core import SuiteResult
from metal_attn.bench.ratios import SUFFIX
from metal_attn.checks import is_finite_real, is_real

SCHEMA = "metal-attn-baseline/1"

#: The schema of a run saved with ``metal-attn bench --json`` (`metal_attn.bench.cli.SCHEMA`).
RUN_SCHEMA = "metal-attn-bench/1"

#: Candidate kinds whose ratios a baseline stores: the providers' results, eager and under ``mx.compile``
#: (the decode-step suite's ``auto_compiled``, the engine's path on CUDA).
TRACKED_KINDS: tuple[str, ...] = ("provider", "compiled")

#: Significant digits kept for a stored ratio.
DIGITS = 4

#: Measurement options a baseline records and a comparison reuses: name -> (type, lowest value).
RUN_OPTIONS: dict[str, tuple[type, int | None]] = {"candidates": (str, None), "warmup": (int, 0), "iters": (int, 1),
                                                   "repeat": (int, 1), "pipelined": (bool, None),
                                                   "interleave": (bool, None)}


class BaselineError(ValueError):
    """A baseline file that cannot be used: unreadable, not JSON, or not of the documented schema."""


def machine_class(machine: Mapping[str, Any]) -> str:
    """The class of machine ratios are comparable across: ``cpu-<N>core`` on the CPU backend
    (``N`` logical CPUs), ``<backend>-<device name>`` on GPUs (``cuda-nvidia-h200``)."""
    backend = machine.get("backend") or "unknown"
    if backend == "cpu":
        return f"cpu-{machine.get('cpu_threads') or 'unknown'}core"
    name = re.sub(r"[^a-z0-9]+", "-", str(machine.get("device_name") or "unknown").lower()).strip("-")
    return f"{backend}-{name}"


def case_id(suite: str, shape_label: str, candidate: str) -> str:
    """The key of one candidate on one shape of one suite."""
    return f"{suite} / {shape_label} / {candidate}"


def case_suite(case: str) -> str:
    """The suite of a case id (`case_id`'s first part)."""
    return case.split(" / ", 1)[0]


@dataclasses.dataclass(frozen=True)
class RunCase:
    """One candidate's outcome in a run, as the comparison needs it."""

    status: str
    reasons: tuple[str, ...]
    ratios: dict[str, float]


def run_cases(runs: Sequence[Sequence[SuiteResult]], kinds: Sequence[str] | None = None) -> dict[str, RunCase]:
    """Every candidate (of ``kinds``; default all) of every shape by case id, over the repeats ``runs``
    (each a list of suite results), combined by `combine_repeats`."""
    seen: dict[str, list[RunCase]] = {}
    for results in runs:
        for s in results:
            for sr in s.results:
                for r in sr.candidates:
                    if kinds is None or r.kind in kinds:
                        seen.setdefault(case_id(s.name, sr.shape.label, r.name), []).append(
                            RunCase(r.status, tuple(r.reasons), dict(r.ratios)))
    return {case: combine_repeats(rs) for case, rs in seen.items()}


def combine_repeats(repeats: Sequence[RunCase]) -> RunCase:
    """One case over its repeats: each ratio its median over the repeats that measured it; the status ``ok``
    when every repeat ran it, else the first other status and its reasons."""
    bad = next((r for r in repeats if r.status != "ok"), None)
    values: dict[str, list[float]] = {}
    for r in repeats:
        for k, v in r.ratios.items():
            values.setdefault(k, []).append(v)
    return RunCase(bad.status if bad else "ok", bad.reasons if bad else (),
                   {k: statistics.median(v) for k, v in values.items()})


def tracked_entries(runs: Sequence[Sequence[SuiteResult]],
                    ratios: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """The ratios a baseline stores: every provider result that ran in every repeat (medians over the
    repeats, `DIGITS` digits), only the ratio names matching a glob of ``ratios`` when given."""
    return entries_of(run_cases(runs, TRACKED_KINDS), ratios)


def entries_of(cases: Mapping[str, RunCase], ratios: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """`tracked_entries` of cases already gathered (and filtered to `TRACKED_KINDS`)."""
    out = {}
    for case, rc in cases.items():
        kept = {k: float(f"{v:.{DIGITS}g}") for k, v in rc.ratios.items()
                if ratios is None or any(fnmatch.fnmatchcase(k, pat) for pat in ratios)}
        if rc.status == "ok" and kept:
            out[case] = kept
    return out


# -- a saved run (``metal-attn bench --json``) -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """The results of a run saved with ``metal-attn bench --json``, as baselines need them."""

    path: str
    machine: dict[str, Any]
    argv: list[str] | None
    suites: tuple[str, ...]
    mode: str | None
    iters: int | None
    interrupted: bool
    #: Every candidate by case id, with its kind and its outcome in each repeat: ``{case: (kind, (RunCase, ...))}``.
    candidates: dict[str, tuple[str, tuple[RunCase, ...]]]
    #: One line per candidate that errored or whose output disagreed with its check.
    problems: tuple[str, ...]
    #: The options of `RUN_OPTIONS` the run's suites agree on (how a later ``--compare`` should measure).
    run: dict[str, Any] = dataclasses.field(default_factory=dict)

    #: How many repeats of the suites the run holds (``--repeat N``; several saved runs merged: their sum).
    repeats: int = 1

    def cases(self, kinds: Sequence[str] | None = None) -> dict[str, RunCase]:
        """The candidates of ``kinds`` (default all) by case id, each combined over its repeats."""
        return {c: combine_repeats(rs) for c, (kind, rs) in self.candidates.items() if kinds is None or kind in kinds}


def parse_run(data: Any, path: str = "<run>") -> SavedRun:
    """Validate a decoded ``--json`` run of the kernel suites; errors name the file and the field."""
    def bad(msg: str) -> BaselineError:
        return BaselineError(f"{path}: {msg}")

    if isinstance(data, dict) and data.get("schema") == SCHEMA:  # the two files of a command swapped
        raise bad(f"a baseline (schema {SCHEMA!r}), not a saved run of `metal-attn bench --json` (allowed: a run "
                  "saved with --json; a baseline goes to --compare)")
    if not isinstance(data, dict) or not isinstance(data.get("suites"), list) or not data["suites"]:
        raise bad("not a saved run of `metal-attn bench --json` (allowed: an object with a non-empty 'suites' list; "
                  "the generate suite's JSON has no baseline ratios)")
    machine = data.get("machine")
    if not isinstance(machine, dict) or not machine.get("backend"):
        raise bad(f"machine={machine!r} (allowed: the machine object a run writes, with its backend)")
    candidates: dict[str, tuple[str, list[RunCase]]] = {}
    problems: list[str] = []
    names, interrupted = [], False
    for i, suite in enumerate(data["suites"]):
        if not isinstance(suite, dict) or not isinstance(suite.get("name"), str) \
                or not isinstance(suite.get("results"), list):
            raise bad(f"suites[{i}] is not a suite result (allowed: an object with 'name' and 'results')")
        names.append(suite["name"])
        interrupted = interrupted or bool(suite.get("interrupted"))
        for j, shape_result in enumerate(suite["results"]):
            try:
                label = shape_result["shape"]["label"]
                cands = list(shape_result["candidates"])
            except (TypeError, KeyError):
                raise bad(f"suites[{i}].results[{j}] has no shape label or candidates") from None
            for c in cands:
                try:
                    name, kind, status = c["name"], c["kind"], c["status"]
                    ratios = {k: float(v) for k, v in (c.get("ratios") or {}).items()}
                    reasons = tuple(str(x) for x in c.get("reasons") or ())
                except (TypeError, KeyError, ValueError, AttributeError):
                    raise bad(f"suites[{i}].results[{j}]: a candidate without name, kind, status, numeric "
                              "ratios (an object) and reasons (a list)") from None
                for k, v in ratios.items():
                    if not k.endswith(SUFFIX):  # a baseline written from it would be refused by --compare
                        raise bad(f"suites[{i}].results[{j}]: candidate {name!r} has the ratio key {k!r} (allowed: "
                                  f"ratio names, which end in {SUFFIX!r})")
                    if not _positive_ratio(v):
                        raise bad(f"suites[{i}].results[{j}]: candidate {name!r} has ratios[{k!r}]={v!r} "
                                  "(allowed: a finite number > 0)")
                case = case_id(suite["name"], label, name)
                candidates.setdefault(case, (kind, []))[1].append(RunCase(status, reasons, ratios))
                check = c.get("check")
                if status == "error":
                    problems.append(f"{case}: {'; '.join(reasons)}")
                elif isinstance(check, dict) and not check.get("ok", True):
                    problems.append(f"{case}: output differs from {check.get('against')}")
    first = data["suites"][0]
    argv = data.get("argv")
    options = {"candidates": lambda x: ",".join(x["candidates"]) if isinstance(x.get("candidates"), list) else None,
               "warmup": lambda x: x.get("warmup"), "iters": lambda x: x.get("iters"),
               "pipelined": lambda x: True if x.get("mode") == "pipelined" else None,
               "interleave": lambda x: True if x.get("interleaved") is True else None}
    run = {}
    for key, get in options.items():
        values = {repr(get(x)) for x in data["suites"]}
        value = get(first)
        kind, low = RUN_OPTIONS[key]
        if len(values) == 1 and type(value) is kind and (low is None or value >= low):
            run[key] = value
    distinct = tuple(dict.fromkeys(names))
    repeats = max(names.count(n) for n in distinct)
    if repeats > 1:
        run["repeat"] = repeats
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        argv = None  # not recorded, or not a command line: the baseline's note says so
    return SavedRun(path, dict(machine), argv, distinct,
                    first.get("mode"), first.get("iters"), interrupted,
                    {c: (kind, tuple(rs)) for c, (kind, rs) in candidates.items()}, tuple(problems), run,
                    repeats=repeats)


def _read_json(path: str | Path, what: str) -> Any:
    """The decoded JSON of ``path`` (`BaselineError` with the path when it cannot be read or is not JSON)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BaselineError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise BaselineError(f"{path}: not a text file (not UTF-8 at byte {exc.start}); the {what} is JSON") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise BaselineError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except _DuplicateKey as exc:
        raise BaselineError(f"{path}: the key {exc.args[0]!r} appears twice in one object (allowed: each key once; "
                            f"JSON readers keep one of the two values, so the {what} would say two things)") from None


class _DuplicateKey(Exception):
    """A key that appears twice in one JSON object (its argument)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or `_DuplicateKey` naming a key given twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def load_run(path: str | Path) -> SavedRun:
    """Read and validate a saved run (`BaselineError` with the path and what is wrong)."""
    return parse_run(_read_json(path, "saved run"), str(path))


def read_run(path: str | Path) -> dict[str, Any]:
    """A saved run's decoded JSON, read once and validated as `load_run` validates it (for printing its
    tables again)."""
    data = _read_json(path, "saved run")
    parse_run(data, str(path))
    return data


def load_runs(paths: Sequence[str | Path]) -> SavedRun:
    """Several saved runs read as one (`merge_runs`); one path is `load_run`."""
    return merge_runs([load_run(p) for p in paths])


def merge_runs(runs: Sequence[SavedRun]) -> SavedRun:
    """Saved runs of one machine class and the same suites as one run whose repeats are all of theirs
    (runs in separate processes vary more than repeats in one, so a baseline can take its medians over
    several). The measuring options kept are those every run agrees on, but for the candidates: runs that
    measured different lists (another order, a subset) keep their union in first-seen order, so a later
    comparison measures every candidate the entries and their peers need; `BaselineError` when the machine
    classes or suites differ."""
    if not runs:
        raise BaselineError("no saved run given")
    first = runs[0]
    if len(runs) == 1:
        return first
    for r in runs[1:]:
        if machine_class(r.machine) != machine_class(first.machine):
            raise BaselineError(f"{r.path}: machine class {machine_class(r.machine)!r}, but {first.path} is "
                                f"{machine_class(first.machine)!r} (allowed: saved runs of one machine class)")
        if r.suites != first.suites:
            raise BaselineError(f"{r.path}: suites {list(r.suites)}, but {first.path} has {list(first.suites)} "
                                "(allowed: saved runs of the same suites)")
    candidates: dict[str, tuple[str, list[RunCase]]] = {}
    for r in runs:
        for case, (kind, reps) in r.candidates.items():
            candidates.setdefault(case, (kind, []))[1].extend(reps)
    run = {k: v for k, v in first.run.items() if all(r.run.get(k) == v for r in runs)}
    lists = [r.run.get("candidates") for r in runs]
    if "candidates" not in run and all(isinstance(c, str) for c in lists):
        run = {"candidates": ",".join(dict.fromkeys(n for c in lists for n in c.split(","))), **run}
    return SavedRun(", ".join(r.path for r in runs), dict(first.machine), first.argv, first.suites,
                    _agreed([r.mode for r in runs]), _agreed([r.iters for r in runs]),
                    any(r.interrupted for r in runs), {c: (k, tuple(v)) for c, (k, v) in candidates.items()},
                    tuple(p for r in runs for p in r.problems), run, repeats=sum(r.repeats for r in runs))


def _agreed(values: Sequence[Any]) -> Any:
    """The value every one of ``values`` has, else None."""
    return values[0] if all(v == values[0] for v in values) else None


def build_from_saved(saved: SavedRun, *, margin: float, note: str = "",
                     ratios: Sequence[str] | None = None) -> dict[str, Any]:
    """A baseline (as JSON data) from a saved run: the same entries `build` would store from it live."""
    entries = _some_entries(entries_of(saved.cases(TRACKED_KINDS), ratios), ratios)
    return _data(entries, saved.machine, list(saved.suites), margin=margin, note=note, run=saved.run,
                 created={"date": saved.machine.get("date"), "argv": saved.argv, "repeat": saved.repeats,
                          "mode": saved.mode,
                          "iters": saved.iters, "machine": dict(saved.machine), "from_json": saved.path})


# -- the file --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A loaded baseline file."""

    path: str
    machine_class: str
    suites: tuple[str, ...]
    margin: float
    entries: dict[str, dict[str, float]]
    note: str = ""
    created: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Options of `RUN_OPTIONS` given when it was written.
    run: dict[str, Any] = dataclasses.field(default_factory=dict)

    def floor(self, value: float) -> float:
        """The lowest ratio a run may have against a baseline ``value``."""
        return value * (1.0 - self.margin)


def check_margin(margin: Any, where: str = "margin") -> float:
    """``margin`` as a float in ``[0, 1)``, else `BaselineError` naming it."""
    if not is_real(margin) or not 0 <= margin < 1:
        raise BaselineError(f"{where}={margin!r} (allowed: a number >= 0 and < 1, the fraction a ratio may fall "
                            "below its baseline)")
    return float(margin)


def _positive_ratio(v: Any) -> bool:
    return is_finite_real(v) and v > 0


def parse(data: Any, path: str = "<baseline>") -> Baseline:
    """Validate a decoded baseline; every error names the file, the field, its value and what is allowed."""
    def bad(msg: str) -> BaselineError:
        return BaselineError(f"{path}: {msg}")

    if not isinstance(data, dict):
        raise bad(f"the top level is a {type(data).__name__} (allowed: an object with schema {SCHEMA!r})")
    if data.get("schema") != SCHEMA:
        run = " (a run saved with --json, which goes to --from-json)" if data.get("schema") == RUN_SCHEMA else ""
        raise bad(f"schema={data.get('schema')!r}{run} (allowed: {SCHEMA!r})")
    mc = data.get("machine_class")
    if not isinstance(mc, str) or not mc:
        raise bad(f"machine_class={mc!r} (allowed: a non-empty string such as 'cpu-2core')")
    suites = data.get("suites")
    if not isinstance(suites, list) or not suites or not all(isinstance(x, str) and x for x in suites):
        raise bad(f"suites={suites!r} (allowed: a non-empty list of suite names)")
    try:
        margin = check_margin(data.get("margin"))
    except BaselineError as exc:
        raise bad(str(exc)) from None
    entries = data.get("entries")
    if not isinstance(entries, dict) or not entries:
        raise bad(f"entries={entries!r} (allowed: a non-empty object, case id -> {{ratio name: value}})")
    for case, ratios in entries.items():
        if not isinstance(ratios, dict) or not ratios:
            raise bad(f"entries[{case!r}]={ratios!r} (allowed: a non-empty object, ratio name -> value)")
        for k, v in ratios.items():
            if not k.endswith(SUFFIX):
                raise bad(f"entries[{case!r}] has the key {k!r} (allowed: ratio names, which end in {SUFFIX!r})")
            if not _positive_ratio(v):
                raise bad(f"entries[{case!r}][{k!r}]={v!r} (allowed: a finite number > 0)")
    listed = {case_suite(c) for c in entries}
    for case in entries:
        if case_suite(case) not in suites:
            raise bad(f"entries[{case!r}] is of suite {case_suite(case)!r}, which suites={suites!r} does not name "
                      "(allowed: cases of the listed suites, keyed 'suite / shape label / candidate')")
    unused = [x for x in suites if x not in listed]
    if unused:
        raise bad(f"suites={suites!r} names {', '.join(map(repr, unused))}, of which no entry is (allowed: the suites "
                  "of the entries, which --compare runs by default)")
    run = data.get("run", {})
    if not isinstance(run, dict):
        raise bad(f"run={run!r} (allowed: an object of options among {', '.join(RUN_OPTIONS)})")
    for k, v in run.items():
        kind, low = RUN_OPTIONS.get(k, (None, None))
        if kind is None:
            raise bad(f"run has the option {k!r} (allowed: {', '.join(RUN_OPTIONS)})")
        if type(v) is not kind or (low is not None and v < low):
            want = kind.__name__ + (f" >= {low}" if low is not None else "")
            raise bad(f"run[{k!r}]={v!r} (allowed: {want})")
    note = data.get("note", "")
    if not isinstance(note, str):
        raise bad(f"note={note!r} (allowed: a string, how the baseline was made)")
    created = data.get("created", {})
    if not isinstance(created, dict):
        raise bad(f"created={created!r} (allowed: an object, what wrote the baseline and when)")
    return Baseline(path, mc, tuple(suites), margin, {c: dict(r) for c, r in entries.items()},
                    note, dict(created), dict(run))


def load(path: str | Path) -> Baseline:
    """Read and validate a baseline file (`BaselineError` with the path and what is wrong)."""
    return parse(_read_json(path, "baseline"), str(path))


def build(runs: Sequence[Sequence[SuiteResult]], machine: Mapping[str, Any], *, margin: float,
          argv: Sequence[str] | None = None, note: str = "", ratios: Sequence[str] | None = None,
          run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A baseline (as JSON data) from a finished run of one or more repeats (``runs``); ``run``: the
    options of `RUN_OPTIONS` the run was given (``None`` values are left out)."""
    entries = _some_entries(tracked_entries(runs, ratios), ratios)
    first = runs[0] if runs else []
    return _data(entries, machine, [s.name for s in first], margin=margin, note=note, run=run or {},
                 created={"date": machine.get("date"), "argv": list(argv) if argv is not None else None,
                          "repeat": len(runs), "mode": first[0].mode if first else None,
                          "iters": first[0].iters if first else None, "machine": dict(machine)})


def _some_entries(entries: dict[str, dict[str, float]], ratios: Sequence[str] | None) -> dict[str, dict[str, float]]:
    """``entries``, or `BaselineError` when there are none to store."""
    if not entries:
        which = f" matching {', '.join(ratios)}" if ratios else ""
        raise BaselineError(f"the run has no provider result with ratios{which} to store (a ratio needs a peer or "
                            "the ceiling among the candidates)")
    return entries


def _data(entries: dict[str, dict[str, float]], machine: Mapping[str, Any], suites: list[str], *, margin: float,
          note: str, run: Mapping[str, Any], created: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "machine_class": machine_class(machine),
        # the suites a comparison runs by default: those the entries are of (a suite whose candidates gave no
        # stored ratio would be measured for nothing)
        "suites": [x for x in dict.fromkeys(suites) if any(case_suite(c) == x for c in entries)],
        "margin": check_margin(margin),
        "note": note,
        "run": {k: v for k, v in run.items() if k in RUN_OPTIONS and v is not None},
        "created": created,
        "entries": entries,
    }


def write(path: str | Path, data: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def replace_problem(path: str | Path, machine_class: str) -> str | None:
    """Why a baseline of ``machine_class`` must not be written over ``path`` (said after the path), or ``None``:
    a new or empty file, or a baseline of that machine class, may be replaced; another machine class's
    baseline (a CPU run written over ``cuda-nvidia-h200.json``), or a file that is no baseline, may not."""
    p = Path(path)
    if not p.is_file():
        return None
    allowed = f"(allowed: a new file, or a baseline of machine class {machine_class!r} to replace)"
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return f"exists and cannot be read as a baseline {allowed}"
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return f"exists and is not a baseline (not JSON) {allowed}"
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        return f"exists and is not a baseline (schema={schema!r}) {allowed}"
    if data.get("machine_class") != machine_class:
        return (f"is the baseline of machine class {data.get('machine_class')!r}, but this run's machine class is "
                f"{machine_class!r} {allowed}")
    return None


# -- the comparison ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One baseline ratio against the run."""

    case: str
    ratio: str
    baseline: float
    floor: float
    value: float | None
    status: str  # ok | above | below | missing
    why: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("below", "missing")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A run against a baseline: one row per baseline ratio, and what makes the whole fail."""

    baseline: Baseline
    run_machine_class: str
    rows: tuple[Row, ...]

    @property
    def machine_mismatch(self) -> bool:
        return self.run_machine_class != self.baseline.machine_class

    @property
    def failed(self) -> bool:
        return self.machine_mismatch or any(r.failed for r in self.rows)

    def problems(self) -> list[str]:
        """One line per reason the comparison fails."""
        out = []
        if self.machine_mismatch:
            out.append(machine_mismatch_message(self.baseline, self.run_machine_class))
        below = [r for r in self.rows if r.status == "below"]
        missing = sorted({r.case for r in self.rows if r.status == "missing"})
        if below:
            out.append(f"{len(below)} ratio(s) below their floor (baseline * (1 - margin {self.baseline.margin:g})): "
                       + "; ".join(f"{r.case}: {r.ratio} {r.value:.4g} < {r.floor:.4g}" for r in below))
        if missing:
            out.append(f"{len(missing)} baseline case(s) missing from the run or without their ratios: "
                       + "; ".join(missing))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline.path, "machine_class": self.baseline.machine_class,
                "run_machine_class": self.run_machine_class, "margin": self.baseline.margin,
                "failed": self.failed, "problems": self.problems(), "rows": [r.to_dict() for r in self.rows]}


def machine_mismatch_message(baseline: Baseline, run_class: str) -> str:
    return (f"machine class differs: {baseline.path} is for {baseline.machine_class!r}, this machine is "
            f"{run_class!r}; compare with a baseline of this class, or write one with --write-baseline")


def compare(baseline: Baseline, run: Mapping[str, RunCase], run_machine_class: str) -> Comparison:
    """Every ratio of ``baseline`` against ``run`` (from `run_cases`)."""
    rows = []
    for case, ratios in baseline.entries.items():
        got = run.get(case)
        for name, base in ratios.items():
            floor = baseline.floor(base)
            if got is None:
                rows.append(Row(case, name, base, floor, None, "missing", "case not in this run"))
                continue
            value = got.ratios.get(name)
            if value is None:
                why = (f"{got.status}: {'; '.join(got.reasons)}" if got.status != "ok"
                       else "ratio not measured (its peer did not run)")
                rows.append(Row(case, name, base, floor, None, "missing", why))
            elif value < floor:
                rows.append(Row(case, name, base, floor, value, "below"))
            else:
                rows.append(Row(case, name, base, floor, value, "above" if value > base * (1 + baseline.margin)
                                else "ok"))
    return Comparison(baseline, run_machine_class, tuple(rows))


#: How each status is shown, and its style.
_STATUS = {"ok": ("ok", None), "above": ("above (faster)", "green"), "below": ("BELOW FLOOR", "bold red"),
           "missing": ("MISSING", "bold red")}


def render(comp: Comparison, file: TextIO) -> None:
    """A rich table of every ratio against its baseline and floor, then the verdict."""
    from rich import box
    from rich.table import Table

    from metal_attn.terminal import console as make_console

    console = make_console(file=file, min_width=160, highlight=False)
    b = comp.baseline
    table = Table(title=f"ratios against {b.path} (machine class {b.machine_class}, margin {b.margin:g}: "
                        f"floor = baseline * {1 - b.margin:g})",
                  box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name, justify in (("case", "left"), ("ratio", "left"), ("baseline", "right"), ("floor", "right"),
                          ("this run", "right"), ("change", "right"), ("status", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    last = None
    for r in comp.rows:
        label, style = _STATUS[r.status]
        change = f"{r.value / r.baseline - 1:+.0%}" if r.value is not None else ""
        table.add_row(r.case if r.case != last else "", r.ratio.removesuffix("_" + SUFFIX), f"{r.baseline:.3g}",
                      f"{r.floor:.3g}", f"{r.value:.3g}" if r.value is not None else "-", change,
                      label + (f": {r.why}" if r.why else ""), style=style)
        last = r.case
    console.print(table)
    counts = {s: sum(r.status == s for r in comp.rows) for s in _STATUS}
    summary = ", ".join(f"{n} {_STATUS[s][0].lower()}" for s, n in counts.items() if n)
    verdict = "FAILED" if comp.failed else "passed"
    console.print(f"comparison {verdict}: {len(comp.rows)} ratios ({summary})", markup=False)
    for p in comp.problems():
        console.print(f"  {p}", markup=False)
