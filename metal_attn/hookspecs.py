"""Hook specifications of metal-attn (pluggy project name ``metal_attn``).

Hooks are few and coarse. They run at start-up and when the plugin set
changes, never per call. A plugin module or object implements them with the
`metal_attn.hookimpl` marker and is found through the entry-point group
``metal_attn.providers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.registry import ProviderRegistrar
    from metal_attn.request import AttentionRequest

PROJECT_NAME = "metal_attn"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def metal_attn_register_providers(registrar: ProviderRegistrar) -> None:
    """Add this plugin's providers.

    :param registrar: call ``registrar.add(provider)`` once per provider (a
        `metal_attn.Provider` instance or class). The registrar validates as it
        goes: duplicate names and non-integer priorities raise `RegistryError`.

    Every implementation is called each time a registry is built: once per
    process for each plugin-loading configuration (``METAL_ATTN_PLUGIN_AUTOLOAD``,
    ``METAL_ATTN_PLUGINS_ALLOW`` / ``_DENY``, as `override_settings` may change
    them), and again after `metal_attn.plugins.reset_registry`; so it must not
    count on running once. Return value: none. An exception raised here is
    logged with the plugin's name and the plugin's providers are left out; the
    other plugins keep working. It must not call metal-attn's API, which needs
    the registry being built (that raises `RegistryError` and leaves the plugin
    out).
    """


@hookspec
def metal_attn_provider_selected(request: AttentionRequest, provider: str, route: str, reasons: dict) -> None:
    """Observe a selection decision.

    Called when the registry selects a provider for a request it has not seen
    (a selection-cache miss), never per call.

    :param request: the `AttentionRequest` that was decided.
    :param provider: the chosen provider's name.
    :param route: the chosen plan's route name.
    :param reasons: ``{provider name: [reasons]}`` of every provider ranked above the chosen one.

    Every implementation is called; return values are ignored.
    """
