"""Run the CUDA providers' Python on a machine without CUDA: fake ``mx.fast.cuda_kernel`` objects.

`fake_cuda` makes the device probe answer a CUDA device (default: the hypothetical
`DeviceInfo.preset("h200")`, so admission and plans are the H200's and `compile_eagerly` skips
its launch) and replaces ``mx.fast.cuda_kernel`` by a factory of `FakeKernel` objects:
`metal_attn.kernels` assembles, names and caches each kernel as usual, and a launch records its
arguments and returns lazy zeros of the requested output shapes and dtypes. MLX's fused SDPA,
which CUDA has and the CPU backend does not, is stood in for by the unfused one
(``force_fused`` dropped), so the routes that call it (``sdpa_prefill``) build their graphs too; or, for
timing, by lazy zeros of its output (``sdpa="zeros"``). Nothing is computed:
this is for the host side (what reaches the kernels, and what it costs), never for numerics.
`fake_chains` does the same for CUDA chains (`metal_attn.cuda_ops`, whose module is built on the GPU
machine only): ``chain`` builds `FakeChain` objects and ``kernel_function`` numbers the kernels it is
asked for, so the routes take their chained form, as on an H200 with the module built.
Used by ``benchmarks/host_cost_python.py`` and the launch-descriptor tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from metal_attn import _epoch, cuda_ops, device, kernels
from metal_attn.device import DeviceInfo

__all__ = ["SDPA_STAND_INS", "FakeChain", "FakeChains", "FakeCuda", "FakeKernel", "Launch", "fake_chains", "fake_cuda"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel's name (`metal_attn.kernels.kernel_name`) and its arguments."""

    kernel: str
    args: dict[str, Any]

    def template(self) -> dict[str, Any]:
        return dict(self.args["template"])


class FakeKernel:
    """Stands in for an ``mx.fast.cuda_kernel`` object: records each launch in ``owner`` (while its
    ``record`` is on), returns lazy zeros of the requested outputs (one array per output geometry,
    reused, so the fake's own cost per launch stays small)."""

    def __init__(self, owner: FakeCuda | None = None, **spec: Any) -> None:
        self.owner = owner
        self.spec = spec
        self._zeros: dict[tuple, mx.array] = {}

    @property
    def name(self) -> str:
        return self.spec["name"]

    def __call__(self, *, inputs: list, template: list, grid: tuple, threadgroup: tuple,
                 output_shapes: list, output_dtypes: list, **rest: Any) -> list[mx.array]:
        if self.owner is not None and self.owner.record:
            self.owner.launches.append(Launch(self.name, {
                "inputs": inputs, "template": template, "grid": grid, "threadgroup": threadgroup,
                "output_shapes": output_shapes, "output_dtypes": output_dtypes, **rest}))
        out = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            key = (tuple(shape), dtype)
            z = self._zeros.get(key)
            if z is None:
                z = self._zeros[key] = mx.zeros(shape, dtype)
            out.append(z)
        return out


@dataclasses.dataclass
class FakeCuda:
    """What `fake_cuda` installed: the kernel objects built while it was active and their launches,
    in call order (recorded while ``record`` is on)."""

    kernels: list[FakeKernel] = dataclasses.field(default_factory=list)
    launches: list[Launch] = dataclasses.field(default_factory=list)
    record: bool = True
    #: MLX SDPA calls (with ``fake_cuda(sdpa="zeros")``, while ``record`` is on).
    sdpa_calls: int = 0


#: What stands in for MLX's fused SDPA under `fake_cuda`: ``"unfused"``, MLX's unfused SDPA (the graph is
#: built, so tests can evaluate it); ``"zeros"``, lazy zeros of the output's shape and dtype, one array per
#: geometry, reused (for timing the Python around it, as `FakeKernel` does for our kernels).
SDPA_STAND_INS = ("unfused", "zeros")


@contextlib.contextmanager
def fake_cuda(dev: DeviceInfo | None = None, *, sdpa: str = "unfused") -> Iterator[FakeCuda]:
    """Run the CUDA providers' Python on this machine: the probe answers ``dev`` (default: the
    H200 preset), ``mx.fast.cuda_kernel`` builds `FakeKernel` objects and MLX's fused SDPA is stood in
    for as ``sdpa`` says (`SDPA_STAND_INS`); all undone on exit, with the kernel objects and every
    dispatch cache (`metal_attn._epoch`) dropped."""
    if sdpa not in SDPA_STAND_INS:
        raise ValueError(f"sdpa={sdpa!r} (allowed: {', '.join(SDPA_STAND_INS)})")
    fake = FakeCuda()
    zeros: dict[tuple, mx.array] = {}
    dev = dev or DeviceInfo.preset("h200")
    real_probe, real_cuda_kernel = device._probed, mx.fast.cuda_kernel
    real_sdpa = mx.fast.scaled_dot_product_attention

    def factory(**spec: Any) -> FakeKernel:
        k = FakeKernel(fake, **spec)
        fake.kernels.append(k)
        return k

    def unfused(*args: Any, force_fused: bool = False, **kwargs: Any) -> mx.array:
        return real_sdpa(*args, **kwargs)

    def stand_in_zeros(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if fake.record:
            fake.sdpa_calls += 1
        key = (*q.shape[:-1], v.shape[-1], q.dtype)
        out = zeros.get(key)
        if out is None:
            out = zeros[key] = mx.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
        return out

    kernels.clear_cache()
    device._probed = lambda: dev
    mx.fast.cuda_kernel = factory
    mx.fast.scaled_dot_product_attention = unfused if sdpa == "unfused" else stand_in_zeros
    _epoch.bump()
    try:
        yield fake
    finally:
        device._probed, mx.fast.cuda_kernel = real_probe, real_cuda_kernel
        mx.fast.scaled_dot_product_attention = real_sdpa
        kernels.clear_cache()
        _epoch.bump()


@dataclasses.dataclass
class FakeChain:
    """Stands in for a ``_cuda_ops.Chain``: the arguments `metal_attn.cuda_ops.chain` gave it; a call
    records its inputs in ``calls`` (while its ``owner`` records, as `FakeKernel` does; never without an
    owner) and returns lazy zeros of the outputs' shapes and dtypes (one array per output, reused)."""

    name: str
    input_dtypes: list
    outputs: list
    scratch: list
    launches: list
    input_shapes: list
    state: list
    pooled: bool = True
    initial: list = dataclasses.field(default_factory=list)
    commit_when_idle: bool = False
    direct_when_idle: int = 0
    after: list = dataclasses.field(default_factory=list)
    owner: FakeChains | None = dataclasses.field(default=None, repr=False)
    calls: list = dataclasses.field(default_factory=list)
    _zeros: list = dataclasses.field(default_factory=list, repr=False)

    def __call__(self, inputs: list) -> list[mx.array]:
        if self.owner is not None and self.owner.record:
            self.calls.append(inputs)
        if not self._zeros:
            self._zeros.extend(mx.zeros(tuple(shape), dtype) for shape, dtype in self.outputs)
        return list(self._zeros)


@dataclasses.dataclass
class FakeChains:
    """What `fake_chains` installed: the chains built while it was active, and the kernel functions
    compiled (each one's spec, in order: the function handle is 1000 + its index); its chains record
    their calls while ``record`` is on."""

    chains: list[FakeChain] = dataclasses.field(default_factory=list)
    functions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    record: bool = True
    #: `spin_until_idle` calls so far (the fake GPU is always idle: one poll each).
    spins: int = 0

    def call_count(self) -> int:
        """Calls recorded so far, over every chain."""
        return sum(len(c.calls) for c in self.chains)


@contextlib.contextmanager
def fake_chains() -> Iterator[FakeChains]:
    """`metal_attn.cuda_ops` as if its module were built (``METAL_ATTN_CUDA_CHAINS`` still decides whether
    chains are used): ``chain`` builds `FakeChain` objects, ``kernel_function`` records each kernel's
    spec; both undone on exit, with every dispatch cache (`metal_attn._epoch`) dropped."""
    fake = FakeChains()

    class Module:
        @staticmethod
        def idle_commits() -> dict[str, int]:
            return {"idle": 0, "ahead": 0, "direct": 0}

        @staticmethod
        def spin_until_idle() -> int:
            fake.spins += 1
            return 1

        @staticmethod
        def Chain(name: str, input_dtypes: list, outputs: list, scratch: list, launches: list,
                  input_shapes: list, state: list, pooled: bool, initial: list,
                  commit_when_idle: bool, direct_when_idle: int = 0, after: list | None = None) -> FakeChain:
            c = FakeChain(name, input_dtypes, outputs, scratch, launches, input_shapes, state, pooled, initial,
                          commit_when_idle, direct_when_idle, list(after or ()), owner=fake)
            fake.chains.append(c)
            return c

    def kernel_function(name: str, source_files: Any, defines: Any, inputs: Any, outputs: Any,
                        template: Any) -> int:
        fake.functions.append(dict(name=name, defines=defines, inputs=list(inputs), outputs=list(outputs),
                                   template=list(template)))
        return 1000 + len(fake.functions) - 1

    real_native, real_kernel_function = cuda_ops.native, cuda_ops.kernel_function
    cuda_ops.native = lambda: Module
    cuda_ops.kernel_function = kernel_function
    _epoch.bump()
    try:
        yield fake
    finally:
        cuda_ops.native, cuda_ops.kernel_function = real_native, real_kernel_function
        _epoch.bump()
