"""CUDA chains' host side (`metal_attn.cuda_ops`), on any machine: what a chained per-token call
hands the compiled module, against what the ``mx.fast`` route launches for the same call.

The module itself (``csrc/cuda``) runs on MLX's CUDA backend only; its numerics are
``tests/gpu/test_cuda_chains_gpu.py``'s (bitwise against the ``mx.fast`` route, and the oracle).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from metal_attn.providers import gpu_common as gc

from metal_attn import cuda_ops, diagnostics
from metal_attn.metadata import AttentionMetadata
from metal_attn.settings import Settings, override_settings
from metal_attn.testing.fake_cuda import fake_chains as fake_cuda_chains
from metal_attn.testing.fake_cuda import fake_cuda


@pytest.fixture
def fake_chains():
    """cuda_ops as if the module were built (`metal_attn.testing.fake_cuda.fake_chains`): chains are
    `FakeChain`, kernels are numbered specs (the fixture's value: 1000 + index)."""
    with fake_cuda_chains() as fake:
        yield fake.functions


def _batch():
    md = AttentionMetadata.build(np.arange(16, dtype=np.int32).reshape(2, 8), [100, 128], [0, 1, 2], validate=False)
    return md, (2, 8, 128), (16, 16, 2, 128)


def _names(template):
    from metal_attn.api import dtype_name

    return [(k, dtype_name(v) if isinstance(v, mx.Dtype) else v) for k, v in template]


def _chained_and_plain(build, monkeypatch, **settings):
    """``build()`` under ``settings`` with chains (faked), then again as the ``mx.fast`` route (chains off,
    kernels faked): the two launch descriptors of one call, to compare."""
    with override_settings(**settings):
        chained = build()
    monkeypatch.setattr(cuda_ops, "enabled", lambda: False)
    with fake_cuda():
        plain = build()
    return chained, plain


def _assert_chain_reduces_like_mx_fast(ch, functions, kernel_out, plain_reduce, input_names):
    """A split chain's partials are its scratch, in the shapes and dtypes the ``mx.fast`` route allocates
    (``kernel_out``: its kernel launch's arguments), written by launch 0; launch 1 is the reducer with the
    ``mx.fast`` reducer's template and grid, reading them with the batch's lengths, the sinks (at their
    places in ``input_names``) and its parameters (the last input), into the chain's output."""
    n_in = len(ch.input_dtypes)
    assert [tuple(s) for s, _ in ch.scratch] == [tuple(s) for s in kernel_out["output_shapes"]]
    assert [d for _, d in ch.scratch] == list(kernel_out["output_dtypes"])
    scratch = list(range(n_in + 1, n_in + 1 + len(ch.scratch)))
    _, _, _, args, reads = ch.launches[0]
    assert args[reads:] == scratch
    red = plain_reduce.launch.kwargs
    f1 = functions[1]
    assert f1["name"] == "paged_attention_v2_reduce" and f1["template"] == _names(red["template"])
    _, grid, block, args, reads = ch.launches[1]
    assert block == red["threadgroup"] and grid == cuda_ops.threadgroups(red["grid"], red["threadgroup"])
    names = list(input_names)
    assert args == [*scratch, names.index("seq_lens"), names.index("cu_seqlens_q"), names.index("sinks"), n_in - 1,
                    n_in]
    assert reads == len(gc.REDUCE_INPUTS)
    assert [tuple(s) for s, _ in ch.outputs] == [tuple(s) for s in red["output_shapes"]]


@pytest.mark.parametrize("partition_size", [0, 64])
def test_a_chained_call_launches_what_the_mx_fast_route_launches(fake_chains, partition_size, monkeypatch):
    md, q_shape, k_shape = _batch()
    geo = gc.geometry(128, "bfloat16", "cuda", 4, partition_size > 0, None)
    kw = dict(scale=0.1, use_sinks=True, sliding_window=50, softcap=None, partition_size=partition_size,
              backend="cuda", geo=geo, prefetch=0, rows=None, pool_dtype=mx.bfloat16)
    chained, plain = _chained_and_plain(lambda: gc.per_token_launch(q_shape, mx.bfloat16, k_shape, md, **kw),
                                        monkeypatch, cuda_fused_reduce=False)
    assert isinstance(chained, gc.ChainedPerTokenLaunch) and isinstance(plain, gc.PerTokenLaunch)
    ch = chained.chain
    pt = plain.launch.kwargs
    # The per-token kernel: same template, grid (in threadgroups), signature and parameters.
    f0 = fake_chains[0]
    assert f0["name"] == "paged_attention" and f0["template"] == _names(pt["template"])
    assert [n for n, _ in f0["inputs"]] == list(gc.PA_INPUTS)
    assert [n for n, _ in f0["outputs"]] == list(gc.PA_OUTPUTS[int(partition_size > 0)])
    fn, grid, block, args, reads = ch.launches[0]
    assert fn == 1000 and block == pt["threadgroup"]
    assert grid == tuple(-(-g // t) for g, t in zip(pt["grid"], pt["threadgroup"]))
    assert reads == len(gc.PA_INPUTS) and args[:reads] == list(range(len(gc.PA_INPUTS)))
    assert chained.params is plain.params and chained.fparams is plain.fparams
    n_in = len(ch.input_dtypes)
    if partition_size == 0:
        assert len(ch.launches) == 1 and ch.scratch == [] and args[reads:] == [n_in]
        assert [tuple(s) for s, _ in ch.outputs] == [tuple(s) for s in pt["output_shapes"]]
        return
    _assert_chain_reduces_like_mx_fast(ch, fake_chains, pt, plain.reduce, gc.PA_INPUTS)
    assert chained.extra is not None and np.array_equal(np.array(chained.extra), np.array(plain.reduce.params))
    assert ch.state == []


def test_a_fused_split_call_is_one_launch_that_reduces_into_the_output(fake_chains):
    # METAL_ATTN_CUDA_FUSED_REDUCE=1: the per-token kernel with PA_FUSED writes the partials
    # (scratch), the output and the arrival counters (a state input, zero, one per row and head group).
    md, q_shape, k_shape = _batch()
    geo = gc.geometry(128, "bfloat16", "cuda", 4, True, None)
    with override_settings(cuda_fused_reduce=True):
        launch = gc.per_token_launch(q_shape, mx.bfloat16, k_shape, md, scale=0.1, use_sinks=True, sliding_window=50,
                                     softcap=None, partition_size=64, backend="cuda", geo=geo, prefetch=0,
                                     rows=None, pool_dtype=mx.bfloat16)
    ch = launch.chain
    assert ch.name == "metal_attn.per_token_ps64_fused" and len(ch.launches) == 1 and len(fake_chains) == 1
    (f0,) = fake_chains
    assert f0["name"] == "paged_attention" and dict(f0["defines"])["PA_FUSED"] == 1
    assert dict(f0["defines"])["PA_SPLIT"] == 1
    assert [n for n, _ in f0["outputs"]] == [*gc.PA_OUTPUTS[1], *gc.PA_FUSED_OUTPUTS]
    assert f0["outputs"][-2:] == [("out", "bfloat16"), ("counters", "int32")]
    n_pa = len(gc.PA_INPUTS)
    counters, out = n_pa, n_pa + 1
    _, grid, _, args, reads = ch.launches[0]
    assert reads == n_pa and args == [*range(n_pa), out + 1, out + 2, out + 3, out, counters]
    assert ch.state == [counters] and ch.input_dtypes[counters] == mx.int32
    assert [tuple(s) for s, _ in ch.outputs] == [q_shape]
    assert len(ch.scratch) == 3  # the partials live for the evaluation only
    arrivals = launch.extra
    assert arrivals.dtype == mx.int32 and arrivals.size >= q_shape[0] * grid[0]
    assert not np.array(arrivals).any()
    assert tuple(ch.input_shapes[counters]) == tuple(arrivals.shape)
    # Every fused launch of the process shares one counter array per size class.
    with override_settings(cuda_fused_reduce=True):
        again = gc.per_token_launch(q_shape, mx.bfloat16, k_shape, md, scale=0.2, use_sinks=False,
                                    sliding_window=None, softcap=None, partition_size=64, backend="cuda", geo=geo,
                                    prefetch=0, rows=None)
    assert again.extra is arrivals


def test_fused_counters_come_in_power_of_two_size_classes():
    assert gc.fused_counters(1).shape == (1024,)
    assert gc.fused_counters(1024) is gc.fused_counters(1000)
    assert gc.fused_counters(1025).shape == (2048,)
    assert gc.fused_counters(5000).dtype == mx.int32 and not np.array(gc.fused_counters(5000)).any()


@pytest.mark.parametrize("fused", [True, False])
def test_a_chained_call_passes_the_inputs_in_the_kernels_order(fake_chains, fused):
    md, q_shape, k_shape = _batch()
    geo = gc.geometry(128, "bfloat16", "cuda", 4, True, None)
    with override_settings(cuda_fused_reduce=fused):
        launch = gc.per_token_launch(q_shape, mx.bfloat16, k_shape, md, scale=0.1, use_sinks=False,
                                     sliding_window=None, softcap=None, partition_size=64, backend="cuda", geo=geo,
                                     prefetch=0, rows=None)
    q, k, v = mx.zeros(q_shape, mx.bfloat16), mx.zeros(k_shape, mx.bfloat16), mx.ones(k_shape, mx.bfloat16)
    launch(q, k, v, md, None)
    (got,) = launch.chain.calls
    want = [q, k, v, md.block_tables, md.seq_lens, md.cu_seqlens_q, launch.zero_sinks, launch.params, launch.fparams,
            launch.extra]
    assert len(got) == len(want) == len(launch.chain.input_dtypes)
    assert all(a is b for a, b in zip(got, want))
    assert [a.dtype for a in got] == launch.chain.input_dtypes
    assert [tuple(a.shape) for a in got] == [tuple(s) for s in launch.chain.input_shapes]


def test_without_the_module_chains_are_off_and_say_why():
    # No machine of CI has MLX's CUDA backend, so the module never loads there.
    if mx.cuda.is_available():
        pytest.skip("this process has MLX's CUDA backend")
    assert cuda_ops.native() is None and not cuda_ops.enabled()
    assert "CUDA backend" in cuda_ops.unavailable_reason()
    with pytest.raises(RuntimeError, match="CUDA chains are not available: MLX's CUDA backend"):
        cuda_ops.chain("x", [], [((1,), mx.float32)], [], [])
    assert cuda_ops.pool_stats() is None  # no pool either; trimming it is a no-op
    cuda_ops.trim_pool()


def test_the_runtime_source_is_the_mx_fast_shape_after_the_nvrtc_preamble():
    text = cuda_ops.runtime_source("k", "// header\n", "out[0] = a[0];", [("a", "bfloat16"), ("t", "int32")],
                                   [("out", "float32")], [("T", "bfloat16"), ("N", 4)])
    assert text.startswith(cuda_ops._PREAMBLE + "// header\n")
    assert ("namespace mlx::core::cu {\n__global__ void k(const __nv_bfloat16* a, const int32_t* t, float* out) {\n"
            "  using T = __nv_bfloat16;\n  constexpr int N = 4;\nout[0] = a[0];\n}\n}\n") in text


def test_threadgroups_are_the_mx_fast_grid_over_the_threadgroup():
    assert cuda_ops.threadgroups((1000, 3, 8), (128, 1, 1)) == (8, 3, 8)
    assert cuda_ops.threadgroups((128, 1, 1), (128, 1, 1)) == (1, 1, 1)


def _gathered_runs(monkeypatch, chained: bool):
    from metal_attn.providers import sdpa_prefill as sp

    # Two decode rows, then two runs of chunks: 2 x 8 rows ending at 40 tokens, 1 x 5 rows at 70.
    md = AttentionMetadata.build(np.arange(25, dtype=np.int32).reshape(5, 5), [30, 31, 40, 40, 70],
                                 [0, 1, 2, 10, 18, 23], validate=False)
    args = (md, 2, (23, 8, 128), (25, 16, 2, 128), mx.bfloat16, mx.bfloat16, 2, "cuda")
    if chained:
        return sp.run_launches(*args)
    monkeypatch.setattr(cuda_ops, "enabled", lambda: False)
    with fake_cuda():
        return sp.run_launches(*args)


def test_a_chained_batch_launches_what_the_mx_fast_route_launches(fake_chains, monkeypatch):
    """Two runs: one gather chain (gather_kv, first_flagged per run) and one finish chain whose
    launches write one output, the lead rows then each run's rows (``out_row0``)."""
    from metal_attn.providers import sdpa_prefill as sp

    chained = _gathered_runs(monkeypatch, True)
    plain = _gathered_runs(monkeypatch, False)
    assert chained.chained is not None and plain.chained is None
    assert len(chained.runs) == len(plain.runs) == 2
    g, f = chained.chained.gather.chain, chained.chained.finish.chain
    assert len(g.launches) == 4 and len(f.launches) == 2
    gather_fn, first_fn, finish_fn = fake_chains  # compiled once, shared by the runs' launches
    for i, (c, p) in enumerate(zip(chained.runs, plain.runs)):
        assert c.gather is c.first is c.finish is None
        assert isinstance(p.gather, gc.KernelLaunch) and isinstance(p.first, gc.KernelLaunch)
        assert (c.takes_lead, p.takes_lead) == (i == 0, i == 0)
        for name in ("gather_params", "first_params"):
            assert np.array_equal(np.array(getattr(c, name)), np.array(getattr(p, name)))
        # The finish's parameters are the mx.fast route's but for where the run's rows go.
        want_row0 = 0 if i == 0 else 2 + chained.runs[0].rows
        plain_params = list(np.array(p.finish_params))
        assert list(np.array(c.finish_params)) == [*plain_params[:6], want_row0, 0, plain_params[8]]
        assert plain_params[6:8] == [0, 0]  # out_row0, in_place
        gk, fk, ffk = p.gather.kwargs, p.first.kwargs, p.finish.kwargs
        assert gather_fn["name"] == "gather_kv" and gather_fn["template"] == _names(gk["template"])
        assert [n for n, _ in gather_fn["inputs"]] == list(sp.GATHER_INPUTS)
        assert [n for n, _ in gather_fn["outputs"]] == list(sp.GATHER_OUTPUTS)
        assert first_fn["name"] == "first_flagged" and first_fn["template"] == _names(fk["template"])
        assert finish_fn["name"] == "sdpa_finish" and finish_fn["template"] == _names(ffk["template"])
        assert [n for n, _ in finish_fn["inputs"]] == list(sp.FINISH_INPUTS)
        (_, g_grid, g_block, g_args, g_reads), (_, f_grid, f_block, f_args, f_reads) = g.launches[2 * i:2 * i + 2]
        assert g_block == gk["threadgroup"] and g_grid == cuda_ops.threadgroups(gk["grid"], gk["threadgroup"])
        assert f_block == fk["threadgroup"] and f_grid == cuda_ops.threadgroups(fk["grid"], fk["threadgroup"])
        # Buffers: 3 + 2 * 2 inputs (pools, table, each run's two parameter arrays), then each run's
        # K, V and first flags (the mx.fast shapes), then each run's flags as scratch.
        assert [tuple(s) for s, _ in g.outputs[3 * i:3 * i + 3]] == [
            tuple(s) for s in (*gk["output_shapes"][:2], *fk["output_shapes"])]
        assert tuple(g.scratch[i][0]) == tuple(gk["output_shapes"][2])
        k, bad = 7 + 3 * i, 13 + i
        assert (g_args, g_reads) == ([0, 1, 2, 3 + 2 * i, k, k + 1, bad], 4)
        assert (f_args, f_reads) == ([bad, 4 + 2 * i, k + 2], 2)
        _, n_grid, n_block, n_args, n_reads = f.launches[i]
        assert n_block == ffk["threadgroup"] and n_grid == cuda_ops.threadgroups(ffk["grid"], ffk["threadgroup"])
        assert (n_args, n_reads) == ([4 * i, 4 * i + 1, 4 * i + 2, 8, 4 * i + 3, 9], 5)
    total = 2 + sum(r.rows for r in chained.runs)
    assert [tuple(s) for s, _ in f.outputs] == [(total, 8, 128)]
    assert f.initial == []  # two runs and lead rows: the finish copies each run's output into one


@pytest.mark.parametrize("in_place", [True, False])
def test_one_run_without_lead_rows_finishes_in_the_fused_output(fake_chains, in_place):
    """Two equal prompts are one run: the finish chain's output starts as the fused output (input 0),
    its launch reads the output in the fused output's place and its parameters say in_place; the
    setting off gives the copying finish."""
    from metal_attn.providers import sdpa_prefill as sp

    md = AttentionMetadata.build(np.arange(10, dtype=np.int32).reshape(2, 5), [70, 70], [0, 70, 140],
                                 validate=False)
    with override_settings(cuda_finish_in_place=in_place):
        plan = sp.run_launches(md, 0, (140, 8, 128), (25, 16, 2, 128), mx.bfloat16, mx.bfloat16, 0, "cuda")
    (run,) = plan.runs
    f = plan.chained.finish.chain
    ((_, _, _, args, reads),) = f.launches
    assert list(np.array(run.finish_params)) == [70, 70, 2, 8, 2, 0, 0, int(in_place), 1]
    assert [tuple(s) for s, _ in f.outputs] == [(140, 8, 128)]
    if in_place:
        assert f.initial == [(0, 0)] and (args, reads) == ([5, 1, 2, 4, 3, 5], 5)
    else:
        assert f.initial == [] and (args, reads) == ([0, 1, 2, 4, 3, 5], 5)


def test_a_chained_batch_passes_its_inputs_in_the_kernels_order(fake_chains, monkeypatch):
    plan = _gathered_runs(monkeypatch, True)
    runs, ch = plan.runs, plan.chained
    kc, vc = mx.zeros((25, 16, 2, 128), mx.bfloat16), mx.ones((25, 16, 2, 128), mx.bfloat16)
    bt = mx.zeros((5, 5), mx.int32)
    gathered = ch.gather_flagged(kc, vc, bt)
    (got,) = ch.gather.chain.calls
    want = [kc, vc, bt, runs[0].gather_params, runs[0].first_params, runs[1].gather_params, runs[1].first_params]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    assert [a.dtype for a in got] == ch.gather.chain.input_dtypes
    (k0, v0, f0), (k1, v1, f1) = gathered
    assert k0.shape == v0.shape == (2, 2, 40, 128) and f0.shape == (4,)
    assert k1.shape == v1.shape == (1, 2, 70, 128) and f1.shape == (2,)
    outs = [mx.zeros((r.rows, 8, 128), mx.bfloat16) for r in runs]
    qs = [mx.zeros((r.rows, 8, 128), mx.bfloat16) for r in runs]
    lead = mx.zeros((2, 8, 128), mx.bfloat16)
    out = ch.finish_rows(runs, outs, qs, [f0, f1], lead)
    (got,) = ch.finish.chain.calls
    want = [outs[0], qs[0], f0, runs[0].finish_params, outs[1], qs[1], f1, runs[1].finish_params, lead]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    assert [a.dtype for a in got] == ch.finish.chain.input_dtypes
    assert out.shape == (2 + 16 + 5, 8, 128)


@pytest.mark.parametrize("pooled", [True, False])
def test_chains_take_their_memory_as_the_pool_setting_says(fake_chains, pooled):
    # METAL_ATTN_CUDA_CHAIN_POOL reaches the module's Chain: its buffers from our device memory pool,
    # or MLX's allocator (docs/cuda-ops.md, "Where a chain's memory comes from").
    with override_settings(cuda_chain_pool=pooled):
        c = cuda_ops.chain("c", [mx.float32], [((4,), mx.float32)], [], [(1000, (1, 1, 1), (32, 1, 1), [0, 1], 1)])
    assert c.pooled is pooled


def _idle_launch(seq_lens, rows=None, window=None):
    """The chained per-token launch over one decode batch of these context lengths (bfloat16 pools of
    8 KV heads of 128: 4 KiB of K+V a token)."""
    n = len(seq_lens)
    width = max(-(-s // 16) for s in seq_lens)
    md = AttentionMetadata.build(np.arange(n * width, dtype=np.int32).reshape(n, width), list(seq_lens),
                                 list(range(n + 1)), validate=False)
    geo = gc.geometry(128, "bfloat16", "cuda", 4, True, None)
    return gc.per_token_launch((n, 32, 128), mx.bfloat16, (n * width, 16, 8, 128), md, scale=0.1, use_sinks=False,
                               sliding_window=window, softcap=None, partition_size=512, backend="cuda", geo=geo,
                               prefetch=0, rows=rows, pool_dtype=mx.bfloat16)


@pytest.mark.parametrize("setting", [None, True, False])
def test_chains_start_an_idle_gpu_by_the_rule_or_the_setting(fake_chains, setting):
    # IDLE_COMMIT_RULE: a whole call reading at least 64 MiB of K/V commits MLX's graph when it finds the
    # GPU idle, a mixed batch's decode rows (rows given) never; METAL_ATTN_CUDA_COMMIT_WHEN_IDLE=1/0
    # overrides it for every per-token chain.
    assert gc.IDLE_COMMIT_RULE.min_kv_bytes == 64 << 20
    token = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bfloat16
    at_bound = (64 << 20) // token  # 16,384 tokens
    with override_settings(cuda_commit_when_idle=setting):
        big = _idle_launch([at_bound // 2, at_bound // 2])
        small = _idle_launch([at_bound // 2, at_bound // 2 - 1])
        # rows (a mixed batch's decode rows): never by the rule, however many bytes they read
        rows = _idle_launch([at_bound, at_bound], rows=1)
        # a sliding window caps what each sequence reads: twice the bound's tokens, windowed to under it
        windowed = _idle_launch([at_bound, at_bound], window=at_bound // 2 - 1)
    want = (True, False, False, False) if setting is None else (setting,) * 4
    got = (big.chain.commit_when_idle, small.chain.commit_when_idle, rows.chain.commit_when_idle,
           windowed.chain.commit_when_idle)
    assert got == want


@pytest.mark.parametrize("direct", [0, 1, 6])
def test_direct_launches_go_only_to_chains_that_start_an_idle_gpu(fake_chains, direct):
    # METAL_ATTN_CUDA_IDLE_DIRECT_CHAINS: how many chains from the one that finds the GPU idle launch straight
    # onto MLX's stream. A chain that never starts the GPU gets 0, whatever the setting.
    at_bound = (64 << 20) // (2 * 8 * 128 * 2)
    with override_settings(cuda_idle_direct_chains=direct):
        big = _idle_launch([at_bound // 2, at_bound // 2])
        small = _idle_launch([at_bound // 2, at_bound // 2 - 1])
    assert (big.chain.commit_when_idle, big.chain.direct_when_idle) == (True, direct)
    assert (small.chain.commit_when_idle, small.chain.direct_when_idle) == (False, 0)


def test_direct_launch_setting_refuses_a_negative_count():
    with pytest.raises(ValueError, match="cuda_idle_direct_chains"):
        Settings(cuda_idle_direct_chains=-1)


def test_the_idle_commit_rule_decides_by_bytes_and_whole_calls_unless_the_setting_says():
    rule = gc.IDLE_COMMIT_RULE
    unset, on = (type("S", (), {"cuda_commit_when_idle": v})() for v in (None, True))
    assert gc.commit_when_idle(rule.min_kv_bytes, True, unset)
    assert not gc.commit_when_idle(rule.min_kv_bytes - 1, True, unset)
    assert not gc.commit_when_idle(rule.min_kv_bytes, False, unset)
    assert gc.commit_when_idle(0, False, on)


def test_bench_reports_the_graphs_chains_launched_for_the_gpu(fake_chains, monkeypatch):
    # metal-attn bench ends a run that built chains with the module's counts (a process total).
    import io

    from metal_attn.bench import cli

    monkeypatch.setattr(cuda_ops, "idle_commits", lambda: {"idle": 3, "ahead": 5, "direct": 4})
    monkeypatch.setattr(cuda_ops, "chains_built", type(cuda_ops.chains_built)({"metal_attn.per_token_ps512": 1}))
    err = io.StringIO()
    cli._report_idle_commits(err)
    assert err.getvalue() == ("CUDA chains: graphs launched for the GPU (commit_when_idle), this process: 3 on an "
                              "idle GPU, 5 ahead of it; 4 chains launched straight onto the stream "
                              "(cuda_idle_direct_chains)\n")
    monkeypatch.setattr(cuda_ops, "chains_built", type(cuda_ops.chains_built)())
    err = io.StringIO()
    cli._report_idle_commits(err)
    assert err.getvalue() == ""  # no chains built: nothing to report


def _explained_idle_note(**fields) -> str:
    """explain's idle-launch line for the classic provider's plan on the H200 preset (bfloat16, 32/8 heads of 128)."""
    from metal_attn.api import explain

    fields = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16", "block_size": 16} | fields
    row = next(r for r in explain(device="h200", **fields).rows if r.name == "classic")
    return next(n for n in row.plan.notes if n.startswith("idle-GPU launch"))


@given(seq_lens=st.lists(st.integers(1, 40_000), min_size=1, max_size=6),
       window=st.one_of(st.none(), st.integers(1, 40_000)))
@hyp_settings(max_examples=60, deadline=None)
def test_explain_says_what_the_call_decides_about_an_idle_gpu(seq_lens, window):
    # explain sees the lengths only as whole partitions: where it gives a verdict, the call (its exact lengths)
    # must decide the same; where the range straddles the bound it says so.
    note = _explained_idle_note(q_lens=[1] * len(seq_lens), seq_lens=seq_lens, sliding_window=window)
    exact = gc.kv_bytes_read(seq_lens, window, 8, 128, 2)
    decided = gc.commit_when_idle(exact, True, type("S", (), {"cuda_commit_when_idle": None})())
    verdict = note.rsplit("-> ", 1)[1]
    assert verdict in ("asks", "does not ask", "depends on the exact lengths")
    if verdict != "depends on the exact lengths":
        assert decided is (verdict == "asks"), (note, exact)
    low, _, high = note.split("reads ")[1].split(" MiB")[0].partition("-")
    assert float(low) <= exact / 2**20 + 0.05 and exact / 2**20 <= float(high or low) + 0.05, (note, exact)


def test_explain_shows_the_idle_launch_for_decode_rows_and_the_setting():
    bound = 16_384  # tokens of 4 KiB of K+V: 64 MiB
    assert _explained_idle_note(q_lens=[1, 1], seq_lens=[bound // 2] * 2) == (
        "idle-GPU launch (CUDA chains): reads 64.0 MiB of K/V, IDLE_COMMIT_RULE.min_kv_bytes=64 MiB -> asks")
    assert _explained_idle_note(q_lens=[1], seq_lens=[bound - 256]).endswith("-> does not ask")
    # 5 x 3,300 tokens: 12 whole partitions of 256 each (15,360 tokens) and up to 255 more each (16,635)
    assert _explained_idle_note(q_lens=[1] * 5, seq_lens=[3300] * 5).endswith("-> depends on the exact lengths")
    with override_settings(cuda_commit_when_idle=False):
        assert _explained_idle_note(q_lens=[1], seq_lens=[4 * bound]).endswith("(METAL_ATTN_CUDA_COMMIT_WHEN_IDLE=0)")
    # a mixed batch's decode rows (the SDPA prefill route's plan) never ask by the rule
    from metal_attn.api import explain

    ex = explain(device="h200", q_lens=[1, 1, 512], seq_lens=[4 * bound, 4 * bound, 2048], num_heads=32,
                 num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    notes = " ".join(n for r in ex.rows if r.name == "sdpa_prefill" for n in r.plan.notes)
    assert "idle-GPU launch (CUDA chains): no (a mixed batch's decode rows" in notes


def test_chain_kernel_functions_keep_define_values_of_other_types_apart(monkeypatch):
    """The chains' function cache keyed defines by value alone: 1 and 1.0 (two texts, ``#define X 1`` and
    ``1.0``) gave one compiled function; `kernels.load_kernel` already kept them apart."""
    from metal_attn import cuda_ops

    built = []
    monkeypatch.setattr(cuda_ops, "compile_function", lambda func, src: (built.append(src), len(built))[1])
    cuda_ops._kernel_function.cache_clear()
    args = (("reshape_and_cache.metal",),)
    sig = ((("key", "float32"),), (("k_out", "float32"),), (("T", "float32"),))
    one = cuda_ops.kernel_function("reshape_and_cache", *args, (("MA_PROBE", 1),), *sig)
    again = cuda_ops.kernel_function("reshape_and_cache", *args, {"MA_PROBE": 1}, *sig)
    other = cuda_ops.kernel_function("reshape_and_cache", *args, (("MA_PROBE", 1.0),), *sig)
    cuda_ops._kernel_function.cache_clear()
    assert one == again != other and len(built) == 2
    assert "#define MA_PROBE 1.0" in built[1] and "#define MA_PROBE 1.0" not in built[0]


def test_the_stream_spin_runs_only_with_the_module_loaded_and_the_gpu_the_default(monkeypatch):
    # spin_until_idle (benchmarks/probe_step_wait.py's third wait): the module's spin where it is loaded and
    # MLX's default device is the GPU its stream belongs to; None otherwise, with no spin made.
    with fake_cuda_chains() as fake:
        assert cuda_ops.spin_until_idle() is None and fake.spins == 0  # the CPU is the default device here
        monkeypatch.setattr(cuda_ops, "_gpu_is_default", lambda: True)
        assert cuda_ops.spin_until_idle() == 1 and fake.spins == 1  # the fake GPU is idle: one poll
    assert cuda_ops.spin_until_idle() is None  # no module outside the fake



def _tiled_batch():
    """A continuation chunk of 48 rows after 200 tokens and a 40-row prompt: bfloat16 pools of 2 KV heads
    of 128, 16-token pages."""
    md = AttentionMetadata.build(np.arange(32, dtype=np.int32).reshape(2, 16), [248, 40], [0, 48, 88],
                                 validate=False)
    return md, (88, 8, 128), (32, 16, 2, 128)


@pytest.mark.parametrize("partition_size", [0, 64])
def test_a_chained_tiled_call_launches_what_the_mx_fast_route_launches(fake_chains, partition_size, monkeypatch):
    """METAL_ATTN_CUDA_TILED_CHAINS=1: the tiled kernel (and, split, the reducer) as one chain with the
    mx.fast route's template, defines, grid, signature and parameters; the partials are its scratch."""
    from metal_attn.providers import tiled_prefill as tp

    md, q_shape, k_shape = _tiled_batch()
    cfg = tp.tile_config("cuda", 128)
    kw = dict(scale=0.1, use_sinks=True, sliding_window=None, softcap=None, backend="cuda", config=cfg,
              first_seq=0, partition_size=partition_size)
    chained, plain = _chained_and_plain(lambda: tp.tiled_launch(q_shape, mx.bfloat16, k_shape, md, **kw),
                                        monkeypatch, cuda_tiled_chains=True)
    assert isinstance(chained, tp.ChainedTiledLaunch) and isinstance(plain, tp.TiledLaunch)
    ch, pk = chained.chain, plain.launch.kwargs
    split = partition_size > 0
    assert ch.name == ("metal_attn.tiled_prefill_ps64" if split else "metal_attn.tiled_prefill")
    f0 = fake_chains[0]
    assert f0["name"] == "tiled_prefill" and f0["template"] == _names(pk["template"])
    assert tuple(f0["defines"]) == tp.kernel_defines(cfg, split)
    assert [n for n, _ in f0["inputs"]] == list(tp.KERNEL_INPUTS)
    assert [n for n, _ in f0["outputs"]] == list(tp.SPLIT_OUTPUTS if split else tp.KERNEL_OUTPUTS)
    fn, grid, block, args, reads = ch.launches[0]
    assert fn == 1000 and block == pk["threadgroup"]
    assert grid == cuda_ops.threadgroups(pk["grid"], pk["threadgroup"])
    n_k = len(tp.KERNEL_INPUTS)
    assert reads == n_k and args[:reads] == list(range(n_k))
    assert chained.tiles is plain.tiles and chained.params is plain.params
    assert np.array_equal(np.array(chained.fparams), np.array(plain.fparams))
    n_in = len(ch.input_dtypes)
    assert [d for _, d in f0["inputs"]] == [str(d).removeprefix("mlx.core.") for d in ch.input_dtypes[:n_k]]
    if not split:
        assert len(ch.launches) == 1 and ch.scratch == [] and args[reads:] == [n_in]
        assert [tuple(s) for s, _ in ch.outputs] == [tuple(s) for s in pk["output_shapes"]]
        assert chained.reduce_params is None
        return
    _assert_chain_reduces_like_mx_fast(ch, fake_chains, pk, plain.reduce, tp.KERNEL_INPUTS)
    assert np.array_equal(np.array(chained.reduce_params), np.array(plain.reduce.params))


@pytest.mark.parametrize("on", [False, True])
def test_tiled_chains_follow_their_setting(on):
    # On by default (measured on a GPU, forty-fourth session): the chain, called with the kernel's inputs in
    # its order and float32 sinks (the reducer's), whatever the caller's sinks dtype; off: the mx.fast launches.
    from metal_attn.providers import tiled_prefill as tp

    assert Settings.model_fields["cuda_tiled_chains"].default is True
    md, q_shape, k_shape = _tiled_batch()
    with fake_cuda_chains() as chains, override_settings(cuda_tiled_chains=on), fake_cuda():
        launch = tp.tiled_launch(q_shape, mx.bfloat16, k_shape, md, scale=0.1, use_sinks=True, sliding_window=None,
                                 softcap=None, backend="cuda", config=tp.tile_config("cuda", 128), first_seq=0,
                                 partition_size=64)
        if not on:
            assert isinstance(launch, tp.TiledLaunch) and not chains.chains
            return
        q, kc = mx.zeros(q_shape, mx.bfloat16), mx.zeros(k_shape, mx.bfloat16)
        out = launch(q, kc, kc, md, mx.zeros((8,), mx.bfloat16))
    (chain,) = chains.chains
    (got,) = chain.calls
    want = [q, kc, kc, md.block_tables, md.seq_lens, md.cu_seqlens_q, launch.tiles]
    assert len(got) == len(tp.KERNEL_INPUTS) + 1 and all(a is b for a, b in zip(got, want))
    assert got[8] is launch.params and got[9] is launch.fparams and got[10] is launch.reduce_params
    assert got[7].dtype == mx.float32 and got[7].shape == (8,)
    assert [a.dtype for a in got] == chain.input_dtypes
    assert out.shape == q_shape


def _mixed_calls(in_chain: bool, route: str, fused: bool, wait: str = "none"):
    """A mixed batch (three decode rows, then chunks of 200 rows after 600 and 900 tokens: two runs) through
    ``sdpa_prefill`` twice on faked CUDA and chains (``wait``: ``cuda_decode_rows_wait``): the second call's
    chain calls, ``{chain name: (chain, its inputs)}``, the spec of a kernel function by its handle, and the
    call's query, pool and metadata."""
    import metal_attn as ma
    from metal_attn.testing.overrides import forced_per_token_route

    seq_lens, q_lens = [300, 1000, 17, 600, 900], [1, 1, 1, 200, 200]
    width = max(-(-s // 16) for s in seq_lens)
    md = AttentionMetadata.build(np.arange(5 * width, dtype=np.int32).reshape(5, width), seq_lens,
                                 np.concatenate([[0], np.cumsum(q_lens)]))
    q, pool = mx.zeros((403, 8, 128), mx.bfloat16), mx.zeros((5 * width, 16, 2, 128), mx.bfloat16)
    sinks = mx.zeros((8,), mx.float32)
    with (fake_cuda_chains() as fake, fake_cuda(sdpa="zeros"),
          override_settings(cuda_decode_rows_in_chain=in_chain, cuda_fused_reduce=fused, cuda_decode_rows_wait=wait),
          forced_per_token_route(route)):
        for _ in range(2):
            before = {id(c): len(c.calls) for c in fake.chains}
            out = ma.paged_attention(q, pool, pool, metadata=md, scale=0.1, sinks=sinks, provider="sdpa_prefill")
        assert diagnostics.last_dispatch().route == "sdpa_prefill_decode"  # the decode rows split off
        assert out.shape == (403, 8, 128)
        calls = [(c, call) for c in fake.chains for call in c.calls[before.get(id(c), 0):]]
        assert len({c.name for c, _ in calls}) == len(calls)  # each chain called once
        named = {c.name: (c, call) for c, call in calls}
        return named, (lambda fn: fake.functions[fn - 1000]), (q, pool, md)


@pytest.mark.parametrize(("route", "fused"), [("per_token_ps0", False), ("per_token_ps64", False),
                                              ("per_token_ps64", True)])
def test_a_mixed_batch_s_decode_rows_run_inside_the_finish_chain_when_asked(route, fused):
    # METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=1: the decode rows' per-token launches (and reducer) become the
    # finish chain's first launches, the same functions, grids and parameters as their chain of its own, its
    # buffers mapped into the finish chain's and its output the batch's; the finishes copy no lead rows and
    # place the first run after them. Two chain calls a batch instead of three.
    from metal_attn.providers import sdpa_prefill as sp

    off, spec_off, _ = _mixed_calls(False, route, fused)
    on, spec_on, (q, pool, md) = _mixed_calls(True, route, fused)
    per_token = next(name for name in off if name.startswith("metal_attn.per_token_ps"))
    assert sorted(off) == sorted(["metal_attn.gather_kv", "metal_attn.sdpa_finish", per_token])
    assert sorted(on) == ["metal_attn.gather_kv", "metal_attn.sdpa_finish_decode"]
    (alone, alone_in), (plain, plain_in) = off[per_token], off["metal_attn.sdpa_finish"]
    chain, chain_in = on["metal_attn.sdpa_finish_decode"]
    assert alone.name.endswith("_fused") == fused and alone.state == ([len(gc.PA_INPUTS)] if fused else [])
    # The gathers are unchanged.
    g_on, g_off = on["metal_attn.gather_kv"][0], off["metal_attn.gather_kv"][0]
    assert [(spec_on(fn), *rest) for fn, *rest in g_on.launches] == [(spec_off(fn), *rest) for fn, *rest in
                                                                      g_off.launches]
    # The finish chain's inputs: the plain finish chain's (the lead rows' place a placeholder), then the
    # per-token chain's, all of them, in order.
    n_plain = len(plain_in)
    assert len(chain_in) == n_plain + len(alone_in)
    assert plain_in[n_plain - 1] is alone._zeros[0] and chain_in[n_plain - 1].size == 1  # no lead rows to copy
    assert all(a is b for a, b in zip(chain_in[n_plain:n_plain + 6], (q, pool, pool, md.block_tables, md.seq_lens,
                                                                     md.cu_seqlens_q)))
    for got, want in zip(chain_in[n_plain + 6:], alone_in[6:]):  # sinks, params, fparams, the reducer's or counters
        assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want))
    assert chain.input_dtypes == [*plain.input_dtypes, *alone.input_dtypes]
    # Its launches: the per-token chain's first, into the output (buffer n_in), then the finishes.
    n_in, n_pa = len(chain_in), len(alone.launches)
    where = [*range(n_plain, n_in), n_in, *range(n_in + 1, n_in + 1 + len(alone.scratch))]
    for (fn, g, b, args, reads), (fn0, g0, b0, args0, reads0) in zip(chain.launches[:n_pa], alone.launches):
        assert (spec_on(fn), g, b, reads) == (spec_off(fn0), g0, b0, reads0) and args == [where[a] for a in args0]
    assert chain.state == [where[i] for i in alone.state] and chain.scratch == alone.scratch
    assert chain.outputs == plain.outputs and [tuple(s) for s, _ in chain.outputs] == [(403, 8, 128)]
    finishes = chain.launches[n_pa:]
    assert len(finishes) == len(plain.launches) == 2
    for (fn, _, b, args, reads), (fn0, _, b0, args0, reads0) in zip(finishes, plain.launches):
        assert (spec_on(fn), b, reads) == (spec_off(fn0), b0, reads0)
        assert args == [n_in if a == n_plain else a for a in args0]  # the output moved after the new inputs
    assert finishes[1][1] == plain.launches[1][1]  # the second run's grid; the first's has no lead rows now
    # The finish parameters: no lead rows; the first run's rows after the decode rows, as the second's already were.
    params = [list(np.array(p)) for p in chain_in[3:n_plain - 1:4]]
    params_off = [list(np.array(p)) for p in plain_in[3:n_plain - 1:4]]
    assert [p[5:7] for p in params_off] == [[3, 0], [0, 3 + 200]]  # lead, out_row0 with the rows' own chain
    assert [p[5:7] for p in params] == [[0, 3], [0, 3 + 200]]
    assert [p[:5] for p in params] == [p[:5] for p in params_off]
    per, threads = sp.finish_launch(200 * 8)
    assert params[0][8] == per and finishes[0][1] == cuda_ops.threadgroups((threads, 1, 1), (sp.FINISH_THREADS, 1, 1))


@pytest.mark.parametrize(("route", "fused"), [("per_token_ps0", False), ("per_token_ps64", True)])
def test_the_decode_rows_in_the_finish_chain_wait_for_what_the_setting_names(route, fused):
    # METAL_ATTN_CUDA_DECODE_ROWS_WAIT: the rows' launches (not the finishes) wait for the first run's flags
    # (the gather chain's output) or its fused SDPA output; the chain is otherwise the same, and by default
    # they wait for nothing but their inputs.
    base, _, _ = _mixed_calls(True, route, fused)
    chain0, in0 = base["metal_attn.sdpa_finish_decode"]
    assert chain0.after == []
    first_finish = chain0.launches[-2]  # the first run's sdpa_finish: args o, q rows, first, lead, params, out
    for wait, arg in (("gathers", 2), ("sdpa", 0)):
        got, _, _ = _mixed_calls(True, route, fused, wait=wait)
        chain, chain_in = got["metal_attn.sdpa_finish_decode"]
        # The rows' first launch waits for the input the first run's finish reads as `first` (or `o`).
        ((launch, at),) = chain.after
        assert launch == 0 and at == first_finish[3][arg]
        assert (chain.launches, chain.state, chain.scratch, chain.outputs) == (chain0.launches, chain0.state,
                                                                               chain0.scratch, chain0.outputs)
        assert [a.shape for a in chain_in] == [a.shape for a in in0]
        gather, _ = got["metal_attn.gather_kv"]
        if wait == "gathers":  # the first run's first flagged positions, as the gather chain returned them
            assert chain_in[at] is gather._zeros[2]
        else:  # the first run's fused SDPA output, in packed rows (not its query rows, the next input)
            assert chain_in[at].shape == (200, 8, 128) and chain_in[at] is not chain_in[at + 1]


def test_decode_rows_in_the_finish_chain_say_so_in_explain():
    from metal_attn.api import explain

    fields = dict(q_lens=[1] * 8 + [512], seq_lens=[1024] * 8 + [2048], num_heads=32, num_kv_heads=8, head_size=128,
                  dtype="bfloat16", block_size=16)
    for on in (False, True):
        with override_settings(cuda_decode_rows_in_chain=on):
            row = next(r for r in explain(device="h200", **fields).rows if r.name == "sdpa_prefill")
        note = next(n for n in row.plan.notes if n.startswith("decode rows: ") and "finish chain" in n)
        assert note.endswith(f"(METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN={int(on)})"), note
    with override_settings(cuda_decode_rows_wait="gathers"):
        row = next(r for r in explain(device="h200", **fields).rows if r.name == "sdpa_prefill")
    note = next(n for n in row.plan.notes if n.startswith("decode rows: ") and "finish chain" in n)
    assert note.endswith("waiting for the first run's gathers (METAL_ATTN_CUDA_DECODE_ROWS_WAIT=gathers)"), note


def test_a_chain_that_needs_after_names_the_rebuild_when_the_module_predates_it(monkeypatch):
    # A module built before chains took `after` refuses the keyword (nanobind's TypeError): the call says what
    # to do instead; without `after` such a module still builds the chain.
    class OldModule:
        @staticmethod
        def Chain(name, input_dtypes, outputs, scratch, launches, input_shapes, state, pooled, initial,
                  commit_when_idle, direct_when_idle):
            return name

    monkeypatch.setattr(cuda_ops, "native", lambda: OldModule)
    launch = [(1, (1, 1, 1), (32, 1, 1), [0, 1], 1)]
    assert cuda_ops.chain("old", [mx.float32], [((4,), mx.float32)], [], launch) == "old"
    with pytest.raises(RuntimeError, match=r"needs after=\[\(0, 0\)\].*predates: rebuild it"):
        cuda_ops.chain("old", [mx.float32], [((4,), mx.float32)], [], launch, after=[(0, 0)])
