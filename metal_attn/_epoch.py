"""One process-wide counter that changes whenever dispatch decisions may change.

Settings changes, registry rebuilds, new providers and kernel failure marks
bump it; per-call selection caches include it in their keys, so reading it is
the only cost on the hot path.
"""

from __future__ import annotations

_value = [0]


def current() -> int:
    return _value[0]


def bump() -> None:
    _value[0] += 1
