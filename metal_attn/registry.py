"""The provider registry: priority order, admission, explanations, fallbacks.

Built once per process from the plugins (`metal_attn.plugins`). The per-call
path is plain Python: selection results are cached by request, and hooks run
only at start-up and on cache misses.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metal_attn import _epoch
from metal_attn.checks import is_int
from metal_attn.constants import DTYPES
from metal_attn.device import BACKENDS, DeviceInfo
from metal_attn.errors import KernelCompileError, NoProviderError, ProviderRefusedError, RegistryError
from metal_attn.log import get_logger, warn_once
from metal_attn.provider import Plan, Provider, reason_list
from metal_attn.request import AttentionRequest, Phase
from metal_attn.settings import Settings

_log = get_logger()


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where a provider came from."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.distribution:
            return f"{self.distribution} {self.version or ''}".strip() + f" ({self.plugin})"
        return self.plugin


@dataclasses.dataclass(frozen=True, slots=True)
class ProviderEntry:
    provider: Provider
    origin: Origin


class ProviderRegistrar:
    """What a plugin's ``metal_attn_register_providers`` hook receives.

    Its `add` calls are staged and reach the registry together, once the hook has returned
    (`commit`): a hook that raises, or one of whose providers is refused, registers nothing.
    """

    def __init__(self, registry: Registry, origin: Origin) -> None:
        self._registry = registry
        self._origin = origin
        self._staged: list[Provider] = []

    def add(self, provider: Provider | type[Provider]) -> None:
        """Register one provider (an instance, or a class with a no-argument constructor)."""
        if isinstance(provider, type):
            if not issubclass(provider, Provider):
                raise RegistryError(f"{provider!r} is not a metal_attn.Provider subclass")
            try:
                inspect.signature(provider).bind()
            except TypeError as exc:  # only a constructor that needs arguments; one that raises inside raises here
                raise RegistryError(f"registrar.add({provider.__qualname__}) builds the provider with no arguments, "
                                    f"but its constructor needs some ({exc}; allowed: a class whose constructor "
                                    "takes none, or an instance: registrar.add(MyProvider(...)))") from None
            except ValueError:  # no signature to read (a C type): let the call say
                pass
            provider = provider()
        self._registry.check_declaration(provider, [p.name for p in self._staged])  # raises here, as documented
        self._staged.append(provider)

    def commit(self) -> None:
        """Add every staged provider, or none (`Registry.add_all`)."""
        staged, self._staged = self._staged, []
        self._registry.add_all(staged, origin=self._origin)


@dataclasses.dataclass(frozen=True)
class ExplainRow:
    """One provider's line in an explanation."""

    name: str
    priority: int
    origin: str
    admitted: bool
    reasons: tuple[str, ...]
    plan: Plan | None = None
    chosen: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "priority": self.priority,
            "origin": self.origin,
            "admitted": self.admitted,
            "chosen": self.chosen,
            "reasons": list(self.reasons),
            "plan": dataclasses.asdict(self.plan) if self.plan else None,
        }


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The whole decision table for one request on one device."""

    request: AttentionRequest
    device: DeviceInfo
    rows: tuple[ExplainRow, ...]
    forced: str | None = None

    @property
    def chosen(self) -> ExplainRow | None:
        return next((r for r in self.rows if r.chosen), None)

    def __str__(self) -> str:
        lines = [repr(self.request), f"device: {self.device.describe()}"]
        if self.forced:
            lines.append(f"forced provider: {self.forced}")
        for r in self.rows:
            mark = "->" if r.chosen else ("ok" if r.admitted else "no")
            lines.append(f"  {mark} {r.name} (priority {r.priority}, from {r.origin})")
            for reason in r.reasons:
                lines.append(f"       - {reason}")
            if r.plan is not None and r.admitted:
                lines.append(f"       plan: {r.plan.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": dataclasses.asdict(self.request) | {"phase": self.request.phase.value},
            "device": dataclasses.asdict(self.device),
            "forced": self.forced,
            "chosen": self.chosen.name if self.chosen else None,
            "providers": [r.to_dict() for r in self.rows],
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """The registry's answer: who runs, how, and which fallbacks were taken."""

    provider: Provider
    plan: Plan
    fallbacks: tuple[tuple[str, str], ...] = ()


#: What a provider's declaration may hold (`Provider`'s class attributes), besides name, priority and backends.
_FEATURES = frozenset({"sinks", "sliding_window", "softcap"})


def _declaration_problem(provider: Provider) -> str | None:
    """Why ``provider``'s declared phases, dtypes, head and block sizes, features or flags cannot be read
    (None when they can): each a set of the allowed values (``None`` for any, where that is allowed)."""
    phases = {ph.value for ph in Phase}

    def a_set(value: Any, allowed: Any = None, ints: bool = False) -> bool:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (set, frozenset, tuple, list)):
            return False
        if ints:
            return all(is_int(x) and x > 0 for x in value)
        return all(isinstance(x, str) and (allowed is None or x in allowed) for x in value)

    checks = (
        ("phases", provider.phases, a_set(provider.phases, phases), f"a set of {sorted(phases)}"),
        ("dtypes", provider.dtypes, provider.dtypes is None or a_set(provider.dtypes, DTYPES),
         f"a set of dtype names from {list(DTYPES)}, or None for any"),
        ("head_sizes", provider.head_sizes, provider.head_sizes is None or a_set(provider.head_sizes, ints=True),
         "a set of positive ints, or None for any"),
        ("block_sizes", provider.block_sizes, provider.block_sizes is None or a_set(provider.block_sizes, ints=True),
         "a set of positive ints, or None for any"),
        ("features", provider.features, a_set(provider.features, _FEATURES), f"a set of {sorted(_FEATURES)}"),
    )
    for attr, value, ok, allowed in checks:
        if not ok:
            return f"{attr}={value!r} (allowed: {allowed})"
    for flag in ("mixed_dtypes", "writes_cache", "reads_lengths_on_device"):
        if not isinstance(getattr(provider, flag), bool):
            return f"{flag}={getattr(provider, flag)!r} (allowed: True or False)"
    return None


class Registry:
    """Providers in priority order, with admission, selection and explanation."""

    def __init__(self, *, on_selected: Callable[..., None] | None = None) -> None:
        self._entries: dict[str, ProviderEntry] = {}
        self._ordered: tuple[ProviderEntry, ...] = ()
        self._by_backend: dict[str, tuple[ProviderEntry, ...]] = {b: () for b in BACKENDS}
        self._failed: dict[tuple[str, tuple], str] = {}
        self._prepared: set[tuple[str, tuple]] = set()
        self._avail_cache: dict[tuple[str, DeviceInfo], tuple[str, ...]] = {}
        self._cache: OrderedDict[tuple, Selection] = OrderedDict()
        self._cache_size = 4096
        self._lock = threading.RLock()
        self._on_selected = on_selected
        #: Plugins that failed to load or register: name -> error text.
        self.load_errors: dict[str, str] = {}

    # -- building ----------------------------------------------------------------------------

    def add(self, provider: Provider, *, origin: Origin | None = None) -> None:
        """Register ``provider``; raises `RegistryError` on a bad or duplicate declaration."""
        with self._lock:
            self.check_declaration(provider)
            self._entries[provider.name] = ProviderEntry(provider, origin or Origin("direct"))
            self._reorder()

    def check_declaration(self, provider: Provider, staged: Sequence[str] = ()) -> None:
        """Raise `RegistryError` if ``provider`` could not be added: not a Provider, a bad name,
        priority or backends, or a name already registered (or among ``staged``, names about to be)."""
        if not isinstance(provider, Provider):
            raise RegistryError(f"{provider!r} is not a metal_attn.Provider")
        name = provider.name
        if not isinstance(name, str) or not name.isidentifier():
            raise RegistryError(f"provider name={name!r} must be a non-empty identifier")
        if type(provider.priority) is not int:
            raise RegistryError(f"provider {name!r}: priority={provider.priority!r} must be an int")
        if (isinstance(provider.backends, (str, bytes)) or not provider.backends
                or not set(provider.backends) <= set(BACKENDS)):
            raise RegistryError(
                f"provider {name!r}: backends={provider.backends!r} "
                "(allowed: a non-empty set of metal, cuda, cpu, e.g. frozenset({'cpu'}))"
            )
        bp = provider.backend_priority
        if not isinstance(bp, Mapping) or any(
            b not in provider.backends or type(v) is not int for b, v in bp.items()
        ):
            raise RegistryError(
                f"provider {name!r}: backend_priority={bp!r} (allowed: a mapping from its backends "
                f"{sorted(provider.backends)} to int priorities)"
            )
        problem = _declaration_problem(provider)
        if problem:
            raise RegistryError(f"provider {name!r}: {problem}")
        clash = next((n for n in self._entries if n.casefold() == name.casefold() and n != name), None)
        if clash is not None:
            raise RegistryError(f"provider name={name!r} differs from the registered {clash!r} only by case "
                                "(names must be told apart in settings and on the command line)")
        if name in self._entries:
            prev = self._entries[name].origin.describe()
            raise RegistryError(f"provider name={name!r} is already registered (by {prev})")
        if name in staged:
            raise RegistryError(f"provider name={name!r} is added twice by this plugin")

    def _reorder(self) -> None:
        """Rebuild the priority orders after the providers changed (the lock is held)."""
        self._ordered = tuple(sorted(self._entries.values(), key=lambda e: (-e.provider.priority, e.provider.name)))
        self._by_backend = {b: tuple(sorted(self._ordered, key=lambda e, b=b: (-e.provider.priority_on(b),
                                                                            e.provider.name)))
                            for b in BACKENDS}
        self._invalidate()

    def add_all(self, providers: Sequence[Provider], *, origin: Origin | None = None) -> None:
        """`add` each of ``providers``, or none of them: on the first refusal the ones already added
        are taken out again and the `RegistryError` is raised."""
        with self._lock:
            added: list[str] = []
            try:
                for provider in providers:
                    self.add(provider, origin=origin)
                    added.append(provider.name)
            except Exception:
                for name in added:
                    del self._entries[name]
                self._reorder()
                raise

    def _invalidate(self) -> None:
        """Providers changed: drop cached answers and tell per-call caches (`metal_attn._epoch`)."""
        self._cache.clear()
        self._avail_cache.clear()
        _epoch.bump()

    def forget_selections(self) -> None:
        """Drop every cached selection, so the next calls re-run admission and planning (after a
        rule table changed at run time: calibration, tests)."""
        with self._lock:
            self._invalidate()

    @property
    def entries(self) -> tuple[ProviderEntry, ...]:
        """Providers in declared priority order (highest first)."""
        return self._ordered

    @property
    def names(self) -> list[str]:
        """The registered providers' names, in declared priority order (what "registered: ..." lists)."""
        return [e.provider.name for e in self._ordered]

    def ordered(self, backend: str) -> tuple[ProviderEntry, ...]:
        """Providers in their priority order on ``backend`` (`Provider.priority_on`, highest first):
        the order `explain` and selection ask them in."""
        return self._by_backend.get(backend, self._ordered)

    def get(self, name: str) -> Provider:
        try:
            return self._entries[name].provider
        except KeyError:
            raise ProviderRefusedError(
                f"provider={name!r} is not registered "
                f"(registered: {', '.join(self.names) or 'none'})"
            ) from None

    # -- admission -----------------------------------------------------------------------------

    def availability_reasons(self, provider: Provider, device: DeviceInfo) -> tuple[str, ...]:
        key = (provider.name, device)
        got = self._avail_cache.get(key)
        if got is None:
            try:
                got = tuple(reason_list(provider.availability_reasons(device), "availability_reasons"))
            except Exception as exc:
                got = (f"availability check raised {type(exc).__name__}: {exc}",)
            self._avail_cache[key] = got
        return got

    def _reasons(
        self, provider: Provider, request: AttentionRequest, device: DeviceInfo, settings: Settings
    ) -> list[str]:
        try:
            reasons = list(provider.not_supported_reasons(request, device, settings))
        except Exception as exc:  # a plugin's bug: passed over like a refusal, and logged once (as a failed plan)
            reason = f"admission check raised {type(exc).__name__}: {exc}"
            warn_once("provider_admission_failed", (provider.name, reason), provider=provider.name, reason=reason)
            return [reason]
        if not reasons and self._failed:  # a plan only matters here if some specialization failed
            plan, failure = self._plan(provider, request, device, settings)
            if failure is not None:
                return [failure]
            failed = self._failed.get((provider.name, plan.specialization))
            if failed is not None:
                reasons.append(f"kernel specialization {plan.specialization} failed to build: {failed}")
        return reasons

    @staticmethod
    def _plan(
        provider: Provider, request: AttentionRequest, device: DeviceInfo, settings: Settings
    ) -> tuple[Plan, None] | tuple[None, str]:
        """``provider.plan(...)``, or the reason it gave no plan: an admitted provider whose plan
        raises (or is not a `Plan`) is passed over like a refusing one, and logged once."""
        try:
            plan = provider.plan(request, device, settings)
        except Exception as exc:
            reason = f"plan() raised {type(exc).__name__}: {exc}"
        else:
            if not isinstance(plan, Plan):
                reason = f"plan() returned {type(plan).__name__}, not a metal_attn.Plan"
            elif (problem := plan.problem()) is not None:
                reason = f"plan() returned a Plan with {problem}"
            else:
                return plan, None
        warn_once("provider_plan_failed", (provider.name, reason), provider=provider.name, reason=reason)
        return None, reason

    def explain(
        self, request: AttentionRequest, device: DeviceInfo, settings: Settings, *, forced: str | None = None
    ) -> Explanation:
        """Every provider in priority order, admitted or not, with reasons and plans."""
        by_setting = not forced and bool(settings.provider)
        forced = forced or settings.provider
        if forced:
            entries = [self._entries[forced]] if forced in self._entries else []
        else:
            entries = list(self.ordered(device.backend))
        rows: list[ExplainRow] = []
        chosen_done = False
        for e in entries:
            p = e.provider
            reasons = self._reasons(p, request, device, settings)
            plan = None
            if not reasons:
                plan, failure = self._plan(p, request, device, settings)
                if failure is not None:
                    reasons = [failure]
            chosen = not reasons and not chosen_done
            chosen_done = chosen_done or chosen
            rows.append(ExplainRow(p.name, p.priority_on(device.backend), e.origin.describe(), not reasons,
                                   tuple(reasons), plan, chosen))
        if forced and forced not in self._entries:
            rows.append(ExplainRow(forced, 0, "-", False, (self.unregistered(forced, by_setting),)))
        return Explanation(request, device, tuple(rows), forced)

    def unregistered(self, name: str, by_setting: bool) -> str:
        """Why the forced provider ``name`` cannot run: no provider has that name; said as the user set it
        (``METAL_ATTN_PROVIDER`` or its alias, as spelled, when ``by_setting``; else the ``provider=``
        argument)."""
        registered = ", ".join(self.names) or "none"
        if by_setting:
            from metal_attn.settings import set_by

            return (f"{set_by('provider') or 'METAL_ATTN_PROVIDER'}={name!r} names no registered provider (allowed: "
                    f"{registered}, or unset for the registry's choice)")
        return f"provider={name!r} is not registered (registered: {registered})"

    # -- selection -----------------------------------------------------------------------------

    def select(
        self, request: AttentionRequest, device: DeviceInfo, settings: Settings, *, forced: str | None = None
    ) -> Selection:
        """The first admitted provider (or the forced one), its plan, and the fallbacks taken."""
        if not forced and settings.provider:
            forced = settings.provider
            if forced not in self._entries:  # named as the user set it, not as a `provider=` argument
                raise ProviderRefusedError(self.unregistered(forced, by_setting=True))
        key = (request, device, settings, forced)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with self._lock:
            selection = self._select_uncached(request, device, settings, forced)
            self._cache[key] = selection
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return selection

    def _select_uncached(
        self, request: AttentionRequest, device: DeviceInfo, settings: Settings, forced: str | None
    ) -> Selection:
        if forced:
            p = self.get(forced)
            reasons = self._reasons(p, request, device, settings)
            if reasons:
                raise ProviderRefusedError(
                    f"the forced provider {forced!r} refuses this request:\n"
                    + str(self.explain(request, device, settings, forced=forced))
                )
            plan, failure = self._plan(p, request, device, settings)
            if failure is not None:
                raise ProviderRefusedError(f"the forced provider {forced!r} gave no plan: {failure}")
            try:
                self._prepare(p, plan, device)
            except KernelCompileError as exc:
                raise ProviderRefusedError(
                    f"the forced provider {forced!r} failed to build kernel {plan.specialization}: {exc}"
                ) from exc
            self._notify(request, p, plan, {})
            return Selection(p, plan)
        fallbacks: list[tuple[str, str]] = []
        refused: dict[str, list[str]] = {}
        for e in self.ordered(device.backend):
            p = e.provider
            reasons = self._reasons(p, request, device, settings)
            if reasons:
                refused[p.name] = reasons
                continue
            plan, failure = self._plan(p, request, device, settings)
            if failure is not None:
                fallbacks.append((p.name, failure))
                refused[p.name] = [failure]
                continue
            try:
                self._prepare(p, plan, device)
            except KernelCompileError as exc:
                reason = f"kernel specialization {plan.specialization} failed to build: {exc}"
                fallbacks.append((p.name, reason))
                refused[p.name] = [reason]
                continue
            _log.debug("provider_selected", provider=p.name, route=plan.route, request=repr(request))
            self._notify(request, p, plan, refused)
            return Selection(p, plan, tuple(fallbacks))
        empty = self.nothing_registered(settings)
        raise NoProviderError(f"no provider admits this request: {empty}" if empty else
                              "no provider admits this request:\n" + str(self.explain(request, device, settings)))

    def _prepare(self, p: Provider, plan: Plan, device: DeviceInfo) -> None:
        key = (p.name, plan.specialization)
        if key in self._prepared:
            return
        try:
            p.prepare(plan, device)
        except KernelCompileError as exc:
            self.mark_failed(p.name, plan.specialization, str(exc))
            raise
        except Exception as exc:  # a provider's bug: its kernel is as unusable as one that failed to build
            reason = f"prepare() raised {type(exc).__name__}: {exc}"
            self.mark_failed(p.name, plan.specialization, reason)
            raise KernelCompileError(reason) from exc
        self._prepared.add(key)

    def mark_failed(self, provider: str, specialization: tuple, reason: str) -> None:
        """Mark one kernel specialization of ``provider`` unavailable (warns once)."""
        self._failed[(provider, specialization)] = reason
        warn_once(
            "kernel_unavailable",
            (provider, specialization),
            provider=provider,
            specialization=str(specialization),
            reason=reason,
        )
        self._cache.clear()  # availability is unaffected by a kernel failure
        _epoch.bump()

    def failures(self) -> dict[tuple[str, tuple], str]:
        """Kernel specializations marked unavailable, with their reasons."""
        return dict(self._failed)

    def _notify(self, request: AttentionRequest, p: Provider, plan: Plan, refused: dict[str, list[str]]) -> None:
        """Tell the ``metal_attn_provider_selected`` observers; one that raises is logged (once per
        error) and the call goes on: an observer's bug must not fail attention."""
        if self._on_selected is None:
            return
        try:
            self._on_selected(request=request, provider=p.name, route=plan.route, reasons=refused)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            warn_once("provider_selected_observer_failed", (reason,), provider=p.name, reason=reason)

    # -- cache writers ---------------------------------------------------------------------------

    def select_cache_writer(self, dtype: str, device: DeviceInfo, settings: Settings) -> Provider:
        """The highest-priority provider that can write a ``dtype`` cache on ``device`` (not cached
        here: `metal_attn.api` keeps the answer per dispatch epoch)."""
        table = []
        for e in self.ordered(device.backend):
            try:
                reasons = list(e.provider.cache_write_reasons(dtype, device, settings))
            except Exception as exc:
                reasons = [f"cache_write_reasons() raised {type(exc).__name__}: {exc}"]
            if not reasons:
                return e.provider
            table.append(f"  no {e.provider.name}: " + "; ".join(reasons))
        empty = self.nothing_registered(settings)
        raise NoProviderError(
            f"no provider implements reshape_and_cache for dtype={dtype} on {device.describe()}:"
            + (f" {empty}" if empty else "\n" + "\n".join(table))
        )

    def nothing_registered(self, settings: Settings) -> str | None:
        """Why this registry holds no provider at all (the plugin settings that may have left them out), or None."""
        if self._entries:
            return None
        chosen = [f"METAL_ATTN_PLUGINS_DENY={','.join(settings.plugins_deny)}"] if settings.plugins_deny else []
        if settings.plugins_allow is not None:
            chosen.append(f"METAL_ATTN_PLUGINS_ALLOW={','.join(settings.plugins_allow)}")
        if not settings.plugin_autoload:
            chosen.append("METAL_ATTN_PLUGIN_AUTOLOAD=0")
        why = f"no plugin registered one under {' and '.join(chosen)}" if chosen else "no plugin registered one"
        return f"no provider is registered ({why}; `metal-attn doctor` lists the plugins and their load errors)"
