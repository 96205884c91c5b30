"""Where MLX's fused SDPA exists on this backend, and where gathering pages for it beats the tiled kernel.

The measurements behind ``providers/sdpa_prefill.py``'s rule (``SDPA_PREFILL_RULES``):

1. ``fused``: for each dtype, head size, GQA group, sinks and query/key length relation, whether
   ``mx.fast.scaled_dot_product_attention(..., force_fused=True)`` accepts the call (MLX raises at
   call time when no fused kernel exists; without ``force_fused`` it would silently fall back to
   unfused matmuls, whose scores take ``q_len * kv_len`` memory per head);
2. ``crossover``: small prefill chunks after some context, 32/8 heads, head 128, bf16, block 16:
   the tiled kernel (``provider="tiled_prefill"``) against the route itself
   (``provider="sdpa_prefill"``, its rule opened to every chunk), medians of calls each waited
   for (``--pipelined``: queued, one wait per sample), in the same run;
3. ``mixed``: mixed batches (decode rows, then one or two prefill chunks of 128 to 2,048 rows), the tiles'
   mixed route against ``sdpa_prefill_decode`` (the rule opened the same way): where
   ``min_mixed_chunk_rows`` comes from.

Usage (GPU): ``python benchmarks/probe_sdpa_fused.py --json OUT.json [--only mixed] [--pipelined]``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import mlx.core as mx
import numpy as np

from metal_attn.testing.overrides import opened_sdpa_prefill_rule

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


#: ``--pipelined``: time queued calls (one wait per sample) instead of one wait per call.
PIPELINED = False


def _median_ms(fn, warmup: int = 3, iters: int = 15) -> float:
    """Median ms per call (`metal_attn.bench.timing.time_calls`): every call waited for, or with
    `PIPELINED` every call queued and each sample (of at least 50 ms) waited for once (calls overlap the
    host's next build)."""
    from metal_attn.bench.timing import time_calls

    return time_calls(fn, pipelined=PIPELINED, warmup=warmup, iters=iters).median_s * 1e3


def _chunk(ql: int, ctx: int, h: int = 32, kvh: int = 8, d: int = 128, bs: int = 16) -> dict:
    """One prefill chunk of ``ql`` rows ending a ``ctx``-token sequence: tiled against the route."""
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

    def route():
        return metal_attn.paged_attention(q, pool, vpool, metadata=md, scale=d ** -0.5, provider="sdpa_prefill")

    with opened_sdpa_prefill_rule():  # once around both: a dispatch epoch per call would re-plan every call
        t_tiled, t_route = _median_ms(tiled), _median_ms(route)
        err = float(mx.abs(tiled().astype(mx.float32) - route().astype(mx.float32)).max())
    return {"q_len": ql, "context": ctx, "tiled_ms": t_tiled, "sdpa_prefill_ms": t_route,
            "sdpa_vs_tiled": t_tiled / t_route, "max_abs_diff": err}


def mixed() -> list[dict]:
    """Mixed batches through ``paged_attention``: the tiles' mixed route against ``sdpa_prefill_decode``."""
    import metal_attn
    from metal_attn.bench.shapes import Rows, Shape, build_case
    from metal_attn.testing.conformance import rel_l2

    rows = []
    batches = [(Rows(dec, 1, 4096 if dec == 8 else 1024), Rows(1, ql, ctx))
               for dec, ql, ctx in ((8, 32, 2048), (8, 64, 2048), (8, 128, 2048), (8, 256, 2048),
                                    (8, 512, 2048), (32, 32, 1024), (32, 64, 1024), (32, 512, 1024),
                                    (8, 1024, 4096), (8, 2048, 4096))]
    # The prefill-gpu suite's batch of two chunks, and 32 decode rows at 1K with one chunk of each size.
    batches.append((Rows(32, 1, 1024), Rows(1, 256, 1024), Rows(1, 256, 2048)))
    batches += [(Rows(32, 1, 1024), Rows(1, ql, 2048)) for ql in (128, 256, 1024)]
    for rows_of in batches:
        case = build_case(Shape.mix(rows_of, 32, 8, 128))

        def run(provider, c=case):
            return metal_attn.paged_attention(c.q, c.k_pool, c.v_pool, metadata=c.metadata, scale=c.scale,
                                              provider=provider)

        with opened_sdpa_prefill_rule():
            t_tiled, t_sdpa = _median_ms(lambda: run("tiled_prefill")), _median_ms(lambda: run("sdpa_prefill"))
            diff = rel_l2(np.array(run("sdpa_prefill").astype(mx.float32)),
                          np.array(run("tiled_prefill").astype(mx.float32)))
        r = {"label": case.shape.label, "tiled_ms": t_tiled, "sdpa_ms": t_sdpa, "sdpa_vs_tiled": t_tiled / t_sdpa,
             "rel_l2": diff}
        rows.append(r)
        print(f"{r['label']:48s} tiled {t_tiled:7.3f} ms  sdpa_prefill_decode {t_sdpa:7.3f} ms  "
              f"({r['sdpa_vs_tiled']:5.2f}x)  rel_l2 {diff:.2g}", flush=True)
    return rows


def crossover() -> list[dict]:
    rows = []
    for ql, ctx in ((24, 1024), (32, 2048), (64, 2048), (128, 4096), (256, 4096),
                    (512, 8192), (1024, 8192), (2048, 2048)):
        r = _chunk(ql, ctx)
        rows.append(r)
        print(f"q{ql:5d} L{ctx:6d}: tiled {r['tiled_ms']:7.3f} ms  sdpa_prefill {r['sdpa_prefill_ms']:7.3f} ms  "
              f"({r['sdpa_vs_tiled']:5.2f}x)  max|diff| {r['max_abs_diff']:.3g}", flush=True)
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
    ap.add_argument("--only", default="fused,crossover,mixed,layouts",
                    help="comma-separated parts to run (default: all four)")
    ap.add_argument("--pipelined", action="store_true",
                    help="time queued calls, one wait per sample (default: every call waited for)")
    args = ap.parse_args()
    global PIPELINED
    PIPELINED = args.pipelined
    parts = set(args.only.split(","))
    fused = fused_matrix() if "fused" in parts else []
    ok = [r for r in fused if r["fused"]]
    print(f"fused SDPA: {len(ok)}/{len(fused)} configurations")
    for key in ("dtype", "head", "group", "sinks", "q_len"):
        refused = sorted({r[key] for r in fused if not r["fused"]} - {r[key] for r in ok}, key=str)
        print(f"  {key}: refused everywhere for {refused}; fused somewhere for "
              f"{sorted({r[key] for r in ok}, key=str)}")
    for err in sorted({r.get("error", "") for r in fused if not r["fused"]}):
        print("  error:", err)
    cross = crossover() if "crossover" in parts else []
    mix = mixed() if "mixed" in parts else []
    layout = layouts() if "layouts" in parts else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": mx.device_info().get("device_name"), "mlx": mx.__version__,
                       "mode": "pipelined" if PIPELINED else "blocking", "fused": fused,
                       "crossover": cross, "mixed": mix, "layouts": layout}, f, indent=1)


if __name__ == "__main__":
    main()
