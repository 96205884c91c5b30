"""The ``gqa_decode`` provider: co-located-heads split-KV decode (Metal and CUDA).

One threadgroup per (partition, KV head, sequence) and one simdgroup per query
head of the group, so the heads that share a KV head read it together; the
kernel (``kernels_v2/gqa_decode.metal``) writes the split contract and the
shared reducer combines the partitions. Admission is data plus a few pure
functions, and every refusal is a reason ``explain`` prints:

- pure decode (one query row per sequence; any number of sequences),
  float16/bfloat16 with the same cache dtype, no sinks, softcap or window;
- the geometry ``(num_heads, num_kv_heads, head_size, block_size)`` is in the
  backend's table (`metal_attn.constants.GQA_DECODE_GEOMETRIES`);
- the work budget ``gpu_cores * SIMDGROUPS_PER_CORE[backend]`` is known and a
  partition size ``P`` (512, then 256) has ``full_partitions(P) * num_heads >=
  budget``, counting complete partitions summed over the batch; device-keyed
  calibration rules (`GQA_CALIBRATION_RULES`) may put 256 first;
- the split scratch stays under `SCRATCH_CAP_BYTES` and the reducer's
  threadgroup memory fits the device limit.

Otherwise the next provider (``classic``) takes the call. On CUDA ``classic`` ranks first
(`GQADecodeProvider.backend_priority`: the H200 measured this kernel slower on every decode
shape), so there ``gqa_decode`` runs when forced (``provider="gqa_decode"``) or when
``classic`` cannot take the call.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from metal_attn.providers import gpu_common as gc

from metal_attn import _epoch, kernels
from metal_attn.constants import (
    GQA_CALIBRATION_RULES,
    GQA_DECODE_GEOMETRIES,
    GQA_PARTITION_SIZES,
    LOG2E,
    SCRATCH_CAP_BYTES,
    SIMDGROUPS_PER_CORE,
)
from metal_attn.kernels import SIMD_WIDTH
from metal_attn.provider import Plan, Provider
from metal_attn.request import split_scratch_bytes

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

ROUTE = "gqa_decode"


def _fmt_geom(g: tuple[int, ...]) -> str:
    return "{}/{}/{}/bs{}".format(*g)


def geometry_table(backend: str) -> tuple[tuple[int, int, int, int], ...]:
    """The admitted ``(num_heads, num_kv_heads, head_size, block_size)`` geometries of ``backend``."""
    return tuple(GQA_DECODE_GEOMETRIES.get(backend, ()))


def work_budget(device: DeviceInfo) -> tuple[int | None, str | None]:
    """``(gpu_cores * simdgroups_per_core, None)``, or ``(None, reason)`` when either is unknown."""
    per_core = SIMDGROUPS_PER_CORE.get(device.backend)
    if device.gpu_cores is None:
        return None, "gpu_cores unknown (the partition budget needs it; set METAL_ATTN_GPU_CORES)"
    if per_core is None:
        return None, (f"no simdgroups-per-core budget measured for backend={device.backend} "
                      f"(measured: {', '.join(sorted(SIMDGROUPS_PER_CORE)) or 'none'})")
    return device.gpu_cores * per_core, None


def _rule_matches(rule: Mapping[str, Any], request: AttentionRequest, device: DeviceInfo) -> bool:
    return (
        device.architecture == rule["architecture"]
        and (rule.get("gpu_cores") is None or device.gpu_cores == rule["gpu_cores"])
        and (rule.get("head_size") is None or request.head_size == rule["head_size"])
        and request.num_seqs >= rule.get("min_seqs", 1)
        and request.max_seq_len >= rule.get("min_max_seq_len", 0)
    )


def calibration_preference(request: AttentionRequest, device: DeviceInfo,
                           rules: tuple[Mapping[str, Any], ...] = GQA_CALIBRATION_RULES) -> int | None:
    """The partition size the first matching device-keyed rule prefers, else ``None``."""
    for rule in rules:
        if _rule_matches(rule, request, device):
            return int(rule["prefer"])
    return None


def reducer_threadgroup_bytes(partitions: int) -> int:
    """Threadgroup memory the reducer may need for ``partitions`` partitions per row.

    Upstream's reducer stages two fp32 statistics per partition in threadgroup
    memory (``2 * partitions * 4`` bytes, rounded up to 16) plus two floats per
    simdgroup for its reductions; admission keeps that bound, so a row that an
    upstream-style reducer could not hold is never launched. (Our shared
    reducer stages one block of partitions' weights at a time: a fixed size, whatever the
    partition count.)
    """
    dynamic = -(-(2 * int(partitions) * 4) // 16) * 16
    return dynamic + 2 * (gc.NUM_THREADS // SIMD_WIDTH) * 4


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionDecision:
    """The partition choice for a request: the size (0 when refused), reasons and arithmetic."""

    partition_size: int
    reasons: tuple[str, ...]
    notes: tuple[str, ...]


def choose_partition(request: AttentionRequest, device: DeviceInfo) -> PartitionDecision:
    """Apply the budget rule (and calibration) to ``request`` on ``device``."""
    budget, why = work_budget(device)
    if budget is None:
        return PartitionDecision(0, (why,), ())
    counts = {}
    for p in GQA_PARTITION_SIZES:
        try:
            counts[p] = request.full_partitions(p)
        except KeyError as exc:
            return PartitionDecision(0, (str(exc.args[0]),), ())
    order = list(GQA_PARTITION_SIZES)
    notes = [f"budget={budget} ({device.gpu_cores} cores x {SIMDGROUPS_PER_CORE[device.backend]})"]
    prefer = calibration_preference(request, device)
    if prefer is not None and prefer in order:
        order.remove(prefer)
        order.insert(0, prefer)
        notes.append(f"calibration prefers P{prefer} on {device.architecture}/{device.gpu_cores} cores")
    for p in order:
        work = counts[p] * request.num_heads
        if work >= budget:
            notes.append(f"P{p}: {counts[p]} full partitions x {request.num_heads} heads = {work} >= {budget}")
            return PartitionDecision(p, (), tuple(notes))
    detail = "; ".join(f"P{p}: {counts[p]} x {request.num_heads} heads = {counts[p] * request.num_heads}"
                       for p in GQA_PARTITION_SIZES)
    return PartitionDecision(
        0, (f"full partitions x heads below the budget {notes[0][len('budget='):]} for every partition size "
            f"({detail}; complete partitions summed over the batch)",), tuple(notes))


def resource_reasons(request: AttentionRequest, device: DeviceInfo, partition_size: int) -> list[str]:
    """Scratch-cap and reducer-fit refusals for launching ``request`` with ``partition_size``."""
    reasons = []
    parts = request.partitions(partition_size)
    scratch = split_scratch_bytes(request.num_seqs, request.num_heads, parts, request.head_size)
    if scratch > SCRATCH_CAP_BYTES:
        reasons.append(
            f"split scratch={scratch} bytes for {request.num_seqs} seqs x {request.num_heads} heads x {parts} "
            f"partitions of P{partition_size} (allowed: <= {SCRATCH_CAP_BYTES} bytes)"
        )
    limit = device.max_threadgroup_memory
    if limit is None:
        reasons.append("max_threadgroup_memory unknown (the reducer fit needs it)")
    else:
        need = reducer_threadgroup_bytes(parts)
        if need > limit:
            reasons.append(
                f"reducer threadgroup memory={need} bytes for {parts} partitions of P{partition_size} "
                f"(allowed: <= {limit} bytes on this device)"
            )
    return reasons


def make_plan(request: AttentionRequest, device: DeviceInfo, partition_size: int,
              notes: tuple[str, ...] = ()) -> Plan:
    """The launch plan for ``request`` with ``partition_size`` (also used to force a size in tests)."""
    if partition_size not in GQA_PARTITION_SIZES:
        raise ValueError(f"partition_size={partition_size} (allowed: {', '.join(map(str, GQA_PARTITION_SIZES))})")
    group = request.num_heads // request.num_kv_heads
    parts = request.partitions(partition_size)
    threads = SIMD_WIDTH * group
    return Plan(
        provider=GQADecodeProvider.name,
        route=ROUTE,
        partition_size=partition_size,
        grid=(threads * parts, request.num_kv_heads, request.num_seqs),
        threadgroup=(threads, 1, 1),
        specialization=(ROUTE, device.backend, request.dtype, request.num_heads, request.num_kv_heads,
                        request.head_size, request.block_size, partition_size),
        notes=notes,
    )


class GQADecodeProvider(Provider):
    """Split-KV decode with the heads of a KV group co-located in one threadgroup."""

    name = ROUTE
    priority = 80
    #: Below `classic` (10) on CUDA: there the classic kernel's matrix path (a group's heads as the
    #: rows of tensor-core products) measured 1.7x-3.4x faster on every decode shape of the suite
    #: (H200, docs/bench-h200-classic.md, session 6). Metal keeps 80 (upstream's measurements).
    backend_priority = MappingProxyType({"cuda": 5})
    backends = frozenset({"metal", "cuda"})
    phases = frozenset({"decode"})
    dtypes = frozenset({"float16", "bfloat16"})
    features = frozenset()
    description = "GQA decode: one threadgroup per (partition, KV head, sequence), heads of a group together."

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        return super().availability_reasons(device) or gc.availability_reasons(device)

    def extra_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        reasons: list[str] = []
        if device.backend not in self.backends:
            return reasons  # availability already says why
        table = geometry_table(device.backend)
        geom = (request.num_heads, request.num_kv_heads, request.head_size, request.block_size)
        if geom not in table:
            reasons.append(
                f"geometry heads/kv_heads/head_size/block_size={_fmt_geom(geom)} "
                f"(supported on {device.backend}: {', '.join(_fmt_geom(g) for g in table)})"
            )
        if request.phase.value != "decode" or request.total_q_tokens != request.num_seqs:
            return reasons  # the phase reason is already there; partitions mean nothing here
        decision = choose_partition(request, device)
        reasons.extend(decision.reasons)
        if decision.partition_size:
            reasons.extend(resource_reasons(request, device, decision.partition_size))
        return reasons

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        decision = choose_partition(request, device)
        if not decision.partition_size:
            raise ValueError(f"gqa_decode does not admit this request: {'; '.join(decision.reasons)}")
        return make_plan(request, device, decision.partition_size, decision.notes)

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Compile the plan's specialization with a one-page launch (skipped for hypothetical devices)."""
        _, backend, dtype, heads, kvh, head, block, psize = plan.specialization
        gc.compile_eagerly(device, f"gqa_decode {plan.specialization}",
                           lambda b: launch(b.q, b.cache, b.cache, b.metadata, scale=1.0, partition_size=psize,
                                            backend=backend),
                           dtype=dtype, head_size=head, block_size=block, num_heads=heads, num_kv_heads=kvh)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        # An admitted plan passes `launch`'s checks by construction: the batch's descriptor, no checks.
        # The key leaves out sinks, softcap and window because the provider admits none of them
        # (`features` is empty, asserted below the class); a feature added to it must join the key.
        q, k_cache, md = inputs.q, inputs.k_cache, inputs.metadata
        backend, psize = plan.specialization[1], plan.partition_size
        key = (_epoch.current(), ROUTE, backend, psize, q.shape, q.dtype, k_cache.shape, inputs.scale)
        got = md._launches.get(key)
        if got is None:
            _, block_size, _, _ = k_cache.shape
            tuning = kernel_tuning(backend, q.shape[2], block_size)
            got = gc.cached_launch(md, key, lambda: gqa_launch(q.shape, q.dtype, k_cache.shape, md, scale=inputs.scale,
                                                               partition_size=psize, backend=backend, tuning=tuning))
        return got(q, k_cache, inputs.v_cache, md)

    # -- source checks ----------------------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """Every Metal specialization this provider can choose, for `metal_attn.msl_check`.

        The kernel over the Metal geometry table x {float16, bfloat16} x {P512, P256}
        (5 x 2 x 2 = 20), and the shared reducer at each partition size it is
        launched with here (head sizes of the table x dtypes x partition sizes).
        """
        from metal_attn.source_specs import Specialization

        specs = []
        dtypes = sorted(self.dtypes)
        for heads, kvh, head, block in geometry_table("metal"):
            group = heads // kvh
            for dtype in dtypes:
                for p in GQA_PARTITION_SIZES:
                    specs.append(Specialization(
                        label=f"gqa_decode {dtype} {heads}/{kvh}/{head}/bs{block} P{p}",
                        kernel="gqa_decode", source_files=KERNEL_FILES, input_names=KERNEL_INPUTS,
                        output_names=KERNEL_OUTPUTS,
                        template=tuple(kernel_template(dtype, kvh, group, head, block, p,
                                                       kernel_tuning("metal", head, block))),
                        inputs=(((2, heads, head), dtype), ((4, block, kvh, head), dtype),
                                ((4, block, kvh, head), dtype), ((2, 3), "int32"), ((2,), "int32"),
                                ((1,), "float32"), ((2,), "int32")),
                        outputs=(((2, heads, 2), "float32"), ((2, heads, 2), "float32"),
                                 ((2, heads, 2, head), "float32")),
                    ))
        for head in sorted({g[2] for g in geometry_table("metal")}):
            for dtype in dtypes:
                for p in GQA_PARTITION_SIZES:
                    specs.append(gc.reducer_msl_specialization(
                        f"paged_attention_v2_reduce (gqa) {dtype} head={head} P{p}", dtype, head, p, rows=2))
        return specs

    def cuda_sources(self) -> list[CudaSource]:
        """Every CUDA geometry at both partition sizes (float16, bfloat16), for `metal_attn.cuda_check`
        (the reducer is in ``classic``'s set)."""
        from metal_attn.source_specs import CudaSource

        return [CudaSource(f"gqa_decode {dt} {h}/{kvh}/{d}/bs{bs} P{part}", "gqa_decode", KERNEL_FILES,
                           tuple(zip(KERNEL_INPUTS, (dt, dt, dt, "int32", "int32", "float32", "int32"))),
                           tuple((n, "float32") for n in KERNEL_OUTPUTS),
                           tuple(kernel_template(dt, kvh, h // kvh, d, bs, part, kernel_tuning("cuda", d, bs))))
                for dt, (h, kvh, d, bs), part in itertools.product(("float16", "bfloat16"), geometry_table("cuda"),
                                                                    (256, 512))]


#: The launch key in `GQADecodeProvider.run` holds no feature: the provider must admit none.
assert not GQADecodeProvider.features, "gqa_decode admits a feature its launch key does not hold"


KERNEL_FILES = ("gqa_decode.metal",)
KERNEL_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale", "dims")
KERNEL_OUTPUTS = ("max_logits", "exp_sums", "tmp_out")


def kernel_object(backend: str) -> Any:
    """The ``mx.fast`` kernel object of ``gqa_decode`` on ``backend`` (built once)."""
    return kernels.load_kernel("gqa_decode", KERNEL_FILES, KERNEL_INPUTS, KERNEL_OUTPUTS, backend)


#: Load pipelining of the kernel per backend and ``(head_size, block_size)``: ``(CHUNK,
#: PREFETCH)``, the tokens whose K/V loads are issued together before any arithmetic,
#: and whether the next page is requested into L2 while a page is computed. Metal keeps
#: upstream's four tokens in flight (its prefetch is a no-op); the CUDA values are the
#: H200 sweep's winners (docs/bench-h200-gqa.md, `benchmarks/sweep_gpu_tuning.py`).
KERNEL_TUNING: Mapping[str, Mapping[tuple[int, int], tuple[int, int]]] = {
    "metal": {},
    "cuda": {(128, 16): (8, 1), (256, 16): (4, 0), (256, 32): (8, 1)},
}
DEFAULT_TUNING = (4, 0)


def kernel_tuning(backend: str, head_size: int, block_size: int) -> tuple[int, int]:
    """``(CHUNK, PREFETCH)`` for a specialization (`DEFAULT_TUNING` where the table has no entry)."""
    return KERNEL_TUNING.get(backend, {}).get((head_size, block_size), DEFAULT_TUNING)


def kernel_template(dtype: Any, num_kv_heads: int, group: int, head_size: int, block_size: int,
                    partition_size: int, tuning: tuple[int, int] = DEFAULT_TUNING) -> list[tuple[str, Any]]:
    """The template arguments of one specialization (``tuning``: ``(CHUNK, PREFETCH)``)."""
    chunk, prefetch = tuning
    return [("T", dtype), ("NUM_KV_HEADS", num_kv_heads), ("GROUP", group), ("HEAD_SIZE", head_size),
            ("BLOCK_SIZE", block_size), ("PARTITION_SIZE", partition_size), ("CHUNK", chunk),
            ("PREFETCH", prefetch)]


def launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
           partition_size: int, backend: str, tuning: tuple[int, int] | None = None) -> mx.array:
    """Run the GQA decode kernel and the shared reducer; returns ``[num_seqs, num_heads, head_size]``.

    ``q``: one row per sequence; pools ``[num_blocks, block_size, num_kv_heads,
    head_size]``; ``partition_size``: 512 or 256 (forcing a size is allowed:
    admission is the caller's business). ``tuning`` overrides `kernel_tuning`
    (``(CHUNK, PREFETCH)``, CHUNK a multiple of 4 dividing the block size) for sweeps.
    """
    if partition_size not in GQA_PARTITION_SIZES:
        raise ValueError(f"partition_size={partition_size} (allowed: {', '.join(map(str, GQA_PARTITION_SIZES))})")
    num_seqs, _, head = q.shape
    if num_seqs != metadata.num_seqs or metadata.total_q_tokens != num_seqs:
        raise ValueError(f"gqa_decode needs one query row per sequence (q has {num_seqs} rows, "
                         f"{metadata.num_seqs} sequences, {metadata.total_q_tokens} query tokens)")
    _, block_size, _, _ = k_cache.shape
    chunk, prefetch = tuning or kernel_tuning(backend, head, block_size)
    if chunk < 4 or chunk % 4 or block_size % chunk or prefetch not in (0, 1):
        raise ValueError(f"tuning={tuning} (allowed: CHUNK a multiple of 4 dividing block_size={block_size}; "
                         f"PREFETCH 0 or 1)")
    return gqa_launch(q.shape, q.dtype, k_cache.shape, metadata, scale=scale, partition_size=partition_size,
                      backend=backend, tuning=(chunk, prefetch))(q, k_cache, v_cache, metadata)


@dataclasses.dataclass(frozen=True, slots=True)
class GQALaunch:
    """A GQA decode launch and its reducer over one batch (`gqa_launch`): call it with the query, the
    pools and the metadata it was built for."""

    launch: gc.KernelLaunch
    scale: mx.array
    dims: mx.array
    reduce: gc.ReduceLaunch

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata) -> mx.array:
        max_logits, exp_sums, tmp_out = self.launch([q, k_cache, v_cache, md.block_tables, md.seq_lens, self.scale,
                                                     self.dims])
        return self.reduce(max_logits, exp_sums, tmp_out, md, None)


def gqa_launch(q_shape: tuple[int, ...], dtype: Any, k_shape: tuple[int, ...], metadata: AttentionMetadata, *,
               scale: float, partition_size: int, backend: str, tuning: tuple[int, int]) -> GQALaunch:
    """The GQA decode kernel's launch (and the reducer's) for a query of ``q_shape`` in ``dtype`` over
    pools of ``k_shape`` and the batch ``metadata`` (arguments checked by `launch`)."""
    import mlx.core as mx

    num_seqs, num_heads, head = q_shape
    _, block_size, kvh, _ = k_shape
    group = num_heads // kvh
    max_parts = -(-metadata.max_seq_len // partition_size)
    threads = SIMD_WIDTH * group
    kernel = gc.kernel_launch(kernel_object(backend),
                              template=kernel_template(dtype, kvh, group, head, block_size, partition_size, tuning),
                              grid=(threads * max_parts, kvh, num_seqs), threadgroup=(threads, 1, 1),
                              **gc.split_scratch(num_seqs, num_heads, max_parts, head))
    reduce = gc.reduce_launch((num_seqs, num_heads, max_parts, head), mx.float32, dtype, metadata, False,
                              partition_size, backend)
    return GQALaunch(kernel, kernels.param_array((scale * LOG2E,), "float32"),
                     gc.pack_int32((metadata.max_blocks_per_seq, max_parts)), reduce)
