"""Shared fixtures: every test starts from fresh settings, registry and diagnostics."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from metal_attn import diagnostics
from metal_attn.plugins import reset_registry
from metal_attn.settings import Settings, override_settings


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[Settings]:
    """Isolate global state: settings changes made inside a test are undone, the provider
    registry is rebuilt on first use, and the dispatch record and history are empty."""
    reset_registry()
    diagnostics.reset()
    with override_settings() as settings:
        yield settings
    reset_registry()
    diagnostics.reset()


@pytest.fixture(scope="session", autouse=True)
def _mlx_cache_limit() -> None:
    """Keep MLX's CPU allocator from unmapping large buffers between tests (KERNELS.md)."""
    mx.set_cache_limit(1 << 31)
