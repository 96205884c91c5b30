"""`benchmarks/probe_call_gaps.py` without a GPU: its reading of a CUPTI trace (made up here, in
torch.profiler's chrome-trace form)."""

from __future__ import annotations

import argparse

import probe_args
import probe_call_gaps as pg
import pytest


def kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def launch(ts, dur, corr, name="cudaGraphLaunch"):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


#: Two calls of a split kernel and its reducer, each call one graph launch. The first was launched
#: long before; the second's launch call started 5 µs after the GPU went idle and returned 10 µs after.
TRACE = [
    launch(-10, 5, 1), kernel("paged_attention_split<128>(int)", 0, 50, 1), kernel("reduce_kernel", 52, 3, 1),
    launch(60, 5, 2), kernel("paged_attention_split<128>(int)", 70, 50, 2), kernel("reduce_kernel", 122, 3, 2),
    {"cat": "cpu_op", "name": "aten::empty", "ts": 0, "dur": 200},
]


def test_the_timeline_splits_each_calls_period_into_busy_and_idle():
    t = pg.timeline(TRACE, calls=2)
    assert t == {"period_us": 62.5, "busy_us": 53.0, "idle_us": 9.5}


def test_overlapping_activities_count_once():
    t = pg.timeline([kernel("a", 0, 10, 1), kernel("b", 2, 4, 1), kernel("c", 12, 8, 2)], calls=1)
    assert t == {"period_us": 20.0, "busy_us": 18.0, "idle_us": 2.0}


def test_each_gap_is_named_by_its_neighbours_and_split_by_its_launch_call():
    g = pg.gaps(TRACE, calls=2)
    assert g["idle_us"] == pytest.approx(9.5)
    assert g["host_late_us"] == pytest.approx(2.5)       # 5 µs of the one 15 µs span, per call of two
    assert g["host_late_end_us"] == pytest.approx(5.0)   # 10 µs
    assert g["queued_us"] == pytest.approx(2.5 + 2.0)    # 5 µs of that span and the two 2 µs spans
    pairs = {(p["before"], p["after"]): p for p in g["pairs"]}
    assert pairs[("paged_attention_split", "reduce_kernel")] == {
        "before": "paged_attention_split", "after": "reduce_kernel", "per_call": 1.0, "median_us": 2.0,
        "us_per_call": 2.0}
    assert pairs[("reduce_kernel", "paged_attention_split")]["us_per_call"] == 7.5
    assert g["pairs"][0]["before"] == "reduce_kernel"  # the costliest first


def test_a_short_kernel_inside_a_long_one_neither_makes_a_gap_nor_names_the_next():
    events = [kernel("long", 0, 20, 1), kernel("inside", 5, 2, 1), kernel("next", 25, 5, 2)]
    (pair,) = pg.gaps(events, calls=1)["pairs"]
    assert (pair["before"], pair["after"], pair["median_us"]) == ("long", "next", 5.0)


def test_api_calls_are_counted_per_call_by_name():
    rows = pg.api_calls([*TRACE, launch(0, 1.0, 9, "cudaEventRecord")], calls=2)
    assert rows[0] == {"name": "cudaGraphLaunch", "calls_per_call": 1.0, "us_per_call": 5.0}
    assert rows[1] == {"name": "cudaEventRecord", "calls_per_call": 0.5, "us_per_call": 0.5}


def test_the_printed_line_holds_the_split():
    row = {"wall_us": 70.0, "timeline": pg.timeline(TRACE, 2), "gaps": pg.gaps(TRACE, 2), "api": []}
    text = pg.line("b8", "auto", row)
    assert "wall 70.0 | period 62.5 busy 53.0 idle 9.5 µs" in text
    assert "host late 2.5-5.0, queued 4.5" in text
    assert "reduce_kernel→paged_attention_split 0.5x 15.0" in text


@pytest.mark.parametrize("text", ["b8:32:8", "b8:32:8:128:x", "b0:32:8:128:4096", ""])
def test_bad_shapes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="batch:heads:kv_heads:head_size:context"):
        probe_args.decode_shapes(text)


def test_shapes_parse_with_or_without_the_b():
    assert probe_args.decode_shapes("b8:32:8:128:4096,1:24:4:256:65536") == ((8, 32, 8, 128, 4096),
                                                                            (1, 24, 4, 256, 65536))


def test_candidates_are_chosen_by_name_and_an_unknown_name_is_refused():
    assert pg.parse_names("auto, step_compiled") == ("auto", "step_compiled")
    for text in ("auto,step_fast", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"allowed: a comma-separated subset of auto, mlx_sdpa"):
            pg.parse_names(text)


def test_the_command_line_refuses_an_unknown_candidate_before_measuring(capsys):
    import sys
    from unittest import mock

    with mock.patch.object(sys, "argv", ["probe_call_gaps.py", "out.json", "--candidates", "nope"]), \
            pytest.raises(SystemExit) as exc:
        pg.main()
    assert exc.value.code == 2
    assert "--candidates='nope' (allowed:" in capsys.readouterr().err
