"""A second example metal-attn plugin: `GatherDecodeProvider`, written from metal-attn's README.

metal-attn finds this module through the entry point ``example_decode`` in the group
``metal_attn.providers`` (``pyproject.toml``) and calls its registrar hook once, when the provider
registry is built.
"""

from __future__ import annotations

from metal_attn import hookimpl
from metal_attn_example_decode.provider import GatherDecodeProvider

__all__ = ["GatherDecodeProvider", "metal_attn_register_providers"]
__version__ = "0.1.0"


@hookimpl
def metal_attn_register_providers(registrar) -> None:
    """Add this package's provider to metal-attn's registry."""
    registrar.add(GatherDecodeProvider)
