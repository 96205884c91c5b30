"""The per-token kernel (``kernels_v2/pagedattention.metal``) that ``classic`` runs for every batch and
the mixed splits run for their decode rows: the occupancy gate (`split_decision`), the partition
size (`PARTITION_RULES`, `partition_choice`), the plan (`plan_per_token`) and the launches
(`launch_paged`, `run_per_token`, `prepare_per_token`; on CUDA with `metal_attn._cuda_ops` built,
`ChainedPerTokenLaunch`: the kernel and its reducer as one MLX operation, built from a
`PerTokenChainPart`, which another chain may also run among its launches: `plan_chain_part`).

Per-token routes: ``per_token_ps0`` (one pass per query row and head) and ``per_token_psP``
(split-KV: ``P``-token partitions, then the reducer), chosen by the occupancy gate
``num_heads * total_q_tokens < k * gpu_cores`` with at least two 512-token partitions (``k`` per
backend in `metal_attn.constants.SPLIT_GATE_FACTOR`). ``P`` is what the backend's
`PARTITION_RULES` gives (`partition_choice`): on CUDA the largest of 4096/2048/1024 whose KV work
items reach twice the core count, else the largest of 512/256/128/64 whose items reach it (measured
on the H200), on Metal 512; ``METAL_ATTN_PARTITION_SIZE`` forces one for A/B runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from metal_attn.providers.gpu_common.launches import (
    ChainPart,
    KernelLaunch,
    TinyBatch,
    cached_launch,
    commit_when_idle,
    compile_eagerly,
    cuda_chains_enabled,
    idle_commit_note,
    kernel_launch,
    kv_bytes_read,
    pack_int32,
    pack_scale,
    split_scratch,
    zeros_f32,
)
from metal_attn.providers.gpu_common.per_token_geometry import (
    PREFETCH_NEXT,
    STAGING_RULES,
    Geometry,
    StagingRule,
    describe_geometry,
    geometry,
    geometry_problem,
    key_rows_rule,
    kv_items_per_core,
    plan_geometry,
)
from metal_attn.providers.gpu_common.reducer import (
    PAGED_FILES,
    ReduceLaunch,
    chained_split_reduce,
    reduce_launch,
    reducer_sinks,
    reducer_slices,
)

from metal_attn import _epoch, kernels
from metal_attn.constants import PARTITION_SIZE, SCRATCH_CAP_BYTES, SPLIT_GATE_FACTOR
from metal_attn.provider import Plan
from metal_attn.request import split_scratch_bytes

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

#: The per-token kernel's inputs, and its outputs by route (0: unsplit; 1: split, the partials).
PA_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "sinks", "params", "fparams")
PA_OUTPUTS = {0: ("out",), 1: ("max_logits", "exp_sums", "tmp_out")}


def per_token_signature(dtype: str, pool_dtype: str | None = None) -> tuple[tuple[str, str], ...]:
    """The per-token kernel's inputs with their dtype names: the query's ``dtype``, the pools'
    ``pool_dtype`` (default: the query's), then the metadata, sinks and parameters."""
    pool = pool_dtype or dtype
    return tuple(zip(PA_INPUTS, (dtype, pool, pool, "int32", "int32", "int32", "float32", "int32", "float32")))


def per_token_route(partition_size: int) -> str:
    """The per-token route's name: ``per_token_ps0`` unsplit, ``per_token_psP`` split into ``P``-token partitions."""
    return f"per_token_ps{partition_size}"


def split_decision(request: AttentionRequest, device: DeviceInfo) -> tuple[bool, tuple[str, ...]]:
    """The occupancy gate, with the arithmetic behind it as notes."""
    p = PARTITION_SIZE
    parts = request.partitions(p)
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


@dataclasses.dataclass(frozen=True)
class PartitionRule:
    """Which partition size a split per-token launch takes on one backend, and the measurement behind it.

    ``sizes``: the partition sizes it may take, largest first (512, the occupancy gate's, first).
    A launch takes the largest whose KV work items (KV heads x query rows x partitions) reach
    ``min_items_per_core`` per GPU core, else the smallest; never one whose split-KV scratch exceeds
    `SCRATCH_CAP_BYTES`. Smaller partitions put more threadgroups on a launch too small to fill the GPU
    (one request's decode: 8 KV heads x 2 partitions of 512 is 16 threadgroups on 132 SMs).
    """

    sizes: tuple[int, ...]
    min_items_per_core: float
    evidence: str
    #: Sizes above 512, largest first, that a launch takes before ``sizes`` where its KV work items
    #: reach ``long_min_items_per_core`` per core (fewer, longer threadgroups over long contexts).
    long_sizes: tuple[int, ...] = ()
    long_min_items_per_core: float = 0.0

    def tiers(self) -> tuple[tuple[int, float], ...]:
        """``(partition size, KV work items per core it needs)``, largest size first."""
        return (tuple((p, self.long_min_items_per_core) for p in self.long_sizes)
                + tuple((p, self.min_items_per_core) for p in self.sizes))


#: The partition sizes the per-token kernel's text takes (multiples of its 32-token staged chunks
#: and of every kernel block size); `METAL_ATTN_PARTITION_SIZE` may force any of them. The sizes
#: above 512 are for long contexts, where fewer and longer threadgroups stream the same bytes. The
#: sizes of three times a power of two are for A/B runs only: on the H200 (twenty-sixth session,
#: `session.sh partition`) each read below both its power-of-two neighbours on all five shapes
#: issue #17 misses (e.g. b8 L32768: 72% of the copy ceiling at 3,072 against 92% at 2,048 and 93%
#: at 4,096), so no rule takes them (docs/bench-h200-decode-step.md).
PER_TOKEN_PARTITION_SIZES = (4096, 3072, 2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 64)

#: One rule per backend (data, like the split gate; ``explain`` prints the arithmetic). CUDA takes
#: the largest size above 512 whose KV work items reach twice the core count, else the largest of
#: 512 and below reaching the core count, else the smallest (the evidence); Metal keeps upstream's 512.
PARTITION_RULES: dict[str, PartitionRule] = {
    "cuda": PartitionRule(
        (512, 256, 128, 64), 1.0,
        "H200, MLX 0.32.4, bf16, 32/8 heads, head 128, one decode row (benchmarks/probe_per_token_small.py, "
        "CUPTI, kernel + reducer us): 600 tokens 16.0 + 2.5 at 512 against 5.7 + 3.1 at 64; 2,048 tokens "
        "16.5 + 2.8 against 6.8 + 3.8. The kernel's floor is about 4.5 us at one page of context, so a "
        "threadgroup's walk over its partition's chunks is most of a 512-token launch at one row. Before "
        "the kernels' small inputs left MLX's small-allocation pool (metal_attn.host_arrays) the floor was "
        "7.2 us and the reducer 7.7, and 512 won. docs/bench-h200-decode-step.md. Partitions above 512 (seventeenth "
        "session, decode-gpu pipelined, one run, % of the copy ceiling at 512 / 1,024 / 2,048 / 4,096): b32 L4096 "
        "75/79/81/80, b64 L8192 83/86/86/87, b8 L32768 83/85/86/86, b16 16/2 L16384 64/71/72/54 (items at "
        "2,048: 256); b8 L4096 61/61/46/26, b1 L32768 60/61/47/27, b1 24/4/256 L65536 58/57/38/21 (items at "
        "1,024: 256): so a size above 512 needs 2 KV items per core",
        long_sizes=(4096, 2048, 1024), long_min_items_per_core=2.0),
    "metal": PartitionRule((PARTITION_SIZE,), 0.0, "upstream's 512-token partitions; not measured on Apple hardware"),
}


def scratch_fits(request: AttentionRequest, partition_size: int) -> bool:
    """Whether a split launch of ``request`` at ``partition_size`` keeps its split-KV scratch (every
    query row's partials) within `SCRATCH_CAP_BYTES`."""
    return split_scratch_bytes(request.total_q_tokens, request.num_heads, request.partitions(partition_size),
                               request.head_size) <= SCRATCH_CAP_BYTES


def partition_choice(request: AttentionRequest, device: DeviceInfo, settings: Settings | None) -> tuple[int, str]:
    """The partition size of a split per-token launch for ``request`` (`PARTITION_RULES`), and the arithmetic."""
    rows, kvh = request.total_q_tokens, request.num_kv_heads

    def items(p: int) -> int:
        return kvh * rows * request.partitions(p)

    forced = settings.partition_size if settings is not None else None
    if forced:
        # The gate checked the scratch at 512: a smaller forced size takes the nearest that fits.
        size = min((p for p in PER_TOKEN_PARTITION_SIZES if p >= forced and scratch_fits(request, p)),
                   default=PARTITION_SIZE)
        why = "" if size == forced else f"; {forced} would exceed the {SCRATCH_CAP_BYTES}-byte scratch cap"
        return size, f"partition size {size} (forced by METAL_ATTN_PARTITION_SIZE={forced}{why})"
    rule = PARTITION_RULES.get(device.backend, PARTITION_RULES["metal"])
    cores = device.gpu_cores or 0
    # Every size must give two partitions (the gate checked 512's) and keep the scratch within its cap.
    tiers = ([(p, need) for p, need in rule.tiers() if request.partitions(p) >= 2 and scratch_fits(request, p)]
             or [(PARTITION_SIZE, 0.0)])
    chosen, need = next(((p, need) for p, need in tiers if cores and items(p) >= need * cores), tiers[-1])
    if len(tiers) == 1 and len(rule.tiers()) == 1:
        return chosen, f"partition size {chosen} (PARTITION_RULES[{device.backend}]: one size)"
    reached = bool(cores) and items(chosen) >= need * cores
    long = (f"; above 512: {list(rule.long_sizes)} at {rule.long_min_items_per_core:g}*gpu_cores"
            if rule.long_sizes else "")
    return chosen, (f"partition size {chosen}: KV items {kvh}*{rows}*{request.partitions(chosen)}={items(chosen)} "
                    f"{'>=' if reached else '<'} {need:g}*gpu_cores={need * cores:g} "
                    f"(PARTITION_RULES[{device.backend}] takes the largest of {list(rule.sizes)} reaching "
                    f"{rule.min_items_per_core:g}*gpu_cores{long}, else the smallest)")


def plan_per_token(provider: str, request: AttentionRequest, device: DeviceInfo, settings: Settings, *,
                   whole_call: bool = True) -> Plan:
    """The per-token kernel's launch decision for an admitted request, as provider ``provider``'s plan;
    ``whole_call=False``: the request is a mixed batch's decode rows, which more work follows."""
    split, notes = split_decision(request, device)
    psize = 0
    if split:
        psize, note = partition_choice(request, device, settings)
        notes = (*notes, note)
    parts = request.partitions(psize) if split else 1
    items = kv_items_per_core(request.num_kv_heads, request.total_q_tokens, parts, device.gpu_cores)
    group = request.num_heads // request.num_kv_heads
    kv_tokens = psize if split else request.max_seq_len
    geo = geometry(request.head_size, request.dtype, device.backend, group, split, items, settings.mma_stage_pad,
                   settings.mma_stage_swizzle, settings.mma_key_rows, kv_tokens)
    rule = STAGING_RULES.get(device.backend)
    if geo.mma and rule is not None and rule.key_rows_launches:  # the matrix path: which of its two, and why
        within, note = key_rows_rule(rule, group, items, kv_tokens)
        notes = (*notes, f"{note} -> {_key_rows_verdict(geo, within, settings, rule, request.head_size)}")
    if split and device.backend == "cuda" and settings.cuda_fused_reduce:
        notes = (*notes, "reducer: fused into the split kernel where CUDA chains run "
                         "(METAL_ATTN_CUDA_FUSED_REDUCE=1), in one partition slice")
    elif split:  # the reducer's partition slices (the launch recomputes them from its batch, with the same rule)
        notes = (*notes, reducer_slices(request.total_q_tokens, request.num_heads, parts, device.gpu_cores,
                                        device.backend, settings.reducer_slices)[1])
    if device.backend == "cuda":
        notes = (*notes, idle_commit_note(request, whole_call, settings))
    return Plan(
        provider=provider,
        route=per_token_route(psize),
        partition_size=psize,
        grid=(geo.grid_x(request.num_heads), request.total_q_tokens, parts),
        threadgroup=(geo.threads, 1, 1),
        specialization=(device.backend, request.dtype, request.head_size, request.block_size, psize,
                        *dataclasses.astuple(geo)),
        notes=(*notes, describe_geometry(geo, items)),
    )


def _key_rows_verdict(geo: Geometry, within: bool, settings: Settings, rule: StagingRule, head_size: int) -> str:
    """Whether a matrix-path plan took the keys as rows, and what kept it from them (explain's note)."""
    if geo.mma == 2:
        return "taken"
    if not within:
        return "not taken: outside the rule"
    if not settings.mma_key_rows:
        return "not taken: METAL_ATTN_MMA_KEY_ROWS=0"
    if not settings.mma_stage_swizzle:
        return "not taken: METAL_ATTN_MMA_STAGE_SWIZZLE=0 (the path needs that row layout)"
    return f"not taken: no launch of key_rows_launches={list(rule.key_rows_launches)} fits head_size={head_size}"


# -- the per-token kernel: launching ------------------------------------------------------------


def paged_defines(split: bool, geo: Geometry, fused: bool = False) -> tuple[tuple[str, int], ...]:
    """The per-token kernel's code-path defines (route; direct or staged loads; the matrix path and its
    staged rows' swizzle; ``fused``: the split partials reduced in the same launch, CUDA chains only), as the pairs
    `kernels.load_kernel` hashes as given on every launch."""
    return (("PA_FUSED", int(fused)), ("PA_MMA", int(geo.mma)), ("PA_SPLIT", int(split)),
            ("PA_STAGED", int(geo.stage > 0)), ("PA_SWIZZLE", int(geo.swizzle)))


#: The fused reducer's outputs after the partials: the attention output and the arrival counters.
PA_FUSED_OUTPUTS = ("out", "counters")

#: Arrival counters of the fused reducer, one zeroed int32 array per size class, shared by every
#: fused call of the process (each call leaves them zero; calls sharing one are ordered).
_fused_counters: dict[int, mx.array] = {}


def fused_counters(slots: int) -> mx.array:
    """A zeroed int32 array of at least ``slots`` counters (a power of two, at least 1,024), kept for
    the process: the fused reducer's kernels leave it zero (`ChainedPerTokenLaunch`)."""
    size = max(1024, 1 << (max(slots, 1) - 1).bit_length())
    got = _fused_counters.get(size)
    if got is None:
        got = _fused_counters[size] = mx.zeros((size,), mx.int32)
    return got


def fused_reduce_enabled() -> bool:
    """Whether split per-token calls on CUDA chains reduce in the same launch (``cuda_fused_reduce``)."""
    from metal_attn.settings import get_settings

    return get_settings().cuda_fused_reduce


def per_token_kernel(backend: str, split: bool, geo: Geometry) -> Any:
    """The ``mx.fast`` kernel object of the per-token kernel for a route and geometry (built once)."""
    return kernels.load_kernel("paged_attention", PAGED_FILES, PA_INPUTS, PA_OUTPUTS[int(split)], backend,
                               defines=paged_defines(split, geo))


def launch_geometry(q: mx.array, k_cache: mx.array, md: AttentionMetadata, *, partition_size: int, backend: str,
                    rows: int | None = None) -> Geometry:
    """The geometry `plan` would give this launch (the device's core count for the grid measure);
    ``partition_size`` 0: unsplit."""
    from metal_attn.api import dtype_name
    from metal_attn.device import current_device
    from metal_attn.settings import get_settings

    total, num_heads, head = q.shape
    num_kv_heads = k_cache.shape[2]
    items = kv_items_per_core(num_kv_heads, rows or total, _max_parts(md, partition_size, rows),
                              current_device().gpu_cores)
    s = get_settings()
    return geometry(head, dtype_name(q.dtype), backend, num_heads // num_kv_heads, partition_size > 0, items,
                    s.mma_stage_pad, s.mma_stage_swizzle, s.mma_key_rows,
                    partition_size or _longest_row(md, rows))


def _longest_row(md: AttentionMetadata, rows: int | None) -> int:
    # The decode rows of a mixed batch: the longest decode row only.
    return md.max_decode_seq_len if rows is not None and rows == md.num_decode_seqs else md.max_seq_len


def _max_parts(md: AttentionMetadata, partition_size: int, rows: int | None) -> int:
    return -(-_longest_row(md, rows) // partition_size) if partition_size else 1


def launch_paged(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata, *, scale: float,
    sinks: mx.array | None, sliding_window: int | None, softcap: float | None, partition_size: int,
    backend: str, geometry_override: Geometry | None = None, prefetch: int | None = None,
    rows: int | None = None,
) -> mx.array:
    """Run the per-token kernel (and the reducer when split); returns ``[T, H, D]``.

    ``partition_size``: 0 for the unsplit route, else the split route's partitions, one of
    `PER_TOKEN_PARTITION_SIZES`. ``rows`` computes only the first ``rows`` query rows (the decode
    rows at the front of a mixed batch) and returns ``[rows, H, D]``.

    ``geometry_override`` replaces `launch_geometry` (checked by `geometry_problem`) and
    ``prefetch`` replaces `PREFETCH_NEXT` (0 or 1), for tuning sweeps and tests; plans run
    through `run_per_token`, whose geometry is valid by construction.
    """
    total, num_heads, head = q.shape
    if rows is not None and not 1 <= rows <= total:
        raise ValueError(f"rows={rows} (allowed: 1..{total}, the query rows of the batch)")
    if partition_size not in (0, *PER_TOKEN_PARTITION_SIZES):
        raise ValueError(f"partition_size={partition_size} (allowed: 0 (unsplit), "
                         f"{', '.join(map(str, PER_TOKEN_PARTITION_SIZES))})")
    if geometry_override is None:  # valid by construction
        geo = launch_geometry(q, k_cache, md, partition_size=partition_size, backend=backend, rows=rows)
    else:
        geo = geometry_override
        problem = geometry_problem(geo, head, num_heads // k_cache.shape[2], q.dtype.size, backend)
        if problem:
            raise ValueError(f"geometry_override={geometry_override}: {problem}")
    prefetch = PREFETCH_NEXT.get(backend, 0) if prefetch is None else prefetch
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch={prefetch} (allowed: 0 or 1)")
    return _launch(q, k_cache, v_cache, md, scale=scale, sinks=sinks, sliding_window=sliding_window,
                   softcap=softcap, partition_size=partition_size, backend=backend, geo=geo, prefetch=prefetch,
                   rows=rows)


def _launch(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata, *, scale: float,
    sinks: mx.array | None, sliding_window: int | None, softcap: float | None, partition_size: int, backend: str,
    geo: Geometry, prefetch: int, rows: int | None,
) -> mx.array:
    """`launch_paged` after its checks."""
    launch = per_token_launch(q.shape, q.dtype, k_cache.shape, md, scale=scale, use_sinks=sinks is not None,
                              sliding_window=sliding_window, softcap=softcap, partition_size=partition_size,
                              backend=backend, geo=geo, prefetch=prefetch, rows=rows, pool_dtype=k_cache.dtype)
    return launch(q, k_cache, v_cache, md, sinks)


@dataclasses.dataclass(frozen=True, slots=True)
class PerTokenLaunch:
    """A per-token launch over one batch (`per_token_launch`), with its reducer when split: call it
    with the query, the pools, the metadata it was built for and the sinks (or ``None`` when it was
    built without)."""

    launch: KernelLaunch
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array
    reduce: ReduceLaunch | None

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        inputs = [q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q,
                  self.zero_sinks if sinks is None else sinks, self.params, self.fparams]
        if self.reduce is None:
            return self.launch(inputs)[0]
        max_logits, exp_sums, tmp_out = self.launch(inputs)
        return self.reduce(max_logits, exp_sums, tmp_out, md, sinks)


@dataclasses.dataclass(frozen=True, slots=True)
class PerTokenChainPart:
    """A per-token launch on CUDA chains as a `ChainPart` (the kernel and, when split, the reducer, the
    partials its scratch) with the arrays it takes besides the call's: a chain of its own
    (`ChainedPerTokenLaunch`) or a piece of another (a mixed batch's decode rows inside its prefill route's
    chain, ``cuda_decode_rows_in_chain``). The part's inputs are `PA_INPUTS`, then ``extra`` when there is
    one; its one output is the attention output."""

    part: ChainPart
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array
    #: After the per-token inputs: the standalone reducer's parameters, or the fused reducer's
    #: counters (`fused_counters`), or nothing (unsplit).
    extra: mx.array | None

    def inputs(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
               sinks: mx.array | None) -> list[mx.array]:
        """The part's inputs for a call, in its order."""
        sinks = reducer_sinks(sinks, self.zero_sinks)  # float32, as the reducer always took them
        inputs = [q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, sinks, self.params,
                  self.fparams]
        if self.extra is not None:
            inputs.append(self.extra)
        return inputs


@dataclasses.dataclass(frozen=True, slots=True)
class ChainedPerTokenLaunch:
    """`PerTokenLaunch` as one MLX operation on CUDA (`metal_attn.cuda_ops`): the per-token kernel
    and, when split, the reducer, with the partials as the chain's scratch. Same kernel texts,
    grids and parameters; called the same way."""

    chain: Any
    launch: PerTokenChainPart

    @property
    def params(self) -> mx.array:
        return self.launch.params

    @property
    def fparams(self) -> mx.array:
        return self.launch.fparams

    @property
    def zero_sinks(self) -> mx.array:
        return self.launch.zero_sinks

    @property
    def extra(self) -> mx.array | None:
        return self.launch.extra

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        return self.chain(self.launch.inputs(q, k_cache, v_cache, md, sinks))[0]


def per_token_chain_part(
    q_shape: tuple[int, ...], dtype: Any, k_shape: tuple[int, ...], md: AttentionMetadata, *, scale: float,
    use_sinks: bool, sliding_window: int | None, softcap: float | None, partition_size: int, geo: Geometry,
    prefetch: int, rows: int | None, pool_dtype: Any = None,
) -> PerTokenChainPart:
    """`per_token_launch`'s launch on CUDA chains as a `PerTokenChainPart`, not yet a chain (the same
    arguments but ``backend``). Split (``partition_size`` > 0): the reducer fused into the kernel's one
    launch where ``cuda_fused_reduce`` says so (the partials reduced by the last threadgroup of each
    (row, head group)), else a launch of its own. A chain of its own checks each call's query, pools
    and metadata against the shapes given here."""
    from metal_attn import cuda_ops
    from metal_attn.api import dtype_name

    total, num_heads, head = q_shape
    total = rows or total
    _, block_size, num_kv_heads, _ = k_shape
    split = partition_size > 0
    fused = split and fused_reduce_enabled()
    max_parts = _max_parts(md, partition_size, rows)
    params = _params(md, num_heads, num_kv_heads, sliding_window, max_parts, use_sinks)
    fparams = pack_scale(scale, softcap)
    dn = dtype_name(dtype)
    sig = per_token_signature(dn, dtype_name(pool_dtype or dtype))
    in_dtypes = tuple(getattr(mx, t) for _, t in sig)
    in_shapes = (tuple(q_shape), tuple(k_shape), tuple(k_shape), tuple(md.block_tables.shape),
                 tuple(md.seq_lens.shape), tuple(md.cu_seqlens_q.shape), (num_heads,), tuple(params.shape),
                 tuple(fparams.shape))
    outputs = [(n, "float32" if split else dn) for n in PA_OUTPUTS[int(split)]]
    if fused:  # the output and the arrival counters after the partials
        outputs += [(PA_FUSED_OUTPUTS[0], dn), (PA_FUSED_OUTPUTS[1], "int32")]
    per_token = cuda_ops.kernel_function(
        "paged_attention", PAGED_FILES, paged_defines(split, geo, fused), sig, outputs,
        paged_template(dn, head, block_size, partition_size, geo, prefetch))
    grid = cuda_ops.threadgroups((geo.grid_x(num_heads), total, max_parts), (geo.threads, 1, 1))
    block = (geo.threads, 1, 1)
    out_spec = (((total, num_heads, head), dtype),)
    n_pa = len(PA_INPUTS)
    zero_sinks = zeros_f32(num_heads)
    if not split:  # buffer indices: the inputs, then the output
        part = ChainPart("metal_attn.per_token_ps0", in_dtypes, out_spec, (),
                         ((per_token, grid, block, (*range(n_pa), n_pa), n_pa),), in_shapes)
        return PerTokenChainPart(part, params, fparams, zero_sinks, None)
    if fused:
        scratch_spec = split_scratch(total, num_heads, max_parts, head)
        scratch = tuple(zip(scratch_spec["output_shapes"], scratch_spec["output_dtypes"]))
        # Buffer indices: the per-token inputs, the counters (state), the output, the partials.
        counters, out = n_pa, n_pa + 1
        partials = (out + 1, out + 2, out + 3)
        arrivals = fused_counters(total * grid[0])  # one per (row, head group)
        part = ChainPart(f"metal_attn.per_token_ps{partition_size}_fused", (*in_dtypes, mx.int32), out_spec, scratch,
                         ((per_token, grid, block, (*range(n_pa), *partials, out, counters), n_pa),),
                         (*in_shapes, tuple(arrivals.shape)), state=(counters,))
        return PerTokenChainPart(part, params, fparams, zero_sinks, arrivals)
    reduce_params = pack_int32((md.num_seqs, num_heads, max_parts, int(use_sinks)))
    launches, scratch = chained_split_reduce((per_token, grid, block), PA_INPUTS, dn, head, partition_size, total,
                                             num_heads, max_parts)
    part = ChainPart(f"metal_attn.per_token_ps{partition_size}", (*in_dtypes, mx.int32), out_spec, tuple(scratch),
                     tuple((fn, g, b, tuple(a), r) for fn, g, b, a, r in launches),
                     (*in_shapes, tuple(reduce_params.shape)))
    return PerTokenChainPart(part, params, fparams, zero_sinks, reduce_params)


def per_token_launch(
    q_shape: tuple[int, ...], dtype: Any, k_shape: tuple[int, ...], md: AttentionMetadata, *, scale: float,
    use_sinks: bool, sliding_window: int | None, softcap: float | None, partition_size: int, backend: str,
    geo: Geometry, prefetch: int, rows: int | None, pool_dtype: Any = None,
) -> PerTokenLaunch | ChainedPerTokenLaunch:
    """The per-token kernel's launch (and the reducer's when split: ``partition_size`` > 0) for a
    query of ``q_shape`` in ``dtype`` over pools of ``k_shape`` and the batch ``md``; ``rows``: only
    the first rows."""
    total, num_heads, head = q_shape
    total = rows or total
    _, block_size, num_kv_heads, _ = k_shape
    if backend == "cuda" and cuda_chains_enabled():
        from metal_attn.settings import get_settings

        launch = per_token_chain_part(q_shape, dtype, k_shape, md, scale=scale, use_sinks=use_sinks,
                                      sliding_window=sliding_window, softcap=softcap, partition_size=partition_size,
                                      geo=geo, prefetch=prefetch, rows=rows, pool_dtype=pool_dtype)
        # Whether the chain is the whole call (rows: a mixed batch's decode rows, which its prefill work follows).
        kv_bytes = kv_bytes_read(md.seq_lens_host, sliding_window, num_kv_heads, head, (pool_dtype or dtype).size)
        idle_commit = commit_when_idle(kv_bytes, rows is None, get_settings())
        chain = launch.part.build(commit_when_idle=idle_commit,
                                  direct_when_idle=get_settings().cuda_idle_direct_chains if idle_commit else 0)
        return ChainedPerTokenLaunch(chain, launch)
    split = partition_size > 0
    max_parts = _max_parts(md, partition_size, rows)
    params = _params(md, num_heads, num_kv_heads, sliding_window, max_parts, use_sinks)
    out = (split_scratch(total, num_heads, max_parts, head) if split
           else {"output_shapes": [(total, num_heads, head)], "output_dtypes": [dtype]})
    launch = kernel_launch(per_token_kernel(backend, split, geo),
                           template=paged_template(dtype, head, block_size, partition_size, geo, prefetch),
                           grid=(geo.grid_x(num_heads), total, max_parts), threadgroup=(geo.threads, 1, 1), **out)
    reduce = (reduce_launch((total, num_heads, max_parts, head), mx.float32, dtype, md, use_sinks, partition_size,
                            backend) if split else None)
    return PerTokenLaunch(launch, params, pack_scale(scale, softcap), zeros_f32(num_heads), reduce)


def _params(md: AttentionMetadata, num_heads: int, num_kv_heads: int, sliding_window: int | None, max_parts: int,
            use_sinks: bool) -> mx.array:
    """The per-token kernel's integer parameters for the batch ``md``."""
    return pack_int32((md.num_seqs, num_heads, num_kv_heads, md.max_blocks_per_seq, int(sliding_window or 0),
                       max_parts, int(use_sinks)))


def paged_template(dtype, head_size: int, block_size: int, partition_size: int, geo: Geometry,
                   prefetch: int) -> list[tuple[str, object]]:
    """The per-token kernel's template arguments (``dtype``: an MLX dtype, or its name for the source
    check; ``partition_size`` 0: unsplit)."""
    return [("T", dtype), ("HEAD_SIZE", head_size), ("BLOCK_SIZE", block_size),
            ("PARTITION_SIZE", partition_size), ("NUM_THREADS", geo.threads),
            ("TPT", geo.lanes), ("UNROLL", geo.unroll), ("HPS", geo.hps), ("HPW", geo.hpw),
            ("PREFETCH", prefetch), ("STAGE", geo.stage), ("STAGES", geo.stages), ("STAGE_PAD", geo.row_pad)]


def run_per_token(inputs: AttentionInputs, specialization: tuple, rows: int | None = None) -> mx.array:
    """Launch a per-token plan's specialization over ``inputs`` (``rows``: only the first rows, as
    `launch_paged`); no checks: the plan's geometry is valid by construction. The launch descriptor
    is built once per batch and call geometry (`cached_launch`): the layers of a step share it."""
    q, k_cache, md = inputs.q, inputs.k_cache, inputs.metadata
    key = (_epoch.current(), "per_token", specialization, rows, q.shape, q.dtype, k_cache.shape, k_cache.dtype,
           inputs.scale,
           inputs.softcap, inputs.sliding_window, inputs.sinks is not None)
    launch = md._launches.get(key)
    if launch is None:
        launch = cached_launch(md, key, lambda: per_token_launch(
            q.shape, q.dtype, k_cache.shape, md, backend=specialization[0],
            **_plan_launch_args(inputs, specialization, rows)))
    return launch(q, k_cache, inputs.v_cache, md, inputs.sinks)


def plan_chain_part(inputs: AttentionInputs, specialization: tuple, rows: int | None = None) -> PerTokenChainPart:
    """A per-token plan's specialization over ``inputs`` as a `PerTokenChainPart` (CUDA chains), for a
    host chain to run among its own launches: `run_per_token`'s launch, not built as a chain of its own."""
    return per_token_chain_part(inputs.q.shape, inputs.q.dtype, inputs.k_cache.shape, inputs.metadata,
                                **_plan_launch_args(inputs, specialization, rows))


def _plan_launch_args(inputs: AttentionInputs, specialization: tuple, rows: int | None) -> dict[str, Any]:
    """What a plan's specialization and the call's ``inputs`` give `per_token_launch` (and
    `per_token_chain_part`) besides the shapes, the metadata and the backend."""
    backend = specialization[0]
    return dict(scale=inputs.scale, use_sinks=inputs.sinks is not None, sliding_window=inputs.sliding_window,
                softcap=inputs.softcap, partition_size=specialization[4], geo=plan_geometry(specialization),
                prefetch=PREFETCH_NEXT.get(backend, 0), rows=rows, pool_dtype=inputs.k_cache.dtype)


def prepare_per_token(plan: Plan, device: DeviceInfo) -> None:
    """Compile a per-token plan's specialization now (a tiny launch), raising `KernelCompileError` on failure."""
    backend, dtype, head, block, psize = plan.specialization[:5]
    geo = plan_geometry(plan.specialization)

    def _go(b: TinyBatch) -> mx.array:
        # hps query heads on one KV head: the plan's exact specialization
        return launch_paged(b.q, b.cache, b.cache, b.metadata, scale=1.0, sinks=None, sliding_window=None,
                            softcap=None, partition_size=psize, backend=backend, geometry_override=geo)

    compile_eagerly(device, f"{plan.provider} {plan.route} {plan.specialization}", _go, dtype=dtype,
                    head_size=head, block_size=block, seq_len=psize + 1, num_heads=geo.hps)
