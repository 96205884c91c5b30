"""Regression tracking by ratios: ratio names, baseline files, the comparison and the CLI around them;
the committed CPU baseline against a smoke run, and a kernel falling to the reference path."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from metal_attn.bench import baselines, candidates, cli, core, ratios, suites
from metal_attn.bench.baselines import Baseline, BaselineError, RunCase
from metal_attn.bench.candidates import CandidateResult
from metal_attn.bench.core import ShapeResult, SuiteResult
from metal_attn.bench.shapes import Shape
from metal_attn.bench.timing import Timing
from metal_attn.settings import override_settings

REPO = Path(__file__).resolve().parents[1]
CPU_BASELINE = REPO / "benchmarks" / "baselines" / "cpu-2core.json"


def _baseline(entries: dict, *, margin: float = 0.5, machine_class: str = "cpu-2core", **extra) -> dict:
    return {"schema": baselines.SCHEMA, "machine_class": machine_class, "suites": ["smoke"], "margin": margin,
            "entries": entries, **extra}


def _write(tmp_path: Path, data, name: str = "base.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


# -- ratio names ------------------------------------------------------------------------------------


def test_ratios_are_named_higher_is_better() -> None:
    got = ratios.ratios_of({"mlx_sdpa": 2.0, "torch_sdpa": 0.5}, 0.25)
    assert got == {"speedup_vs_mlx_sdpa_ratio": 2.0, "speedup_vs_torch_sdpa_ratio": 0.5,
                   "ceiling_fraction_ratio": 0.25}
    assert all(k.endswith(ratios.SUFFIX) for k in got)
    assert ratios.ratios_of({"mlx_sdpa": float("nan")}, None) == {}


def test_candidate_results_carry_ratios_from_speedup_and_ceiling() -> None:
    shape = Shape(2, 4, 2, 64, 64, "float32")
    t = lambda s: Timing(s, s, s, 0.0, (s,), 1)  # noqa: E731
    ours = CandidateResult("classic", "provider", "ok", timing=t(1e-3))
    peer = CandidateResult("mlx_sdpa", "peer", "ok", timing=t(3e-3))
    ceiling = CandidateResult("ceiling", "ceiling", "ok", gbps=shape.kv_bytes / 0.5e-3 / 1e9)
    for r in (ours, peer):
        candidates.apply_metrics(r, shape)
    sr = ShapeResult(shape, [ours, peer, ceiling])
    core.finish_shape(sr)
    assert ours.ratios["speedup_vs_mlx_sdpa_ratio"] == pytest.approx(3.0)
    assert ours.ratios["ceiling_fraction_ratio"] == pytest.approx(0.5)  # t_ceiling / t_ours
    assert ours.to_dict()["ratios"] == ours.ratios
    assert CandidateResult("x", "provider", "refused").ratios == {}


def test_pytest_benchmark_json_gets_peer_and_ceiling_ratios() -> None:
    bench = [
        {"group": "g", "extra_info": {"candidate": "classic", "ceiling_s": 0.5}, "stats": {"median": 1.0}},
        {"group": "g", "extra_info": {"candidate": "mlx_sdpa"}, "stats": {"median": 4.0}},
        {"group": "g", "extra_info": {"candidate": "torch_sdpa"}, "stats": {"median": 2.0}},
        {"group": "other", "extra_info": {"candidate": "classic"}, "stats": {"median": 1.0}},
    ]
    ratios.add_peer_ratios(bench)
    info = bench[0]["extra_info"]
    assert info["speedup_vs_mlx_sdpa_ratio"] == 4.0 and info["speedup_vs_torch_sdpa_ratio"] == 2.0
    assert info["ceiling_fraction_ratio"] == 0.5
    assert bench[1]["extra_info"]["speedup_vs_torch_sdpa_ratio"] == 0.5
    assert "speedup_vs_mlx_sdpa_ratio" not in bench[1]["extra_info"]  # not against itself
    assert not any(k.endswith("ratio") for k in bench[3]["extra_info"])  # no peer in its group


# -- the file ---------------------------------------------------------------------------------------


#: A case id of the suite `_baseline` lists.
C = "smoke / s / c"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
        ([], "the top level is a list"),
        (_baseline({C: {"x_ratio": 1.0}}) | {"schema": "v0"}, "schema='v0' (allowed: 'metal-attn-baseline/1')"),
        (_baseline({C: {"x_ratio": 1.0}}, margin=1.0), "margin=1.0 (allowed: a number >= 0 and < 1"),
        (_baseline({C: {"x_ratio": 1.0}}, margin=-0.1), "margin=-0.1 (allowed"),
        (_baseline({C: {"x_ratio": 1.0}}, machine_class=""), "machine_class='' (allowed: a non-empty string"),
        (_baseline({}), "entries={} (allowed: a non-empty object"),
        (_baseline({C: {"speedup": 1.0}}), f"entries[{C!r}] has the key 'speedup' (allowed: ratio names, which end "
                                           "in 'ratio')"),
        (_baseline({C: {"x_ratio": 0}}), f"entries[{C!r}]['x_ratio']=0 (allowed: a finite number > 0)"),
        (_baseline({C: {"x_ratio": 1.0}}, run={"iters": 0}), "run['iters']=0 (allowed: int >= 1)"),
        (_baseline({C: {"x_ratio": 1.0}}, run={"speed": 1}), "run has the option 'speed'"),
        (_baseline({C: {"x_ratio": 1.0}}, created="abc"), "created='abc' (allowed: an object"),
        # `or {}` read these as "no options" and "nothing recorded"
        (_baseline({C: {"x_ratio": 1.0}}, run=False), "run=False (allowed: an object of options among candidates"),
        (_baseline({C: {"x_ratio": 1.0}}, run=[]), "run=[] (allowed: an object"),
        (_baseline({C: {"x_ratio": 1.0}}, created=[]), "created=[] (allowed: an object"),
        (_baseline({C: {"x_ratio": 1.0}}, note=5), "note=5 (allowed: a string"),
        # a JSON reader keeps one of two values of a key: the file said two things
        (json.dumps(_baseline({C: {"x_ratio": 1.0}}))[:-1] + ', "margin": 0.9}',
         "the key 'margin' appears twice in one object (allowed: each key once"),
        # the suites --compare runs by default against the suites of the entries
        (_baseline({"decode-cpu / s / c": {"x_ratio": 1.0}}),
         "entries['decode-cpu / s / c'] is of suite 'decode-cpu', which suites=['smoke'] does not name"),
        (_baseline({C: {"x_ratio": 1.0}}) | {"suites": ["smoke", "decode-cpu"]},
         "suites=['smoke', 'decode-cpu'] names 'decode-cpu', of which no entry is"),
    ],
)
def test_bad_baselines_say_what_is_wrong(tmp_path, data, message) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(BaselineError) as err:
        baselines.load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_missing_baseline_file_is_an_error(tmp_path) -> None:
    with pytest.raises(BaselineError, match="cannot read the baseline"):
        baselines.load(tmp_path / "nope.json")


def test_machine_class_names() -> None:
    assert baselines.machine_class({"backend": "cpu", "cpu_threads": 2}) == "cpu-2core"
    assert baselines.machine_class({"backend": "cuda", "device_name": "NVIDIA H200"}) == "cuda-nvidia-h200"
    assert baselines.machine_class({"backend": "metal", "device_name": "Apple M5 Max"}) == "metal-apple-m5-max"


# -- the comparison ---------------------------------------------------------------------------------


def _loaded(entries: dict, margin: float) -> Baseline:
    return baselines.parse(_baseline(entries, margin=margin), "base.json")


ENTRIES = {"smoke / s / auto": {"speedup_vs_mlx_sdpa_ratio": 2.0, "ceiling_fraction_ratio": 0.4}}


def test_compare_passes_within_the_margin_and_fails_below_it() -> None:
    run = {"smoke / s / auto": RunCase("ok", (), {"speedup_vs_mlx_sdpa_ratio": 1.1, "ceiling_fraction_ratio": 0.9})}
    comp = baselines.compare(_loaded(ENTRIES, 0.5), run, "cpu-2core")
    assert not comp.failed
    assert [(r.ratio, r.floor, r.status) for r in comp.rows] == [
        ("speedup_vs_mlx_sdpa_ratio", 1.0, "ok"), ("ceiling_fraction_ratio", 0.2, "above")]
    # The same run against the same entries with a tighter margin from the file: 1.1 < 2.0 * 0.6.
    comp = baselines.compare(_loaded(ENTRIES, 0.4), run, "cpu-2core")
    assert comp.failed
    (row,) = [r for r in comp.rows if r.failed]
    assert (row.ratio, row.status, row.value) == ("speedup_vs_mlx_sdpa_ratio", "below", 1.1)
    assert "1 ratio(s) below their floor" in comp.problems()[0]


def test_compare_fails_on_a_missing_case_ratio_or_machine_class() -> None:
    base = _loaded(ENTRIES, 0.5)
    comp = baselines.compare(base, {}, "cpu-2core")
    assert comp.failed and {r.status for r in comp.rows} == {"missing"}
    assert comp.rows[0].why == "case not in this run"
    assert "1 baseline case(s) missing" in comp.problems()[0]
    refused = {"smoke / s / auto": RunCase("refused", ("disabled by X",), {})}
    comp = baselines.compare(base, refused, "cpu-2core")
    assert comp.failed and comp.rows[0].why == "refused: disabled by X"
    no_peer = {"smoke / s / auto": RunCase("ok", (), {"ceiling_fraction_ratio": 0.4})}
    comp = baselines.compare(base, no_peer, "cpu-2core")
    assert [r.status for r in comp.rows] == ["missing", "ok"]
    assert "its peer did not run" in comp.rows[0].why
    good = {"smoke / s / auto": RunCase("ok", (), ENTRIES["smoke / s / auto"])}
    comp = baselines.compare(base, good, "cpu-4core")
    assert comp.failed and comp.machine_mismatch
    assert "machine class differs: base.json is for 'cpu-2core', this machine is 'cpu-4core'" in comp.problems()[0]


def _suite(values: list[float]) -> list[list[SuiteResult]]:
    """Repeats of one suite whose one provider result has a speedup vs mlx_sdpa of each value."""
    shape = Shape(2, 4, 2, 64, 64, "float32")
    runs = []
    for v in values:
        r = CandidateResult("auto", "provider", "ok", speedup={"mlx_sdpa": v})
        peer = CandidateResult("mlx_sdpa", "peer", "ok", speedup={})
        runs.append([SuiteResult("smoke", "", ("auto", "mlx_sdpa"), 1, 1, [ShapeResult(shape, [r, peer])])])
    return runs


def test_repeats_give_median_ratios_and_only_providers_are_stored() -> None:
    runs = _suite([1.0, 5.0, 2.0])
    cid = baselines.case_id("smoke", runs[0][0].results[0].shape.label, "auto")
    assert baselines.run_cases(runs)[cid].ratios == {"speedup_vs_mlx_sdpa_ratio": 2.0}
    data = baselines.build(runs, {"backend": "cpu", "cpu_threads": 2, "date": "d"}, margin=0.3,
                           run={"iters": 9, "candidates": None})
    assert data["entries"] == {cid: {"speedup_vs_mlx_sdpa_ratio": 2.0}}
    assert data["run"] == {"iters": 9} and data["created"]["repeat"] == 3
    loaded = baselines.parse(data)
    assert loaded.margin == 0.3 and loaded.machine_class == "cpu-2core" and loaded.suites == ("smoke",)
    with pytest.raises(BaselineError, match="no provider result with ratios matching ceiling_"):
        baselines.build(runs, {"backend": "cpu"}, margin=0.3, ratios=["ceiling_*"])


# -- the command ----------------------------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--margin", "0.5"], "--margin goes with --write-baseline"),
        (["--ratios", "x*"], "--ratios goes with --write-baseline"),
        (["--write-baseline", "x.json", "--margin", "1.5"], "--margin=1.5 (allowed: a number >= 0 and < 1"),
        (["--compare", "/nonexistent/base.json"], "--compare /nonexistent/base.json: cannot read the baseline"),
        (["--suite", "generate", "--compare", "PLACEHOLDER"], "--compare and --write-baseline take kernel suites"),
        # a pattern matching no ratio was dropped silently (one of two), or refused only after measuring (all)
        (["--suite", "smoke", "--write-baseline", "x.json", "--ratios", "speedup_vs_mlx_sdpa_ratio,ceiling_fraction"],
         "--ratios 'ceiling_fraction' matches no ratio (allowed: names or globs of speedup_vs_gather_sdpa_ratio"),
        (["--from-json", "PLACEHOLDER", "--write-baseline", "x.json", "--ratios", "speedup_vs_mlx"],
         "--ratios 'speedup_vs_mlx' matches no ratio"),
    ],
)
def test_baseline_usage_errors_exit_2(tmp_path, capsys, argv, message) -> None:
    good = _write(tmp_path, _baseline(ENTRIES))
    argv = [str(good) if a == "PLACEHOLDER" else a for a in argv]
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2 and message in err


def test_a_margin_that_is_no_number_names_the_range(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--write-baseline", "x.json", "--margin", "abc"])
    assert exc.value.code == 2
    assert "--margin: invalid value 'abc' (allowed: a number >= 0 and < 1" in capsys.readouterr().err


def test_bad_json_exits_2_before_running(tmp_path, capsys) -> None:
    rc, out, err = _cli(capsys, "--suite", "smoke", "--compare", str(_write(tmp_path, "[1,")))
    assert rc == 2 and "not JSON" in err and out == ""


def test_another_machine_class_exits_1_before_running(tmp_path, capsys) -> None:
    path = _write(tmp_path, _baseline(ENTRIES, machine_class="cuda-nvidia-h200"))
    rc, out, err = _cli(capsys, "--compare", str(path))
    assert rc == 1 and out == ""
    assert "machine class differs" in err and "'cuda-nvidia-h200'" in err


def test_write_then_compare_round_trip(tmp_path, capsys) -> None:
    """A baseline written from a run, compared with a second run: every ratio is listed; and a run
    that lacks a baseline case (here: its shape filtered out) fails."""
    base = tmp_path / "b.json"
    common = ["--suite", "smoke", "--shapes", "decode b3,prefill q48", "--quiet", "--iters", "3"]
    rc, _, err = _cli(capsys, *common, "--candidates", "auto,reference,mlx_sdpa", "--write-baseline", str(base),
                      "--margin", "0.9", "--ratios", "speedup_vs_*")
    assert rc == 0, err
    data = json.loads(base.read_text())
    assert data["margin"] == 0.9 and data["suites"] == ["smoke"]
    assert data["run"] == {"candidates": "auto,reference,mlx_sdpa", "iters": 3}
    shapes = [x for x in suites.get_suite("smoke").shapes if x.label.startswith(("decode b3", "prefill q48"))]
    assert sorted(data["entries"]) == sorted(f"smoke / {x.label} / {c}" for x in shapes for c in ("auto", "reference"))
    assert all(set(r) == {"speedup_vs_mlx_sdpa_ratio"} for r in data["entries"].values())

    rc, out, err = _cli(capsys, "--compare", str(base), "--shapes", "decode b3,prefill q48", "--quiet",
                        "--json", str(tmp_path / "run.json"))
    assert rc == 0, err
    assert "measuring with the baseline's options: --candidates auto,reference,mlx_sdpa --iters 3" in err
    text = " ".join(out.split())
    assert "ratios against" in text and "comparison passed: 4 ratios" in text
    comp = json.loads((tmp_path / "run.json").read_text())["comparison"]
    assert comp["failed"] is False and len(comp["rows"]) == 4

    rc, out, err = _cli(capsys, "--compare", str(base), "--shapes", "decode b3", "--quiet")
    assert rc == 1
    assert "2 baseline case(s) missing from the run" in err and "comparison FAILED" in " ".join(out.split())


def test_the_metal_attn_command_records_the_bench_arguments_once(tmp_path, capsys, restore_logging) -> None:
    """Through the ``metal-attn`` entry point, the baseline's note and the saved run record the arguments
    after ``bench`` (the note once said ``metal-attn bench bench ...``)."""
    from metal_attn import cli as top

    base, run = tmp_path / "b.json", tmp_path / "run.json"
    argv = ["bench", "--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2",
            "--candidates", "auto,mlx_sdpa", "--write-baseline", str(base), "--json", str(run)]
    assert top.main(argv) == 0, capsys.readouterr().err
    note = json.loads(base.read_text())["note"]
    assert note.startswith("written by `metal-attn bench --suite smoke --shapes decode b3 ")
    assert json.loads(run.read_text())["argv"] == argv[1:]


def test_no_baseline_is_written_from_a_run_with_problems(tmp_path, capsys, monkeypatch) -> None:
    from metal_attn.bench import peers

    class Crashing(peers.GatherSdpa):
        def prepare(self, case):
            raise RuntimeError("boom")

    monkeypatch.setitem(peers.PEERS, "gather_sdpa", Crashing)
    base = tmp_path / "b.json"
    rc, _, err = _cli(capsys, "--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2",
                      "--candidates", "auto,gather_sdpa,mlx_sdpa", "--write-baseline", str(base))
    assert rc == 1 and not base.exists()
    assert "not written, the run had 1 problem(s)" in err


def test_a_saved_run_makes_the_same_baseline_and_is_compared_later(tmp_path, capsys) -> None:
    """``--from-json``: a run saved with --json writes the baseline that run would have written live (same
    entries and measuring options), a comparison of the saved run against it passes, and the same run with
    one ratio halved (below a margin of 0.3) fails, naming the case."""
    common = ["--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2",
              "--candidates", "auto,reference,mlx_sdpa", "--ratios", "speedup_vs_*", "--margin", "0.3"]
    run_json, live, saved = tmp_path / "run.json", tmp_path / "live.json", tmp_path / "saved.json"
    rc, _, err = _cli(capsys, *common, "--json", str(run_json), "--write-baseline", str(live))
    assert rc == 0, err
    rc, _, err = _cli(capsys, "--from-json", str(run_json), "--write-baseline", str(saved), "--ratios",
                      "speedup_vs_*", "--margin", "0.3")
    assert rc == 0, err
    a, b = json.loads(live.read_text()), json.loads(saved.read_text())
    assert b["entries"] == a["entries"] and b["machine_class"] == a["machine_class"] and b["suites"] == ["smoke"]
    # The live baseline keeps the options its command line gave; the saved one, what the run's suites record.
    assert a["run"] == {"candidates": "auto,reference,mlx_sdpa", "iters": 2}
    assert b["run"] == {**a["run"], "warmup": suites.get_suite("smoke").warmup}
    assert b["created"]["from_json"] == str(run_json) and f"--from-json {run_json}" in b["note"]

    rc, out, err = _cli(capsys, "--from-json", str(run_json), "--compare", str(saved))
    assert rc == 0, err
    assert f"comparison passed: {sum(len(r) for r in b['entries'].values())} ratios" in " ".join(out.split())

    data = json.loads(run_json.read_text())
    cand = next(c for c in data["suites"][0]["results"][0]["candidates"] if c["name"] == "auto")
    cand["ratios"]["speedup_vs_mlx_sdpa_ratio"] /= 2
    slower = _write(tmp_path, data, "slower.json")
    rc, out, err = _cli(capsys, "--from-json", str(slower), "--compare", str(saved))
    assert rc == 1 and "1 ratio(s) below their floor" in err and "/ auto: speedup_vs_mlx_sdpa_ratio" in err

    # A saved run whose output was wrong fails the comparison whatever its ratios, as a live --compare does
    # (it passed); one measured another way (pipelined, against a blocking baseline) is said to be.
    data = json.loads(run_json.read_text())
    cand = next(c for c in data["suites"][0]["results"][0]["candidates"] if c["name"] == "auto")
    cand["check"] = {"ok": False, "against": "mlx_sdpa", "rel_l2": 0.5}
    rc, out, err = _cli(capsys, "--from-json", str(_write(tmp_path, data, "wrong.json")), "--compare", str(saved))
    assert rc == 1 and "the saved run had a problem: smoke / decode b3" in err and "output differs from mlx_sdpa" in err
    data = json.loads(run_json.read_text())
    data["suites"][0]["mode"] = "pipelined"
    rc, out, err = _cli(capsys, "--from-json", str(_write(tmp_path, data, "piped.json")), "--compare", str(saved))
    assert rc == 0, err
    assert "warning: the saved run was measured with pipelined=True, the baseline with pipelined=None" in err


def test_saved_repeats_and_several_saved_runs_give_medians_over_every_repeat(tmp_path, capsys) -> None:
    """A saved run of ``--repeat 3`` writes the baseline a live ``--repeat 3`` would (medians over its repeats,
    its suite named once, the repeat count among the measuring options); two saved runs count as one of all
    their repeats, so each ratio is the median over the pooled repeats; runs of different suites or machine
    classes are refused, naming the file."""
    common = ["--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2", "--candidates", "auto,mlx_sdpa"]
    one, two, live, saved = (tmp_path / n for n in ("one.json", "two.json", "live.json", "saved.json"))
    assert _cli(capsys, *common, "--repeat", "3", "--json", str(one), "--write-baseline", str(live))[0] == 0
    assert _cli(capsys, "--from-json", str(one), "--write-baseline", str(saved))[0] == 0
    a, b = json.loads(live.read_text()), json.loads(saved.read_text())
    assert b["entries"] == a["entries"] and b["suites"] == ["smoke"] and b["created"]["repeat"] == 3
    assert b["run"]["repeat"] == 3

    assert _cli(capsys, *common, "--json", str(two))[0] == 0
    pooled = tmp_path / "pooled.json"
    rc, _, err = _cli(capsys, "--from-json", str(one), str(two), "--write-baseline", str(pooled))
    assert rc == 0, err
    data = json.loads(pooled.read_text())
    case, key = "smoke / decode b3 h4/2 d64 L100 f32 / auto", "speedup_vs_mlx_sdpa_ratio"
    values = [c["ratios"][key] for f in (one, two) for s in json.loads(f.read_text())["suites"]
              for r in s["results"] for c in r["candidates"] if c["name"] == "auto"]
    assert len(values) == 4 and data["entries"][case][key] == pytest.approx(statistics.median(values), rel=1e-3)
    assert data["created"]["repeat"] == 4 and "repeat" not in data["run"]  # the runs disagree: 3 and 1
    assert "from 2 runs (4 repeats in all)" in data["note"]

    other = json.loads(two.read_text())
    other["suites"][0]["name"] = "decode-cpu"
    rc, _, err = _cli(capsys, "--from-json", str(one), str(_write(tmp_path, other, "other.json")),
                      "--write-baseline", str(tmp_path / "x.json"))
    assert rc == 2 and "other.json: suites ['decode-cpu']" in err
    other = json.loads(two.read_text())
    other["machine"]["backend"] = "cuda"
    rc, _, err = _cli(capsys, "--from-json", str(one), str(_write(tmp_path, other, "gpu.json")),
                      "--write-baseline", str(tmp_path / "x.json"))
    assert rc == 2 and "gpu.json: machine class" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compare", "x.json", "--write-baseline", "y.json"],
         "goes with one of --write-baseline and --compare, or with neither (to print its tables)"),
        (["--json"], "prints the saved runs' tables, so --json would be ignored (allowed: --markdown, --plot)"),
        (["--markdown", "--ratios", "x*", "--margin", "0.5"], "so --ratios, --margin would be ignored"),
        (["--write-baseline", "x.json", "--suite", "smoke"], "measures nothing, so --suite cannot apply"),
        (["--compare", "x.json", "--margin", "0.5"], "--ratios and --margin go with --write-baseline"),
        (["--write-baseline", "x.json", "--margin", "1.5"], "--margin=1.5 (allowed: a number >= 0 and < 1"),
        # measuring options and outputs a saved run cannot use were dropped without a word
        (["--compare", "x.json", "--json"], "so --json would be ignored"),
        (["--compare", "x.json", "--markdown", "--iters", "3"], "so --markdown, --iters would be ignored"),
        (["--write-baseline", "x.json", "--warmup", "0"], "so --warmup would be ignored"),
        (["--compare", "x.json", "--interleave"], "so --interleave would be ignored"),
        # the generate suite's flags were dropped without a word too
        (["--compare", "x.json", "--concurrency", "4", "--num-layers", "3"],
         "so --concurrency, --num-layers would be ignored"),
        (["--gen-tokens", "4"], "prints the saved runs' tables, so --gen-tokens would be ignored"),
    ],
)
def test_saved_run_usage_errors_exit_2(tmp_path, capsys, extra, message) -> None:
    rc, out, err = _cli(capsys, "--from-json", str(_write(tmp_path, {"suites": []}, "run.json")), *extra)
    assert rc == 2 and message in err and out == ""


def test_a_saved_run_that_is_not_one_says_why(tmp_path, capsys) -> None:
    rc, _, err = _cli(capsys, "--from-json", str(_write(tmp_path, {"suites": []}, "run.json")),
                      "--write-baseline", str(tmp_path / "b.json"))
    assert rc == 2 and "not a saved run of `metal-attn bench --json`" in err
    rc, out, err = _cli(capsys, "--from-json", str(_write(tmp_path, {"suites": []}, "run.json")))  # to print
    assert rc == 2 and "run.json: not a saved run of `metal-attn bench --json`" in err and out == ""
    run = {"machine": {"backend": "cpu"}, "suites": [{"name": "smoke", "interrupted": True, "results": []}]}
    rc, _, err = _cli(capsys, "--from-json", str(_write(tmp_path, run, "cut.json")),
                      "--write-baseline", str(tmp_path / "b.json"))
    assert rc == 1 and "not written, the run was interrupted" in err and not (tmp_path / "b.json").exists()


# -- the committed CPU baseline ------------------------------------------------------------------------


def _committed() -> Baseline:
    base = baselines.load(CPU_BASELINE)
    here = baselines.machine_class(core.machine_info())
    if here != base.machine_class:
        pytest.skip(f"{CPU_BASELINE.name} is for {base.machine_class}; this machine is {here}")
    return base


def test_the_committed_cpu_baseline_is_documented_data() -> None:
    base = baselines.load(CPU_BASELINE)
    assert "cpu" in CPU_BASELINE.name and base.machine_class.startswith("cpu-")
    assert base.suites == ("smoke",) and 0 < base.margin < 1 and base.note
    auto = [c for c in base.entries if c.endswith(" / auto")]
    assert len(auto) == len(suites.get_suite("smoke").shapes)


def test_the_committed_h200_baseline_covers_every_decode_gpu_shape() -> None:
    """Written on the H200: every shape of decode-gpu for auto and classic, ratios only, keys ending in ratio."""
    base = baselines.load(CPU_BASELINE.with_name("cuda-nvidia-h200.json"))
    assert base.machine_class == "cuda-nvidia-h200" and base.suites == ("decode-gpu",) and base.margin == 0.4
    labels = {s.label for s in suites.get_suite("decode-gpu").shapes}
    for name in ("auto", "classic"):
        assert {c.split(" / ")[1] for c in base.entries if c.endswith(f" / {name}")} == labels
    assert all(k.endswith("ratio") and v > 0 for e in base.entries.values() for k, v in e.items())


def test_the_committed_h200_decode_step_baseline_covers_every_step_shape() -> None:
    """Written from the thirtieth session's saved H200 runs (session.sh baseline and two more runs of the
    suite, then --from-json): every decode-step shape for auto and auto_compiled, against torch SDPA and the
    ceiling, the measuring options the runs share and their candidates' union."""
    base = baselines.load(CPU_BASELINE.with_name("cuda-nvidia-h200-decode-step.json"))
    assert base.machine_class == "cuda-nvidia-h200" and base.suites == ("decode-step",) and base.margin == 0.4
    labels = {s.label for s in suites.get_suite("decode-step").shapes}
    for name in ("auto", "auto_compiled"):
        assert {c.split(" / ")[1] for c in base.entries if c.endswith(f" / {name}")} == labels
    assert all(set(e) == {"speedup_vs_torch_sdpa_ratio", "ceiling_fraction_ratio"} for e in base.entries.values())
    assert base.run["candidates"] == "auto,auto_compiled,torch_sdpa,ceiling" and base.run["iters"] == 10


H100 = "cuda-nvidia-h100-80gb-hbm3"


def test_the_committed_h100_baselines_cover_every_shape_the_card_holds() -> None:
    """Written on an H100 (thirty-fifth session; the pool lends H100s far more often than the H200): every
    decode-gpu shape for auto and classic; every decode-step shape whose inputs fit the card's 80 GB (the
    suite skips the other two, b64 L8192 and b8 L32768, for memory) for auto and auto_compiled."""
    base = baselines.load(CPU_BASELINE.with_name(f"{H100}.json"))
    assert base.machine_class == H100 and base.suites == ("decode-gpu",) and base.margin == 0.4
    labels = {s.label for s in suites.get_suite("decode-gpu").shapes}
    for name in ("auto", "classic"):
        assert {c.split(" / ")[1] for c in base.entries if c.endswith(f" / {name}")} == labels
    step = baselines.load(CPU_BASELINE.with_name(f"{H100}-decode-step.json"))
    assert step.machine_class == H100 and step.suites == ("decode-step",) and step.margin == 0.4
    shapes = suites.get_suite("decode-step").shapes
    fits = {s.label for s in shapes if s.memory_estimate() <= 0.85 * 80e9}  # the suite's own memory rule
    too_big = {"step b64 h32/8 d128 L8192 bf16 x18", "step b8 h32/8 d128 L32768 bf16 x32"}
    assert {s.label for s in shapes} - fits == too_big
    for name in ("auto", "auto_compiled"):
        assert {c.split(" / ")[1] for c in step.entries if c.endswith(f" / {name}")} == fits
    for b in (base, step):
        assert all(k.endswith("ratio") and v > 0 for e in b.entries.values() for k, v in e.items())


def test_smoke_passes_against_the_committed_cpu_baseline(tmp_path, capsys) -> None:
    _committed()
    out_json = tmp_path / "run.json"
    with override_settings(plugin_autoload=False):
        rc, out, err = _cli(capsys, "--suite", "smoke", "--compare", str(CPU_BASELINE), "--quiet",
                            "--json", str(out_json))
    comp = json.loads(out_json.read_text())["comparison"]
    assert rc == 0, (err, [r for r in comp["rows"] if r["status"] in ("below", "missing")])
    assert "comparison passed" in " ".join(out.split())


def test_a_kernel_falling_to_the_reference_path_fails_the_comparison(tmp_path, capsys) -> None:
    """``auto`` forced onto the reference provider (as CI's fallback step does it), 10x+ slower against the same
    peers: the comparison fails by auto's ratios below their floors, and by nothing else. Disabling classic
    instead (CI's old step) failed from classic's missing cases, whatever auto's ratios were."""
    base = _committed()
    out_json = tmp_path / "run.json"
    with override_settings(plugin_autoload=False, provider="reference"):
        rc, out, _ = _cli(capsys, "--suite", "smoke", "--compare", str(CPU_BASELINE), "--quiet",
                          "--json", str(out_json))
    assert rc == 1
    data = json.loads(out_json.read_text())
    routes = {c["route"] for r in data["suites"][0]["results"] for c in r["candidates"] if c["name"] == "auto"}
    assert routes and all(r.startswith("reference") for r in routes), routes
    rows = data["comparison"]["rows"]
    auto = [r for r in rows if r["case"].endswith(" / auto") and r["ratio"].startswith("speedup_vs_")]
    decode = [r for r in auto if " / decode " in r["case"]]
    assert decode and all(r["status"] == "below" for r in decode), decode
    assert sum(r["status"] == "below" for r in auto) >= len(auto) // 2
    failing = [r for r in rows if r["status"] in ("below", "missing")]
    assert failing and all(r["status"] == "below" and r["case"].endswith(" / auto") for r in failing), failing
    assert "BELOW FLOOR" in out and f"margin {base.margin:g}" in out


# -- CI's fallback step (.ci/run), run on its own ---------------------------------------------------------


def _fallback_step() -> str:
    """The block of .ci/run between its ``# >>> fallback step`` and ``# <<< fallback step`` lines."""
    text = (REPO / ".ci" / "run").read_text()
    start, end = text.index("# >>> fallback step"), text.index("# <<< fallback step")
    return text[start:end]


def _run_fallback_step(tmp_path: Path, metal_attn: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The step under ``bash -e`` with ``$VENV/bin/metal-attn`` = ``metal_attn`` (a script's text, or a path to
    link), ``$PY`` this Python, ``$WORK`` ``tmp_path`` and ``$BASELINE`` the committed CPU baseline."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    exe = venv / "bin" / "metal-attn"
    if metal_attn.startswith("#!"):
        exe.write_text(metal_attn)
        exe.chmod(0o755)
    else:
        exe.symlink_to(metal_attn)
    script = ("set -euo pipefail\nstep() { echo \"==> $*\"; }\n"
              f"VENV={shlex.quote(str(venv))} PY={shlex.quote(sys.executable)} WORK={shlex.quote(str(tmp_path))}\n"
              f"BASELINE={shlex.quote(str(CPU_BASELINE))}\n" + _fallback_step())
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _fake_bench(tmp_path: Path, rc: int, routes: str, statuses: dict[str, str]) -> str:
    """A ``metal-attn`` that records its environment's METAL_ATTN_PROVIDER, writes a run whose auto rows took
    ``routes`` and whose comparison rows of each candidate have ``statuses[candidate]``, and exits ``rc``."""
    rows = [{"case": f"smoke / decode b3 / {name}", "ratio": "speedup_vs_mlx_sdpa_ratio", "status": status}
            for name, status in statuses.items()]
    run = {"suites": [{"results": [{"candidates": [{"name": "auto", "route": routes}]}]}],
           "comparison": {"rows": rows}}
    return f"""#!{sys.executable}
import json, os, sys
open({str(tmp_path / "env.txt")!r}, "w").write(os.environ.get("METAL_ATTN_PROVIDER", "<unset>"))
json.dump({run!r}, open(sys.argv[sys.argv.index("--json") + 1], "w"))
print("comparison FAILED: 2 ratios")
sys.exit({rc})
"""


@pytest.mark.parametrize(("rc", "routes", "statuses", "passes"), [
    (1, "reference (decode)", {"auto": "below", "classic": "ok"}, True),
    # what the step used to accept: classic's cases missing, auto within its floors
    (1, "reference (decode)", {"auto": "ok", "classic": "missing"}, False),
    (1, "reference (decode)", {"auto": "below", "classic": "missing"}, False),
    (1, "classic (split)", {"auto": "below", "classic": "ok"}, False),  # auto not on the reference path
    (0, "reference (decode)", {"auto": "ok", "classic": "ok"}, False),  # the comparison passed
])
def test_ci_fallback_step_passes_only_for_auto_below_its_floors(tmp_path, rc, routes, statuses, passes) -> None:
    """CI's "a kernel falling to the reference path must fail the comparison" step accepts exit 1 only when it
    comes from auto's ratios below their floors, with auto on the reference path, and routes auto there."""
    proc = _run_fallback_step(tmp_path, _fake_bench(tmp_path, rc, routes, statuses))
    assert (proc.returncode == 0) == passes, proc.stdout + proc.stderr
    assert (tmp_path / "env.txt").read_text() == "reference"
    if not passes:
        assert "CI FAILED" in proc.stderr


def test_ci_fallback_step_passes_on_this_machine(tmp_path) -> None:
    """The step as CI runs it, with this environment's ``metal-attn``: the smoke comparison exits 1 with auto on
    the reference path below its floors, and the step passes."""
    _committed()
    exe = Path(sys.executable).parent / "metal-attn"
    if not exe.exists():
        pytest.skip(f"no metal-attn command beside {sys.executable}")
    proc = _run_fallback_step(tmp_path, str(exe), {"METAL_ATTN_PLUGIN_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "comparison FAILED" in proc.stdout and "other failing rows" in proc.stdout
    assert "0 other failing rows" in proc.stdout


# -- bad files and paths -------------------------------------------------------------------------------


def test_a_file_that_is_not_text_is_an_error(tmp_path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(BaselineError, match=r"bin.json: not a text file \(not UTF-8 at byte 0\); the baseline"):
        baselines.load(path)
    with pytest.raises(BaselineError, match=r"bin.json: not a text file .* the saved run is JSON"):
        baselines.load_run(path)


def _saved(candidate: dict) -> dict:
    return {"machine": {"backend": "cpu"}, "suites": [{"name": "smoke", "results": [
        {"shape": {"label": "decode"}, "candidates": [{"name": "auto", "kind": "provider", "status": "ok",
                                                       **candidate}]}]}]}


@pytest.mark.parametrize(("candidate", "message"), [
    # a NaN ratio passed every comparison (NaN < floor is False) and made baselines their loader refused
    ({"ratios": {"x_ratio": float("nan")}}, "candidate 'auto' has ratios['x_ratio']=nan (allowed: a finite number"),
    ({"ratios": {"x_ratio": -3.0}}, "candidate 'auto' has ratios['x_ratio']=-3.0 (allowed: a finite number > 0)"),
    ({"ratios": [1]}, "a candidate without name, kind, status, numeric ratios (an object) and reasons (a list)"),
    ({"ratios": {}, "reasons": 5}, "a candidate without name, kind, status, numeric ratios (an object)"),
    # a baseline written from it was refused by --compare (every stored key must end in 'ratio')
    ({"ratios": {"speedup_vs_mlx_sdpa": 1.0}},
     "candidate 'auto' has the ratio key 'speedup_vs_mlx_sdpa' (allowed: ratio names, which end in 'ratio')"),
])
def test_bad_saved_runs_say_what_is_wrong(candidate, message) -> None:
    with pytest.raises(BaselineError) as err:
        baselines.parse_run(_saved(candidate), "run.json")
    assert str(err.value).startswith("run.json: suites[0].results[0]: ") and message in str(err.value)


def test_a_baseline_and_a_saved_run_swapped_say_which_is_which(tmp_path, capsys) -> None:
    """``--from-json BASELINE --compare RUN``: each file is named for what it is and where it goes."""
    run = _write(tmp_path, _saved({"ratios": {"x_ratio": 1.0}}) | {"schema": cli.SCHEMA}, "run.json")
    rc, _, err = _cli(capsys, "--from-json", str(CPU_BASELINE), "--compare", str(run))
    assert rc == 2 and f"{CPU_BASELINE}: a baseline (schema 'metal-attn-baseline/1'), not a saved run" in err
    with pytest.raises(BaselineError, match=r"schema='metal-attn-bench/1' \(a run saved with --json, which goes to "
                                            r"--from-json\)"):
        baselines.load(run)


def test_a_saved_run_whose_argv_is_not_a_command_line_has_none() -> None:
    data = _saved({"ratios": {"x_ratio": 1.0}}) | {"argv": [1, 2]}
    assert baselines.parse_run(data, "run.json").argv is None


def test_output_paths_and_empty_names_are_refused_before_anything_runs(tmp_path, capsys) -> None:
    """They used to fail after the whole run (a traceback, the results lost), or to pass silently:
    an unset ``--compare "$BASE"`` skipped the comparison and exited 0."""
    folder = str(tmp_path)
    missing = str(tmp_path / "no" / "such" / "x.json")
    for argv, message in [
        (["--json", folder], f"--json {folder!r} is a folder"),
        (["--json", missing], f"--json {missing!r} cannot be written (No such file or directory)"),
        (["--json", ""], "--json '' is empty"),
        (["--plot", missing], f"--plot {missing!r} cannot be written"),
        (["--write-baseline", folder], f"--write-baseline {folder!r} is a folder"),
        (["--compare", ""], "--compare '' names no file"),
        (["--suite", ""], "--suite '' names nothing"),
        (["--suite", ",", "--candidates", ""], "--suite ',' names nothing"),
        (["--candidates", ""], "--candidates '' names nothing"),
    ]:
        rc, out, err = _cli(capsys, *(["--suite", "smoke"] if "--suite" not in argv else []), *argv)
        assert (rc, out) == (2, ""), (argv, rc, err)
        assert message in err, (argv, err)
    assert not (tmp_path / "no").exists()


def test_a_ratio_exactly_on_its_floor_passes() -> None:
    """The floor is the lowest a ratio may read: with margin 0 a run equal to its baseline must pass."""
    run = {"smoke / s / auto": RunCase("ok", (), {"speedup_vs_mlx_sdpa_ratio": 1.0, "ceiling_fraction_ratio": 0.2})}
    comp = baselines.compare(_loaded(ENTRIES, 0.5), run, "cpu-2core")  # floors 1.0 and 0.2
    assert not comp.failed and [r.status for r in comp.rows] == ["ok", "ok"]
    same = {"smoke / s / auto": RunCase("ok", (), dict(ENTRIES["smoke / s / auto"]))}
    assert not baselines.compare(_loaded(ENTRIES, 0.0), same, "cpu-2core").failed


def test_saved_runs_of_two_cpu_classes_are_not_merged() -> None:
    """A 2-core and a 4-core run share a backend but not a machine class: one baseline cannot hold both."""
    def run(threads: int):
        return baselines.parse_run({"machine": {"backend": "cpu", "cpu_threads": threads},
                                    "suites": [{"name": "smoke", "results": []}]}, f"cpu{threads}.json")

    with pytest.raises(BaselineError, match="machine class 'cpu-4core'"):
        baselines.merge_runs([run(2), run(4)])


def test_saved_runs_with_different_candidate_lists_keep_their_union() -> None:
    """Runs of one suite that measured other candidate orders or subsets merge into one run whose recorded
    candidates are the union in first-seen order (a later comparison then measures every candidate the
    entries need); options they agree on stay, those they do not are dropped."""
    def run(names: list[str] | None, iters: int, tag: str):
        suite = {"name": "decode-step", "results": [], "iters": iters, "warmup": 3}
        if names is not None:
            suite["candidates"] = names
        return baselines.parse_run({"machine": {"backend": "cuda", "device_name": "NVIDIA H200"},
                                    "suites": [suite]}, f"{tag}.json")

    a = run(["auto", "auto_compiled", "torch_sdpa", "ceiling"], 10, "a")
    b = run(["auto_compiled", "torch_sdpa", "auto", "ceiling"], 10, "b")
    c = run(["torch_sdpa", "auto_compiled", "ceiling"], 20, "c")
    merged = baselines.merge_runs([c, a, b])
    assert merged.run == {"candidates": "torch_sdpa,auto_compiled,ceiling,auto", "warmup": 3}
    assert baselines.merge_runs([a, b]).run["candidates"] == "auto,auto_compiled,torch_sdpa,ceiling"
    assert baselines.merge_runs([a, a]).run == a.run == {"candidates": "auto,auto_compiled,torch_sdpa,ceiling",
                                                         "warmup": 3, "iters": 10}
    assert "candidates" not in baselines.merge_runs([a, run(None, 10, "d")]).run  # one run recorded none


def test_a_saved_run_prints_the_tables_it_printed_live(tmp_path, capsys) -> None:
    """``--from-json RUN.json`` alone measures nothing and prints the saved run's tables: the terminal table and,
    with --markdown, the Markdown matrix, each as the live run printed it (the same text); several runs one
    after another under their paths; --plot draws them."""
    run_json = tmp_path / "run.json"
    with override_settings(plugin_autoload=False):
        rc, live, err = _cli(capsys, "--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2",
                             "--candidates", "auto,reference,mlx_sdpa,ceiling", "--markdown", "--json", str(run_json))
    assert rc == 0, err
    cut = live.index("#### smoke")
    live_table, live_markdown = live[:cut], live[cut:]
    assert "reference" in live_table and "| decode b3" in live_markdown

    rc, shown, err = _cli(capsys, "--from-json", str(run_json), "--markdown")
    assert rc == 0 and err == "", err
    assert shown == live_markdown
    rc, shown, err = _cli(capsys, "--from-json", str(run_json))
    assert rc == 0 and err == "", err
    assert shown == live_table

    second = _write(tmp_path, json.loads(run_json.read_text()), "second.json")
    rc, shown, err = _cli(capsys, "--from-json", str(run_json), str(second), "--markdown",
                          "--plot", str(tmp_path / "runs.svg"))
    assert rc == 0, err
    assert shown == f"from {run_json}:\n{live_markdown}from {second}:\n{live_markdown}"
    assert (tmp_path / "runs.svg").exists() or "matplotlib is not importable" in err


def test_saved_shapes_read_back_with_their_label_phase_and_metrics() -> None:
    """`Shape.from_dict` of what `to_dict` wrote: a decode batch, a prefill chunk, a mixed batch and a decode step
    (which reads back as its decode batch under its own label) keep the label, phase, metrics and bytes a table
    shows."""
    from metal_attn.bench.decode_step import StepShape
    from metal_attn.bench.shapes import Rows

    shapes = [Shape(8, 32, 8, 128, 4096), Shape(1, 32, 8, 128, 2112, q_len=64, dtype="float16"),
              Shape.mix([Rows(8, 1, 4096), Rows(1, 512, 2048)], 32, 8, 128), StepShape(1, 24, 4, 256, 65536, layers=32)]
    for shape in shapes:
        back = Shape.from_dict(json.loads(json.dumps(shape.to_dict())))
        assert (back.label, back.phase, back.metrics, back.rows, back.dtype) == \
            (shape.label, shape.phase, shape.metrics, shape.rows, shape.dtype)
    assert Shape.from_dict(shapes[2].to_dict()) == shapes[2]


def test_a_saved_run_missing_what_its_tables_read_is_refused_before_printing(tmp_path, capsys) -> None:
    """A saved run whose machine lacks the fields the caption reads (here its MLX version) passes the baseline
    checks but cannot be shown: exit 2 naming the file, and nothing printed, not even the other runs' tables."""
    run_json = tmp_path / "run.json"
    with override_settings(plugin_autoload=False):
        assert _cli(capsys, "--suite", "smoke", "--shapes", "decode b3", "--quiet", "--iters", "2",
                    "--candidates", "auto,mlx_sdpa", "--json", str(run_json))[0] == 0
    data = json.loads(run_json.read_text())
    del data["machine"]["mlx_version"]
    broken = _write(tmp_path, data, "broken.json")
    for markdown in ([], ["--markdown"]):
        rc, out, err = _cli(capsys, "--from-json", str(run_json), str(broken), *markdown)
        assert rc == 2 and out == "", (out, err)
        assert f"{broken}: a result cannot be read back (KeyError: 'mlx_version'" in err
