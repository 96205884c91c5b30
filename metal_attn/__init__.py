"""metal-attn: paged attention for MLX, with a registry of pluggable kernel providers.

Public API::

    import metal_attn as ma
    out = ma.paged_attention(q, k_cache, v_cache, block_tables=..., seq_lens=..., cu_seqlens_q=...)
    k_cache, v_cache = ma.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    print(ma.explain(q_lens=[1, 1], seq_lens=[4096, 300], num_heads=32, num_kv_heads=8, head_size=128))
"""

from __future__ import annotations

from metal_attn import _layout, diagnostics, settings
from metal_attn.api import explain, paged_attention, providers, reshape_and_cache
from metal_attn.cache import BlockAllocator, PagedKVCache
from metal_attn.device import DeviceInfo, current_device
from metal_attn.errors import (
    CacheExhaustedError,
    InvalidInputError,
    KernelCompileError,
    MetalAttnError,
    NoProviderError,
    ProviderContractError,
    ProviderRefusedError,
    RegistryError,
    SettingsError,
)
from metal_attn.hookspecs import hookimpl
from metal_attn.metadata import AttentionMetadata
from metal_attn.provider import AttentionInputs, Plan, Provider
from metal_attn.registry import Explanation
from metal_attn.request import AttentionRequest, Phase
from metal_attn.settings import override_settings

_layout.install_checkout_finder()

__version__ = "0.1.0"

__all__ = [
    "AttentionInputs",
    "AttentionMetadata",
    "AttentionRequest",
    "BlockAllocator",
    "CacheExhaustedError",
    "DeviceInfo",
    "Explanation",
    "InvalidInputError",
    "KernelCompileError",
    "MetalAttnError",
    "NoProviderError",
    "PagedKVCache",
    "Phase",
    "Plan",
    "Provider",
    "ProviderContractError",
    "ProviderRefusedError",
    "RegistryError",
    "SettingsError",
    "current_device",
    "diagnostics",
    "explain",
    "hookimpl",
    "override_settings",
    "paged_attention",
    "providers",
    "reshape_and_cache",
    "settings",
]
