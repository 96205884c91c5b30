"""Per-request sampling for a packed step, with mlx-lm's filters and logits processors.

Greedy rows (the common case) are sampled together with one argmax. A sampled row
applies mlx-lm's top-p, min-p and top-k filters (in ``make_sampler``'s order) and draws
from the request's own ``mx.random`` key, so a seeded request gets the same tokens
whatever it is batched with. A request whose processors or sampler raise while the
step is built is reported in the result's ``errors``; the other rows are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from metal_attn.engine.request import Request, SamplingParams

__all__ = ["init_sampling_state", "sample"]


def init_sampling_state(request: Request) -> None:
    """Give a request its random key (seeded when asked) and its logits processors."""
    sp = request.sampling
    if not sp.greedy:
        seed = sp.seed if sp.seed is not None else int(mx.random.randint(0, 2**31 - 1).item())
        request.key = mx.random.key(seed)
        mx.eval(request.key)  # made on the adding thread's stream; the stepping thread may be another
    request.processors = list(_processors(sp))


def _processors(sp: SamplingParams) -> list[Any]:
    # The biases as floats: mlx-lm makes an array of them, and an int bias past int64 (10**30, within
    # `MAX_LOGIT_BIAS`) failed there with std::bad_cast.
    bias = {tok: float(b) for tok, b in sp.logit_bias.items()} if sp.logit_bias else None
    made = make_logits_processors(logit_bias=bias, repetition_penalty=sp.repetition_penalty)
    return made + list(sp.logits_processors)


def _sample_one(req: Request, logits: mx.array, history: mx.array | None) -> mx.array:
    sp = req.sampling
    shape = logits.shape
    for proc in req.processors:
        logits = proc(history, logits)
        if not isinstance(logits, mx.array) or logits.shape != shape:
            raise ValueError(f"logits processor {proc!r} returned {_describe(logits)} (allowed: logits of the shape "
                             f"it was given, {tuple(shape)})")
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if sp.greedy:
        return mx.argmax(logprobs, axis=-1)
    if 0 < sp.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sp.top_p)
    if sp.min_p:
        logprobs = apply_min_p(logprobs, sp.min_p)
    if sp.top_k > 0:
        logprobs = apply_top_k(logprobs, sp.top_k)
    req.key, sub = mx.random.split(req.key)
    return mx.random.categorical(logprobs * (1 / sp.temperature), key=sub)


def sample(
    logits: mx.array, requests: Sequence[Request], histories: Sequence[mx.array | None]
) -> tuple[mx.array, dict[int, str]]:
    """Tokens ``[N]`` (int32, lazy) for the ``N`` rows of ``logits``, and ``{request id: error}``."""
    if all(r.sampling.greedy and not r.processors for r in requests):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1).astype(mx.int32), {}
    parts, errors = [], {}
    for i, (req, hist) in enumerate(zip(requests, histories)):
        try:
            tok = _sample_one(req, logits[i : i + 1], hist)
            tok = tok.reshape(1)
        except Exception as exc:  # a user's processor or sampler: fail that request only
            errors[req.id] = f"{type(exc).__name__}: {exc}"
            tok = mx.zeros((1,), dtype=mx.int32)
        parts.append(tok.astype(mx.int32))
    return mx.concatenate(parts), errors


def _describe(x: object) -> str:
    return f"an array of shape {tuple(x.shape)}" if isinstance(x, mx.array) else f"a {type(x).__name__}"
