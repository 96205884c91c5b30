"""The reference provider: correct everywhere, fast nowhere.

For each sequence it gathers the sequence's pages into contiguous K/V with MLX
ops and computes attention with the causal rule, sliding window, softcap and
sinks in float32. It implements every feature, dtype and backend, has the
lowest priority, and is the always-available fallback. It is not the test
oracle (that is the float64 numpy implementation in ``metal_attn/testing/oracle.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from metal_attn.provider import AttentionInputs, Plan, Provider

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
        return Plan(provider=self.name, route="reference", specialization=())

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        q, kc, vc, md = inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata
        _, block_size, kvh, head = kc.shape
        num_heads = q.shape[1]
        group = num_heads // kvh
        outs = []
        start = 0
        sinks = inputs.sinks.reshape(kvh, group, 1, 1) if inputs.sinks is not None else None
        for i, (q_len, seq_len) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            nblk = -(-seq_len // block_size)
            ids = md.block_tables[i, :nblk]
            k = kc[ids].reshape(nblk * block_size, kvh, head)[:seq_len].astype(mx.float32)
            v = vc[ids].reshape(nblk * block_size, kvh, head)[:seq_len].astype(mx.float32)
            qs = q[start : start + q_len].astype(mx.float32)  # [q_len, H, D]
            start += q_len
            # [kvh, group, q_len, D] x [kvh, D, seq_len] -> [kvh, group, q_len, seq_len]
            qh = qs.reshape(q_len, kvh, group, head).transpose(1, 2, 0, 3)
            s = (qh * inputs.scale) @ k.transpose(1, 2, 0)[:, None]
            if inputs.softcap is not None:
                s = inputs.softcap * mx.tanh(s / inputs.softcap)
            rows = mx.arange(q_len)[:, None] + (seq_len - q_len)
            cols = mx.arange(seq_len)[None, :]
            allowed = cols <= rows
            if inputs.sliding_window is not None:
                allowed = allowed & (cols > rows - inputs.sliding_window)
            s = mx.where(allowed, s, -mx.inf)
            m = s.max(axis=-1, keepdims=True)
            if sinks is not None:
                m = mx.maximum(m, sinks)
            p = mx.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            if sinks is not None:
                denom = denom + mx.exp(sinks - m)
            o = (p @ v.transpose(1, 0, 2)[:, None]) / denom  # [kvh, group, q_len, D]
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
        nb, bs, kvh, head = k_cache.shape
        host = np.array(slots, copy=False)
        keep = np.nonzero(host >= 0)[0]
        if keep.size == 0:
            return k_cache, v_cache
        if keep.size == host.size:  # no padding: the validated int64 slots are the indices
            idx, rows = slots, None
        else:
            idx, rows = mx.array(host[keep].astype(np.int64)), mx.array(keep.astype(np.int64))
        k_new = key if rows is None else key[rows]
        v_new = value if rows is None else value[rows]
        kf = k_cache.reshape(nb * bs, kvh, head)
        vf = v_cache.reshape(nb * bs, kvh, head)
        kf[idx] = k_new
        vf[idx] = v_new
        return kf.reshape(nb, bs, kvh, head), vf.reshape(nb, bs, kvh, head)
