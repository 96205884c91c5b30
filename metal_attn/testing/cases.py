"""Random paged-attention cases with adversarial page tables, and their oracle.

`make_case` builds q, K and V pools and the metadata for a batch described by
per-sequence lengths. The pages of each sequence are scattered through the
pool in random order, block 0 and the spare blocks hold garbage (NaN values,
huge keys), and so do the unused slots at the end of each sequence's last
page: a provider that reads a wrong block, a padded table entry or a position
past ``seq_len`` produces visibly wrong output instead of a lucky match.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn.api import MX_DTYPES
from metal_attn.checks import is_integer, is_real_scalar
from metal_attn.testing.oracle import attention_oracle

#: Key value written into garbage slots: large enough to dominate any softmax it leaks into,
#: exactly representable in float16 and bfloat16.
GARBAGE_KEY = 8192.0

_MX_DTYPES = {name: MX_DTYPES[name] for name in ("float32", "float16", "bfloat16")}  # message order


def dtype_name(dtype: Any) -> str:
    """``"float16"`` / ``mx.float16`` -> ``"float16"`` (one of float32, float16, bfloat16)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = next((k for k, v in _MX_DTYPES.items() if v == dtype), str(dtype))
    if name not in _MX_DTYPES:
        raise ValueError(f"dtype={dtype!r} (allowed: {', '.join(_MX_DTYPES)})")
    return name


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to ``dtype`` (round to nearest even) and return them as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
        out = rounded.view(np.float32)
        return np.where(np.isnan(x), x, out)
    raise ValueError(f"dtype={dtype!r} (allowed: {', '.join(_MX_DTYPES)})")


def to_numpy(x: mx.array) -> np.ndarray:
    """An MLX array as numpy (float dtypes through float32, so bfloat16 works)."""
    if mx.issubdtype(x.dtype, mx.floating):
        x = x.astype(mx.float32)
    return np.array(x)


@dataclasses.dataclass(eq=False)
class AttentionCase:
    """One paged-attention call: MLX inputs, numpy metadata, and the float64 oracle."""

    q: mx.array
    k_cache: mx.array
    v_cache: mx.array
    block_tables: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    scale: float
    sinks: mx.array | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    label: str = ""
    #: float32 host copies of q, k_cache, v_cache, sinks (exact values of the MLX arrays).
    host: dict[str, np.ndarray | None] | None = dataclasses.field(default=None, repr=False)

    @property
    def dtype(self) -> str:
        """The query dtype name (``float32``, ``float16`` or ``bfloat16``)."""
        return dtype_name(self.q.dtype)

    @property
    def q_lens(self) -> list[int]:
        return np.diff(self.cu_seqlens_q).tolist()

    def metadata(self) -> Any:
        """The case's `metal_attn.AttentionMetadata` (for launchers that take one directly)."""
        from metal_attn.metadata import AttentionMetadata

        return AttentionMetadata.build(mx.array(self.block_tables), mx.array(self.seq_lens),
                                       mx.array(self.cu_seqlens_q))

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `metal_attn.paged_attention` (arrays as MLX arrays)."""
        return {
            "q": self.q,
            "k_cache": self.k_cache,
            "v_cache": self.v_cache,
            "block_tables": mx.array(self.block_tables),
            "seq_lens": mx.array(self.seq_lens),
            "cu_seqlens_q": mx.array(self.cu_seqlens_q),
            "scale": self.scale,
            "sinks": self.sinks,
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
        }

    def explain_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `metal_attn.explain` describing this call's request."""
        from metal_attn.api import kernel_block_size

        page = int(self.k_cache.shape[1])
        return {
            "q_lens": self.q_lens,
            "seq_lens": self.seq_lens.tolist(),
            "dtype": self.dtype,
            "num_heads": int(self.q.shape[1]),
            "num_kv_heads": int(self.k_cache.shape[2]),
            "head_size": int(self.q.shape[2]),
            "block_size": kernel_block_size(page) or page,
            "sinks": self.sinks is not None,
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
        }

    def _host_arrays(self) -> dict[str, np.ndarray | None]:
        if self.host is None:
            self.host = {
                "q": to_numpy(self.q),
                "k_cache": to_numpy(self.k_cache),
                "v_cache": to_numpy(self.v_cache),
                "sinks": to_numpy(self.sinks) if self.sinks is not None else None,
            }
        return self.host

    def oracle(self) -> np.ndarray:
        """The float64 reference output ``[total_q_tokens, num_heads, head_size]``."""
        h = self._host_arrays()
        return attention_oracle(
            h["q"], h["k_cache"], h["v_cache"], self.block_tables, self.seq_lens, self.cu_seqlens_q,
            scale=self.scale, sinks=h["sinks"], sliding_window=self.sliding_window, softcap=self.softcap,
        )


def _check_lengths(q_lens: Sequence[int], seq_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    for name, values in (("q_lens", q_lens), ("seq_lens", seq_lens)):
        if not all(is_integer(x) for x in values):
            raise ValueError(f"{name}={list(values)!r} (allowed: ints; 1.5 is not a length)")
    ql = [int(x) for x in q_lens]
    sl = [int(x) for x in seq_lens]
    if not ql or len(ql) != len(sl):
        raise ValueError(f"q_lens and seq_lens must be non-empty and equally long (got {ql} and {sl})")
    bad = [(q, s) for q, s in zip(ql, sl, strict=True) if not 1 <= q <= s]
    if bad:
        raise ValueError(f"need 1 <= q_len <= seq_len for every sequence (got (q_len, seq_len) pairs {bad})")
    return ql, sl


def _block_tables(
    blocks_needed: list[int],
    shared: int,
    num_blocks: int | None,
    contiguous: bool,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """Tables (right-padded with 0) and the pool size. Non-contiguous: block 0 is never used."""
    shared = min(shared, min(blocks_needed))
    unique = shared + sum(n - shared for n in blocks_needed)
    if contiguous:
        reserved, spare = 0, 0
    else:
        reserved, spare = 1, max(1, unique // 8)
    minimum = reserved + unique
    if num_blocks is None:
        num_blocks = minimum + spare
    elif num_blocks < minimum:
        raise ValueError(f"num_blocks={num_blocks} is too small: these lengths need at least {minimum}")
    ids = np.arange(reserved, reserved + unique) if contiguous else rng.permutation(np.arange(1, num_blocks))[:unique]
    width = max(blocks_needed) + (0 if contiguous else 1)
    tables = np.zeros((len(blocks_needed), width), dtype=np.int32)
    cursor = shared
    for i, n in enumerate(blocks_needed):
        tables[i, :shared] = ids[:shared]
        own = n - shared
        tables[i, shared:n] = ids[cursor : cursor + own]
        cursor += own
    return tables, num_blocks


def make_case(
    *,
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: Any = "float32",
    num_blocks: int | None = None,
    sinks: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
    scale: float | None = None,
    score_bias: float = 0.0,
    contiguous: bool = False,
    poison: Sequence[tuple[str, int, int, int, float]] = (),
    label: str = "",
) -> AttentionCase:
    """A random case: standard-normal q/K/V in ``dtype``, scattered pages, garbage elsewhere.

    - ``q_lens``/``seq_lens``: per sequence (decode rows first, as engines send them);
    - ``shared_prefix_blocks``: every sequence's first N table entries are the same block ids
      (N is capped at the shortest sequence's block count);
    - ``score_bias``: K's channel 0 is set to 1 and q's channel 0 to ``score_bias / scale``, so
      every score is shifted by ``score_bias`` (e.g. -120 puts in-window scores far below zero);
    - ``contiguous``: sequence i gets the next consecutive block ids, no garbage blocks;
    - ``sinks``: one random float32 logit per query head;
    - ``poison``: non-finite values planted in real data, each ``(what, seq, index, head, value)``:
      ``("q", seq, row, head, value)`` sets element 0 of query row ``row`` (within sequence
      ``seq``) of query head ``head``; ``("k" | "v", seq, pos, kv_head, value)`` sets one element
      (dimension ``pos % head_size``) of the K or V row of KV position ``pos`` of sequence ``seq``
      (a shared block is poisoned for every sequence that holds it). The oracle says which
      (row, head) outputs that reaches (`attention_oracle`).
    """
    name = dtype_name(dtype)
    ql, sl = _check_lengths(q_lens, seq_lens)
    for arg, value, low in (("num_heads", num_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                            ("head_size", head_size, 1), ("block_size", block_size, 1),
                            ("shared_prefix_blocks", shared_prefix_blocks, 0)):
        if not is_integer(value) or value < low:
            raise ValueError(f"{arg}={value!r} (allowed: an int >= {low})")
    if scale is not None and not (is_real_scalar(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} (allowed: a finite number > 0, or None for head_size**-0.5)")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    rng = np.random.default_rng(seed)
    scale = float(head_size**-0.5 if scale is None else scale)
    needed = [-(-s // block_size) for s in sl]
    tables, nb = _block_tables(needed, shared_prefix_blocks, num_blocks, contiguous, rng)

    # Slots holding real tokens: every (sequence, position < seq_len); the rest is garbage.
    valid = np.zeros(nb * block_size, dtype=bool)
    for row, s, n in zip(tables, sl, needed, strict=True):
        slots = (row[:n, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)[:s]
        valid[slots] = True
    n_valid = int(valid.sum())
    pool_shape = (nb * block_size, num_kv_heads, head_size)
    k_host = np.full(pool_shape, GARBAGE_KEY, dtype=np.float32)
    v_host = np.full(pool_shape, np.nan, dtype=np.float32)
    k_new = rng.standard_normal((n_valid, num_kv_heads, head_size), dtype=np.float32)
    if score_bias:
        k_new[..., 0] = 1.0
    k_host[valid] = round_to_dtype(k_new, name)
    v_host[valid] = round_to_dtype(rng.standard_normal((n_valid, num_kv_heads, head_size), dtype=np.float32), name)
    k_host = k_host.reshape(nb, block_size, num_kv_heads, head_size)
    v_host = v_host.reshape(nb, block_size, num_kv_heads, head_size)

    q_np = rng.standard_normal((sum(ql), num_heads, head_size), dtype=np.float32)
    if score_bias:
        q_np[..., 0] = score_bias / scale
    q_host = round_to_dtype(q_np, name)
    sinks_host = (rng.standard_normal(num_heads, dtype=np.float32) * 2.0) if sinks else None

    _plant(poison, q_host, k_host, v_host, tables, sl, ql, block_size)

    mxd = _MX_DTYPES[name]
    q_mx, k_mx, v_mx = (mx.array(x).astype(mxd) for x in (q_host, k_host, v_host))
    mx.eval(q_mx, k_mx, v_mx)
    return AttentionCase(
        q=q_mx,
        k_cache=k_mx,
        v_cache=v_mx,
        block_tables=tables,
        seq_lens=np.array(sl, dtype=np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(ql)]).astype(np.int32),
        scale=scale,
        sinks=mx.array(sinks_host) if sinks_host is not None else None,
        sliding_window=sliding_window,
        softcap=softcap,
        label=label,
        host={"q": q_host, "k_cache": k_host, "v_cache": v_host, "sinks": sinks_host},
    )


def _plant(
    poison: Sequence[tuple[str, int, int, int, float]],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tables: np.ndarray,
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
) -> None:
    """Write `make_case`'s ``poison`` entries into the host arrays (in place), checking each."""
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(int)
    for entry in poison:
        what, seq, index, head, value = entry
        if not 0 <= seq < len(seq_lens):
            raise ValueError(f"poison {entry}: seq={seq} (allowed: 0..{len(seq_lens) - 1})")
        if what == "q":
            if not (0 <= index < q_lens[seq] and 0 <= head < q.shape[1]):
                raise ValueError(f"poison {entry}: row={index}, head={head} (allowed: rows 0..{q_lens[seq] - 1}, "
                                 f"heads 0..{q.shape[1] - 1})")
            q[starts[seq] + index, head, 0] = value
        elif what in ("k", "v"):
            if not (0 <= index < seq_lens[seq] and 0 <= head < k.shape[2]):
                raise ValueError(f"poison {entry}: pos={index}, kv_head={head} (allowed: positions "
                                 f"0..{seq_lens[seq] - 1}, kv heads 0..{k.shape[2] - 1})")
            block = int(tables[seq, index // block_size])
            pool = k if what == "k" else v
            pool[block, index % block_size, head, index % pool.shape[3]] = value
        else:
            raise ValueError(f"poison {entry}: what={what!r} (allowed: 'q', 'k', 'v')")
