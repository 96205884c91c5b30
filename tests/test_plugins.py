"""Plugin loading: entry points, isolation of broken plugins, allow/deny lists,
autoload off, plugins with misspelled hooks left out, and the lazy process registry.

Entry points are simulated by monkeypatching `metal_attn.plugins._entry_points`
to return entry points of small plugin modules written to a temporary folder.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import inspect
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from metal_attn.providers.reference import ReferenceProvider

import metal_attn as ma
from metal_attn import hookspecs, plugins
from metal_attn import settings as settings_mod
from metal_attn.plugins import registry_from
from metal_attn.settings import override_settings

GROUP = plugins.ENTRY_POINT_GROUP

#: Plugin modules written for these tests: module name -> source.
MODULES = {
    "ma_test_good_plugin": """
        import metal_attn as ma

        class ThirdParty(ma.Provider):
            name = "third_party"
            priority = 20
            backends = frozenset({"cpu"})

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            registrar.add(ThirdParty)
    """,
    "ma_test_other_plugin": """
        import metal_attn as ma

        class Other(ma.Provider):
            name = "other_party"
            priority = 15
            backends = frozenset({"cpu"})

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            registrar.add(Other())
    """,
    "ma_test_import_error_plugin": """
        raise ImportError("libfoo.so: cannot open shared object file")
    """,
    "ma_test_register_error_plugin": """
        import metal_attn as ma

        class Half(ma.Provider):
            name = "half_registered"
            priority = 30
            backends = frozenset({"cpu"})

        SEEN = []

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            registrar.add(Half)
            raise RuntimeError("vendor SDK not found")

        @ma.hookimpl
        def metal_attn_provider_selected(request, provider, route, reasons):
            SEEN.append(provider)
    """,
    "ma_test_unmarked_plugin": """
        import metal_attn as ma

        class Unmarked(ma.Provider):
            name = "unmarked"
            priority = 20
            backends = frozenset({"cpu"})

        def metal_attn_register_providers(registrar):  # no @ma.hookimpl
            registrar.add(Unmarked)
    """,
    "ma_test_misspelled_plugin": """
        import metal_attn as ma

        @ma.hookimpl
        def metal_attn_register_provider(registrar):
            pass
    """,
    "ma_test_reentrant_plugin": """
        import metal_attn as ma

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            ma.providers()  # to place itself above a built-in: the registry is what is being built
    """,
    "ma_test_reentrant_import_plugin": """
        import metal_attn as ma

        ma.explain(ma.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[8], dtype="float32", num_heads=4,
                                                    num_kv_heads=4, head_size=64))

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            pass
    """,
    "ma_test_thread_reentrant_plugin": """
        from concurrent.futures import ThreadPoolExecutor

        import metal_attn as ma

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            with ThreadPoolExecutor(1) as pool:  # the API from another thread, waited on
                pool.submit(ma.providers).result()
    """,
    "ma_test_sysexit_plugin": """
        import argparse

        argparse.ArgumentParser(prog="vendor-tool").parse_args(["--no-such-flag"])  # a script's module
    """,
    "ma_test_sysexit_hook_plugin": """
        import sys

        import metal_attn as ma

        @ma.hookimpl
        def metal_attn_register_providers(registrar):
            sys.exit("vendor runtime missing")
    """,
    "ma_test_wrapper_plugin": """
        import metal_attn as ma

        class Wrapped(ma.Provider):
            name = "wrapped"
            priority = 20
            backends = frozenset({"cpu"})

        @ma.hookimpl(wrapper=True)
        def metal_attn_register_providers(registrar):
            registrar.add(Wrapped)
            return (yield)
    """,
    "ma_test_fake_builtin_plugin": """
        import metal_attn as ma

        class FakeClassic(ma.Provider):
            name = "classic"
            priority = 1000
            backends = frozenset({"cpu"})

        @ma.hookimpl(tryfirst=True)
        def metal_attn_register_providers(registrar):
            registrar.add(FakeClassic)
    """,
}


@dataclasses.dataclass
class FakeDist:
    name: str
    version: str


@dataclasses.dataclass
class FakeEntryPoint:
    """Duck-typed `importlib.metadata.EntryPoint` with a distribution attached."""

    name: str
    value: str
    dist: FakeDist | None = None
    group: str = GROUP

    def load(self):
        return md.EntryPoint(self.name, self.value, self.group).load()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, clean_settings_env):
    monkeypatch.setattr(logging.getLogger("metal_attn"), "propagate", True)
    plugins.reset_registry()
    yield
    plugins.reset_registry()


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch):
    """Write the plugin modules to a folder on sys.path; forget them afterwards."""
    for mod, src in MODULES.items():
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(src))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for mod in MODULES:
        sys.modules.pop(mod, None)


@pytest.fixture
def entry_points(monkeypatch, plugin_dir):
    """Install fake entry points: ``entry_points(name=module, ...)``."""

    def _set(**eps: str):
        fake = [FakeEntryPoint(name, mod) for name, mod in eps.items()]
        monkeypatch.setattr(plugins, "_entry_points", lambda: fake)
        return fake

    return _set


def names(reg) -> list[str]:
    return [e.provider.name for e in reg.entries]


@pytest.fixture
def builtin(monkeypatch) -> list[str]:
    """Names of the built-in providers, in priority order (the set grows as providers land)."""
    with monkeypatch.context() as m:
        m.setattr(plugins, "_entry_points", lambda: [])
        got = names(plugins.build_registry())
    assert "reference" in got
    return got


def third_party(reg, builtin: list[str]) -> list[str]:
    """Provider names of ``reg`` that are not built in, after checking every built-in one is there."""
    assert [n for n in names(reg) if n in builtin] == builtin
    return [n for n in names(reg) if n not in builtin]


def test_third_party_entry_point_registers_alongside_builtin(entry_points, builtin):
    entry_points(good="ma_test_good_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"]
    assert "good" not in reg.load_errors
    origin = {e.provider.name: e.origin for e in reg.entries}
    assert origin["third_party"].plugin == "good"
    assert origin["reference"].describe() == "metal-attn source checkout (builtin)"


def test_origin_names_distribution_and_version(monkeypatch, plugin_dir):
    ep = FakeEntryPoint("good", "ma_test_good_plugin", FakeDist("acme-attn", "1.2.3"))
    monkeypatch.setattr(plugins, "_entry_points", lambda: [ep])
    reg = plugins.build_registry()
    entry = next(e for e in reg.entries if e.provider.name == "third_party")
    assert entry.origin.describe() == "acme-attn 1.2.3 (good)"


def test_plugin_that_raises_at_import_is_isolated_and_logged(entry_points, log_records, builtin):
    entry_points(broken="ma_test_import_error_plugin", good="ma_test_good_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"]  # the rest keep working
    assert reg.load_errors["broken"] == "ImportError: libfoo.so: cannot open shared object file"
    assert "good" not in reg.load_errors
    [rec] = log_records("plugin_load_failed")
    assert rec.levelno == logging.ERROR
    assert rec.plugin == "broken"
    assert rec.reason == "libfoo.so: cannot open shared object file"
    assert "Traceback (most recent call last)" in rec.traceback
    assert "ma_test_import_error_plugin.py" in rec.traceback


def test_plugin_whose_register_hook_raises_is_isolated(entry_points, log_records, builtin):
    entry_points(half="ma_test_register_error_plugin", good="ma_test_good_plugin")
    reg = plugins.build_registry()
    # What the failing hook added before raising is left out too (it used to stay, at priority
    # 30, above the built-ins); the other plugins are untouched.
    assert third_party(reg, builtin) == ["third_party"]
    assert reg.load_errors["half"] == "RuntimeError: vendor SDK not found"
    assert "good" not in reg.load_errors
    [rec] = log_records("plugin_register_failed")
    assert (rec.plugin, rec.reason) == ("half", "vendor SDK not found")
    assert "RuntimeError: vendor SDK not found" in rec.traceback
    # Reported as not loaded, so none of its hooks run: its observer used to see every selection.
    import ma_test_register_error_plugin as half

    from metal_attn.device import current_device
    from metal_attn.settings import get_settings

    request = ma.AttentionRequest.from_lengths(q_lens=[1], seq_lens=[8], dtype="float32", num_heads=4,
                                               num_kv_heads=4, head_size=64)
    assert reg.select(request, current_device(), get_settings()).provider is not None
    assert half.SEEN == []


@pytest.mark.parametrize(("module", "where"), [("ma_test_reentrant_plugin", "hook"),
                                               ("ma_test_reentrant_import_plugin", "import")])
def test_a_plugin_that_calls_the_api_while_registering_is_left_out_not_a_deadlock(entry_points, builtin, module,
                                                                                   where):
    """Its hook (or its import) called `metal_attn.providers()`, which waited on the lock of the very build it ran
    in: the process hung with no output."""
    entry_points(reentrant=module, good="ma_test_good_plugin")
    with override_settings(plugin_autoload=True):
        reg = plugins.get_registry()  # the process-wide registry, through its lock
    assert third_party(reg, builtin) == ["third_party"]
    assert reg.load_errors["reentrant"].startswith(
        "RegistryError: plugin 'reentrant' called metal-attn's API (which needs the provider registry) while the "
        "registry is being built, from its import or its metal_attn_register_providers hook")


def test_a_plugin_that_waits_on_a_thread_calling_the_api_is_left_out_not_a_deadlock(entry_points, builtin,
                                                                                     monkeypatch):
    """The same call from a thread the hook waits on: that thread waits for the registry's lock, which the build
    holds while it waits on the thread. It hung; now the waiting thread stops after `BUILD_WAIT_S` and says why."""
    monkeypatch.setattr(plugins, "BUILD_WAIT_S", 0.5)
    entry_points(threads="ma_test_thread_reentrant_plugin", good="ma_test_good_plugin")
    with override_settings(plugin_autoload=True):
        reg = plugins.get_registry()
    assert third_party(reg, builtin) == ["third_party"]
    assert reg.load_errors["threads"].startswith(
        "RegistryError: waited 0.5 s for the provider registry, which another thread is building (now running "
        "plugin 'threads''s code)")


@pytest.mark.parametrize(("module", "event", "message"), [
    ("ma_test_sysexit_plugin", "plugin_load_failed", "SystemExit: 2"),
    ("ma_test_sysexit_hook_plugin", "plugin_register_failed", "SystemExit: vendor runtime missing"),
])
def test_a_plugin_that_exits_is_left_out_and_the_process_goes_on(entry_points, log_records, builtin, module, event,
                                                                  message):
    """A script-style module (argparse or sys.exit at import or in its hook) ended the command line with its
    own usage text, and `ma.providers()` raised SystemExit."""
    entry_points(exits=module, good="ma_test_good_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"] and reg.load_errors["exits"] == message
    [rec] = log_records(event)
    assert rec.plugin == "exits" and "Traceback (most recent call last)" in rec.traceback


def test_a_wrapper_register_hook_is_refused_by_name(entry_points, builtin):
    """A register hook marked wrapper=True (a generator) was called and never run: nothing registered, no error."""
    entry_points(wrapper="ma_test_wrapper_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == []
    assert reg.load_errors["wrapper"] == (
        "RegistryError: plugin 'wrapper': its metal_attn_register_providers hook is marked wrapper=True (allowed: a "
        "plain @metal_attn.hookimpl function, optionally tryfirst/trylast)")


def test_a_third_party_entry_point_named_builtin_is_refused_whatever_the_order(monkeypatch, plugin_dir, builtin):
    """Found first (entry points come in file-system order), it pushed metal-attn's own plugin out, and its
    `classic` then took the built-in's place at priority 1000."""
    ours = FakeEntryPoint("builtin", "metal_attn.providers", FakeDist("metal-attn", "1.0"))
    theirs = FakeEntryPoint("builtin", "ma_test_fake_builtin_plugin", FakeDist("shady-attn", "0.1"))
    for order in ([theirs, ours], [ours, theirs]):
        monkeypatch.setattr(plugins, "_entry_points", lambda order=order: order)
        reg = plugins.build_registry()
        assert names(reg) == builtin and type(reg.get("classic")).__name__ != "FakeClassic"
        assert reg.load_errors == {"shady-attn 0.1 (builtin)": (
            "RegistryError: entry point builtin = ma_test_fake_builtin_plugin of shady-attn 0.1 (builtin): the name "
            "'builtin' is reserved for metal-attn's own providers (allowed: another name); the plugin is left out")}


def test_two_distributions_with_one_entry_point_name_are_told_apart(monkeypatch, plugin_dir, builtin):
    """The second was refused by pluggy under the first one's key, naming neither distribution."""
    first = FakeEntryPoint("good", "ma_test_good_plugin", FakeDist("acme-attn", "1.2.3"))
    second = FakeEntryPoint("good", "ma_test_other_plugin", FakeDist("other-attn", "0.2"))
    monkeypatch.setattr(plugins, "_entry_points", lambda: [first, second])
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"] and "good" not in reg.load_errors
    assert reg.load_errors["other-attn 0.2 (good)"] == (
        "RegistryError: entry point good = ma_test_other_plugin of other-attn 0.2 (good): the name 'good' is taken "
        "by acme-attn 1.2.3 (good) (allowed: a name no other installed plugin uses); the plugin is left out")


def test_a_disabled_provider_name_no_provider_has_is_logged(entry_points, log_records, builtin):
    """A typo or another case in METAL_ATTN_DISABLED_PROVIDERS disabled nothing without a word."""
    entry_points()
    with override_settings(disabled_providers=("GQA_DECODE", "reference")):
        plugins.build_registry()
    [rec] = log_records("unknown_disabled_provider")
    assert (rec.setting, rec.provider) == ("METAL_ATTN_DISABLED_PROVIDERS", "GQA_DECODE")
    assert "disables nothing" in rec.reason and "gqa_decode" in rec.providers


def test_a_plugin_cannot_take_a_builtin_name_by_running_first(builtin):
    """trylast hooks run first in pluggy; the built-ins still register first, so the plugin that
    reuses ``classic`` is the one refused (it used to push every built-in but reference out)."""
    class Impostor(ReferenceProvider):
        name = "classic"

    class Hijack:
        @ma.hookimpl(trylast=True)
        def metal_attn_register_providers(self, registrar):
            registrar.add(Impostor)

    reg = registry_from([plugins._builtin_module(), Hijack()], names=["builtin", "hijack"])
    assert [e.provider.name for e in reg.entries] == builtin
    assert type(reg.get("classic")).__name__ == "ClassicProvider"
    assert reg.load_errors == {"hijack": "RegistryError: provider name='classic' is already registered (by builtin)"}


def test_a_refused_provider_leaves_out_the_whole_plugin(builtin):
    class Fine(ReferenceProvider):
        name = "fine_one"

    class Twice:
        @ma.hookimpl
        def metal_attn_register_providers(self, registrar):
            registrar.add(Fine)
            registrar.add(Fine)  # a duplicate, raised at the add call

    reg = registry_from([plugins._builtin_module(), Twice()], names=["builtin", "twice"])
    assert "fine_one" not in [e.provider.name for e in reg.entries]
    assert reg.load_errors == {"twice": "RegistryError: provider name='fine_one' is added twice by this plugin"}


def test_deny_list_blocks_a_plugin_before_it_is_imported(entry_points, monkeypatch, builtin):
    entry_points(good="ma_test_good_plugin", other="ma_test_other_plugin")
    monkeypatch.setenv("METAL_ATTN_PLUGINS_DENY", "good")
    settings_mod.reload_settings()
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["other_party"]
    assert "ma_test_good_plugin" not in sys.modules
    assert "good" not in reg.load_errors


def test_deny_list_can_block_the_builtin_plugin(entry_points):
    entry_points(good="ma_test_good_plugin")
    with override_settings(plugins_deny=("builtin",)):
        reg = plugins.build_registry()
    assert names(reg) == ["third_party"]  # no built-in provider at all


def test_a_registry_left_empty_by_the_deny_list_says_so():
    """METAL_ATTN_PLUGINS_DENY=builtin with no other plugin: the calls' errors ended in an empty list."""
    import mlx.core as mx

    with override_settings(plugins_deny=("builtin",), plugin_autoload=False):  # no installed example plugin
        k = mx.zeros((2, 4, 1, 8))
        with pytest.raises(ma.NoProviderError) as write:
            ma.reshape_and_cache(mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)), k, k, [0])
        with pytest.raises(ma.NoProviderError) as attend:
            ma.paged_attention(mx.zeros((1, 1, 8)), k, k, block_tables=[[0]], seq_lens=[1], cu_seqlens_q=[0, 1])
    for exc in (write, attend):
        assert "no provider is registered (no plugin registered one under METAL_ATTN_PLUGINS_DENY=builtin and " \
               "METAL_ATTN_PLUGIN_AUTOLOAD=0;" in str(
            exc.value), str(exc.value)


def test_deny_list_applies_to_plugin_objects_too():
    import metal_attn as ma

    class P(ma.Provider):
        name = "obj_provider"
        priority = 1
        backends = frozenset({"cpu"})

    class Plugin:
        @ma.hookimpl
        def metal_attn_register_providers(self, registrar):
            registrar.add(P)

    assert names(registry_from([Plugin()], names=["objs"])) == ["obj_provider"]
    with override_settings(plugins_deny=("objs",)):
        assert names(registry_from([Plugin()], names=["objs"])) == []


def test_empty_allow_list_means_no_third_party_plugins(entry_points, monkeypatch, builtin):
    entry_points(good="ma_test_good_plugin", other="ma_test_other_plugin")
    monkeypatch.setenv("METAL_ATTN_PLUGINS_ALLOW", "")
    assert settings_mod.reload_settings().plugins_allow == ()
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == []
    assert "ma_test_good_plugin" not in sys.modules and "ma_test_other_plugin" not in sys.modules


def test_allow_list_keeps_only_the_named_plugins(entry_points, builtin):
    entry_points(good="ma_test_good_plugin", other="ma_test_other_plugin")
    with override_settings(plugins_allow=("other",)):
        reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["other_party"]
    assert "ma_test_good_plugin" not in sys.modules


def test_autoload_off_loads_only_the_builtin_plugin(entry_points, monkeypatch, builtin):
    entry_points(good="ma_test_good_plugin", broken="ma_test_import_error_plugin")
    monkeypatch.setenv("METAL_ATTN_PLUGIN_AUTOLOAD", "0")
    settings_mod.reload_settings()
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == []
    assert "broken" not in reg.load_errors
    assert "ma_test_good_plugin" not in sys.modules


def test_a_plugin_with_a_misspelled_hook_is_left_out_and_named(entry_points, log_records, builtin):
    """pluggy's validation error used to fail every call (attention, `providers`, `doctor`) until the plugin
    was denied by hand; now that plugin alone is left out, logged with the setting that silences it."""
    entry_points(typo="ma_test_misspelled_plugin", good="ma_test_good_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"]
    assert "unknown hook 'metal_attn_register_provider'" in reg.load_errors["typo"]
    assert "METAL_ATTN_PLUGINS_DENY=typo silences this" in reg.load_errors["typo"]
    assert ("(the hooks: metal_attn_provider_selected(request, provider, route, reasons), "
            "metal_attn_register_providers(registrar);") in reg.load_errors["typo"]
    [rec] = log_records("plugin_load_failed")
    assert rec.plugin == "typo" and rec.traceback == "(raised by metal-attn's checks)"  # it read 'NoneType: None'


def test_a_plugin_object_with_a_misspelled_hook_is_left_out(plugin_dir, builtin):
    module = importlib.import_module("ma_test_misspelled_plugin")
    reg = registry_from([plugins._builtin_module(), module], names=["builtin", "typo"])
    assert "metal_attn_register_provider" in reg.load_errors["typo"]
    assert sorted(e.provider.name for e in reg.entries) == sorted(builtin)


def test_process_registry_is_cached_and_rebuilt_when_plugin_settings_change(entry_points, builtin):
    entry_points(good="ma_test_good_plugin")
    first = plugins.get_registry()
    assert plugins.get_registry() is first
    assert third_party(first, builtin) == ["third_party"]
    with override_settings(plugins_deny=("good",)):
        denied = plugins.get_registry()
        assert denied is not first and third_party(denied, builtin) == []
    # Settings that do not concern plugins keep the same registry.
    again = plugins.get_registry()
    assert third_party(again, builtin) == ["third_party"]
    with override_settings(gpu_cores=40, disable_tiled_prefill=True):
        assert plugins.get_registry() is again
    plugins.reset_registry()
    assert plugins.get_registry() is not again


def test_importing_metal_attn_loads_no_plugins():
    code = (
        "import sys, metal_attn, metal_attn.plugins as p; "
        "assert p._registries == {}, 'registry built at import'; "
        "assert 'metal_attn.providers.reference' not in sys.modules, 'provider imported at import'; "
        "print('ok')"
    )
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("METAL_ATTN_")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_hookspec_is_prefixed_and_documented():
    specs = [
        (name, fn) for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "metal_attn_spec")
    ]
    assert sorted(n for n, _ in specs) == ["metal_attn_provider_selected", "metal_attn_register_providers"]
    for name, fn in specs:
        assert name.startswith("metal_attn_")
        assert fn.__doc__ and len(fn.__doc__.strip()) > 40, f"{name} needs a docstring"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "providers.md").read_text()
    for name, _ in specs:
        assert f"`{name}(" in docs, f"{name} is not documented in docs/providers.md (Hooks)"


def test_a_plugin_list_naming_no_plugin_is_logged(entry_points, log_records, builtin):
    """A provider's name in METAL_ATTN_PLUGINS_ALLOW dropped every third-party plugin without a word."""
    entry_points(good="ma_test_good_plugin")
    with override_settings(plugins_allow=("third_party",)):
        reg = plugins.build_registry()
    assert third_party(reg, builtin) == []
    [rec] = log_records("unknown_plugin_name")
    assert (rec.setting, rec.plugin) == ("METAL_ATTN_PLUGINS_ALLOW", "third_party") and "good" in rec.plugins


@pytest.mark.parametrize("value", ["ma_test_unmarked_plugin", "ma_test_good_plugin:metal_attn_register_providers"],
                         ids=["hook-unmarked", "entry-point-names-the-hook-function"])
def test_a_plugin_that_implements_no_hook_is_reported_not_silently_dropped(entry_points, log_records, builtin, value):
    # Two easy mistakes: a hook function without @hookimpl, and an entry point naming the hook function itself.
    # Either way pluggy finds no hook; the plugin is a load error that `metal-attn doctor` shows, the rest load.
    entry_points(nohook=value, good="ma_test_good_plugin")
    reg = plugins.build_registry()
    assert third_party(reg, builtin) == ["third_party"]
    error = reg.load_errors["nohook"]
    assert error.startswith("TypeError: plugin 'nohook' loaded "), error
    assert "implements no metal_attn hook: mark each hook function with @metal_attn.hookimpl" in error
    assert "good" not in reg.load_errors
    [rec] = log_records("plugin_load_failed")
    assert rec.plugin == "nohook"
