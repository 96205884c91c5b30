"""GPU benchmarks (pytest-benchmark): the classic and tiled providers next to their peers, and
the split-KV gate sweep that measures the CUDA gate factor.

Run on a GPU machine:

    python3 -m pytest benchmarks/test_bench_gpu.py --benchmark-only --benchmark-json out.json

- group ``decode-gpu <shape>``: one group per shape of the ``decode-gpu`` suite
  (KERNELS.md's peer table plus two mixed batches), candidates ``auto`` (what the
  registry routes to), ``classic`` (split where the gate says so), ``gather_sdpa``,
  ``mlx_sdpa`` and ``torch_sdpa`` (when importable), built by `metal_attn.bench` (same
  inputs and peers as ``metal-attn bench``);
- group ``prefill-gpu <shape>``: the ``prefill-gpu`` suite (causal prompts, a chunk
  after earlier context, the two mixed batches), ``tiled_prefill`` next to the peers;
- group ``split-gate ctx=<n>``: 32/8 heads, head 128, bf16 decode, batch 1..64,
  each route forced through the gate (GPU core count overridden), to find where
  splitting stops paying: the crossover ``num_heads * batch / gpu_cores`` is the
  gate factor (recorded in docs/bench-h200-classic.md).

Every timed call evaluates its output (``mx.eval``; MLX then waits for the GPU);
warm-up rounds keep the first compile out of the numbers. Skips elsewhere with a reason.
"""

from __future__ import annotations

import pytest

from metal_attn.bench import core
from metal_attn.device import current_device, detect_backend

BACKEND = detect_backend()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(BACKEND not in ("cuda", "metal"),
                       reason=f"GPU benchmarks need an MLX GPU backend (this process runs on backend={BACKEND})"),
]
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed")

DECODE_CANDIDATES = ("auto", "classic", "gather_sdpa", "mlx_sdpa", "torch_sdpa")
PREFILL_CANDIDATES = ("tiled_prefill", "gather_sdpa", "mlx_sdpa", "torch_sdpa")
GATE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
GATE_CONTEXTS = (2048, 8192)
GATE_CORES = {"per_token_ps0": 1, "per_token_ps512": 4096}


def _suite_shapes(name: str = "decode-gpu"):
    from metal_attn.bench.suites import get_suite

    return get_suite(name).shapes


def _machine(benchmark, **extra) -> None:
    dev = current_device()
    benchmark.extra_info.update(backend=dev.backend, chip=dev.name, architecture=dev.architecture,
                                gpu_cores=dev.gpu_cores, **extra)


@pytest.mark.parametrize("candidate", DECODE_CANDIDATES)
@pytest.mark.parametrize("shape", _suite_shapes() if BACKEND in ("cuda", "metal") else (),
                         ids=lambda s: s.label)
def test_decode(run_bench, shape, candidate):
    run_bench(shape, candidate, rounds=20, group=f"decode-gpu {shape.label}")


@pytest.mark.parametrize("candidate", PREFILL_CANDIDATES)
@pytest.mark.parametrize("shape", _suite_shapes("prefill-gpu") if BACKEND in ("cuda", "metal") else (),
                         ids=lambda s: s.label)
def test_prefill(run_bench, shape, candidate):
    run_bench(shape, candidate, rounds=10, group=f"prefill-gpu {shape.label}")


@pytest.mark.parametrize("route", tuple(GATE_CORES))
@pytest.mark.parametrize("batch", GATE_BATCHES)
@pytest.mark.parametrize("context", GATE_CONTEXTS)
def test_split_gate(benchmark, bench_cases, context, batch, route):
    import mlx.core as mx

    import metal_attn
    from metal_attn.bench.core import Shape
    from metal_attn.settings import override_settings

    shape = Shape(batch, 32, 8, 128, context, "bfloat16")
    case = bench_cases.get(shape)
    benchmark.group = f"split-gate ctx={context}"
    with override_settings(gpu_cores=GATE_CORES[route]):

        def run():
            out = metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                             scale=case.scale, provider="classic")
            mx.eval(out)
            return out

        run()
        assert metal_attn.diagnostics.last_dispatch().route == route
        benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=3)
    _machine(benchmark, route=route, grid=32 * batch, batch=batch, context=context)
    core.record_rates(benchmark, shape)


#: (lanes per token, tokens unrolled per lane, heads per threadgroup) variants, 32/8 heads, head 128 bf16.
GEOMETRIES = ((16, 2, 4), (16, 1, 4), (8, 2, 4), (16, 2, 2), (16, 2, 1), (4, 1, 1), (8, 2, 1))
GEOMETRY_SHAPES = ((8, 4096, True), (64, 8192, False))  # (batch, context, split)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: "lanes{}-unroll{}-hps{}".format(*g))
@pytest.mark.parametrize("batch_ctx_split", GEOMETRY_SHAPES, ids=lambda t: f"b{t[0]}-L{t[1]}-split{int(t[2])}")
def test_geometry_sweep(benchmark, bench_cases, batch_ctx_split, geo):
    """Kernel geometry tuning: each variant's output must match the default geometry's."""
    import mlx.core as mx
    from metal_attn.providers.classic.gpu import Geometry, launch_paged

    from metal_attn.bench.core import Shape

    batch, context, split = batch_ctx_split
    shape = Shape(batch, 32, 8, 128, context, "bfloat16")
    case = bench_cases.get(shape)
    benchmark.group = f"geometry b{batch} L{context} split={int(split)}"

    def run(g=Geometry(*geo)):
        out = launch_paged(case.q, case.k_pool, case.v_pool, case.metadata, scale=case.scale, sinks=None,
                           sliding_window=None, softcap=None, split=split, backend=current_device().backend,
                           geometry_override=g)
        mx.eval(out)
        return out

    assert core.rel_l2(run(), run(None)) <= 1e-2
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=3)
    _machine(benchmark, lanes=geo[0], unroll=geo[1], hps=geo[2], batch=batch, context=context, split=split)
    core.record_rates(benchmark, shape)
