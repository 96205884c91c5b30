"""Settings: environment parsing, upstream aliases, validation messages, unknown
and renamed variables, `override_settings`, and probe overrides reaching the device."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import pytest

import metal_attn as ma
from metal_attn import _epoch
from metal_attn import settings as settings_mod
from metal_attn.errors import SettingsError
from metal_attn.settings import (
    RENAMED_VARIABLES,
    Settings,
    env_names,
    get_settings,
    override_settings,
    reload_settings,
)
from metal_attn.testing import make_case
from metal_attn.testing.conformance import assert_close_to_oracle

pytestmark = pytest.mark.usefixtures("clean_settings_env")


def load(monkeypatch, **env: str) -> Settings:
    """Set environment variables and re-read the settings from them."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return settings_mod.reload_settings()


def test_defaults():
    s = get_settings()
    assert (s.disable_gqa_decode, s.disable_nax, s.disable_tiled_prefill) == (False, False, False)
    assert s.disabled_providers == () and s.provider is None
    assert (s.plugin_autoload, s.plugins_allow, s.plugins_deny) == (True, None, ())
    assert (s.diagnostics, s.log_level, s.log_format, s.validate_metadata) == (False, "warning", "console", True)
    assert s.device_overrides() == ()
    assert ma.settings() is s  # the module is callable and returns the active settings


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
def test_bool_parsing(monkeypatch, raw, expected):
    s = load(monkeypatch, METAL_ATTN_DISABLE_TILED_PREFILL=raw, METAL_ATTN_PLUGIN_AUTOLOAD=raw)
    assert s.disable_tiled_prefill is expected
    assert s.plugin_autoload is expected


def test_comma_lists_are_split_and_stripped(monkeypatch):
    s = load(
        monkeypatch,
        METAL_ATTN_DISABLED_PROVIDERS=" gqa_decode, classic ,,tiled_prefill ",
        METAL_ATTN_PLUGINS_DENY="acme",
        METAL_ATTN_PLUGINS_ALLOW="x,y",
    )
    assert s.disabled_providers == ("gqa_decode", "classic", "tiled_prefill")
    assert s.plugins_deny == ("acme",)
    assert s.plugins_allow == ("x", "y")


def test_empty_allow_list_is_empty_not_unset(monkeypatch):
    assert load(monkeypatch, METAL_ATTN_PLUGINS_ALLOW="").plugins_allow == ()


#: Every setting that may be unset (default None), but the allow-list, where empty means no plugin.
_UNSETTABLE = sorted(n.upper() for n, f in Settings.model_fields.items() if f.default is None and n != "plugins_allow")


@pytest.mark.parametrize("name", _UNSETTABLE)
def test_a_blank_optional_setting_is_unset(monkeypatch, name):
    """``METAL_ATTN_GPU_CORES=`` (a shell script's unset) was refused as 'not a valid integer', and
    ``METAL_ATTN_CUDA_COMMIT_WHEN_IDLE=`` as 'expected a boolean' (two of the three three-state switches)."""
    assert getattr(load(monkeypatch, **{f"METAL_ATTN_{name}": ""}), name.lower()) is None
    assert getattr(load(monkeypatch, **{f"METAL_ATTN_{name}": "  "}), name.lower()) is None


def test_a_three_state_switch_says_it_may_be_unset(monkeypatch):
    with pytest.raises(SettingsError, match=r"METAL_ATTN_DECODE_ROWS_STREAM='maybe': expected a boolean: 1/0, "
                                            r"true/false, yes/no, on/off, or unset \(empty\)"):
        load(monkeypatch, METAL_ATTN_DECODE_ROWS_STREAM="maybe")


def test_log_names_in_any_case_and_a_nan_fraction_named_as_such(monkeypatch):
    s = load(monkeypatch, METAL_ATTN_LOG_LEVEL="DEBUG", METAL_ATTN_LOG_FORMAT="Json", METAL_ATTN_BACKEND_OVERRIDE="CPU")
    assert (s.log_level, s.log_format, s.backend_override) == ("debug", "json", "cpu")
    with pytest.raises(SettingsError, match=r"METAL_ATTN_KV_CACHE_FRACTION='nan': Input should be a finite number"):
        load(monkeypatch, METAL_ATTN_KV_CACHE_FRACTION="nan")


def test_names_are_case_insensitive_and_blank_provider_is_none(monkeypatch):
    s = load(monkeypatch, metal_attn_gpu_cores="12", METAL_ATTN_PROVIDER="   ")
    assert s.gpu_cores == 12
    assert s.provider is None


def test_other_values_are_parsed(monkeypatch):
    s = load(
        monkeypatch,
        METAL_ATTN_PROVIDER="classic",
        METAL_ATTN_LOG_LEVEL="debug",
        METAL_ATTN_LOG_FORMAT="json",
        METAL_ATTN_DIAGNOSTICS="1",
        METAL_ATTN_VALIDATE_METADATA="0",
        METAL_ATTN_MAX_THREADGROUP_MEMORY="65536",
        METAL_ATTN_CPU_THREADS="3",
    )
    assert (s.provider, s.log_level, s.log_format, s.diagnostics, s.validate_metadata) == (
        "classic",
        "debug",
        "json",
        True,
        False,
    )
    assert (s.max_threadgroup_memory, s.cpu_threads) == (65536, 3)


@pytest.mark.parametrize(
    ("alias", "field"),
    [("VLLM_METAL_DISABLE_GQA_DECODE", "disable_gqa_decode"), ("VLLM_METAL_DISABLE_NAX", "disable_nax")],
)
def test_upstream_aliases(monkeypatch, alias, field):
    s = load(monkeypatch, **{alias: "1"})
    assert getattr(s, field) is True
    assert s.is_disabled({"disable_gqa_decode": "gqa_decode", "disable_nax": "nax_prefill"}[field])
    assert env_names()[alias] == field


def test_our_name_wins_over_the_upstream_alias(monkeypatch):
    with pytest.warns(UserWarning, match=r"METAL_ATTN_DISABLE_NAX='0' is used and VLLM_METAL_DISABLE_NAX='1' "
                                         r"ignored \(they disagree\)"):
        s = load(monkeypatch, METAL_ATTN_DISABLE_NAX="0", VLLM_METAL_DISABLE_NAX="1")
    assert s.disable_nax is False


def test_conflicts_are_found_in_any_case(monkeypatch):
    """Names are read in any case, but the conflict check matched upper-case names only: a lower-case name of
    ours beside the upstream alias, or one name in two cases, disagreed without a word."""
    with pytest.warns(UserWarning, match=r"metal_attn_disable_gqa_decode='0' is used and "
                                         r"VLLM_METAL_DISABLE_GQA_DECODE='1' ignored \(they disagree\)"):
        s = load(monkeypatch, metal_attn_disable_gqa_decode="0", VLLM_METAL_DISABLE_GQA_DECODE="1")
    assert s.disable_gqa_decode is False
    monkeypatch.delenv("metal_attn_disable_gqa_decode")
    monkeypatch.delenv("VLLM_METAL_DISABLE_GQA_DECODE")
    with pytest.warns(UserWarning, match=r"metal_attn_gpu_cores='7', METAL_ATTN_GPU_CORES='9' spell one variable "
                                         r"in different cases and disagree"):
        load(monkeypatch, metal_attn_gpu_cores="7", METAL_ATTN_GPU_CORES="9")


def test_names_that_agree_in_another_spelling_do_not_warn(monkeypatch):
    """``1`` and ``true`` are one boolean: they were compared as text and said to disagree."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = load(monkeypatch, METAL_ATTN_DISABLE_GQA_DECODE="1", VLLM_METAL_DISABLE_GQA_DECODE=" True")
    assert s.disable_gqa_decode is True
    assert s.is_disabled("gqa_decode") == "disabled by METAL_ATTN_DISABLE_GQA_DECODE=1"


def test_a_provider_disabled_through_the_alias_names_the_alias(monkeypatch):
    s = load(monkeypatch, VLLM_METAL_DISABLE_GQA_DECODE="yes")
    assert s.is_disabled("gqa_decode") == "disabled by VLLM_METAL_DISABLE_GQA_DECODE=yes"


@pytest.mark.parametrize("value", ["null", '["good"]', "1", "true"])
def test_the_plugin_allow_list_is_a_comma_list_not_json(monkeypatch, value):
    """``null`` read as unset (every plugin loaded), ``["a","b"]`` as a list, ``1`` refused as 'a valid tuple':
    the allow-list is the names as written, like the deny-list."""
    s = load(monkeypatch, METAL_ATTN_PLUGINS_ALLOW=value, METAL_ATTN_PLUGINS_DENY=value)
    assert s.plugins_allow == s.plugins_deny == (value,)


@pytest.mark.parametrize(("var", "value", "field", "expected"), [
    ("METAL_ATTN_DISABLE_NAX", " 1 ", "disable_nax", True),
    ("METAL_ATTN_CACHE_DIR", " /tmp/ma-cache ", "cache_dir", "/tmp/ma-cache"),
    ("METAL_ATTN_PROVIDER", " classic", "provider", "classic"),
    ("METAL_ATTN_GPU_CORES", " 8 ", "gpu_cores", 8),
    ("METAL_ATTN_DISABLED_PROVIDERS", " gqa_decode , classic ", "disabled_providers", ("gqa_decode", "classic")),
])
def test_spaces_around_a_value_are_not_part_of_it(monkeypatch, var, value, field, expected):
    got = getattr(load(monkeypatch, **{var: value}), field)
    assert (str(got) if field == "cache_dir" else got) == expected


def test_an_ignored_alias_with_a_bad_value_is_warned_about(monkeypatch):
    """It was ignored without a word: the alias value 'maybe' is not even a boolean."""
    with pytest.warns(UserWarning, match=r"VLLM_METAL_DISABLE_NAX='maybe' ignored"):
        s = load(monkeypatch, METAL_ATTN_DISABLE_NAX="1", VLLM_METAL_DISABLE_NAX="maybe")
    assert s.disable_nax is True


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("METAL_ATTN_DISABLE_NAX", "maybe", "expected a boolean: 1/0, true/false, yes/no, on/off"),
        ("METAL_ATTN_GPU_CORES", "0", "Input should be greater than or equal to 1 (allowed: integer >= 1, <= 4096"),
        ("METAL_ATTN_GPU_CORES", "5000", "Input should be less than or equal to 4096 (allowed: integer >= 1, <= 4096"),
        ("METAL_ATTN_GPU_CORES", "ten", "Input should be a valid integer, unable to parse string as an integer "
                                        "(allowed: integer >= 1, <= 4096 (or unset))"),
        ("METAL_ATTN_LOG_LEVEL", "verbose", "'debug', 'info', 'warning' or 'error'"),
        ("METAL_ATTN_LOG_FORMAT", "xml", "'console' or 'json'"),
        ("METAL_ATTN_BACKEND_OVERRIDE", "rocm", "'metal', 'cuda' or 'cpu'"),
        ("METAL_ATTN_MAX_THREADGROUP_MEMORY", "512",
         "Input should be greater than or equal to 1024 (allowed: integer >= 1024"),
    ],
)
def test_bad_value_names_variable_value_and_allowed(monkeypatch, var, value, allowed):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as err:
        settings_mod.reload_settings()
    msg = str(err.value)
    assert msg.startswith("invalid metal-attn settings from environment:")
    assert f"{var}={value!r}: {allowed}" in msg


def test_bad_value_through_the_lazy_first_read(monkeypatch):
    monkeypatch.setenv("METAL_ATTN_CPU_THREADS", "-1")
    with pytest.raises(SettingsError, match=r"METAL_ATTN_CPU_THREADS='-1': Input should be greater than or equal to 1"):
        get_settings()


def test_bad_value_in_an_alias_names_the_alias(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_DISABLE_NAX", "maybe")
    with pytest.raises(SettingsError, match=r"VLLM_METAL_DISABLE_NAX='maybe'"):
        settings_mod.reload_settings()


def test_unknown_variable_warns_with_the_closest_name(monkeypatch, log_records):
    monkeypatch.setenv("METAL_ATTN_GPU_CORE", "10")
    monkeypatch.setenv("METAL_ATTN_DISABLE_GQA_DECOD", "1")
    with pytest.warns(UserWarning) as warned:
        s = settings_mod.reload_settings()
    messages = sorted(str(w.message) for w in warned)
    assert messages == [
        "METAL_ATTN_DISABLE_GQA_DECOD is not a metal-attn setting and is ignored; "
        "did you mean METAL_ATTN_DISABLE_GQA_DECODE?",
        "METAL_ATTN_GPU_CORE is not a metal-attn setting and is ignored; did you mean METAL_ATTN_GPU_CORES?",
    ]
    assert s.gpu_cores is None and s.disable_gqa_decode is False  # ignored, as the warning says
    logged = sorted(r.reason for r in log_records("unknown_setting"))
    assert logged == messages


def test_the_cuda_tools_variables_are_settings(monkeypatch, log_records):
    """METAL_ATTN_CUDA_CACHE_DIR and METAL_ATTN_NVRTC were read with os.environ, and the unknown-variable check
    called them ignored (with a "did you mean" to another setting)."""
    from pathlib import Path

    s = load(monkeypatch, METAL_ATTN_CUDA_CACHE_DIR="/tmp/cubins", METAL_ATTN_NVRTC="/opt/libnvrtc.so")
    assert (s.cuda_cache_dir, s.nvrtc) == (Path("/tmp/cubins"), Path("/opt/libnvrtc.so"))
    assert log_records("unknown_setting") == []


def test_unknown_variable_without_a_close_name(monkeypatch):
    monkeypatch.setenv("METAL_ATTN_ZZZZZZZZZZ", "1")
    with pytest.warns(UserWarning, match=r"^METAL_ATTN_ZZZZZZZZZZ is not a metal-attn setting and is ignored$"):
        settings_mod.reload_settings()


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED_VARIABLES.items()))
def test_renamed_variables_say_what_replaced_them(monkeypatch, old, new):
    monkeypatch.setenv(old, "x")
    with pytest.warns(UserWarning) as warned:
        settings_mod.reload_settings()
    assert [str(w.message) for w in warned] == [f"{old} is no longer read; use {new}"]


def test_renamed_table_points_at_live_variables():
    live = env_names()
    assert RENAMED_VARIABLES["METAL_ATTN_BACKEND"].startswith("METAL_ATTN_PROVIDER")
    for old, new in RENAMED_VARIABLES.items():
        assert old not in live, f"{old} is both renamed and live"
        assert new.split()[0] in live, f"{old} points at {new.split()[0]}, which is not a setting"


def test_known_names_do_not_warn(monkeypatch, recwarn):
    """Known names are not 'unknown', and no toggle is reserved any more: setting them all warns about nothing."""
    for name in env_names():
        if name.startswith("METAL_ATTN_") and name.endswith(("_GQA_DECODE", "_NAX", "_PREFILL")):
            monkeypatch.setenv(name, "1")
    settings_mod.reload_settings()
    warned = [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)]
    assert warned == []


def test_override_settings_restores_and_nests():
    before = get_settings()
    with override_settings(gpu_cores=40, disable_nax=True) as outer:
        assert get_settings() is outer
        assert (outer.gpu_cores, outer.disable_nax) == (40, True)
        with override_settings(gpu_cores=10) as inner:
            assert (inner.gpu_cores, inner.disable_nax) == (10, True)
        assert get_settings() is outer
    assert get_settings() is before
    assert before.gpu_cores is None and before.disable_nax is False


def test_override_settings_restores_after_an_exception():
    before = get_settings()
    with pytest.raises(RuntimeError, match="inside"), override_settings(provider="reference"):
        raise RuntimeError("inside")
    assert get_settings() is before


def test_override_settings_rejects_unknown_fields_with_a_hint():
    with (
        pytest.raises(SettingsError, match=r"unknown setting\(s\): gpu_core \(did you mean gpu_cores\?\)"),
        override_settings(gpu_core=10),
    ):
        pass


def test_override_settings_rejects_bad_values():
    before = get_settings()
    with pytest.raises(SettingsError) as err, override_settings(log_level="loud"):
        pass
    msg = str(err.value)
    assert msg.startswith("invalid metal-attn settings from overrides:")
    assert "log_level='loud': 'debug', 'info', 'warning' or 'error'" in msg
    assert get_settings() is before


def test_dispatch_epoch_changes_with_the_active_settings():
    """An override block is a scope of its own (each entry a new one); leaving it restores the outer
    epoch, whose cached decisions hold again; reloading the environment moves every scope on."""
    get_settings()  # loaded (which moves the epoch) before the first reading
    e0 = _epoch.current()
    with override_settings(gpu_cores=8):
        e1 = _epoch.current()
        with override_settings(gpu_cores=9):
            e2 = _epoch.current()
        assert _epoch.current() == e1
    with override_settings(gpu_cores=8):
        e3 = _epoch.current()
    assert len({e0, e1, e2, e3}) == 4 and _epoch.current() == e0
    reload_settings()
    assert _epoch.current()[0] > e0[0]


def _interleave(first_exit: str) -> dict:
    """Thread A enters an override, then B enters one, then ``first_exit`` leaves first, then the
    other; returns what each thread and the main thread saw at every step."""
    seen: dict = {}
    steps = {name: (threading.Event(), threading.Event()) for name in "AB"}  # (entered, may exit)

    def body(name: str, changes: dict) -> None:
        entered, may_exit = steps[name]
        with override_settings(**changes):
            seen[name + " inside"] = (get_settings().gpu_cores, get_settings().diagnostics)
            entered.set()
            assert may_exit.wait(10)
            seen[name + " before exit"] = (get_settings().gpu_cores, get_settings().diagnostics)
        seen[name + " after"] = (get_settings().gpu_cores, get_settings().diagnostics)

    ta = threading.Thread(target=body, args=("A", {"gpu_cores": 11, "diagnostics": True}))
    tb = threading.Thread(target=body, args=("B", {"gpu_cores": 22}))
    ta.start()
    assert steps["A"][0].wait(10)
    tb.start()
    assert steps["B"][0].wait(10)
    seen["main while both inside"] = (get_settings().gpu_cores, get_settings().diagnostics)
    second = "B" if first_exit == "A" else "A"
    steps[first_exit][1].set()
    (ta if first_exit == "A" else tb).join(10)
    steps[second][1].set()
    ta.join(10)
    tb.join(10)
    seen["main after"] = (get_settings().gpu_cores, get_settings().diagnostics)
    return seen


@pytest.mark.parametrize("first_exit", ["A", "B"])
def test_override_settings_is_thread_local_and_cannot_leak(first_exit):
    """The interleaving that leaked before (A enters, B enters, A exits, B exits: B restored A's
    override for the rest of the process), and its mirror: each thread sees only its own override,
    the main thread none, and nothing is left behind."""
    base = (get_settings().gpu_cores, get_settings().diagnostics)
    seen = _interleave(first_exit)
    assert seen["A inside"] == seen["A before exit"] == (11, True)
    assert seen["B inside"] == seen["B before exit"] == (22, base[1])
    assert seen["A after"] == seen["B after"] == seen["main while both inside"] == seen["main after"] == base


def test_override_settings_dispatch_caches_do_not_cross_threads():
    """A decision cached under one thread's override is not reused by another thread: the selection
    cache keys carry the settings scope. Here the two threads force different providers through the
    setting (not the call's argument, so only the scope tells the keys apart), interleaved."""
    case = make_case(q_lens=[1, 1], seq_lens=[40, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    md = case.metadata()
    # MLX streams are thread-local: a lazy array made on this thread cannot be evaluated on another.
    mx.eval(case.q, case.k_cache, case.v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q)
    barrier = threading.Barrier(2)
    outs: dict[str, list] = {"reference": [], "classic": []}
    errors: list[str] = []

    def body(provider: str) -> None:
        try:
            with override_settings(provider=provider):
                for _ in range(10):
                    barrier.wait(10)
                    out = ma.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md)
                    mx.eval(out)
                    outs[provider].append(out)
        except Exception as exc:  # a thread's failure must fail the test, not end as a warning
            errors.append(f"{provider}: {exc!r}")
            barrier.abort()

    threads = [threading.Thread(target=body, args=(p,)) for p in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(len(v) == 10 for v in outs.values()), errors
    want = case.oracle()
    for provider, results in outs.items():
        for out in results:
            assert_close_to_oracle(out, want, case.dtype, label=provider)
    by_scope: dict[int, set[str]] = {}
    for key, hit in md._selections.items():
        by_scope.setdefault(key[-1][1], set()).add(hit[0].provider.name)
    assert 0 not in by_scope and sorted(by_scope.values(), key=sorted) == [{"classic"}, {"reference"}], by_scope


def test_probe_overrides_reach_current_device():
    base = ma.current_device()
    with override_settings(
        backend_override="metal",
        gpu_cores=40,
        gpu_architecture="applegpu_g17s",
        gpu_name="Apple M5 Max",
        max_threadgroup_memory=32768,
        cpu_threads=18,
    ):
        dev = ma.current_device()
        assert (dev.backend, dev.gpu_cores, dev.architecture, dev.name) == (
            "metal",
            40,
            "applegpu_g17s",
            "Apple M5 Max",
        )
        assert (dev.max_threadgroup_memory, dev.cpu_threads) == (32768, 18)
        assert (dev.generation, dev.variant) == (17, "s")
    assert ma.current_device() == base


def test_probe_overrides_from_the_environment(monkeypatch):
    load(
        monkeypatch,
        METAL_ATTN_GPU_CORES="10",
        METAL_ATTN_GPU_ARCHITECTURE="applegpu_g15g",
        METAL_ATTN_BACKEND_OVERRIDE="metal",
    )
    dev = ma.current_device()
    assert (dev.backend, dev.gpu_cores, dev.generation, dev.variant) == ("metal", 10, 15, "g")


def test_every_field_has_a_description_and_an_env_name():
    live = env_names()
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        assert f"METAL_ATTN_{name.upper()}" in live


def test_nax_toggle_disables_the_shipped_provider_without_a_warning(monkeypatch):
    """METAL_ATTN_DISABLE_NAX (alias VLLM_METAL_DISABLE_NAX) is the nax_prefill provider's disable switch,
    through the same mechanism as the other toggles; nothing is reserved, so setting it warns about nothing."""
    import warnings

    assert Settings.model_fields["disable_nax"].description.startswith("Disable the M5 NAX prefill provider")
    assert settings_mod.RESERVED_SETTINGS == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = load(monkeypatch, VLLM_METAL_DISABLE_NAX="1")
        assert s.is_disabled("nax_prefill") == "disabled by VLLM_METAL_DISABLE_NAX=1"  # the variable the user set
        monkeypatch.delenv("VLLM_METAL_DISABLE_NAX")
        with override_settings(disable_nax=True) as o:
            # Set in code, not by a variable: the setting is named, with the variable that would set it
            assert o.is_disabled("nax_prefill") == "disabled by the disable_nax setting (its variable: " \
                "METAL_ATTN_DISABLE_NAX=1)"
        with override_settings(disabled_providers=("gqa_decode",)) as o:
            assert o.is_disabled("gqa_decode") == ("disabled by the disabled_providers setting (gqa_decode; its "
                                                   "variable: METAL_ATTN_DISABLED_PROVIDERS)")


@pytest.mark.parametrize(("env", "want"), [({"METAL_ATTN_LOG_FORMAT": "json"}, "json"),
                                         ({"METAL_ATTN_LOG_LEVEL": "error"}, "nothing")])
def test_a_variable_named_while_logging_is_configured_takes_its_format_and_level(env, want):
    """The warnings of the settings read that configures the command's logging were printed bare, in any
    format and at any level: logging was configured from those very settings only afterwards."""
    import json
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("METAL_ATTN_", "VLLM_METAL_"))}
    run = subprocess.run([sys.executable, "-m", "metal_attn", "settings", "--json"], capture_output=True, text=True,
                         env={**base, "METAL_ATTN_PLUGIN_AUTOLOAD": "0", "METAL_ATTN_GPU_CORE": "4", **env},
                         timeout=120, check=True)
    lines = [line for line in run.stderr.splitlines() if "METAL_ATTN_GPU_CORE " in line]
    if want == "nothing":
        assert lines == [], run.stderr
    else:
        assert len(lines) == 1 and json.loads(lines[0])["event"] == "unknown_setting", run.stderr


def test_the_command_line_reports_an_unknown_setting_once(monkeypatch, recwarn, capsys, restore_logging):
    """On the command line an unknown variable is one log event, not also a Python warning (it printed
    twice); programs that load the settings still get the warning (a `SettingsWarning`, a UserWarning)."""
    from metal_attn import cli
    from metal_attn.errors import SettingsWarning

    monkeypatch.setenv("METAL_ATTN_ZZZZZZZZZZ", "1")
    monkeypatch.setattr(settings_mod, "_current", None)  # the command loads the settings afresh
    assert cli.main(["settings"]) == 0
    assert [w for w in recwarn if issubclass(w.category, SettingsWarning)] == []
    err = capsys.readouterr().err  # the event, through the handler the command configured
    assert err.count("METAL_ATTN_ZZZZZZZZZZ is not a metal-attn setting and is ignored") == 1, err
    assert "unknown_setting" in err
    with pytest.warns(SettingsWarning, match="METAL_ATTN_ZZZZZZZZZZ is not a metal-attn setting"):
        settings_mod.reload_settings()


def test_a_program_that_configured_no_logging_reads_a_settings_warning_once():
    """A program that loads the settings with logging unconfigured got the warning and then the log record's
    bare message from Python's last-resort handler: the same sentence twice. The record goes out only where
    logging has a handler (the program's, or the command line's)."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("METAL_ATTN_", "VLLM_METAL_"))}
    code = "from metal_attn.settings import get_settings; get_settings()"
    sentence = "METAL_ATTN_GPU_CORE is not a metal-attn setting and is ignored"
    for setup, want in (("", 1), ("import logging; logging.basicConfig(format='LOG %(message)s'); ", 2)):
        run = subprocess.run([sys.executable, "-c", setup + code], capture_output=True, text=True, timeout=120,
                             env={**base, "METAL_ATTN_PLUGIN_AUTOLOAD": "0", "METAL_ATTN_GPU_CORE": "4"}, check=True)
        assert run.stderr.count(sentence) == want, run.stderr
        assert ("SettingsWarning: " + sentence) in run.stderr
        assert (f"LOG unknown_setting: {sentence}" in run.stderr) == (want == 2), run.stderr
