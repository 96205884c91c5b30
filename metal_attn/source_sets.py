"""The source checks' sets, gathered from the registered providers.

`metal_attn.msl_check` and `metal_attn.cuda_check` never name a provider: each asks every
provider in the registry (built-in and third-party alike) for its entries through the optional
`Provider.msl_specializations` / `Provider.cuda_sources` methods, or only the providers named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.registry import Registry

#: The provider methods that declare a source check's entries.
KINDS = ("msl_specializations", "cuda_sources")


def provider_sets(kind: str, providers: Sequence[str] | None = None,
                  registry: Registry | None = None) -> list[Any]:
    """The entries of ``kind`` (one of `KINDS`) of every provider of ``registry`` (default: the
    process's), or of the ``providers`` named, providers in name order.

    Raises `ProviderRefusedError` for a name that is not registered and `ValueError` when two
    entries share a label (the checks report and filter by label).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} (allowed: {', '.join(KINDS)})")
    if registry is None:
        from metal_attn.plugins import get_registry

        registry = get_registry()
    chosen = ([registry.get(n) for n in dict.fromkeys(providers)] if providers
              else [e.provider for e in registry.entries])
    out: list[Any] = []
    owner: dict[str, str] = {}
    for provider in sorted(chosen, key=lambda p: p.name):
        entries = getattr(provider, kind)()
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"{kind}() of provider {provider.name!r} returned {entries!r} (allowed: a list of "
                             "entries, empty for none)")
        for entry in entries:
            if entry.label in owner:
                raise ValueError(f"{kind}: label={entry.label!r} of provider {provider.name!r} is already "
                                 f"declared by provider {owner[entry.label]!r} (labels must be unique)")
            owner[entry.label] = provider.name
            out.append(entry)
    return out
