"""`AttentionRequest`: the frozen, hashable description of one attention call.

Providers decide admission and plans from a request alone (plus the device
and the settings), so a request carries every host-side fact they may need and
nothing that lives on the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

import numpy as np

from metal_attn.checks import is_integer, is_real_scalar, ordered_ints
from metal_attn.constants import DTYPES, GQA_PARTITION_SIZES, LOG2E, PARTITION_SIZE
from metal_attn.errors import InvalidInputError

#: What the kernels receive for ``scale`` and ``softcap``: a float32, so the value must be a normal
#: float32 (1e-300 would become 0, which the kernels read as "no softcap"; 1e39 would become inf), and
#: one that stays finite times log2(e), since scores are kept in log2 space (a scale of 3e38 made
#: every output NaN).
_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max) / LOG2E
#: The kernels take ``sliding_window`` as an int32.
_INT32_MAX = 2**31 - 1
_F32_RANGE = (f"a finite number > 0 that float32 holds, times log2(e) too ({_F32_TINY:.4g} to "
              f"{_F32_MAX:.4g})")


def _positive_f32(value: Any) -> bool:
    # Compared as a Python float: a NumPy float16 would cast the bounds to float16 (FLT_MIN to 0, so 0
    # passed) under NumPy 2's rules.
    return (
        is_real_scalar(value)
        and _F32_TINY <= float(value) <= _F32_MAX  # False for NaN
    )


def check_feature_values(*, scale: Any = None, sliding_window: Any = None, softcap: Any = None) -> None:
    """Raise `InvalidInputError` naming the first of ``scale``, ``sliding_window`` and ``softcap`` the
    kernels cannot take (None: not given): the float ones as normal positive float32 values, the window
    as an int32 of at least 1. `paged_attention` and `AttentionRequest.from_lengths` (explain) share it."""
    if scale is not None and not _positive_f32(scale):
        raise InvalidInputError(f"scale={scale!r} (allowed: {_F32_RANGE}, or None for head_size**-0.5)")
    if sliding_window is not None and not (
        is_integer(sliding_window)
        and 1 <= sliding_window <= _INT32_MAX
    ):
        raise InvalidInputError(f"sliding_window={sliding_window!r} (allowed: an int from 1 to {_INT32_MAX}, or None)")
    if softcap is not None and not _positive_f32(softcap):
        raise InvalidInputError(f"softcap={softcap!r} (allowed: {_F32_RANGE}, or None)")


class Phase(str, Enum):
    """What kind of batch a call computes.

    - ``decode``: every sequence has exactly one query row;
    - ``prefill``: no sequence is a decode row (each has more than one query row);
    - ``mixed``: decode rows first, then prefill chunks;
    - ``verify``: every sequence has the same small number (2..16) of query rows
      and earlier context (speculative-decoding verification).
    """

    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"
    VERIFY = "verify"

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


#: Largest uniform query length that still counts as speculative verification.
VERIFY_MAX_Q_LEN = 16

#: Partition sizes whose complete-partition counts every request carries.
LENGTH_PLAN_SIZES: tuple[int, ...] = tuple(sorted({PARTITION_SIZE, *GQA_PARTITION_SIZES}, reverse=True))


def classify_phase(q_lens: Sequence[int], seq_lens: Sequence[int]) -> Phase:
    """Classify a batch from its per-sequence query and KV lengths.

    Decode rows are the leading one-row sequences (batch order: decode rows
    first, then prefill chunks); a one-row sequence after a chunk is a
    one-token chunk and computed by the same causal rule.
    """
    n_decode = leading_decode_rows(q_lens)
    if n_decode == len(q_lens):
        return Phase.DECODE
    if n_decode:
        return Phase.MIXED
    first = q_lens[0]
    if (
        1 < first <= VERIFY_MAX_Q_LEN
        and all(q == first for q in q_lens)
        and all(s > q for s, q in zip(seq_lens, q_lens))
    ):
        return Phase.VERIFY
    return Phase.PREFILL


def leading_decode_rows(q_lens: Sequence[int]) -> int:
    """How many sequences at the front of the batch have exactly one query row."""
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def length_plan(seq_lens: Iterable[int], sizes: Sequence[int] = LENGTH_PLAN_SIZES) -> tuple[tuple[int, int], ...]:
    """Count complete partitions summed over the batch, per partition size.

    Returns ``((P, sum_i floor(len_i / P)), ...)`` for each ``P`` in ``sizes``.
    """
    lens = list(seq_lens)
    return tuple((p, sum(n // p for n in lens)) for p in sizes)


def split_scratch_bytes(rows: int, num_heads: int, partitions: int, head_size: int) -> int:
    """Split-KV scratch of one call: per (query row, head, partition) a float32 partial output of
    ``head_size`` elements and two float32 statistics (max logit, exp sum).

    Every split kernel's gate checks it against `SCRATCH_CAP_BYTES`. Python integers are
    unbounded, so the product never wraps (a C ``int32`` version overflows from about 2**31 bytes).
    """
    return int(rows) * int(num_heads) * int(partitions) * (int(head_size) * 4 + 8)


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionRequest:
    """One paged-attention call, as the registry and providers see it."""

    backend: str
    phase: Phase
    dtype: str
    cache_dtype: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_seqs: int
    total_q_tokens: int
    max_q_len: int
    max_seq_len: int
    length_plan: tuple[tuple[int, int], ...] = ()
    num_decode_seqs: int = 0
    max_decode_seq_len: int = 0
    sinks: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    #: The lengths are bounds (`AttentionMetadata.decode_bounds`, a compiled decode step): only
    #: providers that read per-sequence lengths on the device admit it.
    lengths_are_bounds: bool = False

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def partitions(self, partition_size: int) -> int:
        """Partitions of ``partition_size`` tokens the longest row spans (the split grid's depth)."""
        return -(-self.max_seq_len // partition_size)

    def full_partitions(self, partition_size: int) -> int:
        """Complete partitions of ``partition_size`` tokens summed over the batch."""
        for p, n in self.length_plan:
            if p == partition_size:
                return n
        raise KeyError(
            f"partition_size={partition_size} is not in this request's length plan "
            f"(has: {', '.join(str(p) for p, _ in self.length_plan) or 'none'})"
        )

    @property
    def features(self) -> tuple[str, ...]:
        """Names of the optional features this request uses."""
        out = []
        if self.sinks:
            out.append("sinks")
        if self.sliding_window is not None:
            out.append(f"sliding_window={self.sliding_window}")
        if self.softcap is not None:
            out.append(f"softcap={self.softcap:g}")
        return tuple(out)

    def __repr__(self) -> str:
        feats = ", ".join(self.features) or "none"
        plan = ", ".join(f"P{p}:{n}" for p, n in self.length_plan) or "-"
        return (
            f"AttentionRequest({self.backend} {self.phase.value}, q={self.dtype} cache={self.cache_dtype}, "
            f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_size}, block_size={self.block_size}, "
            f"seqs={self.num_seqs} (decode {self.num_decode_seqs}), q_tokens={self.total_q_tokens}, "
            f"max_q_len={self.max_q_len}, max_seq_len={self.max_seq_len}, full_partitions=[{plan}], "
            f"features={feats})"
        )

    @classmethod
    def from_lengths(
        cls,
        *,
        q_lens: Sequence[int],
        seq_lens: Sequence[int],
        backend: str = "cpu",
        dtype: str = "float16",
        cache_dtype: str | None = None,
        num_heads: int = 32,
        num_kv_heads: int = 8,
        head_size: int = 128,
        block_size: int = 16,
        sinks: bool = False,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> AttentionRequest:
        """Build a request from per-sequence lengths (handy for `explain` and tests). A batch no call
        could make (a sequence with fewer KV tokens than query rows, heads that do not group) raises
        `InvalidInputError` naming the value."""
        q_lens = ordered_ints("q_lens", q_lens)
        seq_lens = ordered_ints("seq_lens", seq_lens)
        if len(q_lens) != len(seq_lens) or not q_lens:
            raise InvalidInputError(
                f"q_lens and seq_lens must be non-empty and of equal length (got {len(q_lens)} and {len(seq_lens)})"
            )
        for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
            if not 1 <= q <= s:
                raise InvalidInputError(f"sequence {i}: q_len={q}, seq_len={s} (allowed: 1 <= q_len <= seq_len; "
                                        "seq_len counts this step's tokens)")
            if s > _INT32_MAX:
                raise InvalidInputError(f"sequence {i}: seq_len={s} (allowed: at most {_INT32_MAX}: the metadata and "
                                        "the kernels hold positions in int32)")
        if sum(q_lens) > _INT32_MAX:
            raise InvalidInputError(f"q_lens sum to {sum(q_lens)} query rows (allowed: at most {_INT32_MAX}: the "
                                    "metadata's cu_seqlens_q is int32)")
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_size", head_size),
                            ("block_size", block_size)):
            if not is_integer(value) or value < 1:
                raise InvalidInputError(f"{name}={value!r} (allowed: an int >= 1)")
        num_heads, num_kv_heads, head_size, block_size = map(int, (num_heads, num_kv_heads, head_size, block_size))
        for name, value in (("dtype", dtype), ("cache_dtype", cache_dtype or dtype)):
            if value not in DTYPES:
                raise InvalidInputError(f"{name}={value!r} (allowed: {', '.join(DTYPES)})")
        if not isinstance(sinks, bool):
            raise InvalidInputError(f"sinks={sinks!r} (allowed: True or False, whether the call passes sinks)")
        check_feature_values(sliding_window=sliding_window, softcap=softcap)
        if num_heads % num_kv_heads:
            raise InvalidInputError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads} "
                                    "(GQA needs whole groups)")
        n_dec = leading_decode_rows(q_lens)
        return cls(
            backend=backend,
            phase=classify_phase(q_lens, seq_lens),
            dtype=dtype,
            cache_dtype=cache_dtype or dtype,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            num_seqs=len(q_lens),
            total_q_tokens=sum(q_lens),
            max_q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            length_plan=length_plan(seq_lens),
            num_decode_seqs=n_dec,
            max_decode_seq_len=max(seq_lens[:n_dec], default=0),
            sinks=sinks,
            sliding_window=sliding_window,
            softcap=softcap,
        )

    @classmethod
    def uniform(cls, *, num_seqs: int, q_len: int, seq_len: int, **features: Any) -> AttentionRequest:
        """`from_lengths` for ``num_seqs`` sequences of ``q_len`` query rows and ``seq_len`` KV tokens each,
        without per-sequence lists: the time does not grow with ``num_seqs`` (explain's ``--batch``).
        ``features``: `from_lengths`'s other arguments. Raises `InvalidInputError` as it does."""
        one = cls.from_lengths(q_lens=[q_len], seq_lens=[seq_len], **features)
        if not is_integer(num_seqs) or num_seqs < 1:
            raise InvalidInputError(f"num_seqs={num_seqs!r} (allowed: an int >= 1)")
        n = int(num_seqs)
        rows = n * one.total_q_tokens
        if rows > _INT32_MAX:
            raise InvalidInputError(f"num_seqs={n} x q_len={one.total_q_tokens} = {rows} query rows (allowed: at "
                                    f"most {_INT32_MAX}: the metadata's cu_seqlens_q is int32)")
        # Copies of one sequence: its phase, maxima and decode length hold for the batch; the sums scale.
        return dataclasses.replace(one, num_seqs=n, total_q_tokens=rows, num_decode_seqs=n * one.num_decode_seqs,
                                   length_plan=tuple((p, n * full) for p, full in one.length_plan))
