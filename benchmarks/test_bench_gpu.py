"""GPU benchmarks (pytest-benchmark): the classic and tiled providers next to their peers, and
the split-KV gate sweep that measures the CUDA gate factor.

Run on a GPU machine:

    python3 -m pytest benchmarks/test_bench_gpu.py --benchmark-only --benchmark-json out.json

- group ``decode-gpu <shape>``: one group per shape of the ``decode-gpu`` suite
  (KERNELS.md's peer table plus two mixed batches), the suite's candidates (``auto``,
  what the registry routes to; the providers; ``gather_sdpa``, ``mlx_sdpa`` and
  ``torch_sdpa`` when importable; not the copy ceiling, which ``metal-attn bench``
  measures), built by `metal_attn.bench` (same inputs and peers as ``metal-attn bench``);
  a candidate that refuses a shape skips with its reasons;
- group ``prefill-gpu <shape>``: the ``prefill-gpu`` suite (causal prompts, a chunk
  after earlier context, the two mixed batches), its candidates likewise;
- group ``decode-step <shape>``: the ``decode-step`` suite, a whole 32-layer decode step
  (18 layers at b64 L8192) per round: one metadata shared by the layers, every layer's call
  queued, one eval; ``auto``, the providers, MLX SDPA and torch SDPA on contiguous K/V over the
  same layers;
- group ``split-gate ctx=<n>``: 32/8 heads, head 128, bf16 decode, batch 1..64,
  each route forced through the gate (GPU core count overridden), to find where
  splitting stops paying: the crossover ``num_heads * batch / gpu_cores`` is the
  gate factor (recorded in docs/bench-h200-classic.md).

Every timed call evaluates its output (``mx.eval``; MLX then waits for the GPU);
warm-up rounds keep the first compile out of the numbers. Skips elsewhere with a reason.
The saved JSON carries same-run ratios in ``extra_info`` (benchmarks/conftest.py).
Kernel geometry variants are timed by ``benchmarks/sweep_gpu_tuning.py`` (bare launches).
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

GATE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
GATE_CONTEXTS = (2048, 8192)
GATE_CORES = {"per_token_ps0": 1, "per_token_ps512": 4096}


def _suite_shapes(name: str = "decode-gpu"):
    from metal_attn.bench.suites import get_suite

    return get_suite(name).shapes


def _suite_candidates(name: str) -> tuple[str, ...]:
    """The suite's candidates that pytest-benchmark times (the copy ceiling is `metal-attn bench`'s)."""
    from metal_attn.bench.candidates import TimedCandidate
    from metal_attn.bench.suites import get_suite

    suite = get_suite(name)
    return tuple(c.name for c in suite.resolve(suite.candidates) if isinstance(c, TimedCandidate))


DECODE_CANDIDATES = _suite_candidates("decode-gpu")
PREFILL_CANDIDATES = _suite_candidates("prefill-gpu")
STEP_CANDIDATES = _suite_candidates("decode-step")


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


@pytest.mark.parametrize("candidate", STEP_CANDIDATES)
@pytest.mark.parametrize("shape", _suite_shapes("decode-step") if BACKEND in ("cuda", "metal") else (),
                         ids=lambda s: s.label)
def test_decode_step(run_bench, shape, candidate):
    from metal_attn.bench.suites import get_suite

    run_bench(shape, candidate, rounds=10, group=f"decode-step {shape.label}", suite=get_suite("decode-step"))


@pytest.mark.parametrize("route", tuple(GATE_CORES))
@pytest.mark.parametrize("batch", GATE_BATCHES)
@pytest.mark.parametrize("context", GATE_CONTEXTS)
def test_split_gate(benchmark, bench_cases, context, batch, route):
    import mlx.core as mx

    import metal_attn
    from metal_attn.bench.shapes import Shape
    from metal_attn.settings import override_settings

    shape = Shape(batch, 32, 8, 128, context, "bfloat16")
    case = bench_cases.get(shape)
    benchmark.group = f"split-gate ctx={context}"
    with override_settings(gpu_cores=GATE_CORES[route], partition_size=512 if route == "per_token_ps512" else 0):

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
