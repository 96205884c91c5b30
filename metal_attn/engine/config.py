"""`EngineConfig`: the engine's policies as data (budgets, pool sizing, admission, preemption)."""

from __future__ import annotations

import dataclasses
import math

from metal_attn.checks import int_at_least, is_real
from metal_attn.errors import InvalidInputError

__all__ = ["COMPILE_DECODE_BY_BACKEND", "PREEMPTION_ORDERS", "SETTINGS_FIELDS", "EngineConfig"]

#: Which running request gives its blocks back when another cannot grow: the most recently
#: admitted one ("newest", vLLM's recompute policy) or the one holding most blocks ("largest").
PREEMPTION_ORDERS = ("newest", "largest")

#: Whether decode steps run compiled when neither the config nor ``METAL_ATTN_COMPILE_DECODE``
#: says, per backend, and the measurement behind it (docs/serving.md, "Compiled decode steps").
COMPILE_DECODE_BY_BACKEND: dict[str, tuple[bool, str]] = {
    "cuda": (True, "measured on the H200: 1.75x / 1.29x / 1.25x the eager engine's generation tok/s "
                   "at 1 / 32 / 64 requests"),
    "metal": (False, "not measured on Apple hardware"),
    "cpu": (False, "measured on the 2-core CPU: generation tok/s 1.02x the eager engine's, not worth a trace "
                   "and a C++ compile per shape"),
}


#: The fields whose defaults come from the ``METAL_ATTN_*`` settings: field -> settings field.
SETTINGS_FIELDS: dict[str, str] = {
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "kv_cache_memory": "kv_cache_memory",
    "kv_cache_fraction": "kv_cache_fraction",
    "enable_prefix_caching": "prefix_caching",
    "compile_decode": "compile_decode",
}


def _from_settings(field: str):
    """A field default read from the settings when the config is made (``METAL_ATTN_<FIELD>``, else its default)."""

    def default():
        from metal_attn.settings import get_settings

        return getattr(get_settings(), SETTINGS_FIELDS[field])

    return dataclasses.field(default_factory=default)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduler and pool policies. Every field has a default; `validate` names a bad one.

    The fields of `SETTINGS_FIELDS` default to their ``METAL_ATTN_*`` settings, read when the
    config is made; a field given explicitly wins over its setting.

    Pool size, in order of precedence: ``num_blocks``; else ``kv_cache_memory`` bytes;
    else ``kv_cache_fraction`` of the device's memory. Either way the pool never exceeds
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.
    """

    #: Token budget of one step: decode rows plus prefill-chunk tokens (``METAL_ATTN_MAX_NUM_BATCHED_TOKENS``, 512).
    max_num_batched_tokens: int = _from_settings("max_num_batched_tokens")
    #: Cap on running sequences (``METAL_ATTN_MAX_NUM_SEQS``, 64).
    max_num_seqs: int = _from_settings("max_num_seqs")
    #: Tokens per page of the pool (a multiple of 8).
    block_size: int = 16
    #: Pool size in pages (per layer); ``None`` sizes it from memory.
    num_blocks: int | None = None
    #: Pool budget in bytes (K and V of every layer); ``None`` uses ``kv_cache_fraction``
    #: (``METAL_ATTN_KV_CACHE_MEMORY``, unset).
    kv_cache_memory: int | None = _from_settings("kv_cache_memory")
    #: Share of the device's memory for the pool when no byte budget is given (``METAL_ATTN_KV_CACHE_FRACTION``, 0.2).
    kv_cache_fraction: float = _from_settings("kv_cache_fraction")
    #: Share of the pool kept free when a new request is admitted (headroom for decode growth).
    watermark: float = 0.01
    #: Reuse cached full blocks of shared prompt prefixes (``METAL_ATTN_PREFIX_CACHING``, on).
    enable_prefix_caching: bool = _from_settings("enable_prefix_caching")
    #: See `PREEMPTION_ORDERS`.
    preemption_order: str = "newest"
    #: Longest sequence (prompt plus generated tokens); ``None``: the model's own limit.
    max_model_len: int | None = None
    #: Build and queue step N+1 while step N runs (mlx-lm's ``generate_step`` pattern).
    pipeline: bool = True
    #: Run decode-only steps through a forward traced once per (rows, table width) under
    #: ``mx.compile`` (`metal_attn.mlx_lm.compiled.CompiledDecode`); steps it does not apply to,
    #: and models it refuses, run eagerly. ``None``: the backend's measured default
    #: (`COMPILE_DECODE_BY_BACKEND`) (``METAL_ATTN_COMPILE_DECODE``, unset).
    compile_decode: bool | None = _from_settings("compile_decode")
    #: With compiled steps on: a decode shape (row bucket, table width) is traced on its
    #: ``compile_trace_after``-th step and runs eagerly before that (2: a shape seen on one step
    #: only never pays a trace). 1, the default, traces on first sight: on the H200 at one request
    #: the first token did not wait for the trace either way (TTFT 39 ms at 1, 48 ms at 2, stock
    #: ``generate_step`` 42-47 ms in the same runs: the trace runs on the host while the prefill
    #: runs on the GPU; docs/serving.md).
    compile_trace_after: int = 1
    #: With compiled steps on: a row bucket smaller than one already traced (at the same table
    #: width) runs padded in the larger bucket for its first ``compile_shrink_after`` steps, and is
    #: traced only if it lasts (0: traced as any new shape is, on its ``compile_trace_after``-th
    #: step, padded before that). A decode step's matmuls read the weights once
    #: whatever the rows, and a padding row's attention reads one token, so padded steps cost the
    #: GPU little; a trace cost the host about 28 ms at 64 requests on the H200 (docs/serving.md).
    compile_shrink_after: int = 16

    @classmethod
    def from_settings(cls, **overrides: object) -> EngineConfig:
        """``EngineConfig(**overrides)``, validated: the ``METAL_ATTN_*`` engine settings, then ``overrides``."""
        return cls(**overrides).validate()

    def resolve_compile_decode(self, backend: str) -> tuple[bool, str]:
        """Whether decode steps run compiled on ``backend``, and why (the config's value, else the
        backend's row of `COMPILE_DECODE_BY_BACKEND`)."""
        if self.compile_decode is not None:
            return bool(self.compile_decode), f"compile_decode={self.compile_decode} (set)"
        on, why = COMPILE_DECODE_BY_BACKEND.get(backend, (False, f"no measured default for backend {backend!r}"))
        return on, f"compile_decode unset: {'on' if on else 'off'} on {backend} ({why})"

    def validate(self) -> EngineConfig:
        """Return ``self``; raise `InvalidInputError` naming the first bad field, its value and what is allowed."""
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "compile_trace_after"):
            int_at_least(name, getattr(self, name))
        int_at_least("compile_shrink_after", self.compile_shrink_after, low=0)
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                int_at_least(name, getattr(self, name))
        if self.block_size % 8:
            raise InvalidInputError(f"block_size={self.block_size} (allowed: a multiple of 8, e.g. 8, 16, 32)")
        if not (is_real(self.kv_cache_fraction) and 0 < self.kv_cache_fraction <= 1):
            raise InvalidInputError(f"kv_cache_fraction={self.kv_cache_fraction!r} (allowed: a number in (0, 1])")
        if not (is_real(self.watermark) and 0 <= self.watermark < 1):
            raise InvalidInputError(f"watermark={self.watermark!r} (allowed: a number in [0, 1))")
        for name in ("enable_prefix_caching", "pipeline"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name}={getattr(self, name)!r} (allowed: True or False)")
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise InvalidInputError(f"compile_decode={self.compile_decode!r} (allowed: True, False or None)")
        if self.preemption_order not in PREEMPTION_ORDERS:
            raise InvalidInputError(
                f"preemption_order={self.preemption_order!r} (allowed: {', '.join(PREEMPTION_ORDERS)})"
            )
        return self

    def pool_blocks(self, block_bytes: int, device_memory: int | None, max_model_len: int) -> tuple[int, str]:
        """Pages to allocate, and a sentence saying where the number came from."""
        need = self.max_num_seqs * math.ceil(max_model_len / self.block_size)
        if self.num_blocks is not None:
            return self.num_blocks, f"num_blocks={self.num_blocks}"
        if self.kv_cache_memory is not None:
            if device_memory and self.kv_cache_memory > device_memory:
                raise InvalidInputError(
                    f"kv_cache_memory={self.kv_cache_memory:,} bytes is more than this device's {device_memory:,} "
                    f"(allowed: a budget the device holds, or kv_cache_fraction)"
                )
            budget, source = self.kv_cache_memory, f"kv_cache_memory={self.kv_cache_memory:,} bytes"
        elif device_memory:
            budget = int(device_memory * self.kv_cache_fraction)
            source = f"kv_cache_fraction={self.kv_cache_fraction:g} of {device_memory:,} bytes"
        else:
            raise InvalidInputError(
                "kv_cache_memory is required: the device's memory size is unknown here (allowed: bytes >= 1)"
            )
        blocks = budget // block_bytes
        if blocks < 1:
            raise InvalidInputError(
                f"{source} holds no page of {block_bytes:,} bytes (allowed: at least one page's worth)"
            )
        if blocks > need:
            return need, f"{source}, capped at {need} pages ({self.max_num_seqs} x {max_model_len} tokens)"
        return blocks, source
