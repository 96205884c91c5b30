"""`DensePrefillProvider`: one batched dense-mask attention call for short prefill batches.

It gathers every sequence's pages into a padded ``[num_seqs, kv_heads, max_seq_len,
head_size]`` tensor, pads the queries to ``max_q_len`` rows, builds one boolean mask
(causal rule, sliding window, padding) and makes a single
``mx.fast.scaled_dot_product_attention`` call for the whole batch. The padding
makes memory and work grow with ``num_seqs * max_q_len * max_seq_len``, so it
admits short sequences only and says so when it refuses.

It honours metal-attn's NaN contract (``docs/providers.md``), which the
conformance suite checks: a NaN or infinity in a query row, or in the K/V row of
a position that row attends to, makes that (row, head) NaN; one anywhere else
(a masked position, padding, an unused slot) changes nothing. A dense softmax
would let a masked NaN V row in (its weight is 0, and 0 * NaN is NaN) and drop
a key scored -inf, so non-finite values are replaced by zeros before the SDPA
call and the poisoned (row, head) pairs are set to NaN from the mask.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from metal_attn import AttentionInputs, Plan, Provider


class DensePrefillProvider(Provider):
    """Dense-mask prefill for small batches of short sequences (any backend MLX runs on)."""

    name = "example_dense_prefill"
    #: Above the built-in ``reference`` provider (0), below the built-in kernels.
    priority = 5
    backends = frozenset({"metal", "cuda", "cpu"})
    phases = frozenset({"prefill", "verify"})
    features = frozenset({"sinks", "sliding_window"})
    description = "Example plugin: gather pages, one batched MLX SDPA call with a dense mask (short prefills only)."

    #: Longest sequence admitted (KV tokens, this step's included).
    max_seq_len = 1024
    #: Largest padded score matrix per head admitted: num_seqs * max_q_len * max_seq_len.
    max_mask_elements = 1 << 20

    def extra_reasons(self, request, device, settings) -> list[str]:
        reasons = []
        if request.max_seq_len > self.max_seq_len:
            reasons.append(
                f"max_seq_len={request.max_seq_len} (supported: <= {self.max_seq_len}; "
                "the dense mask is built over the whole padded batch)"
            )
        elements = request.num_seqs * request.max_q_len * request.max_seq_len
        if elements > self.max_mask_elements:
            reasons.append(
                f"num_seqs*max_q_len*max_seq_len={request.num_seqs}*{request.max_q_len}*{request.max_seq_len}"
                f"={elements} (supported: <= {self.max_mask_elements} mask elements)"
            )
        return reasons

    def plan(self, request, device, settings) -> Plan:
        return Plan(
            provider=self.name,
            route="example_dense_prefill",
            specialization=(request.dtype, request.head_size),
            notes=(f"padded batch {request.num_seqs}x{request.max_q_len}x{request.max_seq_len}",),
        )

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        q, kc, vc, md = inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata
        _, block_size, kvh, head = kc.shape
        num_heads = q.shape[1]
        q_lens = np.asarray(md.q_lens_host, dtype=np.int64)
        seq_lens = np.asarray(md.seq_lens_host, dtype=np.int64)
        b, tq, tk = len(q_lens), int(q_lens.max()), int(seq_lens.max())
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])

        # Pages -> padded contiguous K/V: [b, kvh, tk, head]. Every table entry a provider is given names a page
        # of the pool (paged_attention checks the tables first); slots past a sequence's length hold whatever
        # the pool holds, which the mask below keeps out.
        nblk = -(-tk // block_size)
        table = md.block_tables[:, :nblk]
        k = kc[table].reshape(b, nblk * block_size, kvh, head)[:, :tk].transpose(0, 2, 1, 3)
        v = vc[table].reshape(b, nblk * block_size, kvh, head)[:, :tk].transpose(0, 2, 1, 3)
        # Non-finite K/V rows (per key and KV head) are zeroed here, since a masked score still multiplies its
        # V row by 0 and 0 * NaN is NaN, and poison, below, the rows that attend them.
        k_ok, v_ok = mx.isfinite(k), mx.isfinite(v)
        bad_key = ~(k_ok.all(axis=-1) & v_ok.all(axis=-1))  # [b, kvh, tk]
        k, v = mx.where(k_ok, k, 0), mx.where(v_ok, v, 0)

        # Queries padded to tq rows per sequence (padding repeats the sequence's first row).
        rows = np.arange(tq)[None, :]
        valid = rows < q_lens[:, None]  # [b, tq]
        q_idx = np.where(valid, starts[:, None] + rows, starts[:, None])
        qp = q[mx.array(q_idx.reshape(-1).astype(np.int32))].reshape(b, tq, num_heads, head).transpose(0, 2, 1, 3)
        q_ok = mx.isfinite(qp)
        qp = mx.where(q_ok, qp, 0)

        # One mask for the batch: query row i of sequence s sees [lo, seq_len - q_len + i].
        hi = (seq_lens - q_lens)[:, None] + np.arange(tq)[None, :]  # [b, tq], inclusive
        cols = np.arange(tk)[None, None, :]
        allowed = cols <= hi[:, :, None]
        if inputs.sliding_window is not None:
            allowed &= cols > hi[:, :, None] - inputs.sliding_window
        allowed |= ~valid[:, :, None] & (cols == 0)  # padded rows see one key: no all-masked row
        mask = mx.array(allowed[:, None])  # [b, 1, tq, tk]

        sinks = inputs.sinks.astype(q.dtype) if inputs.sinks is not None else None
        out = mx.fast.scaled_dot_product_attention(qp, k, v, scale=inputs.scale, mask=mask, sinks=sinks)
        # Poisoned (row, head): a non-finite query element, or a non-finite key the row attends.
        group = num_heads // kvh
        reached = (mask & bad_key[:, :, None, :]).any(axis=-1)  # [b, kvh, tq]
        poisoned = mx.repeat(reached, group, axis=1) | ~q_ok.all(axis=-1)  # [b, heads, tq]
        out = mx.where(poisoned[..., None], mx.array(float("nan"), dtype=out.dtype), out)
        out = out.transpose(0, 2, 1, 3).reshape(b * tq, num_heads, head)
        keep = np.nonzero(valid.reshape(-1))[0]
        if keep.size == out.shape[0]:
            return out
        return out[mx.array(keep.astype(np.int32))]
