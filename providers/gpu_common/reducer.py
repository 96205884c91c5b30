"""The split-KV reducer (``paged_attention_v2_reduce``, `kernels_v2/split_reduce.h`) of every kernel
that writes the split contract: the per-token kernel, the GQA decode kernel and the tiled kernel's
split launches (docs/kernels.md, "Split-KV")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from metal_attn.providers.gpu_common.launches import KernelLaunch, kernel_launch, pack_int32, split_scratch, zeros_f32

from metal_attn import kernels
from metal_attn.kernels import SIMD_WIDTH

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.source_specs import CudaSource, Specialization

#: Threads per threadgroup of the reducer (per partition slice), and the per-token kernel's default.
NUM_THREADS = 128
SIMDGROUPS = NUM_THREADS // SIMD_WIDTH
#: Partition slices a reducer threadgroup may have (powers of two: at most 8 x 128 = 1,024 threads).
SLICE_COUNTS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class SliceRule:
    """When the reducer splits each row's partitions over several slices of `NUM_THREADS` threads (data).

    A reducer threadgroup reduces one (row, head); a thread holds 16 partitions' loads in flight, so a
    row of ``P`` partitions waits for about ``P / 16`` dependent load rounds. Where the launch has few
    threadgroups per GPU core (under ``max_groups_per_core``) the GPU has room for more threads: the
    threadgroup takes the most slices (up to ``max_slices``) that still give each slice at least
    ``min_parts_per_slice`` partitions, and so about 1/slices of the rounds. ``evidence``: the measurement."""

    max_slices: int
    min_parts_per_slice: int
    max_groups_per_core: float
    evidence: str


#: Per backend (`reducer_slices`); a backend without a rule keeps one slice.
REDUCER_SLICE_RULES: Mapping[str, SliceRule] = MappingProxyType({
    "cuda": SliceRule(
        max_slices=4, min_parts_per_slice=16, max_groups_per_core=2.0,
        evidence="H100, bf16, kernel + reducer under CUPTI (benchmarks/probe_kernel_text.py --set, 2 rounds, "
                 "docs/bench-h200-decode-step.md, twenty-ninth session), 1/2/4/8 slices: b1 24/4/256 L65536 "
                 "(24 threadgroups, 128 partitions) 109.2/107.8/107.0/107.5 us; b1 32/8/128 L32768 (32, 64) "
                 "55.1/54.7/54.5/55.3 us; b16 16/2/128 L16384 (256, 16) 101.2/101.7/102.2/105.9 us"),
})


def reducer_slices(rows: int, num_heads: int, max_parts: int, gpu_cores: int | None, backend: str,
                   forced: int = 0) -> tuple[int, str]:
    """(partition slices of the reducer launch over ``rows`` x ``num_heads`` threadgroups of ``max_parts``
    partitions, the arithmetic as a diagnostics note). ``forced`` (``METAL_ATTN_REDUCER_SLICES``, one of
    `SLICE_COUNTS`) wins; else `REDUCER_SLICE_RULES`; one slice where neither applies."""
    if forced:
        if forced not in SLICE_COUNTS:
            raise ValueError(f"reducer_slices={forced!r}: allowed 0 (the rule) or one of {SLICE_COUNTS}")
        return forced, f"reducer: {_slices(forced)} of {NUM_THREADS} threads (METAL_ATTN_REDUCER_SLICES={forced})"
    rule = REDUCER_SLICE_RULES.get(backend)
    if rule is None:
        return 1, f"reducer: 1 partition slice (no REDUCER_SLICE_RULES[{backend!r}])"
    if not gpu_cores:
        return 1, "reducer: 1 partition slice (GPU cores unknown)"
    per_core = rows * num_heads / gpu_cores
    if per_core >= rule.max_groups_per_core:
        return 1, (f"reducer: 1 partition slice ({rows}x{num_heads} threadgroups / {gpu_cores} cores = {per_core:.2f} "
                   f">= REDUCER_SLICE_RULES[{backend!r}].max_groups_per_core={rule.max_groups_per_core:g})")
    slices = max(s for s in SLICE_COUNTS
                 if s <= rule.max_slices and (s == 1 or max_parts >= s * rule.min_parts_per_slice))
    return slices, (f"reducer: {_slices(slices)} of {NUM_THREADS} threads ({rows}x{num_heads} threadgroups "
                    f"/ {gpu_cores} cores = {per_core:.2f} < {rule.max_groups_per_core:g}; {max_parts} partitions, "
                    f"at least {rule.min_parts_per_slice} a slice, at most {rule.max_slices} slices)")


def _slices(n: int) -> str:
    return f"{n} partition slice{'s' if n > 1 else ''}"


def launch_slices(rows: int, num_heads: int, max_parts: int, backend: str) -> int:
    """`reducer_slices` for a launch on this device with the current settings."""
    from metal_attn.device import current_device
    from metal_attn.settings import get_settings

    return reducer_slices(rows, num_heads, max_parts, current_device().gpu_cores, backend,
                          get_settings().reducer_slices)[0]

#: The kernel text of the per-token kernel and the reducer (the reducer's body is split_reduce.h).
PAGED_FILES = ("paged_common.h", "split_reduce.h", "pagedattention.metal")
REDUCE_INPUTS = ("max_logits", "exp_sums", "tmp_out", "seq_lens", "cu_seqlens_q", "sinks", "params")
#: The reducer's inputs with their dtype names (the partials are float32).
REDUCE_SIGNATURE = tuple(zip(REDUCE_INPUTS, ("float32", "float32", "float32", "int32", "int32", "float32", "int32")))


def reducer_kernel(backend: str) -> Any:
    """The ``mx.fast`` kernel object of ``paged_attention_v2_reduce`` on ``backend`` (built once)."""
    return kernels.load_kernel("paged_attention_v2_reduce", PAGED_FILES, REDUCE_INPUTS, ("out",), backend)


def reducer_template(out_dtype: Any, tmp_dtype: Any, head_size: int, partition_size: int,
                     slices: int = 1) -> list[tuple[str, Any]]:
    """The reducer's template arguments (dtypes as MLX dtypes, or their names for the source checks)
    for ``slices`` partition slices of `NUM_THREADS` threads."""
    return [("T", out_dtype), ("TT", tmp_dtype), ("HEAD_SIZE", head_size), ("PARTITION_SIZE", partition_size),
            ("NUM_THREADS", NUM_THREADS * slices), ("SLICES", slices)]


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


def reducer_sinks(sinks: mx.array | None, zero_sinks: mx.array) -> mx.array:
    """The sinks as the reducer (and every chain that ends in it) takes them: float32, ``zero_sinks``
    (read by nothing: the parameters say no sinks) where the call has none."""
    if sinks is None:
        return zero_sinks
    return sinks if sinks.dtype == mx.float32 else sinks.astype(mx.float32)


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceLaunch:
    """A reducer launch over one batch (`reduce_launch`): call it with the partials, the metadata it
    was built for and the sinks (or ``None`` when it was built without)."""

    launch: KernelLaunch
    params: mx.array
    zero_sinks: mx.array

    def __call__(self, max_logits: mx.array, exp_sums: mx.array, tmp_out: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        sinks = reducer_sinks(sinks, self.zero_sinks)
        return self.launch([max_logits, exp_sums, tmp_out, md.seq_lens, md.cu_seqlens_q, sinks, self.params])[0]


def reduce_launch(tmp_shape: tuple[int, ...], tmp_dtype: Any, out_dtype: Any, md: AttentionMetadata,
                  use_sinks: bool, partition_size: int, backend: str) -> ReduceLaunch:
    """The reducer's launch over partials of ``tmp_shape`` ``[rows, num_heads, max_parts, head_size]``."""
    total, num_heads, max_parts, head = tmp_shape
    slices = launch_slices(total, num_heads, max_parts, backend)
    threads = NUM_THREADS * slices
    launch = kernel_launch(reducer_kernel(backend), template=reducer_template(out_dtype, tmp_dtype, head,
                                                                              partition_size, slices),
                           grid=(num_heads * threads, total, 1), threadgroup=(threads, 1, 1),
                           output_shapes=[(total, num_heads, head)], output_dtypes=[out_dtype])
    return ReduceLaunch(launch, pack_int32((md.num_seqs, num_heads, max_parts, int(use_sinks))), zeros_f32(num_heads))


def chained_split_reduce(kernel: tuple[Any, tuple[int, int, int], tuple[int, int, int]], input_names: Sequence[str],
                         out_dtype: str, head_size: int, partition_size: int, rows: int, num_heads: int,
                         max_parts: int) -> tuple[list[tuple], list[tuple]]:
    """A split kernel and the reducer as the launches of one CUDA chain (`metal_attn.cuda_ops.chain`):
    ``(launches, scratch)``. ``kernel``: the split kernel's ``(function, grid in threadgroups, threadgroup)``,
    its inputs named ``input_names`` (which hold the reducer's shared ones: ``seq_lens``, ``cu_seqlens_q``,
    ``sinks``). Buffer indices: the kernel's inputs, the reducer's parameters, the output (``out_dtype``,
    a dtype name), then the float32 partials ``[rows, num_heads, max_parts]``, the chain's scratch. The
    reducer has `reduce_launch`'s template and grid."""
    from metal_attn import cuda_ops

    n_in = len(input_names)
    red_params, out = n_in, n_in + 1
    partials = [out + 1, out + 2, out + 3]
    shared = [input_names.index(n) for n in REDUCE_INPUTS[len(partials):-1]]  # seq_lens, cu_seqlens_q, sinks
    slices = launch_slices(rows, num_heads, max_parts, "cuda")
    threads = NUM_THREADS * slices
    reducer = cuda_ops.kernel_function("paged_attention_v2_reduce", PAGED_FILES, None, REDUCE_SIGNATURE,
                                       [("out", out_dtype)],
                                       reducer_template(out_dtype, "float32", head_size, partition_size, slices))
    fn, grid, block = kernel
    launches = [(fn, grid, block, [*range(n_in), *partials], n_in),
                (reducer, cuda_ops.threadgroups((num_heads * threads, rows, 1), (threads, 1, 1)), (threads, 1, 1),
                 [*partials, *shared, red_params, out], len(REDUCE_INPUTS))]
    spec = split_scratch(rows, num_heads, max_parts, head_size)
    return launches, list(zip(spec["output_shapes"], spec["output_dtypes"]))


def reducer_msl_specialization(label: str, dtype: str, head_size: int, partition_size: int,
                               rows: int = 3, slices: int = 1) -> Specialization:
    """The reducer's Metal source-check entry (`metal_attn.msl_check`) for ``dtype`` outputs from
    float32 partials in ``slices`` partition slices (``rows`` query rows, 4 heads, 2 sequences, 2
    partitions: shapes only matter for tracing)."""
    from metal_attn.source_specs import Specialization

    return Specialization(
        label=label, kernel="paged_attention_v2_reduce", source_files=PAGED_FILES, input_names=REDUCE_INPUTS,
        output_names=("out",), template=tuple(reducer_template(dtype, "float32", head_size, partition_size, slices)),
        inputs=(((rows, 4, 2), "float32"), ((rows, 4, 2), "float32"), ((rows, 4, 2, head_size), "float32"),
                ((2,), "int32"), ((3,), "int32"), ((4,), "float32"), ((4,), "int32")),
        outputs=(((rows, 4, head_size), dtype),),
    )


def reducer_cuda_source(label: str, dtype: str, head_size: int, partition_size: int, slices: int = 1) -> CudaSource:
    """The reducer's CUDA source-check entry (`metal_attn.cuda_check`) for ``dtype`` outputs from
    float32 partials in ``slices`` partition slices."""
    from metal_attn.source_specs import CudaSource

    return CudaSource(label, "paged_attention_v2_reduce", PAGED_FILES,
                      REDUCE_SIGNATURE, (("out", dtype),),
                      tuple(reducer_template(dtype, "float32", head_size, partition_size, slices)))


def _backend() -> str:
    from metal_attn.device import current_device

    return current_device().backend
