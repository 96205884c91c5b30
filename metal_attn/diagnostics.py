"""Which provider and route ran, and why: process-wide, cheap when off.

The last dispatch is always kept (one assignment of a record built on the
selection-cache miss). Inside `collect()`, or with ``METAL_ATTN_DIAGNOSTICS=1``,
every dispatch is appended to a list as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchRecord:
    """One dispatch: who ran, by which route, and the fallbacks taken on the way."""

    op: str
    provider: str
    route: str
    partition_size: int
    backend: str
    fallbacks: tuple[tuple[str, str], ...] = ()
    request: object = None


_last: DispatchRecord | None = None
_last_cache_write: DispatchRecord | None = None
_history: list[DispatchRecord] | None = None
#: Whether `enable_history` asked for every dispatch (``METAL_ATTN_DIAGNOSTICS`` asks per dispatch, `record`).
_explicit = False
#: The lists of the `collect` blocks open now (any thread); each gets every dispatch.
_collectors: list[list[DispatchRecord]] = []
_history_lock = threading.Lock()


def record(rec: DispatchRecord, keep: bool = False) -> None:
    """Store ``rec`` as the last dispatch, and append it to the open collections and to the history when
    `enable_history` turned it on or ``keep`` (``METAL_ATTN_DIAGNOSTICS`` in the caller's settings) asks."""
    global _last, _last_cache_write, _history
    if rec.op == "reshape_and_cache":
        _last_cache_write = rec
    else:
        _last = rec
    if keep or _explicit or _collectors:
        with _history_lock:
            if keep or _explicit:
                if _history is None:
                    _history = []
                _history.append(rec)
            for c in _collectors:
                c.append(rec)


def last_dispatch() -> DispatchRecord | None:
    """The most recent `paged_attention` dispatch in this process."""
    return _last


def last_cache_write() -> DispatchRecord | None:
    """The most recent `reshape_and_cache` dispatch in this process."""
    return _last_cache_write


def enable_history(on: bool = True) -> None:
    """Start (or stop and drop) the process-wide history of every dispatch. ``METAL_ATTN_DIAGNOSTICS=1``
    appends the dispatches made while it is set, without this."""
    global _history, _explicit
    with _history_lock:
        _history = [] if on else None
        _explicit = on


def history_enabled() -> bool:
    """Whether every dispatch is appended to the history: `enable_history`, or ``METAL_ATTN_DIAGNOSTICS``
    in this thread's settings."""
    from metal_attn.settings import get_settings

    return _explicit or get_settings().diagnostics


def history() -> list[DispatchRecord]:
    """Dispatches recorded since `enable_history` (empty when off)."""
    return list(_history or ())


@contextlib.contextmanager
def collect() -> Iterator[list[DispatchRecord]]:
    """Collect every dispatch made while the block is open (by any thread: dispatch records are
    process-wide) into the yielded list. Blocks nest and may overlap across threads: each gets what
    happened while it was open, and leaving one never closes or leaks another."""
    mine: list[DispatchRecord] = []
    with _history_lock:
        _collectors.append(mine)
    try:
        yield mine
    finally:
        with _history_lock:
            # By identity: two collections holding the same records compare equal.
            _collectors[:] = [c for c in _collectors if c is not mine]


def reset() -> None:
    """Forget the last dispatch and the history."""
    global _last, _last_cache_write, _history, _explicit
    _last = None
    _last_cache_write = None
    with _history_lock:
        _history = None
        _explicit = False
        _collectors.clear()
