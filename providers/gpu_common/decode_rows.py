"""The decode-rows sub-plan of a mixed batch: the decode rows at its front through the per-token
kernel, the prefill rows through the provider's own kernel. `mixed_split` decides it for the tiled
kernels (by `MIXED_DECODE_MIN_CONTEXT`); a provider keeps the sub-plan's specialization in its own
plan (`decode_rows_part`, `tiles_decode_part`) and runs it with `run_decode_rows`, on a second
stream of the GPU where `DECODE_ROWS_STREAM_RULES` (or ``METAL_ATTN_DECODE_ROWS_STREAM``) says so, or
inside one of the route's own CUDA chains where `decode_rows_in_chain` says so
(``METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN``; ``sdpa_prefill``'s finish chain)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
from metal_attn.providers.gpu_common.launches import cuda_chains_enabled
from metal_attn.providers.gpu_common.per_token import plan_per_token, prepare_per_token, run_per_token

from metal_attn.constants import KERNEL_BLOCK_SIZES, MIXED_DECODE_MIN_CONTEXT
from metal_attn.provider import Plan
from metal_attn.request import Phase

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

#: The provider whose kernel (the per-token kernel) the decode rows of a mixed split use.
DECODE_ROWS_PROVIDER = "classic"


@dataclasses.dataclass(frozen=True)
class StreamRule:
    """Whether a backend queues a mixed batch's decode rows on a second stream of the GPU, where the
    per-token kernel (bandwidth-bound) can overlap the prefill chunks' kernels (compute-bound), and the
    measurement behind it (``explain`` and the docs show it)."""

    side_stream: bool
    evidence: str


#: One rule per backend (data; ``METAL_ATTN_DECODE_ROWS_STREAM`` overrides it for A/B runs).
DECODE_ROWS_STREAM_RULES: Mapping[str, StreamRule] = MappingProxyType({
    "cuda": StreamRule(False, "H100, MLX 0.32.4, bf16, 32/8 heads, head 128 (benchmarks/probe_decode_rows_stream.py, "
                              "11 mixed batches on both mixed routes, docs/bench-h200-prefill.md, thirty-first "
                              "session): the second stream was slower in 43 of 44 readings, 0.47-1.06x the one "
                              "stream's speed with every call waited for (median 0.62x) and 0.26-0.95x queued (median "
                              "0.41x), same bytes; MLX's CUDA graphs already run a batch's independent kernels side by "
                              "side, and a wait across streams costs more than any overlap gains"),
    "metal": StreamRule(False, "not measured on Apple hardware: one stream, as upstream"),
    "cpu": StreamRule(False, "no GPU: the CPU's decode rows and chunks share its threads"),
})


def decode_rows_stream(backend: str, settings: Settings) -> tuple[bool, str]:
    """Whether a split mixed batch's decode rows go on the GPU's second stream, and a note naming the rule
    or the setting that decided (the rule's evidence stays in `DECODE_ROWS_STREAM_RULES`, out of ``explain``'s
    table)."""
    if settings.decode_rows_stream is not None:
        on = bool(settings.decode_rows_stream)
        where = "a second" if on else "the default"
        return on, f"decode rows on {where} stream (METAL_ATTN_DECODE_ROWS_STREAM={int(on)})"
    rule = DECODE_ROWS_STREAM_RULES.get(backend)
    if rule is None:
        return False, f"decode rows on the default stream (no stream rule for backend={backend})"
    where = "a second stream, overlapping the chunks" if rule.side_stream else "the default stream"
    return rule.side_stream, (f"decode rows on {where} "
                              f"(DECODE_ROWS_STREAM_RULES[{backend}].side_stream={rule.side_stream})")


_side_streams = threading.local()


def side_stream() -> mx.Stream:
    """The GPU stream a mixed batch's decode rows are queued on when they overlap the chunks: one per
    thread, made on its first use there (since MLX 0.31.2 a stream belongs to the thread that made it:
    another thread evaluating on it raises "There is no Stream(gpu, N) in current thread"). MLX orders
    the work across streams: the rows wait for their inputs' stream, and whatever reads the rows waits
    for this one."""
    stream = getattr(_side_streams, "stream", None)
    if stream is None:
        stream = _side_streams.stream = mx.new_stream(mx.gpu)
    return stream


class DecodeRowsSpec(NamedTuple):
    """A mixed batch's decode rows as a provider's plan keeps them (hashable; an empty tuple in its
    place means the rows ride in the prefill kernel): the per-token plan's specialization, and
    whether the rows run on `side_stream`."""

    per_token: tuple
    side_stream: bool


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


def decode_rows_reasons(request: AttentionRequest, settings: Settings) -> list[str]:
    """Why a mixed ``request``'s decode rows cannot leave for the per-token kernel (empty when they can):
    the `DECODE_ROWS_PROVIDER` disabled, or a page the kernel is not built for (`KERNEL_BLOCK_SIZES`). A
    provider without the tiles to keep them in refuses the batch for these."""
    if request.phase is not Phase.MIXED:
        return []
    reasons = []
    disabled = settings.is_disabled(DECODE_ROWS_PROVIDER)
    if disabled:
        reasons.append(f"mixed batch: its decode rows need the {DECODE_ROWS_PROVIDER} kernel, which is {disabled}")
    if request.block_size not in KERNEL_BLOCK_SIZES:
        reasons.append(f"mixed batch: its decode rows need the per-token kernel, built for block_size in "
                       f"{', '.join(map(str, sorted(KERNEL_BLOCK_SIZES)))} (got block_size={request.block_size})")
    return reasons


def decode_request(request: AttentionRequest) -> AttentionRequest:
    """The decode rows at the front of a mixed ``request``, as a request of their own."""
    return dataclasses.replace(
        request, phase=Phase.DECODE, num_seqs=request.num_decode_seqs, total_q_tokens=request.num_decode_seqs,
        max_q_len=1, max_seq_len=request.max_decode_seq_len, length_plan=(),
    )


def plan_decode_rows(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The per-token plan of a mixed ``request``'s decode rows (split or not by the occupancy gate);
    a provider keeps its ``specialization`` in its own plan, its route and notes in its notes."""
    return plan_per_token(DECODE_ROWS_PROVIDER, decode_request(request), device, settings, whole_call=False)


class DecodeRowsPlan(NamedTuple):
    """What a provider's plan keeps of its decode rows' plan: the specialization (for
    `prepare_decode_rows` / `run_decode_rows`), the partition size, and one note for ``explain``."""

    specialization: DecodeRowsSpec
    partition_size: int
    note: str


def decode_rows_part(request: AttentionRequest, device: DeviceInfo, settings: Settings) -> DecodeRowsPlan:
    """`plan_decode_rows` and `decode_rows_stream`, as the fields a provider's own plan carries."""
    plan = plan_decode_rows(request, device, settings)
    on, stream_note = decode_rows_stream(device.backend, settings)
    return DecodeRowsPlan(DecodeRowsSpec(plan.specialization, on), plan.partition_size,
                          f"decode rows: {plan.route} ({'; '.join(plan.notes)}); {stream_note}")


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


def prepare_decode_rows(spec: DecodeRowsSpec, device: DeviceInfo) -> None:
    """Compile the decode rows' specialization (from `decode_rows_part`) now; `KernelCompileError` on failure."""
    prepare_per_token(Plan(DECODE_ROWS_PROVIDER, "decode rows", specialization=spec.per_token), device)


def decode_rows_in_chain(backend: str | None, spec: DecodeRowsSpec) -> bool:
    """Whether a mixed batch's decode rows may run inside its prefill route's CUDA chain (`plan_chain_part`)
    instead of a chain of their own: CUDA chains, the rows on the default stream, ``cuda_decode_rows_in_chain``
    on. The route decides the rest (whether its own launches are a chain)."""
    from metal_attn.settings import get_settings

    return (backend == "cuda" and not spec.side_stream and get_settings().cuda_decode_rows_in_chain
            and cuda_chains_enabled())


def decode_rows_in_chain_note(settings: Settings, side_stream: bool) -> str:
    """``explain``'s line on where a mixed batch's decode rows run on CUDA chains (`decode_rows_in_chain`)."""
    if side_stream:
        return "decode rows: a chain of their own on the second stream (not inside the finish chain)"
    if settings.cuda_decode_rows_in_chain:
        wait = settings.cuda_decode_rows_wait
        waits = "" if wait == "none" else (f", waiting for the first run's {wait} "
                                           f"(METAL_ATTN_CUDA_DECODE_ROWS_WAIT={wait})")
        return ("decode rows: inside the finish chain where the batch is chained "
                f"(METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=1){waits}")
    return "decode rows: a chain of their own beside the finish chain (METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=0)"


def run_decode_rows(inputs: AttentionInputs, spec: DecodeRowsSpec) -> mx.array:
    """The decode rows of a mixed batch through the per-token kernel: ``[num_decode_seqs, H, D]``
    (the first rows of ``inputs``; the other rows are the caller's), queued on `side_stream` when
    ``spec`` says so."""
    rows = inputs.metadata.num_decode_seqs
    if not spec.side_stream:
        return run_per_token(inputs, spec.per_token, rows=rows)
    with mx.stream(side_stream()):
        return run_per_token(inputs, spec.per_token, rows=rows)
