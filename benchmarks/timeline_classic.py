"""Per-threadgroup timeline of the classic split kernel on CUDA (a profiling aid, not a test).

    python3 benchmarks/timeline_classic.py [BATCH CONTEXT ...]   # default: 8 4096  1 32768  32 4096

32/8 heads, head 128, bf16 decode, the shipped geometry. The kernel text is instrumented
in memory (never in kernels_v2/): each threadgroup records the GPU's global timer when it
starts, when its first staged chunk has landed, and when it is done, plus its SM. Printed
per shape: percentiles of those times, of the threadgroup durations and of each SM's last
end, and the K/V bandwidth delivered over time (chunk 0 counted when it lands, the
others spread evenly up to the end). docs/bench-h200-classic.md (session 7) has
what it showed.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from metal_attn.providers import gpu_common as gc

from metal_attn import kernels
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.constants import LOG2E, PARTITION_SIZE

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
#: (where, what to insert after it): the three timer reads and the record, written by thread 0.
PROBES = (
    ("const int part = int(threadgroup_position_in_grid.z);\n",
     "unsigned long long ma_t0, ma_t1 = 0, ma_t2;\nunsigned ma_sm;\n"
     'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ma_t0));\n'
     'asm volatile("mov.u32 %0, %%smid;" : "=r"(ma_sm));\n'),
    ("threadgroup_barrier(mem_flags::mem_threadgroup);\n  const int cb = t_begin + c * STAGE;\n",
     'if (c == 0) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ma_t1)); }\n'),
)
RECORD = ("__syncthreads();\nif (tid == 0) {\n"
          '  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ma_t2));\n'
          "  const long g = (long(part) * gridDim.y + qtok) * gridDim.x + blockIdx.x;\n"
          "  timing[g * 4] = ma_t0; timing[g * 4 + 1] = ma_t1; timing[g * 4 + 2] = ma_t2; timing[g * 4 + 3] = ma_sm;\n"
          "}\n")


def instrumented_kernel():
    """The staged matrix-path split kernel with the probes, as a CUDA kernel object (extra output ``timing``)."""
    header, body = kernels.assemble("paged_attention", gc.PAGED_FILES, "cuda",
                                    {"PA_SPLIT": 1, "PA_STAGED": 1, "PA_MMA": 1})
    for anchor, probe in PROBES:
        if anchor not in body:
            raise SystemExit(f"the kernel text changed: anchor {anchor!r} not found; update PROBES")
        body = body.replace(anchor, anchor + probe, 1)
    body += RECORD
    return mx.fast.cuda_kernel(name="ma_timeline_paged", input_names=list(gc.PA_INPUTS),
                               output_names=[*gc.PA_OUTPUTS[1], "timing"], source=body, header=header)


def timeline(kern, batch: int, context: int) -> tuple[np.ndarray, gc.Geometry]:
    """([threadgroups, 4] int64: start, first chunk landed, end (ns, global timer), SM id; the geometry)."""
    case = build_case(Shape(batch, HEADS, KV_HEADS, HEAD, context, "bfloat16"))
    md = case.metadata
    geo = gc.launch_geometry(case.q, case.k_pool, md, partition_size=512, backend="cuda")
    if not (geo.stage and geo.mma):
        raise SystemExit(f"{geo}: the probes sit on the staged matrix path; this shape does not take it")
    parts = -(-context // PARTITION_SIZE)
    params = kernels.param_array((md.num_seqs, HEADS, KV_HEADS, md.max_blocks_per_seq, 0, parts, 0), "int32")
    fparams = kernels.param_array((case.scale * LOG2E, 0.0), "float32")
    groups = KV_HEADS * batch * parts

    def launch() -> list[mx.array]:
        return kern(inputs=[case.q, case.k_pool, case.v_pool, md.block_tables, md.seq_lens, md.cu_seqlens_q,
                            gc.zeros_f32(HEADS), params, fparams],
                    template=gc.paged_template(case.q.dtype, HEAD, BLOCK, 512, geo, gc.PREFETCH_NEXT["cuda"]),
                    grid=(geo.grid_x(HEADS), batch, parts), threadgroup=(geo.threads, 1, 1),
                    output_shapes=[(batch, HEADS, parts), (batch, HEADS, parts), (batch, HEADS, parts, HEAD),
                                   (groups * 4,)],
                    output_dtypes=[mx.float32] * 3 + [mx.int64])

    for _ in range(3):  # compile, warm the caches
        mx.eval(launch())
    out = launch()
    mx.eval(out)
    return np.array(out[3]).reshape(groups, 4), geo


def report(t: np.ndarray, geo: gc.Geometry, label: str) -> None:
    base = t[:, 0].min()
    start, first, end = ((t[:, i] - base) / 1e3 for i in range(3))
    sm = t[:, 3]

    def pct(a: np.ndarray) -> str:
        return " ".join(f"{x:6.1f}" for x in np.percentile(a, [0, 10, 50, 90, 100]))

    sms = np.unique(sm)
    last = np.array([end[sm == s].max() for s in sms])
    print(f"{label}: {len(t)} threadgroups on {len(sms)} SMs, span {end.max():.1f} us")
    print("  µs, percentiles 0/10/50/90/100")
    print(f"  start                 {pct(start)}")
    print(f"  first chunk - start   {pct(first - start)}")
    print(f"  end                   {pct(end)}")
    print(f"  duration              {pct(end - start)}")
    print(f"  each SM's last end    {pct(last)}")
    chunks = PARTITION_SIZE // geo.stage
    chunk_kib = 2 * geo.stage * HEAD * 2 / 1024  # K and V rows, bf16
    bins = np.arange(0.0, end.max() + 2.0, 2.0)
    delivered = np.zeros(len(bins))
    for f0, e0 in zip(first, end):
        delivered[np.searchsorted(bins, f0, side="right") - 1] += chunk_kib
        lo = np.clip(bins, f0, e0)
        hi = np.clip(bins + 2.0, f0, e0)
        delivered += chunk_kib * (chunks - 1) * (hi - lo) / max(e0 - f0, 1e-9)
    tbps = delivered * 1024 / 2e-6 / 1e12
    print("  TB/s delivered per 2 µs: " + " ".join(f"{x:.1f}" for x in tbps))


def main(argv: list[str]) -> None:
    nums = [int(x) for x in argv] or [8, 4096, 1, 32768, 32, 4096]
    if len(nums) % 2:
        raise SystemExit("arguments: BATCH CONTEXT pairs")
    kern = instrumented_kernel()
    for batch, context in zip(nums[::2], nums[1::2]):
        t, geo = timeline(kern, batch, context)
        report(t, geo, f"b{batch} h{HEADS}/{KV_HEADS} d{HEAD} L{context}")


if __name__ == "__main__":
    main(sys.argv[1:])
