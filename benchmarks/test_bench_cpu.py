"""CPU benchmarks (pytest-benchmark): the classic provider's native kernel next to its peers.

Run on a CPU machine (the table in docs/bench-cpu.md comes from ``metal-attn bench``;
this module keeps the same shapes under pytest-benchmark for saved runs and
``--benchmark-compare``):

    python3 -m pytest benchmarks/test_bench_cpu.py --benchmark-only --benchmark-json cpu.json

- group ``decode-cpu <shape>``: batch 8, 32 query / 8 KV heads, head 128, contexts
  1K/4K/16K, float32 and bfloat16;
- group ``prefill-cpu <shape>``: one 2048-token causal prompt, same geometry;

candidates ``classic`` (native kernel), ``mlx_sdpa`` (MLX SDPA on contiguous K/V),
``gather_sdpa`` (gather pages with ``mx.take``, then MLX SDPA) and ``reference``,
built by `metal_attn.bench` exactly as ``metal-attn bench`` builds them, plus
``numpy_sum``: a numpy sum over as many bytes as the shape's K+V (the read
bandwidth of this machine, measured in the same run). MLX's buffer cache is
raised for the session so the peers are not measured on page faults. Every
timed call evaluates its output. The slow peers get fewer rounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from metal_attn.bench import core, peers, suites
from metal_attn.device import detect_backend

BACKEND = detect_backend()
pytestmark = pytest.mark.skipif(
    BACKEND != "cpu", reason=f"CPU benchmarks need the cpu backend (this process runs on backend={BACKEND})"
)
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed")

#: The CPU suites' candidates (metal_attn/bench/suites.py) but the copy ceiling, which `numpy_sum` stands for here.
CANDIDATES = peers.timed(suites.get_suite("decode-cpu").candidates)
#: Rounds per candidate: the peers take up to seconds per call on 2 cores.
ROUNDS = {"classic": 10, "mlx_sdpa": 3, "gather_sdpa": 2, "reference": 2, "numpy_sum": 10}


def _shapes(suite: str):
    return tuple((suite, s) for s in suites.get_suite(suite).shapes)


SHAPES = (_shapes("decode-cpu") + _shapes("prefill-cpu")) if BACKEND == "cpu" else ()


def _info(benchmark, shape, **extra) -> None:
    from metal_attn.bench.core import machine_info

    m = machine_info()
    benchmark.extra_info.update(backend=m.get("backend"), cpu_model=m.get("cpu_model"), kv_bytes=shape.kv_bytes,
                                flops=shape.flops, **extra)


@pytest.mark.parametrize("candidate", (*CANDIDATES, "numpy_sum"))
@pytest.mark.parametrize(("suite", "shape"), SHAPES, ids=lambda v: v if isinstance(v, str) else v.label)
def test_cpu(benchmark, run_bench, suite, shape, candidate):
    if candidate == "numpy_sum":
        benchmark.group = f"{suite} {shape.label}"
        buf = np.ones(shape.kv_bytes // 8)
        _info(benchmark, shape, candidate=candidate, kind="ceiling", route="numpy sum (read)")
        benchmark.pedantic(buf.sum, rounds=ROUNDS[candidate], iterations=1, warmup_rounds=1)
        core.record_rates(benchmark, shape)
    else:
        run_bench(shape, candidate, rounds=ROUNDS[candidate], group=f"{suite} {shape.label}")
