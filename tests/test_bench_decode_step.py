"""The decode-step suites on the CPU: step shapes, their inputs, the candidates (one metadata, a pool pair
per layer, one eval per step), the CLI's table and JSON, and pytest-benchmark's ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn.bench import cli, decode_step, shapes, suites
from metal_attn.bench.decode_step import StepShape

REPO = Path(__file__).resolve().parents[1]


def test_a_step_shape_counts_every_layer() -> None:
    s = StepShape(4, 8, 2, 64, 256, "float32", layers=8)
    one = shapes.Shape(4, 8, 2, 64, 256, "float32")
    assert s.label == "step b4 h8/2 d64 L256 f32 x8"
    assert s.layer_kv_bytes == one.kv_bytes and s.kv_bytes == 8 * one.kv_bytes and s.flops == 8 * one.flops
    assert s.request() == one.request() and s.phase == "decode"
    d = s.to_dict()
    assert d["layers"] == 8 and d["kv_bytes"] == s.kv_bytes and d["layer_kv_bytes"] == one.kv_bytes


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layers": 0}, "StepShape.layers=0 (allowed: an int >= 1)"),
    ({"q_len": 4}, "StepShape: q_len=4, mixed=None (allowed: decode rows only"),
])
def test_bad_step_shapes_name_the_value(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StepShape(**({"batch": 2, "num_heads": 4, "num_kv_heads": 2, "head_size": 64, "context": 64} | kwargs))


def test_the_gpu_suite_is_the_8_peer_shapes_at_32_layers() -> None:
    suite = suites.get_suite("decode-step")
    got = {(s.batch, s.num_heads, s.num_kv_heads, s.head_size, s.context): s.layers for s in suite.shapes}
    want = {(s.batch, s.num_heads, s.num_kv_heads, s.head_size, s.context) for s in suites.PEER_TABLE_SHAPES}
    assert set(got) == want and len(suite.shapes) == 8
    assert got.pop((64, 32, 8, 128, 8192)) == 18 and set(got.values()) == {32}
    assert all(s.dtype == "bfloat16" and s.block_size == 16 for s in suite.shapes)
    assert {"auto", "mlx_sdpa", "torch_sdpa", "ceiling"} <= set(suite.candidates)
    # pools, MLX's contiguous copies and torch's at once must fit the H200 (139 GiB, 85% usable)
    assert max(s.memory_estimate() for s in suite.shapes) < 0.85 * 139 * 2**30


def test_layers_have_their_own_pools_and_share_one_metadata() -> None:
    s = StepShape(2, 4, 2, 64, 80, "float32", layers=3)
    case = s.build(seed=1)
    assert len(case.pools) == 3
    ks = [np.array(k) for k, _ in case.pools]
    assert all(k.shape == ks[0].shape for k in ks)
    assert not np.array_equal(ks[0], ks[1]) and not np.array_equal(ks[1], ks[2])
    assert case.metadata.seq_lens_host == (80, 80)


def test_the_provider_step_chains_every_layer_on_one_metadata_and_evaluates_once(monkeypatch) -> None:
    s = StepShape(2, 4, 2, 64, 80, "float32", layers=3)
    case = s.build()
    calls, evals = [], []
    real_pa, real_eval = metal_attn.paged_attention, mx.eval

    def pa(q, k, v, **kw):
        out = real_pa(q, k, v, **kw)
        calls.append((q, id(k), id(kw["metadata"]), out))
        return out

    def ev(*a):
        evals.append(a)
        return real_eval(*a)

    prep = decode_step.StepProvider("classic").prepare(case)
    monkeypatch.setattr(metal_attn, "paged_attention", pa)
    monkeypatch.setattr(mx, "eval", ev)
    outs = prep.run()
    monkeypatch.undo()
    assert len(evals) == 1 and len(outs) == 3
    assert {m for _, _, m, _ in calls} == {id(case.metadata)}
    assert [k for _, k, _, _ in calls] == [id(k) for k, _ in case.pools]
    # as in a model, each layer's query is the output of the layer before it
    assert calls[0][0] is case.q
    assert all(calls[i][0] is calls[i - 1][3] for i in range(1, 3))
    # each layer is attention over its own pools: against a float64 softmax on its contiguous K/V,
    # the oracle's own output being its next layer's query
    q = np.array(case.q, dtype=np.float64)  # [b, h, d]
    for out, (k, v) in zip(outs, case.contiguous_kv()):
        k, v = np.array(k, dtype=np.float64), np.array(v, dtype=np.float64)  # [b, kvh, L, d]
        kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        sc = np.einsum("bhd,bhld->bhl", q, kk) * case.scale
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want = np.einsum("bhl,bhld->bhd", p / p.sum(-1, keepdims=True), vv)
        np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-5)
        q = want


def test_the_compiled_step_traces_once_and_gives_the_eager_step_bit_for_bit(monkeypatch) -> None:
    """auto_compiled: the same layers under mx.compile; Python runs paged_attention only while tracing."""
    case = StepShape(2, 4, 2, 64, 80, "float32", layers=3).build(seed=2)
    eager = decode_step.StepProvider("auto").prepare(case).run()
    calls = []
    real_pa = metal_attn.paged_attention
    monkeypatch.setattr(metal_attn, "paged_attention", lambda *a, **kw: calls.append(1) or real_pa(*a, **kw))
    prep = decode_step.StepCompiled().prepare(case)
    first, again = prep.run(), prep.run()
    assert len(calls) == 3  # one trace of the three layers, then the compiled graph replays
    for e, a, b in zip(eager, first, again):
        assert np.array_equal(np.array(e), np.array(a)) and np.array_equal(np.array(a), np.array(b))
    assert decode_step.StepCompiled.kind == "compiled" and "under mx.compile" in prep.route


def test_staged_segments_cover_every_layer_once_in_order() -> None:
    for layers in (1, 2, 3, 5, 16, 17, 32, 100):
        cuts = decode_step.staged_segments(layers)
        assert [i for c in cuts for i in c] == list(range(layers)) and all(len(c) for c in cuts)
        assert [len(c) for c in cuts[:-1]] == list(decode_step.STAGED_SEGMENTS[:len(cuts) - 1])
    assert [len(c) for c in decode_step.staged_segments(32)] == [1, 1, 2, 4, 8, 16]
    assert [len(c) for c in decode_step.staged_segments(3, (2, 5))] == [2, 1]


def test_the_staged_step_queues_each_segment_and_gives_the_compiled_step_bit_for_bit(monkeypatch) -> None:
    """auto_staged: the layers in compiled segments, each queued (mx.async_eval) when built, one wait."""
    case = StepShape(2, 4, 2, 64, 80, "float32", layers=6).build(seed=4)
    compiled = decode_step.StepCompiled().prepare(case).run()
    prep = decode_step.StepStaged().prepare(case)
    queued, real_async = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(len(a[0])) or real_async(*a))
    first, again = prep.run(), prep.run()
    monkeypatch.undo()
    assert queued == [1, 1, 2, 2] * 2  # 6 layers: 1 + 1 + 2 + the 2 left, each segment queued once per step
    assert len(first) == len(again) == 6
    for c, a, b in zip(compiled, first, again):
        assert np.array_equal(np.array(c), np.array(a)) and np.array_equal(np.array(a), np.array(b))
    assert "compiled segments of 1+1+2+2" in prep.route and decode_step.StepStaged.kind == "compiled"


def test_decode_step_cpu_from_the_command_line(tmp_path, capsys) -> None:
    path = tmp_path / "step.json"
    rc = cli.main(["--suite", "decode-step-cpu", "--iters", "2", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    (suite,) = json.loads(path.read_text())["suites"]
    labels = [s.label for s in suites.get_suite("decode-step-cpu").shapes]
    assert [r["shape"]["label"] for r in suite["results"]] == labels
    for r in suite["results"]:
        c = {x["name"]: x for x in r["candidates"]}
        for name in ("auto", "auto_compiled", "classic"):
            assert c[name]["status"] == "ok" and c[name]["check"]["ok"] is True
            assert c[name]["check"]["against"] == "mlx_sdpa"
            assert set(c[name]["ratios"]) == {"speedup_vs_mlx_sdpa_ratio", "ceiling_fraction_ratio"}
            assert c[name]["ratios"]["speedup_vs_mlx_sdpa_ratio"] == pytest.approx(
                c["mlx_sdpa"]["median_s"] / c[name]["median_s"])
            assert c[name]["gbps"] == pytest.approx(r["shape"]["kv_bytes"] / c[name]["median_s"] / 1e9)
        assert c["torch_sdpa"]["status"] == "unavailable" and c["gqa_decode"]["status"] == "refused"
        assert c["ceiling"]["status"] == "ok" and r["ceiling_gbps"] > 0
    assert "step b4 h8/2 d64 L256 f32 x8" in out


def test_pytest_benchmark_records_same_run_ratios(tmp_path) -> None:
    """The decode-step-cpu suite under pytest-benchmark: each saved benchmark carries its ratios."""
    pytest.importorskip("pytest_benchmark")
    out = tmp_path / "pb.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(REPO / "benchmarks" / "test_bench_suite.py"),
         "--benchmark-only", "--bench-suite", "decode-step-cpu", "--bench-shapes", "L256",
         "--benchmark-json", str(out), "--benchmark-max-time=0.02", "--benchmark-min-rounds=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = {b["extra_info"]["candidate"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(bench) == {"auto", "auto_compiled", "classic", "mlx_sdpa"}
    for name in ("auto", "classic"):
        info, median = bench[name]["extra_info"], bench[name]["stats"]["median"]
        assert info["speedup_vs_mlx_sdpa_ratio"] == pytest.approx(bench["mlx_sdpa"]["stats"]["median"] / median)
        assert info["ceiling_fraction_ratio"] == pytest.approx(info["ceiling_s"] / median)
        assert bench[name]["group"] == "step b4 h8/2 d64 L256 f32 x8"
