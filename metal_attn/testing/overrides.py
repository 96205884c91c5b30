"""Rule-table overrides for GPU tests and sweeps (not for serving)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def forced_mixed_threshold(value: int) -> Iterator[None]:
    """Patch the mixed-batch split threshold of the tiled prefill kernels (`gpu_common.mixed_split`,
    every backend) to ``value`` for the block: 0 sends every decode row of a mixed batch to the
    per-token kernel, a huge value keeps them in the tiles. Cached selections are dropped on entry
    and exit."""
    from metal_attn.plugins import get_registry
    from metal_attn.providers import gpu_common

    get_registry().forget_selections()
    try:
        with mock.patch.object(gpu_common, "MIXED_DECODE_MIN_CONTEXT",
                               dict.fromkeys(gpu_common.MIXED_DECODE_MIN_CONTEXT, value)):
            yield
    finally:
        get_registry().forget_selections()
