"""Python host cost of the CUDA launch path, measured on a machine without a GPU.

    python benchmarks/host_cost_python.py [--calls N] [--samples N] [--profile LABEL] [--plugins] [--no-chains]

What it measures: the thread CPU time (``time.thread_time_ns``, so other processes on a loaded
machine do not count) that building one layer's paged work costs in Python, on the route an H200
takes: `metal_attn.paged_attention` with the step's shared ``metadata=`` and the cache write
`metal_attn.api.write_checked` (what `PagedKVCache.write_step` calls per layer), for 32/8 heads,
head 128, bfloat16, 16-token pages.

How, without CUDA (`metal_attn.testing.fake_cuda`, which the tests of the launch descriptors use too):

- the device probe answers `DeviceInfo.preset("h200")` (a hypothetical device: admission and
  plans are the H200's, `compile_eagerly` skips its launch);
- ``mx.fast.cuda_kernel`` is replaced by a factory of `FakeKernel` objects: `metal_attn.kernels`
  assembles, names and caches each kernel as usual, and a launch records its arguments and returns
  ``mx.zeros`` of the requested output shapes and dtypes (lazy, never evaluated; one array per
  output geometry, reused);
- MLX's fused SDPA (one operation on CUDA; the CPU backend would build its unfused graph, 10 µs a call on a
  2-core CPU) returns lazy zeros of its output (``fake_cuda(sdpa="zeros")``), counted like a launch;
- CUDA chains (`metal_attn.cuda_ops`, on by default where their module is built, as on the H200) are
  `FakeChain` objects (`fake_chains`), so every route takes its chained form; ``--no-chains`` times the
  ``mx.fast`` launches instead (``METAL_ATTN_CUDA_CHAINS=0``).

``launches``, ``chains`` and ``sdpa`` count one call's fake kernel launches, chain calls and SDPA calls. The
fakes' own cost per call is measured alone and reported (``fake/launch``, ``fake/chain``, ``fake/sdpa``), so
``net`` is the Python of the path (and MLX's graph building of its other operations) without them.
MLX's real per-launch cost (its C++ and the driver) is not measured here:
`benchmarks/host_cost_classic.py` on the GPU does that.

Per case: ``attn`` is one steady-state layer (the same metadata as the previous call: layers 2..32
of a step); ``step/32`` is a 32-layer step on a fresh metadata (its first layer misses every
per-metadata cache), per layer; ``write`` is one cache write. One sample is ``--calls`` calls in a
row (the lazy outputs are kept and freed outside the timed span); the figure is the median of
``--samples`` samples. ``--profile LABEL`` prints a cProfile of the steady-state call instead.

After the cases, ``peers of`` lines give the same figure for MLX SDPA's calls on each mixed batch (the
SDPA stand-in again, ``net`` without its cost): ``mlx_sdpa`` on per-group queries made beforehand, as the
benchmark's peer runs, and ``mlx_sdpa_packed`` from and to the packed rows a paged call takes and returns
(`metal_attn.bench.peers`). Their difference is what the packed layout costs MLX SDPA's graph building.

The built-in providers are timed: third-party plugins are not loaded (an installed decode plugin, such as
the example one CI installs, would otherwise take the decode cases) unless ``--plugins`` is given. Each
line names the provider and route its case ran.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn import diagnostics
from metal_attn.api import write_checked
from metal_attn.bench.peers import sdpa_packed, sdpa_per_group
from metal_attn.bench.shapes import Rows, Shape, build_case
from metal_attn.device import DeviceInfo
from metal_attn.metadata import AttentionMetadata
from metal_attn.settings import override_settings
from metal_attn.testing.fake_cuda import FakeChain, FakeChains, FakeCuda, FakeKernel, fake_chains, fake_cuda
from metal_attn.testing.overrides import opened_sdpa_prefill_rule

LAYERS = 32


# -- the cases -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    shape: Shape
    gpu_cores: int | None = None  # None: the H200's 132; fewer moves the split gate (unsplit route)
    route_opened: bool = False  # SDPA_PREFILL_RULES opened on CUDA: the gathered route below its pairs bound
    settings: tuple[tuple[str, Any], ...] = ()  # settings the case runs under (an A/B of a setting)

    def device(self) -> DeviceInfo:
        """The probed device of the case: the H200 preset, with ``gpu_cores`` when given."""
        dev = DeviceInfo.preset("h200")
        return dev.replace(gpu_cores=self.gpu_cores) if self.gpu_cores else dev

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The overrides the case runs under: its ``settings``, and `opened_sdpa_prefill_rule` for ``route_opened``."""
        with (override_settings(**dict(self.settings)),
              opened_sdpa_prefill_rule("cuda") if self.route_opened else contextlib.nullcontext()):
            yield


def cases() -> list[Case]:
    dec = lambda b: Shape(b, 32, 8, 128, 4096, "bfloat16")  # noqa: E731
    mixed = Shape.mix([Rows(8, 1, 4096), Rows(1, 256, 1024)], 32, 8, 128)
    mixed2 = Shape.mix([Rows(32, 1, 1024), Rows(1, 256, 1024), Rows(1, 256, 2048)], 32, 8, 128)  # two runs
    chunk = Shape(1, 32, 8, 128, 2112, "bfloat16", q_len=64)  # the prefill suite's chunk after 2K: split tiles
    own_chain = (("cuda_decode_rows_in_chain", False),)
    return [
        Case("b1 L4096 split", dec(1)),
        Case("b8 L4096 split", dec(8)),
        Case("b1 L4096 unsplit (gpu_cores=1)", dec(1), gpu_cores=1),
        Case("b8 L4096 unsplit (gpu_cores=1)", dec(8), gpu_cores=1),
        Case("mixed 8x1@4096 + 256@1024", mixed),
        Case("mixed 32x1@1024 + 256@1024 + 256@2048", mixed2),
        Case("mixed 32x1@1024 + 256@1024 + 256@2048 (decode rows in their own chain)", mixed2, settings=own_chain),
        Case("chunk 64@2112", chunk),
        Case("chunk 64@2112 (sdpa_prefill rule opened)", chunk, route_opened=True),
    ]


@dataclasses.dataclass
class Bound:
    """One case's inputs and the three calls timed."""

    provider: str
    route: str
    attn: Callable[[], Any]
    step: Callable[[], Any]
    write: Callable[[], Any]
    launches: int  # fake kernel launches of one call
    chain_calls: int = 0  # fake chain calls of one call
    sdpa_calls: int = 0  # MLX SDPA calls of one call (fake)


def bind(case: Case, fake: FakeCuda, chains: FakeChains | None = None) -> Bound:
    c = build_case(case.shape)
    s = case.shape
    tables, lens = c.block_tables, np.array(s.seq_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(s.q_lens)]).astype(np.int32)
    md = c.metadata
    k_new = mx.zeros((s.total_q_tokens, s.num_kv_heads, s.head_size), c.q.dtype)
    slots = mx.array((tables[:, 0].astype(np.int64) * s.block_size)[np.repeat(np.arange(s.batch), s.q_lens)]
                     + np.concatenate([np.arange(q) for q in s.q_lens]))
    mx.eval(k_new, slots)

    def attn() -> mx.array:
        return metal_attn.paged_attention(c.q, c.k_pool, c.v_pool, metadata=md, scale=c.scale)

    def step() -> list[mx.array]:
        m = AttentionMetadata.build(mx.array(tables), mx.array(lens), mx.array(cu))  # untimed below
        t0 = time.thread_time_ns()
        outs = [metal_attn.paged_attention(c.q, c.k_pool, c.v_pool, metadata=m, scale=c.scale)
                for _ in range(LAYERS)]
        return outs, time.thread_time_ns() - t0

    def write() -> tuple[mx.array, mx.array]:
        return write_checked(k_new, k_new, c.k_pool, c.v_pool, slots)

    attn()  # builds every chain the call uses
    fake.launches.clear()
    fake.sdpa_calls = 0
    before = chains.call_count() if chains else 0
    attn()
    chain_calls = chains.call_count() - before if chains else 0
    chosen = diagnostics.last_dispatch()
    return Bound(chosen.provider, chosen.route, attn, step, write, len(fake.launches), chain_calls, fake.sdpa_calls)


@contextlib.contextmanager
def bound_case(case: Case, plugins: bool = False, chains: bool = True) -> Iterator[Bound]:
    """``case`` bound (`bind`) under fake CUDA, recording off; with the built-in providers only unless
    ``plugins`` (then the third-party ones the settings load as well); through fake CUDA chains unless
    ``chains`` is false (then ``METAL_ATTN_CUDA_CHAINS=0``: the ``mx.fast`` launches)."""
    with contextlib.ExitStack() as stack:
        if not plugins:
            stack.enter_context(override_settings(plugin_autoload=False))
        if not chains:
            stack.enter_context(override_settings(cuda_chains=False))
        fake_chain_objects = stack.enter_context(fake_chains())
        fake = stack.enter_context(fake_cuda(case.device(), sdpa="zeros"))
        stack.enter_context(case.scope())
        b = bind(case, fake, fake_chain_objects)
        fake.record = fake_chain_objects.record = False
        yield b


def per_call_us(fn: Callable[[], Any], calls: int, samples: int) -> float:
    """Median over ``samples`` of the thread CPU time of ``calls`` calls, per call, in µs."""
    out = []
    for _ in range(samples):
        keep = []
        t0 = time.thread_time_ns()
        for _ in range(calls):
            keep.append(fn())
        out.append((time.thread_time_ns() - t0) / calls / 1e3)
        del keep
    return statistics.median(out)


def step_us(step: Callable[[], Any], samples: int) -> float:
    """Median over ``samples`` 32-layer steps (each on a fresh metadata), per layer, in µs."""
    out = []
    for _ in range(samples):
        outs, ns = step()
        out.append(ns / LAYERS / 1e3)
        del outs
    return statistics.median(out)


def fake_launch_us(calls: int, samples: int) -> float:
    """The fake kernel's own cost per launch (three outputs, as the split kernel's)."""
    k = FakeKernel(name="calibration")
    args = dict(inputs=[], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                output_shapes=[(8, 32, 8), (8, 32, 8), (8, 32, 8, 128)], output_dtypes=[mx.float32] * 3)
    return per_call_us(lambda: k(**args), calls, samples)


def fake_chain_us(calls: int, samples: int) -> float:
    """The fake chain's own cost per call (one output, as the per-token chain's)."""
    c = FakeChain("calibration", [], [((8, 32, 128), mx.bfloat16)], [], [], [], [])  # no owner: no record
    inputs = [mx.zeros((1,))] * 9
    return per_call_us(lambda: c(inputs), calls, samples)


def fake_sdpa_us(calls: int, samples: int) -> float:
    """The SDPA stand-in's own cost per call (`fake_cuda` with ``sdpa="zeros"``)."""
    q = mx.zeros((1, 32, 256, 128), mx.bfloat16)
    k = mx.zeros((1, 8, 1024, 128), mx.bfloat16)
    with fake_cuda(sdpa="zeros") as fake:
        fake.record = False
        return per_call_us(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask="causal"),
                           calls, samples)


def peer_build_us(shape: Shape, calls: int, samples: int) -> dict[str, float]:
    """The graph building of the MLX SDPA peers on ``shape``, µs a call with the SDPA stand-in
    (`metal_attn.bench.peers`: ``mlx_sdpa`` on ready-made per-group queries, ``mlx_sdpa_packed`` from and to
    the packed rows the paged API takes and returns)."""
    with fake_cuda(sdpa="zeros") as fake:
        fake.record = False
        case = build_case(shape)
        return {name: per_call_us(build(case), calls, samples)
                for name, build in (("mlx_sdpa", sdpa_per_group), ("mlx_sdpa_packed", sdpa_packed))}


def run(calls: int, samples: int, profile: str | None, plugins: bool = False, chains: bool = True) -> None:
    print("providers: " + ("the built-in ones and the third-party ones the settings load" if plugins
                           else "the built-in ones only (--plugins: also the third-party ones)")
          + "; CUDA chains " + ("on (fake)" if chains else "off (--no-chains)"), flush=True)
    fake_us = fake_launch_us(calls, samples)
    chain_us = fake_chain_us(calls, samples)
    sdpa_us = fake_sdpa_us(calls, samples)
    print(f"fake/launch {fake_us:.2f} µs, fake/chain {chain_us:.2f} µs, fake/sdpa {sdpa_us:.2f} µs "
          "(subtracted in 'net')", flush=True)
    width = max(len(c.label) for c in cases())
    for case in cases():
        if profile and profile not in case.label:
            continue
        with bound_case(case, plugins, chains) as b:
            for fn in (b.attn, b.write):  # warm every cache
                for _ in range(20):
                    fn()
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(2000):
                    b.attn()
                prof.disable()
                print(f"== {case.label} ({b.provider}/{b.route}): 2000 steady-state calls")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                continue
            attn = per_call_us(b.attn, calls, samples)
            step = step_us(b.step, samples)
            write = per_call_us(b.write, calls, samples)
        net = attn - b.launches * fake_us - b.chain_calls * chain_us - b.sdpa_calls * sdpa_us
        print(f"{case.label:{width}s} {b.provider:14s} {b.route:22s} launches {b.launches} chains {b.chain_calls} "
              f"sdpa {b.sdpa_calls}  attn {attn:6.1f}  net {net:6.1f}  step/32 {step:6.1f}  write {write:6.1f}  µs",
              flush=True)
    if profile:
        return
    # one line per mixed shape (two cases may share one, as an A/B of a setting)
    for label, shape in {c.shape.label: c.shape for c in cases() if c.shape.phase == "mixed"}.items():
        groups = len(shape.rows)
        peers = ", ".join(f"{name} {us:.1f} (net {us - groups * sdpa_us:.1f})"
                          for name, us in peer_build_us(shape, calls, samples).items())
        print(f"peers of {label}: {peers} µs", flush=True)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200, help="calls per sample (default 200)")
    p.add_argument("--samples", type=int, default=25, help="samples per figure (default 25)")
    p.add_argument("--profile", metavar="LABEL", help="cProfile the steady-state call of the cases matching LABEL")
    p.add_argument("--plugins", action="store_true",
                   help="also time third-party providers, as the settings load them (default: built-in only)")
    p.add_argument("--no-chains", action="store_true",
                   help="time the mx.fast launches (METAL_ATTN_CUDA_CHAINS=0) instead of the chained route")
    a = p.parse_args(argv)
    run(a.calls, a.samples, a.profile, a.plugins, not a.no_chains)


if __name__ == "__main__":
    main(sys.argv[1:])
