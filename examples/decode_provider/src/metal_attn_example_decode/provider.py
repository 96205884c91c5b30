"""`GatherDecodeProvider`: decode batches as one gather and one masked softmax, in MLX ops.

For a batch of decode rows (one query row per sequence) it gathers every sequence's pages
into a padded ``[num_seqs, kv_heads, max_seq_len, head_size]`` tensor, computes the scores of
each query head against its KV head, masks the padding (and the positions left of a sliding
window), applies the softcap, folds the sinks into the softmax and multiplies by V: all in
float32, all lazy MLX. Its priority (20) is above the built-in ``classic`` provider's (10) on
every backend, so where it admits a decode batch it is the one chosen; it refuses batches
whose padded K/V would be large (``max_kv_elements``) and everything but decode.

It honours metal-attn's NaN contract: a NaN or infinity in a query row, or in the K/V row of a
position the row attends, makes that (row, head) NaN; one anywhere else changes nothing. A
masked softmax would let a masked NaN V row in (weight 0 times NaN is NaN) and drop a key
scored -inf, so it computes on finite values and marks the poisoned pairs from the mask.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from metal_attn import AttentionInputs, Plan, Provider


class GatherDecodeProvider(Provider):
    """Batched decode: gather the pages, one masked softmax (any backend MLX runs on)."""

    name = "example_gather_decode"
    #: Above the built-in classic provider (10), below the GPU kernels (tiled 50, gqa_decode 80).
    priority = 20
    backends = frozenset({"metal", "cuda", "cpu"})
    phases = frozenset({"decode"})
    features = frozenset({"sinks", "sliding_window", "softcap"})
    description = "Example plugin: gather the pages, one masked softmax in MLX ops (decode batches only)."

    #: Largest padded K (or V) gathered per call, in elements: num_seqs * max_seq_len * kv_heads * head_size.
    max_kv_elements = 1 << 24

    def extra_reasons(self, request, device, settings) -> list[str]:
        elements = request.num_seqs * request.max_seq_len * request.num_kv_heads * request.head_size
        if elements > self.max_kv_elements:
            return [f"num_seqs*max_seq_len*num_kv_heads*head_size={elements} (supported: <= {self.max_kv_elements};"
                    " the pages are gathered into one padded tensor)"]
        return []

    def plan(self, request, device, settings) -> Plan:
        return Plan(provider=self.name, route="example_gather_decode",
                    notes=(f"padded K/V {request.num_seqs}x{request.num_kv_heads}x{request.max_seq_len}"
                           f"x{request.head_size}",))

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        q, kc, vc, md = inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata
        _, block_size, kvh, head = kc.shape
        b, num_heads = q.shape[0], q.shape[1]  # decode: one query row per sequence
        group = num_heads // kvh
        seq_lens = np.asarray(md.seq_lens_host, dtype=np.int64)
        tk = int(seq_lens.max())
        nblk = -(-tk // block_size)

        # [b, kvh, tk, head] float32; table entries past a sequence's blocks are whatever the table
        # holds (metal-attn hands providers tables whose every entry is inside the pool).
        table = md.block_tables[:, :nblk]
        k = kc[table].reshape(b, nblk * block_size, kvh, head)[:, :tk].transpose(0, 2, 1, 3).astype(mx.float32)
        v = vc[table].reshape(b, nblk * block_size, kvh, head)[:, :tk].transpose(0, 2, 1, 3).astype(mx.float32)

        # Position j of sequence s is attended when lo_s <= j < seq_len_s.
        cols = np.arange(tk)[None, :]
        attended = cols < seq_lens[:, None]
        if inputs.sliding_window is not None:
            attended &= cols >= (seq_lens - inputs.sliding_window)[:, None]
        mask = mx.array(attended[:, None, None, :])  # [b, 1, 1, tk]

        # Non-finite values: zeroed for the arithmetic, then the (row, head) pairs they reach are NaN.
        k_ok, v_ok = mx.isfinite(k), mx.isfinite(v)
        bad_key = ~(k_ok.all(axis=-1) & v_ok.all(axis=-1))[:, :, None, :]  # [b, kvh, 1, tk]
        k, v = mx.where(k_ok, k, 0.0), mx.where(v_ok, v, 0.0)
        qf = q.astype(mx.float32).reshape(b, kvh, group, head)
        q_ok = mx.isfinite(qf).all(axis=-1)  # [b, kvh, group]
        qf = mx.where(mx.isfinite(qf), qf, 0.0)

        s = (qf * inputs.scale) @ k.transpose(0, 1, 3, 2)  # [b, kvh, group, tk]
        if inputs.softcap is not None:
            s = inputs.softcap * mx.tanh(s / inputs.softcap)
        s = mx.where(mask, s, -mx.inf)
        m = s.max(axis=-1, keepdims=True)
        if inputs.sinks is not None:
            sinks = inputs.sinks.astype(mx.float32).reshape(1, kvh, group, 1)
            m = mx.maximum(m, sinks)
        p = mx.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        if inputs.sinks is not None:
            denom = denom + mx.exp(sinks - m)
        out = (p @ v) / denom  # [b, kvh, group, head]

        poisoned = (mask & bad_key).any(axis=-1) | ~q_ok  # [b, kvh, group]
        out = mx.where(poisoned[..., None], mx.nan, out)
        return out.reshape(b, num_heads, head).astype(q.dtype)
