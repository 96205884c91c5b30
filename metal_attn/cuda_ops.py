"""Chains of our CUDA kernels, each run as one MLX primitive (`metal_attn._cuda_ops`, built apart).

On MLX's CUDA backend every ``mx.fast.cuda_kernel`` call is one MLX operation. MLX rebuilds the
kernel's whole source text at each call, and pays a host cost per operation when it evaluates and
encodes the graph. A split-KV decode call is two such operations (the per-token kernel and the
reducer). A `Chain` encodes such a sequence of launches as one operation: ``KernelChain``
(``csrc/cuda/kernel_chain.cpp``) adds one kernel node per launch to MLX's command encoder, ordered
through the buffers as MLX orders its own kernels, and the intermediate buffers live for that
evaluation only.

The kernels are the same texts, compiled by NVRTC from the translation unit ``mx.fast.cuda_kernel``
would build (prelude, defines and headers, one ``__global__`` function with the inputs as
``const T*`` and the outputs as ``T*``, the template arguments as its first lines), less MLX's own
device headers, which our texts do not use. Compiled images are cached on disk by the hash of that
text, the architecture and NVRTC's version.

The module is optional and CUDA-only: it builds against an MLX install with the CUDA backend
(``csrc/cuda/CMakeLists.txt``; `docs/cuda-ops.md`). Without it, or with
``METAL_ATTN_CUDA_CHAINS=0``, providers launch through ``mx.fast.cuda_kernel`` as before.
Nothing here runs on Metal.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from metal_attn import _epoch

#: MLX dtype names to the CUDA types MLX's wrapper writes for them.
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t",
              "uint32": "uint32_t", "int64": "int64_t", "uint8": "uint8_t", "bool": "bool"}

#: What the translation unit needs before our prelude (NVRTC has no host headers).
_PREAMBLE = "#include <cuda/std/cstdint>\nusing cuda::std::int32_t; using cuda::std::uint32_t;\n" \
            "using cuda::std::int64_t; using cuda::std::uint8_t;\n"

_lock = threading.Lock()

#: How many chains of each name this process has built (diagnostics and tests: which launch path ran).
chains_built: collections.Counter[str] = collections.Counter()


def translation_unit(func: str, header: str, body: str, inputs: Sequence[tuple[str, str]],
                     outputs: Sequence[tuple[str, str]], template: Sequence[tuple[str, Any]], *,
                     preamble: str = "") -> str:
    """The CUDA text of one kernel as ``mx.fast.cuda_kernel`` shapes it: ``preamble``, ``header``,
    then ``namespace mlx::core::cu { __global__ void func(<inputs as const T*>, <outputs as T*>) {
    <template lines> <body> } }``. ``inputs``/``outputs``: ``(name, dtype name)``; ``template``:
    ``(name, dtype name or int)``."""
    sig = ", ".join([f"const {CUDA_TYPES[t]}* {n}" for n, t in inputs] + [f"{CUDA_TYPES[t]}* {n}" for n, t in outputs])
    lines = [f"  using {k} = {CUDA_TYPES[v]};" if isinstance(v, str) else f"  constexpr int {k} = {int(v)};"
             for k, v in template]
    return (f"{preamble}{header}\nnamespace mlx::core::cu {{\n__global__ void {func}({sig}) {{\n"
            + "\n".join(lines) + f"\n{body}\n}}\n}}\n")


def native() -> Any | None:
    """The compiled module, or ``None`` when it is not built or cannot load here (`unavailable_reason`)."""
    mod, _ = _load()
    return mod


def unavailable_reason() -> str | None:
    """Why chains cannot run in this process, or ``None`` when they can."""
    _, reason = _load()
    return reason


def enabled() -> bool:
    """Whether launches go through chains: the module loads and ``cuda_chains`` is on."""
    from metal_attn.settings import get_settings

    return get_settings().cuda_chains and native() is not None


@functools.cache
def _load() -> tuple[Any | None, str | None]:
    try:
        import mlx.core as mx
    except ImportError as exc:  # pragma: no cover - mlx is a dependency
        return None, f"mlx does not import: {exc}"
    if not mx.cuda.is_available():
        return None, "MLX's CUDA backend is not available in this process"
    try:
        mod = importlib.import_module("metal_attn._cuda_ops")
    except ImportError as exc:
        return None, (f"metal_attn._cuda_ops is not built for this Python and MLX ({exc}); build it with "
                      "csrc/cuda/CMakeLists.txt (docs/cuda-ops.md)")
    return mod, None


def cuda_include_dirs() -> list[str]:
    """Folders holding the CUDA headers our prelude includes (``cuda_fp16.h``, ``cuda_bf16.h``) and
    CCCL's ``cuda/std``: ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda``, the ``nvidia`` wheels next
    to MLX, and MLX's own ``include/cccl``."""
    import mlx.core as mx

    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [str(Path(r) / "include" / sub) for r in roots if r for sub in ("", "cccl")]
    for base in map(Path, sys.path):
        for sub in ("nvidia/cu13/include", "nvidia/cu13/include/cccl", "nvidia/cuda_runtime/include",
                    "nvidia/cuda_nvrtc/include"):
            dirs.append(str(base / sub))
    dirs.append(str(Path(mx.__file__).parent / "include" / "cccl"))  # mlx is a namespace package: its core
    seen: list[str] = []
    for d in dirs:
        if d not in seen and ((Path(d) / "cuda_fp16.h").exists() or (Path(d) / "cuda" / "std").is_dir()):
            seen.append(d)
    return seen


def nvrtc_options(arch: str) -> list[str]:
    """NVRTC's options for our texts: MLX's for its custom kernels (unannotated functions are device
    functions, as under ``mx.fast.cuda_kernel``), and the CUDA headers' folders."""
    return [f"--gpu-architecture={arch}", "--std=c++17", "--device-as-default-execution-space",
            *(f"--include-path={d}" for d in cuda_include_dirs())]


def runtime_source(func: str, header: str, body: str, inputs: Sequence[tuple[str, str]],
                   outputs: Sequence[tuple[str, str]], template: Sequence[tuple[str, Any]]) -> str:
    """The translation unit a chain compiles (`translation_unit` after the preamble NVRTC needs)."""
    return translation_unit(func, header, body, inputs, outputs, template, preamble=_PREAMBLE)


def _cache_dir() -> Path | None:
    """Where compiled images are kept (``METAL_ATTN_CUDA_CACHE_DIR``, else per user), or ``None`` when no folder
    can be made."""
    from metal_attn.settings import get_settings

    default = Path(tempfile.gettempdir()) / f"metal_attn-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / "cubin"
    path = get_settings().cuda_cache_dir or default
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.R_OK) else None


@functools.cache
def _architecture() -> str:
    return native().device_architecture()


def _read_cached(path: Path) -> tuple[bytes, str] | None:
    """A cached ``(image, lowered name)``: one file, the name's line first; ``None`` if absent or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    name, sep, image = data.partition(b"\n")
    return (image, name.decode()) if sep and name and image else None


def _write_cached(path: Path, image: bytes, lowered: str) -> None:
    """Write the pair atomically (a temporary file, then a rename); a failure only loses the cache."""
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(lowered.encode() + b"\n" + image)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


@functools.cache
def compile_function(func: str, source: str) -> int:
    """The loaded ``__global__`` function ``mlx::core::cu::func`` of ``source`` (NVRTC, once per
    process and text; the image is cached on disk). Raises `KernelCompileError` with NVRTC's log."""
    from metal_attn.errors import KernelCompileError

    mod = native()
    if mod is None:
        raise KernelCompileError(f"CUDA chains are not available: {unavailable_reason()}")
    arch = _architecture()
    options = nvrtc_options(arch)
    version = "{}.{}".format(*mod.nvrtc_version())
    digest = hashlib.sha256("\0".join([version, *options, func, source]).encode()).hexdigest()[:24]
    cache = _cache_dir()
    path = cache / f"{func}-{digest}.cubin" if cache else None
    with _lock:
        cached = _read_cached(path) if path else None
        if cached is not None:
            try:
                (fn,) = mod.load(cached[0], [cached[1]])
                return fn
            except RuntimeError:  # a damaged entry: compile again and replace it
                pass
        try:
            image, (lowered,) = mod.compile(func, source, [f"mlx::core::cu::{func}"], options)
            (fn,) = mod.load(image, [lowered])
        except RuntimeError as exc:
            raise KernelCompileError(f"could not build CUDA kernel {func!r}: {exc}") from exc
        if path:
            _write_cached(path, image, lowered)
    return fn


def kernel_function(name: str, source_files: Sequence[str], defines: Any, inputs: Sequence[tuple[str, str]],
                    outputs: Sequence[tuple[str, str]], template: Sequence[tuple[str, Any]]) -> int:
    """The loaded function of kernel ``name`` of our texts (`metal_attn.kernels.assemble` on CUDA
    with ``defines``), specialized by ``template`` and the ``(name, dtype name)`` signature."""
    from metal_attn import kernels

    items = None if defines is None else kernels.define_items(defines)
    return _kernel_function(_epoch.current()[0], name, tuple(source_files), items, kernels.define_types(items),
                            tuple(inputs), tuple(outputs), tuple(template))


@functools.lru_cache(maxsize=1024)
def _kernel_function(epoch: int, name: str, source_files: tuple, defines: Any, define_types: tuple, inputs: tuple,
                     outputs: tuple, template: tuple) -> int:
    # `epoch`: kernel sources changing (`metal_attn.kernels.use_source_dir`, `clear_cache`) bump it;
    # `define_types` keeps 1, 1.0 and True apart (`metal_attn.kernels.define_types`).
    from metal_attn import kernels

    header, body = kernels.assemble(name, source_files, "cuda", defines)
    base = kernels.kernel_name(name, header, body)
    spec = hashlib.sha1(repr((tuple(inputs), tuple(outputs), tuple(template))).encode()).hexdigest()[:10]
    func = f"{base}_{spec}"
    return compile_function(func, runtime_source(func, header, body, inputs, outputs, template))


def threadgroups(grid: Sequence[int], threadgroup: Sequence[int]) -> tuple[int, int, int]:
    """An ``mx.fast`` grid (in threads) as CUDA's grid of threadgroups."""
    return tuple(-(-g // t) for g, t in zip(grid, threadgroup))  # type: ignore[return-value]


def chain(name: str, input_dtypes: Sequence[Any], outputs: Sequence[tuple[tuple[int, ...], Any]],
          scratch: Sequence[tuple[tuple[int, ...], Any]],
          launches: Sequence[tuple[int, tuple[int, int, int], tuple[int, int, int], Sequence[int], int]],
          input_shapes: Sequence[tuple[int, ...]] = (), state: Sequence[int] = (),
          initial: Sequence[tuple[int, int]] = (), commit_when_idle: bool = False, direct_when_idle: int = 0,
          after: Sequence[tuple[int, int]] = ()) -> Any:
    """A ``_cuda_ops.Chain``: call it with the inputs (a list of arrays in ``input_dtypes``, and of
    ``input_shapes`` when given: each call checks both) for its outputs. ``launches``: ``(function,
    grid in threadgroups, threadgroup, argument buffer indices (inputs, then outputs, then scratch),
    how many of the arguments are read)``. ``state``: the indices of inputs the launches update in
    place (row-contiguous buffers the kernels leave as they found them, such as arrival counters);
    each call is ordered after the previous writer of each. ``initial``: ``(output, input)`` pairs, the
    output starting as the input's values (same dtype and element count) for launches that update it in
    place; it takes over the input's buffer where no other array holds it, else gets a copy
    (`initial_stats`), and launches read the output, not the input. Its buffers come from the chains'
    device memory pool unless ``cuda_chain_pool`` is off (`pool_stats`). ``commit_when_idle``: evaluating the
    chain launches the CUDA graph MLX has encoded so far when the GPU has no work left (`idle_commits`);
    ``direct_when_idle`` (with it): the chain that finds the GPU idle and the next ``direct_when_idle - 1`` such
    chains launch their kernels straight onto MLX's stream, after launching what MLX has encoded, instead of as
    graph nodes (0: never). ``after``: ``(launch, input)`` pairs, the launch waiting for the input's writer
    without reading the input (ordering only: which kernel reaches the GPU's cores first where MLX's graph
    could start two at once)."""
    from metal_attn.settings import get_settings

    mod = native()
    if mod is None:
        raise RuntimeError(f"CUDA chains are not available: {unavailable_reason()}")
    chains_built[name] += 1
    # Passed only when given, so that a module built before `after` existed still builds every other chain.
    extra = {"after": [tuple(p) for p in after]} if after else {}
    try:
        return mod.Chain(name, list(input_dtypes), [(list(s), d) for s, d in outputs],
                         [(list(s), d) for s, d in scratch],
                         [(fn, tuple(g), tuple(b), list(a), r) for fn, g, b, a, r in launches],
                         [list(x) for x in input_shapes], list(state), get_settings().cuda_chain_pool,
                         [tuple(p) for p in initial], commit_when_idle, direct_when_idle, **extra)
    except TypeError as exc:
        if extra and "after" in str(exc):
            raise RuntimeError(f"chain {name!r} needs after={list(after)}, which the built metal_attn._cuda_ops module "
                               "predates: rebuild it (benchmarks/device/build_cuda_ops.sh)") from exc
        raise


def pool_stats() -> dict[str, int] | None:
    """The chains' device memory pool (``live_bytes``, ``live_buffers``, ``reserved_bytes``, ``allocations``,
    ``moved_by_mlx``, ``fallbacks``; docs/cuda-ops.md), or ``None`` where the module is not loaded. Its memory
    is not in ``mx.get_active_memory()``; `trim_pool` returns the idle part to the driver."""
    mod = native()
    return None if mod is None else dict(mod.pool_stats())


def initial_stats() -> dict[str, int] | None:
    """How chain outputs with initial values got them since the process started (`chain`'s
    ``initial``): ``donated`` (took over the input's buffer), ``copied`` (another array held the input);
    ``None`` where the module is not loaded."""
    mod = native()
    return None if mod is None else dict(mod.initial_stats())


def idle_commits() -> dict[str, int] | None:
    """CUDA graphs chains launched for the GPU (`chain`'s ``commit_when_idle``) since the process started:
    ``idle`` (it had no work left), ``ahead`` (at the 1st, 3rd, 7th... such chain after one found it idle),
    ``direct`` (chains launched straight onto MLX's stream instead, ``direct_when_idle``);
    ``None`` where the module is not loaded."""
    mod = native()
    return None if mod is None else dict(mod.idle_commits())


def spin_until_idle() -> int | None:
    """Spin until MLX's default GPU stream has no launched work left (``cuStreamQuery`` in a loop, the GIL
    released) and return the polls made; ``None`` where the module is not loaded or the default device is not
    the GPU. Work MLX has encoded but not launched is not waited for: queue it first (``mx.async_eval``).
    A measurement tool (benchmarks/probe_step_wait.py): on an H100 it read the same as MLX's own wait
    (docs/cuda-ops.md, "Waiting for the GPU")."""
    mod = native()
    if mod is None or not _gpu_is_default():
        return None
    return int(mod.spin_until_idle())


def _gpu_is_default() -> bool:
    """Whether MLX evaluates on the GPU by default (where the module's stream is)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def trim_pool() -> None:
    """Wait for the GPU, then return the chains' pool's idle device memory to the driver
    (``mx.clear_cache()`` does not reach it)."""
    mod = native()
    if mod is not None:
        import mlx.core as mx

        mx.synchronize()
        mod.trim_pool()
