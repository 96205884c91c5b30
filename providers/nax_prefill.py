"""The ``nax_prefill`` provider: prefill on the tensor units of Apple M5-class GPUs (Metal 4 tensor ops).

FlashAttention-2 over the paged cache with MetalPerformancePrimitives' ``matmul2d`` (a 16 x 32 x 16
descriptor, relaxed precision) on cooperative tensors (``kernels_v2/nax_prefill.metal``): 64 query rows
per threadgroup (4 simdgroups x 16), 32-key tiles, 128 threads, no threadgroup memory, four block-table
lookups per tile. Admission is data (`GATE`, `HEAD_SIZES`, ...) and every refusal is a reason
``explain`` prints:

- batches with prefill rows (``prefill``, ``mixed``; never pure decode, never verify windows),
  float16/bfloat16 with the same cache dtype, head sizes 64/96/128/256/512, kernel block sizes
  8/16/32 (the kernel needs ``block_size % 8 == 0``); sinks, sliding window and softcap allowed;
- Metal only, on macOS 26.2 or later with a GPU of architecture generation 17 or later (18 or later
  for 'p' parts), the rule of MLX's own NAX gate;
- ``METAL_ATTN_DISABLE_NAX=1`` (alias ``VLLM_METAL_DISABLE_NAX``) disables it.

A compile or load failure of a specialization is a recorded fallback (`prepare` raises
`KernelCompileError`); the next admitted provider is ``tiled_prefill``. Mixed batches: as the tiled
provider, decode rows ride in the tiles unless the longest reaches `MIXED_DECODE_MIN_CONTEXT`; then
they go through the classic per-token kernel (route ``mixed_prefill_decode``).

The CUDA twin: the same kernel text assembled with ``kernels_v2/nax_tensor_ops_cuda.h`` (the tensor-op
subset on ``mma.sync``, in the same per-lane layout) runs on NVIDIA GPUs through `run_twin` (or
`launch` with ``backend="cuda"``); the provider never routes to it (on CUDA it refuses: no Apple
tensor units). **The Metal build has never been executed on Apple hardware in this project.**
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from metal_attn.providers import gpu_common as gc

from metal_attn import kernels
from metal_attn.constants import (
    KERNEL_BLOCK_SIZES,
    NAX_BQ,
    NAX_MIN_GENERATION,
    NAX_MIN_MACOS,
    NAX_TILE_KV,
)
from metal_attn.kernels import SIMD_WIDTH
from metal_attn.provider import Plan, Provider

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

ROUTE = "nax_prefill"
SPLIT_ROUTE = "mixed_prefill_decode"

#: What the kernel is instantiated for (2 x 5 x 3 = 30 specializations per backend).
DTYPES = ("bfloat16", "float16")
HEAD_SIZES = (64, 96, 128, 256, 512)
BLOCK_SIZES = tuple(sorted(KERNEL_BLOCK_SIZES))
#: Simdgroups of a threadgroup (16 query rows each) and its threads.
SIMDGROUPS = NAX_BQ // 16
THREADS = SIMDGROUPS * SIMD_WIDTH

#: Kernel sources per backend: Metal includes the real tensor ops, CUDA the twin's emulation.
KERNEL_FILES = {
    "metal": ("nax_tensor_ops_metal.h", "paged_common.h", "nax_layout.h", "nax_prefill.metal"),
    "cuda": ("paged_common.h", "nax_layout.h", "nax_tensor_ops_cuda.h", "nax_prefill.metal"),
}
KERNEL_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "tiles", "sinks", "params",
                 "fparams")
KERNEL_OUTPUTS = ("out",)
KERNEL_INPUT_DTYPES = (None, None, None, "int32", "int32", "int32", "int32", "float32", "int32", "float32")
#: The tile reaches the kernel as generated defines (never retyped there).
KERNEL_DEFINES = (("MA_NAX_BQ", NAX_BQ), ("MA_NAX_TILE_KV", NAX_TILE_KV), ("MA_NAX_MAX_SIMDGROUPS", SIMDGROUPS))


@dataclasses.dataclass(frozen=True)
class NaxGate:
    """The hardware the NAX kernel needs (MLX's ``is_nax_available`` rule, as data)."""

    min_macos: tuple[int, ...] = NAX_MIN_MACOS
    #: Minimum architecture generation per variant letter ('default' for the others).
    min_generation: Mapping[str, int] = dataclasses.field(default_factory=lambda: NAX_MIN_GENERATION)

    def generation_needed(self, variant: str | None) -> int:
        return self.min_generation.get(variant or "", self.min_generation["default"])

    def describe(self) -> str:
        by_variant = ", ".join(f">= {g} for '{v}' parts" for v, g in sorted(self.min_generation.items())
                               if v != "default")
        return (f"macOS >= {'.'.join(map(str, self.min_macos))} and GPU architecture generation >= "
                f"{self.min_generation['default']} ({by_variant}): Apple M5-class tensor units")

    def reasons(self, device: DeviceInfo) -> list[str]:
        """Why ``device`` lacks the tensor units or the OS the kernel needs (empty when it has both)."""
        if device.backend == "cuda":
            return ["backend=cuda: needs Apple M5-class tensor units (Metal 4 tensor ops); this kernel's text runs "
                    "on CUDA only as its twin, from tests (metal_attn.providers.nax_prefill.run_twin)"]
        if device.backend != "metal":
            return [f"backend={device.backend} (supported: metal, with {self.describe()})"]
        out = []
        gen = device.generation
        if gen is None:
            out.append(f"architecture={device.architecture} unknown (needs {self.describe()})")
        else:
            need = self.generation_needed(device.variant)
            if gen < need:
                out.append(f"architecture={device.architecture} (generation {gen}; supported: generation >= {need}"
                           + (f" for '{device.variant}' parts" if device.variant in self.min_generation else "")
                           + "; Apple M5-class tensor units)")
        mac = device.macos
        want = ".".join(map(str, self.min_macos))
        if mac is None:
            out.append(f"macos_version={device.macos_version} unknown (needs macOS >= {want} for Metal 4 tensor ops; "
                       "set METAL_ATTN_MACOS_VERSION)")
        elif mac < self.min_macos:
            out.append(f"macos_version={device.macos_version} (supported: >= {want}, Metal 4 tensor ops)")
        return out


GATE = NaxGate()


# -- the provider ---------------------------------------------------------------------------------------


class NaxPrefillProvider(Provider):
    """Prefill with Metal 4 tensor ops (matmul2d on cooperative tensors) on Apple M5-class GPUs."""

    name = ROUTE
    priority = 60
    backends = frozenset({"metal"})
    phases = frozenset({"prefill", "mixed"})
    dtypes = frozenset(DTYPES)
    head_sizes = frozenset(HEAD_SIZES)
    block_sizes = frozenset(BLOCK_SIZES)
    features = frozenset({"sinks", "sliding_window", "softcap"})
    description = ("M5 NAX prefill: Metal 4 tensor ops (matmul2d 16x32x16, cooperative tensors); never executed on "
                   "Apple hardware here, its logic verified through a CUDA twin.")

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = GATE.reasons(device)
        if reasons:
            return reasons
        return gc.availability_reasons(device)

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        return make_plan(request, device, settings, kernel_backend="metal")

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Compile the plan's kernels with tiny launches (skipped for hypothetical devices)."""
        prepare_plan(plan, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        return run_plan(inputs, plan)

    # -- source checks ----------------------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """Every Metal specialization the provider can choose, for `metal_attn.msl_check`:
        {float16, bfloat16} x head sizes {64, 96, 128, 256, 512} x kernel block sizes {8, 16, 32} (30).
        The decode rows of a split mixed batch use the classic provider's specializations."""
        return msl_specializations()

    def cuda_sources(self) -> list[CudaSource]:
        """Every specialization of the CUDA twin (the same 30), for `metal_attn.cuda_check`; the
        provider never launches them itself (its CUDA runs are `run_twin`'s)."""
        return cuda_sources()


def make_plan(request: AttentionRequest, device: DeviceInfo, settings: Settings, *, kernel_backend: str) -> Plan:
    """The launch decision; ``kernel_backend`` is ``"metal"`` (the provider) or ``"cuda"`` (the twin).
    The mixed-batch rule is the one the provider applies on Apple GPUs (Metal's threshold); a split
    plan's decode rows use the classic kernel's plan for ``device``."""
    decode_spec, partition, split_notes = gc.tiles_decode_part(request, "metal", device, settings)
    tiles = request.total_q_tokens // NAX_BQ + request.num_seqs  # an upper bound; exact per batch
    notes = [f"tile: BQ={NAX_BQ} query rows ({SIMDGROUPS} simdgroups x 16), TILE_KV={NAX_TILE_KV} keys, "
             f"matmul2d 16x32x16 relaxed precision, no threadgroup memory", *split_notes]
    return Plan(
        provider=ROUTE,
        route=SPLIT_ROUTE if decode_spec else ROUTE,
        partition_size=partition,
        grid=(tiles * THREADS, request.num_heads, 1),
        threadgroup=(THREADS, 1, 1),
        specialization=(ROUTE, kernel_backend, request.dtype, request.head_size, request.block_size, decode_spec),
        notes=tuple(notes),
    )


def prepare_plan(plan: Plan, device: DeviceInfo) -> None:
    """Compile a plan's kernels now (tiny launches; skipped for hypothetical devices);
    `KernelCompileError` on any failure."""
    _, backend, dtype, head, block, decode_spec = plan.specialization
    gc.compile_eagerly(
        device, f"nax_prefill {plan.specialization[:5]}",
        lambda b: launch(b.q, b.cache, b.cache, b.metadata, scale=1.0, sinks=None, sliding_window=None,
                         softcap=None, backend=backend),
        dtype=dtype, head_size=head, block_size=block, seq_len=2, q_rows=2)
    if decode_spec:
        gc.prepare_decode_rows(decode_spec, device)


def run_plan(inputs: AttentionInputs, plan: Plan) -> mx.array:
    """A plan's lazy computation: the NAX tiles, and the decode rows of a split mixed batch."""
    _, backend, _, _, _, decode_spec = plan.specialization
    common = dict(scale=inputs.scale, sinks=inputs.sinks, sliding_window=inputs.sliding_window,
                  softcap=inputs.softcap, backend=backend)
    if not decode_spec:
        return launch(inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata, **common)
    import mlx.core as mx

    md = inputs.metadata
    n_dec = md.num_decode_seqs
    decode = gc.run_decode_rows(inputs, decode_spec)
    prefill = launch(inputs.q, inputs.k_cache, inputs.v_cache, md, first_seq=n_dec, **common)
    return mx.concatenate([decode, prefill[n_dec:]], axis=0)


# -- the kernel -----------------------------------------------------------------------------------------


def kernel_object(backend: str) -> Any:
    """The ``mx.fast`` kernel object of ``nax_prefill`` on ``backend`` (built once; CUDA: the twin)."""
    if backend not in KERNEL_FILES:
        raise ValueError(f"backend={backend!r} (supported: {', '.join(sorted(KERNEL_FILES))})")
    return kernels.load_kernel(ROUTE, KERNEL_FILES[backend], KERNEL_INPUTS, KERNEL_OUTPUTS, backend,
                               defines=KERNEL_DEFINES)


def kernel_template(dtype: Any, head_size: int, block_size: int) -> list[tuple[str, Any]]:
    """The template arguments of one specialization."""
    return [("T", dtype), ("HEAD_SIZE", head_size), ("BLOCK_SIZE", block_size)]


def launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
           sinks: mx.array | None, sliding_window: int | None, softcap: float | None, backend: str,
           first_seq: int = 0) -> mx.array:
    """Run the NAX kernel over the sequences from ``first_seq`` on; returns ``[T, H, D]``.

    ``backend="metal"`` is the provider's kernel, ``backend="cuda"`` its twin. Rows of sequences
    before ``first_seq`` are left unwritten (the caller fills them).
    """
    total, num_heads, head = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head not in HEAD_SIZES or block_size % 8:
        raise ValueError(f"head_size={head}, block_size={block_size} (allowed: head_size in "
                         f"{', '.join(map(str, HEAD_SIZES))}; block_size a multiple of 8: four block-table "
                         "lookups per 32-key tile)")
    tiles = metadata.query_tiles(NAX_BQ, first_seq)
    num_tiles = tiles.shape[0]
    use_sinks = sinks is not None
    params = gc.pack_int32((num_tiles, num_heads, num_kv_heads, metadata.max_blocks_per_seq,
                            int(sliding_window or 0), int(use_sinks)))
    return kernel_object(backend)(
        inputs=[q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.cu_seqlens_q, tiles,
                gc.sink_logits(sinks, num_heads), params, gc.pack_scale(scale, softcap)],
        template=kernel_template(q.dtype, head, block_size),
        grid=(num_tiles * THREADS, num_heads, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(total, num_heads, head)],
        output_dtypes=[q.dtype],
    )[0]


def run_twin(inputs: AttentionInputs, *, settings: Settings | None = None) -> tuple[mx.array, Plan]:
    """Run the CUDA twin on ``inputs`` as the provider would on an M5: the same plan (route, mixed
    split) with the kernel text assembled for CUDA, the decode rows of a split batch through the
    classic kernel on this GPU. Needs MLX's CUDA backend; returns ``(output, plan)``.

    This is how tests execute the NAX kernel's logic (tests/gpu/test_nax_gpu.py); automatic routing
    never reaches it.
    """
    from metal_attn.api import dtype_name
    from metal_attn.device import current_device
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import get_settings

    device = current_device()
    if device.backend != "cuda":
        raise RuntimeError(f"run_twin needs MLX's CUDA backend (this process runs on backend={device.backend})")
    settings = settings or get_settings()
    md = inputs.metadata
    request = AttentionRequest(
        backend="cuda", phase=md.phase, dtype=dtype_name(inputs.q.dtype),
        cache_dtype=dtype_name(inputs.k_cache.dtype), num_heads=int(inputs.q.shape[1]),
        num_kv_heads=int(inputs.k_cache.shape[2]), head_size=int(inputs.q.shape[2]),
        block_size=int(inputs.k_cache.shape[1]), num_seqs=md.num_seqs, total_q_tokens=md.total_q_tokens,
        max_q_len=md.max_q_len, max_seq_len=md.max_seq_len, length_plan=md.length_plan,
        num_decode_seqs=md.num_decode_seqs, max_decode_seq_len=md.max_decode_seq_len,
        sinks=inputs.sinks is not None, sliding_window=inputs.sliding_window, softcap=inputs.softcap)
    plan = make_plan(request, device, settings, kernel_backend="cuda")
    prepare_plan(plan, device)
    return run_plan(inputs, plan), plan


# -- source checks ----------------------------------------------------------------------------------------


def _spec_inputs(dtype: str, head: int, block: int) -> tuple:
    return (((5, 4, head), dtype), ((4, block, 2, head), dtype), ((4, block, 2, head), dtype),
            ((2, 4), "int32"), ((2,), "int32"), ((3,), "int32"), ((2, 2), "int32"),
            ((4,), "float32"), ((6,), "int32"), ((2,), "float32"))


def msl_specializations() -> list[Specialization]:
    """The provider's Metal specializations (`NaxPrefillProvider.msl_specializations`)."""
    from metal_attn.source_specs import Specialization

    return [
        Specialization(
            label=f"nax_prefill {dtype} head={head} block={block}",
            kernel=ROUTE, source_files=KERNEL_FILES["metal"], input_names=KERNEL_INPUTS, output_names=KERNEL_OUTPUTS,
            template=tuple(kernel_template(dtype, head, block)), inputs=_spec_inputs(dtype, head, block),
            outputs=(((5, 4, head), dtype),), defines=KERNEL_DEFINES,
        )
        for dtype in sorted(DTYPES) for head in HEAD_SIZES for block in BLOCK_SIZES
    ]


def cuda_sources() -> list[CudaSource]:
    """The CUDA twin's specializations (`NaxPrefillProvider.cuda_sources`)."""
    from metal_attn.source_specs import CudaSource

    return [
        CudaSource(f"nax_prefill twin {dtype} h{head} bs{block}", ROUTE, KERNEL_FILES["cuda"],
                   tuple(zip(KERNEL_INPUTS, [t or dtype for t in KERNEL_INPUT_DTYPES])), (("out", dtype),),
                   tuple(kernel_template(dtype, head, block)), KERNEL_DEFINES)
        for dtype in sorted(DTYPES) for head in HEAD_SIZES for block in BLOCK_SIZES
    ]
