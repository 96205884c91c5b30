"""The reference provider: correct everywhere, fast nowhere.

For each sequence it gathers the sequence's pages into contiguous K/V with MLX
ops and computes attention with the causal rule, sliding window, softcap and
sinks in float32. It implements every feature, dtype and backend, has the
lowest priority, and is the always-available fallback. It is not the test
oracle (that is the float64 numpy implementation in ``metal_attn/testing/oracle.py``).

Non-finite inputs follow the contract of ``docs/providers.md``: a NaN or infinity in
a query row, or in the K/V row of a position the row attends to, makes that (row,
head) NaN; one at a position the row does not attend to changes nothing. Dense
attention over the gathered sequence multiplies masked V rows by 0 (and 0 * NaN is
NaN) and drops keys whose score is -inf, so the arithmetic runs on finite values and
the poisoned pairs are marked explicitly: per KV head, a running count of non-finite
positions tells whether a row's range ``[lo, hi)`` holds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from metal_attn.provider import AttentionInputs, Plan, Provider, write_slots

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings


class ReferenceProvider(Provider):
    name = "reference"
    priority = 0
    backends = frozenset({"metal", "cuda", "cpu"})
    features = frozenset({"sinks", "sliding_window", "softcap"})
    mixed_dtypes = True
    writes_cache = True
    description = "Gather pages, then dense attention with MLX ops (every feature; the fallback)."

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        if device.backend == "cuda" and request.dtype == "float32":
            # MLX's CUDA matmuls run float32 through TF32 tensor cores (10-bit mantissas), which
            # the float32 promise does not allow: split each operand into two TF32 parts.
            return Plan(provider=self.name, route="reference", specialization=("split_tf32",),
                        notes=("float32 products as 3 TF32 matmuls (hi*hi + hi*lo + lo*hi)",))
        return Plan(provider=self.name, route="reference", specialization=())

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        q, kc, vc, md = inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata
        _, block_size, kvh, head = kc.shape
        num_heads = q.shape[1]
        group = num_heads // kvh
        outs = []
        start = 0
        sinks = inputs.sinks.reshape(kvh, group, 1, 1) if inputs.sinks is not None else None
        matmul = _matmul_split_tf32 if "split_tf32" in plan.specialization else mx.matmul
        for i, (q_len, seq_len) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            nblk = -(-seq_len // block_size)
            ids = md.block_tables[i, :nblk]
            k = kc[ids].reshape(nblk * block_size, kvh, head)[:seq_len].astype(mx.float32)
            v = vc[ids].reshape(nblk * block_size, kvh, head)[:seq_len].astype(mx.float32)
            qs = q[start : start + q_len].astype(mx.float32)  # [q_len, H, D]
            start += q_len
            # Non-finite values: which positions (per KV head) and query vectors hold one; the
            # arithmetic below sees zeros there, the poisoned (row, head) pairs become NaN at the end.
            k_ok, v_ok, q_ok = mx.isfinite(k), mx.isfinite(v), mx.isfinite(qs)
            bad_pos = ~(k_ok.all(axis=-1) & v_ok.all(axis=-1))  # [seq_len, kvh]
            k, v, qs = mx.where(k_ok, k, 0.0), mx.where(v_ok, v, 0.0), mx.where(q_ok, qs, 0.0)
            # [kvh, group, q_len, D] x [kvh, D, seq_len] -> [kvh, group, q_len, seq_len]
            qh = qs.reshape(q_len, kvh, group, head).transpose(1, 2, 0, 3)
            s = matmul(qh * inputs.scale, k.transpose(1, 2, 0)[:, None])
            if inputs.softcap is not None:
                s = inputs.softcap * mx.tanh(s / inputs.softcap)
            hi = mx.arange(q_len) + (seq_len - q_len + 1)  # row r attends [lo_r, hi_r)
            lo = mx.maximum(hi - inputs.sliding_window, 0) if inputs.sliding_window is not None else None
            cols = mx.arange(seq_len)[None, :]
            allowed = cols < hi[:, None]
            if lo is not None:
                allowed = allowed & (cols >= lo[:, None])
            s = mx.where(allowed, s, -mx.inf)
            m = s.max(axis=-1, keepdims=True)
            if sinks is not None:
                m = mx.maximum(m, sinks)
            p = mx.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            if sinks is not None:
                denom = denom + mx.exp(sinks - m)
            o = matmul(p, v.transpose(1, 0, 2)[:, None]) / denom  # [kvh, group, q_len, D]
            # Poisoned rows: a non-finite position in [lo_r, hi_r) of the row's KV head (prefix
            # counts), or a non-finite element in the row's query vector.
            counts = mx.concatenate([mx.zeros((1, kvh), mx.int32), mx.cumsum(bad_pos.astype(mx.int32), axis=0)])
            reached = counts[hi] - (counts[lo] if lo is not None else 0)  # [q_len, kvh]
            poisoned = (reached.T > 0)[:, None, :] | ~q_ok.all(axis=-1).reshape(q_len, kvh, group).transpose(1, 2, 0)
            o = mx.where(poisoned[..., None], mx.nan, o)
            outs.append(o.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return out.astype(q.dtype)

    def write_cache(
        self,
        key: mx.array,
        value: mx.array,
        k_cache: mx.array,
        v_cache: mx.array,
        slots: mx.array,
        device: DeviceInfo,
    ) -> tuple[mx.array, mx.array]:
        return write_slots(key, value, k_cache, v_cache, slots)


#: The 13 low mantissa bits that TF32 drops from a float32.
_TF32_MASK = 0xFFFFE000


def _tf32_hi(x: mx.array) -> mx.array:
    """``x`` truncated to TF32's 10-bit mantissa (exactly representable in TF32)."""
    return (x.view(mx.uint32) & _TF32_MASK).view(mx.float32)


def _matmul_split_tf32(a: mx.array, b: mx.array) -> mx.array:
    """A float32 matmul accurate to float32 on hardware that multiplies in TF32.

    Each operand is ``hi + lo`` with ``hi`` exact in TF32 and ``lo`` the remainder (itself
    rounded to TF32, an error of about 2^-22 relative); the products ``hi*hi + hi*lo + lo*hi``
    are exact in the tensor cores' float32 accumulation and ``lo*lo`` (about 2^-22) is dropped.
    """
    a_hi, b_hi = _tf32_hi(a), _tf32_hi(b)
    a_lo, b_lo = a - a_hi, b - b_hi
    return a_hi @ b_lo + a_lo @ b_hi + a_hi @ b_hi
