"""The attention hook: route mlx-lm attention whose cache is ours to `paged_attention`.

mlx-lm's model modules do ``from .base import scaled_dot_product_attention``, so
rebinding the name in ``mlx_lm.models.base`` alone reaches none of them: the
hook rebinds it in each served module. Calls whose ``cache`` is a `HookedCache`
go to the cache's ``attend`` (which calls `paged_attention`); every other call
goes, unchanged, to the function that was bound before. gemma2 computes its
attention inline, so there the hook wraps ``Attention.__call__`` the same way.

Installing is explicit and idempotent (`install`, `uninstall`, `installed`), never
a side effect of ``import metal_attn``. `metal_attn.mlx_lm.PagedModel` installs it
for the modules its model needs.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from metal_attn.errors import InvalidInputError
from metal_attn.mlx_lm.architectures import ARCHITECTURES, attention_modules
from metal_attn.mlx_lm.layer_cache import HookedCache

__all__ = ["install", "installed", "is_installed", "uninstall"]

_SDPA = "scaled_dot_product_attention"
_ORIGINAL = "__metal_attn_original__"
_lock = threading.RLock()


def _sdpa_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, HookedCache):
            return cache.attend(queries, scale=scale, sinks=sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _ORIGINAL, original)
    scaled_dot_product_attention.__doc__ = "mlx-lm's attention, routed to metal-attn when the cache is paged."
    return scaled_dot_product_attention


def _gemma2_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """gemma2's ``Attention.__call__`` with the scores' soft cap handed to `paged_attention`."""

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, HookedCache):
            return original(self, x, mask, cache)
        b, length, _ = x.shape
        queries = self.q_proj(x).reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        cache.update_and_fetch(keys, values)
        out = cache.attend(queries, scale=self.scale, softcap=self.attn_logit_softcapping)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    setattr(__call__, _ORIGINAL, original)
    return __call__


def _targets(module_name: str) -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """``(owner, attribute, make_hook)`` for one served module."""
    module = importlib.import_module(module_name)
    arch = ARCHITECTURES.get(module_name.rsplit(".", 1)[-1])
    if arch is not None and arch.attention == "gemma2":
        return [(module.Attention, "__call__", _gemma2_hook)]
    if hasattr(module, _SDPA):
        return [(module, _SDPA, _sdpa_hook)]
    return []


def _served_modules(modules: Iterable[str] | None) -> list[str]:
    """``modules``, or every module whose attention a served architecture runs; anything else is refused
    (a module no served architecture runs would be "installed" with nothing hooked)."""
    served = list(dict.fromkeys(m for name in ARCHITECTURES for m in attention_modules(name)))
    if modules is None:
        return served
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise InvalidInputError(f"modules={modules!r} (allowed: a list of module names such as "
                                f"[{served[0]!r}], or None for every served one)")
    names = list(dict.fromkeys(modules))
    unknown = [m for m in names if m not in served]
    if unknown:
        raise InvalidInputError(f"modules holds {unknown[0]!r}, which no served architecture runs (allowed: "
                                f"{', '.join(served)})")
    return names


def install(modules: Iterable[str] | None = None) -> None:
    """Install the hook in ``modules`` (``mlx_lm.models.*`` names; default: every served one). Idempotent."""
    with _lock:
        for name in _served_modules(modules):
            for owner, attr, make in _targets(name):
                current = getattr(owner, attr)
                if not hasattr(current, _ORIGINAL):
                    setattr(owner, attr, make(current))


def uninstall(modules: Iterable[str] | None = None) -> None:
    """Put back what `install` replaced (default: in every served module). Idempotent."""
    with _lock:
        for name in _served_modules(modules):
            for owner, attr, _ in _targets(name):
                current = getattr(owner, attr)
                if hasattr(current, _ORIGINAL):
                    setattr(owner, attr, getattr(current, _ORIGINAL))


def is_installed(modules: Iterable[str] | None = None) -> bool:
    """Whether the hook is in place in every one of ``modules`` (default: every served one)."""
    return all(
        hasattr(getattr(owner, attr), _ORIGINAL)
        for name in _served_modules(modules)
        for owner, attr, _ in _targets(name)
    )


@contextlib.contextmanager
def installed(modules: Iterable[str] | None = None) -> Iterator[None]:
    """Install the hook for the block; on exit, uninstall what this block installed."""
    with _lock:
        names = _served_modules(modules)
        fresh = [n for n in names if not is_installed([n])]
        install(names)
    try:
        yield
    finally:
        uninstall(fresh)
