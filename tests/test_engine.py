"""The continuous-batching engine: token identity with stock mlx-lm under any batching, the
scheduler's invariants under random workloads (hypothesis), and faults."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metal_attn.device import current_device
from metal_attn.engine import Engine, EngineConfig, SamplingParams
from metal_attn.engine.block_manager import BlockManager, block_hash
from metal_attn.engine.request import RequestStatus
from metal_attn.errors import CacheExhaustedError, InvalidInputError
from metal_attn.settings import override_settings
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

TOL = 1e-4  # float32 on the CPU
EOS = WordTokenizer.eos_token_ids


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def workload(llama):
    """32 prompts of random lengths (1..90 tokens), some sharing a 48-token prefix, and their stock
    mlx-lm greedy continuations (single stream, mlx-lm's own cache)."""
    rng = random.Random(7)
    shared = [rng.randrange(1, 256) for _ in range(48)]
    prompts = []
    for i in range(32):
        tail = [rng.randrange(1, 256) for _ in range(rng.randrange(1, 43))]
        prompts.append(shared + tail if i % 3 == 0 else tail + tail[: rng.randrange(0, 48)])
    n_tokens = [rng.randrange(4, 20) for _ in prompts]
    refs = [reference_greedy(llama, p, n, EOS) for p, n in zip(prompts, n_tokens)]
    return prompts, n_tokens, refs


def _engine(model, **cfg) -> Engine:
    return Engine(model, WordTokenizer(), EngineConfig(**({"num_blocks": 256, "block_size": 16} | cfg)))


def _run_arrivals(eng: Engine, prompts, n_tokens, seed: int, check=None) -> list[int]:
    """Requests arrive over time (a few per step) until all are queued; then run to the end."""
    rng = random.Random(seed)
    ids, i = [], 0
    bound = 4 * (len(prompts) + sum(len(p) for p in prompts) + sum(n_tokens))  # a request that never ends fails
    while i < len(prompts) or eng.has_unfinished():
        bound -= 1
        assert bound > 0, "the requests did not finish within a step per token (max_tokens not applied?)"
        for _ in range(rng.randrange(0, 4) if i < len(prompts) else 0):
            if i < len(prompts):
                ids.append(eng.add_request(prompts[i], max_tokens=n_tokens[i]))
                i += 1
        eng.step()
        if check is not None:
            check(eng)
    return ids


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill-budget-24"),
        pytest.param({"num_blocks": 14, "max_num_batched_tokens": 64}, id="small-pool-preemption"),
        pytest.param({"pipeline": False}, id="no-pipeline"),
        pytest.param({"max_num_seqs": 5, "block_size": 8}, id="cap-5-block-8"),
        pytest.param({"compile_decode": True}, id="compiled-decode"),
        pytest.param({"compile_decode": True, "num_blocks": 14, "max_num_batched_tokens": 64},
                     id="compiled-decode-preemption"),
    ],
)
def test_32_requests_arriving_over_time_match_stock(llama, workload, cfg):
    prompts, n_tokens, refs = workload
    eng = _engine(llama, **cfg)
    ids = _run_arrivals(eng, prompts, n_tokens, seed=3)
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"engine {cfg} req {rid}")
    compiled = eng.runner.compiled
    if eng.config.resolve_compile_decode(current_device().backend)[0]:  # set, or the backend's default
        # the decode-only steps really ran compiled, traced once per shape
        assert compiled.disabled is None and compiled.steps > 0 and 0 < compiled.traces < compiled.steps
    else:
        assert compiled is None
    stats = eng.stats.as_dict(eng.blocks)
    if "num_blocks" in cfg:
        assert stats["preemptions"] > 0, "the small pool must force preemptions"
    if cfg.get("max_num_batched_tokens") == 24:
        assert stats["steps"] > 40
    assert stats["blocks_used"] == 0
    eng.blocks.check_invariants()


def test_shared_prefixes_hit_the_cache_and_match(llama, workload):
    prompts, n_tokens, refs = workload
    eng = _engine(llama, max_num_batched_tokens=64)
    ids = _run_arrivals(eng, prompts, n_tokens, seed=5)
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"prefix req {rid}")
    assert eng.blocks.prefix_hits > 0
    assert sum(eng.requests[r].num_cached_tokens for r in ids) == eng.blocks.prefix_hits
    # Requests that began with the 48-token shared prefix were served 3 full blocks from the cache.
    assert max(eng.requests[r].num_cached_tokens for r in ids[3::3]) == 48
    # The hit rate's denominator: every prompt token looked up at an admission (no preemption here).
    stats = eng.stats.as_dict(eng.blocks)
    assert stats["preemptions"] == 0 and eng.blocks.prefix_queries == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hit_rate"] == eng.blocks.prefix_hits / sum(len(p) for p in prompts)


def test_prefix_caching_off_computes_everything(llama, workload):
    prompts, n_tokens, refs = workload
    eng = _engine(llama, enable_prefix_caching=False)
    ids = _run_arrivals(eng, prompts[:8], n_tokens[:8], seed=5)
    assert eng.blocks.prefix_hits == 0 and eng.blocks.num_cached == 0
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"no-prefix req {rid}")


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    prompt = [5, 9, 200, 31, 77, 12]
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    alone = _engine(llama).generate([prompt], sp, max_tokens=16)[0].token_ids
    others = [[3, 4, 5], [100] * 30, [7, 8]]
    batched = _engine(llama).generate(
        [*others, prompt], [*(SamplingParams(temperature=1.0, seed=i) for i in range(3)), sp], max_tokens=16
    )[-1].token_ids
    assert alone == batched
    different = _engine(llama).generate([prompt], SamplingParams(temperature=0.8, top_p=0.9, seed=99),
                                        max_tokens=16)[0].token_ids
    assert different != alone


def test_mlx_lm_logits_processors_apply(llama):
    """logit_bias through mlx-lm's make_logits_processors forces a token."""
    out = _engine(llama).generate([[1, 2, 3]], SamplingParams(logit_bias={42: 1e4}), max_tokens=5)[0]
    assert out.token_ids == [42] * 5


def test_stop_strings_and_lengths(llama):
    eng = _engine(llama)
    base = eng.generate([[9, 8, 7]], max_tokens=12)[0]
    assert base.finish_reason in ("length", "stop")
    stop_at = WordTokenizer().decode(base.token_ids[3:4])
    c = _engine(llama).generate([[9, 8, 7]], max_tokens=12, stop=stop_at)[0]
    assert c.finish_reason == "stop" and stop_at not in c.text and c.token_ids == base.token_ids[:4]


# -- faults --------------------------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_refused_at_add(llama):
    eng = _engine(llama, num_blocks=4)  # 64 tokens
    with pytest.raises(InvalidInputError, match=r"can never fit the KV pool of 4 blocks x 16 = 64 tokens"):
        eng.add_request(list(range(1, 60)), max_tokens=10)
    with pytest.raises(InvalidInputError, match="exceeds the model's context of 2048"):
        _engine(llama, num_blocks=256).add_request([1] * 2000, max_tokens=100)
    assert not eng.requests


def test_the_pages_the_engine_reserves_are_not_counted_as_room(llama):
    """Compiled decode steps reserve a page for their padding rows: a request that needs the whole pool
    is refused at add_request (it used to be accepted and then wait forever, generate() spinning)."""
    eng = _engine(llama, num_blocks=2, block_size=32, compile_decode=True)
    assert eng.blocks.reserved and eng.pool_tokens == 32
    with pytest.raises(InvalidInputError, match=r"can never fit the KV pool of 1 blocks x 32 = 32 tokens \(and 1 "
                                                r"reserved: padding rows of compiled decode steps\)"):
        eng.add_request(list(range(1, 46)), max_tokens=2)
    rid = eng.add_request(list(range(1, 30)), max_tokens=3)  # what fits still runs
    while eng.has_unfinished():
        eng.step()
    assert len(eng.completion(rid).token_ids) == 3


def test_a_request_that_cannot_be_admitted_into_an_idle_pool_raises_instead_of_spinning(llama, monkeypatch):
    """The guard behind add_request's check: with the check defeated, the step that finds nothing
    running, nothing in flight and a waiting request it cannot admit raises, naming the request."""
    eng = _engine(llama, num_blocks=2, block_size=32, compile_decode=True)
    monkeypatch.setattr(Engine, "pool_tokens", property(lambda self: self.blocks.num_blocks * 32))
    rid = eng.add_request(list(range(1, 46)), max_tokens=2)
    stuck = (rf"request {rid} \(45 tokens, max_tokens=2\) cannot be admitted with nothing running: 1 free and 0 "
             r"cached blocks of 2 \(1 reserved")
    with pytest.raises(CacheExhaustedError, match=stuck):
        for _ in range(3):
            eng.step()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": []}, "prompt has no tokens"),
        ({"prompt": ""}, "prompt=''"),
        ({"prompt": [1, 999]}, r"prompt token id 999 is out of range \(allowed: 0..255\)"),
        ({"prompt": [1], "max_tokens": 0}, r"max_tokens=0 \(allowed: an int >= 1\)"),
        ({"prompt": [1], "sampling": SamplingParams(temperature=-1)}, "temperature=-1"),
        ({"prompt": [1], "sampling": SamplingParams(top_p=0)}, r"top_p=0 \(allowed: a number in \[1e-30, 1\]"),
        # 1e-46 is 0 in float32: the request sampled from the whole vocabulary (garbage text, no error)
        ({"prompt": [1], "sampling": SamplingParams(top_p=1e-46)}, r"top_p=1e-46 \(allowed: a number in \[1e-30"),
        # a lone surrogate (argv bytes that were not UTF-8): the tokenizer raised a TypeError naming nothing
        ({"prompt": "caf\udce9"}, r"prompt='caf\\udce9': character 3 \('\\udce9'\) is no Unicode text"),
        ({"prompt": [1], "stop": ["\udce9"]}, r"allowed: non-empty strings of Unicode text"),
        ({"prompt": [1], "sampling": SamplingParams(seed=-3)}, "seed=-3"),
        ({"prompt": [1], "stop": [""]}, "stop="),
        ({"prompt": [1], "stop": 123}, r"stop=123 \(allowed: a non-empty string, an iterable of them, or None\)"),
        ({"prompt": [1], "sampling": {"temperature": 0.5}},
         r"sampling=\{'temperature': 0.5\} \(allowed: a SamplingParams"),
        ({"prompt": [1, 2.5]}, r"prompt holds 2.5 \(allowed: a text, or a list or 1-D array of int token ids\)"),
        ({"prompt": [True, 2]}, r"prompt holds True"),  # never rounded, never a 1
        ({"prompt": mx.array([1.0, 2.0])}, "prompt holds 1.0"),
        # bytes read as their byte values, a set or a dict's keys in no stated order, a 2-D array row by row
        ({"prompt": b"ab"}, r"prompt=b'ab' \(allowed: a text, or a list"),
        ({"prompt": {3, 1, 2}}, r"prompt=\{1, 2, 3\} \(allowed"),
        ({"prompt": {1: "a"}}, r"prompt=\{1: 'a'\} \(allowed"),
        ({"prompt": iter([1, 2])}, r"prompt=<list_iterator"),
        ({"prompt": mx.array([[1, 2]])}, r"prompt has shape \(1, 2\)"),
        # logit_bias: an id past the vocabulary crashed the process (mlx-lm's processor indexes with it)
        ({"prompt": [1], "sampling": SamplingParams(logit_bias={256: 5.0})},
         r"logit_bias token id 256 is out of range \(allowed: 0..255\)"),
        ({"prompt": [1], "sampling": SamplingParams(logit_bias={-1: 5.0})}, r"logit_bias entry -1: 5.0"),
        ({"prompt": [1], "sampling": SamplingParams(logit_bias={1: float("nan")})}, r"logit_bias entry 1: nan"),
        ({"prompt": [1], "sampling": SamplingParams(logit_bias=[1, 2])}, r"logit_bias=\[1, 2\] \(allowed: a mapping"),
        # 1 / temperature overflows float32 below ~2.9e-39: such a request sampled uniformly at random
        ({"prompt": [1], "sampling": SamplingParams(temperature=1e-40)}, r"temperature=1e-40 \(allowed: 0 \(greedy\)"),
        ({"prompt": [1], "sampling": SamplingParams(top_k=256)}, r"top_k=256 \(allowed: 0..255"),
        ({"prompt": [1], "sampling": SamplingParams(logits_processors=5)}, r"logits_processors=5 \(allowed"),
        ({"prompt": [1], "sampling": SamplingParams(logits_processors=[5])}, r"logits_processors=\[5\]"),
    ],
)
def test_bad_requests_are_named(llama, kwargs, message):
    eng = _engine(llama)
    prompt = kwargs.pop("prompt")
    with pytest.raises(InvalidInputError, match=message):
        eng.add_request(prompt, **kwargs)
    assert not eng.requests


@pytest.mark.parametrize("prompt", [
    [5, 6, 7], (5, 6, 7), range(5, 8), np.array([5, 6, 7], dtype=np.int64), mx.array([5, 6, 7]),
    list(mx.array([5, 6, 7])), [np.int32(5), 6, np.uint8(7)],
], ids=["list", "tuple", "range", "numpy", "mlx", "mlx-scalars", "numpy-scalars"])
def test_token_ids_in_any_ordered_integer_form_are_the_same_prompt(llama, prompt):
    eng = _engine(llama)
    rid = eng.add_request(prompt, max_tokens=1)
    assert eng.requests[rid].prompt_ids == [5, 6, 7]
    assert all(type(t) is int for t in eng.requests[rid].prompt_ids)


def test_a_refused_prompt_in_a_batch_queues_none_of_them(llama):
    """generate()/stream() check every prompt before queueing any: a refused batch used to leave its earlier
    prompts queued, and the next generate() ran them too (holding blocks afterwards)."""
    eng = _engine(llama)
    for bad in ([[1, 2, 3], []], [[1, 2, 3], [1, 999]]):
        with pytest.raises(InvalidInputError, match="prompt 1"):
            eng.generate(bad, max_tokens=2)
    with pytest.raises(InvalidInputError, match=r"sampling=0.5 \(allowed: a SamplingParams"):
        eng.generate([[1, 2]], [0.5])
    for prompts in (None, 5, b"ab", {1: 2}):
        with pytest.raises(InvalidInputError, match=r"prompts=.* \(allowed: a text, or a list"):
            eng.generate(prompts)
    with pytest.raises(InvalidInputError, match=r"request_ids=5 \(allowed: an iterable"):
        list(eng.stream_ids(5))
    with pytest.raises(InvalidInputError, match="prompt 1"):
        eng.stream([[1, 2, 3], []], max_tokens=2)  # at the call, not at the first read
    assert not eng.requests and not eng.has_unfinished()
    (out,) = eng.generate([[4, 5, 6]], max_tokens=2)
    assert len(out.token_ids) == 2 and eng.blocks.num_used == 0


def test_engine_config_refuses_non_bool_switches_and_bool_numbers(llama):
    """pipeline="false" turned pipelining on; enable_prefix_caching took any truthy text; True read as a
    fraction of 1.0; a dict config failed with an AttributeError."""
    for kw, message in (({"pipeline": "false"}, r"pipeline='false' \(allowed: True or False\)"),
                        ({"enable_prefix_caching": None}, "enable_prefix_caching=None"),
                        ({"kv_cache_fraction": True}, "kv_cache_fraction=True"),
                        ({"watermark": False}, "watermark=False")):
        with pytest.raises(InvalidInputError, match=message):
            EngineConfig(**kw).validate()
    with pytest.raises(InvalidInputError, match=r"config=\{'num_blocks': 8\} \(allowed: an EngineConfig"):
        Engine(llama, WordTokenizer(), {"num_blocks": 8})


def test_an_explicit_engine_config_takes_the_settings_for_the_fields_it_leaves_out(llama):
    # EngineConfig(max_num_seqs=32), as the README writes it, dropped every METAL_ATTN_* engine setting; the
    # fields of SETTINGS_FIELDS now default to their settings when the config is made, and a given field wins.
    env = {"max_num_batched_tokens": 64, "kv_cache_memory": 4_000_000, "kv_cache_fraction": 0.5,
           "prefix_caching": False, "compile_decode": True, "max_num_seqs": 7}
    with override_settings(**env):
        cfg = EngineConfig(max_num_seqs=32, num_blocks=8)
        eng = Engine(llama, WordTokenizer(), EngineConfig(num_blocks=8))
    assert (cfg.max_num_batched_tokens, cfg.kv_cache_memory, cfg.kv_cache_fraction, cfg.enable_prefix_caching,
            cfg.compile_decode, cfg.max_num_seqs) == (64, 4_000_000, 0.5, False, True, 32)
    assert eng.config.max_num_seqs == 7 and eng.compile_decode_reason == "compile_decode=True (set)"
    plain = EngineConfig()  # outside the block: the settings' own defaults
    assert (plain.max_num_batched_tokens, plain.max_num_seqs, plain.kv_cache_memory, plain.kv_cache_fraction,
            plain.enable_prefix_caching, plain.compile_decode) == (512, 64, None, 0.2, True, None)


def test_tokens_read_from_step_and_synchronize_are_the_whole_completion(llama):
    # synchronize() finished the steps in flight and dropped their outputs: a caller reading tokens from
    # step() lost the ones those steps sampled. A 20-token prompt over a budget of 8 also gives steps that
    # return [] while work remains.
    eng = _engine(llama, max_num_batched_tokens=8)
    rid = eng.add_request(list(range(3, 23)), max_tokens=6)
    seen, empty_while_busy = [], 0
    while len(seen) < 2:
        got = eng.step()
        empty_while_busy += not got and eng.has_unfinished()
        seen += [t for o in got for t in o.new_token_ids]
    assert eng.in_flight  # pipelined: the next step sampled on the device, not yet read
    synced = [t for o in eng.synchronize() for t in o.new_token_ids]
    assert synced and not eng.in_flight
    seen += synced
    while eng.has_unfinished():
        seen += [t for o in eng.step() for t in o.new_token_ids]
    assert empty_while_busy
    assert seen == list(eng.completion(rid).token_ids) and len(seen) == 6


def test_token_ids_may_be_numpy_or_mlx_integers(llama):
    eng = _engine(llama)
    ids = [eng.add_request(p, max_tokens=1) for p in ([5, 6, 7], np.array([5, 6, 7]), mx.array([5, 6, 7]))]
    assert [eng.requests[i].prompt_ids for i in ids] == [[5, 6, 7]] * 3
    assert all(type(t) is int for i in ids for t in eng.requests[i].prompt_ids)


def test_abort_unknown_id_and_running_request(llama):
    eng = _engine(llama)
    with pytest.raises(InvalidInputError, match="request_id=17 is unknown"):
        eng.abort(17)
    a = eng.add_request([1, 2, 3], max_tokens=50)
    for not_an_id in (True, float(a)):  # equal to the id as dict keys: abort(True) aborted request 1
        with pytest.raises(InvalidInputError, match=f"request_id={not_an_id!r} is unknown"):
            eng.abort(not_an_id)
    b = eng.add_request([4, 5, 6], max_tokens=5)
    eng.step()
    eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    assert eng.completion(a).finish_reason == "abort"
    assert eng.completion(b).finish_reason in ("length", "stop")
    assert eng.blocks.num_used == 0
    eng.blocks.check_invariants()


def test_a_stream_ends_an_aborted_request_with_a_final_output_at_once(llama):
    """Aborting a streamed request gives the stream a last output (finished, "abort", no tokens), and
    the stream stops there: it does not go on stepping the engine for the other requests."""
    eng = _engine(llama)
    ids = [eng.add_request([7 + i] * (9 + 5 * i), max_tokens=40) for i in range(3)]
    waiting = eng.add_request([3] * 12, max_tokens=40)
    outs = []
    for out in eng.stream_ids([ids[0], waiting]):
        outs.append(out)
        if len(outs) == 3:  # the consumer aborts between two outputs: a running and a queued request
            eng.abort(ids[0])
            eng.abort(waiting)
    finals = [o for o in outs if o.finished]
    assert sorted((o.request_id, o.finish_reason) for o in finals) == [(ids[0], "abort"), (waiting, "abort")]
    assert outs[-2:] == finals  # nothing after the aborts: the stream stopped stepping
    for rid in (ids[0], waiting):  # a request's outputs add up to its completion
        assert [t for o in outs if o.request_id == rid for t in o.new_token_ids] == eng.completion(rid).token_ids
    others = [eng.requests[i] for i in ids[1:]]
    assert all(not r.finished and len(r.output_ids) < 10 for r in others), [len(r.output_ids) for r in others]
    # finished before the stream starts: one final output with everything it generated
    (late,) = eng.stream_ids([ids[0]])
    assert late.finished and late.new_token_ids == tuple(eng.completion(ids[0]).token_ids)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_used == 0


def test_a_failing_sampler_ends_only_its_request(llama, workload):
    prompts, n_tokens, refs = workload

    def boom(tokens, logits):
        raise RuntimeError("processor exploded")

    eng = _engine(llama)
    bad = eng.add_request([1, 2, 3], SamplingParams(logits_processors=(boom,)), max_tokens=8)
    good = [eng.add_request(p, max_tokens=n) for p, n in zip(prompts[:4], n_tokens[:4])]
    while eng.has_unfinished():
        eng.step()
    c = eng.completion(bad)
    assert c.finish_reason == "error" and "processor exploded" in c.error
    for rid, ref in zip(good, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"neighbour {rid}")
    assert eng.blocks.num_used == 0


def test_an_interrupt_while_waiting_for_a_step_loses_no_token(llama, monkeypatch):
    """Ctrl-C while a step's tokens came back used to drop that step (its token lost, the request's
    pending count never back to zero) and the engine then stepped forever."""
    from metal_attn.engine.runner import InFlight

    ref = reference_greedy(llama, [1, 2, 3], 8, EOS)
    eng = _engine(llama)
    real, calls = InFlight.tokens, []
    histories: list[int] = []

    def record(tokens, logits):  # what a logits processor is shown: every token before the one it samples
        histories.append(tokens.size)
        return logits

    def flaky(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(InFlight, "tokens", flaky)
    rid = eng.add_request([1, 2, 3], SamplingParams(logits_processors=[record]), max_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        while eng.has_unfinished():
            eng.step()
    depth = []
    for _ in range(40):
        if not eng.has_unfinished():
            break
        eng.step()
        depth.append(len(eng.in_flight))
    assert not eng.has_unfinished() and max(depth) <= 2
    assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, "after an interrupt")
    assert histories == list(range(3, 11))  # a third step in flight ran a token ahead of the history
    assert eng.blocks.num_used == 0


def test_releasing_a_request_its_stream_still_reads_is_named(llama):
    eng = _engine(llama)
    a, b = eng.add_request([1, 2, 3], max_tokens=8), eng.add_request([4, 5, 6], max_tokens=8)
    stream = eng.stream_ids([a, b])
    next(stream)
    eng.abort(b)
    eng.release(b)
    with pytest.raises(InvalidInputError, match=f"request {b} was released while streamed"):
        list(stream)


def test_a_step_that_fails_on_the_device_ends_its_requests_and_drops_what_it_cached(llama, monkeypatch):
    from metal_attn.engine.runner import InFlight

    eng = _engine(llama)
    prompt = list(range(1, 40))
    first = eng.add_request(prompt, max_tokens=6)
    real = InFlight.tokens
    monkeypatch.setattr(InFlight, "tokens", lambda self: (_ for _ in ()).throw(RuntimeError("device lost")))
    outs = eng.step()
    monkeypatch.setattr(InFlight, "tokens", real)
    assert [(o.request_id, o.finish_reason) for o in outs] == [(first, "error")]
    assert "the step failed on the device: RuntimeError: device lost" in eng.completion(first).error
    assert not eng.has_unfinished() and eng.blocks.num_used == 0 and eng.blocks.num_cached == 0
    eng.blocks.check_invariants()
    again = eng.generate([prompt], max_tokens=6)[0]  # recomputed, not served from what the failed step wrote
    assert again.stats.cached_prompt_tokens == 0
    assert_same_greedy(again.token_ids, reference_greedy(llama, prompt, 6, EOS), TOL, "after a device failure")


@pytest.mark.parametrize("processor", [
    lambda tokens, logits: mx.concatenate([logits, logits]),  # two rows
    lambda tokens, logits: logits[:, :10],  # another vocabulary
    lambda tokens, logits: None,
], ids=["two-rows", "narrower", "none"])
def test_a_processor_returning_other_logits_ends_only_its_request(llama, processor):
    """One returning two rows raised out of every later step: the request stayed running, and every
    other request after it failed with the same reshape error."""
    eng = _engine(llama)
    bad, good = eng.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(logits_processors=[processor]), None],
                             max_tokens=4)
    assert bad.finish_reason == "error" and "logits of the shape it was given, (1, 256)" in bad.error
    assert_same_greedy(good.token_ids, reference_greedy(llama, [4, 5, 6], 4, EOS), TOL, "neighbour")
    assert eng.generate([[7, 8, 9]], max_tokens=3)[0].finish_reason in ("length", "stop")
    assert eng.blocks.num_used == 0 and not eng.has_unfinished()


def test_closing_a_stream_early_aborts_its_requests(llama):
    eng = _engine(llama)
    for i, _ in enumerate(eng.stream([[1, 2, 3], [4, 5]], max_tokens=20)):
        if i == 2:
            break
    assert sorted(r.finish_reason.value for r in eng.requests.values()) == ["abort", "abort"]
    assert eng.blocks.num_used == 0  # their pages are back at once
    assert eng.step() == [] and not eng.has_unfinished()  # the step still in flight drops their tokens


def test_streamed_text_never_shows_what_a_stop_string_cuts(llama):
    """The text of a stop string's first tokens was streamed, then cut from the final text."""
    base = _engine(llama).generate([[1, 2, 3]], max_tokens=8)[0]
    text = base.text
    for stop in (text[4:12], text[2:9], text[5:6], text[3:] + "zz", "<" + text[1:5]):
        eng = _engine(llama)
        outs = list(eng.stream([[1, 2, 3]], max_tokens=8, stop=stop))
        final = eng.completion(outs[-1].request_id)
        assert "".join(o.new_text for o in outs) == final.text, stop
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids


def test_every_stream_sees_every_token_of_its_requests(llama):
    """A generate() inside a stream's loop, or a second stream, ran steps whose outputs the first stream
    never saw."""
    eng = _engine(llama)
    outs = []
    for i, o in enumerate(eng.stream([[1, 2, 3]], max_tokens=6)):
        outs.append(o)
        if i == 0:
            eng.generate([[9, 9, 9]], max_tokens=3)
    final = eng.completion(outs[-1].request_id)
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids and len(final.token_ids) == 6
    assert "".join(o.new_text for o in outs) == final.text
    a, b = eng.stream([[1, 2, 3]], max_tokens=6), eng.stream([[4, 5, 6]], max_tokens=6)
    seen: dict[int, list[int]] = {}
    for x, y in zip(a, b):  # interleaved: each runs steps the other's requests take part in
        for o in (x, y):
            seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    for o in list(a) + list(b):
        seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {rid: eng.completion(rid).token_ids for rid in seen} == seen


def test_a_stream_whose_requests_finished_elsewhere_still_gives_their_final_outputs(llama):
    """A stream ended as soon as nothing was left to run, without reading what had finished its requests:
    steps run by another stream or by step(), or the consumer's abort (a helper's stateful fuzz)."""
    def check(outs, eng):
        c = eng.completion(outs[0].request_id)
        assert outs[-1].finished and outs[-1].finish_reason == c.finish_reason
        assert [t for o in outs for t in o.new_token_ids] == c.token_ids

    eng = _engine(llama)
    a, b = eng.stream([[1, 2, 3]], max_tokens=8), eng.stream([[4, 5, 6]], max_tokens=4)
    outs = [next(b)]
    list(a)  # runs b's request to its end too
    check(outs + list(b), eng)
    eng = _engine(llama)
    rid = eng.add_request([1, 2, 3], max_tokens=8)
    stream = eng.stream_ids([rid])
    outs = [next(stream)]
    while eng.has_unfinished():
        eng.step()
    check(outs + list(stream), eng)
    eng, outs = _engine(llama), []
    for out in eng.stream([[1, 2, 3]], max_tokens=8):
        outs.append(out)
        if len(outs) == 1:
            eng.abort(out.request_id)
    check(outs, eng)


def test_a_one_pass_stop_iterable_applies_to_every_prompt(llama):
    base = _engine(llama).generate([[1, 2, 3]], max_tokens=8)[0]
    stop = WordTokenizer().decode(base.token_ids[1:2])
    outs = _engine(llama).generate([[1, 2, 3], [1, 2, 3]], max_tokens=8, stop=(s for s in [stop]))
    assert [c.finish_reason for c in outs] == ["stop", "stop"]


def test_generate_releases_its_requests_and_release_forgets_one(llama):
    eng = _engine(llama)
    eng.generate([[1, 2, 3]] * 3, max_tokens=2)
    assert not eng.requests
    rid = eng.add_request([4, 5], max_tokens=2)
    while eng.has_unfinished():
        eng.step()
    assert eng.release(rid).token_ids and rid not in eng.requests
    with pytest.raises(InvalidInputError, match=f"request_id={rid} is unknown"):
        eng.completion(rid)


def test_a_tokenizer_without_the_wrapper_api_is_named(llama):
    with pytest.raises(InvalidInputError, match=r"tokenizer=object has no encode or detokenizer .*TokenizerWrapper"):
        Engine(llama, object(), EngineConfig(num_blocks=16))


# -- properties (hypothesis) ----------------------------------------------------------------------

_actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(actions=_actions, num_blocks=st.integers(6, 40), budget=st.integers(8, 96), cap=st.integers(1, 8),
       block_size=st.sampled_from([8, 16]))
def test_random_workloads_keep_the_invariants(llama, actions, num_blocks, budget, cap, block_size):
    eng = _engine(llama, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                  max_num_seqs=cap)
    prefixes = [[11] * 40, [12] * 24, [13] * 8, [14] * 56]
    added: list[int] = []
    steps = 0

    def checked_step():
        nonlocal steps
        eng.step()
        steps += 1
        eng.blocks.check_invariants()
        assert len(eng.scheduler.running) <= cap
        for flight in eng.in_flight:
            out = flight.output
            assert out.num_tokens <= budget
            ones = [r.num_tokens == 1 for r in out.rows]
            assert ones == sorted(ones, reverse=True), "decode rows must come first"
            for row in out.rows:  # no block is written while shared
                if row.request.id not in eng.blocks:
                    continue  # finished meanwhile: its pages went back
                table = eng.blocks.table(row.request.id)
                for pos in range(row.start, row.start + row.num_tokens):
                    b = table[pos // block_size]
                    holders = eng.blocks.allocator.refcount(b) - (1 if eng.blocks.is_cached(b) else 0)
                    assert holders == 1, f"block {b} written at position {pos} while held by {holders}"

    for act in actions:
        if act[0] == "add":
            _, n, m, pre = act
            prompt = (prefixes[pre] + list(range(1, n)))[: max(1, n)]
            if len(prompt) + m > num_blocks * block_size:
                with pytest.raises(InvalidInputError, match="can never fit"):
                    eng.add_request(prompt, max_tokens=m)
                continue
            added.append(eng.add_request(prompt, max_tokens=m))
        elif act[0] == "abort":
            if added:
                eng.abort(added[act[1] % len(added)])
        else:
            for _ in range(act[1]):
                checked_step()
    # Every request finishes within a bound (no starvation): at most one step per token plus restarts,
    # counted from the last action.
    bound = steps + sum(len(eng.requests[r].prompt_ids) + eng.requests[r].max_tokens for r in added) * 3 + 10
    while eng.has_unfinished():
        checked_step()
        assert steps <= bound, f"not finished after {steps} steps (bound {bound})"
    for r in added:
        req = eng.requests[r]
        assert req.status is RequestStatus.FINISHED
        if req.finish_reason.value != "abort":
            assert 1 <= len(req.output_ids) <= req.max_tokens
    assert eng.blocks.num_used == 0  # every block free or cached, none referenced by a request
    assert eng.blocks.allocator.num_free + eng.blocks.num_evictable == num_blocks


# -- block manager ---------------------------------------------------------------------------------


def test_block_hash_chains_through_the_parent():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4]) and a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6])


def test_block_manager_prefix_cache_lru_eviction():
    from metal_attn.cache import BlockAllocator

    bm = BlockManager(BlockAllocator(6), block_size=4)
    ids = list(range(1, 14))  # 13 tokens: 3 full blocks and a partial one
    assert bm.admit("a", ids, 13) == 0
    bm.register("a", ids, 13)
    assert bm.num_cached == 3
    bm.free("a")
    assert bm.num_evictable == 3 and bm.num_used == 0
    # A request with the same 12 leading tokens gets all 3 cached blocks.
    assert bm.admit("b", [*ids[:12], 99], 13) == 12
    assert bm.num_evictable == 0
    bm.free("b")
    # A fully cached prompt still computes its last token: 8 of its 8 tokens match 1 block only.
    assert bm.admit("c", ids[:8], 8) == 4
    bm.free("c")
    # A pool that needs pages evicts least recently used cached blocks first.
    assert bm.admit("d", [50] * 24, 24) == 0
    assert bm.evictions == 3 and bm.num_cached == 0
    bm.check_invariants()


def test_scheduler_orders_decode_rows_first(llama):
    eng = _engine(llama)
    a = eng.add_request([1] * 10, max_tokens=5)
    eng.step()  # a prefilled and sampling
    eng.add_request([2] * 30, max_tokens=5)
    out = eng.scheduler.schedule()
    assert [r.num_tokens for r in out.rows] == [1, 30]
    assert out.rows[0].request.id == a
    mx.synchronize()


def test_prefix_blocks_are_shared_from_the_step_after_they_are_written(llama):
    """Requests admitted in the same step compute their prefix each (a block is never shared while it
    is being written); a request admitted one step later reuses it."""
    prefix = list(range(1, 49))  # 3 full blocks
    prompts = [[*prefix, 200 + i] for i in range(4)]
    refs = [reference_greedy(llama, p, 6, EOS) for p in prompts]
    eng = _engine(llama)
    ids = [eng.add_request(p, max_tokens=6) for p in prompts[:2]]
    eng.step()
    ids += [eng.add_request(p, max_tokens=6) for p in prompts[2:]]
    while eng.has_unfinished():
        eng.step()
    assert [eng.requests[i].num_cached_tokens for i in ids] == [0, 0, 48, 48]
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"prefix req {rid}")


def test_steady_decode_feeds_the_samples_back_as_they_are(llama, workload, monkeypatch):
    """Once every row of a step is one token, each the previous step's sample in that step's order,
    the step's input is the previous step's sampled array itself (no host ids, no device gather or
    scatter); any other step builds its ids. The tokens stay stock mlx-lm's either way."""
    from metal_attn.engine.runner import StepRunner

    prompts, n_tokens, refs = workload
    seen: list[bool] = []
    real = StepRunner._input_tokens

    def watch(rows, previous):
        got = real(rows, previous)
        seen.append(previous is not None and got is previous.sampled)
        return got

    monkeypatch.setattr(StepRunner, "_input_tokens", staticmethod(watch))
    eng = _engine(llama, max_num_seqs=4)
    ids = [eng.add_request(p, max_tokens=n) for p, n in zip(prompts[:3], n_tokens[:3])]
    while eng.has_unfinished():
        eng.step()
    for rid, ref in zip(ids, refs[:3]):
        assert_same_greedy(eng.completion(rid).token_ids, ref, TOL, f"steady decode req {rid}")
    assert seen[0] is False  # the prefill step
    assert any(seen), "steady decode steps should reuse the samples"
    assert not all(seen)


# -- statistics ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [16, 32, 512])
def test_computed_token_counts_add_up_to_the_rows_the_steps_ran(llama, budget):
    """Every position a step computes is counted once per computation: a prompt position in
    ``prompt_tokens``, a generated token computed again after a preemption in ``recomputed_tokens``,
    and the rest are the decode rows, one per generated token but the last. Before, a recompute chunk
    counted as prompt only when it began inside the prompt, so the count moved with the budget."""
    eng = _engine(llama, num_blocks=10, max_num_batched_tokens=budget)
    rows: list[tuple[int, int]] = []
    schedule = eng.scheduler.schedule

    def logged():
        out = schedule()
        rows.extend((r.start, r.num_tokens) for r in out.rows)
        return out

    eng.scheduler.schedule = logged
    prompts = [[(9 + 7 * i + j) % 250 + 1 for j in range(20)] for i in range(4)]
    done = eng.generate(prompts, max_tokens=60)
    s = eng.stats.as_dict(eng.blocks)
    assert s["preemptions"] > 0, "the small pool must force preemptions"
    decode = sum(len(c.token_ids) - 1 for c in done)  # a request's last token is sampled, never computed
    assert sum(n for _, n in rows) == s["prompt_tokens"] + s["recomputed_tokens"] + decode
    assert s["recomputed_tokens"] > 0
    assert s["prompt_tokens"] >= sum(len(p) for p in prompts) - sum(c.stats.cached_prompt_tokens for c in done)
    assert all(c.stats.cached_prompt_tokens <= c.stats.prompt_tokens for c in done)


def test_without_preemptions_nothing_is_recomputed_and_cache_hits_are_not_prompt_work(llama):
    eng = _engine(llama)
    shared = [(5 + j) % 250 + 1 for j in range(48)]
    first = eng.generate([[*shared, 7, 8]], max_tokens=4)
    second = eng.generate([[*shared, 9, 10, 11]], max_tokens=4)
    s = eng.stats.as_dict(eng.blocks)
    assert s["preemptions"] == 0 and s["recomputed_tokens"] == 0
    assert second[0].stats.cached_prompt_tokens == 48
    assert s["prompt_tokens"] == 50 + 3
    assert first[0].stats.cached_prompt_tokens == 0


def test_a_prefix_loses_its_tail_before_its_head_when_the_pool_evicts(llama):
    """A finished request's blocks become evictable last block first: one eviction used to take the
    prefix's first block, and every later cached block became unreachable (a repeat got no hit)."""
    eng = _engine(llama, num_blocks=8)
    prompt = [(7 + j) % 250 + 1 for j in range(65)]  # 4 full blocks and one token
    eng.generate([prompt], max_tokens=1)
    eng.generate([[(100 + j) % 250 + 1 for j in range(79)]], max_tokens=1)  # 5 pages: evicts one cached
    assert eng.blocks.evictions == 1
    (again,) = eng.generate([prompt], max_tokens=1)
    assert again.stats.cached_prompt_tokens == 48  # the first 3 blocks; was 0


def test_the_engine_keeps_no_per_request_or_unbounded_per_step_history(llama, monkeypatch):
    """A long-running engine: the means come from sums (no list per request), and the step history a
    benchmark reads is bounded (it grew by one entry per step)."""
    from metal_attn.engine import stats as stats_mod

    monkeypatch.setattr(stats_mod, "HISTORY", 5)
    eng = _engine(llama)
    done = eng.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9]], max_tokens=6)
    s = eng.stats.as_dict()
    assert s["mean_ttft_s"] == pytest.approx(np.mean([c.stats.time_to_first_token for c in done]))
    itls = [c.stats.mean_inter_token_latency for c in done if c.stats.mean_inter_token_latency is not None]
    assert s["mean_itl_s"] == pytest.approx(np.mean(itls))
    assert eng.stats.steps > 5 and len(eng.stats.completions) == 5
    assert not [k for k, v in vars(eng.stats).items() if isinstance(v, list)]



# -- the scheduler's policies, one by one (tokens do not depend on them, so token checks cannot see them) --------


def _step_engine(llama, **cfg) -> Engine:
    return _engine(llama, **({"pipeline": False, "compile_decode": False} | cfg))


def test_a_decode_row_goes_before_an_older_requests_prefill_chunk(llama):
    """A prompt still prefilling (admitted first) and a one-token row admitted after it: the row goes first."""
    eng = _step_engine(llama, max_num_batched_tokens=32)
    eng.add_request([3] * 50, max_tokens=4)
    eng.add_request([5], max_tokens=4)
    eng.step()  # the first 32 tokens of the long prompt fill the budget
    rows = eng.scheduler.schedule().rows
    assert [r.num_tokens for r in rows] == [1, 18]
    mx.synchronize()


def test_the_token_budget_holds_exactly(llama):
    eng = _step_engine(llama, max_num_batched_tokens=16)
    eng.add_request(list(range(1, 41)), max_tokens=2)
    assert eng.scheduler.schedule().num_tokens == 16


@pytest.mark.parametrize(("order", "victim"), [("newest", "c"), ("largest", "b")])
def test_preemption_picks_its_victim_by_the_configured_order(llama, order, victim):
    """a (1 page), b (2 pages), c (1 page) admitted in that order; one spare page. On the first decode step
    a takes the spare and b needs a page: `newest` gives back c's, `largest` b's own (it holds the most)."""
    eng = _step_engine(llama, num_blocks=5, preemption_order=order, watermark=0.0)
    ids = {"a": eng.add_request([7] * 16, max_tokens=3), "b": eng.add_request([8] * 32, max_tokens=3),
           "c": eng.add_request([9] * 16, max_tokens=3)}
    preempted = []
    schedule = eng.scheduler.schedule

    def logged():
        out = schedule()
        preempted.extend(r.id for r in out.preempted)
        return out

    eng.scheduler.schedule = logged
    eng.step()  # all three prefilled: 4 pages
    eng.step()  # the first decode step
    assert preempted[:1] == [ids[victim]]
    while eng.has_unfinished():
        eng.step()
    assert all(eng.completion(i).finish_reason in ("length", "stop") for i in ids.values())


@pytest.mark.parametrize(("watermark", "admitted"), [(0.25, False), (0.0, True)])
def test_admission_leaves_the_watermark_free_while_others_run(llama, watermark, admitted):
    """16 pages, a quarter of them the watermark: with a request running on 9, one needing 5 more waits."""
    eng = _step_engine(llama, num_blocks=16, watermark=watermark)
    eng.add_request([4] * 128, max_tokens=8)  # 8 pages, 9 once its first token is computed
    eng.step()
    b = eng.add_request([6] * 80, max_tokens=1)  # 5 pages: 7 are free, 4 of them the watermark
    rows = eng.scheduler.schedule().rows
    assert (b in [r.request.id for r in rows]) is admitted
    mx.synchronize()


def test_a_cached_block_is_found_only_through_the_blocks_before_it(llama):
    """[A, B, x], [C, D, y], then [A, D, z]: D after A is not the D after C (its K/V depend on what came before),
    so only A is served from the cache; a hash of a block's own tokens would have served D too."""
    bs = 16
    a, b, c, d = ([t] * bs for t in (11, 12, 13, 14))
    eng = _engine(llama)
    eng.generate([[*a, *b, 21], [*c, *d, 22]], max_tokens=2)
    (z,) = eng.generate([[*a, *d, 23]], max_tokens=6)
    assert z.stats.cached_prompt_tokens == bs
    assert_same_greedy(z.token_ids, reference_greedy(llama, [*a, *d, 23], 6, EOS), TOL, "A D z")


def test_a_tiny_top_p_keeps_only_the_most_likely_token(llama):
    """top_p=0.01 at a high temperature samples the greedy tokens (the other candidates are cut first)."""
    prompt = [5, 6, 7, 8]
    greedy = _engine(llama).generate([prompt], max_tokens=8)[0].token_ids
    (hot,) = _engine(llama).generate([prompt], SamplingParams(temperature=5.0, top_p=0.01, seed=3), max_tokens=8)
    (wide,) = _engine(llama).generate([prompt], SamplingParams(temperature=5.0, top_p=1.0, seed=3), max_tokens=8)
    assert hot.token_ids == greedy
    assert wide.token_ids != greedy  # the temperature does flatten the choice: the test can tell


def test_a_length_finish_has_exactly_max_tokens(llama):
    eng = _engine(llama)
    outs = eng.generate([[1, 2, 3], [4, 5], [6]], [SamplingParams(logit_bias={t: -1e9 for t in EOS})] * 3,
                        max_tokens=7)
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 7)] * 3
