"""The engine driven through random interleavings of its whole API (hypothesis' stateful testing).

Requests arrive, are stepped, aborted, released, streamed by several consumers at once (pulled a few
outputs at a time, closed early or read to the end) and generated, under small pools (preemption),
small budgets (chunked prefill), prefix caching, pipelining and compiled decode steps on and off.
What must hold, whatever the order:

- every greedy request's tokens are stock mlx-lm's (single stream, its own cache), cut where it ended;
- a stream's outputs add up to each of its requests' completion, and the last one says it finished;
- released ids are gone, unfinished ones cannot be released;
- once drained, nothing runs, no page is in use and the block manager's invariants hold.

A helper's fuzz of this kind found a stream that ended without its requests' final outputs (twenty-third
session); this is the compact version that CI runs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from metal_attn.engine import Engine, EngineConfig
from metal_attn.errors import InvalidInputError
from metal_attn.testing.greedy import reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

MODEL = tiny_model("llama")
EOS = WordTokenizer.eos_token_ids
SHARED = [17, 200, 3, 99, 41, 5, 250, 8, 64, 77, 12, 140, 33, 9, 180, 21, 6]  # a prefix some prompts share
_REFERENCE: dict[tuple[int, ...], list[int]] = {}

#: Stop strings over WordTokenizer's text ("<84><210>..."): some end requests mid-token-run, some never match.
stops = st.sampled_from([None, "<1", "2><", "<5", "0><2", "zz"])
prompts = st.one_of(
    st.lists(st.integers(1, 255), min_size=1, max_size=40),
    st.lists(st.integers(1, 255), min_size=0, max_size=12).map(lambda tail: SHARED + tail),
)


def reference(prompt: list[int], n: int) -> list[int]:
    """Stock mlx-lm's first ``n`` greedy tokens of ``prompt`` (computed once per prompt, 16 tokens)."""
    key = tuple(prompt)
    if key not in _REFERENCE:
        _REFERENCE[key] = list(reference_greedy(MODEL, prompt, 16, EOS).tokens)
    return _REFERENCE[key][:n]


class EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 40), budget=st.integers(4, 64), cap=st.integers(1, 8),
                block_size=st.sampled_from([8, 16]), prefix=st.booleans(), pipeline=st.booleans(),
                compiled=st.booleans())
    def start(self, num_blocks, budget, cap, block_size, prefix, pipeline, compiled):
        self.eng = Engine(MODEL, WordTokenizer(), EngineConfig(
            num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=cap, block_size=block_size,
            enable_prefix_caching=prefix, pipeline=pipeline, compile_decode=compiled, max_model_len=64))
        self.prompt: dict[int, list[int]] = {}
        self.released: set[int] = set()
        self.streams: list[tuple[object, dict[int, list]]] = []  # (iterator, request id -> its outputs)

    def _fits(self, prompt: list[int], max_tokens: int) -> bool:
        return len(prompt) + max_tokens <= min(64, self.eng.pool_tokens)

    @rule(prompt=prompts, max_tokens=st.integers(1, 12), stop=stops)
    def add(self, prompt, max_tokens, stop):
        if self._fits(prompt, max_tokens):
            self.prompt[self.eng.add_request(prompt, max_tokens=max_tokens, stop=stop)] = prompt

    @rule()
    def step(self):
        self.eng.step()

    @precondition(lambda self: self.prompt)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.prompt)))
        if rid not in self.released:
            self.eng.abort(rid)

    @precondition(lambda self: self.prompt)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.prompt)))
        if rid in self.released:
            with pytest.raises(InvalidInputError, match="is unknown"):
                self.eng.release(rid)
        elif not self.eng.requests[rid].finished:
            with pytest.raises(InvalidInputError, match="is still"):
                self.eng.release(rid)
        elif not any(rid in outs for _, outs in self.streams):  # a stream still reads it
            self._check(rid, self.eng.release(rid))
            self.released.add(rid)

    @precondition(lambda self: len(self.streams) < 3)
    @rule(batch=st.lists(prompts, min_size=1, max_size=2), max_tokens=st.integers(1, 10), stop=stops)
    def open_stream(self, batch, max_tokens, stop):
        if not all(self._fits(p, max_tokens) for p in batch):
            return
        before = set(self.eng.requests)
        it = self.eng.stream(batch, max_tokens=max_tokens, stop=stop)
        outs: dict[int, list] = {}
        first = next(it, None)  # the generator adds its requests when first read
        added = sorted(set(self.eng.requests) - before)  # ids grow in the order of the prompts
        assert [self.eng.requests[rid].prompt_ids for rid in added] == batch
        for rid, p in zip(added, batch, strict=True):
            self.prompt[rid] = p
            outs[rid] = []
        if first is not None:
            outs[first.request_id].append(first)
        self.streams.append((it, outs))

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), n=st.integers(1, 6))
    def pull(self, data, n):
        i = data.draw(st.integers(0, len(self.streams) - 1))
        it, outs = self.streams[i]
        for _ in range(n):
            out = next(it, None)
            if out is None:
                self._stream_ended(i)
                return
            outs[out.request_id].append(out)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def close_stream(self, data):
        i = data.draw(st.integers(0, len(self.streams) - 1))
        it, outs = self.streams.pop(i)
        it.close()  # aborts its unfinished requests
        assert all(self.eng.requests[rid].finished for rid in outs)

    @rule(batch=st.lists(prompts, min_size=1, max_size=3), max_tokens=st.integers(1, 8))
    def generate(self, batch, max_tokens):
        if not all(self._fits(p, max_tokens) for p in batch):
            return
        for p, c in zip(batch, self.eng.generate(batch, max_tokens=max_tokens), strict=True):
            assert c.prompt_token_ids == p
            self._check(None, c)  # generate releases its requests: no id to check afterwards

    def _stream_ended(self, i):
        _, outs = self.streams.pop(i)
        for rid, got in outs.items():
            c = self.eng.completion(rid)
            assert got and got[-1].finished and got[-1].finish_reason == c.finish_reason, (rid, got)
            assert [t for o in got for t in o.new_token_ids] == c.token_ids
            assert "".join(o.new_text for o in got) == c.text

    def _check(self, rid, c):
        """Stock mlx-lm's tokens, cut where the request ended (a stop string or an abort may cut anywhere),
        and the text those tokens spell, cut at the stop string when one ended it."""
        want = reference(c.prompt_token_ids, len(c.token_ids))
        assert c.token_ids == want, (rid, c.finish_reason, c.token_ids, want)
        full = WordTokenizer().decode([t for t in c.token_ids if t not in EOS])
        stop = self.eng.requests[rid].stop_strings if rid in self.eng.requests else ()
        assert full.startswith(c.text) and (c.text == full or c.finish_reason == "stop"), (c.text, full)
        assert not any(s in c.text for s in stop)

    @invariant()
    def pages_add_up(self):
        if hasattr(self, "eng"):
            usage = self.eng.kv_usage()
            assert usage["used"] + usage["free"] + usage["cached"] + usage["reserved"] == usage["blocks"], usage
            assert len(self.eng.scheduler.running) <= self.eng.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        while self.streams:
            it, outs = self.streams[0]
            for out in it:
                outs[out.request_id].append(out)
            self._stream_ended(0)
        for _ in range(2000):
            if not self.eng.has_unfinished():
                break
            self.eng.step()
        assert not self.eng.has_unfinished() and self.eng.step() == []
        for rid in set(self.prompt) - self.released:
            self._check(rid, self.eng.completion(rid))
        assert self.eng.blocks.num_used == 0
        self.eng.blocks.check_invariants()


EngineMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_engine_under_random_interleavings = EngineMachine.TestCase
