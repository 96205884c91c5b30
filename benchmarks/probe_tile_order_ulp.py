"""How far apart two correct prefill kernels land in ULP when they walk the keys in different tiles (not a test).

    python3 benchmarks/probe_tile_order_ulp.py OUT.json

Upstream bounds the NAX kernel against the tiled kernel at 2 ULP of the output dtype at the maximum
(0.05 on average). Both kernels keep an online softmax whose reference maximum moves once per key
tile, so two tile sizes give every probability a different scale and every product a different
rounding. This probe measures what that alone does: the tiled kernel against itself with 16-key
and with 32-key tiles (heads 128 and 256, where both tiles fit in 48 KB), on the case of
``tests/gpu/test_nax_gpu.py``'s specialization matrix (block size 16), and the NAX kernel's CUDA twin against each.
Each row also gives every kernel's distance to the float64 oracle rounded to the dtype.
Needs MLX's CUDA backend (the twin).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np


def main() -> None:
    from metal_attn._layout import import_builtin_providers
    from metal_attn.provider import AttentionInputs
    from metal_attn.testing import make_case
    from metal_attn.testing.cases import round_to_dtype, to_numpy
    from metal_attn.testing.ulp import ulp_figures

    import_builtin_providers()
    from metal_attn.providers import nax_prefill as nx
    from metal_attn.providers import tiled_prefill as tp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    args = ap.parse_args()
    tiles = {128: {16: tp.TileConfig(128, 16, rb=2), 32: tp.TileConfig(128, 32, rb=2)},
             256: {16: tp.TileConfig(128, 16, rb=2), 32: tp.TileConfig(128, 32, rb=2)}}
    block = 16  # the matrix case's page size
    rows = []
    for dtype in ("float16", "bfloat16"):
        for head, configs in tiles.items():
            for sinks in (False, True):
                case = make_case(q_lens=[37, 70, 1], seq_lens=[300, 70, 45], num_heads=4, num_kv_heads=2,
                                 head_size=head, block_size=block, dtype=dtype, seed=head + block, sinks=sinks)
                md = case.metadata()
                sk = case.sinks.astype(mx.float32) if case.sinks is not None else None
                outs = {}
                for bkv, cfg in configs.items():
                    out = tp.launch(case.q, case.k_cache, case.v_cache, md, scale=case.scale, sinks=sk,
                                    sliding_window=None, softcap=None, backend="cuda", config=cfg)
                    mx.eval(out)
                    outs[f"tiled_bkv{bkv}"] = to_numpy(out).astype(np.float64)
                twin, _ = nx.run_twin(AttentionInputs(case.q, case.k_cache, case.v_cache, md, case.scale, sk,
                                                      None, None))
                mx.eval(twin)
                outs["nax_twin"] = to_numpy(twin).astype(np.float64)
                ref = round_to_dtype(np.asarray(case.oracle(), dtype=np.float32), dtype).astype(np.float64)
                row = {"dtype": dtype, "head": head, "block": block, "sinks": sinks}
                pairs = [("tiled_bkv16", "tiled_bkv32"), ("nax_twin", "tiled_bkv32"), ("nax_twin", "tiled_bkv16")]
                for a, b in pairs:
                    mx_ulp, mean_ulp = ulp_figures(outs[a], outs[b], dtype)
                    row[f"{a} vs {b}"] = {"max_ulp": mx_ulp, "mean_ulp": round(mean_ulp, 5)}
                for name, out in outs.items():
                    mx_ulp, mean_ulp = ulp_figures(out, ref, dtype)
                    row[f"{name} vs oracle"] = {"max_ulp": mx_ulp, "mean_ulp": round(mean_ulp, 5)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
