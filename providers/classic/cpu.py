"""The ``classic`` provider's ``cpu`` implementation: native C++ MLX primitives.

The kernel (``csrc/``, loaded through `metal_attn.native`) computes decode and
varlen batches straight from the pages: for each (sequence, KV head, row tile)
it processes every query head of the GQA group together, so each K/V byte is
read once per KV head; online softmax in log2 space, float32 accumulation,
float16/bfloat16 converted on load with the widest vector instructions the CPU
has (chosen at run time; a portable build otherwise). Work units are spread
over a persistent pool of ``device.cpu_threads`` workers.

Routes (upstream vocabulary):

- ``per_token_ps0``: every row in one pass (the usual case: enough units to
  keep the threads busy);
- ``per_token_ps512``: rows split into 512-token KV partitions, merged by the
  reducer, when the unsplit work is too coarse for the threads (the CPU gate:
  fewer than ``SPLIT_UNITS_PER_THREAD`` units per thread) and the longest row
  spans at least two partitions.

``Plan.threadgroup`` carries the number of worker threads; ``Plan.grid`` the
estimated number of work units. See ``docs/cpu-kernels.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metal_attn import native
from metal_attn.constants import DTYPES, PARTITION_SIZE, SCRATCH_CAP_BYTES
from metal_attn.errors import KernelCompileError
from metal_attn.provider import Plan
from metal_attn.request import split_scratch_bytes

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

PROVIDER_NAME = "classic"
ROUTE_UNSPLIT = "per_token_ps0"
ROUTE_SPLIT = f"per_token_ps{PARTITION_SIZE}"

#: Split rows into KV partitions when the unsplit work gives fewer units than this per thread.
SPLIT_UNITS_PER_THREAD = 4

#: Head sizes the kernel handles: multiples of this, up to `MAX_HEAD_SIZE`.
HEAD_SIZE_MULTIPLE = 16
MAX_HEAD_SIZE = 512

#: Query vectors per work unit (rows x GQA group); mirrors the kernel's row tiling.
QUERY_VECTORS_PER_TILE = 64


def availability_reasons(device: DeviceInfo) -> list[str]:
    """Why the native CPU kernels cannot run here (empty when they can)."""
    if device.backend != "cpu":
        return [f"backend={device.backend} (the native kernels implement: cpu)"]
    reason = native.unavailable_reason()
    return [reason] if reason else []


def not_supported_reasons(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
    """Every CPU-specific reason to refuse ``request``, each naming the value and the allowed set."""
    reasons = list(availability_reasons(device))
    if request.dtype not in DTYPES:
        reasons.append(f"dtype={request.dtype} (supported on cpu: {', '.join(DTYPES)})")
    if request.cache_dtype != request.dtype:
        reasons.append(f"cache_dtype={request.cache_dtype} (supported on cpu: same as dtype={request.dtype})")
    hs = request.head_size
    if hs % HEAD_SIZE_MULTIPLE or not 0 < hs <= MAX_HEAD_SIZE:
        reasons.append(
            f"head_size={hs} (supported on cpu: multiples of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE})"
        )
    if request.block_size < 1:
        reasons.append(f"block_size={request.block_size} (supported on cpu: any size >= 1)")
    if request.num_kv_heads < 1 or request.num_heads % request.num_kv_heads:
        reasons.append(
            f"num_heads={request.num_heads} with num_kv_heads={request.num_kv_heads} "
            "(supported on cpu: num_heads a multiple of num_kv_heads)"
        )
    return reasons


def _threads(device: DeviceInfo) -> int:
    if device.cpu_threads:
        return int(device.cpu_threads)
    mod = native.load()
    return int(mod.hardware_threads()) if mod is not None else 1


def _row_tile(group: int) -> int:
    return max(1, QUERY_VECTORS_PER_TILE // max(1, group))


def plan(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The CPU launch decision: split or not, work units, threads (arithmetic in ``notes``)."""
    threads = _threads(device)
    group = request.num_heads // max(1, request.num_kv_heads)
    rt = _row_tile(group)
    n_dec = request.num_decode_seqs
    n_pre = request.num_seqs - n_dec
    pre_rows = request.total_q_tokens - n_dec
    # Decode rows are one tile each; prefill chunks at least one, about rows/rt.
    tiles = n_dec + max(n_pre, -(-pre_rows // rt)) if n_pre else n_dec
    units = tiles * request.num_kv_heads
    parts = request.partitions(PARTITION_SIZE)
    scratch = split_scratch_bytes(request.total_q_tokens, request.num_heads, parts, request.head_size)
    wants_split = units < SPLIT_UNITS_PER_THREAD * threads and parts >= 2
    split = wants_split and scratch <= SCRATCH_CAP_BYTES
    notes = [
        f"threads={threads}",
        f"units~{units} ({tiles} row tiles x {request.num_kv_heads} kv heads; tile={rt} rows x {group} heads)",
        f"split gate: units {units} {'<' if units < SPLIT_UNITS_PER_THREAD * threads else '>='} "
        f"{SPLIT_UNITS_PER_THREAD}*threads and partitions {parts} {'>=' if parts >= 2 else '<'} 2",
    ]
    if wants_split and not split:
        notes.append(f"split refused: scratch {scratch} B > cap {SCRATCH_CAP_BYTES} B")
    if split:
        notes.append(f"units after split~{units * parts} (x{parts} partitions of {PARTITION_SIZE})")
    mod = native.load()
    if mod is not None:  # which build of the kernel body this CPU runs (the best it supports)
        notes.append(f"kernel: metal_attn._native, {mod.resolve_isa('auto')} build")
    return Plan(
        provider=PROVIDER_NAME,
        route=ROUTE_SPLIT if split else ROUTE_UNSPLIT,
        partition_size=PARTITION_SIZE if split else 0,
        grid=(units * (parts if split else 1),),
        threadgroup=(threads,),
        specialization=("cpu", request.dtype, request.head_size),
        notes=tuple(notes),
    )


def prepare(plan: Plan, device: DeviceInfo) -> None:
    """Check the native module and resolve its instruction set; raise `KernelCompileError` if unusable."""
    mod = native.load()
    if mod is None:
        raise KernelCompileError(native.unavailable_reason() or "native module unavailable")
    try:
        mod.resolve_isa("auto")
    except Exception as exc:
        raise KernelCompileError(f"native CPU kernel unusable: {type(exc).__name__}: {exc}") from exc


def _module():
    mod = native.load()
    if mod is None:
        raise RuntimeError(f"classic (cpu): {native.unavailable_reason()}")
    return mod


def run(inputs: AttentionInputs, plan: Plan) -> mx.array:
    """The lazy native paged-attention op for ``inputs`` as planned."""
    md = inputs.metadata
    threads = plan.threadgroup[0] if plan.threadgroup else 0
    return _module().paged_attention(
        inputs.q, inputs.k_cache, inputs.v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, inputs.sinks,
        scale=float(inputs.scale),
        softcap=float(inputs.softcap) if inputs.softcap is not None else 0.0,
        sliding_window=int(inputs.sliding_window) if inputs.sliding_window is not None else 0,
        partition_size=plan.partition_size,
        num_threads=threads,
    )


def write_cache(
    key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array, slots: mx.array, device: DeviceInfo
) -> tuple[mx.array, mx.array]:
    """reshape_and_cache: ``pool[slot] = kv`` (negative slots skipped), in place when the pools are sole owners."""
    k_new, v_new = _module().reshape_and_cache(key, value, k_cache, v_cache, slots)
    return k_new, v_new
