"""Sampling parameters near float32's edges: `logit_bias` and `repetition_penalty` bounded so the
processed logits stay finite (`MAX_LOGIT_BIAS`, `MIN_REPETITION_PENALTY`, `MAX_REPETITION_PENALTY`).
Accepted values near the bounds give stock mlx-lm's tokens (`generate_step` with mlx-lm's own
logits processors); values past them are refused by `add_request`, naming the entry, its value
and the bound."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from metal_attn.engine import Engine, EngineConfig, SamplingParams
from metal_attn.engine.request import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from metal_attn.errors import InvalidInputError
from metal_attn.testing.models import WordTokenizer, tiny_model

EOS = WordTokenizer.eos_token_ids
PROMPT = [1, 2, 3, 9, 9, 40, 2, 3]
N = 6


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def eng(llama):
    return Engine(llama, WordTokenizer(), EngineConfig(num_blocks=32))


def _stock(model, **processors) -> list[int]:
    """Stock mlx-lm greedy tokens with its own logits processors."""
    out = []
    procs = make_logits_processors(**processors)
    for (tok, _), _ in zip(generate_step(mx.array(PROMPT), model, max_tokens=N, logits_processors=procs), range(N)):
        out.append(int(tok))
        if out[-1] in EOS:
            break
    return out


def _tokens(eng, sp: SamplingParams) -> list[int]:
    (c,) = eng.generate([PROMPT], sp, max_tokens=N)
    assert c.error is None, c.error
    return c.token_ids


def test_the_bounds():
    assert MAX_LOGIT_BIAS == 1e30
    assert (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY) == (1e-4, 1e4)
    assert SamplingParams().max_logit_bias == 1e30
    assert SamplingParams(temperature=2.0).max_logit_bias == 1e30
    assert SamplingParams(temperature=0.25).max_logit_bias == 2.5e29


@pytest.mark.parametrize("bias", [1e30, -1e30, 10**30])
def test_greedy_biases_at_the_bound_give_stock_tokens(llama, eng, bias):
    first = _stock(llama)[0]
    tok = 5 if bias > 0 else first  # pushed up, or the token stock picks first pushed down
    got = _tokens(eng, SamplingParams(logit_bias={tok: bias}))
    assert got == _stock(llama, logit_bias={tok: float(bias)})
    assert (set(got) == {5}) if bias > 0 else (tok not in got)


def test_sampled_bias_at_the_bound_forces_its_token(eng):
    """At temperature 1 a bias of 1e30 puts all the probability on its token (any correct sampler draws it);
    at 0.25 the bound is 2.5e29."""
    assert _tokens(eng, SamplingParams(temperature=1.0, seed=0, logit_bias={5: 1e30})) == [5] * N
    assert _tokens(eng, SamplingParams(temperature=0.25, seed=0, logit_bias={5: 2.5e29})) == [5] * N
    assert _tokens(eng, SamplingParams(temperature=4.0, seed=0, logit_bias={7: 1e30})) == [7] * N


@pytest.mark.parametrize(("sp", "message"), [
    # The reviewer's case: finite in float64, infinite in float32; sampled, it gave the last id every time.
    (SamplingParams(temperature=1.0, seed=0, logit_bias={5: 1e39}),
     "logit_bias entry 5: 1e+39 is beyond the bound of 1e+30 (allowed: biases of magnitude up to 1e+30"),
    (SamplingParams(temperature=1.0, seed=0, logit_bias={5: 1e300}), "logit_bias entry 5: 1e+300 is beyond"),
    (SamplingParams(logit_bias={5: 1e39}), "logit_bias entry 5: 1e+39 is beyond the bound of 1e+30"),
    (SamplingParams(logit_bias={3: 0.5, 5: -1.5e30}), "logit_bias entry 5: -1.5e+30 is beyond the bound of 1e+30"),
    (SamplingParams(logit_bias={5: 10**400}), "logit_bias entry 5: 1000000000"),
    (SamplingParams(temperature=0.25, seed=0, logit_bias={5: 3e29}),
     "logit_bias entry 5: 3e+29 is beyond the bound of 2.5e+29 at temperature=0.25 (1e+30 x temperature)"),
    (SamplingParams(temperature=1e-30, seed=0, logit_bias={5: 2.0}),
     "logit_bias entry 5: 2.0 is beyond the bound of 1 at temperature=1e-30"),
    (SamplingParams(repetition_penalty=1e39), "repetition_penalty=1e+39 (allowed: a number in [0.0001, 10000]"),
    (SamplingParams(repetition_penalty=2e4), "repetition_penalty=20000.0 (allowed: a number in [0.0001, 10000]"),
    (SamplingParams(repetition_penalty=1e-5), "repetition_penalty=1e-05 (allowed"),
    (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty=inf (allowed"),
    (SamplingParams(repetition_penalty=10**400), "repetition_penalty=1000000000"),
    # An int too large for a float raised OverflowError from the finiteness check.
    (SamplingParams(top_p=10**400), "top_p=1000000000"),
    (SamplingParams(min_p=10**400), "min_p=1000000000"),
])
def test_values_past_the_bounds_are_refused(eng, sp, message):
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        eng.add_request(PROMPT, sp, max_tokens=N)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("penalty", [1e4, 1e-4, 1.3])
def test_greedy_penalties_at_the_bounds_give_stock_tokens(llama, eng, penalty):
    bias = {0: -1e30, 7: 3.0}
    got = _tokens(eng, SamplingParams(repetition_penalty=penalty, logit_bias=bias))
    assert got == _stock(llama, repetition_penalty=penalty, logit_bias=bias)


def test_sampled_at_the_smallest_temperature_and_the_largest_penalty_is_greedy(llama, eng):
    """Temperature 1e-30 with the penalty at its bound and the bias at its (scaled) bound: the logits,
    multiplied by 1e4 and then by 1e30, stay finite, and sampling is argmax: stock's greedy tokens."""
    bias = {7: 1.0, 0: -1.0}
    sp = SamplingParams(temperature=1e-30, seed=0, repetition_penalty=1e4, logit_bias=bias)
    assert _tokens(eng, sp) == _stock(llama, repetition_penalty=1e4, logit_bias=bias)


def test_is_finite_real_takes_ints_past_float_range():
    """An int of any size is finite; `math.isfinite` raised OverflowError on one past float's range, so a
    huge int reached callers as a crash instead of a refusal naming the value."""
    from metal_attn.checks import is_finite_real

    assert is_finite_real(10**400) and is_finite_real(-(10**400)) and is_finite_real(1.5)
    assert not is_finite_real(float("inf")) and not is_finite_real(float("nan")) and not is_finite_real(True)
