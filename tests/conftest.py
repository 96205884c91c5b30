"""Shared fixtures: every test starts from fresh settings, registry and diagnostics."""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.core as mx
import pytest

from metal_attn import diagnostics, log
from metal_attn import settings as settings_mod
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


@pytest.fixture
def clean_settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No METAL_ATTN_/VLLM_METAL_ variable from the outside, settings re-read lazily from the
    (cleaned) environment, and fresh warn-once memory; all restored after the test."""
    for var in list(os.environ):
        if var.upper().startswith(("METAL_ATTN_", "VLLM_METAL_")):
            monkeypatch.delenv(var)
    monkeypatch.setattr(settings_mod, "_current", None)
    monkeypatch.setattr(log, "_warned", set())


@pytest.fixture(scope="session", autouse=True)
def _mlx_cache_limit() -> None:
    """Keep MLX's CPU allocator from unmapping large buffers between tests (KERNELS.md)."""
    mx.set_cache_limit(1 << 31)
