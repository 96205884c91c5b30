"""Upstream spellings of the diagnostics API (vllm-metal), for users who know them.

``set_paged_dispatch_diagnostics(True)`` starts recording, ``last_paged_dispatch()``
returns the last route name (``gqa_decode``, ``per_token_ps0``, ...), and
``last_gqa_partition_size()`` the partition size of the last GQA decode dispatch.
"""

from __future__ import annotations

from metal_attn import diagnostics


def set_paged_dispatch_diagnostics(enabled: bool) -> None:
    """Turn the dispatch history on or off (the last dispatch is always kept)."""
    diagnostics.enable_history(enabled)


def last_paged_dispatch() -> str | None:
    """Route name of the last `paged_attention` dispatch, or ``None``."""
    rec = diagnostics.last_dispatch()
    return rec.route if rec else None


def last_gqa_partition_size() -> int | None:
    """Partition size of the last dispatch when it took the ``gqa_decode`` route, else ``None``."""
    rec = diagnostics.last_dispatch()
    if rec is None or rec.route != "gqa_decode":
        return None
    return rec.partition_size
