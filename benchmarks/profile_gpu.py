"""Kernel-level profile on the CUDA backend (not a test): where the decode kernels' time goes.

    python3 benchmarks/profile_gpu.py OUT.json

Uses the profiler the H200 image has: torch.profiler (CUPTI activity tracing), which
records every kernel launched in the process, MLX's included, with its GPU duration
and launch facts (registers per thread, blocks per SM, estimated achieved occupancy).
For each case it reports the GPU time of each kernel (median over the traced calls),
K+V bytes over the summed kernel time (no host overhead), and the launch facts.

Cases:

- the two decode kernels (``gqa_decode`` with its reducer; ``classic`` split and
  unsplit) at the shipped tuning;
- ``paged_read`` probes: a kernel that only reads the same pages through the same
  block tables with the same per-warp addressing (CHUNK rows in flight per warp) and
  does no attention arithmetic. ``dup`` makes every warp of a threadgroup read the
  same rows (as the co-located GQA heads do); ``split`` gives each warp its own rows.
  Their bandwidth is what the memory access pattern allows; the gap between a probe
  and a kernel is the kernel's arithmetic and dependency chains;
- a device-to-device copy (the ceiling) and torch SDPA on contiguous K/V.
"""

from __future__ import annotations

import functools
import json
import sys

import mlx.core as mx
from kernel_trace import summarise, trace
from metal_attn.providers import gpu_common as gc
from metal_attn.providers import gqa_decode as gq

from metal_attn.bench.shapes import Shape, build_case
from metal_attn.device import current_device

PROBE_SOURCE = r"""
const int part = int(blockIdx.x);
const int kv_head = int(blockIdx.y);
const int seq = int(blockIdx.z);
const int warp = int(threadIdx.x) >> 5;
const int lane = int(threadIdx.x) & 31;
const int n = seq_lens[seq];
const int start = part * PARTITION;
if (start >= n) return;
const int end = min(start + PARTITION, n);
const int mb = dims[0];
const long head_off = long(kv_head) * HEAD + lane * (HEAD / 32);
float acc = 0.0f;
const int first = start + (SPLIT ? warp * CHUNK : 0);
const int stride = CHUNK * (SPLIT ? WARPS : 1);
for (int t0 = first; t0 < end; t0 += stride) {
  uint2 rk[CHUNK][HEAD / 128];
  uint2 rv[CHUNK][HEAD / 128];
#pragma unroll
  for (int c = 0; c < CHUNK; ++c) {
    const int tok = t0 + c;
    const int page = tok < end ? block_tables[seq * mb + tok / BS] : 0;
    const long addr = (long(page) * BS + tok % BS) * TOKEN_STRIDE + head_off;
#pragma unroll
    for (int v = 0; v < HEAD / 128; ++v) {
      rk[c][v] = tok < end ? *reinterpret_cast<const uint2*>(k_cache + addr + 4 * v) : make_uint2(0, 0);
      rv[c][v] = tok < end ? *reinterpret_cast<const uint2*>(v_cache + addr + 4 * v) : make_uint2(0, 0);
    }
  }
#pragma unroll
  for (int c = 0; c < CHUNK; ++c) {
#pragma unroll
    for (int v = 0; v < HEAD / 128; ++v) {
      acc += __uint_as_float((rk[c][v].x ^ rv[c][v].y) & 0x3f800000u);
    }
  }
}
out[(long(seq) * gridDim.y + kv_head) * gridDim.x * WARPS + part * WARPS + warp] = acc;
"""


@functools.cache
def _probe_kernel():
    return mx.fast.cuda_kernel(name="paged_read_probe", input_names=["k_cache", "v_cache", "block_tables",
                                                                       "seq_lens", "dims"],
                               output_names=["out"], source=PROBE_SOURCE)


def cases(backend: str):
    shapes = [
        ("gqa b1 32/8/128 L32768", Shape(1, 32, 8, 128, 32768, "bfloat16"), 512),
        ("gqa b8 32/8/128 L32768", Shape(8, 32, 8, 128, 32768, "bfloat16"), 512),
        ("gqa b1 24/4/256 L65536", Shape(1, 24, 4, 256, 65536, "bfloat16"), 512),
    ]
    for label, shape, p in shapes:
        case = build_case(shape)
        yield label, shape, (lambda c=case, p=p: gq.launch(c.q, c.k_pool, c.v_pool, c.metadata, scale=c.scale,
                                                           partition_size=p, backend=backend))
        yield from _probes(label.replace("gqa", "probe"), shape, case, p)
        if label.startswith("gqa b8"):
            yield from _classic(shape, case, backend, split=True)
            yield from _torch(shape, case)
    shape = Shape(64, 32, 8, 128, 8192, "bfloat16")
    case = build_case(shape)
    yield from _classic(shape, case, backend, split=False)
    yield from _probes("probe b64 32/8/128 L8192", shape, case, 512)


def _classic(shape, case, backend, *, split):
    def run(c=case):
        return gc.launch_paged(c.q, c.k_pool, c.v_pool, c.metadata, scale=c.scale, sinks=None,
                               sliding_window=None, softcap=None,
                               partition_size=512 if split else 0, backend=backend)

    yield f"classic split={int(split)} b{shape.batch} L{shape.context}", shape, run


def _probes(label, shape, case, partition):
    kern = _probe_kernel()
    group = shape.num_heads // shape.num_kv_heads
    parts = -(-shape.context // partition)
    dims = mx.array([case.metadata.max_blocks_per_seq], mx.int32)
    for warps, split, chunk in ((group, 0, 4), (group, 0, 16), (group, 1, 4), (1, 0, 16)):
        def run(w=warps, s=split, ch=chunk):
            return kern(inputs=[case.k_pool, case.v_pool, case.metadata.block_tables, case.metadata.seq_lens, dims],
                        template=[("PARTITION", partition), ("HEAD", shape.head_size), ("BS", shape.block_size),
                                  ("TOKEN_STRIDE", shape.num_kv_heads * shape.head_size), ("CHUNK", ch),
                                  ("WARPS", w), ("SPLIT", s)],
                        grid=(32 * w * parts, shape.num_kv_heads, shape.batch), threadgroup=(32 * w, 1, 1),
                        output_shapes=[(shape.batch * shape.num_kv_heads * parts * w,)],
                        output_dtypes=[mx.float32], init_value=0)[0]

        yield f"{label} warps={warps} {'split' if split else 'dup'} chunk={chunk}", shape, run


def _torch(shape, case):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return
    b, h, kvh, d, n = shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size, shape.context
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kvh, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    src = torch.empty(shape.kv_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return mx.array(0)

    def copy():
        dst.copy_(src)
        return mx.array(0)

    yield f"torch_sdpa b{b} L{n}", shape, sdpa
    yield f"copy {shape.kv_bytes >> 20} MiB (read+write = 2x bytes)", shape, copy


def main(out_path: str) -> None:
    mx.set_cache_limit(1 << 34)
    backend = current_device().backend
    results = []
    for label, shape, fn in cases(backend):
        events = trace(fn, calls=10)
        row = {"case": label, "kv_bytes": shape.kv_bytes, **summarise(events, 10, shape.kv_bytes)}
        results.append(row)
        k0 = row["kernels"][0] if row["kernels"] else {}
        print(f"{label:55s} {row['gpu_us_per_call']:9.1f} us  {row['gbps_gpu_time'] or 0:7.0f} GB/s  "
              f"regs={k0.get('registers_per_thread')} blocks/SM={k0.get('blocks_per_sm')} "
              f"occ={k0.get('occupancy_pct')}", flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": current_device().describe(), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 benchmarks/profile_gpu.py OUT.json")
    main(sys.argv[1])
