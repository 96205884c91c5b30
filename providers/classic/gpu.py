"""The ``classic`` provider on the GPU backends (Metal and CUDA): one kernel text.

Routes: ``per_token_ps0`` (one pass per query row and head) and
``per_token_ps512`` (split-KV: 512-token partitions, then the shared reducer),
chosen by the occupancy gate ``num_heads * total_q_tokens < k * gpu_cores``
with at least two partitions (``k`` per backend in
`metal_attn.constants.SPLIT_GATE_FACTOR`). `reduce_partitions` launches the
reducer for any kernel that writes the split contract (the GQA decode kernel).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from metal_attn import kernels
from metal_attn.constants import LOG2E, PARTITION_SIZE, SCRATCH_CAP_BYTES, SPLIT_GATE_FACTOR
from metal_attn.provider import Plan
from metal_attn.request import split_scratch_bytes

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

#: Threads per threadgroup of the per-token kernel and of the reducer.
NUM_THREADS = 128
#: Threads per threadgroup of reshape_and_cache, and its most threadgroups per launch.
CACHE_THREADS = 256
CACHE_MAX_GROUPS = 8192

PAGED_FILES = ("paged_common.h", "pagedattention.metal")
CACHE_FILES = ("reshape_and_cache.metal",)
PA_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "sinks", "params", "fparams")
PA_OUTPUTS = {0: ("out",), 1: ("max_logits", "exp_sums", "tmp_out")}
CACHE_INPUTS = ("key", "value", "k_cache", "v_cache", "inv_map", "params")
CACHE_OUTPUTS = ("k_out", "v_out")
REDUCE_INPUTS = ("max_logits", "exp_sums", "tmp_out", "seq_lens", "cu_seqlens_q", "sinks", "params")

ROUTES = {False: "per_token_ps0", True: f"per_token_ps{PARTITION_SIZE}"}


@dataclasses.dataclass(frozen=True)
class GeometryRule:
    """How the per-token kernel lays a head out on a simdgroup, per backend (data, not code paths).

    - lanes per token: the largest power of two up to ``max_lanes`` dividing ``head_size / 4``
      that still leaves each lane at least ``min_elements`` head elements;
    - tokens unrolled per lane: 2 while a lane holds at most ``unroll_up_to`` elements (split
      route) or ``unroll_up_to_unsplit`` (unsplit route), else 1;
    - heads per threadgroup (HPS): the largest of ``hps_choices`` dividing the GQA group with
      ``HPS * elements per lane <= hps_element_budget`` (q and the accumulators of every head
      live in registers).
    """

    max_lanes: int
    min_elements: int
    unroll_up_to: int
    unroll_up_to_unsplit: int
    hps_choices: tuple[int, ...]
    hps_element_budget: int


#: Metal: upstream's shape (8 lanes per token, 2 tokens unrolled up to 16 elements, one head
#: per threadgroup, its simdgroups striding over the tokens). CUDA: the H200 sweep
#: (docs/bench-h200-classic.md): 16 elements per lane (8 lanes for head 128), two heads of a
#: GQA group per threadgroup so each K/V row is read once for both, one token per lane on
#: the split route and two on the unsplit one.
GEOMETRY_RULES: dict[str, GeometryRule] = {
    "metal": GeometryRule(max_lanes=8, min_elements=4, unroll_up_to=16, unroll_up_to_unsplit=16, hps_choices=(1,),
                          hps_element_budget=0),
    "cuda": GeometryRule(max_lanes=32, min_elements=16, unroll_up_to=0, unroll_up_to_unsplit=16,
                         hps_choices=(4, 3, 2, 1), hps_element_budget=32),
}
#: Whether the kernel asks L2 for the next iteration's K/V rows (CUDA ``prefetch.global.L2``;
#: Metal has no such instruction and the kernel's prefetch is a no-op there).
PREFETCH_NEXT = {"metal": 0, "cuda": 1}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One launch shape of the per-token kernel."""

    lanes: int  # lanes per token (TPT)
    unroll: int  # tokens per lane per iteration
    hps: int  # query heads per threadgroup (all of one KV head)


def geometry(head_size: int, dtype: str | None, backend: str = "metal", group: int = 1,
             split: bool = False) -> Geometry:
    """The kernel geometry for ``head_size`` on ``backend``, GQA ``group`` query heads per KV head, route ``split``."""
    del dtype  # the same geometry for every dtype (registers hold float32 either way)
    vecs = head_size // 4
    if head_size % 4 or vecs == 0:
        raise ValueError(f"head_size={head_size} has no lane geometry (need a positive multiple of 4)")
    rule = GEOMETRY_RULES.get(backend, GEOMETRY_RULES["metal"])
    lanes = next(t for t in (32, 16, 8, 4, 2, 1)
                 if t <= rule.max_lanes and vecs % t == 0 and (head_size // t >= rule.min_elements or t == 1))
    elements = head_size // lanes
    unroll = 2 if elements <= (rule.unroll_up_to if split else rule.unroll_up_to_unsplit) else 1
    hps = next((h for h in rule.hps_choices if group % h == 0 and h * elements <= rule.hps_element_budget), 1)
    return Geometry(lanes, unroll, hps)


def _backend() -> str:
    from metal_attn.device import current_device

    return current_device().backend


def head_groups(num_heads: int, hps: int) -> int:
    """Threadgroups per (row, partition): ``hps`` query heads each (``hps`` divides the GQA group)."""
    return num_heads // hps


def availability_reasons(device: DeviceInfo) -> list[str]:
    """Why the GPU kernels cannot run on ``device`` (a hypothetical device is taken at its word)."""
    if device.hypothetical:
        return []
    if not mx.is_available(mx.gpu):
        return [f"backend={device.backend}: MLX has no usable GPU here"]
    if device.backend == "metal" and not mx.metal.is_available():
        return ["backend=metal: this MLX build has no Metal backend"]
    if device.backend == "cuda" and not mx.cuda.is_available():
        return ["backend=cuda: this MLX build has no CUDA backend"]
    return []


def split_decision(request: AttentionRequest, device: DeviceInfo) -> tuple[bool, tuple[str, ...]]:
    """The occupancy gate, with the arithmetic behind it as notes."""
    p = PARTITION_SIZE
    parts = -(-request.max_seq_len // p)
    grid = request.num_heads * request.total_q_tokens
    factor = SPLIT_GATE_FACTOR.get(device.backend)
    cores = device.gpu_cores
    if factor is None:
        return False, (f"split gate: no factor measured for backend={device.backend} (no split)",)
    if cores is None:
        return False, ("split gate: gpu_cores unknown (no split; set METAL_ATTN_GPU_CORES)",)
    threshold = factor * cores
    small = grid < threshold
    long_enough = parts >= 2
    scratch = split_scratch_bytes(request.total_q_tokens, request.num_heads, parts, request.head_size)
    fits = scratch <= SCRATCH_CAP_BYTES
    notes = [
        f"split gate: num_heads*total_q_tokens={request.num_heads}*{request.total_q_tokens}={grid} "
        f"{'<' if small else '>='} {factor}*gpu_cores={factor}*{cores}={threshold}",
        f"partitions=ceil(max_seq_len/{p})=ceil({request.max_seq_len}/{p})={parts} "
        f"{'>=' if long_enough else '<'} 2",
    ]
    if not fits:
        notes.append(f"scratch={scratch} bytes > cap {SCRATCH_CAP_BYTES} (no split)")
    split = small and long_enough and fits
    notes.append("-> split" if split else "-> no split")
    return split, tuple(notes)


def plan(provider: str, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The launch decision for an admitted request."""
    split, notes = split_decision(request, device)
    geo = geometry(request.head_size, request.dtype, device.backend, request.num_heads // request.num_kv_heads, split)
    parts = -(-request.max_seq_len // PARTITION_SIZE) if split else 1
    return Plan(
        provider=provider,
        route=ROUTES[split],
        partition_size=PARTITION_SIZE if split else 0,
        grid=(head_groups(request.num_heads, geo.hps) * NUM_THREADS, request.total_q_tokens, parts),
        threadgroup=(NUM_THREADS, 1, 1),
        specialization=(device.backend, request.dtype, request.head_size, request.block_size,
                        PARTITION_SIZE if split else 0, geo.lanes, geo.unroll, geo.hps),
        notes=(*notes, f"lanes_per_token={geo.lanes} unroll={geo.unroll} heads_per_threadgroup={geo.hps}"),
    )


# -- launching -----------------------------------------------------------------------------------


def _paged_kernel(backend: str, split: bool):
    return kernels.load_kernel("paged_attention", PAGED_FILES, PA_INPUTS, PA_OUTPUTS[int(split)], backend,
                               defines={"PA_SPLIT": int(split)})


def _reduce_kernel(backend: str):
    return kernels.load_kernel("paged_attention_v2_reduce", PAGED_FILES, REDUCE_INPUTS, ("out",), backend)


def zeros_f32(n: int) -> mx.array:
    """``n`` float32 zeros (the sink logits of a call without sinks), built once per ``n``."""
    return kernels.param_array((0.0,) * n, "float32")


def launch_paged(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata, *, scale: float,
    sinks: mx.array | None, sliding_window: int | None, softcap: float | None, split: bool, backend: str,
    geometry_override: Geometry | None = None, prefetch: int | None = None, rows: int | None = None,
) -> mx.array:
    """Run the per-token kernel (and the reducer when ``split``); returns ``[T, H, D]``.

    ``rows`` computes only the first ``rows`` query rows (the decode rows at the front of a
    mixed batch) and returns ``[rows, H, D]``.

    ``geometry_override`` replaces `geometry` (lanes per token: a power of two up to 32 with
    ``head_size % (4 * lanes) == 0``; unroll >= 1; hps dividing the GQA group) and
    ``prefetch`` replaces `PREFETCH_NEXT` (0 or 1), for tuning sweeps.
    """
    total, num_heads, head = q.shape
    if rows is not None:
        if not 1 <= rows <= total:
            raise ValueError(f"rows={rows} (allowed: 1..{total}, the query rows of the batch)")
        total = rows
    _, block_size, num_kv_heads, _ = k_cache.shape
    dtype = q.dtype
    group = num_heads // num_kv_heads
    geo = geometry_override or geometry(head, None, backend, group, split)
    tpt, unroll, hps = geo.lanes, geo.unroll, geo.hps
    if tpt not in (1, 2, 4, 8, 16, 32) or head % (4 * tpt) or unroll < 1 or hps < 1 or group % hps:
        raise ValueError(f"geometry_override={geometry_override} (allowed: lanes in 1..32, a power of two dividing "
                         f"head_size/4={head // 4}; unroll >= 1; hps dividing the GQA group {group})")
    prefetch = PREFETCH_NEXT.get(backend, 0) if prefetch is None else prefetch
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch={prefetch} (allowed: 0 or 1)")
    # The decode rows of a mixed batch need partitions for the longest decode row only.
    longest = md.max_decode_seq_len if rows is not None and rows == md.num_decode_seqs else md.max_seq_len
    max_parts = -(-longest // PARTITION_SIZE) if split else 1
    use_sinks = sinks is not None
    sinks_arr = sinks if use_sinks else zeros_f32(num_heads)
    params = kernels.param_array((md.num_seqs, num_heads, num_kv_heads, md.max_blocks_per_seq,
                           int(sliding_window or 0), max_parts, int(use_sinks)), "int32")
    fparams = kernels.param_array((scale if softcap else scale * LOG2E, float(softcap or 0.0)), "float32")
    template = [("T", dtype), ("HEAD_SIZE", head), ("BLOCK_SIZE", block_size),
                ("PARTITION_SIZE", PARTITION_SIZE if split else 0), ("NUM_THREADS", NUM_THREADS),
                ("TPT", tpt), ("UNROLL", unroll), ("HPS", hps), ("PREFETCH", prefetch)]
    inputs = [q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, sinks_arr, params, fparams]
    grid = (head_groups(num_heads, hps) * NUM_THREADS, total, max_parts)
    kern = _paged_kernel(backend, split)
    if not split:
        return kern(inputs=inputs, template=template, grid=grid, threadgroup=(NUM_THREADS, 1, 1),
                    output_shapes=[(total, num_heads, head)], output_dtypes=[dtype])[0]
    max_logits, exp_sums, tmp_out = kern(
        inputs=inputs, template=template, grid=grid, threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[(total, num_heads, max_parts), (total, num_heads, max_parts),
                       (total, num_heads, max_parts, head)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return reduce_partitions(max_logits, exp_sums, tmp_out, md, sinks, PARTITION_SIZE,
                             out_dtype=dtype, backend=backend)


def reduce_partitions(
    max_logits: mx.array, exp_sums: mx.array, tmp_out: mx.array, metadata: AttentionMetadata,
    sinks: mx.array | None, partition_size: int, *, out_dtype=None, backend: str | None = None,
) -> mx.array:
    """Launch ``paged_attention_v2_reduce`` over partials written by the split contract.

    ``max_logits``/``exp_sums``: ``[total_q_tokens, num_heads, max_parts]`` float32
    (log2-space maxima, un-normalised sums); ``tmp_out``: ``[..., head_size]``
    (float32 or the query dtype), already divided by ``exp_sums + eps``; neutral
    partials are ``(-FLT_MAX, 0, 0)``. Each row's partition count is recomputed
    from ``metadata`` (causal length over ``partition_size``). ``sinks``: float32
    ``[num_heads]`` or ``None``, folded once here. Returns ``[total_q_tokens,
    num_heads, head_size]`` in ``out_dtype`` (default: ``tmp_out``'s dtype).
    """
    total, num_heads, max_parts, head = tmp_out.shape
    if max_logits.shape != (total, num_heads, max_parts) or exp_sums.shape != max_logits.shape:
        raise ValueError(f"max_logits.shape={tuple(max_logits.shape)} and exp_sums.shape={tuple(exp_sums.shape)} "
                         f"must both be {(total, num_heads, max_parts)} to match tmp_out.shape={tuple(tmp_out.shape)}")
    out_dtype = out_dtype or tmp_out.dtype
    backend = backend or _backend()
    use_sinks = sinks is not None
    sinks_arr = sinks.astype(mx.float32) if use_sinks else zeros_f32(num_heads)
    params = kernels.param_array((metadata.num_seqs, num_heads, max_parts, int(use_sinks)), "int32")
    return _reduce_kernel(backend)(
        inputs=[max_logits, exp_sums, tmp_out, metadata.seq_lens, metadata.cu_seqlens_q, sinks_arr, params],
        template=[("T", out_dtype), ("TT", tmp_out.dtype), ("HEAD_SIZE", head),
                  ("PARTITION_SIZE", partition_size), ("NUM_THREADS", NUM_THREADS)],
        grid=(num_heads * NUM_THREADS, total, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[(total, num_heads, head)], output_dtypes=[out_dtype],
    )[0]


def run(inputs: AttentionInputs, plan: Plan) -> mx.array:
    """The provider's lazy computation for an admitted request, in the plan's exact specialization
    (the one `prepare` compiled)."""
    backend, _, _, _, psize, lanes, unroll, hps = plan.specialization
    return launch_paged(
        inputs.q, inputs.k_cache, inputs.v_cache, inputs.metadata, scale=inputs.scale, sinks=inputs.sinks,
        sliding_window=inputs.sliding_window, softcap=inputs.softcap, split=psize > 0, backend=backend,
        geometry_override=Geometry(lanes, unroll, hps),
    )


def prepare(plan: Plan, device: DeviceInfo) -> None:
    """Compile the plan's specialization now (a tiny launch), raising `KernelCompileError` on failure."""
    from metal_attn.metadata import AttentionMetadata

    backend, dtype, head, block, psize, lanes, unroll, hps = plan.specialization
    if device.hypothetical:
        return
    split = psize > 0
    mdt = getattr(mx, dtype)
    seq_len = PARTITION_SIZE + 1 if split else 1
    nblk = -(-seq_len // block)
    md = AttentionMetadata.build(np.arange(nblk, dtype=np.int32)[None, :], [seq_len], [0, 1], validate=False)
    q = mx.zeros((1, hps, head), mdt)  # hps query heads on one KV head: the plan's exact specialization
    kc = mx.zeros((nblk, block, 1, head), mdt)

    def _go():
        return launch_paged(q, kc, kc, md, scale=1.0, sinks=None, sliding_window=None, softcap=None,
                            split=split, backend=backend, geometry_override=Geometry(lanes, unroll, hps))

    kernels.compile_now(_go, f"classic {plan.route} {plan.specialization}")


# -- reshape_and_cache ---------------------------------------------------------------------------


def _cache_kernel(backend: str):
    return kernels.load_kernel("reshape_and_cache", CACHE_FILES,
                               CACHE_INPUTS, CACHE_OUTPUTS, backend)


def write_cache(key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array, slots: mx.array,
                device: DeviceInfo) -> tuple[mx.array, mx.array]:
    """``pool[slot] = kv`` for every non-negative slot, as one GPU pass producing the new pools."""
    nb, bs, kvh, head = k_cache.shape
    host = np.array(slots, copy=False).astype(np.int64, copy=False)
    keep = np.nonzero(host >= 0)[0]
    if keep.size == 0:
        return k_cache, v_cache
    num_slots = nb * bs
    inv = np.full(num_slots, -1, dtype=np.int32)
    inv[host[keep]] = keep.astype(np.int32)
    row = kvh * head
    total = num_slots * row
    groups = max(1, min(CACHE_MAX_GROUPS, math.ceil(total / CACHE_THREADS)))
    threads = groups * CACHE_THREADS
    params = kernels.param_array((total, row, threads), "int64")
    k_out, v_out = _cache_kernel(device.backend)(
        inputs=[key, value, k_cache, v_cache, mx.array(inv), params],
        template=[("T", k_cache.dtype)], grid=(threads, 1, 1), threadgroup=(CACHE_THREADS, 1, 1),
        output_shapes=[k_cache.shape, v_cache.shape], output_dtypes=[k_cache.dtype, v_cache.dtype],
    )
    return k_out, v_out
