"""Command-line arguments the probe scripts in this folder share (not a test)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.bench.shapes import Shape


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


def prefill_suite_shape(pattern: str) -> Shape:
    """The one shape of the ``prefill-gpu`` suite whose label matches ``pattern`` (`Suite.select`'s matching);
    `ValueError` naming the pattern and the labels where none or several match."""
    from metal_attn.bench.suites import get_suite

    suite = get_suite("prefill-gpu")
    hits = suite.select([pattern])
    if len(hits) != 1:
        found = "no shape" if not hits else f"{len(hits)} shapes"
        labels = "; ".join(s.label for s in (hits or suite.shapes))
        raise ValueError(f"--shape {pattern!r} matches {found} of the prefill-gpu suite (allowed: a pattern "
                         f"matching exactly one of: {labels})")
    return hits[0]
