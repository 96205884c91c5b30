"""The decode-rows sub-plan of a mixed batch: the decode rows at its front through the per-token
kernel, the prefill rows through the provider's own kernel. `mixed_split` decides it for the tiled
kernels (by `MIXED_DECODE_MIN_CONTEXT`); a provider keeps the sub-plan's specialization in its own
plan (`decode_rows_part`, `tiles_decode_part`) and runs it with `run_decode_rows`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
from metal_attn.providers.gpu_common.per_token import plan_per_token, prepare_per_token, run_per_token

from metal_attn.constants import MIXED_DECODE_MIN_CONTEXT
from metal_attn.provider import Plan
from metal_attn.request import Phase

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings

#: The provider whose kernel (the per-token kernel) the decode rows of a mixed split use.
DECODE_ROWS_PROVIDER = "classic"


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
