"""What the GPU providers (Metal and CUDA) share: the one module a GPU provider imports besides ``metal_attn.*``.

No provider module imports another provider's module; each takes what it shares from here.
The public names, by concept:

- availability: `availability_reasons` (why the GPU kernels cannot run on a device);
- zero buffers and scratch: `zeros_f32` (the sink logits of a call without sinks), `sink_logits`,
  `split_scratch` (the output shapes and dtypes of the split-KV contract's partials);
- parameter packing: `pack_int32` (a kernel's integer parameters), `pack_scale` (the score scale
  and softcap as the kernels take them);
- launch descriptors: `cached_launch` (per metadata: what a launch derives from its plan, the batch
  and the call's shapes and constants, built once and shared by the layers of a step),
  `KernelLaunch` / `kernel_launch` (one ``mx.fast`` call without its per-call arrays), and the
  per-token kernel's and the reducer's descriptors (`PerTokenLaunch`, `ReduceLaunch`); on CUDA with
  `metal_attn._cuda_ops` built, `ChainedPerTokenLaunch` (both kernels as one MLX operation,
  `metal_attn.cuda_ops`; `cuda_chains_enabled`);
- eager compilation (``Provider.prepare``): `tiny_batch` and `compile_eagerly` (a one-page launch
  of a specialization, skipped on hypothetical devices, failures as `KernelCompileError`);
- the split-KV reducer (``paged_attention_v2_reduce``) of every kernel that writes the split
  contract: `reduce_partitions`, with `reducer_template`, `REDUCE_INPUTS`, `NUM_THREADS` and the
  source-check entries `reducer_msl_specialization` and `reducer_cuda_source`;
- the per-token kernel (``kernels_v2/pagedattention.metal``) that ``classic`` runs for every batch and
  the mixed split runs for the decode rows: its geometry rules (`Geometry`, `geometry`,
  `GEOMETRY_RULES`, `STAGING_RULES`, ...), the occupancy gate (`split_decision`), the partition size
  (`PARTITION_RULES`, `partition_choice`), `plan_per_token`,
  `prepare_per_token`, `run_per_token` and `launch_paged`;
- the decode-rows sub-plan of a mixed batch (the decode rows at its front through the per-token
  kernel, the prefill rows through the provider's own kernel): `mixed_split` (whether a tiled
  kernel's decode rows leave its tiles, by `MIXED_DECODE_MIN_CONTEXT`), `decode_request` (those rows as a
  request of their own), `plan_decode_rows` (their plan; the provider keeps its specialization in
  its own plan: `decode_rows_part` gives the fields it carries; `tiles_decode_part` both steps for
  a tiled kernel), `prepare_decode_rows` and
  `run_decode_rows` (``[num_decode_seqs, H, D]``).
  `DECODE_ROWS_PROVIDER` names the provider whose kernel they use (disabling it keeps them in the
  caller's kernel).

Per-token routes: ``per_token_ps0`` (one pass per query row and head) and ``per_token_psP``
(split-KV: ``P``-token partitions, then the reducer), chosen by the occupancy gate
``num_heads * total_q_tokens < k * gpu_cores`` with at least two 512-token partitions (``k`` per
backend in `metal_attn.constants.SPLIT_GATE_FACTOR`). ``P`` is what the backend's
`PARTITION_RULES` gives (`partition_choice`): on CUDA the largest of 512/256/128/64 whose KV work
items reach the core count (measured on the H200), on Metal 512; ``METAL_ATTN_PARTITION_SIZE``
forces one for A/B runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import numpy as np

from metal_attn import _epoch, kernels
from metal_attn.constants import LOG2E, MIXED_DECODE_MIN_CONTEXT, PARTITION_SIZE, SCRATCH_CAP_BYTES, SPLIT_GATE_FACTOR
from metal_attn.kernels import SIMD_WIDTH
from metal_attn.provider import Plan
from metal_attn.request import Phase, split_scratch_bytes

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

#: Threads per threadgroup of the reducer, and the per-token kernel's default.
NUM_THREADS = 128
SIMDGROUPS = NUM_THREADS // SIMD_WIDTH
#: Threadgroup sizes a per-token geometry may take.
THREAD_CHOICES = (64, 128, 256)
#: Tokens a simdgroup takes per step on the matrix path (the columns of one 8x8 block).
MMA_TOKENS = 8

#: The kernel text of the per-token kernel and the reducer.
PAGED_FILES = ("paged_common.h", "split_reduce.h", "pagedattention.metal")
PA_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "sinks", "params", "fparams")
PA_OUTPUTS = {0: ("out",), 1: ("max_logits", "exp_sums", "tmp_out")}
REDUCE_INPUTS = ("max_logits", "exp_sums", "tmp_out", "seq_lens", "cu_seqlens_q", "sinks", "params")
#: The reducer's inputs with their dtype names (the partials are float32).
REDUCE_SIGNATURE = tuple(zip(REDUCE_INPUTS, ("float32", "float32", "float32", "int32", "int32", "float32", "int32")))


def per_token_signature(dtype: str, pool_dtype: str | None = None) -> tuple[tuple[str, str], ...]:
    """The per-token kernel's inputs with their dtype names: the query's ``dtype``, the pools'
    ``pool_dtype`` (default: the query's), then the metadata, sinks and parameters."""
    pool = pool_dtype or dtype
    return tuple(zip(PA_INPUTS, (dtype, pool, pool, "int32", "int32", "int32", "float32", "int32", "float32")))


def per_token_route(partition_size: int) -> str:
    """The per-token route's name: ``per_token_ps0`` unsplit, ``per_token_psP`` split into ``P``-token partitions."""
    return f"per_token_ps{partition_size}"


#: The provider whose kernel (the per-token kernel) the decode rows of a mixed split use.
DECODE_ROWS_PROVIDER = "classic"


# -- availability ----------------------------------------------------------------------------------


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


# -- zero buffers, scratch and parameter packing -----------------------------------------------------


@functools.lru_cache(maxsize=64)
def zeros_f32(n: int) -> mx.array:
    """``n`` float32 zeros (the sink logits of a call without sinks), built once per ``n``."""
    return kernels.param_array((0.0,) * n, "float32")


@functools.lru_cache(maxsize=8)
def placeholder(dtype: mx.Dtype) -> mx.array:
    """One element of ``dtype`` for a kernel input a launch does not read (so the kernel's signature,
    and its compiled specialization, stay those of the launches that do), built once per dtype."""
    out = mx.zeros((1,), dtype)
    mx.eval(out)
    return out


def sink_logits(sinks: mx.array | None, num_heads: int) -> mx.array:
    """The ``sinks`` input of a kernel: the sink logits given, else `zeros_f32` (the kernel's
    ``use_sinks`` parameter says which)."""
    return sinks if sinks is not None else zeros_f32(num_heads)


def pack_int32(values: tuple[int, ...]) -> mx.array:
    """A kernel's integer parameters as one int32 array, built once per distinct tuple
    (`metal_attn.kernels.param_array`)."""
    return kernels.param_array(values, "int32")


def pack_scale(scale: float, softcap: float | None) -> mx.array:
    """The float parameters ``(score scale, softcap)`` of the kernels that take ``fparams``: the scale
    in log2 space (times `LOG2E`, for ``exp2``) unless a softcap applies (the kernel scales before the
    ``tanh``, then converts), and the softcap (0: none)."""
    return kernels.param_array((scale if softcap else scale * LOG2E, float(softcap or 0.0)), "float32")


def split_scratch(rows: int, num_heads: int, max_parts: int, head_size: int) -> dict[str, list]:
    """The partials of the split-KV contract as ``mx.fast`` output arguments (``output_shapes`` and
    ``output_dtypes``): ``max_logits`` and ``exp_sums`` ``[rows, num_heads, max_parts]`` and
    ``tmp_out`` ``[rows, num_heads, max_parts, head_size]``, all float32 (their bytes:
    `metal_attn.request.split_scratch_bytes`)."""
    return {"output_shapes": [(rows, num_heads, max_parts), (rows, num_heads, max_parts),
                              (rows, num_heads, max_parts, head_size)],
            "output_dtypes": [mx.float32, mx.float32, mx.float32]}


# -- launch descriptors ------------------------------------------------------------------------------

#: Most launch descriptors one metadata keeps (a step needs one per kind of layer).
MAX_LAUNCHES_PER_METADATA = 64


@dataclasses.dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One ``mx.fast`` kernel call without its per-call arrays: the kernel object and every other
    keyword argument (template, grid, threadgroup, output shapes and dtypes), built once."""

    kernel: Any
    kwargs: dict[str, Any]

    def __call__(self, inputs: list[mx.array]) -> list[mx.array]:
        return self.kernel(inputs=inputs, **self.kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainLaunch:
    """Launches of our kernels as one MLX operation on CUDA (a `metal_attn.cuda_ops.chain`), called
    like a `KernelLaunch`: the inputs in order, the outputs back."""

    chain: Any

    def __call__(self, inputs: list[mx.array]) -> list[mx.array]:
        return self.chain(inputs)


def kernel_launch(kernel: Any, *, template: list, grid: tuple[int, ...], threadgroup: tuple[int, ...],
                  output_shapes: list, output_dtypes: list) -> KernelLaunch:
    """A `KernelLaunch` of ``kernel`` with these arguments."""
    return KernelLaunch(kernel, {"template": template, "grid": grid, "threadgroup": threadgroup,
                                 "output_shapes": output_shapes, "output_dtypes": output_dtypes})


def cuda_chains_enabled() -> bool:
    """Whether CUDA launches run as chains, one MLX operation each (`metal_attn.cuda_ops.enabled`:
    the module is built and ``METAL_ATTN_CUDA_CHAINS`` is on)."""
    from metal_attn import cuda_ops

    return cuda_ops.enabled()


def cached_launch(md: AttentionMetadata, key: tuple, build: Callable[[], Any]) -> Any:
    """The launch descriptor ``key`` of the batch ``md``, from ``build()`` on first use.

    A descriptor holds what a launch derives from its plan, the batch and the call's shapes and
    constants (kernel objects, templates, grids, output shapes, parameter arrays). It lives on the
    metadata (``AttentionMetadata._launches``), so the layers of a step share it, it goes with the
    step, and another metadata (other lengths or tables) builds its own. ``key`` must hold every
    value besides ``md`` the descriptor depends on, led by the dispatch epoch
    (`metal_attn._epoch.current`: settings and kernel sources change it).
    """
    cache = md._launches
    got = cache.get(key)
    if got is None:
        if len(cache) >= MAX_LAUNCHES_PER_METADATA:
            cache.clear()
        got = cache[key] = build()
    return got


# -- eager compilation (Provider.prepare) ------------------------------------------------------------


class TinyBatch(NamedTuple):
    """A one-sequence batch of zeros for a compile launch (``cache`` serves as both pools)."""

    q: mx.array
    cache: mx.array
    metadata: AttentionMetadata


def tiny_batch(dtype: str, head_size: int, block_size: int, *, seq_len: int = 1, q_rows: int = 1,
               num_heads: int = 1, num_kv_heads: int = 1) -> TinyBatch:
    """One sequence of ``seq_len`` tokens (its pages ``0..``) whose last ``q_rows`` are queries:
    ``q`` ``[q_rows, num_heads, head_size]`` and a pool of exactly those pages, all zeros."""
    from metal_attn.metadata import AttentionMetadata

    mdt = getattr(mx, dtype)
    pages = -(-seq_len // block_size)
    md = AttentionMetadata.build(np.arange(pages, dtype=np.int32)[None, :], [seq_len], [0, q_rows], validate=False)
    return TinyBatch(mx.zeros((q_rows, num_heads, head_size), mdt),
                     mx.zeros((pages, block_size, num_kv_heads, head_size), mdt), md)


def compile_eagerly(device: DeviceInfo, what: str, launch: Callable[[TinyBatch], Any], *, dtype: str,
                    head_size: int, block_size: int, seq_len: int = 1, q_rows: int = 1, num_heads: int = 1,
                    num_kv_heads: int = 1) -> None:
    """A provider's ``prepare``: evaluate ``launch`` over a `tiny_batch` now, so that a compile
    failure raises `KernelCompileError` (named by ``what``) while a fallback is still possible.
    Skipped for hypothetical devices (nothing runs there)."""
    if device.hypothetical:
        return
    batch = tiny_batch(dtype, head_size, block_size, seq_len=seq_len, q_rows=q_rows, num_heads=num_heads,
                       num_kv_heads=num_kv_heads)
    kernels.compile_now(lambda: launch(batch), what)


# -- the split-KV reducer --------------------------------------------------------------------------


def reducer_kernel(backend: str) -> Any:
    """The ``mx.fast`` kernel object of ``paged_attention_v2_reduce`` on ``backend`` (built once)."""
    return kernels.load_kernel("paged_attention_v2_reduce", PAGED_FILES, REDUCE_INPUTS, ("out",), backend)


def reducer_template(out_dtype: Any, tmp_dtype: Any, head_size: int, partition_size: int) -> list[tuple[str, Any]]:
    """The reducer's template arguments (dtypes as MLX dtypes, or their names for the source checks)."""
    return [("T", out_dtype), ("TT", tmp_dtype), ("HEAD_SIZE", head_size), ("PARTITION_SIZE", partition_size),
            ("NUM_THREADS", NUM_THREADS)]


def reduce_partitions(
    max_logits: mx.array, exp_sums: mx.array, tmp_out: mx.array, metadata: AttentionMetadata,
    sinks: mx.array | None, partition_size: int, *, out_dtype=None, backend: str | None = None,
) -> mx.array:
    """Launch ``paged_attention_v2_reduce`` over partials written by the split contract.

    ``max_logits``/``exp_sums``: ``[total_q_tokens, num_heads, max_parts]`` float32
    (log2-space reference maxima, each the partition's maximum or up to
    ``RESCALE_SLACK`` below it; sums un-normalised, relative to that reference); ``tmp_out``: ``[..., head_size]``
    (float32 or the query dtype), already divided by ``exp_sums + eps``; neutral
    partials are ``(-FLT_MAX, 0, 0)``. Each row's partition count is recomputed
    from ``metadata`` (causal length over ``partition_size``). ``sinks``: float32
    ``[num_heads]`` or ``None``, folded once here. Returns ``[total_q_tokens,
    num_heads, head_size]`` in ``out_dtype`` (default: ``tmp_out``'s dtype).
    """
    total, num_heads, max_parts, _ = tmp_out.shape
    if max_logits.shape != (total, num_heads, max_parts) or exp_sums.shape != max_logits.shape:
        raise ValueError(f"max_logits.shape={tuple(max_logits.shape)} and exp_sums.shape={tuple(exp_sums.shape)} "
                         f"must both be {(total, num_heads, max_parts)} to match tmp_out.shape={tuple(tmp_out.shape)}")
    launch = reduce_launch(tmp_out.shape, tmp_out.dtype, out_dtype or tmp_out.dtype, metadata, sinks is not None,
                           partition_size, backend or _backend())
    return launch(max_logits, exp_sums, tmp_out, metadata, sinks)


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceLaunch:
    """A reducer launch over one batch (`reduce_launch`): call it with the partials, the metadata it
    was built for and the sinks (or ``None`` when it was built without)."""

    launch: KernelLaunch
    params: mx.array
    zero_sinks: mx.array

    def __call__(self, max_logits: mx.array, exp_sums: mx.array, tmp_out: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        if sinks is None:
            sinks = self.zero_sinks
        elif sinks.dtype != mx.float32:
            sinks = sinks.astype(mx.float32)
        return self.launch([max_logits, exp_sums, tmp_out, md.seq_lens, md.cu_seqlens_q, sinks, self.params])[0]


def reduce_launch(tmp_shape: tuple[int, ...], tmp_dtype: Any, out_dtype: Any, md: AttentionMetadata,
                  use_sinks: bool, partition_size: int, backend: str) -> ReduceLaunch:
    """The reducer's launch over partials of ``tmp_shape`` ``[rows, num_heads, max_parts, head_size]``."""
    total, num_heads, max_parts, head = tmp_shape
    launch = kernel_launch(reducer_kernel(backend), template=reducer_template(out_dtype, tmp_dtype, head,
                                                                              partition_size),
                           grid=(num_heads * NUM_THREADS, total, 1), threadgroup=(NUM_THREADS, 1, 1),
                           output_shapes=[(total, num_heads, head)], output_dtypes=[out_dtype])
    return ReduceLaunch(launch, pack_int32((md.num_seqs, num_heads, max_parts, int(use_sinks))), zeros_f32(num_heads))


def reducer_msl_specialization(label: str, dtype: str, head_size: int, partition_size: int,
                               rows: int = 3) -> Specialization:
    """The reducer's Metal source-check entry (`metal_attn.msl_check`) for ``dtype`` outputs from
    float32 partials (``rows`` query rows, 4 heads, 2 sequences, 2 partitions: shapes only matter
    for tracing)."""
    from metal_attn.source_specs import Specialization

    return Specialization(
        label=label, kernel="paged_attention_v2_reduce", source_files=PAGED_FILES, input_names=REDUCE_INPUTS,
        output_names=("out",), template=tuple(reducer_template(dtype, "float32", head_size, partition_size)),
        inputs=(((rows, 4, 2), "float32"), ((rows, 4, 2), "float32"), ((rows, 4, 2, head_size), "float32"),
                ((2,), "int32"), ((3,), "int32"), ((4,), "float32"), ((4,), "int32")),
        outputs=(((rows, 4, head_size), dtype),),
    )


def reducer_cuda_source(label: str, dtype: str, head_size: int, partition_size: int) -> CudaSource:
    """The reducer's CUDA source-check entry (`metal_attn.cuda_check`) for ``dtype`` outputs from
    float32 partials."""
    from metal_attn.source_specs import CudaSource

    return CudaSource(label, "paged_attention_v2_reduce", PAGED_FILES,
                      REDUCE_SIGNATURE, (("out", dtype),),
                      tuple(reducer_template(dtype, "float32", head_size, partition_size)))


# -- the per-token kernel: geometry ---------------------------------------------------------------------


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
@dataclasses.dataclass(frozen=True)
class StagingRule:
    """When and how the per-token kernel stages K/V chunks through threadgroup memory (data).

    Staged launches give one threadgroup every head of a GQA group (``HPS`` = the group, or its
    largest divisor up to ``max_heads``), so each K/V row is read from the pools once. They apply
    to groups of at least ``min_group`` heads and to the ``head_sizes`` the sweep measured; other
    requests keep direct loads (the established geometry).

    - heads per simdgroup (HPW): ``hpw_small_grid`` on split launches with fewer than
      ``small_grid_per_core`` threadgroups per GPU core (short partitions, few of them: each
      simdgroup needs its own instruction-level parallelism), else ``hpw``; raised to the first
      divisor of HPS whose simdgroups across heads (HPS/HPW) divide the NUM_THREADS/32 simdgroups;
    - tokens unrolled per lane: ``unroll_one_head`` when a simdgroup holds one head, else
      ``unroll_more_heads``;
    - ``chunk`` tokens per staged chunk (halved until the chunks fit the threadgroup-memory
      limit), ``stages`` chunks in flight;
    - the matrix path (``Geometry.mma``: the heads as rows of 8x8 products) for 16-bit dtypes at
      the ``mma_head_sizes``: the first of ``mma_launches`` (threads, chunk) whose chunks fit.
    """

    min_group: int
    head_sizes: tuple[int, ...]
    max_heads: int
    hpw: int
    hpw_small_grid: int
    small_grid_per_core: float
    unroll_one_head: int
    unroll_more_heads: int
    chunk: int
    stages: int
    mma_head_sizes: tuple[int, ...] = ()
    mma_launches: tuple[tuple[int, int], ...] = ()


#: CUDA: the H200 sweep (docs/bench-h200-classic.md, `benchmarks/sweep_gpu_tuning.py classic`).
#: Metal: none (direct loads, upstream's shape; nothing here measures an Apple GPU).
STAGING_RULES: dict[str, StagingRule] = {
    "cuda": StagingRule(min_group=4, head_sizes=(128, 256), max_heads=8, hpw=2, hpw_small_grid=1,
                        small_grid_per_core=6.0, unroll_one_head=4, unroll_more_heads=2, chunk=32, stages=2,
                        mma_head_sizes=(128, 256), mma_launches=((128, 32), (64, 16))),
}
#: Threadgroup memory the staged chunks may take, per backend (the rule's budget: the rest of
#: `THREADGROUP_BYTES_LIMIT` holds Q's matrix operands and the merge statistics; the merge's
#: partial outputs reuse the stages).
STAGE_BYTES_LIMIT = {"metal": 24 * 1024, "cuda": 40 * 1024}
#: All of the per-token kernel's threadgroup memory, per backend: CUDA's static limit is 48 KiB
#: a threadgroup, Apple GPUs have 32 KiB.
THREADGROUP_BYTES_LIMIT = {"metal": 32 * 1024, "cuda": 48 * 1024}
#: Bytes of padding after each staged K/V row, by path (`Geometry.stage_pad`'s default). Scalar:
#: 64, so that the two tokens a half-simdgroup reads sit in different banks. Matrix: 16, so that
#: the 8 rows of a fragment read do. On CUDA the matrix path's rows are not padded but swizzled
#: (`Geometry.swizzle`, ``METAL_ATTN_MMA_STAGE_SWIZZLE``, on by default): ncu on the H200 counts
#: 1.5x the L2 reads of the bytes with 16-byte padding (rows not 32-byte aligned), 1.0x with 32
#: (but 32x the bank conflicts) and 1.0x swizzled with as few conflicts as at 16
#: (docs/bench-h200-classic.md, nineteenth session). Metal keeps the padding: the swizzle's
#: fragment loads are written for CUDA's ``ldmatrix`` only.
STAGE_PAD = {"scalar": 64, "mma": 16}
#: Whether the kernel asks L2 for the next iteration's K/V rows (CUDA ``prefetch.global.L2``;
#: Metal has no such instruction and the kernel's prefetch is a no-op there).
PREFETCH_NEXT = {"metal": 0, "cuda": 1}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One launch shape of the per-token kernel."""

    lanes: int  # lanes per token (TPT)
    unroll: int  # tokens per lane per iteration
    hps: int  # query heads per threadgroup (all of one KV head)
    hpw: int = 0  # query heads per simdgroup (0: all ``hps``, the simdgroups split the tokens)
    stage: int = 0  # tokens per chunk staged through threadgroup memory (0: direct loads)
    stages: int = 2  # staged chunks in flight
    mma: int = 0  # 1: the heads as rows of 8x8 matrix products (staged, 16-bit; lanes/unroll unused)
    threads: int = NUM_THREADS  # threads per threadgroup
    #: Bytes of padding after each staged row (0: the path's default, `STAGE_PAD`: 64 for the
    #: scalar path, 16 for the matrix path's fragment reads).
    stage_pad: int = 0
    #: 1 (matrix path, CUDA): rows unpadded, each row's 16-byte pieces XOR-swizzled by the row's index
    #: mod 8 (``stage_pad`` unused; `row_pad` is 0).
    swizzle: int = 0

    def __post_init__(self) -> None:
        if self.hpw == 0:
            object.__setattr__(self, "hpw", self.hps)
        if self.stage_pad == 0:
            object.__setattr__(self, "stage_pad", STAGE_PAD["mma" if self.mma else "scalar"])

    @property
    def simdgroups(self) -> int:
        return self.threads // SIMD_WIDTH

    @property
    def row_pad(self) -> int:
        """Bytes between the end of one staged row and the start of the next (the kernel's ``STAGE_PAD``)."""
        return 0 if self.swizzle else self.stage_pad

    def grid_x(self, num_heads: int) -> int:
        """The launch grid's x extent in threads: one threadgroup per ``hps`` query heads."""
        return num_heads // self.hps * self.threads

    @property
    def simdgroups_across_heads(self) -> int:
        return self.hps // self.hpw

    @property
    def token_simdgroups(self) -> int:
        """Simdgroups that split the tokens (each holding its own softmax state until the merge)."""
        return self.simdgroups // self.simdgroups_across_heads

    @property
    def tokens_per_pass(self) -> int:
        """Tokens the simdgroups that split the tokens take per iteration (a staged chunk is whole passes)."""
        per_simdgroup = MMA_TOKENS if self.mma else (SIMD_WIDTH // self.lanes) * self.unroll
        return self.token_simdgroups * per_simdgroup

    def stage_bytes(self, head_size: int, itemsize: int) -> int:
        """Threadgroup memory of the staged chunks (rows padded as the kernel lays them out:
        `row_pad` bytes)."""
        return self.stages * 2 * self.stage * (head_size * itemsize + self.row_pad) if self.stage else 0

    def threadgroup_bytes(self, head_size: int, itemsize: int, backend: str) -> int:
        """All the threadgroup memory the kernel declares for this geometry: the stages (or, with
        direct loads, the merge's partial outputs; staged, those reuse the stages), the merge
        statistics and, on the matrix path, Q's packed operands (a 32-bit register each on CUDA,
        two floats on Metal)."""
        merge = self.token_simdgroups * self.hps * head_size * 4
        main = max(self.stage_bytes(head_size, itemsize), merge)
        stats = self.token_simdgroups * self.hps * 2 * 4
        q_ops = (head_size // 8) * SIMD_WIDTH * (4 if backend == "cuda" else 8) if self.mma else 0
        return main + stats + q_ops


def geometry(head_size: int, dtype: str | None, backend: str = "metal", group: int = 1,
             split: bool = False, kv_items_per_core: float | None = None, mma_stage_pad: int = 0,
             mma_stage_swizzle: bool = True) -> Geometry:
    """The kernel geometry for ``head_size`` on ``backend``, GQA ``group`` query heads per KV head, route ``split``.

    ``kv_items_per_core``: (KV heads x query rows x partitions) / GPU cores of the launch, for
    the staging rule's small-grid choice (None: treated as a large grid). ``mma_stage_pad``: the
    matrix path's row padding (``METAL_ATTN_MMA_STAGE_PAD``; 0: `STAGE_PAD`'s); ``mma_stage_swizzle``: its
    rows unpadded and swizzled instead (``METAL_ATTN_MMA_STAGE_SWIZZLE``, the default; where
    `geometry_problem` refuses the swizzle, as on Metal, the padded rows).
    """
    vecs = head_size // 4
    if head_size % 4 or vecs == 0:
        raise ValueError(f"head_size={head_size} has no lane geometry (need a positive multiple of 4)")
    rule = GEOMETRY_RULES.get(backend, GEOMETRY_RULES["metal"])
    lanes = next(t for t in (32, 16, 8, 4, 2, 1)
                 if t <= rule.max_lanes and vecs % t == 0 and (head_size // t >= rule.min_elements or t == 1))
    itemsize = 4 if dtype in (None, "float32") else 2  # unknown dtype: size the chunks for the widest
    mma = _mma_geometry(STAGING_RULES.get(backend), backend, head_size, dtype, lanes, group, mma_stage_pad,
                        mma_stage_swizzle)
    if mma is not None:
        return mma
    staged = _staged_geometry(STAGING_RULES.get(backend), backend, head_size, itemsize, lanes, group, split,
                              kv_items_per_core)
    if staged is not None:
        return staged
    elements = head_size // lanes
    unroll = 2 if elements <= (rule.unroll_up_to if split else rule.unroll_up_to_unsplit) else 1
    hps = next((h for h in rule.hps_choices if group % h == 0 and h * elements <= rule.hps_element_budget), 1)
    return Geometry(lanes, unroll, hps)


def _group_heads(rule: StagingRule, group: int) -> int:
    """Heads per threadgroup on a staged launch: the GQA group, or its largest divisor up to ``max_heads``."""
    return max(d for d in range(1, min(group, rule.max_heads) + 1) if group % d == 0)


def _mma_geometry(rule: StagingRule | None, backend: str, head_size: int, dtype: str | None, lanes: int,
                  group: int, pad: int, swizzle: bool) -> Geometry | None:
    """The matrix-path geometry `StagingRule` gives, or None where it does not apply (the same for
    both routes and any grid: the sweep found no split or small-grid variant worth a rule)."""
    if (rule is None or dtype not in ("float16", "bfloat16") or group < rule.min_group
            or head_size not in rule.mma_head_sizes):
        return None
    hps = _group_heads(rule, group)
    for threads, chunk in rule.mma_launches:
        geo = Geometry(lanes, 1, hps, hps, chunk, rule.stages, mma=1, threads=threads, stage_pad=pad)
        if geometry_problem(geo, head_size, group, 2, backend) is None:
            swizzled = dataclasses.replace(geo, swizzle=1)
            return swizzled if swizzle and geometry_problem(swizzled, head_size, group, 2, backend) is None else geo
    return None


def _staged_geometry(rule: StagingRule | None, backend: str, head_size: int, itemsize: int, lanes: int,
                     group: int, split: bool, kv_items_per_core: float | None) -> Geometry | None:
    """The staged geometry `StagingRule` gives, or None where it does not apply."""
    if rule is None or group < rule.min_group or head_size not in rule.head_sizes:
        return None
    hps = _group_heads(rule, group)
    small = split and kv_items_per_core is not None and kv_items_per_core * group / hps < rule.small_grid_per_core
    target = rule.hpw_small_grid if small else rule.hpw
    hpw = next((h for h in range(target, hps + 1) if hps % h == 0 and SIMDGROUPS % (hps // h) == 0), None)
    if hpw is None:
        return None
    unroll = rule.unroll_one_head if hpw == 1 else rule.unroll_more_heads
    per_pass = Geometry(lanes, unroll, hps, hpw).tokens_per_pass
    chunk = rule.chunk
    while chunk >= per_pass:
        geo = Geometry(lanes, unroll, hps, hpw, chunk, rule.stages)
        if geometry_problem(geo, head_size, group, itemsize, backend) is None:
            return geo
        chunk //= 2
    return None


def source_check_launches(head_size: int, dtype: str | None = None) -> list[tuple[bool, Geometry]]:
    """(split, geometry) pairs whose Metal text the source check type-checks, for both routes: Metal's
    own geometry (direct loads), one staged chunk per token simdgroup pass, and for 16-bit ``dtype``
    and head sizes that are multiples of 32 the matrix path (the staged code paths the CUDA tables
    choose; the text is checked, whether or not Apple's threadgroup memory would hold that chunk)."""
    launches = []
    for split in (False, True):
        geo = geometry(head_size, None, "metal", split=split)
        one_pass = Geometry(geo.lanes, 1, 1, 1).tokens_per_pass
        launches += [(split, geo), (split, Geometry(geo.lanes, 1, 1, 1, one_pass, 2))]
        if dtype in ("float16", "bfloat16") and head_size % 32 == 0:
            mma_pass = Geometry(geo.lanes, 1, 1, 1, mma=1).tokens_per_pass
            launches.append((split, Geometry(geo.lanes, 1, 1, 1, mma_pass, 2, mma=1)))
    return launches


def _bytes_limit(table: dict[str, int], backend: str) -> int:
    """A per-backend threadgroup-memory ``table``'s value for ``backend`` (Apple's, the smaller, for any other)."""
    return table.get(backend, table["metal"])


def kv_items_per_core(num_kv_heads: int, rows: int, parts: int, gpu_cores: int | None) -> float | None:
    """(KV heads x query rows x partitions) per GPU core, the staging rule's grid measure (None: cores unknown)."""
    return num_kv_heads * rows * parts / gpu_cores if gpu_cores else None


def _backend() -> str:
    from metal_attn.device import current_device

    return current_device().backend


def geometry_problem(geo: Geometry, head_size: int, group: int, itemsize: int, backend: str) -> str | None:
    """Why ``geo`` cannot lay out ``head_size`` for a GQA ``group`` (None when it can)."""
    lanes = geo.lanes
    if lanes not in (1, 2, 4, 8, 16, 32) or head_size % (4 * lanes):
        return f"lanes={lanes} (allowed: a power of two up to 32 dividing head_size/4={head_size // 4})"
    if geo.unroll < 1:
        return f"unroll={geo.unroll} (allowed: >= 1)"
    if geo.hps < 1 or group % geo.hps:
        return f"hps={geo.hps} (allowed: a divisor of the GQA group {group})"
    if geo.threads not in THREAD_CHOICES:
        return f"threads={geo.threads} (allowed: {', '.join(map(str, THREAD_CHOICES))})"
    if geo.hpw < 1 or geo.hps % geo.hpw or geo.simdgroups % (geo.hps // geo.hpw):
        return (f"hpw={geo.hpw} (allowed: a divisor of hps={geo.hps} with hps/hpw dividing {geo.simdgroups} "
                f"simdgroups)")
    if geo.stage_pad < 16 or geo.stage_pad % 16:
        return f"stage_pad={geo.stage_pad} (allowed: a positive multiple of 16 bytes, the staged copies' size)"
    if geo.swizzle and (geo.swizzle != 1 or not geo.mma or backend != "cuda" or head_size * itemsize < 128):
        return (f"swizzle={geo.swizzle} (allowed: 0, or 1 on the matrix path (mma={geo.mma}) on cuda "
                f"(backend={backend}) with rows of at least eight 16-byte pieces (head_size={head_size}, "
                f"itemsize={itemsize}))")
    if geo.mma:
        if geo.mma != 1 or not geo.stage or itemsize != 2 or geo.hpw != geo.hps or geo.hps > 8 or head_size % 32:
            return (f"mma={geo.mma} (allowed: 0, or 1 with staged chunks, a 16-bit dtype (itemsize={itemsize}), "
                    f"hpw == hps <= 8 (hps={geo.hps}, hpw={geo.hpw}) and head_size a multiple of 32 "
                    f"(head_size={head_size}))")
    if geo.stage:
        if geo.stage < 0 or geo.stage % geo.tokens_per_pass:
            return (f"stage={geo.stage} (allowed: 0, or a multiple of the {geo.tokens_per_pass} tokens the token "
                    f"simdgroups take per iteration)")
        if geo.stages < 2:
            return f"stages={geo.stages} (allowed: >= 2)"
        limit = _bytes_limit(STAGE_BYTES_LIMIT, backend)
        if geo.stage_bytes(head_size, itemsize) > limit:
            return (f"stage={geo.stage} stages={geo.stages}: {geo.stage_bytes(head_size, itemsize)} bytes of "
                    f"threadgroup memory on {backend} (allowed: <= {limit})")
    total = geo.threadgroup_bytes(head_size, itemsize, backend)
    total_limit = _bytes_limit(THREADGROUP_BYTES_LIMIT, backend)
    if total > total_limit:
        return (f"{geo}: {total} bytes of threadgroup memory in all at head_size={head_size} on {backend} "
                f"(allowed: <= {total_limit})")
    return None


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
#: above 512 are for long contexts, where fewer and longer threadgroups stream the same bytes.
PER_TOKEN_PARTITION_SIZES = (4096, 2048, 1024, 512, 256, 128, 64)

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


def plan_per_token(provider: str, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The per-token kernel's launch decision for an admitted request, as provider ``provider``'s plan."""
    split, notes = split_decision(request, device)
    psize = 0
    if split:
        psize, note = partition_choice(request, device, settings)
        notes = (*notes, note)
    parts = request.partitions(psize) if split else 1
    items = kv_items_per_core(request.num_kv_heads, request.total_q_tokens, parts, device.gpu_cores)
    geo = geometry(request.head_size, request.dtype, device.backend, request.num_heads // request.num_kv_heads,
                   split, items, settings.mma_stage_pad, settings.mma_stage_swizzle)
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


def describe_geometry(geo: Geometry, kv_items_per_core: float | None) -> str:
    """The geometry as a diagnostics note."""
    loads = (f"staged chunks of {geo.stage} tokens, {geo.stages} in flight" if geo.stage else "direct loads")
    if geo.stage and geo.swizzle:
        loads += ", rows unpadded and swizzled"
    elif geo.stage and geo.stage_pad != STAGE_PAD["mma" if geo.mma else "scalar"]:
        loads += f", rows padded by {geo.stage_pad} bytes"
    grid = "" if kv_items_per_core is None else f" (kv_items_per_core={kv_items_per_core:.1f})"
    if geo.mma:
        return (f"heads_per_threadgroup={geo.hps} as the rows of 8x8 matrix products, {MMA_TOKENS} tokens a "
                f"simdgroup step, {loads}{grid}")
    return (f"lanes_per_token={geo.lanes} unroll={geo.unroll} heads_per_threadgroup={geo.hps} "
            f"heads_per_simdgroup={geo.hpw}, {loads}{grid}")


@functools.lru_cache(maxsize=256)
def plan_geometry(specialization: tuple) -> Geometry:
    """The `Geometry` a classic plan's specialization carries."""
    return Geometry(*specialization[5:])


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
                    s.mma_stage_pad, s.mma_stage_swizzle)


def _max_parts(md: AttentionMetadata, partition_size: int, rows: int | None) -> int:
    # The decode rows of a mixed batch need partitions for the longest decode row only.
    longest = md.max_decode_seq_len if rows is not None and rows == md.num_decode_seqs else md.max_seq_len
    return -(-longest // partition_size) if partition_size else 1


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
class ChainedPerTokenLaunch:
    """`PerTokenLaunch` as one MLX operation on CUDA (`metal_attn.cuda_ops`): the per-token kernel
    and, when split, the reducer, with the partials as the chain's scratch. Same kernel texts,
    grids and parameters; called the same way."""

    chain: Any
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array
    #: After the per-token inputs: the standalone reducer's parameters, or the fused reducer's
    #: counters (`fused_counters`), or nothing (unsplit).
    extra: mx.array | None

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        if sinks is None:
            sinks = self.zero_sinks
        elif sinks.dtype != mx.float32:  # the chain takes float32 sinks (as the reducer always did)
            sinks = sinks.astype(mx.float32)
        inputs = [q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, sinks, self.params,
                  self.fparams]
        if self.extra is not None:
            inputs.append(self.extra)
        return self.chain(inputs)[0]


def chained_per_token_launch(
    dtype: Any, pool_dtype: Any, total: int, num_heads: int, head: int, block_size: int, max_parts: int,
    partition_size: int, geo: Geometry, prefetch: int, params: mx.array, fparams: mx.array,
    reduce_params: mx.array | None, shapes: tuple[tuple[int, ...], ...], fused: bool = False,
) -> ChainedPerTokenLaunch:
    """The `ChainedPerTokenLaunch` of a per-token launch (`per_token_launch` builds both kinds);
    ``shapes``: the query's, the pools' and the metadata's (``q``, ``k``, ``v``, ``block_tables``,
    ``seq_lens``, ``cu_seqlens_q``), which every call of the chain checks. ``fused`` (split only):
    one launch, the partials reduced by the last threadgroup of each (row, head group)."""
    from metal_attn import cuda_ops
    from metal_attn.api import dtype_name

    split = partition_size > 0
    if fused and not split:
        raise ValueError(f"fused=True needs a split launch (partition_size={partition_size}; allowed: > 0)")
    dn = dtype_name(dtype)
    sig = per_token_signature(dn, dtype_name(pool_dtype))
    in_dtypes = [getattr(mx, t) for _, t in sig]
    in_shapes = [*shapes, (num_heads,), tuple(params.shape), tuple(fparams.shape)]
    outputs = [(n, "float32" if split else dn) for n in PA_OUTPUTS[int(split)]]
    if fused:  # the output and the arrival counters after the partials
        outputs += [(PA_FUSED_OUTPUTS[0], dn), (PA_FUSED_OUTPUTS[1], "int32")]
    per_token = cuda_ops.kernel_function(
        "paged_attention", PAGED_FILES, paged_defines(split, geo, fused), sig, outputs,
        paged_template(dn, head, block_size, partition_size, geo, prefetch))
    grid = cuda_ops.threadgroups((geo.grid_x(num_heads), total, max_parts), (geo.threads, 1, 1))
    out_spec = [((total, num_heads, head), dtype)]
    n_pa = len(PA_INPUTS)
    if not split:  # buffer indices: the inputs, then the output
        ch = cuda_ops.chain("metal_attn.per_token_ps0", in_dtypes, out_spec, [],
                            [(per_token, grid, (geo.threads, 1, 1), [*range(n_pa), n_pa], n_pa)], in_shapes)
        return ChainedPerTokenLaunch(ch, params, fparams, zeros_f32(num_heads), None)
    scratch_spec = split_scratch(total, num_heads, max_parts, head)
    scratch = list(zip(scratch_spec["output_shapes"], scratch_spec["output_dtypes"]))
    if fused:
        # Buffer indices: the per-token inputs, the counters (state), the output, the partials.
        counters, out = n_pa, n_pa + 1
        partials = [out + 1, out + 2, out + 3]
        arrivals = fused_counters(total * grid[0])  # one per (row, head group)
        ch = cuda_ops.chain(f"metal_attn.per_token_ps{partition_size}_fused", [*in_dtypes, mx.int32], out_spec,
                            scratch, [(per_token, grid, (geo.threads, 1, 1), [*range(n_pa), *partials, out, counters],
                                       n_pa)], [*in_shapes, tuple(arrivals.shape)], state=[counters])
        return ChainedPerTokenLaunch(ch, params, fparams, zeros_f32(num_heads), arrivals)
    reducer = cuda_ops.kernel_function("paged_attention_v2_reduce", PAGED_FILES, None, REDUCE_SIGNATURE,
                                       [("out", dn)], reducer_template(dn, "float32", head, partition_size))
    # Buffer indices: the per-token inputs, the reducer's parameters, the output, the partials.
    red_params, out = n_pa, n_pa + 1
    partials = [out + 1, out + 2, out + 3]
    shared = [PA_INPUTS.index(n) for n in REDUCE_INPUTS[len(partials):-1]]  # seq_lens, cu_seqlens_q, sinks
    launches = [(per_token, grid, (geo.threads, 1, 1), [*range(n_pa), *partials], n_pa),
                (reducer, cuda_ops.threadgroups((num_heads * NUM_THREADS, total, 1), (NUM_THREADS, 1, 1)),
                 (NUM_THREADS, 1, 1), [*partials, *shared, red_params, out], len(REDUCE_INPUTS))]
    ch = cuda_ops.chain(f"metal_attn.per_token_ps{partition_size}", [*in_dtypes, mx.int32], out_spec, scratch,
                        launches, [*in_shapes, tuple(reduce_params.shape)])
    return ChainedPerTokenLaunch(ch, params, fparams, zeros_f32(num_heads), reduce_params)


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
    split = partition_size > 0
    max_parts = _max_parts(md, partition_size, rows)
    params = pack_int32((md.num_seqs, num_heads, num_kv_heads, md.max_blocks_per_seq, int(sliding_window or 0),
                         max_parts, int(use_sinks)))
    if backend == "cuda" and cuda_chains_enabled():
        fused = split and fused_reduce_enabled()
        reduce_params = pack_int32((md.num_seqs, num_heads, max_parts, int(use_sinks))) if split and not fused else None
        return chained_per_token_launch(dtype, pool_dtype or dtype, total, num_heads, head, block_size, max_parts,
                                        partition_size, geo, prefetch, params, pack_scale(scale, softcap),
                                        reduce_params, (tuple(q_shape), tuple(k_shape), tuple(k_shape),
                                                        tuple(md.block_tables.shape), tuple(md.seq_lens.shape),
                                                        tuple(md.cu_seqlens_q.shape)), fused=fused)
    out = (split_scratch(total, num_heads, max_parts, head) if split
           else {"output_shapes": [(total, num_heads, head)], "output_dtypes": [dtype]})
    launch = kernel_launch(per_token_kernel(backend, split, geo),
                           template=paged_template(dtype, head, block_size, partition_size, geo, prefetch),
                           grid=(geo.grid_x(num_heads), total, max_parts), threadgroup=(geo.threads, 1, 1), **out)
    reduce = (reduce_launch((total, num_heads, max_parts, head), mx.float32, dtype, md, use_sinks, partition_size,
                            backend) if split else None)
    return PerTokenLaunch(launch, params, pack_scale(scale, softcap), zeros_f32(num_heads), reduce)


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
        backend = specialization[0]
        launch = cached_launch(md, key, lambda: per_token_launch(
            q.shape, q.dtype, k_cache.shape, md, scale=inputs.scale, use_sinks=inputs.sinks is not None,
            sliding_window=inputs.sliding_window, softcap=inputs.softcap, partition_size=specialization[4],
            backend=backend, geo=plan_geometry(specialization), prefetch=PREFETCH_NEXT.get(backend, 0), rows=rows,
            pool_dtype=k_cache.dtype))
    return launch(q, k_cache, inputs.v_cache, md, inputs.sinks)


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


# -- the decode-rows sub-plan of a mixed batch --------------------------------------------------------


def mixed_split(request: AttentionRequest, backend: str, settings: Settings | None = None) -> tuple[bool, str]:
    """Whether a mixed batch's decode rows leave the prefill kernel's tiles (from
    `MIXED_DECODE_MIN_CONTEXT` tokens on, per backend), and the arithmetic behind it."""
    if request.phase is not Phase.MIXED:
        return False, ""
    if settings is not None and settings.is_disabled(DECODE_ROWS_PROVIDER):
        return False, (f"mixed split: the {DECODE_ROWS_PROVIDER} provider is disabled "
                       "(decode rows ride in the tiles)")
    threshold = MIXED_DECODE_MIN_CONTEXT.get(backend)
    if threshold is None:
        return False, f"mixed split: no threshold measured for backend={backend} (decode rows ride in the tiles)"
    split = request.max_decode_seq_len >= threshold
    return split, (
        f"mixed split: longest decode row {request.max_decode_seq_len} {'>=' if split else '<'} "
        f"MIXED_DECODE_MIN_CONTEXT[{backend}]={threshold} -> "
        + ("decode rows through the per-token kernel" if split else "decode rows ride in the tiles")
    )


def decode_request(request: AttentionRequest) -> AttentionRequest:
    """The decode rows at the front of a mixed ``request``, as a request of their own."""
    return dataclasses.replace(
        request, phase=Phase.DECODE, num_seqs=request.num_decode_seqs, total_q_tokens=request.num_decode_seqs,
        max_q_len=1, max_seq_len=request.max_decode_seq_len, length_plan=(),
    )


def plan_decode_rows(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The per-token plan of a mixed ``request``'s decode rows (split or not by the occupancy gate);
    a provider keeps its ``specialization`` in its own plan, its route and notes in its notes."""
    return plan_per_token(DECODE_ROWS_PROVIDER, decode_request(request), device, settings)


class DecodeRowsPlan(NamedTuple):
    """What a provider's plan keeps of its decode rows' plan: the specialization (for
    `prepare_decode_rows` / `run_decode_rows`), the partition size, and one note for ``explain``."""

    specialization: tuple
    partition_size: int
    note: str


def decode_rows_part(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> DecodeRowsPlan:
    """`plan_decode_rows`, as the fields a provider's own plan carries."""
    plan = plan_decode_rows(request, device, settings)
    return DecodeRowsPlan(plan.specialization, plan.partition_size,
                          f"decode rows: {plan.route} ({'; '.join(plan.notes)})")


def tiles_decode_part(request: AttentionRequest, backend: str, device: DeviceInfo,
                      settings: Settings) -> tuple[tuple, int, list[str]]:
    """For a tiled prefill kernel's plan: whether a mixed batch's decode rows leave the tiles
    (`mixed_split` on ``backend``'s threshold) and, when they do, their sub-plan
    (`decode_rows_part`): ``(decode specialization or (), partition size, notes for explain)``."""
    split, split_note = mixed_split(request, backend, settings)
    notes = [split_note] if split_note else []
    if not split:
        return (), 0, notes
    part = decode_rows_part(request, device, settings)
    return part.specialization, part.partition_size, [*notes, part.note]


def prepare_decode_rows(specialization: tuple, device: DeviceInfo) -> None:
    """Compile the decode rows' specialization (from `plan_decode_rows`) now; `KernelCompileError` on failure."""
    prepare_per_token(Plan(DECODE_ROWS_PROVIDER, "decode rows", specialization=specialization), device)


def run_decode_rows(inputs: AttentionInputs, specialization: tuple) -> mx.array:
    """The decode rows of a mixed batch through the per-token kernel: ``[num_decode_seqs, H, D]``
    (the first rows of ``inputs``; the other rows are the caller's)."""
    return run_per_token(inputs, specialization, rows=inputs.metadata.num_decode_seqs)
