"""pytest-benchmark support for metal-attn: machine info, one group per shape, shared fixtures.

A benchmark module needs only (``test_bench_suite.py`` is that module)::

    def test_paged_attention(run_bench, bench_shape, bench_candidate):
        run_bench(bench_shape, bench_candidate)

``bench_shape`` x ``bench_candidate`` are parametrized from a suite of
`metal_attn.bench.suites` when a ``--bench-*`` option asks for one (``--bench-suite``,
default: decode on this backend; ``--bench-shapes`` filters it, ``--bench-candidates``
overrides its candidates); without one the test is skipped with that reason. The options are
checked as ``metal-attn bench`` checks ``--suite``, ``--shapes`` and ``--candidates`` (its own
functions, `metal_attn.bench.cli`): a name no plugin registered, a malformed variant, a pattern
matching nothing or a GPU suite on the CPU is a usage error, and so is a candidate pytest-benchmark
does not time (the ceiling). ``NAME[setting=value;...]`` variants run under their settings. Inputs are
built once per shape; a candidate that refuses a shape is skipped with its own reasons.

Ratios (`metal_attn.bench.ratios`, higher is better): each benchmark's ``extra_info`` gets
``ceiling_s`` (its shape's K+V bytes at the bandwidth ceiling measured in the same session) and,
in the saved JSON, ``speedup_vs_<peer>_ratio`` against every peer benchmark of its group and
``ceiling_fraction_ratio``. See benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest

from metal_attn.bench import candidates, cli, core, ratios, shapes, suites
from metal_attn.device import current_device

#: Keys added to pytest-benchmark's machine info, so runs on different chips are told apart.
MACHINE_KEYS: tuple[str, ...] = (
    "backend", "device_name", "architecture", "gpu_cores", "cpu_model", "mlx_version", "metal_attn_version",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("metal-attn", "metal-attn benchmarks")
    group.addoption("--bench-suite", default=None, metavar="NAME",
                    help=f"suite to parametrize from ({', '.join(suites.SUITES)}); default: decode-cpu on the CPU, "
                         "decode-gpu on GPUs")
    group.addoption("--bench-candidates", default=None, metavar="A,B,...",
                    help="candidates instead of the suite's (providers by name, auto, gather_sdpa, mlx_sdpa, "
                         "mlx_sdpa_packed, torch_sdpa; NAME[setting=value;...] for NAME under those settings)")
    group.addoption("--bench-shapes", default=None, metavar="PATTERN,...",
                    help="only shapes whose label contains a pattern (or matches a glob)")


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Backend, device name, GPU core count and versions: saved with every run and compared."""
    info = core.machine_info()
    machine_info.update({k: info.get(k) for k in MACHINE_KEYS})


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict[str, Any]) -> None:
    """Same-run ratios into every saved benchmark's ``extra_info``: its group's peers and the ceiling."""
    ratios.add_peer_ratios(output_json.get("benchmarks", []))


def _suite(config: pytest.Config) -> suites.Suite:
    name = config.getoption("--bench-suite")
    if name is None:
        name = suites.default_suite(current_device().backend)
    try:
        return suites.get_suite(name)
    except ValueError as exc:
        raise pytest.UsageError(f"--bench-suite: {exc}") from None


def _timed(cand: Any) -> bool:
    """Whether pytest-benchmark times ``cand`` (a timed candidate, or a settings variant of one)."""
    return isinstance(getattr(cand, "base", cand), candidates.TimedCandidate)


def _requested(config: pytest.Config) -> tuple[suites.Suite, tuple[shapes.Shape, ...], list[str]]:
    """The suite, shapes and candidate names the ``--bench-*`` options ask for, checked by `metal-attn bench`'s
    own rules (`cli.check_backend`, `cli.select_shapes`, `cli.resolve_candidates`); `pytest.UsageError`
    naming the option, its value and what is allowed."""
    suite = _suite(config)
    raw = config.getoption("--bench-candidates")
    try:
        if config.getoption("--bench-suite") is not None:
            cli.check_backend([suite], current_device().backend, "--bench-suite")
        chosen = cli.select_shapes(suite, config.getoption("--bench-shapes"), "--bench-shapes")
        names = cli.split_names(raw) if raw is not None else list(suite.candidates)
        if raw is not None and not names:
            raise cli.UsageError(f"--bench-candidates {raw!r} names nothing (allowed: names, comma-separated)")
        cands = cli.resolve_candidates(suite, names, typed=raw is not None, flag="--bench-candidates")
    except cli.UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    untimed = [c.name for c in cands if not _timed(c)]
    if raw is not None and untimed:
        # The ceiling is a reference line of `metal-attn bench`, not a kernel whose history is tracked.
        raise pytest.UsageError(
            f"--bench-candidates {untimed[0]!r} is measured by `metal-attn bench`, not timed by pytest-benchmark "
            "(allowed: providers by name, auto, and the peers gather_sdpa, mlx_sdpa, mlx_sdpa_packed, torch_sdpa; the "
            "ceiling's time for each shape is in every benchmark's extra_info as ceiling_s)")
    return suite, chosen, [c.name for c in cands if _timed(c)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not {"bench_shape", "bench_candidate"} <= set(metafunc.fixturenames):
        return
    cfg = metafunc.config
    if all(cfg.getoption(o) is None for o in ("--bench-suite", "--bench-shapes", "--bench-candidates")):
        # The fixed benchmark modules run by default; a suite is benchmarked on request.
        metafunc.parametrize(("bench_shape", "bench_candidate"), [pytest.param(None, None, marks=pytest.mark.skip(
            reason="pass --bench-suite NAME (or --bench-shapes / --bench-candidates) to benchmark a suite"))],
            ids=["no-suite-requested"])
        return
    _, shapes, names = _requested(cfg)
    pairs = [(s, n) for s in shapes for n in names]
    metafunc.parametrize(("bench_shape", "bench_candidate"), pairs,
                         ids=[f"{s.label.replace(' ', '_')}-{n}" for s, n in pairs])


class _Cases:
    """Inputs of the current shape only (tests run shape by shape, so each case is built once)."""

    def __init__(self) -> None:
        self._shape: shapes.Shape | None = None
        self._case: Any = None
        self._ceiling_s: float | None = None

    def get(self, shape: shapes.Shape) -> Any:
        if shape != self._shape:
            if self._case is not None:
                self._case.release()  # keep one shape's inputs alive at a time
            self._case = self._ceiling_s = None
            mx.clear_cache()  # a decode step's pools are tens of GB: give them back before the next
            self._case = shape.build()
            self._shape = shape
        return self._case

    def ceiling_s(self, shape: shapes.Shape) -> float | None:
        """The current shape's K+V bytes at the bandwidth ceiling (`peers.Ceiling`), measured once per shape;
        ``None`` for shapes without a bandwidth metric."""
        if "GB/s" not in shape.metrics:
            return None
        if self._ceiling_s is None:
            from metal_attn.bench import peers

            res = peers.Ceiling().measure(self.get(shape), warmup=1, iters=5)
            self._ceiling_s = shape.kv_bytes / (res.gbps * 1e9) if res.ok and res.gbps else None
        return self._ceiling_s


@pytest.fixture(scope="session")
def bench_suite(pytestconfig: pytest.Config) -> suites.Suite:
    """The suite the benchmarks are parametrized from (its warm-up count is used)."""
    return _suite(pytestconfig)


@pytest.fixture(scope="session")
def bench_cases() -> Iterator[_Cases]:
    """Shape -> inputs, with MLX's CPU buffer cache raised for the whole session."""
    with core.cpu_cache_limit():
        yield _Cases()


@pytest.fixture
def run_bench(benchmark: Any, bench_cases: _Cases, bench_suite: suites.Suite) -> Callable[..., None]:
    """``run_bench(shape, candidate, rounds=None, group=None, suite=None)``: warm up, then time one
    finished call per round with pytest-benchmark (``rounds``: a fixed count, else pytest-benchmark's
    calibration; ``group``: the benchmark group, default the shape's label; ``suite``: whose
    candidates these are, default the session's). A refusing candidate is skipped with its reasons;
    GB/s and TFLOP/s of the median and the ceiling's time go into ``extra_info``."""

    def run(shape: shapes.Shape, candidate: str, rounds: int | None = None, group: str | None = None,
            suite: suites.Suite | None = None) -> None:
        (cand,) = candidates.with_variants((suite or bench_suite).resolve)([candidate])
        if not _timed(cand):
            pytest.skip(f"{candidate} is measured by `metal-attn bench`, not by pytest-benchmark")
        base = getattr(cand, "base", cand)
        # A variant (NAME[setting=value;...]) is its base candidate prepared, called and closed under its settings.
        scope = cand.scope() if isinstance(cand, candidates.SettingsVariant) else contextlib.nullcontext()
        case = bench_cases.get(shape)
        with scope:
            try:
                prep = base.prepare(case)
            except candidates.Skip as skip:
                pytest.skip(f"{candidate} {skip.status} on {shape.label}: {'; '.join(skip.reasons)}")
            benchmark.group = group or shape.label
            benchmark.extra_info.update(candidate=candidate, kind=cand.kind, shape=shape.to_dict(),
                                        kv_bytes=shape.kv_bytes, flops=shape.flops)
            try:
                for _ in range(max(bench_suite.warmup, 1)):  # the first call compiles: never time it
                    prep.run()
                prep.sync()
                route = base.route_after(prep)
                benchmark.extra_info["route"] = route

                def target() -> None:
                    prep.run()
                    prep.sync()

                if rounds is None:
                    benchmark(target)
                else:
                    benchmark.pedantic(target, rounds=rounds, iterations=1, warmup_rounds=1)
            finally:
                if prep.close:
                    prep.close()
        core.record_rates(benchmark, shape)
        ceiling_s = bench_cases.ceiling_s(shape)
        if ceiling_s is not None:
            benchmark.extra_info["ceiling_s"] = ceiling_s

    return run
