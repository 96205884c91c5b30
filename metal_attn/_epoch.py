"""The dispatch epoch: a value that changes whenever dispatch decisions may change.

Settings changes, registry rebuilds, new providers and kernel failure marks bump the
process-wide counter; an `override_settings` block gives its context (its thread, or its
asyncio task) a scope of its own for the block's duration. Per-call selection caches include
`current()` in their keys, so a cached answer is never reused under other settings, and reading
it is the only cost on the hot path.
"""

from __future__ import annotations

import contextvars
import itertools

_value = [0]
#: The settings scope of this context: 0 outside any `override_settings` block, else a number
#: no other block has used.
_scope: contextvars.ContextVar[int] = contextvars.ContextVar("metal_attn_epoch_scope", default=0)
_scopes = itertools.count(1)


def current() -> tuple[int, int]:
    """The process-wide counter and this context's settings scope."""
    return _value[0], _scope.get()


def bump() -> None:
    _value[0] += 1


def enter_scope() -> contextvars.Token:
    """Give this context a new settings scope (``itertools.count`` is atomic under the GIL)."""
    return _scope.set(next(_scopes))


def exit_scope(token: contextvars.Token) -> None:
    _scope.reset(token)
