"""Compiled decode steps: `AttentionMetadata.decode_bounds` (host bounds, device lengths), the
providers allowed to run it, and `CompiledDecode` on the model adapter against the eager forward
and stock mlx-lm (the engine's own identity runs are in tests/test_engine.py)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn.cache import build_step_plan
from metal_attn.engine import Engine, EngineConfig
from metal_attn.errors import InvalidInputError, ProviderRefusedError
from metal_attn.metadata import AttentionMetadata
from metal_attn.mlx_lm.compiled import CompiledDecode, table_width
from metal_attn.mlx_lm.runner import PagedModel
from metal_attn.settings import override_settings
from metal_attn.testing import make_case
from metal_attn.testing.greedy import assert_same_greedy, reference_greedy
from metal_attn.testing.models import WordTokenizer, tiny_model

# Lengths at partition edges (512) and far below the bound, so the bound's launch has partitions
# some rows never reach.
LENS = [1, 17, 511, 512, 513, 1100]


def _bounds(case, width: int, block_size: int) -> AttentionMetadata:
    tables = np.zeros((len(case.seq_lens), width), dtype=np.int32)
    tables[:, : case.block_tables.shape[1]] = case.block_tables
    return AttentionMetadata.decode_bounds(mx.array(tables), mx.array(case.seq_lens), max_seq_len=width * block_size)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_classic_reads_the_lengths_on_the_device(dtype, sinks):
    """The same decode batch with its real metadata and with bounds only (2048 tokens per row):
    classic gives the same rows (the bound's launch has more partitions than the rows reach when
    it splits; BOUNDS_SPECS in the conformance suite hold both routes)."""
    case = make_case(q_lens=[1] * len(LENS), seq_lens=LENS, num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=dtype, sinks=sinks, seed=3)
    kw = case.kwargs()
    want = metal_attn.paged_attention(**kw)
    md = _bounds(case, 128, 16)
    for k in ("block_tables", "seq_lens", "cu_seqlens_q"):
        kw.pop(k)
    got = metal_attn.paged_attention(**kw, metadata=md)
    assert metal_attn.diagnostics.last_dispatch().provider == "classic"
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=1e-5 if dtype == "float32" else 1e-2, atol=1e-6 if dtype == "float32" else 1e-2)
    assert md.seq_lens_host == (2048,) * len(LENS) and md.q_lens_host == (1,) * len(LENS)


def test_bounds_metadata_refuses_what_it_cannot_honour():
    case = make_case(q_lens=[1, 1], seq_lens=[40, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    kw = {k: v for k, v in case.kwargs().items() if k not in ("block_tables", "seq_lens", "cu_seqlens_q")}
    md = _bounds(case, 4, 16)
    metal_attn.paged_attention(**kw, metadata=md)
    record = metal_attn.diagnostics.last_dispatch()
    assert record.provider == "classic" and record.request.lengths_are_bounds
    table = metal_attn.explain(record.request)  # automatic choice: only providers that read lengths on the device
    assert table.chosen.name == "classic"
    assert any("lengths_are_bounds" in r for row in table.rows if row.name == "reference" for r in row.reasons)
    with pytest.raises(ProviderRefusedError, match=r"lengths_are_bounds .*this provider reads per-sequence lengths "
                                                  r"on the host"):
        metal_attn.paged_attention(**kw, metadata=md, provider="reference")
    with pytest.raises(InvalidInputError, match=r"sliding_window=8 with decode_bounds metadata \(allowed: None\)"):
        metal_attn.paged_attention(**(kw | {"sliding_window": 8}), metadata=md)
    narrow = AttentionMetadata.decode_bounds(mx.array(case.block_tables[:, :3]), mx.array(case.seq_lens),
                                             max_seq_len=64)
    with pytest.raises(InvalidInputError, match=r"max_seq_len=64 needs 4 blocks of 16 but the table has 3 columns"):
        metal_attn.paged_attention(**kw, metadata=narrow)
    with pytest.raises(InvalidInputError, match=r"cannot be re-split into kernel blocks \(ratio 2\)"):
        md.split_blocks(2)
    with pytest.raises(InvalidInputError, match=r"padded_block_tables: decode_bounds metadata has no host copy"):
        md.padded_block_tables(8)
    with pytest.raises(InvalidInputError, match=r"seq_lens.shape=\(3,\) \(need \(2,\)"):
        AttentionMetadata.decode_bounds(mx.array(case.block_tables), mx.array([1, 2, 3]), max_seq_len=64)
    with pytest.raises(InvalidInputError, match=r"max_seq_len=0 \(allowed: an int in 1..2\^31-1\)"):
        AttentionMetadata.decode_bounds(mx.array(case.block_tables), mx.array(case.seq_lens), max_seq_len=0)


def test_table_widths_are_powers_of_two():
    assert [table_width(n) for n in (1, 2, 3, 4, 5, 63, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 128]
    with pytest.raises(ValueError, match="blocks=0"):
        table_width(0)


def _decode(pm, compiled, tables, lens, first, steps):
    """Greedy decode rows through ``compiled`` (or eagerly when None): the tokens and logits per step."""
    cur, lens, out = list(first), list(lens), []
    for _ in range(steps):
        plan = build_step_plan(list(range(len(lens))), lens, [1] * len(lens), tables, pm.kv.block_size)
        tok = mx.array(np.array(cur, dtype=np.int32))
        logits = compiled.run(plan, tok) if compiled is not None else pm.forward(plan, tok)
        assert logits is not None, compiled.disabled
        cur = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
        out.append((cur, np.array(logits)))
        lens = [n + 1 for n in lens]
    return out


def test_compiled_steps_replay_the_eager_forward_bit_for_bit():
    """Two sequences decoding 10 steps across a page edge: one trace per table width, the same logits."""
    pm = PagedModel(tiny_model("llama"), num_blocks=64)
    tables, lens = [[1, 2, 3], [5, 6, 7, 8, 9]], [30, 70]
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(1, 250, size=n) for n in lens]).astype(np.int32)
    logits = pm.forward(build_step_plan([0, 1], [0, 0], lens, tables, 16), mx.array(ids))
    first = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
    saved = [mx.array(a) for a in pm.kv.take_pools()]
    pm.kv.put_pools([mx.array(a) for a in saved])
    eager = _decode(pm, None, tables, lens, first, 10)
    pm.kv.put_pools([mx.array(a) for a in saved])
    compiled = CompiledDecode(pm)
    replayed = _decode(pm, compiled, tables, lens, first, 10)
    for (te, le), (tc, lc) in zip(eager, replayed):
        assert te == tc and np.array_equal(le, lc)
    assert compiled.steps == 10 and compiled.traces == 1  # the 5-column table pads to 8 throughout


def test_models_and_providers_it_refuses_stay_eager_and_correct():
    gemma = CompiledDecode(PagedModel(tiny_model("gemma3_text"), num_blocks=32))
    assert gemma.disabled and "sliding window" in gemma.disabled
    wide = CompiledDecode(PagedModel(tiny_model("llama"), num_blocks=8, block_size=64))
    assert wide.disabled == "page size 64 is not a kernel block size (8, 16, 32)"
    model = tiny_model("llama")
    prompt = [5, 9, 200, 31, 77, 12, 40]
    ref = reference_greedy(model, prompt, 10, WordTokenizer.eos_token_ids)
    with override_settings(provider="reference"):
        eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, compile_decode=True))
        out = eng.generate([prompt], max_tokens=10)[0].token_ids
    assert_same_greedy(out, ref, 1e-4, "compiled decode refused under the reference provider")
    compiled = eng.runner.compiled
    assert compiled.steps == 0 and compiled.disabled.startswith("ProviderRefusedError: the forced provider 'reference'")
    assert "lengths_are_bounds" in compiled.disabled


def test_a_new_dispatch_epoch_retraces_with_the_new_choice():
    """Replays run no Python: after a settings change the next decode step traces again, and a
    refusal (here: classic disabled, so nothing admits bounds metadata) is retried, not kept."""
    pm = PagedModel(tiny_model("llama"), num_blocks=32)
    compiled = CompiledDecode(pm)
    tables, lens = [[1, 2]], [10]
    ids = mx.array(np.arange(1, 11, dtype=np.int32))
    first = [int(mx.argmax(pm.forward(build_step_plan([0], [0], lens, tables, 16), ids), axis=-1).item())]
    _decode(pm, compiled, tables, lens, first, 2)
    assert compiled.traces == 1 and compiled.steps == 2
    with override_settings(disabled_providers=["classic"]):
        plan = build_step_plan([0], [12], [1], tables, 16)
        assert compiled.run(plan, mx.array([3], dtype=mx.int32)) is None
        assert compiled.traces == 2 and "NoProviderError" in compiled.disabled
        pm.forward(plan, mx.array([3], dtype=mx.int32))  # the eager step the engine runs instead (reference)
    _decode(pm, compiled, tables, [13], [3], 1)  # back to the first settings: retraced, compiled again
    assert compiled.disabled is None and compiled.traces == 3 and compiled.steps == 3


def test_steps_with_a_row_that_does_not_sample_run_eagerly():
    """A one-token prefill chunk cut at the budget is a q_len-1 row that does not sample: such a step
    must not go through the compiled forward, whose logits are every row's."""
    model = tiny_model("llama")
    prompts = [[7, 8, 9, 10, 11], [40, 41, 42, 43], [90, 91, 92], [5, 6]]
    refs = [reference_greedy(model, p, 6, WordTokenizer.eos_token_ids) for p in prompts]
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, compile_decode=True, max_num_batched_tokens=3))
    launches = []  # per step: (every row one token, every row samples, ran compiled)
    real = eng.runner.launch

    def launch(out, previous):
        before = eng.runner.compiled.steps
        flight = real(out, previous)
        launches.append((all(r.num_tokens == 1 for r in out.rows), all(r.samples for r in out.rows),
                         eng.runner.compiled.steps > before))
        return flight

    eng.runner.launch = launch
    ids = []
    for p in prompts:
        ids.append(eng.add_request(p, max_tokens=6))
        eng.step()
    while eng.has_unfinished():
        eng.step()
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, 1e-4, f"budget-3 compiled decode req {rid}")
    assert (True, False, False) in launches  # the case arises: one-token rows, one of them not sampling
    assert any(compiled for _, _, compiled in launches)
    assert all(samples for _, samples, compiled in launches if compiled)


def test_decode_bounds_wants_integer_arrays():
    with pytest.raises(InvalidInputError, match=r"block_tables: float32 \(1, 2\) \(allowed for decode_bounds: a "
                                                r"2-d integer mx.array\)"):
        AttentionMetadata.decode_bounds(mx.zeros((1, 2)), mx.array([3]), max_seq_len=32)
    with pytest.raises(InvalidInputError, match=r"seq_lens: list \(allowed for decode_bounds"):
        AttentionMetadata.decode_bounds(mx.zeros((1, 2), dtype=mx.int32), [3], max_seq_len=32)
    md = AttentionMetadata.decode_bounds(mx.zeros((1, 2), dtype=mx.int64), mx.array([3], dtype=mx.int16),
                                         max_seq_len=32)
    assert md.block_tables.dtype == mx.int32 and md.seq_lens.dtype == mx.int32


def test_the_setting_turns_it_on_or_off_and_unset_leaves_the_backend_default(monkeypatch):
    from metal_attn.settings import reload_settings

    try:
        for value, want in (("1", True), ("0", False)):
            monkeypatch.setenv("METAL_ATTN_COMPILE_DECODE", value)
            reload_settings()
            assert EngineConfig.from_settings().compile_decode is want
        monkeypatch.delenv("METAL_ATTN_COMPILE_DECODE")
        reload_settings()
        assert EngineConfig.from_settings().compile_decode is None
    finally:
        monkeypatch.delenv("METAL_ATTN_COMPILE_DECODE", raising=False)
        reload_settings()


def test_unset_means_the_backends_measured_default():
    from metal_attn.engine.config import COMPILE_DECODE_BY_BACKEND

    cfg = EngineConfig()
    assert cfg.compile_decode is None
    for backend, (on, why) in COMPILE_DECODE_BY_BACKEND.items():
        got, reason = cfg.resolve_compile_decode(backend)
        assert got is on and backend in reason and why in reason
    assert cfg.resolve_compile_decode("cuda")[0] and not cfg.resolve_compile_decode("cpu")[0]
    assert cfg.resolve_compile_decode("tpu") == (False, "compile_decode unset: off on tpu (no measured default "
                                                        "for backend 'tpu')")
    for value in (True, False):
        assert EngineConfig(compile_decode=value).resolve_compile_decode("cuda") == (value, f"compile_decode={value} "
                                                                                             "(set)")
    with pytest.raises(InvalidInputError, match=r"compile_decode='yes' \(allowed: True, False or None\)"):
        EngineConfig(compile_decode="yes").validate()


def test_an_engine_follows_its_backends_default_unless_told():
    from metal_attn.device import current_device
    from metal_attn.engine.config import COMPILE_DECODE_BY_BACKEND

    backend = current_device().backend
    on = COMPILE_DECODE_BY_BACKEND[backend][0]
    model = tiny_model("llama")
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, max_num_seqs=2))
    assert (eng.runner.compiled is not None) is on
    assert f"{'on' if on else 'off'} on {backend}" in eng.compile_decode_reason
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, max_num_seqs=2, compile_decode=True))
    assert eng.runner.compiled is not None and eng.compile_decode_reason == "compile_decode=True (set)"


@pytest.mark.parametrize("shrink_after", [0, 16])
def test_row_counts_are_padded_to_powers_of_two_through_a_reserved_scratch_page(shrink_after):
    """Requests finishing one after another shrink the batch 6, 5, 4, 3, 2, 1: with padding rows the
    engine traces once per power of two (8, 4, 2, 1) at one table width, or, by default, runs the
    smaller batches padded in the traced 8 (`compile_shrink_after`: they last fewer steps than
    that); their K/V lands on a page no request holds, and every request's tokens stay stock
    mlx-lm's."""
    from metal_attn.mlx_lm.compiled import row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 128]
    with pytest.raises(ValueError, match=r"rows=0 \(allowed: >= 1\)"):
        row_bucket(0)
    model = tiny_model("llama")
    prompts = [[3 + i, 50 + i, 9, 100 + 7 * i] for i in range(6)]
    max_tokens = [4, 5, 6, 7, 8, 9]
    refs = [reference_greedy(model, p, n, WordTokenizer.eos_token_ids) for p, n in zip(prompts, max_tokens)]
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=40, compile_decode=True,
                                                      compile_shrink_after=shrink_after))
    (pad,) = eng.blocks.reserved
    pools_before = [np.array(a) for a in (eng.model.kv.take_pools())]
    eng.model.kv.put_pools([mx.array(a) for a in pools_before])
    ids = [eng.add_request(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    rows_seen = set()
    while eng.has_unfinished():
        rows_seen.add(sum(1 for r in eng.requests.values() if not r.finished))
        eng.step()
        eng.blocks.check_invariants()
        assert all(pad not in eng.blocks.table(i) for i in ids if i in eng.blocks)
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, 1e-4, f"padded compiled decode req {rid}")
    compiled = eng.runner.compiled
    assert compiled.pad_block == pad and compiled.steps > 0
    want = 4 if shrink_after == 0 else 1
    assert compiled.traces == want, f"{compiled.traces} traces for batch sizes {sorted(rows_seen)}"
    assert (compiled.shrunk_steps > 0) == (shrink_after > 0)
    pools_after = eng.model.kv.take_pools()
    written = [not np.array_equal(np.array(a)[pad], b[pad]) for a, b in zip(pools_after, pools_before)]
    assert all(written), "the padding rows' K/V did not go to the reserved page"


def test_a_shape_traces_on_its_trace_after_th_step_and_runs_eagerly_before():
    """``trace_after=2``: a decode shape's first step is left to the eager forward (``None``), its
    second traces; another table width counts again; the logits stay the eager forward's."""
    pm = PagedModel(tiny_model("llama"), num_blocks=32)
    compiled = CompiledDecode(pm, trace_after=2)
    plan = build_step_plan([0], [9], [1], [[1]], 16)
    tok = mx.array([7], dtype=mx.int32)
    pm.forward(build_step_plan([0], [0], [9], [[1]], 16), mx.array(np.arange(1, 10, dtype=np.int32)))
    assert compiled.run(plan, tok) is None and compiled.early_steps == 1 and compiled.traces == 0
    eager = pm.forward(plan, tok)
    got = compiled.run(plan, tok)  # the same shape again: traced now, and replayed from here on
    assert compiled.traces == 1 and compiled.steps == 1
    np.testing.assert_array_equal(np.array(got), np.array(eager)[-1:])
    wider = build_step_plan([0], [17], [1], [[1, 2, 3]], 16)  # 3 pages: table width 4
    assert compiled.run(wider, tok) is None and compiled.early_steps == 2 and compiled.traces == 1
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match=r"trace_after=.* \(allowed: an int >= 1\)"):
            CompiledDecode(pm, trace_after=bad)


def test_an_engine_tracing_on_second_sight_runs_the_first_decode_step_eagerly():
    """``compile_trace_after=2`` (the default is 1): the decode step launched behind the prefill is
    a shape's first sight and runs eagerly; the next one traces, and the tokens stay stock mlx-lm's."""
    model = tiny_model("llama")
    prompt = [5, 9, 200, 31, 77, 12, 40]
    ref = reference_greedy(model, prompt, 8, WordTokenizer.eos_token_ids)
    assert EngineConfig().compile_trace_after == 1
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, compile_decode=True, compile_trace_after=2))
    rid = eng.add_request(prompt, max_tokens=8)
    first = eng.step()
    compiled = eng.runner.compiled
    assert [o.new_token_ids for o in first] == [tuple(ref.tokens[:1])]
    assert compiled.traces == 0 and compiled.early_steps == 1  # the decode step launched behind it ran eager
    while eng.has_unfinished():
        eng.step()
    assert compiled.traces == 1 and compiled.steps > 0
    assert_same_greedy(eng.completion(rid).token_ids, ref, 1e-4, "compiled decode traced on second sight")
    with pytest.raises(InvalidInputError, match=r"compile_trace_after=0 \(allowed: an int >= 1\)"):
        EngineConfig(compile_trace_after=0).validate()


def test_a_one_page_pool_compiles_without_padding_rows():
    eng = Engine(tiny_model("llama"), WordTokenizer(), EngineConfig(num_blocks=1, compile_decode=True))
    assert eng.runner.compiled.pad_block is None and not eng.blocks.reserved


@pytest.mark.parametrize(("name", "block_size", "reason"), [
    ("gemma3_text", 16, "have a sliding window"),
    ("llama", 24, "page size 24 is not a kernel block size"),
])
def test_compiled_steps_refused_up_front_reserve_no_page(name, block_size, reason):
    """A model or page size compiled steps refuse from the start never runs a padding row: no page is
    reserved for them, and a request that fills the whole pool is accepted (the page was lost, and
    add_request blamed the reservation)."""
    model = tiny_model(name)
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=4, block_size=block_size, compile_decode=True))
    compiled = eng.runner.compiled
    assert reason in compiled.disabled
    assert compiled.pad_block is None and not eng.blocks.reserved and eng.kv_usage()["reserved"] == 0
    assert eng.pool_tokens == 4 * block_size
    prompt = [(7 * i) % 250 + 1 for i in range(4 * block_size - 5)]  # + max_tokens 5: the whole pool
    (c,) = eng.generate([prompt], max_tokens=5)
    assert_same_greedy(c.token_ids, reference_greedy(model, prompt, 5, WordTokenizer.eos_token_ids), 1e-4,
                       f"{name}, page size {block_size}, compiled steps refused")


def _plan_arrays(plan):
    """A plan's arrays (values and dtypes: a compiled step's cache key includes the dtypes) and host views."""
    md = plan.metadata
    arrays = {"positions": plan.positions, "slots": plan.slot_mapping, "seq_lens": md.seq_lens,
              "cu": md.cu_seqlens_q, "tables": md.block_tables}
    return {**{k: (str(a.dtype), np.array(a).tolist()) for k, a in arrays.items()},
            "host": (plan.seq_lens, md.seq_lens_host, md.q_lens_host), "plan": md.length_plan, "phase": md.phase}


@pytest.mark.parametrize("starts", [[9], [9, 20, 3], [1, 2, 3, 4, 5]])
def test_the_next_decode_plan_is_the_built_one_without_a_host_array(starts, monkeypatch):
    """One token on, every row in the same page: `next_decode_plan` gives what `build_step_plan`
    builds for those rows (positions, slots, lengths, tables, query starts, host views), from the
    device alone (no host array made), its bases over MLX CUDA's small pool; and nothing when a row's
    next token starts a page without its new block, a row has several tokens, or a plan has no bases."""
    from metal_attn import host_arrays
    from metal_attn.cache import next_decode_plan

    tables = [[4, 7], [1, 2], [3]][: len(starts)] + [[10 + i] for i in range(len(starts) - 3)]
    ids = list(range(len(starts)))
    plan = build_step_plan(ids, starts, [1] * len(starts), tables, 16)
    want = build_step_plan(ids, [s + 1 for s in starts], [1] * len(starts), tables, 16)
    monkeypatch.setattr(host_arrays, "_allocate", lambda host: pytest.fail(f"a host array was made: {host}"))
    got = next_decode_plan(plan, 16)
    assert _plan_arrays(got) == _plan_arrays(want)
    assert all(b.nbytes > host_arrays.SMALL_POOL_BYTES for b in got.bases)
    again = next_decode_plan(got, 16)  # and on from a derived plan
    monkeypatch.undo()
    assert _plan_arrays(again) == _plan_arrays(build_step_plan(ids, [s + 2 for s in starts], [1] * len(starts),
                                                               tables, 16))
    assert next_decode_plan(build_step_plan([0], [15], [1], [[4, 7]], 16), 16) is None  # position 16: page 2
    assert next_decode_plan(plan, 16, {0: 9}) is None  # a new block for a row that starts no page
    assert next_decode_plan(build_step_plan([0], [0], [9], [[4]], 16), 16) is None  # a prefill row
    assert next_decode_plan(dataclasses.replace(plan, bases=None), 16) is None
    md = build_step_plan([0], [9], [1], [[4]], 16).metadata
    with pytest.raises(InvalidInputError, match=r"seq_lens_host=\(12,\) \(allowed: each of \(10,\) plus one"):
        md.next_decode_step(mx.array([12], dtype=mx.int32), [12])
    with pytest.raises(InvalidInputError, match=r"seq_lens is an array of int64 \(1,\) \(allowed: an int32 mx.array"):
        md.next_decode_step(mx.array([11], dtype=mx.int64), [11])


@pytest.mark.parametrize("widths", [(), (8,)], ids=["no-padded-table", "padded-8"])
def test_rows_that_start_pages_are_derived_with_their_new_blocks(widths, monkeypatch):
    """Two of three rows' next tokens start pages: given the blocks the caller appended for them,
    `next_decode_plan` gives what `build_step_plan` builds over the grown tables, with two host
    arrays (the new slots and one table, of which the padded tables the plan had handed out are
    views); and on from there without any."""
    from metal_attn import host_arrays
    from metal_attn.cache import next_decode_plan

    ids, starts = [0, 1, 2], [15, 31, 9]
    plan = build_step_plan(ids, starts, [1] * 3, [[4], [1, 2], [3]], 16)
    for w in widths:
        plan.metadata.padded_block_tables(w)
    grown = [[4, 9], [1, 2, 5], [3]]
    want = build_step_plan(ids, [16, 32, 10], [1] * 3, grown, 16)
    made = []
    real = host_arrays._allocate
    monkeypatch.setattr(host_arrays, "_allocate", lambda host: made.append(host.shape) or real(host))
    got = next_decode_plan(plan, 16, {0: 9, 1: 5})
    assert len(made) == 2, made
    assert _plan_arrays(got) == _plan_arrays(want)
    for w in widths:  # the handed-out widths come with the new blocks, from the same upload
        assert np.array(got.metadata.padded_block_tables(w)).tolist() == [t + [0] * (w - len(t)) for t in grown]
        assert len(made) == 2
    got.metadata.check_against_pool(16, 16)  # the host copy went along: the pool check sees the new blocks
    with pytest.raises(InvalidInputError, match="block_tables"):
        got.metadata.check_against_pool(6, 16)
    made.clear()
    again = next_decode_plan(got, 16)
    assert made == [] and _plan_arrays(again) == _plan_arrays(build_step_plan(ids, [17, 33, 11], [1] * 3, grown, 16))
    assert next_decode_plan(plan, 16, {0: 9}) is None  # row 1 starts a page too, and has no block
    with pytest.raises(InvalidInputError, match=r"with_new_pages: row 5 -> \(1, 9\)"):
        plan.metadata.with_new_pages({5: (1, 9)})
    # a column more than one past the table: 10**7 built a table that wide (and 2**31 ran out of memory)
    width = plan.metadata.max_blocks_per_seq
    with pytest.raises(InvalidInputError, match=rf"a column in 0..{width}, "):
        plan.metadata.with_new_pages({0: (10**7, 9)})
    for bad in (2**40, 2.5, "3", True, width - 1):
        with pytest.raises(InvalidInputError, match=r"width=.* \(allowed: an int from the table's"):
            plan.metadata.padded_block_tables(bad)


def test_steady_compiled_decode_builds_a_plan_only_when_the_batch_changes(monkeypatch):
    """A compiled single stream builds its step plan on the host at the prefill and its first decode
    step only; every later step derives it on the device, those whose token starts a page with the
    new block. The tokens stay stock mlx-lm's."""
    from metal_attn.engine import runner as runner_mod

    model = tiny_model("llama")
    prompt = [5, 9, 200, 31, 77, 12, 40, 8, 3, 66]  # 10 tokens, pages of 16
    n = 40  # positions 10..49: pages start at 16, 32 and 48
    ref = reference_greedy(model, prompt, n, WordTokenizer.eos_token_ids)
    built = []
    real = runner_mod.build_step_plan
    monkeypatch.setattr(runner_mod, "build_step_plan", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, compile_decode=True))
    rid = eng.add_request(prompt, max_tokens=n)
    while eng.has_unfinished():
        eng.step()
    assert_same_greedy(eng.completion(rid).token_ids, ref, 1e-4, "compiled decode, derived plans")
    # Starts: the prefill (0) and the first decode row (10); the page starts (16, 32, 48) are derived.
    assert built == [[0], [10]], built
    assert eng.runner.compiled.steps >= n - 2
    # The runner's own counters say the same (benchmarks/probe_engine_steps.py reads them).
    assert (eng.runner.plans_built, eng.runner.plans_derived) == (2, eng.stats.steps - 2)


def test_rows_starting_pages_on_different_steps_keep_deriving_their_plans(monkeypatch):
    """Four requests of staggered lengths decode together: their tokens start pages on different
    steps, and every one of those steps derives its plan with the new blocks (the host builds one at
    the prefill and the first decode step only). Tokens are stock mlx-lm's, single stream each."""
    from metal_attn.engine import runner as runner_mod

    class NoStop(WordTokenizer):
        eos_token_ids = frozenset()  # every request runs its 30 tokens: the batch never changes

    model = tiny_model("llama")
    prompts = [[5 + i for i in range(n)] for n in (5, 9, 14, 22)]
    n = 30  # rows reach 35, 39, 44 and 52 tokens: page starts at 16 and 32 (48 too for the last), on 7 steps
    refs = [reference_greedy(model, p, n, frozenset()) for p in prompts]
    built = []
    real = runner_mod.build_step_plan
    monkeypatch.setattr(runner_mod, "build_step_plan", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    eng = Engine(model, NoStop(), EngineConfig(num_blocks=64, compile_decode=True, max_num_batched_tokens=256))
    ids = [eng.add_request(p, max_tokens=n) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    for rid, ref in zip(ids, refs):
        assert_same_greedy(eng.completion(rid).token_ids, ref, 1e-4, f"staggered pages, request {rid}")
    assert built == [[0, 0, 0, 0], [5, 9, 14, 22]], built  # the prefill and the first decode step only
    assert eng.runner.compiled.steps == n - 1
    assert (eng.runner.plans_built, eng.runner.plans_derived) == (2, n - 2)


def test_a_smaller_batch_that_lasts_is_traced_after_shrink_after_steps():
    """`CompiledDecode` runs a row bucket smaller than a traced one padded in it for its first
    ``shrink_after`` steps, then traces it; a bucket larger than every traced one traces at once; the
    logits are the eager forward's throughout. Without a scratch page nothing is padded."""
    pm = PagedModel(tiny_model("llama"), num_blocks=32)
    compiled = CompiledDecode(pm, pad_block=31, shrink_after=2)

    def step(starts):
        n = len(starts)
        plan = build_step_plan(list(range(n)), starts, [1] * n, [[i + 1] for i in range(n)], 16)
        tok = mx.arange(1, n + 1, dtype=mx.int32)
        want = pm.forward(plan, tok)  # first: the eager forward's first dispatch may move the epoch
        got = compiled.run(plan, tok)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)

    step([3, 4, 5, 6])  # bucket 4: traced
    assert (compiled.traces, compiled.shrunk_steps) == (1, 0)
    step([4, 5])  # bucket 2, first and second sight: padded in 4
    step([5, 6])
    assert (compiled.traces, compiled.shrunk_steps) == (1, 2)
    step([6, 7])  # third: traced
    assert (compiled.traces, compiled.shrunk_steps) == (2, 2)
    step([1, 2, 3, 4, 5, 6, 7, 8])  # bucket 8, larger than any traced: traced at once
    assert compiled.traces == 3
    with pytest.raises(ValueError, match=r"shrink_after=-1 \(allowed: an int >= 0\)"):
        CompiledDecode(pm, shrink_after=-1)
    unpadded = CompiledDecode(pm, shrink_after=2)  # no scratch page: every row count is its own trace
    for starts in ([3, 4, 5, 6], [4, 5]):
        n = len(starts)
        assert unpadded.run(build_step_plan(list(range(n)), starts, [1] * n, [[i + 1] for i in range(n)], 16),
                            mx.arange(1, n + 1, dtype=mx.int32)) is not None
    assert (unpadded.traces, unpadded.shrunk_steps) == (2, 0)
    with pytest.raises(InvalidInputError, match=r"compile_shrink_after=-1 \(allowed: an int >= 0\)"):
        EngineConfig(compile_shrink_after=-1).validate()


def test_a_smaller_bucket_runs_padded_until_its_trace_after_th_step():
    """With ``trace_after=3``, a smaller bucket than a traced one never goes eager: padded in the traced
    bucket for its first two steps (``shrink_after=1`` alone would have covered one), traced on its third."""
    pm = PagedModel(tiny_model("llama"), num_blocks=32)
    compiled = CompiledDecode(pm, pad_block=31, trace_after=3, shrink_after=1)

    def run(starts):
        n = len(starts)
        plan = build_step_plan(list(range(n)), starts, [1] * n, [[i + 1] for i in range(n)], 16)
        return compiled.run(plan, mx.arange(1, n + 1, dtype=mx.int32))

    pm.forward(build_step_plan([0], [2], [1], [[1]], 16), mx.array([1], dtype=mx.int32))  # settle the epoch

    assert [run([3, 4, 5, 6]) is None for _ in range(3)] == [True, True, False]  # eager, eager, traced
    assert [run([4, 5]) is not None for _ in range(3)] == [True, True, True]
    assert (compiled.traces, compiled.shrunk_steps, compiled.early_steps) == (2, 2, 2)


def test_compiled_steps_decode_with_weights_updated_in_place():
    """The weights were captured at the trace: after ``model.update`` the prefill ran with the new
    weights and the compiled decode steps with the old ones."""
    from mlx.utils import tree_map

    model = tiny_model("llama")
    eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=64, compile_decode=True))
    prompt = [1, 2, 3]
    eng.generate([prompt], max_tokens=8)
    assert eng.runner.compiled.steps > 0
    model.update(tree_map(lambda w: w * 1.3 if w.ndim >= 2 else w, model.parameters()))
    mx.eval(model.parameters())
    out = eng.generate([prompt], max_tokens=8)[0].token_ids
    assert_same_greedy(out, reference_greedy(model, prompt, 8, WordTokenizer.eos_token_ids), 1e-4, "updated weights")
    assert eng.runner.compiled.steps > 7  # the second request's steps ran compiled too


def test_a_failed_trace_leaves_the_model_s_weights_in_place():
    """MLX puts tracers in the model's tree while tracing and leaves them there if the trace raises."""
    model = tiny_model("llama")
    before = model.lm_head.weight
    with override_settings(provider="reference"):  # refuses bounds metadata: the trace fails
        eng = Engine(model, WordTokenizer(), EngineConfig(num_blocks=32, compile_decode=True))
        eng.generate([[5, 6, 7]], max_tokens=4)
    assert eng.runner.compiled.disabled and model.lm_head.weight is before
    mx.eval(model(mx.array([[1, 2]])))


def test_an_interrupt_while_tracing_puts_the_pools_and_the_weights_back(monkeypatch):
    """Ctrl-C (not an Exception) skipped the handler: the pools stayed taken (every later step raised
    'the pools were already taken') and the weights stayed tracers."""
    model = tiny_model("llama")
    pm = PagedModel(model, num_blocks=16)
    compiled = CompiledDecode(pm)
    before = model.lm_head.weight
    real = PagedModel.forward

    def interrupted(self, plan, tokens):
        raise KeyboardInterrupt

    monkeypatch.setattr(PagedModel, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compiled.run(build_step_plan([0], [4], [1], [[1]], 16), mx.array([3], dtype=mx.int32))
    monkeypatch.setattr(PagedModel, "forward", real)
    assert model.lm_head.weight is before
    pm.kv.put_pools(pm.kv.take_pools())  # not taken any more
    mx.eval(model(mx.array([[1, 2]])))
