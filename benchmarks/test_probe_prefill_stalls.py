"""`benchmarks/probe_prefill_stalls.py --trace` without a GPU: its reading of a trace (made up here, in
torch.profiler's chrome-trace form)."""

from __future__ import annotations

import probe_args
import probe_prefill_stalls as ps
import pytest


def mark(i, ts, dur):
    return {"cat": "user_annotation", "name": f"{ps.SAMPLE_MARK}{i}", "ts": ts, "dur": dur, "tid": 1}


def gpu(name, ts, dur, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def api(name, ts, dur, tid=1):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid}


def py(name, ts, dur, tid=1):
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


#: Sample 0 steady: two overlapping kernels, then a third. Sample 1 stalls: a 2,500 µs host copy made from
#: inside ``run`` -> ``async_eval``, during which the GPU is idle but for the copy's own 400 µs.
TRACE = [
    mark(0, 0, 1000), gpu("k1", 100, 300), gpu("k2", 200, 300), gpu("k3", 700, 200),
    api("cudaGraphLaunch", 50, 20), api("cudaStreamSynchronize", 80, 900),
    mark(1, 2000, 4000), gpu("k1", 2100, 300), gpu("Memcpy DtoD (Device -> Managed)", 3000, 400, "gpu_memcpy"),
    gpu("k3", 5500, 300), api("cudaMemcpy", 2450, 2500), api("cudaMallocManaged", 2420, 20),
    api("cudaStreamSynchronize", 5000, 900), py("run", 1900, 4200), py("async_eval", 2400, 2600),
    py("elsewhere", 2400, 2600, tid=2),
]


def test_each_sample_reads_its_busy_time_gap_and_host_calls():
    steady, stall = ps.read_samples(TRACE, stacks=True)
    assert steady["wall_us"] == 1000 and steady["gpu_activities"] == 3
    assert steady["busy_us"] == 400 + 200  # k1 and k2 overlap once: 100-500, then 700-900
    assert (steady["gap_at_us"], steady["gap_us"]) == (500, 200)  # k2's end to k3 (longer than 0-100, 900-1000)
    assert stall["busy_us"] == 1000 and stall["gpu_activities"] == 3
    assert (stall["gap_at_us"], stall["gap_us"]) == (1400, 2100)  # the copy's end (3,400) to k3 (5,500)
    assert stall["api_in_gap"][0] == ("cudaMemcpy", 2500)
    assert stall["slowest_gpu"][0] == ("Memcpy DtoD (Device -> Managed)", 400)
    assert stall["api_over_100us"] == [("cudaMemcpy", 2500), ("cudaStreamSynchronize", 900)]
    assert dict(stall["api_total_us"])["cudaMallocManaged"] == 20
    # The copy's Python callers, innermost first, on its own thread only; the wait is not reported.
    assert stall["callers"] == [("cudaMemcpy", 2500, ["async_eval", "run"])]


def test_callers_are_reported_only_with_stacks():
    assert ps.read_samples(TRACE)[1]["callers"] == []


def test_spans_merge_where_they_overlap_or_touch():
    assert ps.union_spans([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_suite_shape_takes_exactly_one_prefill_gpu_shape():
    assert probe_args.prefill_suite_shape("mixed 32x1").label.startswith("mixed 32x1@1024")
    with pytest.raises(ValueError, match=r"--shape 'nothing' matches no shape of the prefill-gpu suite"):
        probe_args.prefill_suite_shape("nothing")
    with pytest.raises(ValueError, match=r"--shape 'mixed' matches 3 shapes"):
        probe_args.prefill_suite_shape("mixed")
