"""Command-line arguments the probe scripts in this folder share (not a test)."""

from __future__ import annotations

import argparse


def decode_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    """``--shapes b8:32:8:128:4096,...`` as (batch, heads, kv heads, head size, context) tuples; the ``b`` is
    optional. Refuses a malformed item or a field below 1."""
    try:
        out = tuple(tuple(int(x) for x in item.removeprefix("b").split(":")) for item in text.split(","))
    except ValueError:
        out = ()
    if not out or any(len(s) != 5 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"--shapes={text!r} (allowed: batch:heads:kv_heads:head_size:context, "
                                         "comma-separated, every field at least 1)")
    return out
