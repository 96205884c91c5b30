"""Where MLX's fused SDPA exists on this backend, and where gathering pages for it beats the tiled kernel.

The measurements behind ``providers/sdpa_prefill.py``'s rule (``SDPA_PREFILL_RULES``):

1. ``fused``: for each dtype, head size, GQA group, sinks and query/key length relation, whether
   ``mx.fast.scaled_dot_product_attention(..., force_fused=True)`` accepts the call (MLX raises at
   call time when no fused kernel exists; without ``force_fused`` it would silently fall back to
   unfused matmuls, whose scores take ``q_len * kv_len`` memory per head);
2. ``crossover``: small prefill chunks after some context, 32/8 heads, head 128, bf16, block 16:
   the tiled kernel (``provider="tiled_prefill"``) against the gathered-SDPA route (one ``mx.take``
   per pool, then fused SDPA), medians of queued calls, in the same run.

Usage (GPU): ``python benchmarks/probe_sdpa_fused.py --json OUT.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import mlx.core as mx
import numpy as np

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}


def fused_matrix() -> list[dict]:
    rows = []
    for (dt, dtype), head, group, sinks, (ql, kl) in itertools.product(
            DTYPES.items(), (64, 80, 96, 128, 160, 192, 256), (1, 4, 8), (False, True),
            ((64, 64), (48, 300), (1, 300), (256, 4096))):
        kvh = 2
        q = mx.random.normal((1, kvh * group, ql, head)).astype(dtype)
        k = mx.random.normal((1, kvh, kl, head)).astype(dtype)
        s = mx.zeros((kvh * group,), dtype=dtype) if sinks else None
        entry = {"dtype": dt, "head": head, "group": group, "sinks": sinks, "q_len": ql, "kv_len": kl}
        try:
            out = mx.fast.scaled_dot_product_attention(q, k, k, scale=head ** -0.5,
                                                       mask="causal" if ql > 1 else None, sinks=s,
                                                       force_fused=True)
            mx.eval(out)
            entry["fused"] = True
        except Exception as exc:  # the message is the measurement
            entry["fused"] = False
            entry["error"] = str(exc)[:160]
        rows.append(entry)
    return rows


def _median_ms(fn, warmup: int = 3, iters: int = 15) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        mx.synchronize()
        t = time.perf_counter()
        n = 0
        while True:
            mx.async_eval(fn())
            n += 1
            mx.synchronize()
            if time.perf_counter() - t > 2e-3:
                break
        samples.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(samples)


def _chunk(ql: int, ctx: int, h: int = 32, kvh: int = 8, d: int = 128, bs: int = 16) -> dict:
    """One prefill chunk of ``ql`` rows ending a ``ctx``-token sequence: tiled against gathered SDPA."""
    import metal_attn

    nblk = -(-ctx // bs)
    rng = np.random.default_rng(ql)
    pool = mx.random.normal((nblk + 8, bs, kvh, d)).astype(mx.bfloat16)
    vpool = mx.random.normal((nblk + 8, bs, kvh, d)).astype(mx.bfloat16)
    table = mx.array(rng.permutation(nblk + 8)[:nblk].astype(np.int32)[None])
    q = mx.random.normal((ql, h, d)).astype(mx.bfloat16)
    md = metal_attn.AttentionMetadata.build(table, mx.array([ctx], dtype=mx.int32), mx.array([0, ql], dtype=mx.int32))
    mx.eval(pool, vpool, table, q)

    def tiled():
        return metal_attn.paged_attention(q, pool, vpool, metadata=md, scale=d ** -0.5, provider="tiled_prefill")

    def gathered():
        k = mx.take(pool, table[0], axis=0).reshape(1, nblk * bs, kvh, d)[:, :ctx].transpose(0, 2, 1, 3)
        v = mx.take(vpool, table[0], axis=0).reshape(1, nblk * bs, kvh, d)[:, :ctx].transpose(0, 2, 1, 3)
        o = mx.fast.scaled_dot_product_attention(q.reshape(1, ql, h, d).transpose(0, 2, 1, 3), k, v,
                                                 scale=d ** -0.5, mask="causal")
        return o.transpose(0, 2, 1, 3).reshape(ql, h, d)

    t_tiled, t_gather = _median_ms(tiled), _median_ms(gathered)
    err = float(mx.abs(tiled().astype(mx.float32) - gathered().astype(mx.float32)).max())
    return {"q_len": ql, "context": ctx, "tiled_ms": t_tiled, "gather_sdpa_ms": t_gather,
            "gather_vs_tiled": t_tiled / t_gather, "max_abs_diff": err}


def crossover() -> list[dict]:
    rows = []
    for ql, ctx in ((8, 1024), (16, 1024), (32, 2048), (64, 2048), (128, 4096), (256, 4096), (512, 8192),
                    (1024, 8192), (2048, 2048)):
        r = _chunk(ql, ctx)
        rows.append(r)
        print(f"q{ql:5d} L{ctx:6d}: tiled {r['tiled_ms']:7.3f} ms  gather+sdpa {r['gather_sdpa_ms']:7.3f} ms  "
              f"({r['gather_vs_tiled']:5.2f}x)  max|diff| {r['max_abs_diff']:.3g}", flush=True)
    return rows


def layouts() -> list[dict]:
    """Fused SDPA's speed by operand layout: K/V as ``[n, KVH, L, D]`` (each head's keys contiguous)
    or a transposed view of ``[n, L, KVH, D]`` (the pages' layout); q contiguous or a view."""
    rows = []
    for n, ql, ctx in ((8, 2048, 2048), (1, 512, 33280), (1, 4096, 4096)):
        h, kvh, d = 32, 8, 128
        q_rows = mx.random.normal((n, ql, h, d)).astype(mx.bfloat16)
        kv_rows = mx.random.normal((n, ctx, kvh, d)).astype(mx.bfloat16)
        q_heads = mx.contiguous(q_rows.transpose(0, 2, 1, 3))
        kv_heads = mx.contiguous(kv_rows.transpose(0, 2, 1, 3))
        mx.eval(q_rows, kv_rows, q_heads, kv_heads)
        variants = {
            "q view, kv view": (q_rows.transpose(0, 2, 1, 3), kv_rows.transpose(0, 2, 1, 3)),
            "q view, kv heads": (q_rows.transpose(0, 2, 1, 3), kv_heads),
            "q heads, kv heads": (q_heads, kv_heads),
        }
        entry = {"n": n, "q_len": ql, "context": ctx}
        for name, (qq, kk) in variants.items():
            entry[name] = _median_ms(lambda qq=qq, kk=kk: mx.fast.scaled_dot_product_attention(
                qq, kk, kk, scale=0.08838834764831845, mask="causal"))  # 1 / sqrt(128)
        rows.append(entry)
        print("layout", entry, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    fused = fused_matrix()
    ok = [r for r in fused if r["fused"]]
    print(f"fused SDPA: {len(ok)}/{len(fused)} configurations")
    for key in ("dtype", "head", "group", "sinks", "q_len"):
        refused = sorted({r[key] for r in fused if not r["fused"]} - {r[key] for r in ok}, key=str)
        print(f"  {key}: refused everywhere for {refused}; fused somewhere for "
              f"{sorted({r[key] for r in ok}, key=str)}")
    for err in sorted({r.get("error", "") for r in fused if not r["fused"]}):
        print("  error:", err)
    cross = crossover()
    layout = layouts()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": mx.device_info().get("device_name"), "mlx": mx.__version__, "fused": fused,
                       "crossover": cross, "layouts": layout}, f, indent=1)


if __name__ == "__main__":
    main()
