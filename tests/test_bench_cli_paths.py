"""`metal-attn bench`'s regression-tracking paths: what it reads and writes, and what it refuses before measuring.

Output paths that are inputs or each other, a baseline written over another machine class's file or after a failed
comparison, a baseline's candidates from a plugin this machine lacks, a baseline's suites against ``--suite``, an
interrupted saved run, a ``--write-baseline`` plan that cannot give one, the flags ``--list`` and ``--from-json``
would ignore; the pytest-benchmark options of benchmarks/conftest.py checked by the same rules; the generate suite's
ratio keys; and the docs that describe them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from metal_attn.bench import baselines, cli, core, suites
from metal_attn.device import current_device

REPO = Path(__file__).resolve().parents[1]
B3 = "smoke / decode b3 h4/2 d64 L100 f32"
HERE = baselines.machine_class(core.machine_info())


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _no_measuring(monkeypatch) -> None:
    monkeypatch.setattr(cli, "run_suite", lambda *a, **k: pytest.fail("measured before refusing"))


def _baseline(path: Path, entries: dict, *, machine_class: str = HERE, suites_: tuple[str, ...] = ("smoke",),
              run: dict | None = None, margin: float = 0.5) -> Path:
    path.write_text(json.dumps({"schema": baselines.SCHEMA, "machine_class": machine_class, "suites": list(suites_),
                                "margin": margin, "run": run or {}, "entries": entries}))
    return path


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A tiny smoke run saved with --json: decode b3, auto against mlx_sdpa, one sample."""
    path = tmp_path_factory.mktemp("saved") / "run.json"
    assert cli.main(["--suite", "smoke", "--shapes", "decode b3", "--quiet", "--warmup", "1", "--iters", "1",
                     "--candidates", "auto,mlx_sdpa", "--json", str(path)]) == 0
    return path


# -- outputs that are inputs, or each other ----------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--compare", "X", "--write-baseline", "X"], "--write-baseline 'X' is the file --compare reads ('X')"),
    (["--from-json", "R", "--write-baseline", "R"], "--write-baseline 'R' is the file --from-json reads ('R')"),
    (["--compare", "X", "--json", "X"], "--json 'X' is the file --compare reads ('X')"),
    (["--suite", "smoke", "--json", "P.svg", "--write-baseline", "P.svg"],
     "--write-baseline 'P.svg' is the file --json writes ('P.svg')"),
    (["--suite", "smoke", "--json", "P.svg", "--plot", "P.svg"], "--plot 'P.svg' is the file --json writes ('P.svg')"),
    (["--from-json", "R", "--plot", "R"], "--plot 'R' is the file --from-json reads ('R')"),
    (["--compare", "X", "--write-baseline", "sub/../X"], "--write-baseline 'sub/../X' is the file --compare reads"),
])
def test_an_output_path_that_is_an_input_or_another_output_is_refused(tmp_path, capsys, monkeypatch, saved_run,
                                                                      argv, message) -> None:
    """They used to run: the new baseline replaced the one it was compared against, a saved run became a
    baseline, the run's JSON replaced its baseline, and of two outputs on one path only the last was kept."""
    _no_measuring(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    _baseline(tmp_path / "X", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 0.01}},
              run={"candidates": "auto,mlx_sdpa", "iters": 1})
    (tmp_path / "R").write_text(saved_run.read_text())
    before = {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    rc, out, err = _cli(capsys, *argv, "--quiet") if "--from-json" not in argv else _cli(capsys, *argv)
    assert (rc, out) == (2, ""), err
    assert f"metal-attn bench: error: {message}" in err and "(allowed: another path for" in err
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_failed_comparison_writes_no_baseline(tmp_path, capsys) -> None:
    """``--compare A --write-baseline B`` wrote B from a run that failed against A: a regression became the new
    baseline. It is not written now, and the command says so (exit 1)."""
    base = _baseline(tmp_path / "base.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 1e6}},
                     run={"candidates": "auto,mlx_sdpa", "iters": 1, "warmup": 1})
    new = tmp_path / "new.json"
    rc, out, err = _cli(capsys, "--compare", base, "--shapes", "decode b3", "--quiet", "--write-baseline", new)
    assert rc == 1 and not new.exists()
    assert f"--write-baseline {new}: not written, the comparison against {base} failed" in err
    assert "comparison FAILED" in " ".join(out.split())


# -- another machine class's file --------------------------------------------------------------------------


def test_write_baseline_refuses_a_file_of_another_machine_class(tmp_path, capsys, monkeypatch, saved_run) -> None:
    """``--from-json run.json --write-baseline benchmarks/baselines/cuda-nvidia-h200.json`` on the CPU replaced the
    H200's baseline with the CPU's ratios. Refused now, naming both classes, before anything is measured; a file of
    this machine class, an empty one or a new path is written."""
    other = "cuda-nvidia-h200" if HERE != "cuda-nvidia-h200" else "cpu-2core"
    theirs = _baseline(tmp_path / f"{other}.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 2.0}},
                       machine_class=other)
    text = theirs.read_text()
    message = (f"--write-baseline {str(theirs)!r} is the baseline of machine class {other!r}, but this run's machine "
               f"class is {HERE!r} (allowed: a new file, or a baseline of machine class {HERE!r} to replace)")
    rc, _, err = _cli(capsys, "--from-json", saved_run, "--write-baseline", theirs)
    assert rc == 2 and message in err and theirs.read_text() == text
    _no_measuring(monkeypatch)
    for dry in ([], ["--dry-run"]):
        rc, _, err = _cli(capsys, "--suite", "smoke", "--write-baseline", theirs, "--quiet", *dry)
        assert rc == 2 and message in err and theirs.read_text() == text
    if current_device().backend == "cpu":  # a GPU suite's plan: the run's machine class is the GPU's, checked there
        rc, out, err = _cli(capsys, "--suite", "decode-gpu", "--write-baseline", theirs, "--dry-run")
        assert rc == 0, err
        assert f"would write baseline {theirs} (the machine class of the GPU that runs it)" in out
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    rc, _, err = _cli(capsys, "--from-json", saved_run, "--write-baseline", notes)
    assert rc == 2 and "exists and is not a baseline (not JSON)" in err and notes.read_text() == "my notes"

    ours = _baseline(tmp_path / "ours.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 2.0}})
    empty = tmp_path / "empty.json"
    empty.write_text("")
    for path in (ours, empty, tmp_path / "new.json"):
        rc, _, err = _cli(capsys, "--from-json", saved_run, "--write-baseline", path)
        assert rc == 0, err
        assert baselines.load(path).machine_class == HERE


# -- a baseline's candidates and suites ----------------------------------------------------------------------


def test_a_baseline_candidate_from_a_missing_plugin_is_measured_as_not_registered(tmp_path, capsys) -> None:
    """A baseline whose run lists a provider of a plugin this machine lacks: the comparison runs, lists it as
    ``not registered`` and fails by its missing ratios (exit 1). It used to stop with exit 2 and an error about
    ``--candidates``, which the user never typed. Typed, such a name is still refused."""
    absent = "absent_plugin_decode"
    base = _baseline(tmp_path / "base.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 0.001},
                                              f"{B3} / {absent}": {"speedup_vs_mlx_sdpa_ratio": 1.0}},
                     run={"candidates": f"auto,mlx_sdpa,{absent}", "iters": 1, "warmup": 1})
    run_json = tmp_path / "run.json"
    rc, _, err = _cli(capsys, "--compare", base, "--shapes", "decode b3", "--quiet", "--json", run_json)
    assert rc == 1, err
    assert "--candidates" not in err.replace("measuring with the baseline's options: --candidates", "")
    data = json.loads(run_json.read_text())
    status = {c["name"]: c["status"] for c in data["suites"][0]["results"][0]["candidates"]}
    assert status == {"auto": "ok", "mlx_sdpa": "ok", absent: "not registered"}
    rows = {r["case"]: r["status"] for r in data["comparison"]["rows"]}
    assert rows == {f"{B3} / auto": "above", f"{B3} / {absent}": "missing"}
    assert "1 baseline case(s) missing from the run" in err

    rc, _, err = _cli(capsys, "--compare", base, "--candidates", f"auto,{absent}", "--dry-run")
    assert rc == 2 and f"--candidates {absent!r} is neither a registered provider" in err


def test_a_suite_that_leaves_out_the_baselines_suite_is_refused_before_measuring(tmp_path, capsys,
                                                                                monkeypatch) -> None:
    """``--suite decode-step-cpu --compare cpu-2core.json`` measured for 25 s, then failed with every case missing
    (and a dry run approved it). Refused up front now; a --suite that includes the baseline's suite runs."""
    _no_measuring(monkeypatch)
    base = _baseline(tmp_path / "base.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 2.0}})
    for dry in ([], ["--dry-run"]):
        rc, out, err = _cli(capsys, "--suite", "decode-step-cpu", "--compare", base, "--quiet", *dry)
        assert (rc, out) == (2, ""), err
        assert (f"--suite decode-step-cpu leaves out suite(s) smoke of --compare {base}, whose entries are of smoke "
                "(allowed: --suite smoke, or no --suite: the baseline's suites)") in err
    rc, out, err = _cli(capsys, "--suite", "smoke,decode-cpu", "--compare", base, "--dry-run")
    assert rc == 0, err
    assert "would run smoke" in out and "would run decode-cpu" in out


def test_a_baseline_whose_suites_are_not_its_entries_suites_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """A baseline listing ``decode-cpu`` over smoke entries planned decode-cpu, then failed with all missing."""
    _no_measuring(monkeypatch)
    base = _baseline(tmp_path / "base.json", {f"{B3} / auto": {"speedup_vs_mlx_sdpa_ratio": 2.0}},
                     suites_=("decode-cpu",))
    rc, out, err = _cli(capsys, "--compare", base, "--dry-run")
    assert (rc, out) == (2, ""), err
    assert f"entries['{B3} / auto'] is of suite 'smoke', which suites=['decode-cpu'] does not name" in err


# -- saved runs -----------------------------------------------------------------------------------------------


def test_an_interrupted_saved_run_is_not_compared(tmp_path, capsys, saved_run) -> None:
    """``--write-baseline`` refused an interrupted saved run; ``--compare`` passed it (exit 0). Both refuse it."""
    base = tmp_path / "base.json"
    assert _cli(capsys, "--from-json", saved_run, "--write-baseline", base)[0] == 0
    assert _cli(capsys, "--from-json", saved_run, "--compare", base)[0] == 0
    data = json.loads(saved_run.read_text())
    data["suites"][0]["interrupted"] = True
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(data))
    rc, out, err = _cli(capsys, "--from-json", cut, "--compare", base)
    assert (rc, out) == (1, "")
    assert f"--compare {base}: not compared, the run {cut} was interrupted (allowed: a complete run" in err


def test_from_json_refuses_the_seed_and_its_note_has_margin_and_ratios(tmp_path, capsys, saved_run) -> None:
    """``--seed`` was silently ignored by ``--from-json`` (it measures nothing); a baseline written from a saved run
    left its ``--margin`` and ``--ratios`` out of the command its note records."""
    for seed in ("7", "0"):
        rc, _, err = _cli(capsys, "--from-json", saved_run, "--compare", tmp_path / "x.json", "--seed", seed)
        assert rc == 2 and "measures nothing, so --seed cannot apply" in err
    base = tmp_path / "b.json"
    rc, _, err = _cli(capsys, "--from-json", saved_run, "--write-baseline", base, "--margin", "0.3",
                      "--ratios", "speedup_vs_*")
    assert rc == 0, err
    note = json.loads(base.read_text())["note"]
    assert f"`metal-attn bench --from-json {saved_run} --write-baseline {base} --margin 0.3 --ratios 'speedup_vs_*'`" \
        in note


# -- a --write-baseline plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "message"), [
    (["--candidates", "mlx_sdpa,gather_sdpa"], "no candidate whose ratios a baseline stores (allowed: a provider, "
                                               "auto, auto_compiled or auto_staged among the candidates"),
    (["--candidates", "auto[validate_metadata=0],mlx_sdpa"], "no candidate whose ratios a baseline stores"),
    (["--candidates", "auto,classic"], "no ratio a provider could carry (allowed: a peer among gather_sdpa, "
                                       "mlx_sdpa, mlx_sdpa_packed, torch_sdpa, or the ceiling on shapes with GB/s"),
    (["--candidates", "auto,mlx_sdpa", "--ratios", "ceiling_*"], "no ratio matching --ratios ceiling_* a provider"),
    (["--shapes", "prefill", "--candidates", "auto,ceiling"], "no ratio a provider could carry"),  # no GB/s there
])
def test_a_write_baseline_that_cannot_be_written_is_refused_in_the_plan(tmp_path, capsys, monkeypatch, extra,
                                                                        message) -> None:
    """``--dry-run`` approved such a plan; the run measured, then wrote nothing (exit 1). Both refuse it now."""
    _no_measuring(monkeypatch)
    out_path = tmp_path / "b.json"
    for dry in (["--dry-run"], []):
        rc, out, err = _cli(capsys, "--suite", "smoke", *extra, "--write-baseline", out_path, "--quiet", *dry)
        assert (rc, out) == (2, ""), err
        assert f"--write-baseline {out_path}: {message}" in err
    assert not out_path.exists()


def test_a_write_baseline_plan_that_can_be_written_is_said(tmp_path, capsys) -> None:
    rc, out, err = _cli(capsys, "--suite", "smoke", "--candidates", "auto,ceiling", "--ratios", "ceiling_*",
                        "--write-baseline", tmp_path / "b.json", "--dry-run")
    assert rc == 0, err
    assert f"would write baseline {tmp_path / 'b.json'} (machine class {HERE})" in out


# -- --list --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "named"), [
    (["--candidates", "nosuch"], "--candidates"),
    (["--compare", "/nonexistent.json"], "--compare"),
    (["--write-baseline", "/nonexistent/x.json"], "--write-baseline"),
    (["--repeat", "3", "--seed", "0"], "--seed, --repeat"),
    (["--shapes", "b3", "--dry-run"], "--shapes, --dry-run"),
])
def test_list_refuses_the_flags_it_would_ignore(capsys, extra, named) -> None:
    rc, out, err = _cli(capsys, "--list", "--suite", "smoke", *extra)
    assert (rc, out) == (2, "")
    assert (f"--list prints the suites and exits, so {named} would be ignored (allowed with --list: --suite, --json, "
            "--quiet)") in err


# -- benchmarks/conftest.py: the pytest-benchmark options ----------------------------------------------------


def _bench_conftest():
    spec = importlib.util.spec_from_file_location("_bench_conftest", REPO / "benchmarks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Metafunc:
    """What ``pytest_generate_tests`` reads of a metafunc: the fixture names and the options; what it parametrizes."""

    fixturenames = ("run_bench", "bench_shape", "bench_candidate")

    def __init__(self, **options: str | None) -> None:
        opts = {"--bench-suite": None, "--bench-shapes": None, "--bench-candidates": None, **options}
        self.config = SimpleNamespace(getoption=lambda name: opts[name])
        self.params: list = []

    def parametrize(self, names, values, ids=None) -> None:
        self.params = [(s.label, n) for s, n in values]


@pytest.mark.parametrize(("options", "message"), [
    # each of these ran with every test skipped, and exited 0
    ({"--bench-candidates": "nosuch"}, "--bench-candidates 'nosuch' is neither a registered provider nor a candidate "
                                       "of suite 'smoke' (allowed: auto, "),
    ({"--bench-candidates": "ceiling"}, "--bench-candidates 'ceiling' is measured by `metal-attn bench`, not timed by "
                                        "pytest-benchmark (allowed: providers by name"),
    ({"--bench-candidates": "auto[partition_size=64"}, "--bench-candidates: candidate 'auto[partition_size=64' is not "
                                                       "NAME[setting=value;...]"),
    ({"--bench-candidates": ""}, "--bench-candidates '' names nothing"),
    ({"--bench-shapes": ","}, "--bench-shapes ',' holds no pattern (allowed: labels or globs"),
    ({"--bench-shapes": "zzz"}, "--bench-shapes 'zzz' matches no shape of suite 'smoke'"),
])
def test_the_pytest_benchmark_options_are_checked_as_the_cli_checks_its_flags(options, message) -> None:
    conftest = _bench_conftest()
    metafunc = _Metafunc(**{"--bench-suite": "smoke", **options})
    with pytest.raises(pytest.UsageError) as exc:
        conftest.pytest_generate_tests(metafunc)
    assert message in str(exc.value)


def test_a_gpu_suite_is_a_usage_error_of_pytest_benchmark_on_the_cpu() -> None:
    if current_device().backend != "cpu":
        pytest.skip("a GPU suite runs on this backend")
    with pytest.raises(pytest.UsageError, match="--bench-suite decode-gpu needs a GPU backend"):
        _bench_conftest().pytest_generate_tests(_Metafunc(**{"--bench-suite": "decode-gpu"}))


def test_pytest_benchmark_variants_keep_their_commas_and_the_suites_ceiling_is_left_out() -> None:
    """A variant's commas split it into two broken names (each skipped as not registered); now one candidate. The
    suite's own list drops its ceiling without a word, as before."""
    conftest = _bench_conftest()
    variant = "auto[partition_size=64,validate_metadata=0]"
    metafunc = _Metafunc(**{"--bench-suite": "smoke", "--bench-shapes": "decode b3",
                            "--bench-candidates": f"{variant},mlx_sdpa"})
    conftest.pytest_generate_tests(metafunc)
    assert metafunc.params == [("decode b3 h4/2 d64 L100 f32", variant), ("decode b3 h4/2 d64 L100 f32", "mlx_sdpa")]
    metafunc = _Metafunc(**{"--bench-suite": "smoke", "--bench-shapes": "decode b3"})
    conftest.pytest_generate_tests(metafunc)
    assert [n for _, n in metafunc.params] == [n for n in suites.get_suite("smoke").candidates if n != "ceiling"]


def test_pytest_benchmark_times_a_variant_under_its_settings(tmp_path) -> None:
    """The variant runs (it used to be skipped as `not registered`), named and kinded as `metal-attn bench` does."""
    pytest.importorskip("pytest_benchmark")
    out = tmp_path / "pb.json"
    variant = "auto[partition_size=64,validate_metadata=0]"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(REPO / "benchmarks" / "test_bench_suite.py"), "--benchmark-only", "--bench-suite", "smoke",
         "--bench-shapes", "decode b3", "--bench-candidates", f"{variant},mlx_sdpa", "--benchmark-json", str(out),
         "--benchmark-max-time=0.02", "--benchmark-min-rounds=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = {b["extra_info"]["candidate"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    assert set(bench) == {variant, "mlx_sdpa"}
    assert bench[variant]["kind"] == "variant" and bench[variant]["speedup_vs_mlx_sdpa_ratio"] > 0


# -- the generate suite's ratio keys -------------------------------------------------------------------------


def test_every_generate_ratio_key_reads_higher_as_better() -> None:
    """``peak_memory_ratio`` was engine / peer, higher worse, under the ``*ratio`` names documented higher-is-better.
    An engine better than its peer in everything reads above 1 in every ``*ratio`` key; its memory is
    ``peak_memory_of_peer``, the fraction of the peer's."""
    from metal_attn.bench import generate

    def result(candidate: str, wall_s: float, ttft: float, peak: int) -> generate.GenerateResult:
        return generate.GenerateResult("random", 8, candidate, 32, 32, wall_s, 0.1, 256, ttft, peak)

    (row,) = generate.ratios([result("engine", 1.0, 0.05, 100), result("batch_generator", 2.0, 0.1, 200)])
    keys = [k for k in row if k.endswith("ratio")]
    assert sorted(keys) == ["e2e_ratio", "generation_ratio", "ttft_ratio"]
    assert all(row[k] > 1 for k in keys), row
    assert row["peak_memory_of_peer"] == pytest.approx(0.5)


# -- the docs ------------------------------------------------------------------------------------------------


def test_the_docs_say_auto_compiled_is_stored_in_baselines() -> None:
    """docs/regressions.md said `auto_compiled` (kind ``compiled``) was not stored in baselines; the code stores it."""
    assert "compiled" in baselines.TRACKED_KINDS
    text = " ".join((REPO / "docs" / "regressions.md").read_text().split())
    sentence = text[text.index("(kind `compiled`"):][:200]
    assert "not stored in baselines" not in sentence and "stored in baselines" in sentence


def test_ci_runs_the_suite_module_it_says_it_runs_once() -> None:
    """benchmarks/README.md and .ci/run said CI ran each benchmark of test_bench_suite.py once; without a --bench-*
    option its one test is skipped. CI gives it the smoke suite now, and the GPU file is said to be only collected."""
    ci = (REPO / ".ci" / "run").read_text()
    line = next(x for x in ci.splitlines() if "test_bench_suite.py" in x and "$REPO" in x)
    assert "test_bench_suite.py\" --bench-suite smoke" in line
    readme = " ".join((REPO / "benchmarks" / "README.md").read_text().split())
    assert "`test_bench_suite.py --bench-suite smoke` with `--benchmark-disable` (each benchmark once" in readme
    assert "`test_bench_gpu.py` is collected there too, its benchmarks skipping on the CPU" in readme
