"""CUDA chains (`metal_attn.cuda_ops`): a per-token call as one MLX operation, on MLX's CUDA backend.

The chain runs the same kernel texts as ``mx.fast.cuda_kernel`` with the same grids and parameters,
so its output must equal the ``mx.fast`` route's bit for bit, and both must match the float64
oracle. Also: a strided query (the chain copies it, as MLX does for its custom kernels), a compiled
step, inputs that do not match what the chain was built for, and the chains' device memory pool
(the same bytes as MLX's allocator, buffers back in the pool once released, an output the host reads).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_attn.providers import gpu_common

import metal_attn
from metal_attn import cuda_ops, diagnostics
from metal_attn.device import detect_backend
from metal_attn.settings import override_settings
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.overrides import PER_TOKEN_TEST_ROUTES, forced_per_token_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(detect_backend() != "cuda", reason="CUDA chains run on MLX's CUDA backend only"),
    pytest.mark.skipif(detect_backend() == "cuda" and cuda_ops.unavailable_reason() is not None,
                       reason=f"metal_attn._cuda_ops is not loadable here: {cuda_ops.unavailable_reason()}"),
]

CASES = [
    dict(q_lens=[1, 1, 1], seq_lens=[17, 1000, 4096], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
         dtype="bfloat16", label="gqa4 bf16"),
    dict(q_lens=[1, 1], seq_lens=[600, 2049], num_heads=16, num_kv_heads=2, head_size=256, block_size=32,
         dtype="float16", sinks=True, label="gqa8 h256 fp16 sinks"),
    dict(q_lens=[1, 1], seq_lens=[700, 1500], num_heads=8, num_kv_heads=8, head_size=64, block_size=8,
         dtype="float32", sliding_window=300, label="mha fp32 window"),
    dict(q_lens=[1, 3, 1], seq_lens=[513, 40, 1025], num_heads=4, num_kv_heads=2, head_size=96, block_size=16,
         dtype="bfloat16", softcap=30.0, label="mixed rows softcap"),
]


def _case(spec, seed):
    return make_case(**spec, seed=seed)


def _run(case, route, chains: bool, fused: bool = True, slices: int = 0):
    before = dict(cuda_ops.chains_built)
    with (override_settings(cuda_chains=chains, cuda_fused_reduce=fused, reducer_slices=slices),
          forced_per_token_route(route)):
        out = run_case(case, provider="classic")
        rec = diagnostics.last_dispatch()
    built = {k: v - before.get(k, 0) for k, v in cuda_ops.chains_built.items() if v != before.get(k, 0)}
    return out, rec, built


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("route", PER_TOKEN_TEST_ROUTES)
@pytest.mark.parametrize("spec", CASES, ids=[c["label"] for c in CASES])
def test_the_chain_equals_the_mx_fast_route_bit_for_bit_and_matches_the_oracle(spec, route, fused):
    # The fused reducer runs the standalone reducer's arithmetic (ma_reduce_partials) in the same
    # order, so it too equals the mx.fast route (per-token kernel, then reducer) bit for bit: the
    # reducer in one partition slice, as the fused one sums (several add the slices' sums in slice
    # order; the two-kernel chain takes the same slices as the mx.fast route, the rule's).
    case = _case(spec, seed=7)
    want_fused = fused and route != "per_token_ps0"
    chained, rec_c, built_c = _run(case, route, True, fused)
    plain, rec_p, built_p = _run(case, route, False, slices=1 if want_fused else 0)
    assert rec_c.route == rec_p.route, (rec_c.route, rec_p.route)
    assert built_c and not built_p, (built_c, built_p)
    assert all(name.endswith("_fused") == want_fused for name in built_c), built_c
    np.testing.assert_array_equal(chained, plain, err_msg=f"{case.label} {rec_c.route} fused={fused}")
    assert_close_to_oracle(chained, case.oracle(), case.dtype, label=f"{case.label} {rec_c.route} chain")


def test_fused_calls_queued_on_one_counter_array_never_overlap_and_leave_it_zero():
    # 24 layers' calls over one metadata share one launch, hence one counter array; they are queued
    # and evaluated together. Each must equal its two-kernel result (the reducer in one partition slice,
    # as the fused one sums), and the counters end at zero.
    case = make_case(q_lens=[1] * 6, seq_lens=[4096, 3001, 17, 1024, 2500, 65], num_heads=32, num_kv_heads=8,
                     head_size=128, block_size=16, dtype="bfloat16", sinks=True, seed=11)
    qs = [mx.random.normal(case.q.shape, key=mx.random.key(i)).astype(case.q.dtype) for i in range(24)]

    def layers(fused: bool):
        md = case.metadata()
        with (override_settings(cuda_fused_reduce=fused, reducer_slices=1),
              forced_per_token_route("per_token_ps64")):
            outs = [metal_attn.paged_attention(q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                               sinks=case.sinks, provider="classic") for q in qs]
            mx.eval(outs)
        return outs, next(v for v in md._launches.values() if isinstance(v, gpu_common.ChainedPerTokenLaunch))

    outs, launch = layers(True)
    assert launch.chain.name.endswith("_fused")
    assert not np.array(launch.extra).any(), "the fused reducer left counters non-zero"
    for i, (got, want) in enumerate(zip(outs, layers(False)[0])):
        np.testing.assert_array_equal(_as_f32(got), _as_f32(want), err_msg=f"layer {i}")
    again, _ = layers(True)  # a second round on the same counters
    for i, (got, want) in enumerate(zip(again, outs)):
        np.testing.assert_array_equal(_as_f32(got), _as_f32(want), err_msg=f"round 2, layer {i}")


def _decode_case():
    return make_case(q_lens=[1, 1], seq_lens=[300, 900], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype="bfloat16", seed=3)


def _as_f32(x):
    return np.asarray(x.astype(mx.float32))


def test_a_strided_query_is_copied_first_as_mlx_does():
    case = _decode_case()
    md = case.metadata()
    ref = metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                     provider="classic")
    # The same values through a view that is not row-contiguous: [T, D, H] swapped back to [T, H, D].
    qt = mx.swapaxes(mx.contiguous(mx.swapaxes(case.q, 1, 2)), 1, 2)
    got = metal_attn.paged_attention(qt, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                     provider="classic")
    assert any(isinstance(v, gpu_common.ChainedPerTokenLaunch) for v in md._launches.values())
    np.testing.assert_array_equal(_as_f32(got), _as_f32(ref))


def test_a_compiled_step_replays_the_chain():
    case = _decode_case()
    md = case.metadata()

    def layer(q, k, v):
        return metal_attn.paged_attention(q, k, v, metadata=md, scale=case.scale, provider="classic")

    eager = layer(case.q, case.k_cache, case.v_cache)
    compiled = mx.compile(layer)
    for q in (case.q, case.q * 1):
        np.testing.assert_array_equal(_as_f32(compiled(q, case.k_cache, case.v_cache)), _as_f32(eager))


def _built_chain():
    """A decode case after one classic call: the case, the chained launch its metadata holds, and the
    inputs that launch passes its chain."""
    case = _decode_case()
    md = case.metadata()
    mx.eval(metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                       provider="classic"))
    launch = next(v for v in md._launches.values() if isinstance(v, gpu_common.ChainedPerTokenLaunch))
    inputs = [case.q, case.k_cache, case.v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, launch.zero_sinks,
              launch.params, launch.fparams] + ([launch.extra] if launch.extra is not None else [])
    return case, launch, inputs


def test_inputs_that_do_not_match_the_chain_are_refused_by_name():
    case, launch, inputs = _built_chain()
    assert launch.chain.name.startswith("metal_attn.per_token")
    with pytest.raises(ValueError, match=r"input 0 has dtype .*float16.*built for .*bfloat16"):
        launch.chain([case.q.astype(mx.float16), *inputs[1:]])
    with pytest.raises(ValueError, match=r"inputs \(it takes"):
        launch.chain(inputs[:-1])


def test_a_chain_whose_data_flow_is_wrong_is_refused_when_built():
    f32 = mx.float32
    fake_fn = 1  # never launched: validation refuses the chain first
    bad = [
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 0], 1)]), r"writes input 0"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 2], 1)]), r"no launch writes output 0"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 2, 1], 2)]), r"reads scratch buffer 2 before"),
        (dict(launches=[(fake_fn, (0, 1, 1), (32, 1, 1), [0, 1], 1)]), r"grid \(0, 1, 1\).*at least 1"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 7], 1)]), r"argument 7 \(allowed: buffer indices 0..2\)"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 1], 1)], state=[3]),
         r"state input 3 \(allowed: input indices 0..0\)"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 1], 1)], after=[(1, 0)]),
         r"after pair \(1, 0\) \(allowed: a launch index 0..0 and an input index 0..0\)"),
        (dict(launches=[(fake_fn, (1, 1, 1), (32, 1, 1), [0, 1], 1)], after=[(0, 1)]),
         r"after pair \(0, 1\)"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            cuda_ops.chain("bad", [f32], [((4,), f32)], [((4,), f32)], **kw)
    # A state input may be written in place (the fused reducer's counters).
    ok = cuda_ops.chain("state", [f32], [((4,), f32)], [], [(fake_fn, (1, 1, 1), (32, 1, 1), [0, 1], 0)], state=[0])
    assert ok.name == "state"


#: Two one-thread kernels that stamp the GPU's global timer (ns): the first spins 2 ms, then writes when it
#: ended; the second writes when it started.
_TIMER_SOURCE = r"""
namespace mlx::core::cu {
__device__ unsigned long long ma_test_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__global__ void ma_test_spin_2ms(const float* x, unsigned long long* end) {
  const unsigned long long t0 = ma_test_now();
  unsigned long long t = t0;
  while (t - t0 < 2000000ull) t = ma_test_now();
  end[0] = t;
}
__global__ void ma_test_stamp(const float* y, unsigned long long* start) {
  start[0] = ma_test_now();
}
}
"""


def test_a_launch_after_an_input_starts_when_its_writer_has_ended():
    # `after`: a launch waits for an input's writer without reading the input (METAL_ATTN_CUDA_DECODE_ROWS_WAIT
    # is built on it). The stamp reads only y; with after=[(0, 0)] it must start after the 2 ms spin that
    # wrote `end` has ended. Without it the two may run at once (MLX's graph links nodes by the buffers they
    # name), which is what makes the edge worth having: that run is reported, not asserted.
    spin = cuda_ops.compile_function("ma_test_spin_2ms", _TIMER_SOURCE)
    stamp = cuda_ops.compile_function("ma_test_stamp", _TIMER_SOURCE)
    one = ((1, 1, 1), (1, 1, 1))
    writer = cuda_ops.chain("test_spin", [mx.float32], [((1,), mx.uint64)], [], [(spin, *one, [0, 1], 1)])
    starts = {}
    for waits in (True, False):
        reader = cuda_ops.chain("test_stamp", [mx.uint64, mx.float32], [((1,), mx.uint64)], [],
                                [(stamp, *one, [1, 2], 1)], after=[(0, 0)] if waits else ())
        (end,) = writer([mx.zeros((1,), mx.float32)])
        (start,) = reader([end, mx.zeros((1,), mx.float32)])
        mx.eval(start, end)
        starts[waits] = (int(np.array(start)[0]), int(np.array(end)[0]))
    started, ended = starts[True]
    assert started >= ended, f"the launch started {ended - started} ns before its input's writer ended"
    started, ended = starts[False]
    print(f"without after: the stamp started {(ended - started) / 1e3:.0f} µs before the spin ended")


def test_an_input_of_another_shape_is_refused_by_name():
    case, launch, inputs = _built_chain()
    with pytest.raises(ValueError, match=r"input 0 has shape .* \(it was built for"):
        launch.chain([case.q[:1], *inputs[1:]])


def _sdpa_prefill_case():
    # sdpa_prefill's two chains (gather_kv + first_flagged, sdpa_finish) and its decode row's per-token
    # chain; the 1,024-row prompt has the attended pairs SDPA_PREFILL_RULES[cuda] asks for.
    return make_case(q_lens=[1024, 1, 64], seq_lens=[1024, 900, 2048], num_heads=16, num_kv_heads=4, head_size=128,
                     block_size=16, dtype="bfloat16", seed=5)


def test_pooled_chain_memory_gives_the_same_bytes_as_mlx_allocator():
    case = _sdpa_prefill_case()
    outs = {}
    for pooled in (True, False):
        before = cuda_ops.pool_stats()["allocations"]
        with override_settings(cuda_chain_pool=pooled):
            outs[pooled] = run_case(case, provider="sdpa_prefill")
        grew = cuda_ops.pool_stats()["allocations"] - before
        assert (grew > 0) == pooled, (pooled, grew)
    np.testing.assert_array_equal(outs[True], outs[False])
    assert_close_to_oracle(outs[True], case.oracle(), case.dtype, label="pooled chains")


def test_pooled_buffers_return_to_the_pool_when_released():
    case = _sdpa_prefill_case()
    md = case.metadata()

    def call():
        return metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                          provider="sdpa_prefill")

    mx.eval(call())
    mx.synchronize()
    idle = cuda_ops.pool_stats()
    outs = [call() for _ in range(8)]
    mx.eval(outs)
    held = cuda_ops.pool_stats()
    assert held["live_buffers"] >= idle["live_buffers"] + 8, (idle, held)
    assert held["live_bytes"] >= idle["live_bytes"] + 8 * outs[0].nbytes, (idle, held)
    del outs
    mx.synchronize()
    after = cuda_ops.pool_stats()
    assert after["live_buffers"] == idle["live_buffers"], (idle, after)
    assert after["live_bytes"] == idle["live_bytes"], (idle, after)
    assert after["reserved_bytes"] >= held["live_bytes"] - idle["live_bytes"]  # kept for reuse until trimmed
    cuda_ops.trim_pool()
    assert cuda_ops.pool_stats()["reserved_bytes"] <= after["reserved_bytes"]


def test_a_pooled_output_the_host_reads_keeps_its_values_and_mlx_accounting_sane():
    # Reading an array on the host makes MLX move its buffer into unified memory (and free our device
    # memory itself); its release then frees MLX's unified memory. MLX's active-memory figure must not
    # wrap around for memory it never counted.
    case = _sdpa_prefill_case()
    active_before = mx.get_active_memory()
    moved = cuda_ops.pool_stats()["moved_by_mlx"]
    out = metal_attn.paged_attention(case.q, case.k_cache, case.v_cache, metadata=case.metadata(),
                                     scale=case.scale, provider="sdpa_prefill")
    bits = np.array(out.view(mx.uint16))  # the host reads the chain's own buffer (a view shares it)
    first = (bits.astype(np.uint32) << 16).view(np.float32)
    again = _as_f32(out)  # a GPU op reads the moved buffer
    np.testing.assert_array_equal(first, again)
    assert_close_to_oracle(again, case.oracle(), case.dtype, label="host-read pooled output")
    del out
    mx.synchronize()
    assert cuda_ops.pool_stats()["moved_by_mlx"] >= moved + 1
    total = mx.device_info().get("memory_size") or 2**40
    assert mx.get_active_memory() < total, (active_before, mx.get_active_memory())
    assert abs(mx.get_active_memory() - active_before) < 2**30, (active_before, mx.get_active_memory())


def _doubling_chain():
    # out = 2 * out + 1 over 1,024 floats, in place: the output starts as input 0's values (initial).
    body = ("const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "if (i < 1024) { out[i] = 2.0f * out[i] + 1.0f; }")
    fn = cuda_ops.compile_function("ma_test_double_in_place", cuda_ops.runtime_source(
        "ma_test_double_in_place", "", body, [("unused", "float32")], [("out", "float32")], []))
    return cuda_ops.chain("test.double_in_place", [mx.float32], [((1024,), mx.float32)], [],
                          [(fn, (4, 1, 1), (256, 1, 1), [1, 1], 1)], initial=[(0, 0)])


def test_an_output_with_initial_values_takes_over_a_free_input_and_copies_a_held_one():
    chain = _doubling_chain()
    base = np.arange(1024, dtype=np.float32) * 3
    want = 2 * base + 1

    before = cuda_ops.initial_stats()
    (free,) = chain([mx.arange(1024, dtype=mx.float32) * 3])  # no other array holds the product
    np.testing.assert_array_equal(np.array(free), want)
    after = cuda_ops.initial_stats()
    assert (after["donated"] - before["donated"], after["copied"] - before["copied"]) == (1, 0), (before, after)

    held = mx.arange(1024, dtype=mx.float32) * 3
    mx.eval(held)
    (out,) = chain([held])
    np.testing.assert_array_equal(np.array(out), want)
    np.testing.assert_array_equal(np.array(held), base)  # the caller's array is not written
    strided = mx.stack([held, -held], axis=1)[:, 0]  # not row-contiguous: copied, in order
    (out2,) = chain([strided])
    np.testing.assert_array_equal(np.array(out2), want)
    last = cuda_ops.initial_stats()
    assert (last["donated"] - after["donated"], last["copied"] - after["copied"]) == (0, 2), (after, last)

    with pytest.raises(ValueError, match=r"starts as input 0, which has 1023 elements \(the output has 1024\)"):
        chain([mx.zeros((1023,), mx.float32)])


def test_a_chain_with_a_wrong_initial_pair_is_refused_when_built():
    f32, fn = mx.float32, 1  # never launched
    launch = [(fn, (1, 1, 1), (32, 1, 1), [1, 1], 1)]
    for kw, message in [
        (dict(initial=[(1, 0)]), r"initial pair \(output 1, input 0\) \(allowed: outputs 0..0, inputs 0..0\)"),
        (dict(initial=[(0, 0), (0, 0)]), r"output 0 has two initial inputs"),
        (dict(initial=[(0, 0)], input_shapes=[(3,)]), r"output 0 starts as input 0, which has another element count"),
    ]:
        with pytest.raises(ValueError, match=message):
            cuda_ops.chain("bad", [f32], [((4,), f32)], [], launch, **kw)
    with pytest.raises(ValueError, match=r"output 0 \(.*float32.*\) starts as input 0 \(.*float16.*\)"):
        cuda_ops.chain("bad", [mx.float16], [((4,), f32)], [], launch, initial=[(0, 0)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sdpa_prefill_finishes_one_run_in_the_fused_output_s_buffer(dtype):
    # Two equal prompts (one run, no decode rows): the finish chain takes over MLX SDPA's output and
    # writes only the NaN rows; the same bytes as the copying finish, NaN rows included.
    from metal_attn.testing.overrides import rule_opened_for

    nan, inf = float("nan"), float("inf")
    case = make_case(q_lens=[300, 300], seq_lens=[300, 300], num_heads=8, num_kv_heads=2, head_size=128,
                     block_size=16, dtype=dtype, seed=31,
                     poison=[("v", 0, 120, 0, nan), ("k", 1, 250, 1, inf), ("q", 0, 10, 3, nan),
                             ("q", 1, 299, 5, -inf)],
                     label=f"one run {dtype}")
    outs = {}
    with rule_opened_for("sdpa_prefill"):
        for in_place in (True, False):
            before = cuda_ops.initial_stats()
            with override_settings(cuda_finish_in_place=in_place):
                outs[in_place] = run_case(case, provider="sdpa_prefill")
            assert diagnostics.last_dispatch().route == "sdpa_prefill"
            after = cuda_ops.initial_stats()
            # Every finish of the provider's calls (its warm-up's too) takes the buffer over, or none.
            assert (after["donated"] > before["donated"]) == in_place, (in_place, before, after)
            assert after["copied"] == before["copied"], (in_place, before, after)
    np.testing.assert_array_equal(outs[True], outs[False])
    assert np.isnan(outs[True]).any() and np.isfinite(outs[True]).any()
    assert_close_to_oracle(outs[True], case.oracle(), case.dtype, label=case.label)


def _chained_step(case, layers: int):
    """`layers` classic calls, each layer's query the output of the one before, one evaluation."""
    md = case.metadata()
    q = case.q
    for _ in range(layers):
        q = metal_attn.paged_attention(q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                       provider="classic")
    return q


def _step_on_an_idle_gpu(step, q):
    """``step(q)`` evaluated once to warm it (a compiled step's trace), then again after the GPU drained: its
    output and the chains' `cuda_ops.idle_commits` counts during that evaluation."""
    mx.eval(step(q))
    mx.synchronize()
    before = cuda_ops.idle_commits()
    got = step(q)
    mx.eval(got)
    after = cuda_ops.idle_commits()
    return got, {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("on", [True, False], ids=["commit-when-idle", "mlx-alone"])
def test_a_step_on_an_idle_gpu_launches_after_its_first_chain_only_when_asked(on):
    # cuda_commit_when_idle: the chain launches MLX's encoded graph when the stream has no work left,
    # then ahead of the GPU at the 1st, 3rd, 7th... chain after that. A step evaluated after a
    # synchronize starts on an idle GPU, so with the setting on its first chain commits; the values
    # are those of MLX's own launches, bit for bit.
    case = _decode_case()
    with override_settings(cuda_commit_when_idle=False):
        want = _chained_step(case, 8)
        mx.eval(want)
    with override_settings(cuda_commit_when_idle=on):
        got = _chained_step(case, 8)
        mx.synchronize()
        before = cuda_ops.idle_commits()
        mx.eval(got)
        after = cuda_ops.idle_commits()
    np.testing.assert_array_equal(_as_f32(got), _as_f32(want))
    idle, ahead = after["idle"] - before["idle"], after["ahead"] - before["ahead"]
    if on:
        assert idle >= 1, (idle, ahead)  # at least the first chain found the GPU idle
    else:
        assert (idle, ahead) == (0, 0)


def test_a_compiled_step_that_keeps_the_gpu_busy_launches_ahead_of_it():
    # Layers of 4 x 16,384 tokens (268 MB of K/V each, about 90 us of an H100) compiled, as the engine's
    # decode steps are: the host encodes a layer in a fraction of the time the GPU runs one, so after the
    # first chain finds the GPU idle, the next ones find it busy and launch ahead (at the 1st, 3rd, 7th and
    # 15th of them). The values are those of MLX's own launches, bit for bit.
    case = make_case(q_lens=[1] * 4, seq_lens=[16384] * 4, num_heads=32, num_kv_heads=8, head_size=128,
                     block_size=16, dtype="bfloat16", seed=11)
    md = case.metadata()

    def step(q):
        for _ in range(16):
            q = metal_attn.paged_attention(q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                           provider="classic")
        return q

    with override_settings(cuda_commit_when_idle=False):
        want = step(case.q)
        mx.eval(want)
    with override_settings(cuda_commit_when_idle=True):
        got, counts = _step_on_an_idle_gpu(mx.compile(step), case.q)
    np.testing.assert_array_equal(_as_f32(got), _as_f32(want))
    assert counts["idle"] >= 1 and counts["ahead"] >= 1, counts


@pytest.mark.parametrize("direct", [1, 3, 32])
def test_chains_launched_straight_onto_the_stream_give_mlx_s_values(direct):
    # cuda_idle_direct_chains: the chain that finds the GPU idle and the next direct - 1 after it launch with
    # cuLaunchKernel after committing what MLX encoded, not as graph nodes. Stream order must keep every
    # layer after the one before, eager and compiled, with an MLX op between layers as a model has: the
    # values are those of MLX's own launches, bit for bit, and the count says they went straight.
    case = _decode_case()
    md = case.metadata()

    def step(q):
        for _ in range(8):
            q = metal_attn.paged_attention(q, case.k_cache, case.v_cache, metadata=md, scale=case.scale,
                                           provider="classic") * 1.0625
        return q

    with override_settings(cuda_commit_when_idle=False):
        want = step(case.q)
        mx.eval(want)
    with override_settings(cuda_commit_when_idle=True, cuda_idle_direct_chains=direct):
        for fn in (step, mx.compile(step)):
            got, counts = _step_on_an_idle_gpu(fn, case.q)
            np.testing.assert_array_equal(_as_f32(got), _as_f32(want))
            assert 1 <= counts["direct"] <= 8, (direct, counts)  # every chain that finds the GPU idle starts a run


def test_a_spin_wait_returns_with_the_gpu_done_and_mlx_s_values():
    # spin_until_idle after mx.async_eval: the step queued, a spin on MLX's stream until it has no work left,
    # then mx.eval, which finds it done (the probe's stream-spin wait). The values are those of mx.eval's wait
    # bit for bit; the spin ran (the module loaded, the GPU the default device); and the stream it waited for is
    # idle after it (a second spin returns on its first poll).
    case = _decode_case()
    want = _chained_step(case, 8)
    mx.eval(want)
    got = _chained_step(case, 8)
    mx.async_eval(got)
    assert cuda_ops.spin_until_idle() is not None, "the module's spin did not run"
    mx.eval(got)
    np.testing.assert_array_equal(_as_f32(got), _as_f32(want))
    big = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    mx.eval(big)
    # Milliseconds of GPU work: the spin polls more than once. Up to three tries: with other processes on
    # the GPU (the suite under pytest-xdist) one spin found the stream idle at its first poll.
    polls = []
    for _ in range(3):
        out = big @ big @ big
        mx.async_eval(out)
        polls.append(cuda_ops.spin_until_idle())
        assert cuda_ops.spin_until_idle() == 1
        mx.eval(out)
        if polls[-1] > 1:
            break
    assert polls[-1] > 1, polls


TILED_CASES = [
    dict(q_lens=[64, 300], seq_lens=[2112, 300], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
         dtype="bfloat16", sinks=True, label="chunk after 2K and a prompt, sinks"),
    dict(q_lens=[1, 1, 200], seq_lens=[5000, 40, 1200], num_heads=16, num_kv_heads=2, head_size=64, block_size=32,
         dtype="float16", sliding_window=500, softcap=30.0, label="mixed, window, softcap"),
]


@pytest.mark.parametrize("split", [-1, 128], ids=["unsplit", "split128"])
@pytest.mark.parametrize("spec", TILED_CASES, ids=[c["label"] for c in TILED_CASES])
def test_the_tiled_chain_equals_the_mx_fast_route_bit_for_bit_and_matches_the_oracle(spec, split):
    # METAL_ATTN_CUDA_TILED_CHAINS=1: the tiled kernel and (split) the reducer as one chain, the same texts,
    # grids and parameters as the mx.fast launches: the same bytes. The mixed case's decode rows take the
    # per-token chain either way; a forced split leaves mixed batches unsplit.
    case = _case(spec, seed=11)
    outs, routes, built = {}, {}, {}
    for on in (True, False):
        before = dict(cuda_ops.chains_built)
        with override_settings(cuda_tiled_chains=on, tiled_partition_size=split):
            outs[on] = run_case(case, provider="tiled_prefill")
            routes[on] = diagnostics.last_dispatch().route
        built[on] = {k for k, v in cuda_ops.chains_built.items() if v != before.get(k, 0)}
    assert routes[True] == routes[False], routes
    if case.q_lens[0] != 1:  # not mixed: the forced split applies
        assert routes[True] == ("tiled_prefill_ps128" if split > 0 else "tiled_prefill"), routes
    assert any(k.startswith("metal_attn.tiled_prefill") for k in built[True]), built
    assert not any(k.startswith("metal_attn.tiled_prefill") for k in built[False]), built
    np.testing.assert_array_equal(outs[True], outs[False], err_msg=f"{case.label} {routes[True]}")
    assert_close_to_oracle(outs[True], case.oracle(), case.dtype, label=f"{case.label} {routes[True]} chain")


MIXED_CHAIN_CASES = [
    dict(q_lens=[1, 1, 1, 200, 200], seq_lens=[300, 1000, 17, 600, 900], num_heads=32, num_kv_heads=8,
         head_size=128, block_size=16, dtype="bfloat16", sinks=True, label="3 rows, two runs, sinks"),
    dict(q_lens=[1] * 8 + [256], seq_lens=[4096] * 8 + [2048], num_heads=16, num_kv_heads=2, head_size=64,
         block_size=32, dtype="float16", label="8 rows at 4K, one chunk, fp16"),
]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("route", ["per_token_ps0", "per_token_ps64"])
@pytest.mark.parametrize("spec", MIXED_CHAIN_CASES, ids=[c["label"] for c in MIXED_CHAIN_CASES])
def test_decode_rows_inside_the_finish_chain_give_the_same_bytes(spec, route, fused):
    # METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=1: a mixed batch's decode rows run inside sdpa_prefill's finish chain,
    # straight into the output's first rows, the same kernels, grids and parameters as their chain of their own:
    # the same bytes, and the oracle; whatever the rows wait for (METAL_ATTN_CUDA_DECODE_ROWS_WAIT).
    from metal_attn.testing.overrides import rule_opened_for

    case = _case(spec, seed=23)
    outs, built = {}, {}
    with rule_opened_for("sdpa_prefill"):
        for key in ("own chain", "none", "gathers", "sdpa"):
            on, wait = key != "own chain", "none" if key == "own chain" else key
            before = dict(cuda_ops.chains_built)
            with (override_settings(cuda_decode_rows_in_chain=on, cuda_fused_reduce=fused, cuda_decode_rows_wait=wait),
                  forced_per_token_route(route)):
                outs[key] = run_case(case, provider="sdpa_prefill")
                assert diagnostics.last_dispatch().route == "sdpa_prefill_decode"
            built[key] = {k for k, v in cuda_ops.chains_built.items() if v != before.get(k, 0)}
    assert "metal_attn.sdpa_finish_decode" not in built["own chain"], built
    for key in ("none", "gathers", "sdpa"):
        assert "metal_attn.sdpa_finish_decode" in built[key], (key, built)
        np.testing.assert_array_equal(outs[key], outs["own chain"],
                                      err_msg=f"{case.label} {route} fused={fused} wait={key}")
    assert_close_to_oracle(outs["none"], case.oracle(), case.dtype, label=f"{case.label} {route} in the finish chain")
