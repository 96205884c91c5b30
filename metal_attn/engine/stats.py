"""Per-request and engine-wide statistics: latency, throughput, pool use, preemptions, prefix hits."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.engine.request import Request
    from metal_attn.engine.runner import InFlight
    from metal_attn.engine.scheduler import SchedulerOutput

__all__ = ["HISTORY", "EngineStats", "RequestStats"]

#: Steps whose completion times `EngineStats` keeps: the history a benchmark reads, bounded so a
#: long-running engine does not grow a list per step.
HISTORY = 1 << 14


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """One finished request's timings (seconds) and counts."""

    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    time_to_first_token: float | None
    mean_inter_token_latency: float | None
    total_time: float | None
    preemptions: int

    @classmethod
    def of(cls, req: Request) -> RequestStats:
        gaps = [b - a for a, b in zip(req.token_times, req.token_times[1:])]
        return cls(
            prompt_tokens=len(req.prompt_ids),
            cached_prompt_tokens=req.num_cached_tokens,
            generated_tokens=len(req.output_ids),
            time_to_first_token=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            mean_inter_token_latency=statistics.fmean(gaps) if gaps else None,
            total_time=(req.finish_time - req.arrival_time) if req.finish_time else None,
            preemptions=req.num_preemptions,
        )


@dataclasses.dataclass
class EngineStats:
    """Totals since the engine started (`as_dict` adds rates and the pool's state)."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0
    #: Prompt positions computed: cache hits excluded, a preempted request's prompt computed again included.
    prompt_tokens: int = 0
    #: Generated tokens computed again after a preemption (their K/V were written before).
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    build_seconds: float = 0.0  # host time spent building and queueing steps
    first_launch: float | None = None
    last_complete: float | None = None
    #: Sums and counts of the finished requests' time to first token and mean inter-token latency (a
    #: long-running engine keeps no per-request list).
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0
    #: Seconds of every step completed so far, and of those that prefilled (`record_complete`): running
    #: totals over the engine's life, where ``completions`` keeps the last `HISTORY` steps only.
    step_seconds: float = 0.0
    prefill_seconds: float = 0.0
    #: (time a step's tokens came back, whether the step prefilled) of the last `HISTORY` steps, in order.
    completions: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    #: The host-time phases (`InFlight.timings`) of the last steps completed.
    step_timings: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=1024))

    def record_launch(self, out: SchedulerOutput, build_seconds: float) -> None:
        self.steps += 1
        self.build_seconds += build_seconds
        if self.first_launch is None:
            self.first_launch = time.perf_counter() - build_seconds
        for r in out.rows:  # the requests' counts are those before this step
            end, prompt = r.start + r.num_tokens, len(r.request.prompt_ids)
            self.prompt_tokens += max(0, min(end, prompt) - r.start)
            self.recomputed_tokens += max(0, min(end, r.request.num_computed_ever) - max(r.start, prompt))

    def record_complete(self, flight: InFlight, now: float) -> None:
        """A step's tokens came back at ``now``. Its time runs from the previous step's completion, or
        from when it began (scheduled) if that was later (time with no step under way is no step's):
        with pipelining, completion to completion, as `prompt_seconds` and the generate suite count."""
        prefilled = any(_prefills(r) for r in flight.output.rows)
        began = flight.launched_at - flight.timings.get("schedule", 0.0)
        seconds = now - (began if self.last_complete is None else max(began, self.last_complete))
        self.step_seconds += seconds
        if prefilled:
            self.prefill_seconds += seconds
        self.last_complete = now
        self.completions.append((now, prefilled))
        self.step_timings.append(dict(flight.timings))

    @property
    def prompt_tokens_per_s(self) -> float | None:
        """Prompt positions computed (`prompt_tokens`) per second of the steps that prefilled
        (``prefill_seconds``; mlx-lm's ``BatchStats.prompt_tps``), or None before any."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def generation_tokens_per_s(self) -> float | None:
        """Generated tokens per second of the steps that did not prefill: every step's time less the
        prefilling ones' (``step_seconds - prefill_seconds``; mlx-lm's ``BatchStats.generation_tps``,
        the generate suite's ``generation_tps``), or None while there are none."""
        decode = self.step_seconds - self.prefill_seconds
        return self.generated_tokens / decode if decode > 0 else None

    def prompt_seconds(self, since: float) -> float:
        """Wall time, from ``since``, between step completions whose step prefilled (computed prompt
        tokens, or recomputed a preempted request's; mlx-lm's ``BatchStats.prompt_time`` counts the
        prompt steps), over the last `HISTORY` steps (a benchmark's run)."""
        total, last = 0.0, since
        for t, prompt in self.completions:
            if t >= since:
                if prompt:
                    total += t - last
                last = t
        return total

    def record_token(self) -> None:
        self.generated_tokens += 1

    def record_finish(self, req: Request) -> None:
        self.finished += 1
        s = RequestStats.of(req)
        if s.time_to_first_token is not None:
            self.ttft_sum += s.time_to_first_token
            self.ttft_count += 1
        if s.mean_inter_token_latency is not None:
            self.itl_sum += s.mean_inter_token_latency
            self.itl_count += 1

    def as_dict(self, blocks: Any = None) -> dict[str, Any]:
        """The totals with rates over ``elapsed_s`` (first launch to last completion): ``prompt_tokens``
        (prompt positions computed; prefix-cache hits excluded, a preempted prompt computed again
        included), ``recomputed_tokens`` (generated tokens computed again after a preemption),
        ``computed_tokens_per_s`` (all of those and the generated tokens, per second) and
        ``generated_tokens_per_s`` (generated tokens over the whole run, prefill time included; not
        mlx-lm's generation rate, which `metal-attn generate --json` gives at its top level:
        `generation_tokens_per_s`), ``step_s`` and ``prefill_s`` (seconds of every step and of those
        that prefilled, `record_complete`). With
        ``blocks`` (the `BlockManager`), the pool's state and ``prefix_cache_hit_rate``: tokens
        served from cached blocks over tokens looked up at admissions, readmissions included."""
        span = (self.last_complete - self.first_launch) if self.first_launch and self.last_complete else 0.0
        computed = self.prompt_tokens + self.recomputed_tokens + self.generated_tokens
        out: dict[str, Any] = {
            "steps": self.steps,
            "requests_finished": self.finished,
            "prompt_tokens": self.prompt_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": span,
            "step_s": self.step_seconds,
            "prefill_s": self.prefill_seconds,
            "computed_tokens_per_s": computed / span if span else None,
            "generated_tokens_per_s": self.generated_tokens / span if span else None,
            "mean_ttft_s": self.ttft_sum / self.ttft_count if self.ttft_count else None,
            "mean_itl_s": self.itl_sum / self.itl_count if self.itl_count else None,
            "host_build_s": self.build_seconds,
            "preemptions": self.preemptions,
        }
        if blocks is not None:
            q = blocks.prefix_queries
            out |= {
                "blocks_total": blocks.num_blocks,
                "blocks_used": blocks.num_used,
                "blocks_free": blocks.allocator.num_free,
                "blocks_cached": blocks.num_evictable,
                "prefix_cache_hit_rate": blocks.prefix_hits / q if q else 0.0,
                "evictions": blocks.evictions,
            }
        return out


def _prefills(row: Any) -> bool:
    """Whether a scheduled row prefills: prompt positions, or a chunk of several tokens (a preempted
    request's recomputation); a decode row is one token past the prompt."""
    return row.start < len(row.request.prompt_ids) or row.num_tokens > 1
