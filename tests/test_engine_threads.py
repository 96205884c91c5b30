"""One engine used from several threads, and engines on several threads sharing one model.

A server steps its engine on one thread while request threads add, abort and release. Before the
engine's lock, an abort landing inside a step lost that step (`KeyError` from the block manager) and
left another request pending forever with its pages; two engines sharing a model with compiled
decode steps read the tracers a trace had put in the model's weights. Tokens are checked against
stock mlx-lm's (`metal_attn.testing.greedy.reference_greedy`).
"""

from __future__ import annotations

import random
import threading

import pytest

from metal_attn.engine import Engine, EngineConfig, SamplingParams
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

EOS = WordTokenizer.eos_token_ids
TOL = 1e-4


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _run(threads: list[threading.Thread], timeout: float = 120.0) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{t.name} did not finish in {timeout:.0f} s (a deadlock?)"


def test_an_abort_from_another_thread_waits_for_the_step_it_lands_in(llama):
    eng = Engine(llama, WordTokenizer(), EngineConfig(num_blocks=64, block_size=16, compile_decode=False))
    a = eng.add_request([5, 6, 7, 8, 9], max_tokens=8)
    b = eng.add_request([10, 11, 12], max_tokens=8)
    register, aborter = eng.blocks.register, []

    def register_then_abort(req_id, *args):  # the step is between its launch and its bookkeeping
        if req_id == a and not aborter:
            aborter.append(threading.Thread(target=eng.abort, args=(b,), name="client"))
            aborter[0].start()
            aborter[0].join(0.2)  # it waits for the step: the lock is held
            assert aborter[0].is_alive()
        return register(req_id, *args)

    eng.blocks.register = register_then_abort
    eng.step()
    eng.blocks.register = register
    aborter[0].join(10)
    while eng.has_unfinished():
        eng.step()
    assert eng.completion(b).finish_reason == "abort"
    assert_same_greedy(eng.completion(a).token_ids, reference_greedy(llama, [5, 6, 7, 8, 9], 8, EOS), TOL, "a")
    assert eng.blocks.num_used == 0


def test_a_server_thread_steps_while_client_threads_add_abort_and_release(llama):
    eng = Engine(llama, WordTokenizer(), EngineConfig(num_blocks=48, block_size=16, max_num_seqs=6))
    stop, errors, done = threading.Event(), [], {}
    prompts = {c: [[(7 * c + 3 * r + j) % 250 + 1 for j in range(3 + (c + r) % 9)] for r in range(6)]
               for c in range(4)}

    def server():
        while not stop.is_set():
            try:
                if not eng.step():
                    stop.wait(0.001)
            except Exception as exc:  # pragma: no cover - the failure the test looks for
                errors.append(f"step: {type(exc).__name__}: {exc}")
                return

    def client(c: int):
        rng = random.Random(c)
        try:
            for r, prompt in enumerate(prompts[c]):
                sampled = r % 3 == 2
                rid = eng.add_request(prompt, SamplingParams(temperature=0.8, seed=c) if sampled else None,
                                      max_tokens=6)
                if rng.random() < 0.3:
                    eng.abort(rid)
                while not eng.requests[rid].finished:
                    stop.wait(0.001)
                done[(c, r)] = (sampled, eng.release(rid))
        except Exception as exc:  # pragma: no cover
            errors.append(f"client {c}: {type(exc).__name__}: {exc}")

    clients = [threading.Thread(target=client, args=(c,), name=f"client {c}") for c in range(4)]
    serving = threading.Thread(target=server, name="server")
    serving.start()
    _run(clients)
    stop.set()
    serving.join(30)
    assert not errors, errors
    assert len(done) == 24
    for (c, r), (sampled, out) in done.items():
        assert out.finish_reason in ("length", "stop", "abort"), (c, r, out)
        if not sampled:
            ref = reference_greedy(llama, prompts[c][r], 6, EOS)
            if out.finish_reason == "abort":  # cut anywhere
                assert out.token_ids == ref.tokens[:len(out.token_ids)], (c, r, out.token_ids, ref.tokens)
            else:
                assert_same_greedy(out.token_ids, ref, TOL, f"client {c} request {r}")
    assert not eng.has_unfinished() and eng.blocks.num_used == 0
    eng.blocks.check_invariants()


def test_engines_on_several_threads_share_one_model_with_compiled_steps(llama):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = reference_greedy(llama, prompt, 6, EOS)
    errors, runs = [], []

    def worker(compiled: bool):
        try:
            for _ in range(10):  # a fresh engine each time: each traces its decode shapes again
                eng = Engine(llama, WordTokenizer(), EngineConfig(num_blocks=16, block_size=16,
                                                                  compile_decode=compiled))
                out = eng.generate([prompt, prompt[:4]], max_tokens=6)
                assert not out[0].error and not out[1].error, (out[0].error, out[1].error)
                assert_same_greedy(out[0].token_ids, ref, TOL, f"compiled={compiled}")
                runs.append(compiled)
        except Exception as exc:
            errors.append(f"compiled={compiled}: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    _run([threading.Thread(target=worker, args=(k,), name=f"engine {i}")
          for i, k in enumerate((True, True, True, False))], timeout=300)
    assert not errors, errors
    assert len(runs) == 40
    assert reference_greedy(llama, prompt, 6, EOS).tokens == ref.tokens  # the model's weights are its own again
