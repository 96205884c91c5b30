"""Tile-shape sweep of the tiled prefill kernel on a GPU (not a test).

    python3 benchmarks/sweep_tiled.py OUT.json
    python3 benchmarks/sweep_tiled.py OUT.json --chunks 64:2112,128:4096 [--partitions 0,128,256,512]

Bare launches of ``tiled_prefill.launch`` with each ``(BQ, BKV)`` on causal prefill
shapes (a 4K prompt, a 512-row chunk after 1.5K tokens of context as in the mixed
benchmark batch, head 256), timed pipelined (medians of 10 samples). Every variant's
output is compared with the shipped configuration's (relative L2 <= 1e-2), so a fast
wrong variant cannot win. Winners go into ``providers/tiled_prefill.py::TILE_CONFIGS``
with the figures in docs/bench-h200-tiled.md.

``--chunks Q:L[+Q:L...],...``: instead, prefill batches of 32/8 heads, head 128 (one chunk of ``Q`` rows
ending an ``L``-token sequence per ``Q:L``; ``+`` joins chunks into one batch), each tile shape at each
of ``--partitions`` (0: unsplit; skipped where a partition would not hold two BKV tiles' worth of
keys or the batch spans fewer than two partitions), with MLX SDPA on contiguous K/V queued the
same way in the same run (``vs_mlx``: its time over the variant's): where ``TILE_CONFIGS`` and
``TILED_SPLIT_RULES`` stand for short chunks.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from metal_attn.providers import tiled_prefill as tp

from metal_attn.bench.candidates import pipelined_median_s, rates
from metal_attn.bench.peers import MlxSdpa
from metal_attn.bench.shapes import Rows, Shape, build_case
from metal_attn.bench.timing import PIPELINED_MIN_SAMPLE_S, time_fn
from metal_attn.device import current_device
from metal_attn.testing.conformance import rel_l2

SHAPES = (
    Shape(1, 32, 8, 128, 4096, "bfloat16", q_len=4096),
    Shape.mix((Rows(1, 512, 2048),), 32, 8, 128),
    Shape(1, 16, 2, 256, 4096, "bfloat16", q_len=2048),
)
#: (BQ, BKV, RB) per head size.
CONFIGS = {
    128: ((32, 32, 1), (64, 32, 2), (128, 32, 2), (64, 64, 2), (128, 64, 2), (256, 32, 2), (128, 32, 1)),
    256: ((16, 16, 1), (32, 16, 2), (64, 16, 2), (64, 32, 2), (128, 16, 2), (128, 32, 2)),
}


#: ``--chunks`` mode: tile shapes at head 128 (the shipped one among them).
CHUNK_CONFIGS = ((128, 32, 2), (64, 32, 2), (32, 32, 1), (64, 64, 2), (128, 64, 2))


def _chunks(text: str) -> list[Shape]:
    shapes = []
    for batch in text.split(","):
        try:
            rows = tuple(Rows(1, *(int(x) for x in item.split(":"))) for item in batch.split("+"))
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"--chunks item {batch!r}: {exc} (allowed: Q:L[+Q:L...], positive "
                                             "integers, Q rows at most L tokens of context)") from None
        shapes.append(Shape.mix(rows, 32, 8, 128) if len(rows) > 1 else
                      Shape(1, 32, 8, 128, rows[0].context, "bfloat16", q_len=rows[0].q_len))
    return shapes


def _partitions(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(p < 0 for p in sizes):
        raise argparse.ArgumentTypeError(f"--partitions {text!r} (allowed: non-negative integers, 0 = unsplit)")
    return sizes


def _launch(case, backend: str, cfg: tp.TileConfig, partition_size: int = 0) -> mx.array:
    """One bare tiled launch of ``case`` with tile ``cfg`` (split at ``partition_size`` keys when > 0)."""
    return tp.launch(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale, sinks=None,
                     sliding_window=None, softcap=None, backend=backend, config=cfg, partition_size=partition_size)


def sweep_chunks(shapes: list[Shape], partitions: tuple[int, ...]) -> list[dict]:
    """Every tile shape of `CHUNK_CONFIGS` at every partition size on each batch of ``shapes``, with
    MLX SDPA on contiguous K/V in the same run."""
    backend = current_device().backend
    rows = []
    for shape in shapes:
        case = build_case(shape)
        peer = MlxSdpa().prepare(case)
        peer.run()
        # The peer queues its own work: sampled as the candidates' queued launches are (pipelined_median_s).
        peer_s = time_fn(peer.launch, warmup=3, iters=10, min_sample_s=PIPELINED_MIN_SAMPLE_S).median_s
        shipped = tp.tile_config(backend, shape.head_size)
        ref = np.array(_launch(case, backend, shipped).astype(mx.float32))
        label = "+".join(f"{r.q_len}@{r.context}" for r in shape.rows)
        print(json.dumps({"batch": label, "mlx_sdpa_us": peer_s * 1e6}), flush=True)
        for bq, bkv, rb in CHUNK_CONFIGS:
            cfg = tp.TileConfig(bq, bkv, rb)
            for psize in partitions:
                if psize and (psize % bkv or psize < 2 * bkv or -(-shape.context // psize) < 2):
                    continue
                try:
                    got = _launch(case, backend, cfg, psize)
                    mx.eval(got)
                    sec = pipelined_median_s(lambda cfg=cfg, psize=psize, case=case: _launch(case, backend, cfg, psize))
                except RuntimeError as exc:
                    print(json.dumps({"batch": label, "config": [bq, bkv, rb, psize], "error": str(exc)}))
                    continue
                err = rel_l2(got, ref)
                row = {"batch": label, "bq": bq, "bkv": bkv, "rb": rb, "partition_size": psize,
                       "shipped_tile": cfg == shipped, "us": sec * 1e6, "tflops": rates(shape, sec)[1],
                       "mlx_sdpa_us": peer_s * 1e6, "vs_mlx": peer_s / sec, "rel_l2": err}
                print(json.dumps(row), flush=True)
                assert err <= 1e-2, row
                rows.append(row)
        case.release()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--chunks", type=_chunks, default=None, help="Q:L[+Q:L...],...: prefill batches (see above)")
    ap.add_argument("--partitions", type=_partitions, default=(0, 128, 256, 512),
                    help="partition sizes with --chunks (0: unsplit)")
    args = ap.parse_args()
    if args.chunks:
        with open(args.out, "w") as f:
            json.dump({"backend": current_device().backend, "rows": sweep_chunks(args.chunks, args.partitions)},
                      f, indent=1)
        return
    shape_sweep(args.out)


def shape_sweep(path: str) -> None:
    """The tile-shape sweep on `SHAPES` (the module docstring's first mode)."""
    backend = current_device().backend
    rows = []
    for shape in SHAPES:
        case = build_case(shape)
        shipped = tp.tile_config(backend, shape.head_size)
        ref = np.array(_launch(case, backend, shipped).astype(mx.float32))
        for bq, bkv, rb in CONFIGS[shape.head_size]:
            cfg = tp.TileConfig(bq, bkv, rb)
            try:
                got = _launch(case, backend, cfg)
                mx.eval(got)
                sec = pipelined_median_s(lambda cfg=cfg, case=case: _launch(case, backend, cfg))
            except RuntimeError as exc:  # e.g. more registers than the SM has for this many threads
                print(json.dumps({"shape": shape.label, "config": [bq, bkv, rb], "error": str(exc)}))
                continue
            err = rel_l2(got, ref)
            row = {"shape": shape.label, "bq": bq, "bkv": bkv, "rb": rb, "shipped": cfg == shipped, "us": sec * 1e6,
                   "tflops": rates(shape, sec)[1], "rel_l2": err}
            print(json.dumps(row), flush=True)
            assert err <= 1e-2, row
            rows.append(row)
    with open(path, "w") as f:
        json.dump({"backend": backend, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
