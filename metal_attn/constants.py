"""Constants shared by the host code, the kernel sources and the C++ build.

Every number that a kernel and the dispatch logic must agree on lives here and
reaches kernels as template arguments or generated ``#define`` lines, and the
native build as compile definitions. Never retype one of these elsewhere.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

#: Tokens per split-KV partition of the classic kernel (and the GQA kernel's first tier).
PARTITION_SIZE: Final[int] = 512

#: Partition sizes the GQA decode kernel can launch, largest first.
GQA_PARTITION_SIZES: Final[tuple[int, ...]] = (512, 256)

#: Kernel block sizes (tokens per page as the kernels see them), largest first.
#: A cache page of another size is served by the largest of these that divides it.
KERNEL_BLOCK_SIZES: Final[tuple[int, ...]] = (32, 16, 8)

#: Epsilon of the final normalisation ``acc / (l + SOFTMAX_EPS)``; part of the split contract.
SOFTMAX_EPS: Final[float] = 1e-6

#: How far (log2 space) a running maximum may trail the scores before the per-token kernel
#: rescales its accumulators: probabilities then reach at most ``2**RESCALE_SLACK`` (fp32 holds
#: that for any context), and a rescale happens only when the maximum grows by more than this,
#: not each time it grows. A split partial's max_logits is its reference maximum, at most this
#: far below the partition's true maximum; the reducer's arithmetic holds for any reference.
RESCALE_SLACK: Final[float] = 8.0

#: log2(e): scores are multiplied by it so that every exponential is an ``exp2``.
LOG2E: Final[float] = 1.4426950408889634

#: Finite sentinel for masked scores (``-FLT_MAX``).
NEG_FLT_MAX: Final[float] = -3.4028234663852886e38

#: Upper bound on the split-KV scratch (tmp_out + max_logits + exp_sums) of one call.
SCRATCH_CAP_BYTES: Final[int] = 512 * 1024 * 1024

#: Simdgroups per GPU core in the GQA decode work budget, per backend.
#: Apple: measured upstream on M-series chips. CUDA: measured on the H200 (see docs).
SIMDGROUPS_PER_CORE: Final = MappingProxyType({"metal": 33, "cuda": 24})

#: Split-KV occupancy gate of the classic kernel: split when
#: ``num_heads * total_q_tokens < factor * gpu_cores`` (and the longest row spans
#: at least two partitions). Apple value as measured upstream; CUDA value measured
#: on the H200 (docs/bench-h200-classic.md).
SPLIT_GATE_FACTOR: Final = MappingProxyType({"metal": 8, "cuda": 16})

#: Decode rows in a mixed batch go through the per-token decode kernel instead of
#: riding in the prefill tiles (``mixed_prefill_decode``) when the longest of them
#: reaches this many tokens, per backend. Apple: upstream's measurement. CUDA:
#: measured on the H200 (docs/bench-h200-tiled.md): splitting won at every point
#: measured (8 to 128 decode rows, contexts 128 to 4096: 1.27x to 6.7x), so the
#: threshold is the smallest context measured.
MIXED_DECODE_MIN_CONTEXT: Final = MappingProxyType({"metal": 4096, "cuda": 128})

#: Supported query/cache dtypes, by name.
DTYPES: Final[tuple[str, ...]] = ("float16", "bfloat16", "float32")

#: GQA decode geometries ``(num_heads, num_kv_heads, head_size, kernel block_size)``
#: per backend. Metal: the five measured upstream on M-series chips. CUDA: the
#: same five (H200 measurements in docs/bench-h200-gqa.md).
GQA_DECODE_GEOMETRIES: Final = MappingProxyType(
    {
        "metal": ((32, 8, 128, 16), (24, 4, 256, 16), (16, 2, 128, 16), (16, 2, 256, 16), (16, 2, 256, 32)),
        "cuda": ((32, 8, 128, 16), (24, 4, 256, 16), (16, 2, 128, 16), (16, 2, 256, 16), (16, 2, 256, 32)),
    }
)

#: Device-keyed partition preferences of the GQA decode kernel (calibration data,
#: read by providers/gqa_decode.py). A rule matches a device by architecture and
#: core count and a request by head size, batch size and longest row; it puts
#: ``prefer`` first among the partition sizes the budget admits. Upstream: a
#: 10-core M3 prefers P256 for head 256 in batches, beyond 4K tokens from four
#: requests and beyond 8K tokens from two.
GQA_CALIBRATION_RULES: Final[tuple] = (
    MappingProxyType(
        {
            "architecture": "applegpu_g15g",
            "gpu_cores": 10,
            "head_size": 256,
            "min_seqs": 4,
            "min_max_seq_len": 4096,
            "prefer": 256,
        }
    ),
    MappingProxyType(
        {
            "architecture": "applegpu_g15g",
            "gpu_cores": 10,
            "head_size": 256,
            "min_seqs": 2,
            "min_max_seq_len": 8192,
            "prefer": 256,
        }
    ),
)

#: The M5 NAX prefill kernel's tile (kernels_v2/nax_prefill.metal, as upstream shaped it): 64 query
#: rows per threadgroup (4 simdgroups x 16 rows, 128 threads) and 32 keys per KV tile; the kernel
#: receives both as generated defines and checks them against its 16 x 32 x 16 matmul2d.
NAX_BQ: Final[int] = 64
NAX_TILE_KV: Final[int] = 32

#: What the NAX kernel needs of an Apple GPU, mirroring MLX's own gate (``is_nax_available``): macOS
#: 26.2 or later at run time, GPU architecture generation 17 or later, 18 or later for parts whose
#: architecture name ends in 'p'.
NAX_MIN_MACOS: Final[tuple[int, int]] = (26, 2)
NAX_MIN_GENERATION: Final = MappingProxyType({"default": 17, "p": 18})
