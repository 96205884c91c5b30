"""The benchmark framework on the CPU, on tiny shapes: arithmetic, inputs, peers, timing, CLI, JSON."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal_attn.bench import baselines, candidates, cli, core, peers, render, shapes, suites, timing
from metal_attn.bench.shapes import Rows, Shape
from metal_attn.bench.timing import Timing
from metal_attn.device import current_device
from metal_attn.errors import NoProviderError
from metal_attn.settings import override_settings
from metal_attn.testing.oracle import attention_oracle

SMOKE = suites.get_suite("smoke")


def _timing(median: float) -> Timing:
    return Timing(median, median, median, 0.0, (median,), 1)


# -- arithmetic ----------------------------------------------------------------------------------------


def test_decode_bytes_and_gbps_for_a_known_shape() -> None:
    s = Shape(3, 4, 2, 64, 100, "float32")
    # 3 sequences * 100 tokens * 2 kv heads * 64 * (K and V) * 4 bytes
    assert s.kv_bytes == 3 * 100 * 2 * 64 * 2 * 4 == 307_200
    assert Shape(3, 4, 2, 64, 100, "bfloat16").kv_bytes == 153_600
    res = candidates.CandidateResult("x", "peer", "ok", timing=_timing(2e-3))
    candidates.apply_metrics(res, s)
    assert res.gbps == pytest.approx(307_200 / 2e-3 / 1e9)  # 0.1536 GB/s
    assert res.gbps == pytest.approx(0.1536)
    # decode: each row attends to all 100 positions: 4 flops per (query head, key, dim)
    assert s.flops == 4 * 4 * 64 * 300
    assert s.phase == "decode" and s.metrics == ("GB/s",)


@pytest.mark.parametrize(("q_len", "context"), [(1, 7), (5, 5), (12, 40), (48, 48), (3, 1000)])
def test_causal_pairs_match_a_brute_force_count(q_len: int, context: int) -> None:
    s = Shape(2, 4, 2, 64, context, "float32", q_len=q_len)
    rows = np.arange(q_len)[:, None] + (context - q_len)
    allowed = np.arange(context)[None, :] <= rows  # the causal rule of KERNELS.md
    assert s.attended_pairs == 2 * int(allowed.sum())
    assert s.flops == 4 * 4 * 64 * 2 * int(allowed.sum())
    res = candidates.CandidateResult("x", "peer", "ok", timing=_timing(1e-3))
    candidates.apply_metrics(res, s)
    assert res.tflops == pytest.approx(s.flops / 1e-3 / 1e12)


def test_mixed_shape_sequences_and_metrics() -> None:
    s = Shape.mix((Rows(8, 1, 4096), Rows(1, 512, 2048)), 32, 8, 128)
    assert (s.batch, s.context, s.q_len, s.phase) == (9, 4096, 512, "mixed")
    assert s.q_lens == [1] * 8 + [512] and s.seq_lens == [4096] * 8 + [2048]
    assert s.kv_bytes == (8 * 4096 + 2048) * 8 * 128 * 2 * 2
    assert s.attended_pairs == 8 * 4096 + 512 * (2048 - 512) + 512 * 513 // 2
    assert s.metrics == ("GB/s", "TFLOP/s")
    assert s.label == "mixed 8x1@4096+1x512@2048 h32/8 d128 bf16"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "Shape.dtype='float64' (allowed: float32, float16, bfloat16)"),
        ({"num_kv_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
        ({"q_len": 101}, "Shape.q_len=101 > context=100"),
        ({"block_size": 12}, "Shape.block_size=12 (allowed: a multiple of 8)"),
        ({"batch": 0}, "Shape.batch=0 (allowed: an int >= 1)"),
        ({"mixed": (Rows(1, 1, 100),)}, "build mixed shapes with Shape.mix"),
    ],
)
def test_bad_shapes_name_the_value(kwargs: dict, message: str) -> None:
    base = {"batch": 2, "num_heads": 4, "num_kv_heads": 2, "head_size": 64, "context": 100, "dtype": "float32"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Shape(**(base | kwargs))


def test_mixed_rows_must_put_decode_first() -> None:
    with pytest.raises(ValueError, match="decode rows"):
        Shape.mix((Rows(1, 8, 30), Rows(2, 1, 50)), 4, 2, 64)


# -- inputs --------------------------------------------------------------------------------------------


def test_case_has_random_tables_and_matching_contiguous_kv() -> None:
    s = Shape.mix((Rows(2, 1, 50), Rows(1, 12, 30)), 4, 2, 64, dtype="float32")
    case = shapes.build_case(s, seed=3)
    blocks = [-(-n // 16) for n in s.seq_lens]
    used = np.concatenate([case.block_tables[i, :n] for i, n in enumerate(blocks)])
    assert len(set(used.tolist())) == used.size == sum(blocks)  # no page shared
    assert not np.array_equal(used, np.sort(used))  # not laid out in order
    assert case.metadata.phase.value == "mixed"
    assert case.metadata.seq_lens_host == (50, 50, 30) and case.metadata.q_lens_host == (1, 1, 12)
    kp, vp = np.array(case.k_pool), np.array(case.v_pool)
    for g, (k, v) in zip(case.groups, case.contiguous_kv()):
        for j, seq in enumerate(range(g.seq_start, g.seq_start + g.rows.count)):
            for t in range(g.rows.context):
                page = case.block_tables[seq, t // 16]
                np.testing.assert_array_equal(np.array(k)[j, :, t], kp[page, t % 16])
                np.testing.assert_array_equal(np.array(v)[j, :, t], vp[page, t % 16])
    q = np.array(case.q)
    for g, qg in zip(case.groups, case.group_queries()):
        np.testing.assert_array_equal(np.array(qg).transpose(0, 2, 1, 3).reshape(-1, 4, 64), q[g.tokens])


def _f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


@pytest.mark.parametrize("shape", SMOKE.shapes, ids=[s.label for s in SMOKE.shapes])
@pytest.mark.parametrize("name", ["reference", "gather_sdpa", "mlx_sdpa", "mlx_sdpa_packed"])
def test_candidates_compute_paged_attention(shape: Shape, name: str) -> None:
    """Every timed candidate computes the same attention as the float64 oracle, on the same data."""
    case = shapes.build_case(shape, seed=1)
    (cand,) = peers.resolve([name])
    prep = cand.prepare(case)
    got = prep.to_rows(prep.run())
    cu = np.concatenate([[0], np.cumsum(shape.q_lens)])
    ref = attention_oracle(_f32(case.q), _f32(case.k_pool), _f32(case.v_pool), case.block_tables,
                           np.array(shape.seq_lens), cu, scale=case.scale)
    assert got.shape == ref.shape
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[shape.dtype], rel


# -- timing ----------------------------------------------------------------------------------------------


def test_time_fn_reports_the_median_of_synchronized_samples() -> None:
    calls, syncs = [], []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.006)

    t = timing.time_fn(slow, warmup=2, iters=5, sync=lambda: syncs.append(1))
    assert t.inner == 1 and len(t.samples_s) == 5
    assert len(calls) == 1 + 2 + 5  # a warm-up call, one per calibration loop, then one per sample
    assert len(syncs) == 2 * 2 + 2 * 5  # around each calibration loop and around every sample
    assert 0.006 <= t.min_s <= t.median_s < 0.03
    assert t.median_s == sorted(t.samples_s)[2]


def test_time_fn_loops_short_calls_to_a_measurable_sample() -> None:
    t = timing.time_fn(lambda: None, warmup=1, iters=3, sync=lambda: None, max_inner=50)
    assert t.inner == 50


def test_time_fn_sizes_its_samples_from_the_fast_calls_after_a_slow_first_one() -> None:
    # A first call that builds something (a kernel variant, a plan) must not size the samples:
    # from it alone a sample would hold one call of a function that takes 0.2 ms.
    calls = []

    def first_slow() -> None:
        calls.append(1)
        time.sleep(0.05 if len(calls) == 1 else 0.0002)

    t = timing.time_fn(first_slow, warmup=1, iters=2, sync=lambda: None)
    assert t.inner >= 3, t.inner  # about 25 on an idle host; 1 when sized from the first call
    assert t.median_s < 0.003


def test_time_fn_calibrates_over_several_calls_unless_one_fills_a_sample() -> None:
    # Samples of 50 ms. A 12 ms call passes a fifth of a sample alone, but a lone call and its wait
    # time the latency, so each loop goes on from one call to four (5 calls); a 60 ms call fills a
    # sample alone (1 call). Sleeps only overrun: the 12 ms one may overrun 4x on a loaded host.
    for pause, loop in ((0.012, 1 + timing.MIN_CALIBRATION_CALLS), (0.06, 1)):
        calls = []

        def fn(p=pause, c=calls) -> None:
            c.append(1)
            time.sleep(p)

        t = timing.time_fn(fn, warmup=1, iters=1, sync=lambda: None, min_sample_s=0.05)
        assert len(calls) == 2 * loop + t.inner, (pause, len(calls), t.inner)


def test_time_fn_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="iters=0"):
        timing.time_fn(lambda: None, iters=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        timing.time_fn(lambda: None, warmup=-1)


# -- the command and its JSON -----------------------------------------------------------------------------


def _bench(tmp_path, capsys, *argv: str) -> tuple[int, dict | None, str, str]:
    out = tmp_path / "bench.json"
    rc = cli.main(["--suite", "smoke", "--warmup", "1", "--iters", "2", "--quiet", "--json", str(out), *argv])
    captured = capsys.readouterr()
    data = json.loads(out.read_text()) if out.exists() else None
    return rc, data, captured.out, captured.err


def test_smoke_suite_json_and_tables(tmp_path, capsys) -> None:
    rc, data, out, err = _bench(
        tmp_path, capsys, "--markdown",
        "--candidates", "reference,gather_sdpa,mlx_sdpa,torch_sdpa,ceiling",
    )
    assert rc == 0, err
    assert data["schema"] == "metal-attn-bench/1"
    m = data["machine"]
    assert m["backend"] == "cpu" and m["mlx_version"] == mx.__version__
    assert {"device_name", "gpu_cores", "cpu_model", "metal_attn_version"} <= set(m)
    assert datetime.datetime.fromisoformat(m["date"]).tzinfo is not None
    (suite,) = data["suites"]
    assert suite["name"] == "smoke" and suite["iters"] == 2 and suite["warmup"] == 1
    assert [r["shape"]["label"] for r in suite["results"]] == [s.label for s in SMOKE.shapes]
    for r, shape in zip(suite["results"], SMOKE.shapes):
        assert r["shape"]["kv_bytes"] == shape.kv_bytes and r["shape"]["flops"] == shape.flops
        c = {x["name"]: x for x in r["candidates"]}
        assert list(c) == ["reference", "gather_sdpa", "mlx_sdpa", "torch_sdpa", "ceiling"]
        ref, mlx, ceil = c["reference"], c["mlx_sdpa"], c["ceiling"]
        for x in (ref, mlx, c["gather_sdpa"], ceil):
            assert x["status"] == "ok", x
            assert len(x["timing"]["samples_s"]) == 2 and x["median_s"] == x["timing"]["median_s"] > 0
        assert ref["gbps"] == pytest.approx(shape.kv_bytes / ref["median_s"] / 1e9, rel=1e-12)
        assert ref["tflops"] == pytest.approx(shape.flops / ref["median_s"] / 1e12, rel=1e-12)
        assert ref["route"].startswith("reference: route=reference")
        assert ref["speedup"]["mlx_sdpa"] == pytest.approx(mlx["median_s"] / ref["median_s"])
        assert "mlx_sdpa" not in mlx["speedup"] and "torch_sdpa" not in ref["speedup"]
        assert ref["check"]["against"] == "mlx_sdpa" and ref["check"]["ok"] is True
        assert r["ceiling_gbps"] == ceil["gbps"] > 0
        if "GB/s" in shape.metrics:
            assert ref["fraction_of_ceiling"] == pytest.approx(ref["gbps"] / ceil["gbps"])
        else:
            assert ref["fraction_of_ceiling"] is None
        assert c["torch_sdpa"]["status"] == "unavailable"
        assert any("backend=cpu" in x for x in c["torch_sdpa"]["reasons"])
    for shape in SMOKE.shapes:
        assert shape.label[:20] in out
    assert "| shape | metric | reference | gather_sdpa | mlx_sdpa | torch_sdpa | ceiling |" in out
    assert "n/r" in out and "n/a" in out


def test_a_refused_provider_is_reported_with_its_reasons(tmp_path, capsys) -> None:
    with override_settings(disabled_providers=("reference",)):
        rc, data, out, _ = _bench(tmp_path, capsys, "--shapes", "decode b3", "--candidates", "reference,mlx_sdpa")
    assert rc == 0
    (result,) = data["suites"][0]["results"]
    ref = result["candidates"][0]
    assert ref["status"] == "refused" and ref["median_s"] is None
    why = "disabled by the disabled_providers setting (reference; its variable: METAL_ATTN_DISABLED_PROVIDERS)"
    assert why in ref["reasons"]
    assert "refused" in out and "disabled_providers setting" in out.replace("\n", "")


class _Broken(peers.MlxSdpa):
    name = "mlx_sdpa"

    def prepare(self, case: shapes.Case) -> candidates.Prepared:
        prep = super().prepare(case)
        prep.to_rows = lambda outs: np.zeros_like(peers.mlx_rows(outs))
        return prep


class _Crashing(peers.GatherSdpa):
    def prepare(self, case: shapes.Case) -> candidates.Prepared:
        raise RuntimeError("kernel exploded")


def test_wrong_outputs_and_crashes_fail_the_run(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(peers.PEERS, "mlx_sdpa", _Broken)
    monkeypatch.setitem(peers.PEERS, "gather_sdpa", _Crashing)
    rc, data, out, err = _bench(tmp_path, capsys, "--shapes", "decode b3", "--candidates",
                                "reference,gather_sdpa,mlx_sdpa")
    assert rc == 1
    c = {x["name"]: x for x in data["suites"][0]["results"][0]["candidates"]}
    assert c["gather_sdpa"]["status"] == "error"
    assert c["gather_sdpa"]["reasons"] == ["RuntimeError: kernel exploded"]
    # the zeroed peer is the check baseline: the correct reference disagrees with it
    assert c["reference"]["check"]["against"] == "mlx_sdpa" and c["reference"]["check"]["ok"] is False
    assert "MISMATCH vs mlx_sdpa" in out.replace("\n", "")
    assert "kernel exploded" in err and "output differs from mlx_sdpa" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--suite", "nope"],
         "suite='nope' is unknown (known: decode-gpu, prefill-gpu, gqa-gpu, decode-cpu, prefill-cpu, decode-step, "
         "decode-step-cpu, smoke)"),
        (["--suite", "smoke", "--shapes", "zzz"], "--shapes 'zzz' matches no shape of suite 'smoke'"),
        # ',' and ' ' selected every shape without a word
        (["--suite", "smoke", "--shapes", ","], "--shapes ',' holds no pattern"),
        (["--suite", "smoke", "--shapes", " "], "--shapes ' ' holds no pattern"),
        # a typo or a half-written variant measured nothing, shape after shape, and exited 0
        (["--suite", "smoke", "--candidates", "bogus"],
         "--candidates 'bogus' is neither a registered provider nor a candidate of suite 'smoke'"),
        (["--suite", "smoke", "--candidates", "classic[partition_size=64"],
         "candidate 'classic[partition_size=64' is not NAME[setting=value;...]"),
        (["--suite", "smoke", "--candidates", "classic[validate_metadata=0,nope=1]"],
         "candidate 'classic[validate_metadata=0,nope=1]'"),  # one variant: the comma stays in it
        # flags the chosen suite does not read were dropped silently
        (["--suite", "smoke", "--concurrency", "3"], "--suite smoke does not read --concurrency"),
        (["--suite", "generate", "--shapes", "x", "--pipelined"],
         "--suite generate does not read --shapes, --pipelined (they are flags of the kernel suites)"),
        (["--suite", "generate", "--warmup", "0"], "--suite generate does not read --warmup"),  # 0 read as unset
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_list_names_every_suite(capsys) -> None:
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for s in suites.SUITES.values():
        assert s.name in out
        for shape in s.shapes:
            assert shape.label in out
    from metal_attn.bench import generate

    assert "\ngenerate (any; a model against mlx-lm" in out  # the suite of another kind is listed too
    assert all(name in out for name in generate.RUNNERS)


def test_list_with_suites_lists_those_and_refuses_an_unknown_one(capsys) -> None:
    """``--list --suite nope`` listed every suite and exited 0."""
    assert cli.main(["--list", "--suite", "smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smoke (") and "decode-gpu" not in out and "\ngenerate (" not in out
    assert cli.main(["--list", "--suite", "generate"]) == 0
    assert capsys.readouterr().out.startswith("generate (any;")
    assert cli.main(["--list", "--suite", "nope"]) == 2
    assert "--list --suite 'nope': no such suite (known: decode-gpu," in capsys.readouterr().err


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "p.png"
    msg = render.write_plot([], str(path))
    assert msg is not None and "matplotlib is not importable" in msg and "No plot was written" in msg
    assert not path.exists()


def test_plot_is_written_with_matplotlib(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, _, _, err = _bench(tmp_path, capsys, "--shapes", "decode b3", "--candidates", "reference,mlx_sdpa",
                           "--plot", str(png))
    assert rc == 0 and f"wrote {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_path_asked_for_in_the_format_its_name_says(tmp_path, capsys) -> None:
    """Without an extension matplotlib wrote ``NAME.png`` while the bench said it wrote ``NAME``."""
    pytest.importorskip("matplotlib")
    bare, svg = tmp_path / "plot", tmp_path / "plot.SVG"
    for path in (bare, svg):
        rc, _, _, err = _bench(tmp_path, capsys, "--shapes", "decode b3", "--candidates", "reference",
                               "--plot", str(path))
        assert rc == 0 and f"wrote {path}" in err
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists()
    assert b"<svg" in svg.read_bytes()[:2000]


def test_a_plot_format_matplotlib_would_refuse_is_refused_before_the_run(tmp_path, capsys) -> None:
    """``--plot out.xyz`` measured the whole run, then ended in matplotlib's ValueError traceback."""
    rc = cli.main(["--suite", "smoke", "--plot", str(tmp_path / "out.xyz")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--plot {str(tmp_path / 'out.xyz')!r} names a .xyz file (allowed: a file name ending in .png, .pdf, " \
           ".svg, or without an extension: PNG)" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system (a device whose writes fail)")
def test_a_plot_that_cannot_be_written_is_an_error(tmp_path, capsys) -> None:
    """``--plot /dev/full`` said it wrote the plot and exited 0."""
    pytest.importorskip("matplotlib")
    rc, _, _, err = _bench(tmp_path, capsys, "--shapes", "decode b3", "--candidates", "reference",
                           "--plot", "/dev/full")
    assert rc == 1
    assert "--plot '/dev/full': not written (No space left on device)" in err and "wrote /dev/full" not in err


# -- the suites as data -----------------------------------------------------------------------------------


def test_gpu_suites_use_the_kernels_md_shapes() -> None:
    table = {(1, 32, 8, 128, 32768), (8, 32, 8, 128, 4096), (32, 32, 8, 128, 4096), (64, 32, 8, 128, 8192),
             (8, 32, 8, 128, 32768), (1, 24, 4, 256, 65536), (16, 16, 2, 128, 16384), (128, 32, 8, 128, 1024)}
    dec = suites.get_suite("decode-gpu")
    decode = [s for s in dec.shapes if s.phase == "decode"]
    assert {(s.batch, s.num_heads, s.num_kv_heads, s.head_size, s.context) for s in decode} == table
    assert [s.phase for s in dec.shapes].count("mixed") == 2
    assert all(s.dtype == "bfloat16" and s.block_size == 16 for s in dec.shapes)
    gqa = suites.get_suite("gqa-gpu")
    geo = {(s.num_heads, s.num_kv_heads, s.head_size) for s in gqa.shapes}
    assert geo <= {(32, 8, 128), (24, 4, 256), (16, 2, 128), (16, 2, 256)}
    singles = {(s.num_heads, s.context) for s in gqa.shapes if s.batch == 1}
    assert {(24, n) for n in (16384, 32768, 65536, 131072)} | {(32, 32768), (32, 131072)} <= singles
    for s in suites.SUITES.values():
        labels = [x.label for x in s.shapes]
        assert len(set(labels)) == len(labels), s.name


def test_cpu_suites_follow_the_cpu_facts() -> None:
    dec = suites.get_suite("decode-cpu")
    assert {(s.context, s.dtype) for s in dec.shapes} == {
        (n, dt) for n in (1024, 4096, 16384) for dt in ("float32", "bfloat16")}
    assert all((s.batch, s.num_heads, s.num_kv_heads, s.head_size) == (8, 32, 8, 128) for s in dec.shapes)
    (pre,) = suites.get_suite("prefill-cpu").shapes
    assert (pre.q_len, pre.context, pre.dtype, pre.phase) == (2048, 2048, "float32", "prefill")


def test_pipelined_mode_is_recorded_and_measures(tmp_path, capsys) -> None:
    rc, data, out, _ = _bench(tmp_path, capsys, "--pipelined", "--shapes", "mixed",
                              "--candidates", "reference,gather_sdpa,mlx_sdpa")
    assert rc == 0
    (suite,) = data["suites"]
    assert suite["mode"] == "pipelined"
    assert all(c["status"] == "ok" and c["median_s"] > 0 for c in suite["results"][0]["candidates"])
    assert "pipelined: queued calls" in out


# -- streaming, interruption, JSON on stdout, the CPU ceiling -------------------------------------------


def test_json_without_a_path_goes_to_stdout_and_tables_to_stderr(capsys) -> None:
    """`--json` alone writes the JSON on stdout (the README: every command's --json does), the
    tables then go to stderr; `--json PATH` still writes a file."""
    rc = cli.main(["--suite", "smoke", "--shapes", "decode b3", "--candidates", "reference,mlx_sdpa",
                   "--warmup", "1", "--iters", "2", "--quiet", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert data["schema"] == "metal-attn-bench/1" and data["suites"][0]["interrupted"] is False
    assert "decode b3" in captured.err and "route / reasons" in captured.err


def test_rows_are_printed_as_each_shape_completes(tmp_path, capsys, monkeypatch) -> None:
    """Each shape's rows reach stdout before the next shape is measured."""
    seen_at_start: list[str] = []
    real = shapes.build_case

    def spy(shape, **kw):
        seen_at_start.append(capsys.readouterr().out)  # what was printed before this shape began
        return real(shape, **kw)

    monkeypatch.setattr(shapes, "build_case", spy)
    rc, _, _, err = _bench(tmp_path, capsys, "--shapes", "decode", "--candidates", "reference")
    assert rc == 0, err
    labels = [s.label for s in SMOKE.select(["decode"])]
    assert len(labels) == 2 and len(seen_at_start) == 2
    assert labels[0] not in seen_at_start[0] and labels[0] in seen_at_start[1]


class _Interrupted(peers.MlxSdpa):
    calls = 0

    def prepare(self, case: shapes.Case) -> candidates.Prepared:
        type(self).calls += 1
        if type(self).calls == 2:  # Ctrl-C during the second shape
            raise KeyboardInterrupt
        return super().prepare(case)


def test_an_interrupted_run_keeps_its_partial_table_and_json(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(peers.PEERS, "mlx_sdpa", _Interrupted)
    rc, data, out, err = _bench(tmp_path, capsys, "--candidates", "reference,mlx_sdpa")
    assert rc == 130
    (suite,) = data["suites"]
    assert suite["interrupted"] is True and len(suite["results"]) == 1
    assert SMOKE.shapes[0].label in out and SMOKE.shapes[1].label not in out
    assert "interrupted: 1 of 5 shapes of smoke completed" in err


def test_help_says_how_long_each_suite_takes(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in suites.SUITES.values():
        assert s.name in text
    assert "decode-cpu (about" in text and "on a 2-core CPU" in text


def test_the_cpu_ceiling_is_a_multi_threaded_read_the_kernel_does_not_exceed() -> None:
    """With the native module the ceiling is its read with the kernels' thread count; the classic kernel,
    which reads the same bytes and computes, stays below it (a single-threaded numpy sum did not)."""
    from metal_attn import native

    if native.load() is None or current_device().backend != "cpu":
        pytest.skip("the native module's read is the CPU ceiling; it is not built here")
    shape = Shape(8, 32, 8, 128, 1024, "float32")
    case = shapes.build_case(shape)
    ceiling = peers.Ceiling().measure(case, warmup=2, iters=7)
    assert ceiling.route.startswith(f"native read ({current_device().cpu_threads} threads")
    classic = candidates.ProviderCandidate("classic").measure(case, warmup=2, iters=7)
    assert classic.ok and ceiling.ok
    assert classic.gbps <= 1.2 * ceiling.gbps, (classic.gbps, ceiling.gbps)


def _ran(name: str, kind: str, ms: float, route: str | None = None) -> candidates.CandidateResult:
    t = Timing(ms / 1e3, ms / 1e3, ms / 1e3, 0.0, (ms / 1e3,), 1)
    return candidates.CandidateResult(name, kind, "ok", timing=t, route=route or name)


def test_auto_lag_marks_auto_slower_than_the_fastest_admitted_provider():
    results = [_ran("auto", "provider", 2.3, "tiled_prefill"), _ran("tiled_prefill", "provider", 2.3),
               _ran("sdpa_prefill", "provider", 2.0), _ran("mlx_sdpa", "peer", 0.5),
               candidates.CandidateResult("classic", "provider", "refused", reasons=("head_size=80",))]
    lag = core.auto_lag(results)
    assert lag["fastest"] == "sdpa_prefill" and lag["marked"] and abs(lag["lag"] - 1.15) < 1e-9  # peers never count
    results[0] = _ran("auto", "provider", 2.1, "sdpa_prefill")
    assert not core.auto_lag(results)["marked"]  # 5% over the fastest: within the 10% limit
    assert core.auto_lag([_ran("auto", "provider", 1.0), _ran("mlx_sdpa", "peer", 0.5)]) is None
    # The same route measured twice: noise, not a routing mistake.
    same = core.auto_lag([_ran("auto", "provider", 1.3, "sdpa_prefill"), _ran("sdpa_prefill", "provider", 1.0)])
    assert same["same_route"] and not same["marked"] and abs(same["lag"] - 1.3) < 1e-9


def test_markdown_names_the_marked_shapes():
    shape = suites.get_suite("smoke").shapes[2]
    sr = core.ShapeResult(shape, [_ran("auto", "provider", 3.0, "classic"), _ran("sdpa_prefill", "provider", 1.0)])
    sr.auto_vs_fastest = core.auto_lag(sr.candidates)
    suite = core.SuiteResult("s", "d", ("auto", "sdpa_prefill"), 1, 1, [sr])
    text = render.render_markdown(suite, core.machine_info())
    assert " SLOW |" in text and f"marked: {shape.label} (route classic took 3.00x the time of sdpa_prefill" in text


def test_generate_suite_refuses_an_unknown_candidate_before_loading_a_model(capsys, monkeypatch):
    from metal_attn.bench import generate

    monkeypatch.setattr(generate, "load_bench_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--suite", "generate", "--candidates", "engine,engine_compiled,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("nope unknown for the generate suite (allowed: engine, engine_eager, engine_compiled, engine_trace_second, "
            "engine_no_chains, batch_generator, generate_step)") in err


@pytest.mark.parametrize("value", ["0", "abc", "1.5", "nan", "1,,8", "-2", "", "\u00b2", "\u0661\u0662", "4097",
                                   "99999999999"])
def test_generate_suite_refuses_a_bad_concurrency_before_loading_a_model(capsys, monkeypatch, value):
    """``0`` used to fail with an IndexError after the model loaded, ``''`` to run the defaults (25 min); '²'
    raised a ValueError traceback, Arabic-Indic '١٢' ran as 12, 99,999,999,999 built prompts past 5 GB."""
    from metal_attn.bench import generate

    monkeypatch.setattr(generate, "load_bench_model", lambda *a: pytest.fail("the model was loaded"))
    assert cli.main(["--suite", "generate", "--concurrency", value]) == 2
    assert f"--concurrency {value!r} (allowed: whole numbers from 1 to 4096, comma-separated" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expect"), [
    (["--prompt-len", "100000"], "--prompt-len 100000 + --gen-tokens 32 = 100032 tokens a request, over the bench "
                                 "model's context of 8192 (allowed: at most 8192 in all)"),
    (["--prompt-len", "64", "--shared-prefix", "8190"],
     "--shared-prefix 8190 + --prompt-len 64 // 8 + --gen-tokens 32 = 8230 tokens a shared-prefix request, over "
     "the bench model's context of 8192 (allowed: at most 8192 in all; --shared-prefix 0 leaves that workload out)"),
])
def test_generate_suite_refuses_requests_longer_than_the_models_context_before_any_run(capsys, monkeypatch, argv,
                                                                                      expect):
    """A prompt over the model's context used to end in the engine's traceback from the warm-up; now the suite
    says which arguments overran the context, and nothing runs."""
    from metal_attn.bench import generate

    class Args:  # what a model's args declare
        max_position_embeddings = 8192

    class Model:
        args = Args()

    monkeypatch.setattr(generate, "load_bench_model", lambda *a: (Model(), "a model of 8192 tokens"))
    monkeypatch.setattr(generate, "bench_generate", lambda *a, **k: pytest.fail("the suite ran"))
    assert cli.main(["--suite", "generate", "--concurrency", "1", *argv]) == 2
    assert f"metal-attn bench: error: {expect}" in capsys.readouterr().err


def test_generate_rounds_alternate_the_order_and_report_the_median_ratio(monkeypatch):
    """``--repeat`` on the generate suite: every candidate once a round, the order reversed every other
    round, and each ratio the median of the rounds' own ratios (a drifting host weighs on both)."""
    from metal_attn.bench import generate

    calls = []
    speeds = iter([100.0, 50.0, 80.0, 40.0, 90.0, 60.0])  # engine, step | step, engine | engine, step

    def fake(name):
        def run(model, prompts, gen, **kw):
            if gen != 4:  # the warm-up generates 4 tokens each
                calls.append(name)
                tps = next(speeds)
                return gen / tps, 0.0, gen, [0.01], {}
            return 1.0, 0.0, gen, [0.01], {}
        return run

    monkeypatch.setitem(generate.RUNNERS, "engine", fake("engine"))
    monkeypatch.setitem(generate.RUNNERS, "generate_step", fake("generate_step"))

    class Model:
        pass

    results = generate.bench_generate(Model(), concurrencies=(1,), prompt_len=4, gen_tokens=8,
                                      candidates=("engine", "generate_step"), rounds=3)
    assert calls == ["engine", "generate_step", "generate_step", "engine", "engine", "generate_step"]
    assert [r.round for r in results] == [0, 0, 1, 1, 2, 2]
    (row,) = [r for r in generate.ratios(results) if r["peer"] == "generate_step"]
    # Rounds: 100/50 = 2.0, engine 40 / step 80 = 0.5, 90/60 = 1.5; the median is 1.5.
    assert [round(e["generation_ratio"], 6) for e in row["per_round"]] == [2.0, 0.5, 1.5]
    assert row["generation_ratio"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"rounds=0 \(allowed: an int >= 1\)"):
        generate.bench_generate(Model(), concurrencies=(1,), rounds=0)


def test_a_rotated_run_measures_the_candidates_from_another_place_and_keeps_their_order():
    """``run_suite(rotate=k)`` (``--repeat`` passes each run's index) starts each shape's measurements
    ``k`` candidates further along, so no candidate is always measured first; the results keep the
    candidates' order, so tables and comparisons do not move."""
    measured: list[tuple[str, str]] = []

    class Recording:
        kind = "peer"

        def __init__(self, name: str) -> None:
            self.name = name

        def measure(self, case, *, warmup, iters, pipelined=False):
            measured.append((case.shape.label, self.name))
            return candidates.CandidateResult(self.name, self.kind, "skipped", ("recorded",))

    shapes = [Shape(1, 4, 2, 32, 64, "float32"), Shape(2, 4, 2, 32, 64, "float32")]
    cands = [Recording(n) for n in ("a", "b", "c")]
    for rotate, want in ((0, "abc"), (1, "bca"), (2, "cab"), (4, "bca")):
        measured.clear()
        result = core.run_suite("t", shapes, cands, warmup=1, iters=1, rotate=rotate)
        assert [n for _, n in measured] == list(want) * 2, rotate
        assert [label for label, _ in measured] == [shapes[0].label] * 3 + [shapes[1].label] * 3
        assert all([c.name for c in sr.candidates] == ["a", "b", "c"] for sr in result.results)


def test_a_settings_variant_is_measured_under_its_settings_and_named_for_them(tmp_path, capsys, monkeypatch) -> None:
    from metal_attn.settings import get_settings

    seen: list[tuple[str, int]] = []
    real = candidates.ProviderCandidate.prepare

    def prepare(self, case):
        seen.append((self.name, get_settings().partition_size))
        return real(self, case)

    monkeypatch.setattr(candidates.ProviderCandidate, "prepare", prepare)
    rc, data, out, err = _bench(tmp_path, capsys, "--markdown", "--shapes", "decode b3",
                                "--candidates", "classic,classic[partition_size=64],reference")
    assert rc == 0, err
    assert ("classic", 0) in seen and ("classic", 64) in seen
    (r,) = data["suites"][0]["results"]
    c = {x["name"]: x for x in r["candidates"]}
    assert list(c) == ["classic", "classic[partition_size=64]", "reference"]
    variant = c["classic[partition_size=64]"]
    assert variant["status"] == "ok" and variant["kind"] == "variant"
    assert variant["check"]["ok"] is True
    assert get_settings().partition_size == 0  # the override ended with the candidate
    assert "| classic[partition_size=64] |" in out


@pytest.mark.parametrize(("name", "message"), [
    ("auto[cuda_chains]", "'cuda_chains' is not setting=value"),
    ("auto[]", "no settings between the brackets"),
    ("auto[no_such_setting=1]", "unknown setting(s): no_such_setting"),
    ("auto[partition_size=7]", "partition_size"),
])
def test_a_malformed_variant_is_a_usage_error(name: str, message: str, capsys) -> None:
    assert cli.main(["--suite", "smoke", "--candidates", f"reference,{name}"]) == 2
    assert message in capsys.readouterr().err


def test_variant_names_parse() -> None:
    assert candidates.parse_variant("auto[cuda_chains=0; partition_size = 256]") == (
        "auto", {"cuda_chains": "0", "partition_size": "256"})
    assert candidates.parse_variant("auto") is None


def test_a_gpu_suite_is_refused_on_the_cpu(capsys):
    """It used to run for minutes, timing GPU-sized shapes on the CPU's reference paths."""
    if current_device().backend != "cpu":
        pytest.skip("the refusal is the CPU backend's")
    assert cli.main(["--suite", "smoke,decode-gpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--suite decode-gpu needs a GPU backend (this is cpu; allowed here: " in err and "decode-cpu" in err


def test_comma_separated_names_keep_a_variant_s_commas_together() -> None:
    assert cli._csv("auto, auto[a=1,b=2] ,reference,,") == ["auto", "auto[a=1,b=2]", "reference"]
    assert candidates.parse_variant("auto[a=1,b=2;c=3]") == ("auto", {"a": "1", "b": "2", "c": "3"})


def test_generate_json_on_stdout_is_json_alone(capsys, monkeypatch) -> None:
    """With --json -, the suite's Markdown rows and ratio lines went to stdout ahead of the JSON."""
    from metal_attn.bench import generate

    result = generate.GenerateResult(workload="plain", concurrency=1, candidate="engine", prompt_len=4,
                                     gen_tokens=2, wall_s=2.0, prompt_s=1.0, generated=2, mean_ttft_s=0.5,
                                     peak_memory_bytes=1)
    monkeypatch.setattr(generate, "load_bench_model", lambda backend, layers: (object(), "fake model"))
    monkeypatch.setattr(generate, "_too_long", lambda *a: None)

    def fake_bench(model, *, on_result, **kw):
        on_result(result)
        return [result]

    monkeypatch.setattr(generate, "bench_generate", fake_bench)
    assert cli.main(["--suite", "generate", "--candidates", "engine", "--concurrency", "1", "--json", "-",
                     "--quiet"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["results"][0]["candidate"] == "engine"
    assert "| workload |" in captured.err


def test_list_writes_its_json_to_a_path(tmp_path, capsys) -> None:
    """--json PATH was ignored by --list (text on stdout, no file, exit 0). A dry run's --json PATH is the
    measuring run's, which the dry run checks and does not write (the dry-run test below)."""
    listed = tmp_path / "list.json"
    assert cli.main(["--list", "--suite", "smoke", "--json", str(listed)]) == 0
    assert [s["name"] for s in json.loads(listed.read_text())["suites"]] == ["smoke"]
    assert f"wrote {listed}" in capsys.readouterr().err
    assert cli.main(["--list", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "cannot write it" in capsys.readouterr().err


def test_a_prefill_table_shows_the_ceilings_bandwidth_in_its_note() -> None:
    """A prefill suite's table has no GB/s column, so the ceiling's row showed nothing measured (its Markdown
    had the GB/s)."""
    import io

    from metal_attn.bench.candidates import CandidateResult
    from metal_attn.bench.core import ShapeResult
    from metal_attn.bench.render import TableStream

    shape = Shape(1, 4, 2, 64, 64, "float32", q_len=64)
    ceiling = CandidateResult("ceiling", "ceiling", "ok", gbps=70.9, route="native read (2 threads)")
    out = io.StringIO()
    TableStream("prefill-cpu", "test", [shape], ["classic", "ceiling"], out).shape(ShapeResult(shape, [ceiling]))
    row = next(line for line in out.getvalue().splitlines() if "ceiling" in line)
    assert "70.9 GB/s; native read (2 threads)" in row, out.getvalue()


def test_the_module_command_takes_verbose_as_metal_attn_bench_does() -> None:
    """``python -m metal_attn.bench.cli -v`` was an unrecognized argument."""
    assert cli.main(["-v", "--suite", "smoke", "--dry-run"]) == 0


@pytest.mark.parametrize("seed", [None, 7])
def test_generate_suite_takes_the_seed(monkeypatch, seed) -> None:
    """--seed reached every other suite but not the generate suite's prompts (always seed 0)."""
    from metal_attn.bench import generate

    monkeypatch.setattr(generate, "load_bench_model", lambda backend, layers: (object(), "fake model"))
    monkeypatch.setattr(generate, "_too_long", lambda *a: None)
    seen = []

    def fake_bench(model, **kw):
        seen.append(kw["seed"])
        return []

    monkeypatch.setattr(generate, "bench_generate", fake_bench)
    argv = ["--suite", "generate", "--candidates", "engine", "--concurrency", "1", "--quiet"]
    assert cli.main(argv + ([] if seed is None else ["--seed", str(seed)])) == 0
    assert seen == [0 if seed is None else seed]


def test_a_provider_no_plugin_registered_is_reported_not_measured() -> None:
    """A suite's or a baseline's candidate from a plugin this machine lacks (--candidates refuses a name no
    plugin registered before anything runs)."""
    with pytest.raises(candidates.Skip) as exc:
        candidates.ProviderCandidate("no_such_provider").admit(SMOKE.shapes[0])
    assert exc.value.status == "not registered"
    assert "provider='no_such_provider' is not registered (registered: " in exc.value.reasons[0]


def test_the_progress_bar_is_off_the_terminal_while_a_table_prints_there() -> None:
    """On one terminal the bar's redraws landed between a table's rows."""
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Tty()
    with cli._Progress(4, quiet=False, file=term) as bar:
        assert bar._bar.live.is_started
        with bar.hidden(Tty()):
            assert not bar._bar.live.is_started
        assert bar._bar.live.is_started
        with bar.hidden(io.StringIO()):  # a table going to a file or a pipe leaves the bar alone
            assert bar._bar.live.is_started


# -- --dry-run: a plan checked before device time is spent on it --------------------------------------------------


def test_a_dry_run_of_a_gpu_suite_lists_its_plan_on_the_cpu_and_times_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_suite", lambda *a, **k: pytest.fail("a dry run timed something"))
    out = tmp_path / "run.json"
    rc = cli.main(["--suite", "decode-gpu", "--shapes", "b8 h32/8 d128 L4096", "--candidates",
                   "auto,auto[mma_key_rows=0],torch_sdpa,ceiling", "--json", str(out), "--dry-run"])
    got = capsys.readouterr()
    assert rc == 0, got.err
    assert "would run decode-gpu: 1 shapes x 4 candidates, 1 time(s); needs a GPU backend (this is cpu)" in got.out
    assert "candidates: auto, auto[mma_key_rows=0], torch_sdpa, ceiling" in got.out
    assert "  - decode b8 h32/8 d128 L4096 bf16" in got.out
    assert not out.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--suite", "decode-gpu", "--candidates", "auto,torch_sdpaa"], "--candidates 'torch_sdpaa' is neither"),
    (["--suite", "decode-gpu", "--candidates", "auto[mma_key_rows="], "--candidates:"),
    (["--suite", "decode-gpu", "--shapes", "b3x"], "--shapes 'b3x' matches no shape"),
    (["--suite", "decode-step", "--concurrency", "8"], "does not read --concurrency"),
    (["--suite", "decode-gpuu"], "decode-gpuu"),
    (["--from-json", "run.json"], "--from-json measures nothing"),
])
def test_a_dry_run_refuses_what_the_run_would_refuse(capsys, argv, message):
    assert cli.main([*argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_a_dry_run_admits_the_decode_steps_compiled_candidate(capsys):
    """``auto_compiled`` is a peer of the decode-step suite; the unknown-provider check refused it (the
    baseline phase of benchmarks/device/session.sh would have failed on the GPU)."""
    assert cli.main(["--suite", "decode-step", "--candidates", "auto,auto_compiled,torch_sdpa,ceiling",
                     "--dry-run"]) == 0
    assert "candidates: auto, auto_compiled, torch_sdpa, ceiling" in capsys.readouterr().out


def test_a_dry_run_of_a_comparison_goes_on_past_another_machine_class(capsys):
    from pathlib import Path

    base = Path(__file__).resolve().parents[1] / "benchmarks" / "baselines" / "cuda-nvidia-h200-decode-step.json"
    rc = cli.main(["--suite", "decode-step", "--compare", str(base), "--dry-run"])
    got = capsys.readouterr()
    assert rc == 0, got.err
    assert "machine class differs" in got.err and "a run here would stop with exit 1" in got.err
    assert f"would compare against {base} (cuda-nvidia-h200" in got.out


def test_a_dry_run_of_the_generate_suite_loads_no_model(capsys, monkeypatch):
    from metal_attn.bench import generate

    monkeypatch.setattr(generate, "load_bench_model", lambda *a: pytest.fail("the model was loaded"))
    rc = cli.main(["--suite", "generate", "--candidates", "engine,batch_generator", "--concurrency", "1,8",
                   "--shared-prefix", "64", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("would run generate on cpu: candidates engine, batch_generator against their peers at concurrency 1, 8, "
            "prompts of 32 tokens, 32 generated each, 1 round(s), and the shared-prefix workload (64 tokens shared)"
            ) in out


def test_the_generate_suites_id_only_tokenizer_is_one_the_engine_takes():
    """The GPU model has no vocabulary: the suite's tokenizer passes the engine's tokenizer check (it lacked
    `encode` and the suite failed on the H100 before generating) and refuses text by name."""
    from metal_attn.bench.generate import _NoStopTokenizer
    from metal_attn.engine import Engine, EngineConfig
    from metal_attn.errors import InvalidInputError
    from metal_attn.testing.models import tiny_model

    eng = Engine(tiny_model("llama"), _NoStopTokenizer(), EngineConfig(num_blocks=16, block_size=16))
    (out,) = eng.generate([[1, 2, 3]], max_tokens=4)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(InvalidInputError, match="has no vocabulary"):
        eng.add_request("text")


def test_bench_refuses_a_backend_override_it_would_not_time(capsys, tmp_path):
    """METAL_ATTN_BACKEND_OVERRIDE=cuda on this CPU ran the GPU suite here for minutes, and --write-baseline
    wrote a baseline of machine class 'cuda-cpu' from CPU timings. A dry run still checks a GPU plan."""
    from metal_attn.device import detect_backend

    other = "cuda" if detect_backend() != "cuda" else "metal"
    out = tmp_path / "b.json"
    with override_settings(backend_override=other):
        assert cli.main(["--suite", "smoke", "--quiet", "--write-baseline", str(out)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"METAL_ATTN_BACKEND_OVERRIDE='{other}', but bench times the backend MLX computes on here" in err
        assert not out.exists()
        assert cli.main(["--suite", "smoke", "--dry-run"]) == 0
    with override_settings(backend_override=detect_backend()):  # naming the real backend changes nothing
        assert cli.main(["--suite", "smoke", "--dry-run"]) == 0


@pytest.mark.parametrize("argv", [["--list"], ["--list", "--suite", "smoke"], ["--suite", "smoke", "--dry-run"],
                                  ["--suite", "generate", "--dry-run"]])
def test_json_on_stdout_is_json_for_a_listing_and_a_dry_run(capsys, argv) -> None:
    """`--json` gives JSON on stdout (the docs); --list and --dry-run printed their text there instead."""
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if "--list" in argv:
        names = [s["name"] for s in out["suites"]]
        assert names == ["smoke"] if "smoke" in argv else ("generate" in names and "decode-gpu" in names)
    elif "generate" in argv:
        assert out["dry_run"] is True and out["suite"] == "generate" and out["concurrency"]
    else:
        (smoke,) = out["suites"]
        assert out["dry_run"] is True and smoke["name"] == "smoke"
        assert smoke["shapes"] == [s.label for s in suites.get_suite("smoke").shapes]


class _Logged(candidates.TimedCandidate):
    """A timed candidate whose calls append ``(name, the forced partition size)`` to ``log``; it raises
    on its ``fail_at``-th call, and counts its closes."""

    kind = "peer"

    def __init__(self, name: str, log: list, fail_at: int | None = None) -> None:
        self.name, self.log, self.fail_at, self.closed = name, log, fail_at, 0

    def prepare(self, case):
        from metal_attn.settings import get_settings

        def run():
            if self.fail_at is not None and sum(n == self.name for n, _ in self.log) == self.fail_at:
                raise RuntimeError(f"{self.name} broke")
            self.log.append((self.name, get_settings().partition_size))
            return mx.zeros((1,))

        def close():
            self.closed += 1

        return candidates.Prepared(run=run, close=close, route=f"{self.name} route")


def test_interleaved_candidates_take_their_samples_in_turn():
    """``run_suite(interleave=True)``: every timed candidate is opened and calibrated first, then each
    round takes one sample of each in turn, so the timed calls alternate in blocks of each one's
    ``inner``; a settings variant's calls keep its settings, the others' do not; every prepared
    call is closed; the ceiling is measured on its own."""
    log: list[tuple[str, int]] = []
    a, b = _Logged("a", log), _Logged("b", log)
    resolve = candidates.with_variants(lambda names: [{"a": a, "b": b}[n] for n in names])
    cands = resolve(["a", "b[partition_size=384]"])
    shape = Shape(1, 4, 2, 32, 64, "float32")
    iters = 4
    result = core.run_suite("t", [shape], cands, warmup=1, iters=iters, interleave=True)
    assert result.interleaved and result.to_dict()["interleaved"] is True
    res_a, res_b = result.results[0].candidates
    assert (res_a.name, res_b.name) == ("a", "b[partition_size=384]") and res_a.ok and res_b.ok
    assert (res_a.route, res_b.route) == ("a route", "b route")
    assert len(res_a.timing.samples_s) == len(res_b.timing.samples_s) == iters
    assert a.closed == b.closed == 1
    assert {p for n, p in log if n == "a"} == {0} and {p for n, p in log if n == "b"} == {384}
    # The samples: the last iters * (inner_a + inner_b) calls, in rounds of one block of each, in the
    # rounds' own orders: not always a first.
    ia, ib = res_a.timing.inner, res_b.timing.inner
    timed = [n for n, _ in log[-iters * (ia + ib):]]
    assert timed == _rounds([("a", ia), ("b", ib)], iters)
    assert {core.round_order(2, r)[0] for r in range(iters)} == {0, 1}  # not always a first
    # Without interleave the same candidates take their samples one after the other.
    log.clear()
    result = core.run_suite("t", [shape], cands, warmup=1, iters=iters)
    assert not result.interleaved
    names = [n for n, _ in log]
    assert names == sorted(names)  # every a call before every b call


def _rounds(blocks: list[tuple[str, int]], iters: int) -> list[str]:
    """The timed calls of ``iters`` interleaved rounds: each round one block of ``inner`` calls per
    candidate, in `core.round_order`'s order for that round."""
    return [name for r in range(iters) for k in core.round_order(len(blocks), r)
            for name in [blocks[k][0]] * blocks[k][1]]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_interleaved_rounds_balance_who_leads_and_who_follows_whom(count):
    """Over 2 * count rounds every candidate leads twice and directly follows every other one twice, so
    no candidate always follows the same one; the orders are the same in every run."""
    orders = [core.round_order(count, r) for r in range(2 * count)]
    assert all(sorted(o) == list(range(count)) for o in orders)
    assert orders == [core.round_order(count, r) for r in range(2 * count)]
    leads = [o[0] for o in orders]
    assert all(leads.count(k) == 2 for k in range(count))
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(count - 1)]
    assert all(pairs.count((a, b)) == 2 for a in range(count) for b in range(count) if a != b)


def test_interleaved_candidates_are_calibrated_once_all_are_warm_and_a_round_is_dropped():
    """Opening (one call each), the warm-up's calibration per candidate as it opens, a second
    calibration of each once every one is warm, one dropped round, then the kept rounds."""
    log: list = []
    a, b = _Logged("a", log), _Logged("b", log)
    iters = 2
    res_a, res_b = core.run_suite("t", [_SHAPE], [a, b], warmup=1, iters=iters, interleave=True).results[0].candidates
    ia, ib = res_a.timing.inner, res_b.timing.inner
    kept = iters * (ia + ib)
    dropped = [n for n, _ in log[-kept - ia - ib:-kept]]
    assert sorted(dropped) == sorted(["a"] * ia + ["b"] * ib) and dropped[0] == "a"  # the dropped round, a first
    assert len(res_a.timing.samples_s) == len(res_b.timing.samples_s) == iters
    # Before it: a's open and calibration, b's, then a's and b's second calibrations (two loops each).
    names = [n for n, _ in log[:-kept - ia - ib]]
    first_b = names.index("b")
    assert set(names[:first_b]) == {"a"} and "a" in names[first_b:] and names[-1] == "b"


def _interleaved(cands: list, iters: int = 5) -> list:
    """`core.measure_interleaved` of ``cands`` on a tiny float32 decode case."""
    case = Shape(1, 4, 2, 32, 64, "float32").build(seed=0)
    try:
        return core.measure_interleaved(cands, case, warmup=1, iters=iters)
    finally:
        case.release()


def test_an_interleaved_candidate_that_fails_is_an_error_and_the_others_finish():
    log: list[tuple[str, int]] = []
    good, bad = _Logged("good", log), _Logged("bad", log, fail_at=6)  # breaks in its calibration
    res_good, res_bad = _interleaved([good, bad])
    assert res_good.ok and len(res_good.timing.samples_s) == 5
    assert res_bad.status == "error" and res_bad.reasons == ("RuntimeError: bad broke",)
    assert good.closed == bad.closed == 1


def test_the_interleave_flag_is_recorded_and_refused_where_nothing_reads_it(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = cli.main(["--suite", "smoke", "--shapes", "decode b3", "--candidates", "auto,mlx_sdpa",
                     "--interleave", "--iters", "2", "--quiet", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "interleaved: a sample of each timed candidate per round" in " ".join(capsys.readouterr().out.split())
    data = json.loads(out.read_text())
    assert {s["interleaved"] for s in data["suites"]} == {True}
    from metal_attn.bench import baselines

    assert baselines.load_run(out).run["interleave"] is True
    code = cli.main(["--suite", "generate", "--interleave", "--dry-run"])
    assert code == 2
    assert "--suite generate does not read --interleave" in capsys.readouterr().err


def test_only_candidates_that_measure_as_timed_candidates_do_are_interleaved():
    class OwnMeasure(_Logged):
        def measure(self, case, **kwargs):  # e.g. a candidate timing something other than its prepared call
            return candidates.CandidateResult(self.name, self.kind, "skipped", ("own",))

    log: list = []
    assert core.can_interleave(_Logged("a", log))
    assert not core.can_interleave(OwnMeasure("b", log))
    assert not core.can_interleave(peers.Ceiling())
    assert core.can_interleave(candidates.SettingsVariant("a[x=1]", _Logged("a", log), {"x": "1"}))
    assert not core.can_interleave(candidates.SettingsVariant("b[x=1]", OwnMeasure("b", log), {"x": "1"}))

_SHAPE = Shape(1, 4, 2, 32, 64, "float32")


class _Slow(_Logged):
    """A `_Logged` whose calls last 6 ms (a calibration loop is one call) and whose syncs are counted;
    its Prepared carries details, and a launch that logs itself as ``NAME+launch``."""

    def __init__(self, name, log, fail_at=None):
        super().__init__(name, log, fail_at)
        self.syncs = 0

    def prepare(self, case):
        prep = super().prepare(case)
        run = prep.run

        def slow():
            time.sleep(0.006)
            return run()

        def launch():
            self.log.append((self.name + "+launch", 0))
            return mx.zeros((1,))

        def sync():
            self.syncs += 1

        return dataclasses.replace(prep, run=slow, launch=launch, sync=sync, details={"k": 1})


class _Refusing(_Logged):
    """A `_Logged` whose breaking call raises NoProviderError (a forced kernel that failed to build)."""

    def prepare(self, case):
        prep = super().prepare(case)
        run = prep.run

        def refusing():
            try:
                return run()
            except RuntimeError as exc:
                raise NoProviderError(str(exc)) from None

        return dataclasses.replace(prep, run=refusing)


@pytest.mark.parametrize("interleave", [False, True])
def test_a_timed_candidate_calls_and_syncs_as_time_fn_does(interleave):
    """warmup=3: the opening call, one more warm-up call, a call per calibration loop (a 6 ms call fills
    one), then a call per sample; a sync after the opening call and around every loop and sample.
    Interleaved, once all are warm: two more calibration loops and a dropped sample. The result keeps the
    prepared details; a blocking run never calls the queued form."""
    log: list = []
    c = _Slow("s", log)
    (res,) = core.run_suite("t", [_SHAPE], [c], warmup=3, iters=2, interleave=interleave).results[0].candidates
    assert res.ok and res.timing.inner == 1 and len(res.timing.samples_s) == 2
    again = 2 + 1 if interleave else 0
    assert [n for n, _ in log] == ["s"] * (1 + 1 + 2 + again + 2)
    assert c.syncs == 1 + 2 * 2 + 2 * again + 2 * 2
    assert res.details == {"k": 1} and c.closed == 1


@pytest.mark.parametrize("interleave", [False, True])
def test_a_pipelined_run_samples_the_queued_form(interleave):
    log: list = []
    c = _Slow("s", log)
    (res,) = core.run_suite("t", [_SHAPE], [c], warmup=1, iters=2, pipelined=True,
                            interleave=interleave).results[0].candidates
    assert res.ok and log[0][0] == "s" and {n for n, _ in log[1:]} == {"s+launch"}


class _Queued(_Logged):
    """A `_Logged` whose blocking call and queued form both last 2 ms."""

    def prepare(self, case):
        prep = super().prepare(case)

        def two_ms():
            time.sleep(0.002)
            return mx.zeros((1,))

        return dataclasses.replace(prep, run=two_ms, launch=two_ms)


@pytest.mark.parametrize("interleave", [False, True])
def test_a_pipelined_sample_holds_enough_queued_calls_to_hide_its_boundary(interleave):
    """A pipelined sample waits once at each end, a blocking boundary whatever it holds, so it is sized for
    `PIPELINED_MIN_SAMPLE_S` (50 ms: 25 calls of 2 ms), where a blocking sample is sized for `MIN_SAMPLE_S`
    (5 ms: 3 calls). Sleeps only overrun, so the bounds allow calls up to 3.5 ms on a loaded host."""
    inner = {}
    for pipelined in (False, True):
        (res,) = core.run_suite("t", [_SHAPE], [_Queued("q", [])], warmup=1, iters=2, pipelined=pipelined,
                                interleave=interleave).results[0].candidates
        inner[pipelined] = res.timing.inner
        assert res.ok and res.timing.inner * res.timing.min_s >= 0.5 * (
            timing.PIPELINED_MIN_SAMPLE_S if pipelined else timing.MIN_SAMPLE_S)
    assert inner[False] <= 3 and inner[True] >= 14, inner


@pytest.mark.parametrize("interleave", [False, True])
def test_a_candidate_that_breaks_is_closed(interleave):
    """Broken at its first call (in `open`) or in the warm-up: an error, and its prepared call closed."""
    for fail_at in (0, 3):
        log: list = []
        bad = _Logged("bad", log, fail_at=fail_at)
        bad.kind = "provider"
        (res,) = core.run_suite("t", [_SHAPE], [bad], warmup=1, iters=2, interleave=interleave).results[0].candidates
        assert (res.status, res.reasons, res.kind, bad.closed) == ("error", ("RuntimeError: bad broke",), "provider",
                                                                   1), fail_at


@pytest.mark.parametrize("interleave", [False, True])
def test_a_candidate_whose_kernel_fails_to_build_is_refused_and_closed(interleave):
    for fail_at in (0, 3):  # at the opening call, in the warm-up
        log: list = []
        bad = _Refusing("bad", log, fail_at=fail_at)
        (res,) = core.run_suite("t", [_SHAPE], [bad], warmup=1, iters=2, interleave=interleave).results[0].candidates
        assert (res.status, res.reasons, bad.closed) == ("refused", ("bad broke",), 1), fail_at


def test_the_plain_runner_closes_what_it_measured():
    log: list = []
    a, b = _Logged("a", log), _Logged("b", log)
    core.run_suite("t", [_SHAPE], [a, b], warmup=1, iters=2)
    assert a.closed == b.closed == 1


def test_an_interleaved_candidate_that_breaks_mid_samples_is_dropped_from_the_rounds(monkeypatch):
    """Broken at its first kept sample (after the second calibration and the dropped round): an error,
    never called again, and the other one takes every sample."""
    samples: dict[str, int] = {}
    plain_sample = candidates.Opened.sample

    def counting_sample(self):
        samples[self.prep.route] = samples.get(self.prep.route, 0) + 1
        return plain_sample(self)

    monkeypatch.setattr(candidates.Opened, "sample", counting_sample)

    class BreaksWhenSampled(_Logged):
        def prepare(self, case):
            prep = super().prepare(case)
            inner = prep.run

            def run():
                self.tries += 1
                if samples.get(prep.route, 0) == 2:  # the dropped round's sample was the first
                    raise RuntimeError(f"{self.name} broke")
                return inner()

            return dataclasses.replace(prep, run=run)

    log: list = []
    good, bad = _Logged("good", log), BreaksWhenSampled("bad", log)
    bad.tries = 0
    res_good, res_bad = _interleaved([good, bad])
    assert res_good.ok and len(res_good.timing.samples_s) == 5
    assert res_bad.status == "error" and res_bad.reasons == ("RuntimeError: bad broke",)
    assert samples["bad route"] == 2 and samples["good route"] == 1 + 5
    assert bad.tries == sum(n == "bad" for n, _ in log) + 1  # one failed call, none after it
    assert good.closed == bad.closed == 1


def test_interleaved_samples_are_sized_by_the_second_calibration():
    """A candidate slow through its warm-up (a first-use cost) and fast after it: its samples are sized
    from the calibration taken once all are warm, not from the slow one."""

    class SlowWhileWarming(_Logged):
        def prepare(self, case):
            prep = super().prepare(case)
            inner = prep.run

            def run():
                time.sleep(0.004 if self.warming else 0.0)
                return inner()

            return dataclasses.replace(prep, run=run)

        def route_after(self, prep):  # the warm-up and its first calibration are done
            self.warming = False
            return super().route_after(prep)

    slow = SlowWhileWarming("s", [])
    slow.warming = True
    (res,) = _interleaved([slow], iters=1)
    # Sized from 4 ms calls a 5 ms sample would hold 2; warm calls (tens of µs) fill it with far more. The bound
    # leaves room for a loaded 2-core machine (it read under 50 once beside other tests).
    assert res.ok and res.timing.inner >= 10, res.timing.inner


def test_an_interleaved_candidate_whose_route_fails_is_an_error_and_not_sampled():
    class NoRoute(_Logged):
        def route_after(self, prep):
            raise RuntimeError("no route")

    log: list = []
    good, bad = _Logged("good", log), NoRoute("bad", log)
    res_good, res_bad = _interleaved([good, bad], iters=3)
    assert res_good.ok and (res_bad.status, res_bad.reasons) == ("error", ("RuntimeError: no route",))


def test_an_interleaved_variant_of_a_refusing_candidate_is_refused_under_its_own_name():
    class Skips(_Logged):
        def prepare(self, case):
            raise candidates.Skip("refused", ["not here"])

    log: list = []
    a, s = _Logged("a", log), Skips("s", log)
    cands = candidates.with_variants(lambda names: [{"a": a, "s": s}[n] for n in names])(["a", "s[partition_size=384]"])
    res_a, res_s = core.run_suite("t", [_SHAPE], cands, warmup=1, iters=2, interleave=True).results[0].candidates
    assert res_a.ok
    assert (res_s.name, res_s.kind, res_s.status, res_s.reasons) == ("s[partition_size=384]", "variant", "refused",
                                                                     ("not here",))


def test_interleaved_rounds_permute_the_rotated_list():
    log: list = []
    a, b = _Logged("a", log), _Logged("b", log)
    iters = 3
    res_a, res_b = core.run_suite("t", [_SHAPE], [a, b], warmup=1, iters=iters, interleave=True,
                                  rotate=1).results[0].candidates
    assert (res_a.name, res_b.name) == ("a", "b")  # results keep the list's order
    ia, ib = res_a.timing.inner, res_b.timing.inner
    assert [n for n, _ in log[-iters * (ia + ib):]] == _rounds([("b", ib), ("a", ia)], iters)


def test_time_fn_checks_its_counts():
    assert timing.time_fn(lambda: None, warmup=0, iters=1, sync=lambda: None, max_inner=4).inner == 4
    for kwargs, message in (({"warmup": 1.5}, "warmup=1.5"), ({"warmup": True}, "warmup=True"),
                            ({"max_inner": 0}, "max_inner=0")):
        with pytest.raises(ValueError, match=message):
            timing.time_fn(lambda: None, **kwargs)


def test_time_fn_on_a_clock_that_does_not_move_fills_samples_to_max_inner(monkeypatch):
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: 1.0))
    t = timing.time_fn(lambda: None, warmup=1, iters=1, sync=lambda: None, max_inner=8)
    assert t.inner == 8 and t.median_s == 0.0


def test_timing_of_summarizes_the_samples():
    samples = [3.0, 1.0, 2.0, 6.0]
    t = timing.timing_of(samples, 7)
    assert (t.median_s, t.min_s, t.mean_s, t.samples_s, t.inner) == (2.5, 1.0, 3.0, (3.0, 1.0, 2.0, 6.0), 7)
    assert t.stdev_s == pytest.approx(statistics.stdev(samples))
    assert timing.timing_of([2.0, 4.0], 1).stdev_s == pytest.approx(2**0.5)
    assert timing.timing_of([2.0], 1).stdev_s == 0.0


def test_run_options_give_interleave_only_when_the_flag_is():
    ns = argparse.Namespace(candidates=None, warmup=None, iters=None, repeat=None, pipelined=False, interleave=True)
    assert cli._run_options(ns)["interleave"] is True
    ns.interleave = False
    assert cli._run_options(ns)["interleave"] is None


def test_from_json_refuses_interleave(tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"suites": []}))
    rc = cli.main(["--from-json", str(run), "--compare", "x.json", "--interleave"])
    assert rc == 2 and "so --interleave would be ignored" in capsys.readouterr().err


def test_a_saved_run_records_interleave_only_when_it_is_true(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--suite", "smoke", "--shapes", "decode b3", "--candidates", "auto,mlx_sdpa",
                     "--iters", "2", "--quiet", "--json", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    for value in (False, 1, "yes"):
        for s in data["suites"]:
            s["interleaved"] = value
        out.write_text(json.dumps(data))
        assert "interleave" not in baselines.load_run(out).run, value


@pytest.mark.parametrize("interleave", [False, True])
def test_a_variant_finds_its_route_under_its_settings(interleave):
    class SettingsRoute(_Logged):
        def route_after(self, prep):
            from metal_attn.settings import get_settings

            return f"partition {get_settings().partition_size}"

    v = candidates.SettingsVariant("r[partition_size=384]", SettingsRoute("r", []), {"partition_size": "384"})
    (res,) = core.run_suite("t", [_SHAPE], [v], warmup=1, iters=2, interleave=interleave).results[0].candidates
    assert res.ok and res.route == "partition 384"


def test_the_sweeps_queued_timing_sizes_its_samples_for_queued_calls(monkeypatch):
    """`pipelined_median_s` (the sweeps' bare-launch timing) samples queued calls, so its samples are sized
    for `PIPELINED_MIN_SAMPLE_S`, as the bench's pipelined mode's are."""
    seen = {}

    def fake_time_fn(fn, **kwargs):
        seen.update(kwargs)
        return timing.timing_of([1.0], 1)

    monkeypatch.setattr(timing, "time_fn", fake_time_fn)
    assert candidates.pipelined_median_s(lambda: mx.zeros((1,)), warmup=2, iters=3) == 1.0
    assert seen == {"warmup": 2, "iters": 3, "min_sample_s": timing.PIPELINED_MIN_SAMPLE_S}


@pytest.mark.parametrize("pipelined", [False, True])
def test_time_calls_queues_or_waits_with_the_suites_sample_sizes(monkeypatch, pipelined):
    """`time_calls` (the probes' timing): queued calls go through ``mx.async_eval`` in samples of at least
    `PIPELINED_MIN_SAMPLE_S` (a sample of 2 ms calls holds 25 or more, so its closing wait is hidden), waited
    calls through ``mx.eval`` in samples of `MIN_SAMPLE_S`; anything but a bool for ``pipelined`` is refused."""
    evals = {"eval": 0, "async_eval": 0}
    real = {name: getattr(timing.mx, name) for name in evals}

    def counting(name):
        def wrapped(*arrays):
            evals[name] += 1
            return real[name](*arrays)
        return wrapped

    for name in evals:
        monkeypatch.setattr(timing.mx, name, counting(name))

    def two_ms():
        time.sleep(0.002)
        return mx.zeros((1,))

    t = timing.time_calls(two_ms, pipelined=pipelined, warmup=1, iters=2)
    used, unused = ("async_eval", "eval") if pipelined else ("eval", "async_eval")
    assert evals[used] > 0 and evals[unused] == 0, evals
    assert t.inner * t.min_s >= 0.5 * (timing.PIPELINED_MIN_SAMPLE_S if pipelined else timing.MIN_SAMPLE_S)
    assert (t.inner >= 14) if pipelined else (t.inner <= 3), t.inner
    with pytest.raises(ValueError, match=r"pipelined=1 \(allowed: True or False\)"):
        timing.time_calls(two_ms, pipelined=1)
