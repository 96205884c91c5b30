"""The GPU session runner (benchmarks/device/session.sh): its phase names and its time budget.

What the phases measure needs the H200; what is checked here is the harness a device call depends
on: an unknown phase is refused before anything runs, and a step the budget cannot hold is skipped,
named and counted as a failure, so a call never runs past the device tool's limit unseen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device" / "session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path / "out"), **env})


def test_no_phase_prints_the_usage(tmp_path):
    got = _run(tmp_path=tmp_path)
    assert got.returncode == 2
    assert "Phases" in got.stdout and "BUDGET" in got.stdout


def test_an_unknown_phase_is_refused_before_any_phase_runs(tmp_path):
    got = _run("tests", "decod", tmp_path=tmp_path)
    assert got.returncode == 2
    assert "unknown phase 'decod'" in got.stderr and "allowed: tests, decode" in got.stderr
    assert not (tmp_path / "out").exists()


def test_steps_the_budget_cannot_hold_are_skipped_and_named(tmp_path):
    got = _run("decode", tmp_path=tmp_path, BUDGET="0")
    assert got.returncode == 1
    for step in ("decode-gpu", "decode-step", "sweep-matrix"):
        assert f"decode/{step}: skipped" in got.stdout
        assert f"decode/{step} (skipped)" in got.stdout.splitlines()[-1]
    assert (tmp_path / "out" / "decode").is_dir()
    assert not list((tmp_path / "out" / "decode").iterdir())  # nothing ran


def test_pack_leaves_one_archive_of_every_phases_folder(tmp_path):
    """PACK=1 (the device tool brings back at most eight files a call): the phases' folders go into one archive
    with their logs, failed steps and all, each folder once, and nothing else is left under OUT."""
    import tarfile

    # Run from tmp_path, the `wait` phase's script and test path do not exist: both steps fail at once, with logs.
    got = _run("wait", "wait", tmp_path=tmp_path, PACK="1", BUDGET="40")
    assert got.returncode == 1  # the failures are still reported
    assert "packed wait into" in got.stdout and "failed: wait/probe wait/pytest" in got.stdout
    out = tmp_path / "out"
    assert [p.name for p in out.iterdir()] == ["session.tar.gz"]
    with tarfile.open(out / "session.tar.gz") as archive:
        names = [m.name for m in archive.getmembers()]
    assert sorted(names) == ["wait", "wait/probe.log", "wait/pytest.log"]


def test_a_pack_that_fails_keeps_the_folders_and_fails_the_session(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tar").write_text("#!/bin/sh\necho 'tar: no space left' >&2\nexit 2\n")
    (fake / "tar").chmod(0o755)
    got = _run("decode", tmp_path=tmp_path, PACK="1", BUDGET="0", PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert got.returncode == 1
    assert "packing failed" in got.stdout and "pack" in got.stdout.splitlines()[-1]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["decode"]


@pytest.mark.skipif(bool(list(Path("/usr/local").glob("cuda*/bin/ncu"))), reason="this machine has ncu")
def test_the_ncu_phase_without_ncu_says_so(tmp_path):
    got = _run("ncu", tmp_path=tmp_path, NCU="", PATH="/usr/bin:/bin")
    assert got.returncode == 1
    assert "no ncu" in got.stdout


def test_the_profiler_driver_runs_our_side_on_any_backend(tmp_path):
    """`benchmarks/ncu_decode_pair.py ours ...` (what the ncu phase profiles) runs here on the CPU, through
    the registry; a bad shape is refused with the rule."""
    import sys

    driver = str(ROOT / "benchmarks" / "ncu_decode_pair.py")
    got = subprocess.run([sys.executable, driver, "ours", "2", "8", "2", "64", "40", "2"], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "op='paged_attention'" in got.stderr and "heads=8/2x64" in got.stderr
    bad = subprocess.run([sys.executable, driver, "ours", "2", "8", "3", "64", "40"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "HEADS a multiple of KV_HEADS" in bad.stderr


#: Every phase of session.sh, in its order (the dry-run test checks the script lists no other).
DRY_RUN_PHASES = ("tests", "decode", "prefill", "streams", "stalls", "finish", "idle", "direct", "wait", "staged",
                  "engine", "baseline", "queued", "tiles", "inchain", "cudnn", "rowswait", "mixblock", "fuzz", "ncu",
                  "partition", "kernels")


def test_the_device_readme_describes_every_phase():
    """benchmarks/device/README.md's phase table has a row for each phase the script runs."""
    readme = (ROOT / "benchmarks" / "device" / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")}
    phases = set(DRY_RUN_PHASES)
    assert rows == phases, f"phases without a row: {sorted(phases - rows)}; rows of no phase: {sorted(rows - phases)}"


def _dry_run(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    import sys

    # The script runs `python3`: this interpreter's (a venv's bin/ has one), as on the GPU machine's setup.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(["bash", str(script), *DRY_RUN_PHASES], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "DRY_RUN": "1",
                               "METAL_ATTN_PLUGIN_AUTOLOAD": "0"})


def test_a_dry_run_checks_every_step_of_every_phase(tmp_path):
    """Every bench command's flags and names, the GPU tests' collection and every script's imports, here on
    the CPU, so a device call does not find a typo after its machine started."""
    got = _dry_run(SCRIPT, tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-2000:]
    script_phases = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("PHASES=("))
    assert script_phases == f"PHASES=({' '.join(DRY_RUN_PHASES)})", "a phase the dry run does not check"
    checked = [line for line in got.stdout.splitlines() if "[dry run: " in line]
    # steps per phase: 1 + 3 + 4 + 4 + 5 + 3 + 4 + 5 + 2 + 2 + 2 + 2 + 4 + 3 + 4 + 1 + 4 + 4 + 1 + 8 + 1 + 4
    assert len(checked) == 71
    # A step run under `env NAME=VALUE` is checked too (its command after the variables, with --dry-run).
    assert any("env MLX_USE_CUDA_GRAPHS=0 python3 -m metal_attn.bench.cli" in line
               and line.endswith("[dry run: --dry-run]") for line in checked)
    assert not [line for line in checked if "nothing here knows" in line]
    assert got.stdout.count(": ok") == len(checked)
    assert "dry run: every step checked (nothing measured)" in got.stdout


def test_a_dry_run_finds_a_misspelled_candidate(tmp_path):
    broken = tmp_path / "session.sh"
    text = SCRIPT.read_text()
    assert '"auto,torch_sdpa,mlx_sdpa,ceiling"' in text
    broken.write_text(text.replace('"auto,torch_sdpa,mlx_sdpa,ceiling"', '"auto,torch_sdpa,mlx_sdpaa,ceiling"'))
    got = _dry_run(broken, tmp_path)
    assert got.returncode == 1
    assert "decode/decode-step: FAILED" in got.stdout and "'mlx_sdpaa' is neither" in got.stdout
    assert "failed: decode/decode-step" in got.stdout.splitlines()[-1]


def test_a_dry_run_checks_the_command_after_env_variables(tmp_path):
    """A step run as `env NAME=VALUE COMMAND` has COMMAND checked: a misspelled candidate there fails."""
    broken = tmp_path / "session.sh"
    text = SCRIPT.read_text()
    step = ('env MLX_USE_CUDA_GRAPHS=0 "${BENCH[@]}" --suite decode-gpu --pipelined \\\n'
            '        --shapes mixed --repeat 3 --quiet --markdown --candidates auto,mlx_sdpa ')
    assert step in text
    broken.write_text(text.replace(step, step.replace("auto,mlx_sdpa ", "auto,mlx_sdpaa ")))
    got = _dry_run(broken, tmp_path)
    assert got.returncode == 1
    assert "prefill/mixed-no-graphs: FAILED" in got.stdout and "'mlx_sdpaa' is neither" in got.stdout
