"""The Metal text of the classic kernels executed on the CPU: a simulation of whole Apple threadgroups,
built with g++ from ``tests/metal_sim/``.

CI has no GPU, and no other CPU test executes ``kernels_v2/pagedattention.metal`` (the per-token
kernel and the split-KV reducer ``paged_attention_v2_reduce``), ``reshape_and_cache.metal`` or
``gqa_decode.metal``. Here they run as Metal would get them: `kernels.load_kernel` is replaced by
`SimulatedMetal.load_kernel`, so the providers' own launch code (``launch_paged``, the classic plan
and run, the reducer's launch, ``write_cache``, the GQA decode launch) picks the Metal geometry,
template arguments, defines, grid, threadgroup size, partition size and parameters, and the kernel
object it builds assembles the text MLX would compile (`kernels.assemble`: the Metal prelude, the
generated defines, the headers, the body section). That text goes into a C++ translation unit shaped
like MLX's kernel (a template over the input and output pointers, instantiated with the launch's
template arguments) after ``tests/metal_sim/sim_metal.h``, an executable stand-in for the Metal
builtins the text and ``prelude_metal.h`` use, so the prelude's helpers run too.

The simulation runs every threadgroup of the grid whole: its threads are cooperative fibers
(``sim_fiber.h``: a few instructions a switch on x86-64, ``swapcontext`` elsewhere), 32 lanes a
simdgroup, taking turns in a shuffled ring; ``threadgroup`` arrays are memory the fibers share,
filled with a poison pattern before each threadgroup (a read of what the threadgroup did not write
shows); ``threadgroup_barrier`` and every ``simd_*`` call are barriers of the threadgroup or the
simdgroup, values exchanged through slots; ``simdgroup_matrix`` 8x8 products (the matrix path,
``PA_MMA 1``) multiply in float in Apple's ``thread_elements()`` layout as MLX's steel kernels record
it. A ``simd_*`` call or barrier that not every lane or thread reaches (or lanes at different calls)
stops the run with a message; outputs start as NaN bytes, so an element left unwritten shows.
Threadgroups are spread over a few worker processes (``sim_driver.h``).

Covered, against the float64 oracle with the dtype's tolerance (``assert_close_to_oracle``):
``reshape_and_cache`` byte for byte against a scatter (K and V distinct, padding slots, the
grid-stride loop); the per-token kernel unsplit and split (with the reducer) in Metal's geometry at
every head size the classic provider admits, all three dtypes, every kernel block size, GQA groups 1
to 8, scattered pages, sinks, sliding windows (neutral partials included), softcap, the NaN contract,
more partitions than the reducer has threads and the reducer's partition slices; the classic
provider's plan and run for a Metal device; the staged and matrix paths (``PA_STAGED 1``, ``PA_MMA 1``)
that Metal's tables never choose but the Metal source check type-checks (``source_check_launches``),
and the CUDA table's geometries (several heads per threadgroup and per simdgroup, staged chunks, the
matrix path with 8 heads) through the Metal prelude; the GQA decode kernel at every geometry of the
Metal table; and that the simulation itself catches planted synchronisation errors.

Left out: ``PA_MMA 2`` and ``PA_SWIZZLE`` (CUDA's tensor-core paths: the Metal prelude refuses the one
and lacks the fragment loads of the other) and ``PA_FUSED`` (CUDA chains only: its atomics and fences
are the CUDA prelude's). Not modelled: Apple's arithmetic (float here, IEEE, the host compiler's
contractions; ``max``/``min`` as IEEE fmax/fmin), the order of a simdgroup's hardware reductions and
matrix products, races beyond the fibers' interleaving at synchronisation points, threadgroup-memory
limits, and whether Apple's matrix layout is the one MLX records. float16 and bfloat16 are 16-bit
types converting to and from float with IEEE rounding (a signalling NaN quieted, as hardware
conversions do). Executables are kept in pytest's cache, keyed by everything they are built from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metal_attn import kernels
from metal_attn._layout import import_builtin_providers, kernels_dir
from metal_attn.constants import (
    DTYPES,
    GQA_DECODE_GEOMETRIES,
    GQA_PARTITION_SIZES,
    KERNEL_BLOCK_SIZES,
    PARTITION_SIZE,
)
from metal_attn.device import DeviceInfo
from metal_attn.provider import AttentionInputs
from metal_attn.request import AttentionRequest
from metal_attn.settings import get_settings, override_settings
from metal_attn.testing import assert_close_to_oracle, make_case

import_builtin_providers()
from metal_attn.providers import gpu_common as gc  # noqa: E402
from metal_attn.providers import gqa_decode as gqa  # noqa: E402
from metal_attn.providers.classic import GPU_HEAD_SIZES  # noqa: E402
from metal_attn.providers.classic import gpu as classic_gpu  # noqa: E402

SIM_DIR = Path(__file__).parent / "metal_sim"
#: How every simulator is built (-O1: a third of -O0's run time for twice its compile time), and what
#: it links (dlinfo, for the threadgroup memory's poison: in libc since glibc 2.34, libdl before).
GXX_FLAGS = ("-std=c++20", "-O1", "-w")
GXX_LIBS = ("-ldl",)
#: Executables pytest's cache keeps (about 100 KB each; this module builds about 60 per kernel text).
CACHE_KEEP = 400
#: The C++ type of each MLX dtype in the generated signatures (sim_metal.h defines the 16-bit ones).
C_TYPES = {"float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float", "int32": "int32_t",
           "int64": "int64_t", "uint32": "uint32_t", "uint16": "uint16_t", "uint8": "uint8_t"}
#: The unsigned view that carries each float dtype's bytes to and from the simulation unchanged.
_BITS = {"float16": mx.uint16, "bfloat16": mx.uint16, "float32": mx.uint32}
#: A Metal device as the providers see one (hypothetical: nothing runs on it but the simulation).
METAL = DeviceInfo(backend="metal", name="simulated Apple GPU", architecture="applegpu_g15s", gpu_cores=10,
                   max_threadgroup_memory=32 * 1024, hypothetical=True)
#: The split route's partition size on Metal (the classic provider's rule for the backend).
METAL_PARTITION = gc.PARTITION_RULES["metal"].sizes[0]
#: The smallest partition size the per-token text takes (METAL_ATTN_PARTITION_SIZE can force it on Metal).
SMALL_PARTITION = min(gc.PER_TOKEN_PARTITION_SIZES)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _to_bytes(arr: mx.array) -> bytes:
    name = _dtype_name(arr.dtype)
    return np.ascontiguousarray(np.array(arr.view(_BITS[name]) if name in _BITS else arr)).tobytes()


def _from_bytes(data: bytes, shape: Sequence[int], dtype: Any) -> mx.array:
    name = _dtype_name(dtype)
    host = np.frombuffer(data, dtype=np.dtype(_dtype_name(_BITS.get(name, dtype)))).reshape(tuple(shape))
    return mx.array(host).view(dtype) if name in _BITS else mx.array(host)


@dataclasses.dataclass
class Launch:
    """One simulated launch, as the provider made it."""

    kernel: str
    defines: dict[str, Any]
    template: dict[str, Any]
    grid: tuple[int, ...]
    threadgroup: tuple[int, ...]


class SimulatedMetal:
    """`kernels.load_kernel` for ``backend="metal"``: kernel objects that execute the assembled Metal
    text on the CPU simulation (one g++ build per distinct source and instantiation, kept for the module)."""

    def __init__(self, root: Path, gxx: str, cache: Path | None = None, seed: int = 1) -> None:
        self.root = root
        self.gxx = gxx
        #: Where executables are kept between sessions (pytest's cache), by a hash of everything they
        #: are built from; None: built afresh under ``root``.
        self.cache = cache
        self._toolchain = "".join([subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout,
                                   *(p.read_text() for p in sorted(SIM_DIR.glob("*.h")))])
        #: The fibers' ring order: 0 thread order, else shuffled per threadgroup from this seed.
        self.seed = seed
        self.workers = max(1, min(4, os.cpu_count() or 1))
        self.launches: list[Launch] = []
        self._built: dict[str, Path] = {}
        self._runs = itertools.count()
        if cache is not None:  # keep the most recently used executables only
            old = sorted(cache.glob("sim-*"), key=lambda p: p.stat().st_mtime)[:-CACHE_KEEP]
            for p in old:
                p.unlink(missing_ok=True)

    def load_kernel(self, name: str, source_files: Sequence[str], input_names: Sequence[str],
                    output_names: Sequence[str], backend: str, *, defines: Any = None,
                    ensure_row_contiguous: bool = True) -> SimKernel:
        """The stand-in for `kernels.load_kernel` (same arguments)."""
        assert backend == "metal", f"the simulation runs the Metal text (backend={backend!r})"
        return SimKernel(self, name, tuple(source_files), tuple(input_names), tuple(output_names), dict(defines or {}))

    def build(self, source: str) -> Path:
        """The simulator executable of one translation unit (compiled once; kept in the cache when there is one)."""
        key = hashlib.sha1("\0".join([*GXX_FLAGS, *GXX_LIBS, self._toolchain, source]).encode()).hexdigest()[:20]
        if key in self._built:
            return self._built[key]
        exe = (self.cache or self.root) / f"sim-{key}"
        if exe.is_file():
            exe.touch()  # recently used
        else:
            d = self.root / key
            d.mkdir(exist_ok=True)
            (d / "kernel.cpp").write_text(source)
            cmd = [self.gxx, *GXX_FLAGS, f"-I{SIM_DIR}", str(d / "kernel.cpp"), "-o", str(d / "sim"), *GXX_LIBS]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, f"g++ failed on {d / 'kernel.cpp'}:\n{proc.stderr[-6000:]}"
            os.replace(d / "sim", exe)  # atomic: a concurrent session sees the whole file or none
        self._built[key] = exe
        return exe


class SimKernel:
    """One kernel object: called like an ``mx.fast.metal_kernel`` object, it runs the simulation."""

    def __init__(self, sim: SimulatedMetal, name: str, source_files: tuple[str, ...], input_names: tuple[str, ...],
                 output_names: tuple[str, ...], defines: dict[str, Any]) -> None:
        self.sim = sim
        self.name = name
        self.input_names = input_names
        self.output_names = output_names
        self.defines = defines
        self.header, self.body = kernels.assemble(name, source_files, "metal", defines)

    def source(self, inputs: Sequence[mx.array], template: Sequence[tuple[str, Any]],
               output_dtypes: Sequence[Any]) -> str:
        """The C++ translation unit: MLX's kernel shape (template, input and output pointers) around the text."""
        params, args = [], []
        for i, (n, a) in enumerate(zip(self.input_names, inputs, strict=True)):
            ct = C_TYPES[_dtype_name(a.dtype)]
            params.append(f"const {ct}* {n}")
            args.append(f"reinterpret_cast<const {ct}*>(sim_bufs[{i}])")
        for j, (n, dt) in enumerate(zip(self.output_names, output_dtypes, strict=True)):
            ct = C_TYPES[_dtype_name(dt)]
            params.append(f"{ct}* {n}")
            args.append(f"reinterpret_cast<{ct}*>(sim_bufs[{len(inputs) + j}])")
        tparams, targs = [], []
        for n, v in template:
            if isinstance(v, mx.Dtype):
                tparams.append(f"typename {n}")
                targs.append(C_TYPES[_dtype_name(v)])
            elif isinstance(v, bool):
                tparams.append(f"bool {n}")
                targs.append("true" if v else "false")
            else:
                tparams.append(f"int {n}")
                targs.append(str(int(v)))
        instance = f"sim_kernel<{', '.join(targs)}>" if targs else "sim_kernel"
        # The header and the body carry their own #line directives (kernels.assemble).
        return "".join([
            '#include "sim_metal.h"\n',
            self.header, "\n",
            '#include "sim_body_begin.h"\n',
            f'#line 1 "(generated signature of {self.name})"\n',
            f"template <{', '.join(tparams)}>\n" if tparams else "",
            f"void sim_kernel({', '.join(params)}) {{\n",
            self.body, "}\n",
            '#include "sim_body_end.h"\n',
            f"static void sim_kernel_entry() {{ {instance}({', '.join(args)}); }}\n",
            '#include "sim_driver.h"\n',
        ])

    def __call__(self, *, inputs: Sequence[mx.array], template: Sequence[tuple[str, Any]], grid: tuple[int, ...],
                 threadgroup: tuple[int, ...], output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[Any],
                 **_: Any) -> list[mx.array]:
        """Run the launch on the simulation (inputs' bytes in, outputs' bytes back, as MLX arrays)."""
        exe = self.sim.build(self.source(inputs, template, output_dtypes))
        run = self.sim.root / f"run{next(self.sim._runs)}"
        run.mkdir()
        sizes = []
        for i, a in enumerate(inputs):
            data = _to_bytes(a)
            (run / f"in{i}.bin").write_bytes(data)
            sizes.append(len(data))
        out_bytes = [int(np.prod(s)) * dt.size for s, dt in zip(output_shapes, output_dtypes, strict=True)]
        head = [*grid, *threadgroup, self.sim.seed, self.sim.workers, len(inputs), len(out_bytes)]
        (run / "launch.txt").write_text(" ".join(map(str, head + sizes + out_bytes)) + "\n")
        proc = subprocess.run([str(exe), str(run)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{self.name}: the simulation failed ({proc.returncode}): {proc.stderr[-3000:]}"
        self.sim.launches.append(Launch(self.name, self.defines, dict(template), tuple(grid), tuple(threadgroup)))
        outs = [_from_bytes((run / f"out{j}.bin").read_bytes(), s, dt)
                for j, (s, dt) in enumerate(zip(output_shapes, output_dtypes, strict=True))]
        shutil.rmtree(run)
        return outs


@pytest.fixture(scope="module")
def metal_sim(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config, gxx: str) -> SimulatedMetal:
    """The simulation (g++ from the conftest's ``gxx``: skipped where it is missing, failing in CI); executables
    kept in pytest's cache when it is on."""
    cache = pytestconfig.cache.mkdir("metal_sim") if getattr(pytestconfig, "cache", None) is not None else None
    return SimulatedMetal(tmp_path_factory.mktemp("metal_sim"), gxx, cache)


@pytest.fixture
def sim(metal_sim: SimulatedMetal, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedMetal]:
    """Every kernel object the providers build in the test is a simulated Metal one."""
    monkeypatch.setattr(kernels, "load_kernel", metal_sim.load_kernel)
    metal_sim.launches.clear()
    seed = metal_sim.seed
    yield metal_sim
    metal_sim.seed = seed


# -- reshape_and_cache ---------------------------------------------------------------------------------


def _bits(arr: mx.array) -> np.ndarray:
    return np.array(arr.view(_BITS[_dtype_name(arr.dtype)]))


@pytest.mark.parametrize("max_groups", [classic_gpu.CACHE_MAX_GROUPS, 3], ids=["provider-grid", "grid-stride"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_reshape_and_cache_is_a_scatter_byte_for_byte(sim, monkeypatch, dtype, max_groups):
    # A pool of 20 pages of 16 slots, 2 KV heads of 64: 37 new tokens (5 of them padding, slot -1) land
    # on scattered slots; K and V (old and new) are all distinct, and signalling NaNs (which a copy
    # through float would quiet) sit in the old pools and the new rows, so a swapped, shifted,
    # converted or skipped element shows in the bytes.
    monkeypatch.setattr(classic_gpu, "CACHE_MAX_GROUPS", max_groups)  # 3: every thread loops over the pool
    rng = np.random.default_rng(7)
    nb, bs, kvh, head, n = 20, 16, 2, 64, 37
    mxd = getattr(mx, dtype)
    snan = {"float16": 0x7C01, "bfloat16": 0x7F81, "float32": 0x7F800001}[dtype]
    args = []
    for shape, shift in (((n, kvh, head), -10.0), ((n, kvh, head), 20.0), ((nb, bs, kvh, head), 0.0),
                         ((nb, bs, kvh, head), 10.0)):
        bits = _bits(mx.array(rng.standard_normal(shape).astype(np.float32) + shift).astype(mxd))
        bits.reshape(-1)[rng.permutation(bits.size)[:40]] = snan
        args.append(mx.array(bits).view(mxd))
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[[0, 9, 10, 30, 36]] = -1
    k_out, v_out = classic_gpu.write_cache(*args, mx.array(slots), METAL)
    [launch] = sim.launches
    assert launch.kernel == "reshape_and_cache" and launch.threadgroup == (classic_gpu.CACHE_THREADS, 1, 1)
    assert launch.grid[0] <= max_groups * classic_gpu.CACHE_THREADS
    for new, old, got in ((args[0], args[2], k_out), (args[1], args[3], v_out)):
        want = _bits(old).reshape(nb * bs, kvh, head).copy()
        keep = slots >= 0
        want[slots[keep]] = _bits(new)[keep]
        assert np.array_equal(_bits(got).reshape(nb * bs, kvh, head), want)


# -- the per-token kernel --------------------------------------------------------------------------------


def _launch_paged(case, partition_size: int) -> mx.array:
    """The classic kernel (and the reducer when split) as the Metal backend launches it."""
    return gc.launch_paged(case.q, case.k_cache, case.v_cache, case.metadata(), scale=case.scale, sinks=case.sinks,
                           sliding_window=case.sliding_window, softcap=case.softcap, partition_size=partition_size,
                           backend="metal")


def _launch_geometry(case, partition_size: int, geo: gc.Geometry, prefetch: int) -> mx.array:
    """The per-token launch (and reducer) of ``geo`` on the Metal backend, whether Metal's tables choose it or not."""
    launch = gc.per_token_launch(case.q.shape, case.q.dtype, case.k_cache.shape, case.metadata(), scale=case.scale,
                                 use_sinks=case.sinks is not None, sliding_window=case.sliding_window,
                                 softcap=case.softcap, partition_size=partition_size, backend="metal", geo=geo,
                                 prefetch=prefetch, rows=None)
    return launch(case.q, case.k_cache, case.v_cache, case.metadata(), case.sinks)


def _check_launches(sim: SimulatedMetal, partition_size: int, geo: gc.Geometry | None = None) -> None:
    """The per-token kernel ran with ``partition_size`` (and ``geo``), and the reducer after it when split."""
    kinds = [launch.kernel for launch in sim.launches]
    assert kinds == (["paged_attention", "paged_attention_v2_reduce"] if partition_size else ["paged_attention"])
    pa = sim.launches[0]
    assert pa.template["PARTITION_SIZE"] == partition_size and pa.defines["PA_SPLIT"] == int(partition_size > 0)
    if geo is not None:
        assert (pa.template["NUM_THREADS"], pa.template["HPS"], pa.template["STAGE"]) == (geo.threads, geo.hps,
                                                                                        geo.stage)
        assert pa.defines["PA_MMA"] == geo.mma and pa.defines["PA_STAGED"] == int(geo.stage > 0)
    if partition_size:
        assert sim.launches[1].threadgroup == (gc.NUM_THREADS, 1, 1)  # Metal: one partition slice


_ROUTES = [0, METAL_PARTITION]
_ROUTE_IDS = ["ps0", f"ps{METAL_PARTITION}"]

#: (dtype, head, block, heads, kv heads): every head size the classic provider admits on Metal, each
#: dtype and kernel block size, GQA groups 1 (MHA), 2, 3, 4 and 8 (MQA).
_MATRIX = [
    ("float16", 64, 8, 4, 4),
    ("bfloat16", 80, 16, 4, 2),
    ("float32", 96, 32, 8, 2),
    ("bfloat16", 112, 16, 6, 2),
    ("float16", 128, 16, 8, 1),
    ("bfloat16", 192, 8, 4, 1),
    ("float32", 256, 32, 4, 2),
]
#: The specialization (dtype, head, block) of the feature tests below: one of the matrix's, so that
#: they share its builds.
REF = ("float16", 128, 16)
assert REF in [m[:3] for m in _MATRIX]


def test_matrix_covers_the_admission_table():
    assert sorted({h for _, h, *_ in _MATRIX}) == sorted(GPU_HEAD_SIZES)
    assert {b for _, _, b, *_ in _MATRIX} == set(KERNEL_BLOCK_SIZES)
    assert {d for d, *_ in _MATRIX} == set(DTYPES)


@pytest.mark.parametrize("partition_size", _ROUTES, ids=_ROUTE_IDS)
@pytest.mark.parametrize(("dtype", "head", "block", "heads", "kv_heads"), _MATRIX,
                         ids=[f"{d}-h{h}-b{b}-g{n // k}" for d, h, b, n, k in _MATRIX])
def test_per_token_kernel_in_metal_geometry(sim, dtype, head, block, heads, kv_heads, partition_size):
    # Decode rows (one past two partitions, one just past one, one inside one), a chunk with earlier
    # context crossing a partition edge and a fresh three-token prompt; pages scattered, garbage around.
    case = make_case(q_lens=[1, 1, 1, 6, 3], seq_lens=[1100, 517, 40, 530, 3], num_heads=heads,
                     num_kv_heads=kv_heads, head_size=head, block_size=block, dtype=dtype, seed=head + block,
                     label=f"sim {dtype} h{head} b{block} {heads}/{kv_heads} ps{partition_size}")
    out = _launch_paged(case, partition_size)
    _check_launches(sim, partition_size, gc.geometry(head, dtype, "metal", heads // kv_heads, partition_size > 0))
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


_FEATURES = [
    (dict(sinks=True), "sinks"),
    (dict(sliding_window=100), "window"),
    (dict(sliding_window=40, score_bias=-120.0), "window far below zero"),
    (dict(sliding_window=1), "window 1"),
    (dict(softcap=5.0, scale=0.5), "softcap"),
    (dict(sinks=True, sliding_window=300, softcap=20.0, shared_prefix_blocks=3), "every feature"),
]


@pytest.mark.parametrize("partition_size", [*_ROUTES, SMALL_PARTITION], ids=[*_ROUTE_IDS, f"ps{SMALL_PARTITION}"])
@pytest.mark.parametrize(("features", "label"), _FEATURES, ids=[label for _, label in _FEATURES])
def test_per_token_features(sim, features, label, partition_size):
    # Partitions of 64 put windows wholly left of some partitions (neutral partials) and past others.
    dtype, head, block = REF
    case = make_case(q_lens=[1, 1, 9], seq_lens=[1000, 200, 600], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=5, label=f"sim {label} ps{partition_size}", **features)
    out = _launch_paged(case, partition_size)
    _check_launches(sim, partition_size)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize("partition_size", [*_ROUTES, SMALL_PARTITION], ids=[*_ROUTE_IDS, f"ps{SMALL_PARTITION}"])
def test_per_token_nan_contract(sim, partition_size):
    # NaN in V at an attended position, +inf in K at a position only later rows attend, NaN in q; the
    # garbage around the pages (NaN V, huge K) must stay out of every row.
    dtype, head, block = REF
    case = make_case(q_lens=[1, 12, 1], seq_lens=[700, 300, 90], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=11, label=f"sim nan contract ps{partition_size}",
                     poison=[("v", 0, 650, 1, float("nan")), ("k", 1, 295, 0, float("inf")),
                             ("q", 1, 3, 2, float("nan")), ("v", 2, 10, 0, float("-inf"))])
    got = _launch_paged(case, partition_size)
    assert_close_to_oracle(got, case.oracle(), dtype, label=case.label)
    assert not np.isfinite(np.array(got.astype(mx.float32))).all()


def test_reducer_over_more_partitions_than_threads(sim):
    # 9,000 tokens in 64-token partitions: 141 partials a row, more than the reducer's 128 threads
    # (its maximum and its weights go over two blocks of partitions). A key in partition 132 dominates
    # head 0's row by about 150 (log2): a reducer that missed the second block's maxima would
    # overflow exp2 there.
    dtype, head, block = REF
    pos = 8500
    kwargs = dict(q_lens=[1], seq_lens=[9000], num_heads=2, num_kv_heads=1, head_size=head, block_size=block,
                  dtype=dtype, seed=2, sinks=True, label="sim 141 partitions")
    q = make_case(**kwargs).host["q"][0, 0, pos % head]  # the poison does not change the random draws
    case = make_case(**kwargs, poison=[("k", 0, pos, 0, float(np.sign(q)) * 2000.0)])
    assert pos // SMALL_PARTITION >= gc.NUM_THREADS
    out = _launch_paged(case, SMALL_PARTITION)
    _check_launches(sim, SMALL_PARTITION)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize("slices", [s for s in gc.SLICE_COUNTS if s > 1])
def test_reducer_partition_slices(sim, slices):
    # METAL_ATTN_REDUCER_SLICES forces slices on Metal (its rule keeps one): threadgroups of up to 1,024
    # threads, each slice summing its share of a row's partitions.
    dtype, head, block = REF
    case = make_case(q_lens=[1, 1, 2], seq_lens=[3000, 700, 1500], num_heads=2, num_kv_heads=1, head_size=head,
                     block_size=block, dtype=dtype, seed=slices, sinks=True, sliding_window=2000,
                     label=f"sim reducer slices={slices}")
    with override_settings(reducer_slices=slices):
        out = _launch_paged(case, SMALL_PARTITION)
    assert sim.launches[1].threadgroup == (gc.NUM_THREADS * slices, 1, 1)
    assert sim.launches[1].template["SLICES"] == slices
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize(("q_lens", "seq_lens", "route"), [
    ([1, 1, 1], [1300, 600, 45], gc.per_token_route(METAL_PARTITION)),
    ([1, 30, 17], [200, 90, 17], gc.per_token_route(0)),
], ids=["decode-split", "prefill-unsplit"])
def test_classic_plan_and_run_on_a_metal_device(sim, q_lens, seq_lens, route):
    # The classic provider's own decision (the occupancy gate, the partition rule, the geometry) for a
    # Metal device, and its run of that plan.
    dtype, head, block = REF
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=8, num_kv_heads=2, head_size=head,
                     block_size=block, dtype=dtype, seed=len(q_lens) + sum(q_lens), sinks=True,
                     label=f"sim classic {route}")
    request = AttentionRequest.from_lengths(q_lens=q_lens, seq_lens=seq_lens, backend="metal", dtype=dtype,
                                            num_heads=8, num_kv_heads=2, head_size=head, block_size=block, sinks=True)
    plan = classic_gpu.plan("classic", request, METAL, get_settings())
    assert plan.route == route
    inputs = AttentionInputs(case.q, case.k_cache, case.v_cache, case.metadata(), case.scale, case.sinks)
    out = classic_gpu.run(inputs, plan)
    assert sim.launches[0].threadgroup == plan.threadgroup and sim.launches[0].grid == plan.grid
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


# -- code paths the Metal tables do not choose, through the Metal prelude --------------------------------


def _source_check_paths() -> list[tuple[str, int, bool, gc.Geometry]]:
    """The staged and matrix launches the Metal source check type-checks (`gc.source_check_launches`)."""
    out = []
    for dtype, head in (("float16", 128), ("bfloat16", 64), ("float32", 96)):
        for split, geo in gc.source_check_launches(head, dtype):
            if geo.stage:  # direct loads: Metal's own geometry, tested above
                out.append((dtype, head, split, geo))
    return out


_SOURCE_CHECK_PATHS = _source_check_paths()


@pytest.mark.parametrize(("dtype", "head", "split", "geo"), _SOURCE_CHECK_PATHS,
                         ids=[f"{d}-h{h}-{'split' if s else 'unsplit'}-{'mma' if g.mma else 'staged'}"
                              for d, h, s, g in _SOURCE_CHECK_PATHS])
def test_staged_and_matrix_paths_the_metal_source_check_types(sim, dtype, head, split, geo):
    case = make_case(q_lens=[1, 1, 7], seq_lens=[1100, 70, 300], num_heads=4, num_kv_heads=2, head_size=head,
                     block_size=16, dtype=dtype, seed=head, sinks=True, sliding_window=900,
                     label=f"sim {dtype} h{head} {geo}")
    psize = PARTITION_SIZE if split else 0
    out = _launch_geometry(case, psize, geo, gc.PREFETCH_NEXT["metal"])
    _check_launches(sim, psize, geo)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


def _cuda_table_paths() -> list[tuple[str, int, int, bool, float, gc.Geometry]]:
    """The CUDA table's geometries (`gc.geometry` for ``cuda``) on Apple's padded rows (no swizzle, no
    keys-as-rows path: CUDA's vocabulary): several heads per threadgroup and per simdgroup, staged
    chunks, the matrix path with up to 8 heads, on small and large grids."""
    out = []
    for dtype, head, group, split, items in (("float16", 64, 2, True, 100.0), ("float16", 64, 2, False, 100.0),
                                             ("float32", 128, 4, True, 1.0), ("float32", 256, 8, False, 100.0),
                                             ("float16", 128, 8, True, 100.0), ("bfloat16", 256, 4, False, 100.0)):
        geo = gc.geometry(head, dtype, "cuda", group, split, items, mma_stage_swizzle=False, mma_key_rows=False)
        out.append((dtype, head, group, split, items, geo))
    return out


_CUDA_TABLE_PATHS = _cuda_table_paths()


def test_cuda_table_paths_cover_hps_hpw_staging_and_matrix():
    geos = [g for *_, g in _CUDA_TABLE_PATHS]
    assert any(g.hps > 1 and not g.stage for g in geos) and any(g.stage and not g.mma for g in geos)
    assert any(g.hpw < g.hps for g in geos) and any(g.mma == 1 and g.hps == 8 for g in geos)


@pytest.mark.parametrize(("dtype", "head", "group", "split", "items", "geo"), _CUDA_TABLE_PATHS,
                         ids=[f"{d}-h{h}-g{g}-{'split' if s else 'unsplit'}" for d, h, g, s, _, _ in _CUDA_TABLE_PATHS])
def test_cuda_table_geometries_through_the_metal_prelude(sim, dtype, head, group, split, items, geo):
    case = make_case(q_lens=[1, 1, 5], seq_lens=[1200, 33, 260], num_heads=2 * group, num_kv_heads=2,
                     head_size=head, block_size=32 if head == 64 else 16, dtype=dtype, seed=group + head,
                     sinks=split, softcap=None if split else 30.0, sliding_window=1000,
                     label=f"sim cuda table {dtype} h{head} g{group} {geo}")
    psize = PARTITION_SIZE if split else 0
    out = _launch_geometry(case, psize, geo, gc.PREFETCH_NEXT["cuda"])
    _check_launches(sim, psize, geo)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


def test_results_do_not_depend_on_the_interleaving(sim):
    # The fibers' ring in thread order and in two shuffled orders: bit-identical outputs (a missing
    # barrier would let one order read threadgroup memory before it is written).
    dtype, head, group, split, _, geo = _CUDA_TABLE_PATHS[2]
    assert geo.stage and geo.hpw < geo.hps  # staged chunks and two simdgroups across heads: many barriers
    case = make_case(q_lens=[1, 4], seq_lens=[900, 100], num_heads=2 * group, num_kv_heads=2, head_size=head,
                     block_size=16, dtype=dtype, seed=9, sinks=True)
    outs = []
    for seed in (0, 1, 2):
        sim.seed = seed
        out = _launch_geometry(case, PARTITION_SIZE if split else 0, geo, gc.PREFETCH_NEXT["cuda"])
        outs.append(np.array(out.astype(mx.float32)))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert_close_to_oracle(outs[0], case.oracle(), dtype)


# -- gqa_decode ---------------------------------------------------------------------------------------


_GQA = [(geom, dtype, p) for geom, dtype, p in zip(GQA_DECODE_GEOMETRIES["metal"],
                                                   itertools.cycle(("float16", "bfloat16")),
                                                   itertools.cycle(GQA_PARTITION_SIZES))]


@pytest.mark.parametrize(("geom", "dtype", "partition_size"), _GQA,
                         ids=[f"{d}-{'/'.join(map(str, g))}-ps{p}" for g, d, p in _GQA])
def test_gqa_decode_kernel(sim, geom, dtype, partition_size):
    heads, kv_heads, head, block = geom
    case = make_case(q_lens=[1, 1, 1], seq_lens=[1300, 600, 90], num_heads=heads, num_kv_heads=kv_heads,
                     head_size=head, block_size=block, dtype=dtype, seed=heads + head,
                     label=f"sim gqa_decode {geom} {dtype} ps{partition_size}")
    out = gqa.launch(case.q, case.k_cache, case.v_cache, case.metadata(), scale=case.scale,
                     partition_size=partition_size, backend="metal")
    assert [launch.kernel for launch in sim.launches] == ["gqa_decode", "paged_attention_v2_reduce"]
    assert sim.launches[0].threadgroup == (kernels.SIMD_WIDTH * (heads // kv_heads), 1, 1)
    assert_close_to_oracle(out, case.oracle(), dtype, label=case.label)


# -- the simulation itself ------------------------------------------------------------------------------

#: Synchronisation errors planted in a copy of pagedattention.metal, each with what the simulation says.
_PLANTS = [
    ("missing barrier", "threadgroup_barrier(mem_flags::mem_threadgroup);\n\nfor (int i = tid; i < HPS * HEAD_SIZE",
     "\n\nfor (int i = tid; i < HPS * HEAD_SIZE", "sim planted error"),
    ("divergent shuffle", "const float m_o = simd_shuffle_xor(m[h], ushort(o));",
     "const float m_o = lane < 16 ? simd_shuffle_xor(m[h], ushort(o)) : m[h];", "different simd_\\* calls"),
    ("unwritten threadgroup memory", "    sg_stats[slot * 2 + 1] = l[h];\n", "", "sim planted error"),
    ("early return", "const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;",
     "if (tid >= 64) { return; }\nconst int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;",
     "simd_\\* call|threadgroup_barrier"),
]


@pytest.mark.parametrize(("old", "new", "error"), [p[1:] for p in _PLANTS], ids=[p[0] for p in _PLANTS])
def test_the_simulation_catches_synchronisation_errors(sim, tmp_path, old, new, error):
    # A barrier left out reads threadgroup memory before the other simdgroups write it (the oracle
    # tells); lanes at different simd_* calls or threads that left early stop the run with a message.
    planted = tmp_path / "kernels_v2"
    shutil.copytree(kernels_dir(), planted)
    text = (planted / "pagedattention.metal").read_text()
    assert text.count(old) == 1
    (planted / "pagedattention.metal").write_text(text.replace(old, new))
    dtype, head, block = REF
    case = make_case(q_lens=[1, 3], seq_lens=[300, 50], num_heads=2, num_kv_heads=1, head_size=head,
                     block_size=block, dtype=dtype, seed=4, label="sim planted error")
    kernels.use_source_dir(planted)
    try:
        with pytest.raises(AssertionError, match=error):
            assert_close_to_oracle(_launch_paged(case, 0), case.oracle(), dtype, label=case.label)
    finally:
        kernels.use_source_dir(None)
