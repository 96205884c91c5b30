"""A float64 numpy oracle for paged attention, independent of every provider.

It reads pages through the block table, applies the causal rule, the sliding
window, the softcap and the sinks exactly as ``KERNELS.md`` states them, and
computes the softmax in float64 without any epsilon. It never calls MLX, so a
bug in MLX or in a provider cannot leak into it.

Semantics (per sequence with ``q_len`` query rows and ``seq_len`` KV tokens):

- query row ``i`` attends to KV positions ``[0, seq_len - q_len + i + 1)``;
- with a sliding window ``W``, only the last ``W`` of those;
- scores are ``scale * q . k``, then ``c * tanh(s / c)`` when ``softcap=c``;
- a sink is one logit per query head, added to the softmax denominator once
  (it has no value row);
- query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Non-finite inputs (the contract every provider honours, ``docs/providers.md``):

- a position a row does not attend to (past its causal end, left of its window,
  past ``seq_len``, an unused block or table entry) never affects that row,
  whatever it holds;
- a NaN or an infinity in ``q[row, head]``, or in the K or V row of a position
  that ``row`` attends to (of ``head``'s KV head), makes ``out[row, head]``
  NaN (every element here; a provider must make at least one element
  non-finite, never a silent 0 or a plausible finite value).

The oracle states this explicitly rather than leaving it to float64
arithmetic, which would drop a key whose score is ``-inf`` (or whose softcapped
score is finite) and keep the row finite: the poisoned (row, head) pairs are
set to NaN, the others are computed from the finite values only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Upper bound on score-matrix elements materialised at once (bounds memory on long prefills).
_MAX_SCORE_ELEMENTS = 1 << 24


def _numeric(name: str, x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(
            f"{name} must be a numeric numpy array (got dtype {arr.dtype}); convert bfloat16 through float32 first"
        )
    return arr


def _f64(name: str, x: Any) -> np.ndarray:
    return _numeric(name, x).astype(np.float64, copy=False)


def _ints(name: str, x: Any, ndim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be an integer array of rank {ndim} (got {arr.dtype} {arr.shape})")
    return arr.astype(np.int64, copy=False)


def attention_oracle(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    cu_seqlens_q: Any,
    *,
    scale: float,
    sinks: Any = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Paged attention in float64.

    ``q``: ``[total_q_tokens, num_heads, head_size]``; ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_size]``; ``block_tables``:
    ``[num_seqs, max_blocks]``; ``seq_lens``: ``[num_seqs]``; ``cu_seqlens_q``:
    ``[num_seqs + 1]``; ``sinks``: ``[num_heads]`` or ``None``. All numpy
    (bfloat16 data converted through float32 first).

    Returns a float64 array ``[total_q_tokens, num_heads, head_size]``.
    """
    qf = _f64("q", q)
    # The pools stay in their dtype; only the pages a row reads are converted to float64.
    kc = _numeric("k_cache", k_cache)
    vc = _numeric("v_cache", v_cache)
    tables = _ints("block_tables", block_tables, 2)
    lens = _ints("seq_lens", seq_lens, 1)
    cu = _ints("cu_seqlens_q", cu_seqlens_q, 1)
    total, num_heads, head_size = qf.shape
    _, block_size, num_kv_heads, _ = kc.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if cu.shape[0] != lens.shape[0] + 1 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens_q={cu.tolist()} does not match seq_lens ({lens.shape[0]}) and q rows ({total})")
    sink = None
    if sinks is not None:
        sink = _f64("sinks", sinks).reshape(num_kv_heads, group, 1, 1)

    out = np.empty((total, num_heads, head_size), dtype=np.float64)
    for seq, seq_len in enumerate(lens.tolist()):
        row0, row1 = int(cu[seq]), int(cu[seq + 1])
        q_len = row1 - row0
        if q_len < 1 or seq_len < q_len:
            raise ValueError(f"sequence {seq}: q_len={q_len}, seq_len={seq_len} (need 1 <= q_len <= seq_len)")
        first_row = seq_len - q_len  # absolute KV position of query row 0
        step = max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * seq_len))
        for a in range(0, q_len, step):
            b = min(q_len, a + step)
            # Row i attends [lo_i, hi_i); only the union [lo_a, hi_{b-1}) is read.
            hi = first_row + np.arange(a, b) + 1
            lo = np.zeros_like(hi) if sliding_window is None else np.maximum(hi - int(sliding_window), 0)
            start, stop = int(lo[0]), int(hi[-1])
            k, v = _gather(kc, vc, tables[seq], block_size, start, stop)  # [n, kvh, d]
            rows = b - a
            # [kvh, group, rows, d] @ [kvh, 1, d, n] -> [kvh, group, rows, n]
            qs = qf[row0 + a : row0 + b].reshape(rows, num_kv_heads, group, head_size).transpose(1, 2, 0, 3)
            # Non-finite values: the (row, head) pairs they reach are poisoned; the arithmetic runs on
            # finite values only (a masked NaN must not leak through 0 * NaN).
            bad_pos = ~(np.isfinite(k).all(axis=-1) & np.isfinite(v).all(axis=-1))  # [n, kvh]
            bad_q = ~np.isfinite(qs).all(axis=-1)  # [kvh, group, rows]
            k, v, qs = (np.where(np.isfinite(x), x, 0.0) for x in (k, v, qs))
            s = (qs @ k.transpose(1, 2, 0)[:, None]) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            pos = np.arange(start, stop)[None, :]
            allowed = (pos >= lo[:, None]) & (pos < hi[:, None])  # [rows, n]
            s = np.where(allowed, s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            if sink is not None:
                m = np.maximum(m, sink)
            p = np.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            if sink is not None:
                denom = denom + np.exp(sink - m)
            o = (p @ v.transpose(1, 0, 2)[:, None]) / denom  # [kvh, group, rows, d]
            reached = (allowed[None, :, :] & bad_pos.T[:, None, :]).any(axis=-1)  # [kvh, rows]
            o[bad_q | reached[:, None, :]] = np.nan
            out[row0 + a : row0 + b] = o.transpose(2, 0, 1, 3).reshape(rows, num_heads, head_size)
    return out


def _gather(
    kc: np.ndarray, vc: np.ndarray, table: np.ndarray, block_size: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """K and V of KV positions ``[start, stop)`` of one sequence, read page by page."""
    b0, b1 = start // block_size, -(-stop // block_size)
    ids = table[b0:b1]
    if ids.shape[0] != b1 - b0:
        raise ValueError(f"block table row has {table.shape[0]} entries; positions up to {stop} need {b1}")
    if ids.size and (ids.min() < 0 or ids.max() >= kc.shape[0]):
        raise ValueError(f"block ids {ids.tolist()} out of range for a pool of {kc.shape[0]} blocks")
    off = start - b0 * block_size
    n = stop - start
    k = kc[ids].reshape(-1, *kc.shape[2:])[off : off + n]
    v = vc[ids].reshape(-1, *vc.shape[2:])[off : off + n]
    return k.astype(np.float64), v.astype(np.float64)
