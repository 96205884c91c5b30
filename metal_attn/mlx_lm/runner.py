"""`PagedModel`: an unmodified mlx-lm model bound to paged K/V pools.

One call of `PagedModel.forward` runs one scheduler step: the step's tokens of
every sequence packed as a ``[T, 1]`` batch (one token per row, no padding), K/V
written into pages, attention through `paged_attention` with the step's
metadata, and the LM head only on the rows whose logits are sampled.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_attn.api import dtype_name
from metal_attn.cache import PagedKVCache, StepPlan
from metal_attn.errors import InvalidInputError, ModelError
from metal_attn.host_arrays import device_array
from metal_attn.mlx_lm import hook
from metal_attn.mlx_lm.architectures import ResolvedModel, resolve
from metal_attn.mlx_lm.layer_cache import LayerGeometry, PagedLayerCache, ProbeCache

__all__ = ["ModelShape", "PagedModel", "array_slots", "inspect_model", "model_lock", "probe_geometry"]


def probe_geometry(model: nn.Module, resolved: ResolvedModel | None = None) -> list[LayerGeometry]:
    """Each layer's attention geometry, from a lazy one-token forward that is never evaluated.

    Raises `ModelError` when a layer writes K/V but its attention does not reach the
    hook (or the reverse): such a model would be served wrongly, so it is refused.
    """
    resolved = resolved or resolve(model)
    hook.install(resolved.attention_modules)
    probes = [ProbeCache() for _ in range(resolved.num_layers)]
    resolved.arch.text_model(model).model(mx.zeros((1, 1), dtype=mx.int32), probes)
    out = []
    for i, p in enumerate(probes):
        if p.writes != 1 or p.attends != 1 or p.geometry is None:
            raise ModelError(
                f"model_type={resolved.model_type!r}: layer {i} called update_and_fetch {p.writes} time(s) and "
                f"reached the attention hook {p.attends} time(s) in one step (need exactly 1 and 1); its attention "
                "does not go through the paged path, so the model is not served"
            )
        out.append(p.geometry)
    return out


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the paged path needs to know of a model before any pool exists."""

    resolved: ResolvedModel
    #: The K/V geometry every layer shares.
    geometry: LayerGeometry

    def block_bytes(self, block_size: int) -> int:
        """Bytes one page of ``block_size`` tokens takes over all layers (K and V), for pool sizing."""
        g = self.geometry
        return 2 * self.resolved.num_layers * block_size * g.num_kv_heads * g.head_size * g.dtype.size


def inspect_model(model: nn.Module) -> ModelShape:
    """Check ``model`` (`resolve`), install its hook, and read its geometry with one lazy probe."""
    resolved = resolve(model)
    layers = probe_geometry(model, resolved)
    first = layers[0]
    for i, g in enumerate(layers):
        if (g.num_kv_heads, g.head_size, g.dtype) != (first.num_kv_heads, first.head_size, first.dtype):
            raise ModelError(
                f"layer {i} has (kv_heads, head_size, dtype)=({g.num_kv_heads}, {g.head_size}, "
                f"{dtype_name(g.dtype)}) but layer 0 has ({first.num_kv_heads}, {first.head_size}, "
                f"{dtype_name(first.dtype)}): one paged pool needs one K/V geometry for every layer"
            )
    return ModelShape(resolved, first)


class PagedModel:
    """An mlx-lm model served on a `PagedKVCache` (built here unless ``kv_cache`` is given).

    Construction checks the architecture (`resolve`), installs the attention hook for
    the modules it needs, and reads each layer's geometry with a lazy probe, before
    any pool is allocated (`inspect_model`; pass its ``shape`` when you already have it).
    ``num_blocks`` pages of ``block_size`` tokens (default 16) per layer; or ``kv_cache``, which
    brings its own pages (``num_blocks`` and ``block_size`` are then left out, or equal its own).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_cache: PagedKVCache | None = None,
        shape: ModelShape | None = None,
    ) -> None:
        _check_pool_arguments(num_blocks, block_size, kv_cache)
        self.model = model
        shape = shape or inspect_model(model)
        self.resolved, self.geometry = shape.resolved, shape.geometry
        g = self.geometry
        if kv_cache is None:
            kv_cache = PagedKVCache(self.resolved.num_layers, num_blocks, 16 if block_size is None else block_size,
                                    g.num_kv_heads, g.head_size, g.dtype)
        else:
            want = (self.resolved.num_layers, g.num_kv_heads, g.head_size, g.dtype)
            have = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_size, kv_cache.dtype)
            if have != want:
                raise InvalidInputError(
                    f"kv_cache has (layers, kv_heads, head_size, dtype)={_show(have)} but the model needs {_show(want)}"
                )
        self.kv = kv_cache
        self._text = self.resolved.arch.text_model(model)
        self._head = self.resolved.arch.head
        self.caches = [PagedLayerCache(self.kv, i, spec.sliding_window) for i, spec in enumerate(self.resolved.layers)]

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"PagedModel({self.resolved.model_type}, layers={self.resolved.num_layers}, heads={g.num_heads}/"
            f"{g.num_kv_heads}, head_size={g.head_size}, dtype={dtype_name(g.dtype)}, {self.kv!r})"
        )

    @property
    def vocab_size(self) -> int:
        return int(self._text.model.embed_tokens.weight.shape[0])

    def forward(self, plan: StepPlan, tokens: mx.array | Sequence[int] | np.ndarray,
                logit_rows: Sequence[int] | mx.array | None = None) -> mx.array:
        """Logits ``[len(logit_rows), vocab]`` (lazy) for one step.

        ``tokens``: ``[plan.num_tokens]`` int ids in the plan's row order; host ids (a list or
        numpy array) are checked against the vocabulary, an ``mx.array`` (a device array, often
        the last step's samples, not read back) only for rank and dtype: its ids are trusted, as
        mlx-lm trusts them. ``logit_rows``: the rows whose logits are wanted (default: each
        sequence's last row), each in ``0..plan.num_tokens - 1``; given as an ``mx.array``, only
        its rank and dtype are checked.
        """
        if not isinstance(plan, StepPlan):
            raise InvalidInputError(f"plan={_describe(plan)} (allowed: a StepPlan, as PagedKVCache.prepare_step "
                                    "returns it)")
        tokens = self._check_tokens(tokens, plan.num_tokens)
        if logit_rows is None:
            logit_rows = np.cumsum(plan.q_lens) - 1
        elif isinstance(logit_rows, mx.array):
            if logit_rows.ndim != 1 or not mx.issubdtype(logit_rows.dtype, mx.integer):
                raise InvalidInputError(f"logit_rows: an mx.array of shape {tuple(logit_rows.shape)} and dtype "
                                        f"{dtype_name(logit_rows.dtype)} (allowed: 1-D integer row indices)")
        else:
            _check_rows(logit_rows, plan.num_tokens)
        if not isinstance(logit_rows, mx.array):
            logit_rows = device_array(logit_rows, np.int32)
        if not hook.is_installed(self.resolved.attention_modules):
            raise ModelError(
                "the attention hook is not installed for this model's modules "
                f"{', '.join(self.resolved.attention_modules)}: call metal_attn.mlx_lm.install()"
            )
        with model_lock(self.model):  # another thread's compiled trace may hold tracers in its weights
            hidden = self._forward_layers(plan, tokens)
        logits = self._head(self._text, hidden[logit_rows])
        return logits.reshape(logit_rows.shape[0], -1)

    def _check_tokens(self, tokens: Any, num_tokens: int) -> mx.array:
        """``tokens`` as an int ``mx.array`` of shape ``[num_tokens]``, or `InvalidInputError` naming what is wrong."""
        if isinstance(tokens, mx.array):
            shape, dtype = tuple(tokens.shape), dtype_name(tokens.dtype)
            integral = mx.issubdtype(tokens.dtype, mx.integer)
        else:
            host = np.asarray(tokens)
            shape, dtype = tuple(host.shape), str(host.dtype)
            integral = host.size == 0 or np.issubdtype(host.dtype, np.integer)
        if not integral:
            raise InvalidInputError(f"tokens: dtype {dtype} (allowed: integer token ids)")
        if shape != (num_tokens,):
            raise InvalidInputError(f"tokens.shape={shape} (allowed: [{num_tokens}], one id per row of the step)")
        if isinstance(tokens, mx.array):
            return tokens
        vocab = self.vocab_size
        bad = host[(host < 0) | (host >= vocab)]
        if bad.size:
            raise InvalidInputError(f"tokens holds id {int(bad[0])} (allowed: 0..{vocab - 1}, the model's vocabulary)")
        return mx.array(host.astype(np.int32))

    def _forward_layers(self, plan: StepPlan, tokens: mx.array) -> mx.array:
        for c in self.caches:
            c.begin(plan)
        before = [(c.writes, c.attends) for c in self.caches]
        hidden = self._text.model(tokens.reshape(-1, 1), self.caches)
        for i, (c, (w, a)) in enumerate(zip(self.caches, before)):
            if c.writes != w + 1 or c.attends != a + 1:
                raise ModelError(
                    f"layer {i}: the step wrote K/V {c.writes - w} time(s) and reached the attention hook "
                    f"{c.attends - a} time(s) (need 1 and 1): is the hook installed (metal_attn.mlx_lm.install())?"
                )
        return hidden


_locks_guard = threading.Lock()
#: id(model) -> (a weak reference to it, its lock).
_model_locks: dict[int, tuple[weakref.ref, threading.RLock]] = {}


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock every graph built on ``model`` by metal-attn is built under (one per model object).

    While ``mx.compile`` traces a forward, MLX puts placeholders in place of the model's weights in
    its own tree; another thread building a graph on the same model then read them ("Attempting to
    eval an array without a primitive"). Engines on several threads may share one model: their
    forwards and traces (`PagedModel.forward`, `CompiledDecode.run`) take turns building graphs;
    the device work still overlaps. Code outside metal-attn that runs the same model concurrently
    must not do so while an engine traces (its first compiled step of each shape)."""
    key = id(model)
    with _locks_guard:
        hit = _model_locks.get(key)
        if hit is not None and hit[0]() is model:
            return hit[1]
        lock = threading.RLock()
        _model_locks[key] = (weakref.ref(model, lambda _r, k=key: _model_locks.pop(k, None)), lock)
        return lock


def _check_pool_arguments(num_blocks: Any, block_size: Any, kv_cache: Any) -> None:
    """`PagedModel`'s pool: ``num_blocks`` (and ``block_size``) to build one, or a ``kv_cache``, not both."""
    if kv_cache is None:
        if num_blocks is None:
            raise InvalidInputError("num_blocks is required when no kv_cache is given (allowed: an int >= 1)")
        return
    if not isinstance(kv_cache, PagedKVCache):
        raise InvalidInputError(f"kv_cache={_describe(kv_cache)} (allowed: a PagedKVCache, or None to build one of "
                                "num_blocks pages)")
    for name, value, has in (("num_blocks", num_blocks, kv_cache.num_blocks),
                             ("block_size", block_size, kv_cache.block_size)):
        if value is not None and value != has:
            raise InvalidInputError(
                f"{name}={value!r} given with a kv_cache of {kv_cache.num_blocks} blocks of {kv_cache.block_size} "
                f"tokens (allowed: {name} left out, or {has}: the kv_cache brings its own pages)")


def _describe(value: Any) -> str:
    """A value for a message: its repr, cut short, and its type."""
    shown = repr(value)
    return f"{shown[:60]}{'...' if len(shown) > 60 else ''} (a {type(value).__name__})"


def array_slots(tree: Any) -> list[tuple[Any, Any, mx.array]]:
    """Every array of a tree of dicts and lists (a module's ``state``), with the container and key it sits at."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, mx.array):
                out.append((node, key, value))
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return out


def _check_rows(rows: Sequence[int], num_tokens: int) -> None:
    """``rows`` are host row indices of a step of ``num_tokens`` rows (a gather past the rows would
    read whatever memory follows, silently)."""
    arr = np.asarray(rows)
    if (arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer)
            or arr.min() < 0 or arr.max() >= num_tokens):
        shown = list(rows) if arr.size <= 16 else f"{arr.size} values"
        raise InvalidInputError(f"logit_rows={shown} (allowed: one or more row indices in 0..{num_tokens - 1}, "
                                f"the step's rows)")


def _show(values: tuple) -> str:
    return "(" + ", ".join(dtype_name(v) if isinstance(v, mx.Dtype) else str(v) for v in values) + ")"
