"""The ``metal-attn`` command: every subcommand with and without ``--json``, bad flags,
the demo's checks (including one that must fail), the bench delegation, and the
generated docs tables staying in step with the code.

Most tests call `metal_attn.cli.main` in-process (fast); a few run a fresh
``python -m metal_attn`` (or the installed ``metal-attn`` script) from a
temporary directory, so that an installed package is the one imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import pytest

import metal_attn
from metal_attn import cli, plugins
from metal_attn.demo import TOLERANCES
from metal_attn.provider import Plan, Provider
from metal_attn.settings import Settings, env_names, override_settings, reload_settings

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def fresh_process(*argv: str, env: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("METAL_ATTN_", "VLLM_METAL_"))}
    return subprocess.run([sys.executable, "-m", "metal_attn", *argv], cwd=cwd, env=base | (env or {}),
                          capture_output=True, text=True, timeout=300)


pytestmark = pytest.mark.usefixtures("restore_logging")


# -- providers -------------------------------------------------------------------------------------


def test_providers_json_lists_reference_as_enabled_and_available(capsys):
    code, data = run_json(capsys, "providers")
    assert code == 0
    rows = {p["name"]: p for p in data["providers"]}
    ref = rows["reference"]
    assert ref["enabled"] is True and ref["available"] is True and ref["availability_reasons"] == []
    assert ref["plugin"] == "builtin" and ref["distribution"] == "metal-attn"
    assert set(ref["backends"]) == {"metal", "cuda", "cpu"}
    assert data["device"]["backend"] == metal_attn.current_device().backend
    priorities = [p["priority_here"] for p in data["providers"]]
    assert priorities == sorted(priorities, reverse=True)  # the order on this device's backend
    gqa = rows["gqa_decode"]  # declares 80 and {"cuda": 5}
    assert gqa["priority_here"] == (5 if data["device"]["backend"] == "cuda" else 80)
    assert "versions" not in data


def test_providers_table_names_every_provider(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = run(capsys, "providers")
    assert code == 0
    for p in metal_attn.providers():
        assert p["name"] in out
    assert "reference" in out and "available" in out


def test_providers_versions_for_bug_reports(capsys):
    code, data = run_json(capsys, "providers", "--versions")
    assert code == 0
    v = data["versions"]
    for key in ("metal-attn", "mlx", "mlx-lm", "pluggy", "pydantic-settings", "structlog", "python", "platform"):
        assert key in v, key
    assert v["mlx"] == md.version("mlx")
    assert v["pluggy"] == md.version("pluggy")
    assert v["python"].startswith(".".join(map(str, sys.version_info[:3])))
    code, out, _ = run(capsys, "providers", "--versions")
    assert code == 0 and md.version("structlog") in out


def test_providers_on_a_device_preset_reports_availability_there(capsys):
    code, data = run_json(capsys, "providers", "--device", "h200")
    assert code == 0
    assert data["device"]["backend"] == "cuda" and data["device"]["hypothetical"] is True
    for p in data["providers"]:
        assert p["available"] == ("cuda" in p["backends"] and not p["availability_reasons"])
        if "cuda" not in p["backends"]:
            assert "backend=cuda" in " ".join(p["availability_reasons"])


def test_disabled_provider_is_listed_with_its_reason(capsys):
    with override_settings(disabled_providers=("reference",)):
        code, data = run_json(capsys, "providers")
    assert code == 0
    ref = next(p for p in data["providers"] if p["name"] == "reference")
    assert ref["enabled"] is False
    assert ref["disabled_reason"] == ("disabled by the disabled_providers setting (reference; its variable: "
                                      "METAL_ATTN_DISABLED_PROVIDERS)")


# -- explain ---------------------------------------------------------------------------------------


def test_explain_on_m5_max_shows_metal_and_the_chosen_provider(capsys):
    code, data = run_json(capsys, "explain", "--device", "m5-max", "--batch", "8", "--context", "8192")
    assert code == 0
    assert data["device"]["backend"] == "metal" and data["device"]["name"] == "Apple M5 Max"
    assert data["request"]["backend"] == "metal"
    assert data["request"]["phase"] == "decode" and data["request"]["num_seqs"] == 8
    assert data["request"]["max_seq_len"] == 8192
    rows = data["providers"]
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["name"] == data["chosen"]
    # The chosen one is the first admitted in priority order, and it carries a plan.
    assert data["chosen"] == next(r["name"] for r in rows if r["admitted"])
    assert chosen[0]["plan"]["provider"] == data["chosen"] and chosen[0]["reasons"] == []
    # Same answer as the library's explain on the same preset.
    lib = metal_attn.explain(q_lens=[1] * 8, seq_lens=[8192] * 8, device="m5-max")
    assert lib.chosen.name == data["chosen"]
    assert [r.name for r in lib.rows] == [r["name"] for r in rows]

    code, out, _ = run(capsys, "explain", "--device", "m5-max", "--batch", "8", "--context", "8192")
    assert code == 0
    assert "metal" in out and "Apple M5 Max" in out and "CHOSEN" in out and data["chosen"] in out


def test_explain_lists_describe_a_mixed_batch(capsys):
    code, data = run_json(capsys, "explain", "--q-lens", "1,1,128", "--seq-lens", "4096,300,128", "--heads", "16",
                          "--kv-heads", "4", "--head-size", "64", "--block-size", "32", "--dtype", "bfloat16")
    assert code == 0
    req = data["request"]
    assert (req["phase"], req["num_seqs"], req["num_decode_seqs"], req["total_q_tokens"]) == ("mixed", 3, 2, 130)
    assert (req["num_heads"], req["num_kv_heads"], req["head_size"], req["block_size"]) == (16, 4, 64, 32)
    assert req["dtype"] == req["cache_dtype"] == "bfloat16"
    assert req["max_decode_seq_len"] == 4096


def test_explain_takes_a_one_row_sequence_after_a_chunk_as_paged_attention_does(capsys):
    # A one-row sequence after a chunk is a one-token chunk: the batch is a prefill, and explain chooses what
    # the API's explain (and so a real call) chooses.
    code, data = run_json(capsys, "explain", "--q-lens", "4,1", "--seq-lens", "9,9")
    assert code == 0
    assert (data["request"]["phase"], data["request"]["num_decode_seqs"]) == ("prefill", 0)
    want = metal_attn.explain(q_lens=[4, 1], seq_lens=[9, 9]).chosen.name
    assert data["chosen"] == want and [r["name"] for r in data["providers"] if r["chosen"]] == [want]


def test_explain_translates_a_page_size_to_the_kernel_block_size(capsys):
    code, data = run_json(capsys, "explain", "--block-size", "64")
    assert code == 0 and data["request"]["block_size"] == 32
    code, data = run_json(capsys, "explain", "--block-size", "24")
    assert code == 0 and data["request"]["block_size"] == 8


def test_explain_device_overrides_and_features(capsys):
    code, data = run_json(capsys, "explain", "--backend", "cuda", "--gpu-cores", "7", "--arch", "sm_90",
                          "--q-len", "4", "--context", "64", "--batch", "2", "--sinks", "--sliding-window", "32",
                          "--softcap", "30")
    assert code == 0
    dev = data["device"]
    assert (dev["backend"], dev["gpu_cores"], dev["architecture"], dev["hypothetical"]) == ("cuda", 7, "sm_90", True)
    req = data["request"]
    assert req["phase"] == "verify" and req["sinks"] is True
    assert req["sliding_window"] == 32 and req["softcap"] == 30.0
    for r in data["providers"]:
        if r["name"] != "reference" and not r["admitted"]:
            assert r["reasons"], r


HUGE_BATCHES = [
    (["--batch", "100000000"], 0, "seqs=100000000 (decode 100000000), q_tokens=100000000"),
    (["--batch", "2147483647", "--json"], 0, '"total_q_tokens": 2147483647'),
    (["--batch", "2147483648"], 2, "--batch=2147483648 with --q-len=1 (allowed: 1 to 2147483647: "),
    (["--batch", "100000000", "--q-len", "32", "--context", "64"], 2,
     "--batch=100000000 with --q-len=32 (allowed: 1 to 67108863: "),
]


@pytest.mark.parametrize(("argv", "code", "expected"), HUGE_BATCHES, ids=[" ".join(a) for a, _, _ in HUGE_BATCHES])
def test_explain_answers_a_huge_batch_at_once_or_names_the_flag(tmp_path, argv, code, expected):
    """--batch 100000000 built and checked two lists of 10**8 lengths (minutes, gigabytes); past what int32
    query-row offsets address it ran out of memory (a MemoryError traceback, or the OOM killer)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "metal_attn", "explain", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"explain {' '.join(argv)} ran past 60 s")
    assert proc.returncode == code, proc.stderr[-2000:]
    assert expected in " ".join((proc.stdout if code == 0 else proc.stderr).split())
    if code == 2:
        assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_a_uniform_request_is_the_request_of_its_lengths():
    from metal_attn.errors import InvalidInputError
    from metal_attn.request import AttentionRequest

    for q, s in ((1, 4096), (4, 64), (4, 4), (64, 2112), (17, 100)):
        kw = dict(num_heads=16, num_kv_heads=4, head_size=64, block_size=32, sliding_window=128)
        assert (AttentionRequest.uniform(num_seqs=5, q_len=q, seq_len=s, **kw)
                == AttentionRequest.from_lengths(q_lens=[q] * 5, seq_lens=[s] * 5, **kw)), (q, s)
    with pytest.raises(InvalidInputError, match=r"^num_seqs=1073741824 x q_len=2 = 2147483648 query rows \(allowed"):
        AttentionRequest.uniform(num_seqs=2**30, q_len=2, seq_len=8)
    with pytest.raises(InvalidInputError, match=r"^num_seqs=0 \(allowed: an int >= 1\)"):
        AttentionRequest.uniform(num_seqs=0, q_len=1, seq_len=8)


def test_explain_forced_provider(capsys):
    code, data = run_json(capsys, "explain", "--provider", "reference")
    assert code == 0
    assert data["forced"] == "reference" and [r["name"] for r in data["providers"]] == ["reference"]
    # the API names an unregistered provider in its decision table; the command line refuses the flag
    exp = metal_attn.explain(metal_attn.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[64]),
                             provider="no_such_provider")
    registered = ", ".join(p["name"] for p in metal_attn.providers())
    assert exp.chosen is None
    assert exp.rows[-1].reasons == (f"provider='no_such_provider' is not registered (registered: {registered})",)
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--provider", "no_such_provider", "--json"])
    assert exc.value.code == 2 and capsys.readouterr().out == ""


# -- bad flags -------------------------------------------------------------------------------------


BAD_FLAGS = [
    (["explain", "--dtype", "float8"], ["--dtype", "'float8'", "float16", "bfloat16", "float32"]),
    (["explain", "--heads", "0"], ["--heads", "'0'", "integer >= 1"]),
    (["explain", "--context", "many"], ["--context", "'many'", "integer >= 1"]),
    (["explain", "--softcap", "-1"], ["--softcap", "'-1'", "finite number > 0"]),
    (["explain", "--device", "m9"], ["--device", "'m9'", "m5-max", "h200"]),
    (["explain", "--backend", "rocm"], ["--backend", "'rocm'", "metal", "cuda", "cpu"]),
    (["explain", "--q-lens", "1,x", "--seq-lens", "5,5"], ["--q-lens", "'1,x'", "comma-separated integers >= 1"]),
    (["explain", "--q-lens", "1,2", "--seq-lens", "5"], ["--q-lens has 2 values", "--seq-lens has 1"]),
    (["explain", "--q-lens", "1"], ["--q-lens needs --seq-lens"]),
    (["explain", "--q-lens", "1", "--seq-lens", "9", "--batch", "2"], ["--batch", "cannot be combined"]),
    (["explain", "--q-lens", "8", "--seq-lens", "4"], ["q_len=8 > seq_len=4"]),
    (["explain", "--heads", "6", "--kv-heads", "4"], ["--heads=6", "--kv-heads=4", "whole groups"]),
    (["demo", "--block-size", "12"], ["--block-size=12", "multiple of 8"]),
    (["demo", "--steps", "1"], ["--steps=1", ">= 2"]),
    (["demo", "--heads", "6", "--kv-heads", "4"], ["--heads=6", "--kv-heads=4"]),
    (["demo", "--dtype", "int8"], ["--dtype", "'int8'", "float16"]),
    (["demo", "--seed", "-3"], ["--seed", "'-3'", "integer >= 0"]),
    # past MLX's seed range: a nanobind TypeError traceback
    (["demo", "--seed", str(2**64)], ["--seed=18446744073709551616", "0 to 2**64 - 1"]),
    # the request's own checks exited 1 naming API fields (sliding_window=, softcap=, provider=)
    (["explain", "--sliding-window", str(10**20)], ["--sliding-window=100000000000000000000", "2147483647"]),
    (["explain", "--softcap", "1e-300"], ["--softcap=1e-300", "float32 holds"]),
    (["explain", "--provider", "nope"], ["--provider 'nope' is not registered", "classic", "reference"]),
    (["demo", "--provider", ""], ["--provider '' is not registered"]),
    (["explain", "--q-lens", "1,,1", "--seq-lens", "5,,5"], ["--q-lens", "'1,,1'"]),  # read as two sequences
    (["models", "path", "--force"], ["--force goes with fetch"]),  # silently ignored
    (["providers", "--device", "tpu"], ["--device", "'tpu'", "m3-10core"]),
    (["frobnicate"], ["'frobnicate'", "providers", "explain", "doctor", "settings", "demo", "bench"]),
    (["settings", "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_exit_2_naming_flag_value_and_allowed(capsys, argv, expected):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    for text in expected:
        assert text in err, (text, err)


def test_bad_setting_in_the_environment_exits_2_with_the_variable(tmp_path):
    proc = fresh_process("settings", env={"METAL_ATTN_LOG_LEVEL": "loud"}, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "METAL_ATTN_LOG_LEVEL='loud'" in proc.stderr
    assert "'debug', 'info', 'warning' or 'error'" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- settings --------------------------------------------------------------------------------------


def test_settings_json_lists_every_variable_with_default_and_current(capsys):
    with override_settings(gpu_cores=40, disabled_providers=("reference", "classic")):
        code, data = run_json(capsys, "settings")
    assert code == 0
    rows = {r["name"]: r for r in data["settings"]}
    assert list(rows) == list(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        r = rows[name]
        assert r["variable"] == "METAL_ATTN_" + name.upper()
        assert r["description"] == field.description and r["description"]
        assert set(r["aliases"]) == {n for n, f in env_names().items() if f == name} - {r["variable"]}
    assert rows["gpu_cores"]["default"] is None and rows["gpu_cores"]["current"] == 40
    assert rows["gpu_cores"]["allowed"] == "integer >= 1, <= 4096 (or unset)"
    assert rows["disabled_providers"]["current"] == ["reference", "classic"]
    assert rows["log_level"]["allowed"] == "debug, info, warning, error"
    assert rows["disable_gqa_decode"]["aliases"] == ["VLLM_METAL_DISABLE_GQA_DECODE"]
    assert rows["log_level"]["default"] == "warning"


def test_settings_table_shows_values_and_where_they_come_from(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    reload_settings()  # the conftest fixture restores the previous settings afterwards
    code, out, _ = run(capsys, "settings")
    assert code == 0
    for name in Settings.model_fields:
        assert "METAL_ATTN_" + name.upper() in out
    line = next(ln for ln in out.splitlines() if "METAL_ATTN_DISABLE_GQA_DECODE" in ln)
    assert "true  (from VLLM_METAL_DISABLE_GQA_DECODE)" in line


# -- doctor ----------------------------------------------------------------------------------------


def test_doctor_json_reports_device_settings_native_module_providers_and_smoke(capsys):
    with override_settings(gpu_cores=12):
        code, data = run_json(capsys, "doctor")
    assert code == 0, data["problems"]
    assert data["ok"] is True and data["problems"] == []
    assert data["device"]["backend"] == metal_attn.current_device().backend
    assert data["device"]["gpu_cores"] == 12 and data["device_overrides"] == ["gpu_cores"]
    expected = {"gpu_cores": {"value": 12, "default": None}}
    if not metal_attn.settings().plugin_autoload:  # the suite's hermetic default (tests/conftest.py)
        expected["plugin_autoload"] = {"value": False, "default": True}
    assert data["non_default_settings"] == expected
    native = data["native_module"]
    try:
        importlib.import_module("metal_attn._native")
        expected = "ok"
    except ModuleNotFoundError as exc:
        expected = "not built" if exc.name == "metal_attn._native" else "import failed"
    except Exception:
        expected = "import failed"
    assert native["status"] == expected and native["detail"]
    ref = next(p for p in data["providers"] if p["name"] == "reference")
    assert ref["available"] is True and ref["enabled"] is True
    assert [s["phase"] for s in data["smoke"]] == ["prefill", "mixed", "decode"]
    assert all(s["ok"] and s["provider"] for s in data["smoke"])
    assert data["kernel_failures"] == [] and data["plugin_load_errors"] == {}
    assert "mlx" in data["versions"]


@pytest.mark.parametrize(("error", "status"), [
    (ModuleNotFoundError("No module named 'metal_attn._native'", name="metal_attn._native"), "not built"),
    (ModuleNotFoundError("No module named 'libsimulated'", name="libsimulated"), "import failed"),
    (ImportError("undefined symbol: simulated"), "import failed"),
])
def test_doctor_native_status_comes_from_the_loader(monkeypatch, error, status):
    """The loader classifies the import failure itself (a missing module of its own is "not built",
    anything else "import failed"), and doctor shows its status."""
    import importlib

    from metal_attn import native

    real_import = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name == "metal_attn._native":
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(native.importlib, "import_module", import_module)
    try:
        native._reset_for_tests()
        got = cli.native_module_status()
        assert got["status"] == status and got["detail"] == native.unavailable_reason()
        if status == "import failed":
            assert str(error) in got["detail"]
    finally:
        monkeypatch.undo()
        native._reset_for_tests()


def test_doctor_table(capsys):
    code, out, _ = run(capsys, "doctor", "--no-smoke")
    assert code == 0
    for text in ("native CPU module", "providers", "kernel compile failures", "no problems found", "reference"):
        assert text in out


@pytest.mark.skipif(metal_attn.current_device().backend != "cpu", reason="the native module is the CPU backend's path")
def test_doctor_reports_a_missing_native_module_as_a_problem_on_the_cpu(capsys):
    """The CPU install's main failure (no compiled module: classic unavailable, calls on the reference path)
    ended in "no problems found" and exit 0."""
    from metal_attn import native

    try:
        native._reset_for_tests(None, "native module metal_attn._native is not built (simulated)")
        code, data = run_json(capsys, "doctor", "--no-smoke")
    finally:
        native._reset_for_tests()
    assert code == 1 and data["ok"] is False
    assert any(p.startswith("the native CPU module (metal_attn._native) is not built: native module "
                            "metal_attn._native is not built (simulated); classic's CPU kernels are unavailable")
               for p in data["problems"]), data["problems"]


def test_doctor_reports_a_kernel_failure_as_a_problem(capsys):
    reg = plugins.get_registry()
    reg.mark_failed("reference", ("float16", 64), "planted: clang exited with status 1")
    code, data = run_json(capsys, "doctor", "--no-smoke")
    assert code == 1 and data["ok"] is False
    assert data["kernel_failures"] == [{"provider": "reference", "specialization": ["float16", 64],
                                        "reason": "planted: clang exited with status 1"}]
    assert any("planted: clang exited with status 1" in p for p in data["problems"])


def test_doctor_reports_provider_settings_that_name_no_provider(capsys):
    """A typo in METAL_ATTN_DISABLED_PROVIDERS disabled nothing and METAL_ATTN_PROVIDER=nosuch failed
    only at the first call; doctor said "no problems found" for both."""
    with override_settings(disabled_providers=("gqa-decode",), provider="nosuch"):
        code, data = run_json(capsys, "doctor", "--no-smoke")
    assert code == 1
    registered = ", ".join(p["name"] for p in data["providers"])
    assert (f"METAL_ATTN_PROVIDER='nosuch' names no registered provider (allowed: {registered}, or unset for the "
            "registry's choice)") in data["problems"]
    assert any(p.startswith("METAL_ATTN_DISABLED_PROVIDERS names 'gqa-decode', not a registered provider, so it "
                            "disables nothing") for p in data["problems"])


def test_doctor_words_an_unknown_forced_provider_as_the_other_commands_do(capsys, monkeypatch):
    """Doctor said "is not a registered provider (registered: ...)" under the canonical name whatever variable
    set it, and its smoke test failed on it again, in the API's terms ("smoke all: ProviderRefusedError:
    provider='nosuch' ..."); `demo`, `generate` and `bench` refuse it with `check_provider_setting`'s words."""
    from metal_attn.errors import SettingsError
    from metal_attn.plugins import check_provider_setting

    monkeypatch.setenv("metal_attn_provider", "nosuch")
    reload_settings()
    try:
        with pytest.raises(SettingsError) as exc:
            check_provider_setting()
        code, data = run_json(capsys, "doctor")
        code_table, out, _ = run(capsys, "doctor")
    finally:
        monkeypatch.delenv("metal_attn_provider")
        reload_settings()
    assert code == code_table == 1
    assert data["problems"] == [str(exc.value)]
    assert str(exc.value).startswith("metal_attn_provider='nosuch' names no registered provider (allowed: ")
    assert all(p["name"] in str(exc.value) for p in data["providers"])
    assert data["smoke"] == []  # every call fails the same way: the smoke test is not run to say it again
    out = " ".join(out.split())
    assert f"problem: {exc.value}" in out and "smoke test skipped" in out and "ProviderRefusedError" not in out


def test_commands_say_why_no_provider_is_registered(capsys):
    """With the built-in plugin denied and no other, the tables came out empty with nothing said."""
    why = "no provider is registered (no plugin registered one under METAL_ATTN_PLUGINS_DENY=builtin"
    with override_settings(plugins_deny=("builtin",), plugin_autoload=False):  # no installed example plugin
        for argv, want in ((("providers",), 0), (("explain", "--batch", "1", "--context", "64"), 1)):
            code, out, _ = run(capsys, *argv)
            assert code == want and why in " ".join(out.split()), out
        code, data = run_json(capsys, "doctor", "--no-smoke")
    assert code == 1 and any(why in p for p in data["problems"]), data["problems"]


def test_doctor_reports_plugin_lists_that_name_no_plugin(capsys):
    """METAL_ATTN_PLUGINS_ALLOW / _DENY take entry-point names; a provider's name there (classic) matched nothing,
    silently: the allow-list then dropped every third-party plugin, the deny-list denied nothing."""
    with override_settings(plugins_allow=("classic",), plugins_deny=("nosuch",)):
        code, data = run_json(capsys, "doctor", "--no-smoke")
    assert code == 1
    for var, name in (("METAL_ATTN_PLUGINS_ALLOW", "classic"), ("METAL_ATTN_PLUGINS_DENY", "nosuch")):
        assert any(p.startswith(f"{var} names {name!r}, which no installed plugin is called (plugins are named by "
                                "their entry point: builtin") for p in data["problems"]), data["problems"]


# -- demo ------------------------------------------------------------------------------------------


def test_demo_json_runs_every_phase_and_reports_its_checks(capsys):
    code, data = run_json(capsys, "demo")
    assert code == 0, data["failures"]
    assert data["ok"] is True and data["failures"] == []
    cfg = data["config"]
    assert data["checks"] == {"total": cfg["num_layers"] * cfg["steps"], "passed": cfg["num_layers"] * cfg["steps"],
                              "failed": 0}
    steps = data["steps"]
    assert [s["phase"] for s in steps] == ["prefill", "mixed"] + ["decode"] * (cfg["steps"] - 2)
    # One prompt is longer than a chunk: step 1 carries its continuation chunk next to decode rows.
    assert steps[1]["q_lens"][:2] == [1, 1] and steps[1]["q_lens"][2] > 1
    assert steps[1]["seq_lens"][2] == max(cfg["prompt_lens"])
    tol = TOLERANCES[cfg["dtype"]]
    for s in steps:
        assert s["ok"] and s["providers"] and s["routes"]
        assert s["time_ms_median"] > 0
        assert 0 <= s["max_abs_error"] <= tol[0] + tol[1] * 10
        assert s["rel_l2_error"] <= tol[2]
    assert data["elapsed_s"] < 30


def test_demo_table_and_options(capsys):
    argv = ["demo", "--dtype", "bfloat16", "--heads", "4", "--kv-heads", "1", "--head-size", "32", "--block-size",
            "8", "--steps", "3", "--layers", "1", "--seed", "3", "--repeats", "1"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "all 3 checks passed" in out
    for text in ("prefill", "mixed", "decode", "ms/call", "max err"):
        assert text in out
    code, data = run_json(capsys, *argv)
    assert code == 0
    cfg = data["config"]
    assert (cfg["dtype"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_size"], cfg["block_size"]) == (
        "bfloat16", 4, 1, 32, 8)
    registered = {p["name"] for p in metal_attn.providers()}
    for s in data["steps"]:
        assert set(s["providers"]) <= registered
        for name in s["providers"]:
            assert name in out


def test_the_demo_computes_its_schedule_once(capsys, monkeypatch):
    """`run_demo` validated its config (whose memory check computes the schedule) and computed the schedule
    again; `metal-attn demo`, validating first for its exit code 2, a third time."""
    from metal_attn import demo

    calls = []
    real = demo.schedule
    monkeypatch.setattr(demo, "schedule", lambda cfg: calls.append(cfg) or real(cfg))
    code, _, _ = run(capsys, "demo", "--steps", "2", "--layers", "1", "--repeats", "1")
    assert code == 0 and len(calls) == 1
    calls.clear()
    cfg = demo.DemoConfig(steps=2, num_layers=1, repeats=1, prompt_lens=(9, 40), chunk_size=24)
    assert [s.q_lens for s in demo.run_demo(cfg).steps] == [(9, 24), (1, 16)] and len(calls) == 1


def test_demo_is_deterministic_per_seed(capsys):
    runs = [run_json(capsys, "demo", "--steps", "2", "--layers", "1", "--repeats", "1", "--seed", s)[1]
            for s in ("5", "5", "6")]
    errs = [[s["max_abs_error"] for s in r["steps"]] for r in runs]
    assert errs[0] == errs[1] and errs[0] != errs[2]


class _OffByALittle(Provider):
    """A plausible-looking provider that is wrong: its output is shifted by 5e-3."""

    name = "off_by_a_little"
    priority = 1000
    backends = frozenset({"metal", "cuda", "cpu"})

    def plan(self, request, device, settings):
        return Plan(self.name, "off_by_a_little")

    def run(self, inputs, plan):
        from metal_attn.providers.reference import ReferenceProvider

        return ReferenceProvider().run(inputs, Plan("reference", "reference")) + mx.array(5e-3, dtype=inputs.q.dtype)


class _BrokenPlugin:
    @metal_attn.hookimpl
    def metal_attn_register_providers(self, registrar):
        registrar.add(_OffByALittle)


@pytest.fixture
def broken_provider_installed(monkeypatch):
    from metal_attn._layout import import_builtin_providers
    from metal_attn.plugins import registry_from

    reg = registry_from([import_builtin_providers(), _BrokenPlugin()], names=["builtin", "broken"])
    monkeypatch.setattr(plugins, "get_registry", lambda: reg)
    monkeypatch.setattr(metal_attn.api, "get_registry", lambda: reg)
    return reg


def test_demo_fails_loudly_on_a_mismatch(capsys, broken_provider_installed):
    code, data = run_json(capsys, "demo", "--steps", "3", "--layers", "2", "--repeats", "1")
    assert code == 1
    assert data["ok"] is False
    assert data["checks"] == {"total": 6, "passed": 0, "failed": 6}
    assert all(s["providers"] == ["off_by_a_little"] for s in data["steps"])
    assert "rel_l2_error" in data["failures"][0] and "allowed for float16" in data["failures"][0]

    code, out, _ = run(capsys, "demo", "--steps", "2", "--layers", "1", "--repeats", "1")
    assert code == 1
    assert "MISMATCH" in out and "demo FAILED: 2 of 2 checks" in out


class _AllNaN(_OffByALittle):
    def run(self, inputs, plan):
        return mx.full(inputs.q.shape, float("nan"), dtype=inputs.q.dtype)


def test_the_demo_reports_an_all_nan_output_as_a_nan_error(capsys, monkeypatch, broken_provider_installed):
    """`max(0.0, nan)` is 0.0: an all-NaN output's failed check was reported with max_abs_error 0."""
    monkeypatch.setattr(_OffByALittle, "run", _AllNaN.run)
    code, data = run_json(capsys, "demo", "--steps", "2", "--layers", "1", "--repeats", "1")
    assert code == 1 and data["checks"]["failed"] == 2
    assert all(math.isnan(s["max_abs_error"]) for s in data["steps"]), data["steps"]


class _ShortAfterItsFirstCall(_OffByALittle):
    """Right on the first call of each batch shape (a selection's first call, which the provider contract
    checks), a column short on the calls after it."""

    name = "short_after_first_call"
    seen: set = set()

    def run(self, inputs, plan):
        from metal_attn.providers.reference import ReferenceProvider

        out = ReferenceProvider().run(inputs, Plan("reference", "reference"))
        first = inputs.q.shape not in self.seen
        self.seen.add(inputs.q.shape)
        return out if first else out[..., :-1]


def test_demo_reports_a_wrong_shape_past_the_contract_check_as_a_failed_check(capsys, monkeypatch):
    """The output is checked against the contract on a selection's first call only; a later wrong shape
    ended `metal-attn demo` with numpy's broadcast error and no provider named."""
    from metal_attn._layout import import_builtin_providers
    from metal_attn.plugins import registry_from

    class Plugin:
        @metal_attn.hookimpl
        def metal_attn_register_providers(self, registrar):
            registrar.add(_ShortAfterItsFirstCall)

    reg = registry_from([import_builtin_providers(), Plugin()], names=["builtin", "short"])
    monkeypatch.setattr(plugins, "get_registry", lambda: reg)
    monkeypatch.setattr(metal_attn.api, "get_registry", lambda: reg)
    code, data = run_json(capsys, "demo", "--steps", "2", "--layers", "2", "--repeats", "1")
    assert code == 1 and data["ok"] is False
    assert data["checks"] == {"total": 4, "passed": 2, "failed": 2}
    assert all(" layer 1: short_after_first_call/off_by_a_little returned shape (" in f and "63) (expected (" in f
               for f in data["failures"])


def test_demo_forced_provider_refusal_is_an_error_not_a_crash(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--provider", "no_such_provider", "--steps", "2", "--layers", "1"])
    assert exc.value.code == 2
    assert "--provider 'no_such_provider' is not registered (allowed: " in capsys.readouterr().err
    with override_settings(disabled_providers=("reference",)):  # registered, refusing: a run-time error
        code, _, err = run(capsys, "demo", "--provider", "reference", "--steps", "2", "--layers", "1")
    assert code == 1 and "reference" in err


def test_demo_too_large_for_memory_is_refused_before_any_allocation(capsys):
    """A million query heads: about 228 GiB a step. MLX's CPU backend crashed the process (exit 139, no
    message) allocating the queries; now the flags are named first."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--heads", "1000000", "--kv-heads", "1", "--layers", "1", "--steps", "2"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--heads=1000000, --kv-heads=1, --head-size=64" in err and "one step of the demo needs about" in err
    assert "(allowed: fewer heads, a smaller head size or shorter prompts)" in err


def test_the_demo_s_working_set_estimate_bounds_its_largest_step():
    """The estimate grows with the heads and the prompts, and is a bound on what a step holds: the
    float32 scores of the longest prompt's last chunk alone (heads x rows x keys x 4 bytes) fit within it."""
    from metal_attn.demo import DemoConfig, schedule, working_set_bytes

    base = DemoConfig()
    ws = working_set_bytes(base, schedule(base))
    assert ws >= base.num_heads * (150 - 96) * 150 * 4
    wider = dataclasses.replace(base, num_heads=16)
    assert working_set_bytes(wider, schedule(wider)) > ws
    longer = dataclasses.replace(base, prompt_lens=(37, 90, 300))
    assert working_set_bytes(longer, schedule(longer)) > ws


# -- bench -----------------------------------------------------------------------------------------


def test_bench_missing_module_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "metal_attn.bench.cli", None)  # makes the import fail
    code, _, err = run(capsys, "bench")
    assert code == 1
    assert "metal-attn bench: error: the benchmark is unavailable" in err
    assert "metal_attn.bench.cli" in err


def test_bench_delegates_to_the_bench_module(capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("metal_attn.bench.cli")

    def add_arguments(parser):
        parser.add_argument("--shapes", default="decode")
        parser.add_argument("--json", action="store_true")

    def run_bench(args):
        seen["args"] = args
        return 3

    fake.add_arguments, fake.run = add_arguments, run_bench
    monkeypatch.setitem(sys.modules, "metal_attn.bench.cli", fake)
    code, _, _ = run(capsys, "bench", "--shapes", "prefill", "--json", "-v")
    assert code == 3
    assert seen["args"].shapes == "prefill" and seen["args"].json is True and seen["args"].verbose == 1


# -- logging, entry points, docs -------------------------------------------------------------------


def test_verbose_flag_configures_the_library_logger(capsys, restore_logging):
    lg = restore_logging
    assert cli.main(["settings", "--json"]) == 0
    assert lg.level == logging.WARNING
    assert cli.main(["settings", "--json", "-v"]) == 0
    assert lg.level == logging.INFO
    assert cli.main(["settings", "--json", "-vv"]) == 0
    assert lg.level == logging.DEBUG
    assert len(lg.handlers) == 1 and lg.propagate is False
    capsys.readouterr()


def test_an_event_reads_on_its_own_and_carries_its_fields(log_records):
    """The record's message is the event with its fields as text (what Python prints when nothing
    configured logging); the fields are also the record's attributes."""
    from metal_attn.log import get_logger

    get_logger().warning("test_event", reason="why it happened", provider="p", route="r")
    [rec] = log_records("test_event")
    assert rec.getMessage() == "test_event: why it happened (provider=p, route=r)"
    assert (rec.reason, rec.provider, rec.route, rec.levelname) == ("why it happened", "p", "r", "WARNING")


def test_an_event_without_logging_configured_prints_its_reason(tmp_path):
    """A library user who configured nothing sees the whole warning, not the bare event name (an event that is
    only logged; a settings warning is a Python warning there, test_settings.py)."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", "import metal_attn as ma; ma.providers()"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "METAL_ATTN_DISABLED_PROVIDERS": "clasic"})
    assert proc.returncode == 0, proc.stderr
    assert ("unknown_disabled_provider: no registered provider has this name, so it disables nothing "
            "(setting=METAL_ATTN_DISABLED_PROVIDERS, provider=clasic, providers=") in proc.stderr, proc.stderr


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_the_cli_log_formats_render_the_event_fields(capsys, restore_logging, fmt):
    from metal_attn.log import configure_cli_logging, get_logger

    configure_cli_logging(fmt=fmt)
    get_logger().warning("test_event", reason="why it happened", provider="p")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    if fmt == "json":
        data = json.loads(err)
        assert (data["event"], data["reason"], data["provider"], data["level"]) == (
            "test_event", "why it happened", "p", "warning")
    else:
        assert "[warning" in err and "test_event" in err
        assert "reason='why it happened'" in err and "provider=p" in err


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_providers", interrupted)
    assert cli.main(["providers"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "metal-attn providers: interrupted" and "Traceback" not in err


def test_python_dash_m_and_version(tmp_path):
    proc = fresh_process("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"metal-attn {metal_attn.__version__}"
    proc = fresh_process("providers", "--json", env={"METAL_ATTN_DISABLED_PROVIDERS": "reference"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ref = next(p for p in json.loads(proc.stdout)["providers"] if p["name"] == "reference")
    assert ref["enabled"] is False


def test_console_script_when_installed(tmp_path):
    script = shutil.which("metal-attn", path=str(Path(sys.executable).parent))
    try:
        entry = md.distribution("metal-attn").entry_points
    except md.PackageNotFoundError:
        pytest.skip("metal-attn is not installed (source checkout): no console script to run")
    assert any(ep.group == "console_scripts" and ep.value == "metal_attn.cli:main" for ep in entry)
    assert script is not None, f"metal-attn is installed but its script is not next to {sys.executable}"
    proc = subprocess.run([script, "providers", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "reference" in {p["name"] for p in json.loads(proc.stdout)["providers"]}


def _between_markers(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    assert start in text and end in text, f"markers {start} / {end} are missing"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


@pytest.mark.parametrize("doc", ["README.md", "docs/settings.md"])
def test_settings_tables_in_the_docs_are_generated_from_the_model(doc):
    text = (REPO / doc).read_text()
    expected = cli.settings_markdown(cli.settings_rows())
    assert _between_markers(text, "settings-table") == expected, (
        f"{doc} is out of date: paste the output of `metal-attn settings --markdown` between its settings-table markers"
    )


@pytest.mark.parametrize("doc", ["README.md", "docs/providers.md"])
def test_provider_tables_in_the_docs_list_exactly_the_builtin_providers(doc):
    table = _between_markers((REPO / doc).read_text(), "provider-table")
    documented = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    with override_settings(plugin_autoload=False):
        builtin = {p["name"] for p in metal_attn.providers() if p["plugin"] == "builtin"}
    assert documented == builtin, (
        f"{doc}'s provider table lists {sorted(documented)} but the built-in providers are {sorted(builtin)}; "
        "regenerate it with `METAL_ATTN_PLUGIN_AUTOLOAD=0 metal-attn providers --markdown`"
    )


def test_bench_runs_the_real_benchmark_module_when_present(capsys):
    if importlib.util.find_spec("metal_attn.bench") is None:
        pytest.skip("metal_attn.bench is not in this tree")
    code, out, _ = run(capsys, "bench", "--list")
    assert code == 0
    assert out.strip()


def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads(capsys):
    """``--prompt $'caf\\xe9'``: Python keeps the byte as a lone surrogate, which the tokenizer refused with a
    TypeError and a traceback after the model had loaded."""
    import argparse

    from metal_attn.generate import _read_prompts

    parser = argparse.ArgumentParser(prog="metal-attn generate")
    with pytest.raises(SystemExit) as exc:
        _read_prompts(argparse.Namespace(prompt=["ok", "caf\udce9"], prompts_file=None), parser)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--prompt='caf\\udce9' (prompt 1): character 3 is no Unicode text" in err and "(allowed: UTF-8 text)" in err


def test_a_prompts_file_that_is_not_text_is_refused_naming_the_flag(tmp_path, capsys):
    """It raised UnicodeDecodeError with a traceback."""
    import argparse

    from metal_attn.generate import _read_prompts

    path = tmp_path / "bin.txt"
    path.write_bytes(b"\xff\xfe hello\n")
    parser = argparse.ArgumentParser(prog="metal-attn generate")
    with pytest.raises(SystemExit) as exc:
        _read_prompts(argparse.Namespace(prompt=None, prompts_file=str(path)), parser)
    assert exc.value.code == 2
    assert f"--prompts-file={str(path)!r} is not UTF-8 text (byte 0; allowed: a text file" in capsys.readouterr().err


def test_a_prompts_file_splits_only_at_line_ends(tmp_path):
    """One prompt a line, lines ending at \\n or \\r\\n: str.splitlines also split a prompt at U+2028, \\x0c, \\x1c
    and the like, and read_text's universal newlines at a lone \\r."""
    import argparse

    from metal_attn.generate import _read_prompts

    path = tmp_path / "prompts.txt"
    path.write_text("hello\u2028world\r\nform\x0cfeed\n\nthird\x1cone\rstill", encoding="utf-8", newline="")
    prompts, labels = _read_prompts(argparse.Namespace(prompt=None, prompts_file=str(path)), argparse.ArgumentParser())
    assert prompts == ["hello\u2028world", "form\x0cfeed", "third\x1cone\rstill"]
    assert labels == ["--prompts-file line 1", "--prompts-file line 2", "--prompts-file line 4"]


def test_generate_sizes_its_pool_for_the_requests_there_are(monkeypatch):
    """--concurrency 100000 with one prompt allocated a page for each of the 100,000 requests that could run
    (5 GB for a 2-token prompt): the pool now adds a page per request that can run, at most the prompts."""
    from metal_attn.engine import EngineConfig
    from metal_attn.generate import _pool_blocks

    cfg = EngineConfig(max_num_seqs=100_000, kv_cache_memory=1 << 30)
    blocks, source = _pool_blocks(need_tokens=34, block=16, per_block=1024, cfg=cfg, num_prompts=1)
    assert blocks == 3 + 1 and "what the prompts need: 34 tokens" in source
    assert _pool_blocks(need_tokens=34, block=16, per_block=1024, cfg=EngineConfig(max_num_seqs=2,
                        kv_cache_memory=1 << 30), num_prompts=5)[0] == 3 + 2


# -- a closed pipe and the standalone bench command (probed by a helper, twenty-third session) ----------


@pytest.mark.parametrize("argv", [
    ["-m", "metal_attn", "explain"],
    ["-m", "metal_attn", "providers", "--versions"],
    ["-m", "metal_attn", "demo", "--repeats", "1", "--layers", "1", "--steps", "2"],
    ["-m", "metal_attn.bench.cli", "--suite", "smoke", "--quiet", "--json", "-", "--shapes", "decode b3"],
], ids=["explain", "providers", "demo", "bench-standalone"])
def test_a_reader_that_goes_away_is_exit_0(argv, tmp_path):
    """rich's console answered a closed pipe with SystemExit(1) (`metal-attn explain | head -1` failed under
    pipefail); the standalone bench printed a BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")} | {"METAL_ATTN_PLUGIN_AUTOLOAD": "0"}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write meets a closed pipe
    try:
        done = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_the_standalone_bench_command_names_bad_settings(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")} | {"METAL_ATTN_GPU_CORES": "abc"}
    done = subprocess.run([sys.executable, "-m", "metal_attn.bench.cli", "--suite", "smoke", "--quiet"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "METAL_ATTN_GPU_CORES='abc'" in done.stderr and "Traceback" not in done.stderr


def test_a_reader_of_stderr_that_goes_away_is_not_success(tmp_path):
    """The run stops short there (a --json file unwritten): exit 1, where a closed stdout is exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")} | {"METAL_ATTN_PLUGIN_AUTOLOAD": "0"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "metal_attn", "bench", "--suite", "smoke", "--shapes", "decode b3",
                               "--iters", "1", "--warmup", "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=write_end, timeout=600)
    finally:
        os.close(write_end)
    assert done.returncode == 1


@pytest.mark.parametrize("argv", [["generate", "--max-tokens", "2"], ["bench", "--suite", "smoke", "--quiet"],
                                  ["bench", "--suite", "smoke", "--dry-run"], ["demo", "--steps", "2"]])
def test_a_forced_provider_that_is_not_registered_is_refused_before_any_work(capsys, monkeypatch, argv):
    """METAL_ATTN_PROVIDER=nope: generate loaded the model then exited 1 naming `provider=`, bench smoke
    exited 0 with every `auto` refused, and its dry run said every name was checked."""
    import metal_attn.mlx_lm as mlx_lm_pkg

    monkeypatch.setattr(mlx_lm_pkg, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setenv("METAL_ATTN_PROVIDER", "nope")
    reload_settings()
    try:
        code, _, err = run(capsys, *argv)
    finally:
        monkeypatch.delenv("METAL_ATTN_PROVIDER")
        reload_settings()
    assert code == 2
    assert "METAL_ATTN_PROVIDER='nope' names no registered provider (allowed: " in " ".join(err.split())


# -- edges mutation testing found unguarded (twenty-fifth session) --------------------------------------


def test_generate_s_number_flags_take_their_bounds():
    import argparse

    from metal_attn.generate import _temperature, _top_p

    assert _top_p("1") == 1.0 and _temperature("0") == 0.0  # the closed ends are allowed
    for bad in ("0", "-0.1", "1.0001", "nan"):  # the engine's rule (tests/test_generate_cli.py)
        with pytest.raises(argparse.ArgumentTypeError, match=r"allowed: a number in \[1e-30, 1\]"):
            _top_p(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        _temperature("-1e-9")


@pytest.mark.parametrize(("prompt", "prompts_file", "message"), [
    (["\udce9x"], None, "--prompt='\\udce9x' (prompt 0): character 0 is no Unicode text"),
    (None, "\n \n\t\n", "holds no prompt (allowed: one per line)"),
])
def test_read_prompts_refuses_what_no_request_could_take(tmp_path, capsys, prompt, prompts_file, message):
    import argparse

    from metal_attn.generate import _read_prompts

    path = None
    if prompts_file is not None:
        path = tmp_path / "p.txt"
        path.write_text(prompts_file)
    with pytest.raises(SystemExit) as exc:
        _read_prompts(argparse.Namespace(prompt=prompt, prompts_file=None if path is None else str(path)),
                      argparse.ArgumentParser())
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_pool_budget_exactly_the_need_is_what_the_prompts_need():
    from metal_attn.engine import EngineConfig
    from metal_attn.generate import _pool_blocks

    cfg = EngineConfig(max_num_seqs=1, num_blocks=4)  # a budget of exactly 3 + 1 blocks
    blocks, source = _pool_blocks(need_tokens=34, block=16, per_block=1024, cfg=cfg, num_prompts=1)
    assert blocks == 4 and source.startswith("what the prompts need: 34 tokens")


def test_generate_sizes_no_pool_past_what_a_request_can_hold(monkeypatch, capsys):
    """--max-tokens 10**20 sized the pool from 10**20 tokens (the memory budget, 5 GB) before its error."""
    from metal_attn import generate
    from metal_attn.testing.models import tiny_model

    model = tiny_model("llama")
    seen = []
    real = generate._pool_blocks

    def spy(need_tokens, *a, **k):
        seen.append(need_tokens)
        return real(need_tokens, *a, **k)

    import metal_attn.mlx_lm as mlx_lm_pkg
    from metal_attn.testing.models import WordTokenizer

    monkeypatch.setattr(mlx_lm_pkg, "load", lambda *a, **k: (model, WordTokenizer()))
    monkeypatch.setattr(generate, "_pool_blocks", spy)
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "a", "--prompt", "b", "--max-tokens", str(10**20)])
    assert exc.value.code == 2 and "exceeds the model's context" in capsys.readouterr().err
    from metal_attn.engine.engine import model_max_len

    assert seen and seen[0] <= 2 * (model_max_len(model) or 8192)


def test_bench_with_the_real_backend_named_in_the_override_times_as_usual():
    import io

    from metal_attn.bench.cli import _check_backend_override
    from metal_attn.device import detect_backend

    with override_settings(backend_override=detect_backend()):
        assert _check_backend_override(io.StringIO()) is None
    with override_settings(backend_override=None):
        assert _check_backend_override(io.StringIO()) is None


def test_list_with_an_empty_suite_name_is_refused(capsys):
    from metal_attn.bench import cli as bench_cli

    assert bench_cli.main(["--list", "--suite", ","]) == 2
    assert "no such suite" in capsys.readouterr().err


def test_the_generate_suite_s_bounds_are_inclusive():
    from types import SimpleNamespace

    from metal_attn.bench.generate import MAX_CONCURRENCY, _concurrencies, _too_long

    assert _concurrencies(str(MAX_CONCURRENCY), "cpu") == [MAX_CONCURRENCY]
    m = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=8192))
    assert _too_long(m, 8160, 32, 0) is None  # exactly the context
    assert _too_long(m, 8161, 32, 0) is not None
    assert _too_long(m, 7, 32, 8160) is not None  # a prompt of 7 rows still adds one (7 // 8 is 0)
    assert _too_long(m, 8, 32, 8159) is None


def test_a_forced_provider_error_names_the_variable_as_it_is_spelled(monkeypatch):
    from metal_attn.errors import SettingsError
    from metal_attn.plugins import check_provider_setting

    monkeypatch.setenv("metal_attn_provider", "nope")
    reload_settings()
    try:
        with pytest.raises(SettingsError, match=r"^metal_attn_provider='nope' names no registered provider"):
            check_provider_setting()
    finally:
        monkeypatch.delenv("metal_attn_provider")
        reload_settings()


def test_the_demo_s_working_set_is_its_arithmetic_and_its_config_checks_the_api_too():
    from metal_attn.demo import DemoConfig, schedule, working_set_bytes
    from metal_attn.errors import InvalidInputError

    cfg = DemoConfig(dtype="float16", num_heads=4, num_kv_heads=2, head_size=8, prompt_lens=(5, 10), chunk_size=6,
                     steps=2)
    # step 0: 5 + 6 rows; step 1: the first decodes (seq 6), the second's last 4 rows (seq 10)
    rows0 = 11 * 8 * (2 * 2 * 2 + 4 * (2 * 2 + 8))
    scores0 = max(5 * 5, 6 * 6) * (4 * 8 + 1)
    rows1 = 5 * 8 * (2 * 2 * 2 + 4 * (2 * 2 + 8))
    scores1 = max(1 * 6, 4 * 10) * (4 * 8 + 1)
    assert working_set_bytes(cfg, schedule(cfg)) == max(rows0 + scores0, rows1 + scores1)
    with pytest.raises(InvalidInputError, match=r"chunk_size=96 must be below the longest prompt \(96\)"):
        DemoConfig(prompt_lens=(96,), chunk_size=96).validate()
    with pytest.raises(InvalidInputError, match=r"repeats=0 \(allowed: an int >= 1\)"):
        DemoConfig(repeats=0).validate()


@pytest.mark.parametrize(("argv", "env", "by"), [
    (["--provider", "gqa_decode"], {}, "--provider"),
    ([], {"METAL_ATTN_PROVIDER": "gqa_decode"}, "METAL_ATTN_PROVIDER"),
])
def test_explain_says_the_forced_provider_refuses(capsys, monkeypatch, argv, env, by):
    """With a forced provider that refuses, explain ended "no provider admits this request", as if none had
    been asked but that one."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reload_settings()
    code, out, _ = run(capsys, "explain", *argv)
    assert code == 1 and out.strip().splitlines()[-1] == f"the forced provider 'gqa_decode' ({by}) refuses this request"


def test_a_call_under_a_provider_variable_no_provider_has_names_the_variable(monkeypatch):
    """It read "provider='clasic' is not registered", naming an argument the caller never passed."""
    from metal_attn.testing import make_case

    monkeypatch.setenv("METAL_ATTN_PROVIDER", "clasic")
    reload_settings()
    case = make_case(q_lens=[1], seq_lens=[20], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                     dtype="float16")
    with pytest.raises(metal_attn.ProviderRefusedError, match=r"^METAL_ATTN_PROVIDER='clasic' names no registered "
                                                               r"provider \(allowed: .*classic.*, or unset"):
        metal_attn.paged_attention(**case.kwargs())
    # explain says it the same way (it said "provider='clasic' is not registered")
    (row,) = metal_attn.explain(**{"q_lens": [1], "seq_lens": [20], "num_heads": 2, "num_kv_heads": 1,
                                   "head_size": 64, "dtype": "float16"}).rows
    assert row.reasons[0].startswith("METAL_ATTN_PROVIDER='clasic' names no registered provider")
