"""Plugin discovery and loading (pluggy), and the process-wide registry.

Providers, built-in and third-party alike, arrive through the entry-point
group ``metal_attn.providers``. Loading is lazy (first use, never at import),
isolated per plugin (an import or registration error is logged with the
plugin's name and traceback; the others keep working) and controlled by the
settings users know from pytest: autoload off, an allow-list, a deny-list.
"""

from __future__ import annotations

import importlib.metadata as md
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pluggy

from metal_attn import _epoch, hookspecs
from metal_attn.errors import RegistryError, SettingsError
from metal_attn.log import get_logger, warn_once
from metal_attn.registry import Origin, ProviderRegistrar, Registry
from metal_attn.settings import Settings, get_settings

ENTRY_POINT_GROUP = "metal_attn.providers"
BUILTIN_PLUGIN = "builtin"
BUILTIN_MODULE = "metal_attn.providers"

_log = get_logger()


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _is_builtin(ep: md.EntryPoint) -> bool:
    """Whether ``ep`` is metal-attn's own plugin: the name ``builtin`` is reserved for it."""
    return ep.name == BUILTIN_PLUGIN and ep.value.split(":")[0] == BUILTIN_MODULE


def _entry_points() -> list[md.EntryPoint]:
    """The installed plugins' entry points, metal-attn's own first (whatever order the file system gives)."""
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (not _is_builtin(ep), ep.name))


def plugin_names() -> list[str]:
    """The names METAL_ATTN_PLUGINS_ALLOW / _DENY match: the installed plugins' entry-point names (the
    built-in one included, also in a source checkout without metadata)."""
    return list(dict.fromkeys([BUILTIN_PLUGIN, *(ep.name for ep in _entry_points())]))


def unknown_plugin_names(settings: Settings, known: Sequence[str]) -> list[tuple[str, str]]:
    """``(variable, name)`` for each name in METAL_ATTN_PLUGINS_ALLOW / _DENY that no plugin in ``known`` has
    (a provider's name where a plugin's belongs, say: the allow-list then drops every third-party plugin,
    the deny-list denies nothing). Logged when a registry is built; `metal-attn doctor` reports them."""
    lists = (("METAL_ATTN_PLUGINS_ALLOW", settings.plugins_allow or ()),
             ("METAL_ATTN_PLUGINS_DENY", settings.plugins_deny))
    return [(var, name) for var, listed in lists for name in sorted(set(listed) - set(known))]


def _builtin_module() -> Any:
    """The built-in plugin, also when running from a source checkout (no dist metadata)."""
    from metal_attn._layout import import_builtin_providers

    return import_builtin_providers()


def build_registry(
    settings: Settings | None = None,
    *,
    extra_plugins: Sequence[object] = (),
    names: Sequence[str] | None = None,
    load_entry_points: bool = True,
) -> Registry:
    """Build a registry: entry-point plugins (filtered by settings) plus ``extra_plugins``."""
    settings = settings or get_settings()
    pm = new_plugin_manager()
    registry = Registry(on_selected=lambda **kw: pm.hook.metal_attn_provider_selected(**kw))
    origins: dict[str, Origin] = {}
    deny = set(settings.plugins_deny)
    for name in deny:
        pm.set_blocked(name)

    def _failed(event: str, name: str, exc: BaseException) -> None:
        """Isolate a third-party failure: record it for `metal-attn doctor` and log it with its traceback (the
        exception's own, where it was raised)."""
        registry.load_errors[name] = f"{type(exc).__name__}: {exc}"
        trace = "".join(traceback.format_exception(exc)) if exc.__traceback__ else "(raised by metal-attn's checks)"
        _log.error(event, plugin=name, reason=str(exc), traceback=trace)

    def _register(plugin: object, name: str, origin: Origin) -> None:
        if pm.is_blocked(name):
            return
        try:
            pm.register(plugin, name=name)
        except Exception as exc:
            _failed("plugin_load_failed", name, exc)
            return
        if not pm.get_hookcallers(plugin):
            pm.unregister(plugin)
            _failed("plugin_load_failed", name, TypeError(
                f"plugin {name!r} loaded {type(plugin).__name__} {getattr(plugin, '__name__', plugin)!r}, which "
                "implements no metal_attn hook: mark each hook function with @metal_attn.hookimpl, and point the "
                "entry point at the module (or object) that holds the hooks, not at a hook function"))
            return
        origins[name] = origin

    if load_entry_points:
        seen_builtin = False
        taken: dict[str, str] = {}  # entry-point name -> the distribution whose plugin loaded under it
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            origin = Origin(ep.name, dist.name if dist else None, dist.version if dist else None)
            builtin = _is_builtin(ep)
            seen_builtin = seen_builtin or builtin
            if ep.name in deny:
                continue
            if not builtin:
                if not settings.plugin_autoload:
                    continue
                if settings.plugins_allow is not None and ep.name not in settings.plugins_allow:
                    continue
            who = origin.describe()
            if ep.name == BUILTIN_PLUGIN and not builtin:
                _failed("plugin_load_failed", who, RegistryError(
                    f"entry point {ep.name} = {ep.value} of {origin.describe()}: the name {BUILTIN_PLUGIN!r} is "
                    "reserved for metal-attn's own providers (allowed: another name); the plugin is left out"))
                continue
            if ep.name in taken:
                _failed("plugin_load_failed", who, RegistryError(
                    f"entry point {ep.name} = {ep.value} of {origin.describe()}: the name {ep.name!r} is taken by "
                    f"{taken[ep.name]} (allowed: a name no other installed plugin uses); the plugin is left out"))
                continue
            try:
                plugin = _building(ep.name, ep.load)
            except (Exception, SystemExit) as exc:  # a script-style module's sys.exit/argparse at import too
                _failed("plugin_load_failed", ep.name, exc)
                continue
            _register(plugin, ep.name, origin)
            if ep.name in origins:
                taken[ep.name] = origin.describe()
        if not seen_builtin and BUILTIN_PLUGIN not in deny:
            # Running from a source checkout without installed metadata (the GPU machine).
            _register(_builtin_module(), BUILTIN_PLUGIN, Origin(BUILTIN_PLUGIN, "metal-attn", "source checkout"))
    extra_names = []
    for i, plugin in enumerate(extra_plugins):
        name = (names[i] if names else None) or getattr(plugin, "__name__", None) or f"plugin-{i}"
        extra_names.append(name)
        _register(plugin, name, Origin(name))
    if load_entry_points:
        known = [*plugin_names(), *extra_names]
        for var, name in unknown_plugin_names(settings, known):
            warn_once("unknown_plugin_name", (var, name), setting=var, plugin=name, plugins=", ".join(known))
    _drop_invalid_plugins(pm, _failed)
    # The built-in providers register first, whatever order pluggy's tryfirst/trylast give the
    # hooks: a third-party provider that takes a built-in name is then the one refused.
    impls = sorted(pm.hook.metal_attn_register_providers.get_hookimpls(), key=lambda i: i.plugin_name != BUILTIN_PLUGIN)
    for impl in impls:
        origin = origins.get(impl.plugin_name, Origin(impl.plugin_name))
        registrar = ProviderRegistrar(registry, origin)
        try:
            if impl.hookwrapper or getattr(impl, "wrapper", False):  # a generator: calling it would run nothing
                raise RegistryError(
                    f"plugin {impl.plugin_name!r}: its metal_attn_register_providers hook is marked "
                    f"{'hookwrapper' if impl.hookwrapper else 'wrapper'}=True (allowed: a plain @metal_attn.hookimpl "
                    "function, optionally tryfirst/trylast)")
            _building(impl.plugin_name, impl.function, registrar=registrar)
            registrar.commit()  # all of the plugin's providers, or none of them
        except (Exception, SystemExit) as exc:
            _failed("plugin_register_failed", impl.plugin_name, exc)
            pm.unregister(impl.plugin)  # reported as not loaded: none of its hooks run (its observers included)
    for name in unknown_provider_names(settings.disabled_providers, registry.names):
        warn_once("unknown_disabled_provider", (name,), setting="METAL_ATTN_DISABLED_PROVIDERS", provider=name,
                  reason="no registered provider has this name, so it disables nothing",
                  providers=", ".join(registry.names))
    return registry


def unknown_provider_names(names: Iterable[str], registered: Sequence[str]) -> list[str]:
    """The names in ``names`` (METAL_ATTN_DISABLED_PROVIDERS) that no provider in ``registered`` has: a typo
    or another case there disables nothing. Logged when a registry is built; `metal-attn doctor` reports them."""
    return [n for n in dict.fromkeys(names) if n not in registered]


def _drop_invalid_plugins(pm: Any, failed: Callable[[str, str, Exception], None]) -> None:
    """pluggy's ``check_pending``, one plugin at a time: a plugin with a hook no spec declares (a
    misspelled ``metal_attn_register_provider``) is unregistered and reported, and the others load."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin) or repr(exc.plugin)
            pm.unregister(exc.plugin)
            specs = {h: c.spec for h, c in vars(pm.hook).items() if getattr(c, "spec", None) is not None}
            hooks = ", ".join(f"{h}({', '.join(spec.argnames)})" for h, spec in sorted(specs.items()))
            failed("plugin_load_failed", name, RuntimeError(
                f"{exc} (the hooks: {hooks}; the plugin is left out; METAL_ATTN_PLUGINS_DENY={name} silences this)"))


def registry_from(plugins: Iterable[object] | None = None, *, names: Sequence[str] | None = None) -> Registry:
    """A fresh registry built from plugin objects/modules directly, without entry points (for tests)."""
    return build_registry(extra_plugins=list(plugins or ()), names=names, load_entry_points=False)


_lock = threading.Lock()
#: The plugin whose import or registration hook this thread is running while it builds a registry.
_local = threading.local()
#: The plugin whose code a registry build is running, in whichever thread (for the message below).
_in_plugin: str | None = None
#: How long `get_registry` waits for a build another thread holds before it says why it stopped waiting: a
#: plugin that waits, while it registers, on a thread of its own calling the API would wait on it forever.
BUILD_WAIT_S = 60.0


def _building(plugin: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on behalf of ``plugin`` while a registry is built: `get_registry` called from it
    raises instead of waiting for the build it is part of (it deadlocked)."""
    global _in_plugin
    outer, outer_any = getattr(_local, "building", None), _in_plugin
    _local.building = _in_plugin = plugin
    try:
        return fn(*args, **kwargs)
    finally:
        _local.building, _in_plugin = outer, outer_any
#: One registry per plugin-loading configuration (autoload, allow- and deny-lists): threads whose
#: `override_settings` differ there each get theirs, without rebuilding each other's.
_registries: dict[tuple, Registry] = {}


def _plugin_key(s: Settings) -> tuple:
    return (s.plugin_autoload, s.plugins_allow, tuple(sorted(s.plugins_deny)))


def get_registry() -> Registry:
    """The registry for the plugin settings in force (built on first use of those settings)."""
    building = getattr(_local, "building", None)
    if building is not None:
        raise RegistryError(
            f"plugin {building!r} called metal-attn's API (which needs the provider registry) while the registry "
            "is being built, from its import or its metal_attn_register_providers hook (allowed there: "
            "registrar.add(...); call the API once registration is done, e.g. from a metal_attn_provider_selected "
            "observer or at run time)")
    s = get_settings()
    key = _plugin_key(s)
    reg = _registries.get(key)
    if reg is not None:
        return reg
    if not _lock.acquire(timeout=BUILD_WAIT_S):
        raise RegistryError(
            f"waited {BUILD_WAIT_S:g} s for the provider registry, which another thread is building (now running "
            f"plugin {_in_plugin!r}'s code): a plugin that, while it registers, waits on a thread calling "
            "metal-attn's API waits forever (allowed: registrar.add(...) only, from the hook's own thread)")
    try:
        reg = _registries.get(key)
        if reg is None:
            reg = _registries[key] = build_registry(s)
            _epoch.bump()
        return reg
    finally:
        _lock.release()


def provider_setting_error() -> str | None:
    """Why ``METAL_ATTN_PROVIDER`` (or its alias, named as it is spelled) is unusable: it names no registered
    provider, so every call would fail; ``None`` when it is unset or registered. `check_provider_setting`
    raises it; `metal-attn doctor` reports it."""
    forced = get_settings().provider
    if not forced:
        return None
    registry = get_registry()
    return None if forced in registry.names else registry.unregistered(forced, by_setting=True)


def check_provider_setting() -> None:
    """Raise `SettingsError` when ``METAL_ATTN_PROVIDER`` (or its alias) names no registered provider: every
    call would then fail, so commands check it before loading a model or timing anything."""
    error = provider_setting_error()
    if error is not None:
        raise SettingsError(error)


def reset_registry() -> None:
    """Forget every registry (the next use rebuilds the one it needs)."""
    with _lock:
        _registries.clear()
        _epoch.bump()
