"""Requests and their state: sampling parameters, the status machine, per-request timings."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metal_attn.checks import is_finite_real, is_int, is_real
from metal_attn.errors import InvalidInputError

__all__ = ["FinishReason", "Request", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # holds blocks; scheduled every step it needs
    PREEMPTED = "preempted"  # blocks given back; queued again, recomputed from its tokens when readmitted
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string ended it
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # `Engine.abort`
    ERROR = "error"  # its own sampling failed; `Request.error` says how


#: Every allowed status change; `Request.move_to` is the one place a status changes.
_TRANSITIONS: Mapping[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED, RequestStatus.FINISHED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.FINISHED: frozenset(),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples; mlx-lm's samplers and logits processors do the work.

    ``temperature`` 0 is greedy (argmax). ``seed`` makes a sampled request reproducible
    whatever it is batched with (each request draws from its own key).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    #: Extra mlx-lm logits processors ``(tokens, logits) -> logits``.
    logits_processors: Sequence[Callable[[Any, Any], Any]] = ()

    def validate(self) -> SamplingParams:
        """Return ``self``; raise `InvalidInputError` naming the first bad value and what is allowed."""
        if not is_finite_real(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidInputError(f"temperature={self.temperature!r} (allowed: 0 (greedy), or a number >= "
                                    f"{MIN_TEMPERATURE:g}: the logits are divided by it in float32)")
        if not is_finite_real(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise InvalidInputError(f"top_p={self.top_p!r} (allowed: a number in [{MIN_TOP_P:g}, 1]; 1 disables it; "
                                    "it is compared in float32)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidInputError(f"top_k={self.top_k!r} (allowed: an int >= 0; 0 disables it)")
        if not is_finite_real(self.min_p) or not 0 <= self.min_p < 1:
            raise InvalidInputError(f"min_p={self.min_p!r} (allowed: a number in [0, 1); 0 disables it)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidInputError(f"seed={self.seed!r} (allowed: an int in [0, 2**63), or None)")
        penalty = self.repetition_penalty
        low, high = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if penalty is not None and not (is_real(penalty) and low <= penalty <= high):
            raise InvalidInputError(
                f"repetition_penalty={penalty!r} (allowed: a number in [{low:g}, {high:g}], or None: repeated "
                "tokens' logits are multiplied or divided by it in float32, and must stay finite)")
        self._check_logit_bias()
        if not isinstance(self.logits_processors, (list, tuple)) or not all(
                callable(f) for f in self.logits_processors):
            raise InvalidInputError(f"logits_processors={self.logits_processors!r} (allowed: a list or tuple of "
                                    "callables (tokens, logits) -> logits)")
        return self

    @property
    def max_logit_bias(self) -> float:
        """The largest bias magnitude this request takes: `MAX_LOGIT_BIAS`, times the temperature
        when sampled below 1 (the biased logits are divided by it)."""
        if self.greedy or not is_finite_real(self.temperature):
            return MAX_LOGIT_BIAS
        return MAX_LOGIT_BIAS * min(1.0, self.temperature)

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidInputError(f"logit_bias={self.logit_bias!r} (allowed: a mapping of token id to bias, "
                                    "or None)")
        bound = self.max_logit_bias
        for tok, bias in self.logit_bias.items():
            if not is_int(tok) or tok < 0 or not is_finite_real(bias):
                raise InvalidInputError(f"logit_bias entry {tok!r}: {bias!r} (allowed: int token ids >= 0 "
                                        "mapped to finite numbers)")
            if abs(bias) > bound:
                at = "" if bound == MAX_LOGIT_BIAS else (f" at temperature={self.temperature!r} "
                                                         f"({MAX_LOGIT_BIAS:g} x temperature)")
                raise InvalidInputError(
                    f"logit_bias entry {tok!r}: {bias!r} is beyond the bound of {bound:g}{at} (allowed: biases of "
                    f"magnitude up to {MAX_LOGIT_BIAS:g}, times the temperature when sampling below 1: the biased "
                    "logits are divided by the temperature in float32, and must stay finite)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


#: The smallest positive temperature: sampled logits are multiplied by 1 / temperature in float32, which
#: overflows below about 2.9e-39 (the request then samples uniformly at random).
MIN_TEMPERATURE = 1e-30

#: The largest logit bias magnitude (`SamplingParams.max_logit_bias`), times the temperature for a request
#: sampled below 1: mlx-lm adds the biases to the logits in float32 (a bias past 3.4e38 is infinite there), and
#: a sampled request's logits are then divided by the temperature. A bias of 1e39 at temperature 1 was accepted
#: and the request sampled the last token of the vocabulary every time.
MAX_LOGIT_BIAS = 1e30

#: The range of `SamplingParams.repetition_penalty`: a repeated token's logit is multiplied by it (a negative
#: one) or divided by it (a positive one) in float32, after the biases and before the division by the
#: temperature; with the bias bound above, what comes out stays below about 1e34 in magnitude.
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4

#: The smallest top-p: the sampler compares it in float32, where values below about 1.4e-45 are 0 and a
#: request with top-p 0 sampled from the whole vocabulary (mlx-lm's ``apply_top_p``); 1e-30 keeps it far
#: from that edge, and below it every value keeps the one most likely token.
MIN_TOP_P = 1e-30


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt's life in the engine. Token counts:

    - ``num_tokens``: prompt plus generated tokens known on the host, plus ``pending``
      (sampled on the device by a step still in flight);
    - ``num_computed``: tokens whose K/V are written, or queued to be written by a launched step.
    """

    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_computed: int = 0
    pending: int = 0
    #: Position in admission order (for preemption); set when it starts running.
    admitted: int = -1
    num_preemptions: int = 0
    #: Prompt tokens served from the prefix cache at the last admission (at most the prompt).
    num_cached_tokens: int = 0
    #: The most tokens whose K/V were ever written or queued: after a preemption, what is computed
    #: again below it is recomputation (`EngineStats.recomputed_tokens`).
    num_computed_ever: int = 0
    #: The prompt as text, when it was given as text.
    prompt_text: str | None = None
    text: str = ""
    #: Characters of ``text`` that `Engine.step`'s outputs have handed out (`text_ready` bounds it).
    delivered: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    #: Sampling state: an mx.random key (sampled requests), mlx-lm logits processors, the streaming detokenizer.
    key: Any = None
    processors: list[Any] = dataclasses.field(default_factory=list)
    detokenizer: Any = None

    def __post_init__(self) -> None:
        self._ids = [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self._ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_more(self) -> bool:
        """Whether another token should be sampled (max_tokens not yet reached, counting in-flight ones)."""
        return not self.finished and len(self.output_ids) + self.pending < self.max_tokens

    def text_ready(self) -> int:
        """How much of ``text`` is final: all of it once finished; while running, all but a tail that
        could be the start of a stop string (a stop string found later cuts the text there, and a
        stream must never have shown what is cut)."""
        text = self.text
        if self.finished or not self.stop_strings:
            return len(text)
        hold = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold

    def known_ids(self) -> list[int]:
        """Prompt plus generated tokens known on the host (not the in-flight ones): the live list,
        kept by `append_output`; read it, do not modify it."""
        return self._ids

    def append_output(self, token: int) -> None:
        """Add a generated token (the one place outputs grow)."""
        self.output_ids.append(token)
        self._ids.append(token)

    def move_to(self, status: RequestStatus, reason: FinishReason | None = None, error: str | None = None) -> None:
        """The one place a status changes; an illegal change is a bug and raises."""
        if status not in _TRANSITIONS[self.status]:
            raise RuntimeError(f"request {self.id}: {self.status.value} -> {status.value} is not a legal transition")
        self.status = status
        if status is RequestStatus.FINISHED:
            self.finish_reason = reason
            self.error = error
            self.finish_time = time.perf_counter()
