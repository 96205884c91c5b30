"""The built-in providers of metal-attn (installed as ``metal_attn.providers``).

This module is the built-in plugin: the entry point ``builtin`` in the group
``metal_attn.providers`` points here, the same road a third-party package takes.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from metal_attn.hookspecs import hookimpl
from metal_attn.registry import ProviderRegistrar

#: Every built-in provider, as "module:Class" (priorities live on the classes).
BUILTIN_PROVIDERS: tuple[str, ...] = (
    "metal_attn.providers.reference:ReferenceProvider",
    "metal_attn.providers.classic:ClassicProvider",
    "metal_attn.providers.gqa_decode:GQADecodeProvider",
    "metal_attn.providers.tiled_prefill:TiledPrefillProvider",
    "metal_attn.providers.sdpa_prefill:SdpaPrefillProvider",
    "metal_attn.providers.nax_prefill:NaxPrefillProvider",
)


@hookimpl
def metal_attn_register_providers(registrar: ProviderRegistrar) -> None:
    """Register every built-in provider."""
    for spec in BUILTIN_PROVIDERS:
        module, _, cls = spec.partition(":")
        registrar.add(getattr(importlib.import_module(module), cls)())


class _ProvidersModule(types.ModuleType):
    """``metal_attn.providers`` is this package *and* the inventory function:
    importing the package replaces the attribute ``metal_attn.providers``, so the
    package itself answers ``metal_attn.providers()`` (see `metal_attn.api.providers`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        from metal_attn.api import providers

        return providers(*args, **kwargs)


sys.modules[__name__].__class__ = _ProvidersModule
