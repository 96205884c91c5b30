"""`EngineStats`' running totals of step time and the rates `metal-attn generate` reports, on
synthetic step completions (deterministic: no timing), against the generate suite's definitions
computed by hand: prompt positions per second of the steps that prefilled, generated tokens per
second of the other steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from metal_attn.cache import BlockAllocator
from metal_attn.engine import SamplingParams
from metal_attn.engine import stats as stats_module
from metal_attn.engine.block_manager import BlockManager
from metal_attn.engine.request import Request
from metal_attn.engine.scheduler import ScheduledRow, SchedulerOutput
from metal_attn.engine.stats import EngineStats, RequestStats

PROMPT, GEN = 10, 16  # tokens per request
PREFILL_S, DECODE_S = 1.0, 0.1  # seconds per prefill step and per decode step


class Clock:
    """Runs synthetic steps through `EngineStats` as the engine would: launch, then completion."""

    def __init__(self, stats: EngineStats, pipelined: bool = True) -> None:
        self.stats, self.pipelined, self.now = stats, pipelined, 100.0

    def step(self, rows: list[ScheduledRow], seconds: float, *, idle_before: float = 0.0) -> None:
        self.now += idle_before
        # Pipelined: the step was scheduled and queued while the one before ran (0.05 s before its end).
        began = self.now - 0.05 if self.pipelined and not idle_before and self.stats.last_complete else self.now
        out = SchedulerOutput(tuple(rows))
        self.stats.record_launch(out, 0.0)
        for r in rows:
            r.request.num_computed = r.start + r.num_tokens
            r.request.num_computed_ever = max(r.request.num_computed_ever, r.request.num_computed)
        self.now += seconds
        flight = SimpleNamespace(output=out, launched_at=began + 0.01, timings={"schedule": 0.01})
        self.stats.record_complete(flight, self.now)
        for r in rows:
            req = r.request
            if r.start + r.num_tokens >= len(req.prompt_ids):
                self.stats.record_token()
                req.output_ids.append(1)
                req.token_times.append(self.now)
                req.first_token_time = req.first_token_time or self.now
                if len(req.output_ids) == req.max_tokens:
                    req.finish_time = self.now


def _request(i: int) -> Request:
    """A request that arrived when the clock started (every prompt is queued at once by the CLI)."""
    return Request(id=i, prompt_ids=list(range(1, PROMPT + 1)), sampling=SamplingParams(), max_tokens=GEN,
                   arrival_time=100.0)


def _one_after_another(clock: Clock, n: int) -> list[Request]:
    """``n`` requests at concurrency 1: each a prefill step (its first token), then decode steps."""
    reqs = [_request(i) for i in range(n)]
    for req in reqs:
        clock.step([ScheduledRow(req, 0, PROMPT)], PREFILL_S)
        for k in range(GEN - 1):
            clock.step([ScheduledRow(req, PROMPT + k, 1)], DECODE_S)
    return reqs


@pytest.mark.parametrize("pipelined", [True, False])
def test_rates_count_the_same_steps_whenever_requests_start(pipelined):
    """Three requests one after another: every prefill step is prefill time and every decode step
    generation time, so the rates are those of one request alone (the CLI gave 2.7x one stream's)."""
    stats = EngineStats()
    _one_after_another(Clock(stats, pipelined), 3)
    assert stats.prefill_seconds == pytest.approx(3 * PREFILL_S)
    assert stats.step_seconds == pytest.approx(3 * (PREFILL_S + (GEN - 1) * DECODE_S))
    assert stats.prompt_tokens_per_s == pytest.approx(3 * PROMPT / (3 * PREFILL_S))
    assert stats.generation_tokens_per_s == pytest.approx(3 * GEN / (3 * (GEN - 1) * DECODE_S))
    alone = EngineStats()
    _one_after_another(Clock(alone, pipelined), 1)
    assert stats.generation_tokens_per_s == pytest.approx(alone.generation_tokens_per_s)
    assert stats.prompt_tokens_per_s == pytest.approx(alone.prompt_tokens_per_s)


def test_a_batch_s_rates_and_the_generate_suite_s_prompt_seconds_agree():
    """Three requests prefilled together then decoded together: the totals equal `prompt_seconds`
    (the generate suite's prompt time, from the completions it keeps) and its generation rate."""
    stats = EngineStats()
    clock = Clock(stats)
    start = clock.now
    reqs = [_request(i) for i in range(3)]
    clock.step([ScheduledRow(r, 0, PROMPT) for r in reqs], PREFILL_S)
    for k in range(GEN - 1):
        clock.step([ScheduledRow(r, PROMPT + k, 1) for r in reqs], DECODE_S)
    wall = clock.now - start
    assert stats.prefill_seconds == pytest.approx(stats.prompt_seconds(start)) == pytest.approx(PREFILL_S)
    suite_generation_tps = 3 * GEN / (wall - stats.prompt_seconds(start))  # GenerateResult.generation_tps
    assert stats.generation_tokens_per_s == pytest.approx(suite_generation_tps)


def test_idle_time_between_steps_is_no_step_s():
    """A step that begins after the engine sat idle counts from its own start, not from the completion
    before the idle time."""
    stats = EngineStats()
    clock = Clock(stats)
    _one_after_another(clock, 1)
    busy = stats.step_seconds
    req = _request(9)
    clock.step([ScheduledRow(req, 0, PROMPT)], PREFILL_S, idle_before=50.0)
    assert stats.step_seconds == pytest.approx(busy + PREFILL_S)
    assert stats.prefill_seconds == pytest.approx(2 * PREFILL_S)


def test_the_totals_outlive_the_bounded_history(monkeypatch):
    """``completions`` keeps the last HISTORY steps; the totals count every step of a long run."""
    monkeypatch.setattr(stats_module, "HISTORY", 4)
    stats = EngineStats()
    _one_after_another(Clock(stats), 3)
    assert len(stats.completions) == 4
    assert stats.prefill_seconds == pytest.approx(3 * PREFILL_S)
    assert stats.generation_tokens_per_s == pytest.approx(3 * GEN / (3 * (GEN - 1) * DECODE_S))
    as_dict = stats.as_dict()
    assert as_dict["prefill_s"] == pytest.approx(3 * PREFILL_S)
    assert as_dict["step_s"] == pytest.approx(3 * (PREFILL_S + (GEN - 1) * DECODE_S))


def test_no_rate_before_its_steps():
    stats = EngineStats()
    assert stats.prompt_tokens_per_s is None and stats.generation_tokens_per_s is None
    Clock(stats).step([ScheduledRow(_request(0), 0, PROMPT)], PREFILL_S)  # max_tokens=1: prefill steps only
    assert stats.prompt_tokens_per_s == pytest.approx(PROMPT / PREFILL_S)
    assert stats.generation_tokens_per_s is None


def test_the_cli_summary_reports_the_engine_s_rates():
    """`metal-attn generate`'s stats: the reviewer's run (three prompts at concurrency 1) reported
    generation at the last request's first token onwards, over every request's tokens."""
    from metal_attn.generate import _stats

    stats = EngineStats()
    reqs = _one_after_another(Clock(stats), 3)
    engine = SimpleNamespace(stats=stats, blocks=BlockManager(BlockAllocator(8), 16), config=SimpleNamespace(
        block_size=16), pool_bytes=0, pool_source="test")
    completions = [SimpleNamespace(prompt_token_ids=r.prompt_ids, token_ids=r.output_ids, stats=RequestStats.of(r))
                   for r in reqs]
    out = _stats(engine, completions, [], 0)
    assert out["prompt_tokens"] == 3 * PROMPT and out["generation_tokens"] == 3 * GEN
    assert out["prompt_tokens_per_s"] == pytest.approx(PROMPT / PREFILL_S)
    assert out["generation_tokens_per_s"] == pytest.approx(GEN / ((GEN - 1) * DECODE_S))
    assert out["engine"]["prefill_s"] == pytest.approx(3 * PREFILL_S)
