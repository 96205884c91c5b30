"""tests/gpu: what needs a GPU backend (MLX CUDA or Metal). Skipped elsewhere, with the reason."""

from __future__ import annotations

import pytest

from metal_attn.device import detect_backend

GPU_BACKEND = detect_backend()
SKIP_REASON = (
    f"needs an MLX GPU backend (cuda or metal); this process runs on backend={GPU_BACKEND} "
    "(run tests/gpu where MLX has a GPU backend: README.md, 'Installing for a GPU')"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_BACKEND in ("cuda", "metal"):
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("gpu/"):
            item.add_marker(skip)
