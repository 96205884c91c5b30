"""`Engine`: continuous batching of mlx-lm models on the paged cache.

The engine owns the loop. Each `Engine.step` lets the scheduler pick a batch, has the
step runner build and queue it, and, while it runs on the device, finishes the step
before it: its tokens come back to the host, are detokenized and checked against the
stop conditions. One forward per call; the host's work overlaps the device's.

The prefix cache holds K/V computed with the weights the model had then. Before a request is
served cached blocks, the engine checks that the model's weight arrays are the ones it saw
last (by identity, through weak references; `BlockManager.weights_unchanged`); when they are not (``model.update``,
``load_weights``, an adapter swap), the cache starts a new weights epoch
(`BlockManager.new_epoch`). `Engine.reset_prefix_cache` does so on demand, for changes the
identity of the arrays does not show (an assignment into an array, ``w[...] = x``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metal_attn.checks import int_at_least, is_int, not_unicode_at, ordered_ints
from metal_attn.device import current_device
from metal_attn.engine.block_manager import BlockManager
from metal_attn.engine.config import EngineConfig
from metal_attn.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from metal_attn.engine.runner import InFlight, StepRunner
from metal_attn.engine.sampling import init_sampling_state
from metal_attn.engine.scheduler import Scheduler
from metal_attn.engine.stats import EngineStats, RequestStats
from metal_attn.errors import CacheExhaustedError, InvalidInputError
from metal_attn.log import get_logger
from metal_attn.mlx_lm.runner import PagedModel, array_slots, inspect_model, model_lock

__all__ = ["Completion", "Engine", "RequestOutput"]

log = get_logger(component="engine")


def _serialized(method: Any) -> Any:
    """One thread at a time inside the engine (see `Engine`): the method runs under its lock."""

    @functools.wraps(method)
    def locked(self: Engine, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: int
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request, in the shape `metal-attn generate --json` prints."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    stats: RequestStats | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def model_max_len(model: nn.Module) -> int | None:
    """The context length an mlx-lm model declares (its args' ``max_position_embeddings``), or None."""
    for obj in (getattr(model, "args", None), getattr(getattr(model, "language_model", None), "args", None)):
        n = getattr(obj, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def weight_refs(model: nn.Module) -> tuple[tuple[Any, weakref.ref], ...]:
    """Which arrays ``model``'s tree holds (`nn.Module.state`): each one's key and a weak reference
    to it, so that arrays the model drops are not kept alive."""
    return tuple((key, weakref.ref(value)) for _, key, value in array_slots(model.state))


def same_weights(model: nn.Module, refs: tuple[tuple[Any, weakref.ref], ...]) -> bool:
    """Whether ``model``'s tree holds the very arrays of ``refs`` (`weight_refs`), at the same keys."""
    slots = array_slots(model.state)
    return len(slots) == len(refs) and all(
        key == k and ref() is value for (_, key, value), (k, ref) in zip(slots, refs))


def context_len(model: nn.Module, config: EngineConfig) -> int:
    """The most tokens (prompt and generated) one request may hold: ``config.max_model_len``, else what
    the model declares, else 8,192."""
    return config.max_model_len or model_max_len(model) or 8192


class Engine:
    """Serve requests on ``model`` (an mlx-lm model) with ``tokenizer`` (mlx-lm's `TokenizerWrapper`).

    Threads: one engine may be used from several threads (a server's engine thread stepping while
    request threads add, abort and release): its methods take turns under one lock, so a step is
    never seen half done. A stream or `generate` steps the engine itself, between other threads'
    calls. Several engines may share one model (their graphs are built under the model's lock,
    `metal_attn.mlx_lm.runner.model_lock`). MLX arrays made on one thread are evaluated on that
    thread's stream (docs/design.md, "Threads").
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: EngineConfig | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidInputError(f"config={config!r} (allowed: an EngineConfig, or None for the settings' "
                                    "defaults)")
        self.config = (config or EngineConfig.from_settings()).validate()
        missing = [a for a in ("encode", "detokenizer") if not hasattr(tokenizer, a)]
        if missing:
            raise InvalidInputError(
                f"tokenizer={type(tokenizer).__name__} has no {' or '.join(missing)} (allowed: mlx-lm's "
                "TokenizerWrapper, as mlx_lm.load returns it; wrap a Hugging Face tokenizer with "
                "mlx_lm.tokenizer_utils.TokenizerWrapper(tokenizer))")
        self.tokenizer = tokenizer
        cfg = self.config
        self.max_model_len = context_len(model, cfg)
        shape = inspect_model(model)
        block_bytes = shape.block_bytes(cfg.block_size)
        num_blocks, self.pool_source = cfg.pool_blocks(block_bytes, current_device().memory_bytes, self.max_model_len)
        self.model = PagedModel(model, num_blocks=num_blocks, block_size=cfg.block_size, shape=shape)
        self.pool_bytes = num_blocks * block_bytes
        self.blocks = BlockManager(self.model.kv.allocator, cfg.block_size,
                                   enable_prefix_caching=cfg.enable_prefix_caching)
        self.blocks.weights_unchanged = self._weights_unchanged
        self.scheduler = Scheduler(cfg, self.blocks)
        compile_decode, self.compile_decode_reason = cfg.resolve_compile_decode(current_device().backend)
        self.runner = StepRunner(self.model, self.blocks, compile_decode=compile_decode,
                                 trace_after=cfg.compile_trace_after, shrink_after=cfg.compile_shrink_after)
        self.requests: dict[int, Request] = {}
        self._lock = threading.RLock()
        self._inflight: deque[InFlight] = deque()
        self._next_id = 0
        self.stats = EngineStats()
        #: The model's weight arrays as the prefix cache last saw them (`same_weights`).
        with model_lock(model):
            self._weights = weight_refs(model)
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        self._eos = frozenset(int(t) for t in eos)

    def __repr__(self) -> str:
        return f"Engine({self.model!r}, {self.config})"

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds for requests: every page but those the engine reserves (the
        padding page of compiled decode steps)."""
        return (self.blocks.num_blocks - len(self.blocks.reserved)) * self.config.block_size

    # -- requests ------------------------------------------------------------------------------

    @_serialized
    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        max_tokens: int = 256,
        stop: Iterable[str] | str | None = None,
        prompt_text: str | None = None,
    ) -> int:
        """Queue a prompt (text, tokenized as is, or token ids); return its request id.

        Everything is checked here (`check_request`), before any model work. ``prompt_text``
        is what `Completion.prompt` reports (default: the prompt when it is text).
        """
        ids, sampling, stops = self.check_request(prompt, sampling, max_tokens=max_tokens, stop=stop)
        return self._queue(ids, sampling, stops, max_tokens,
                           prompt_text if prompt_text is not None else (prompt if isinstance(prompt, str) else None))

    def _queue(self, ids: list[int], sampling: SamplingParams, stops: tuple[str, ...], max_tokens: int,
               prompt_text: str | None) -> int:
        """Queue a request `check_request` has passed; return its id."""
        req = Request(
            id=self._next_id,
            prompt_ids=ids,
            sampling=sampling,
            max_tokens=max_tokens,
            stop_strings=stops,
            stop_token_ids=self._eos,
            prompt_text=prompt_text,
        )
        req.detokenizer = self.tokenizer.detokenizer
        init_sampling_state(req)
        self._next_id += 1
        self.requests[req.id] = req
        self.scheduler.add(req)
        return req.id

    def check_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        max_tokens: int = 256,
        stop: Iterable[str] | str | None = None,
        label: str = "prompt",
    ) -> tuple[list[int], SamplingParams, tuple[str, ...]]:
        """Check a request without queueing it: an empty prompt, ids outside the vocabulary,
        ``max_tokens`` < 1, bad sampling values, or a request that can never fit (longer than
        the model's context or than the whole pool) raise `InvalidInputError`."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidInputError(f"sampling={sampling!r} (allowed: a SamplingParams, or None for greedy)")
        sampling = (sampling or SamplingParams()).validate()
        vocab = self.model.vocab_size
        if sampling.top_k >= vocab:
            raise InvalidInputError(f"top_k={sampling.top_k} (allowed: 0..{vocab - 1}, below the vocabulary of "
                                    f"{vocab}; 0 disables it)")
        far = [t for t in (sampling.logit_bias or {}) if t >= vocab]
        if far:
            raise InvalidInputError(f"logit_bias token id {far[0]} is out of range (allowed: 0..{vocab - 1})")
        int_at_least("max_tokens", max_tokens)
        if stop is not None and not isinstance(stop, (str, Iterable)):
            raise InvalidInputError(f"stop={stop!r} (allowed: a non-empty string, an iterable of them, or None)")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s or not_unicode_at(s) is not None for s in stops):
            raise InvalidInputError(f"stop={stop!r} (allowed: non-empty strings of Unicode text)")
        ids = self._prompt_ids(prompt, label)
        total = len(ids) + max_tokens
        if total > self.max_model_len:
            raise InvalidInputError(
                f"{label} of {len(ids)} tokens + max_tokens={max_tokens} = {total} tokens exceeds the model's "
                f"context of {self.max_model_len} tokens (allowed: at most {self.max_model_len} in all)"
            )
        if total > self.pool_tokens:
            reserved = self.blocks.reserved
            aside = f" (and {len(reserved)} reserved: {', '.join(sorted(set(reserved.values())))})" if reserved else ""
            raise InvalidInputError(
                f"{label} of {len(ids)} tokens + max_tokens={max_tokens} = {total} tokens can never fit the KV pool "
                f"of {self.blocks.num_blocks - len(reserved)} blocks x {self.config.block_size} = {self.pool_tokens} "
                f"tokens{aside} (allowed: at most {self.pool_tokens}; give the pool more memory)"
            )
        return ids, sampling, stops

    def _prompt_ids(self, prompt: str | Sequence[int], label: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError(f"{label}='' (allowed: a non-empty text or a non-empty list of token ids)")
            at = not_unicode_at(prompt)
            if at is not None:
                raise InvalidInputError(
                    f"{label}={prompt[:60]!r}: character {at} ({prompt[at]!r}) is no Unicode text (bytes that were not "
                    "UTF-8?) (allowed: Unicode text, or a list of token ids)")
            bos = getattr(self.tokenizer, "bos_token", None)
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
        else:
            ids = ordered_ints(label, prompt, allowed="a text, or a list or 1-D array of int token ids")
        if not ids:
            raise InvalidInputError(f"{label} has no tokens (allowed: a non-empty text or list of token ids)")
        vocab = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(f"{label} token id {bad[0]} is out of range (allowed: 0..{vocab - 1})")
        return ids

    @_serialized
    def abort(self, request_id: int) -> None:
        """Stop a request now; its pages go back (an unknown id is an error)."""
        req = self._get(request_id)
        if req.finished:
            return
        self._finish(req, FinishReason.ABORT)

    def _get(self, request_id: int) -> Request:
        try:
            if not is_int(request_id):  # True == 1, 0.0 == 0 as dict keys
                raise TypeError
            return self.requests[request_id]
        except (KeyError, TypeError):
            known = ", ".join(map(str, list(self.requests)[:8])) or "none"
            raise InvalidInputError(f"request_id={request_id!r} is unknown (known: {known})") from None

    @_serialized
    def has_unfinished(self) -> bool:
        return bool(self._inflight) or bool(self.scheduler.waiting) or bool(self.scheduler.running)

    @property
    @_serialized
    def in_flight(self) -> tuple[InFlight, ...]:
        """The steps launched and not yet completed, oldest first: each one's scheduled rows
        (``output``), step plan and host timings. With pipelining on, the newest is the step the
        last `step` call launched."""
        return tuple(self._inflight)

    # -- the loop ------------------------------------------------------------------------------

    @_serialized
    def step(self) -> list[RequestOutput]:
        """Run one forward for the batch the scheduler picks; return each request's new tokens.

        With pipelining on, the step launched now runs while the previous one is finished
        on the host, so the tokens returned are those of the previous forward (the first
        call launches two). Returns ``[]`` when no request got a token: nothing is left to do, or the
        step only ran prefill chunks (a prompt longer than the token budget); loop on `has_unfinished`.
        """
        if not self._inflight:
            self._launch()
        # Two steps in flight at most: after a Ctrl-C left a step queued, a third would run one token ahead
        # of what the logits processors' histories know.
        if self.config.pipeline and len(self._inflight) == 1:
            self._launch()
        if not self._inflight:
            self._check_not_stuck()
            return []
        return self._complete_oldest()

    @_serialized
    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache: no request admitted from now on is served K/V computed before
        (`BlockManager.new_epoch`); returns how many cached blocks were dropped. The engine does this
        itself when the model's weight arrays are replaced (``model.update``, ``load_weights``, an
        adapter swap); call it after changing weights in a way that keeps the arrays (``w[...] = x``).
        Requests running now keep the K/V they have."""
        with model_lock(self.model.model):  # not while another engine's trace holds tracers in the tree
            self._weights = weight_refs(self.model.model)
        return self.blocks.new_epoch()

    def _weights_unchanged(self) -> bool:
        """Whether the model holds the weight arrays the prefix cache saw (`BlockManager.weights_unchanged`:
        asked only when a request is about to be served cached blocks, so decode steps and admissions
        without a hit never walk the model's tree). When not, the arrays now held are the ones to compare
        with next, and the block manager starts a new weights epoch."""
        with model_lock(self.model.model):  # not while another engine's trace holds tracers in the tree
            if same_weights(self.model.model, self._weights):
                return True
            self._weights = weight_refs(self.model.model)
        log.info("prefix_cache_reset", reason="the model's weights changed", epoch=self.blocks.epoch + 1)
        return False

    def _check_not_stuck(self) -> None:
        """Nothing ran and nothing is in flight: with requests waiting and none running, the pool is
        as empty as it gets, so a request it cannot admit now never will be. Raise rather than let
        the caller's loop spin (`add_request` refuses such a request, so this is a broken invariant)."""
        sched = self.scheduler
        if sched.waiting and not sched.running:
            req = sched.waiting[0]
            raise CacheExhaustedError(
                f"request {req.id} ({req.num_tokens} tokens, max_tokens={req.max_tokens}) cannot be admitted with "
                f"nothing running: {self.blocks.allocator.num_free} free and {self.blocks.num_evictable} cached "
                f"blocks of {self.blocks.num_blocks} ({len(self.blocks.reserved)} reserved by the engine)")

    def _launch(self) -> None:
        t = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter() - t
        self.stats.preemptions += len(out.preempted)
        if not out.rows:
            return
        previous = self._inflight[-1] if self._inflight else None
        flight = self.runner.launch(out, previous)
        flight.timings["schedule"] = scheduled
        self.stats.record_launch(out, flight.build_seconds)  # before the counts below move
        for row in out.rows:
            req = row.request
            req.num_computed = row.start + row.num_tokens
            req.num_computed_ever = max(req.num_computed_ever, req.num_computed)
            if row.samples:
                req.pending += 1
            # Full blocks this step writes become shareable from the next step on (never while being written).
            self.blocks.register(req.id, req.known_ids(), req.num_computed)
        self._inflight.append(flight)

    def _complete_oldest(self) -> list[RequestOutput]:
        """Finish the oldest step in flight: its tokens to the host, each request's token accepted.

        The step leaves the queue only once its tokens are on the host: an interrupt while waiting
        (Ctrl-C) leaves it queued and the next call finishes it, so no token is lost. If the wait
        fails with an error (the device's), every step in flight is lost with it (each one's input
        is the one before's samples): their requests end with ``finish_reason`` ``"error"``."""
        flight = self._inflight[0]
        try:
            tokens = flight.tokens()
        except Exception as exc:
            return self._fail_in_flight(f"the step failed on the device: {type(exc).__name__}: {exc}")
        self._inflight.popleft()
        now = time.perf_counter()
        self.stats.record_complete(flight, now)
        rows = list(zip(flight.sampling_rows, tokens))
        for row, _ in rows:
            row.request.pending -= 1
        outputs = []
        for row, tok in rows:
            req = row.request
            if req.finished:
                continue  # stopped or aborted while this step ran: its token is dropped
            error = flight.errors.get(req.id)
            if error is None:
                try:
                    outputs.append(self._accept(req, int(tok), now))
                    continue
                except Exception as exc:  # the tokenizer's detokenizer, on this request's token
                    error = f"{type(exc).__name__}: {exc}"
            if not req.finished:
                self._finish(req, FinishReason.ERROR, error)
            outputs.append(self._output(req, ()))
        return outputs

    def _fail_in_flight(self, error: str) -> list[RequestOutput]:
        """End every request of every step in flight with ``error``; empty the queue."""
        flights, outputs = list(self._inflight), []
        self._inflight.clear()
        for flight in flights:
            for row in flight.sampling_rows:
                row.request.pending -= 1
        failed = list(dict.fromkeys(row.request for flight in flights for row in flight.output.rows))
        self.blocks.uncache(r.id for r in failed)  # what those steps were writing is not K/V anyone may reuse
        for req in failed:
            if not req.finished:
                self._finish(req, FinishReason.ERROR, error)
                outputs.append(self._output(req, ()))
        return outputs

    def _output(self, req: Request, tokens: tuple[int, ...]) -> RequestOutput:
        """What `step` returns for ``req``: its ``tokens`` and the text that became final since its last output."""
        end = req.text_ready()
        text, req.delivered = req.text[req.delivered:end], max(req.delivered, end)
        return RequestOutput(req.id, tokens, text, req.finished,
                             req.finish_reason.value if req.finish_reason else None, req.error)

    def _accept(self, req: Request, tok: int, now: float) -> RequestOutput:
        """Append a sampled token, detokenize it, and finish the request if a stop condition holds."""
        req.append_output(tok)
        req.token_times.append(now)
        self.stats.record_token()
        if req.first_token_time is None:
            req.first_token_time = now
        before = len(req.text)
        reason = None
        if tok in req.stop_token_ids:
            reason = FinishReason.STOP  # kept in output_ids, not in the text
            req.detokenizer.finalize()
        else:
            req.detokenizer.add_token(tok)
            if len(req.output_ids) >= req.max_tokens:
                reason = FinishReason.LENGTH
                req.detokenizer.finalize()
        req.text = req.detokenizer.text
        if req.stop_strings:
            longest = max(len(s) for s in req.stop_strings)
            cut = _first_stop(req.text, req.stop_strings, max(0, before - longest))
            if cut is not None:
                req.text = req.text[:cut]
                reason = FinishReason.STOP
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, (tok,))

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        req.move_to(RequestStatus.FINISHED, reason, error)
        self.scheduler.remove(req)
        self.stats.record_finish(req)

    # -- conveniences --------------------------------------------------------------------------

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int = 256,
        stop: Iterable[str] | str | None = None,
    ) -> Iterator[RequestOutput]:
        """Add ``prompts`` and yield every request's new tokens as steps produce them.

        The prompts are checked when this is called (a refused one raises here, and none is
        queued); the requests are added when the iterator is first read, as a generator's body
        runs. Closing the iterator early (``break``, or an exception in the loop) aborts the
        requests it added that have not finished, so their pages go back at once."""
        return self._stream(self._check_all(prompts, sampling, max_tokens, stop))

    def _stream(self, checked: list[tuple[Any, ...]]) -> Iterator[RequestOutput]:
        ids = self._queue_all(checked)
        try:
            yield from self.stream_ids(ids)
        finally:
            self._abort_unfinished(ids)

    def stream_ids(self, request_ids: Iterable[int]) -> Iterator[RequestOutput]:
        """Step until the given (already added) requests finish, yielding their new tokens.

        Outputs are read from the requests, not from the steps this stream runs: tokens that steps
        run elsewhere produced (another stream, `step`, `generate`) come in the next output, so a
        request's outputs here add up to its completion, from its first token. Each request's last
        output has ``finished`` set, whatever ended it (an abort by the consumer between two
        outputs included). Closing the iterator early leaves the requests running (abort them to
        free their pages)."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise InvalidInputError(f"request_ids={request_ids!r} (allowed: an iterable of request ids)")
        seen = {self._get(i).id: [0, 0] for i in request_ids}  # request id -> [tokens, characters] yielded
        idle = False
        while seen:
            for rid in list(seen):
                with self._lock:  # not across the yield: the consumer may call the engine
                    req = self.requests.get(rid)
                    if req is None:
                        raise InvalidInputError(f"request {rid} was released while streamed (allowed: release a "
                                                "request once its stream has ended)")
                    out = self._unread(req, seen[rid])
                if out is not None:
                    yield out
                    if out.finished:
                        del seen[rid]
            if not seen or idle:
                break
            # Nothing left to run: one more read (what finished the requests may have come from steps run
            # elsewhere, or an abort), then the stream ends.
            idle = not self.step() and not self._inflight and not self.scheduler.has_work()

    @staticmethod
    def _unread(req: Request, seen: list[int]) -> RequestOutput | None:
        """What ``req`` produced past ``seen`` (tokens and final text already yielded; advanced), or
        None when nothing is new and it has not finished."""
        tokens, chars = seen
        end = req.text_ready()
        if len(req.output_ids) == tokens and end == chars and not req.finished:
            return None
        seen[:] = [len(req.output_ids), max(chars, end)]
        return RequestOutput(req.id, tuple(req.output_ids[tokens:]), req.text[chars:end], req.finished,
                             req.finish_reason.value if req.finish_reason else None, req.error)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int = 256,
        stop: Iterable[str] | str | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` to completion; one `Completion` per prompt, in input order. The requests
        are released when it returns (`release`); if it raises, the unfinished ones are aborted."""
        ids = self._add_all(prompts, sampling, max_tokens, stop)
        try:
            for _ in self.stream_ids(ids):
                pass
        finally:
            self._abort_unfinished(ids)
        return [self.release(i) for i in ids]

    @_serialized
    def _abort_unfinished(self, ids: Iterable[int]) -> None:
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self._finish(req, FinishReason.ABORT)

    def _add_all(self, prompts, sampling, max_tokens, stop) -> list[int]:
        """Check every prompt, then queue them all: a refused prompt queues none of them."""
        return self._queue_all(self._check_all(prompts, sampling, max_tokens, stop))

    def _check_all(self, prompts, sampling, max_tokens, stop) -> list[tuple[Any, ...]]:
        """Every prompt checked, with what `_queue_all` needs to queue it (raises for the first refused)."""
        if isinstance(prompts, str):
            items = [prompts]
        elif isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, Mapping)):
            items = list(prompts)
        else:
            raise InvalidInputError(f"prompts={prompts!r} (allowed: a text, or a list of texts or token-id lists)")
        if not items:
            raise InvalidInputError("prompts is empty (allowed: one or more prompts)")
        if stop is not None and not isinstance(stop, str) and isinstance(stop, Iterable):
            stop = tuple(stop)  # one pass: a generator would serve the first prompt only
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(items)
        if len(params) != len(items):
            raise InvalidInputError(f"{len(params)} sampling parameter sets for {len(items)} prompts (need one each)")
        checked = [self.check_request(p, s, max_tokens=max_tokens, stop=stop,
                                      label="prompt" if len(items) == 1 else f"prompt {i}")
                   for i, (p, s) in enumerate(zip(items, params))]
        return [(ids, sp, stops, max_tokens, p if isinstance(p, str) else None)
                for p, (ids, sp, stops) in zip(items, checked)]

    @_serialized
    def _queue_all(self, checked: list[tuple[Any, ...]]) -> list[int]:
        return [self._queue(*c) for c in checked]

    @_serialized
    def release(self, request_id: int) -> Completion:
        """The result of a finished request, which the engine then forgets (its id becomes unknown).
        A long-running server releases each request it is done with: the engine keeps every other
        one, with its tokens, text and timings, for `completion`."""
        out = self.completion(request_id)
        del self.requests[request_id]
        return out

    @_serialized
    def completion(self, request_id: int) -> Completion:
        """The result of a finished request."""
        req = self._get(request_id)
        if not req.finished:
            raise InvalidInputError(f"request_id={request_id} is still {req.status.value} (allowed: a finished one)")
        return Completion(
            prompt=req.prompt_text,
            prompt_token_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=req.text,
            finish_reason=req.finish_reason.value,
            error=req.error,
            stats=RequestStats.of(req),
        )

    @_serialized
    def kv_usage(self) -> dict[str, int]:
        """Pages used by requests, free, cached (evictable) and reserved by the engine, and the pool size."""
        return {
            "blocks": self.blocks.num_blocks,
            "used": self.blocks.num_used,
            "free": self.blocks.allocator.num_free,
            "cached": self.blocks.num_evictable,
            "reserved": len(self.blocks.reserved),
        }

    @_serialized
    def synchronize(self) -> list[RequestOutput]:
        """Finish every step in flight (their tokens are processed as usual) and return their outputs, as
        `step` returns a step's: a caller that reads tokens from `step` reads the rest here."""
        outputs: list[RequestOutput] = []
        while self._inflight:
            outputs += self._complete_oldest()
        mx.synchronize()
        return outputs


def _first_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    return min(hits) if hits else None

