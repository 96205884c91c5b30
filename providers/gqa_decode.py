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

Otherwise the next provider (``classic``) takes the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from metal_attn.constants import (
    GQA_CALIBRATION_RULES,
    GQA_DECODE_GEOMETRIES,
    GQA_PARTITION_SIZES,
    SCRATCH_CAP_BYTES,
    SIMDGROUPS_PER_CORE,
)
from metal_attn.provider import Plan, Provider

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

ROUTE = "gqa_decode"
SIMD_WIDTH = 32
#: Bytes of the two fp32 statistics (max logit, exp sum) per (sequence, head, partition).
STAT_BYTES = 8
#: The kernel writes its partial outputs (``tmp_out``) in float32.
TMP_OUT_ITEMSIZE = 4


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


def scratch_bytes(num_seqs: int, num_heads: int, partitions: int, head_size: int,
                  itemsize: int = TMP_OUT_ITEMSIZE) -> int:
    """Split scratch of one call: per (sequence, head, partition) ``head_size * itemsize + 8`` bytes.

    Python integers are unbounded, so the product never wraps (a C ``int32``
    version of the same formula overflows from about 2**31 bytes).
    """
    return int(num_seqs) * int(num_heads) * int(partitions) * (int(head_size) * int(itemsize) + STAT_BYTES)


def reducer_threadgroup_bytes(partitions: int) -> int:
    """Threadgroup memory of the shared reducer for ``partitions`` partitions per row.

    The reducer keeps two fp32 values per partition (``2 * partitions * 4``
    bytes, rounded up to 16) plus its static part, which the kernel loader reports.
    """
    from metal_attn import kernels

    return int(kernels.reducer_threadgroup_bytes(partitions))


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
    parts = -(-request.max_seq_len // partition_size)
    scratch = scratch_bytes(request.num_seqs, request.num_heads, parts, request.head_size)
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
    parts = -(-request.max_seq_len // partition_size)
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
    backends = frozenset({"metal", "cuda"})
    phases = frozenset({"decode"})
    dtypes = frozenset({"float16", "bfloat16"})
    features = frozenset()
    description = "GQA decode: one threadgroup per (partition, KV head, sequence), heads of a group together."

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
        from providers_gqa_runtime import prepare  # replaced below

        prepare(plan, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        raise NotImplementedError
