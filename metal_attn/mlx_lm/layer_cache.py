"""The per-layer cache objects an mlx-lm model sees while it runs on the paged path.

mlx-lm's attention does ``q, k = rope(q, offset=cache.offset), rope(k, ...)``, then
``keys, values = cache.update_and_fetch(keys, values)``, then
``scaled_dot_product_attention(q, keys, values, cache=cache, ...)``. A packed step
feeds its ``T`` tokens as a ``[T, 1]`` batch, so each token is a batch row:

- `PagedLayerCache.offset` is the ``[T]`` array of the tokens' positions (RoPE
  takes one offset per row);
- `PagedLayerCache.update_and_fetch` writes the rows' K/V ``[T, kv_heads, 1, D]``
  into the layer's pages (`reshape_and_cache`, the step's slot mapping) and returns
  the layer's pools;
- the hook (`metal_attn.mlx_lm.hook`) sees a `HookedCache` and calls its `attend`,
  which runs `paged_attention` with the step's `AttentionMetadata`.

`ProbeCache` walks the same road once, lazily and without computing anything, to
read each layer's K/V geometry and prove that every layer's attention reaches the hook.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from metal_attn.api import paged_attention

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.cache import PagedKVCache, StepPlan

__all__ = ["HookedCache", "LayerGeometry", "PagedLayerCache", "ProbeCache"]


class HookedCache:
    """A cache whose attention the hook routes to `attend` (every other cache keeps mlx-lm's path)."""

    #: Steps seen by `update_and_fetch` and by `attend`; they must match after every forward.
    writes: int = 0
    attends: int = 0

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        """No mask: causality and windows come from the step's lengths."""
        return None

    def attend(
        self, queries: mx.array, *, scale: float, sinks: mx.array | None = None, softcap: float | None = None
    ) -> mx.array:
        raise NotImplementedError

    # mlx-lm's cache protocol, as far as a paged layer can honour it.
    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> list:
        return []


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """One layer's attention shapes, read off a lazy probe forward."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sinks: bool


class ProbeCache(HookedCache):
    """Records what one layer's attention looks like; returns shape-correct lazy placeholders."""

    def __init__(self) -> None:
        self.offset = mx.array([0], dtype=mx.int32)
        self.kv_shape: tuple[int, ...] | None = None
        self.dtype: Any = None
        self.geometry: LayerGeometry | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.writes += 1
        self.kv_shape, self.dtype = tuple(keys.shape), keys.dtype
        return keys, values

    def attend(
        self, queries: mx.array, *, scale: float, sinks: mx.array | None = None, softcap: float | None = None
    ) -> mx.array:
        self.attends += 1
        if self.kv_shape is not None:
            self.geometry = LayerGeometry(
                num_heads=int(queries.shape[1]),
                num_kv_heads=int(self.kv_shape[1]),
                head_size=int(self.kv_shape[3]),
                dtype=self.dtype,
                sinks=sinks is not None,
            )
        return queries


class PagedLayerCache(HookedCache):
    """Layer ``layer`` of a `PagedKVCache`, for the step the runner set with `PagedLayerCache.begin`."""

    def __init__(self, kv: PagedKVCache, layer: int, sliding_window: int | None = None) -> None:
        self.kv = kv
        self.layer = layer
        self.sliding_window = sliding_window
        self.plan: StepPlan | None = None
        self.offset: mx.array | None = None

    def __repr__(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return f"PagedLayerCache(layer={self.layer}{window})"

    def begin(self, plan: StepPlan) -> None:
        """Serve ``plan``'s tokens next (positions, slots and metadata of the step)."""
        self.plan = plan
        self.offset = plan.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's K/V ``[T, kv_heads, 1, D]`` into this layer's pages; return the pools."""
        self.writes += 1
        t, kvh, _, d = keys.shape
        self.kv.write_step(self.layer, keys.reshape(t, kvh, d), values.reshape(t, kvh, d), self.plan)
        return self.kv.pools(self.layer)

    def attend(
        self, queries: mx.array, *, scale: float, sinks: mx.array | None = None, softcap: float | None = None
    ) -> mx.array:
        """`paged_attention` for the step's ``[T, heads, 1, D]`` queries, in the same layout."""
        self.attends += 1
        t, h, _, d = queries.shape
        k_pool, v_pool = self.kv.pools(self.layer)
        out = paged_attention(
            queries.reshape(t, h, d),
            k_pool,
            v_pool,
            metadata=self.plan.metadata,
            scale=scale,
            sinks=sinks,
            sliding_window=self.sliding_window,
            softcap=softcap,
        )
        return out.reshape(t, h, 1, d)

    def size(self) -> int:
        return max(self.plan.seq_lens) if self.plan else 0

    def empty(self) -> bool:
        return self.plan is None

    @property
    def nbytes(self) -> int:
        k, v = self.kv.pools(self.layer)
        return k.nbytes + v.nbytes
