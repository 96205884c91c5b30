"""`benchmarks/probe_kernel_text.py` without a GPU: its --texts parsing, the rounds' order and the summary."""

from __future__ import annotations

import argparse

import probe_kernel_text as pk
import pytest

from metal_attn._layout import kernels_dir


def test_texts_keep_their_order_and_dash_is_the_packages_own():
    got = pk.parse_texts(f"base={kernels_dir()},new=-")
    assert list(got) == ["base", "new"]
    assert got["base"] == kernels_dir() and got["new"] is None


@pytest.mark.parametrize(("text", "needle"), [
    ("base", "allowed: NAME=DIR"),
    ("=x", "allowed: NAME=DIR"),
    ("a=-,a=-", "names 'a' twice"),
    ("a=/nonexistent", "no kernel texts there"),
])
def test_bad_texts_are_refused(text, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        pk.parse_texts(text)


def test_each_version_goes_first_in_turn():
    assert [pk.rotate(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_the_summary_is_against_the_first_version_and_the_ceiling():
    row = pk.summary("s", {"base": [40.0, 42.0, 41.0], "new": [39.0, 38.0, 40.0]}, 30.0)
    base, new = row["versions"]["base"], row["versions"]["new"]
    assert base["median_us"] == 41.0 and base["vs_base"] == 1.0
    assert new["median_us"] == 39.0 and new["vs_base"] == pytest.approx(39.0 / 41.0)
    assert new["ceiling_pct"] == pytest.approx(100 * 30.0 / 39.0)
    text = pk.line(row)
    assert text.startswith("s: base [40.0, 42.0, 41.0] 41.0 µs (x1.000, 73.2%)")
    assert "new [39.0, 38.0, 40.0] 39.0 µs (x0.951, 76.9%)" in text


def test_the_line_ends_with_torch_when_it_was_timed():
    row = pk.summary("s", {"base": [40.0]}, 30.0)
    row["torch_sdpa_us"] = 37.5
    assert pk.line(row).endswith("| torch SDPA 37.5 µs, 80.0%")


def test_a_calls_kernel_time_is_each_kernels_median_times_its_launches():
    import kernel_trace

    kernels = [{"median_us": 40.0, "launches_per_call": 1.0}, {"median_us": 3.5, "launches_per_call": 2.0}]
    assert kernel_trace.kernel_us(kernels) == 47.0
    assert kernel_trace.kernel_us([]) == 0.0


def test_a_version_may_run_under_settings_of_its_own():
    sets = [pk.parse_set("s1:reducer_slices=1"), pk.parse_set("s1:mma_key_rows=0")]
    assert sets[0] == ("s1", "reducer_slices", "1")
    assert pk.version_settings(sets, ["rule", "s1"]) == {"rule": {}, "s1": {"reducer_slices": "1", "mma_key_rows": "0"}}
    with pytest.raises(ValueError, match="no version 'sx' in --texts"):
        pk.version_settings([("sx", "reducer_slices", "1")], ["rule", "s1"])
    for bad in ("s1", "s1:reducer_slices", ":x=1", "s1:=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed: NAME:SETTING=VALUE"):
            pk.parse_set(bad)


def _event(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}


def test_a_timeline_gives_each_launch_its_median_offsets_from_the_calls_first_event():
    import kernel_trace

    # three blocking calls, 1,000 us apart: rows and chunk side by side, then the finish, launched twice
    calls = [[_event("rows", t, 50.0), _event("chunk", t + 2.0, 190.0), _event("finish", t + 192.0, 10.0),
              _event("finish", t + 203.0, 4.0)] for t in (0.0, 1000.0, 2000.0)]
    calls[1][1]["dur"] = 194.0  # the second call's chunk ran 4 us longer, the third's 8
    calls[2][1]["dur"] = 198.0
    calls[2][0]["ts"] += 1.0  # and the third's rows started 1 us late (its first event still)
    events = [e for call in reversed(calls) for e in reversed(call)]  # the order given must not matter
    rows = kernel_trace.timeline(events, 3)
    assert [(r["name"], r["launch"]) for r in rows] == [("rows", 0), ("chunk", 0), ("finish", 0), ("finish", 1)]
    assert rows[1]["start_us"] == 2.0 and rows[1]["end_us"] == 196.0  # start 2, median duration 194
    assert rows[3]["start_us"] == 203.0 and rows[3]["end_us"] == 207.0
    lines = kernel_trace.timeline_lines({"timeline": rows}, 10)
    assert lines[0] == "        0.0 ->    50.0 us  rows"
    assert lines[3].endswith("finish #2")


def test_a_timeline_tells_calls_apart_by_the_gpus_idle_time_not_by_counting():
    import kernel_trace

    # the first call's copy makes five events for two calls: counting would cut through the second call
    first = [_event("copy", 0.0, 3.0), _event("rows", 5.0, 50.0), _event("chunk", 6.0, 190.0)]
    second = [_event("rows", 1000.0, 50.0), _event("chunk", 1001.0, 190.0)]
    assert kernel_trace.timeline(first + second, 2) is None  # the calls launched different kernels
    third = [_event("copy", 2000.0, 3.0), _event("rows", 2005.0, 50.0), _event("chunk", 2006.0, 190.0)]
    rows = kernel_trace.timeline(first + third, 2)
    assert [(r["name"], r["start_us"]) for r in rows] == [("copy", 0.0), ("rows", 5.0), ("chunk", 6.0)]


def test_a_timeline_is_none_when_the_calls_launched_different_kernels():
    import kernel_trace

    assert kernel_trace.timeline([_event("a", 0, 1), _event("b", 5, 1), _event("a", 100, 1)], 2) is None
    assert kernel_trace.timeline([_event("a", 0, 1), _event("b", 5, 1), _event("a", 100, 1),
                                  _event("a", 105, 1)], 2) is None
    assert kernel_trace.timeline([_event("a", 0, 1)], 2) is None
    assert kernel_trace.timeline([], 3) is None
    assert kernel_trace.timeline_lines({"timeline": None}, 10) == []
