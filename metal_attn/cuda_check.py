"""CUDA source check: compile every CUDA specialization of the kernel texts with nvcc, on any machine.

What it proves: for the specializations the CUDA tables choose (classic's direct, staged and matrix
paths on both routes, the shared reducer, every gqa_decode geometry at both partition sizes, every
tiled tile), our part of the source (the CUDA prelude, generated defines, headers, body) inside a
wrapper shaped like the one ``mx.fast.cuda_kernel`` generates (``namespace mlx::core::cu``, one
``__global__`` function, the inputs as ``const T*``, template arguments as ``using`` / ``constexpr``
lines at the top of the body) compiles for ``sm_90a`` with nvcc; with ``--resources``, ptxas's
registers and spills per kernel, to compare two versions of a kernel text; with ``--same-ptx-as DIR``,
whether each source compiles to the same PTX from the kernel texts in DIR (another version: a refactor
or a new parameter at its default that should change no generated code).

What it does not prove: MLX compiles with NVRTC, not nvcc, and its real wrapper also includes MLX's
device headers; nvcc has no ``--device-as-default-execution-space``, so the wrapper restores
``__device__`` that the prelude's ``#define device`` empties. Nothing runs: numerics, races and
speed are for ``tests/gpu`` on a GPU. The sources come from every registered provider
(`Provider.cuda_sources`, built-in and third-party alike), or from those named with ``--provider``.
With ``--nvrtc LIBNVRTC`` it compiles instead the translation units CUDA chains build at run time
(`metal_attn.cuda_ops`: no nvcc wrapper, NVRTC's options) with that NVRTC library, which needs no
GPU either (``pip download nvidia-cuda-nvrtc`` has one).
Usage: ``python -m metal_attn.cuda_check [--provider NAME ...] [--only REGEX] [--kernels-dir DIR]
[--resources | --same-ptx-as DIR] [--jobs N] [--nvrtc LIB [--arch sm_90a]]``; exit 1 when a source fails
(or, with ``--same-ptx-as``, compiles to other PTX), 2 without a compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from metal_attn.cuda_ops import nvrtc_options, runtime_source, translation_unit
from metal_attn.source_specs import CudaSource

NVCC_ARGS = ("-std=c++17", "-arch=sm_90a")
#: Restores CUDA's __device__ after the prelude's `#define device` (NVRTC's default-device mode makes it moot).
_PRE = "#include <cuda_runtime.h>\n#undef __device__\n#define __device__ __attribute__((__device__))\n"


def _parts(src: CudaSource) -> tuple[str, str, str]:
    from metal_attn import kernels

    header, body = kernels.assemble(src.kernel, src.source_files, "cuda", dict(src.defines))
    return re.sub(r"\W", "_", src.label), header, body


def wrapped_source(src: CudaSource) -> str:
    """The wrapped source for nvcc (prelude, defines and headers, then one __global__ function)."""
    name, header, body = _parts(src)
    return translation_unit(name, header, body, src.inputs, src.outputs, src.template, preamble=_PRE)


def nvrtc_source(src: CudaSource) -> str:
    """The translation unit a CUDA chain compiles at run time with NVRTC (`metal_attn.cuda_ops`)."""
    name, header, body = _parts(src)
    return runtime_source(name, header, body, src.inputs, src.outputs, src.template)


def cuda_sources(providers: Sequence[str] | None = None) -> list[CudaSource]:
    """Every registered provider's `Provider.cuda_sources` (or only the ``providers`` named): the
    specializations their CUDA tables choose."""
    from metal_attn.source_sets import provider_sets

    return provider_sets("cuda_sources", providers)


def find_nvcc() -> str | None:
    return shutil.which("nvcc")


def find_nvrtc() -> str | None:
    """A libnvrtc for ``--nvrtc``: ``$METAL_ATTN_NVRTC``, else the ``nvidia-cuda-nvrtc`` wheel's on
    ``sys.path`` (CUDA 13, then 12), else ``None``."""
    from metal_attn.settings import get_settings

    env = get_settings().nvrtc
    if env:
        return str(env)
    for base in sys.path:
        for rel in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"):
            path = os.path.join(base, rel)
            if os.path.exists(path):
                return path
    return None


def _unit_path(src: CudaSource, workdir: str) -> str:
    """The unit's file: its label as a name, cut to 120 characters plus a hash of the whole label (nvcc's
    intermediate files add their own prefix and suffix, and a long label overran the file-name limit)."""
    name = re.sub(r"\W", "_", src.label)
    if len(name) > 120:
        name = f"{name[:120]}_{hashlib.sha1(src.label.encode()).hexdigest()[:12]}"
    return os.path.join(workdir, name + ".cu")


def compile_one(src: CudaSource, text: str, workdir: str, nvcc: str, resources: bool) -> tuple[CudaSource, int, str]:
    """nvcc on one source's text (PTX, or a cubin with ptxas's resource report); (source, return code, output).
    The PTX is left at the unit's path plus ``.ptx`` (`comparable_ptx` reads it)."""
    path = _unit_path(src, workdir)
    with open(path, "w") as f:
        f.write(text)
    args = [nvcc, *NVCC_ARGS, *(("-cubin", "-Xptxas", "-v") if resources else ("--ptx",)),
            "-o", path + (".cubin" if resources else ".ptx"), path]
    res = subprocess.run(args, capture_output=True, text=True)
    return src, res.returncode, res.stdout + res.stderr


def comparable_ptx(src: CudaSource, workdir: str) -> str:
    """The PTX `compile_one` wrote for ``src`` in ``workdir``, without comments and file or line records (they
    name the temporary file and the compiler's build)."""
    with open(_unit_path(src, workdir) + ".ptx") as f:
        return "\n".join(ln for ln in f.read().splitlines()
                         if not ln.lstrip().startswith(("//", ".file", ".loc")))


def _texts(sources: Sequence[CudaSource], kernels_dir: str | None, make: Any) -> dict[CudaSource, str]:
    """``make(source)`` for each source with the kernel texts read from ``kernels_dir`` (None: the package's)."""
    from metal_attn import kernels

    saved = kernels._source_dir
    if kernels_dir:
        kernels.use_source_dir(kernels_dir)
    try:
        return {s: make(s) for s in sources}
    finally:
        if kernels_dir:
            kernels.use_source_dir(saved)


def compile_nvrtc(src: CudaSource, text: str, lib: Any, arch: str) -> tuple[CudaSource, int, str]:
    """NVRTC (``lib``, a ctypes handle of libnvrtc) on one runtime translation unit, as a chain
    compiles it; (source, NVRTC's result code, its log)."""
    import ctypes

    name = re.sub(r"\W", "_", src.label)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{name}.cu".encode(), 0, None, None)
    if rc:
        return src, rc, "nvrtcCreateProgram failed"
    try:
        expr = f"mlx::core::cu::{name}".encode()
        if lib.nvrtcAddNameExpression(prog, expr):
            return src, 1, "nvrtcAddNameExpression failed"
        opts = [o.encode() for o in nvrtc_options(arch)]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if rc == 0:  # the kernel a chain loads must exist under the name it asks for
            lowered = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, expr, ctypes.byref(lowered)) or not lowered.value:
                return src, 1, f"error: no kernel {expr.decode()} in the compiled program"
        return src, rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def resources_line(output: str) -> str:
    """ptxas's registers, spills and shared memory from its -v output."""
    regs = re.search(r"Used (\d+) registers", output)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
    smem = re.search(r"(\d+) bytes smem", output)
    return (f"{regs.group(1) if regs else '?'} registers, spills {spill.group(1) if spill else '?'}/"
            f"{spill.group(2) if spill else '?'} bytes (stores/loads), {smem.group(1) if smem else 0} bytes smem")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metal_attn.cuda_check", description=__doc__.splitlines()[0])
    p.add_argument("--provider", action="append", default=None, metavar="NAME",
                   help="only this registered provider's sources (repeatable; default: every provider's)")
    p.add_argument("--only", help="only sources whose label matches this regular expression")
    p.add_argument("--kernels-dir", help="read the kernel texts from this folder (another version, to compare)")
    p.add_argument("--resources", action="store_true", help="print ptxas's registers and spills per kernel")
    p.add_argument("--same-ptx-as", metavar="DIR",
                   help="also compile every source from the kernel texts in DIR and say whether the PTX is the same "
                        "(exit 1 when one differs)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes")
    p.add_argument("--nvrtc", metavar="LIBNVRTC", nargs="?", const="",
                   help="compile the run-time translation units of CUDA chains (metal_attn.cuda_ops) with this "
                        "libnvrtc.so instead of nvcc's; without a path, METAL_ATTN_NVRTC's, else the "
                        "nvidia-cuda-nvrtc wheel's (CUDA 13, then 12)")
    p.add_argument("--arch", default="sm_90a", help="--nvrtc's target architecture (default sm_90a)")
    args = p.parse_args(argv)
    if args.nvrtc == "":  # --nvrtc without a path
        args.nvrtc = find_nvrtc()
        if args.nvrtc is None:
            p.error("--nvrtc without a path: METAL_ATTN_NVRTC is unset and no nvidia-cuda-nvrtc wheel is installed "
                    "(allowed: a path to libnvrtc.so, or install nvidia-cuda-nvrtc)")
    if args.same_ptx_as and (args.nvrtc or args.resources):
        p.error("--same-ptx-as compares nvcc's PTX: it goes without --nvrtc and --resources")
    if args.same_ptx_as and not os.path.isdir(args.same_ptx_as):
        p.error(f"--same-ptx-as {args.same_ptx_as!r}: not a folder (allowed: a folder of kernel texts, like "
                "kernels_v2/ of another version)")
    from metal_attn.errors import ProviderRefusedError
    from metal_attn.msl_check import selection_problem

    try:  # the selection first: a usage error whether or not a compiler is here
        chosen = cuda_sources(args.provider)
    except ProviderRefusedError as exc:
        p.error(str(exc))
    problem = selection_problem("cuda_sources", chosen, args.only, args.provider)
    if problem:
        p.error(problem)
    sources = [s for s in chosen if not args.only or re.search(args.only, s.label)]
    lib = None
    if args.nvrtc:
        import ctypes

        try:
            lib = ctypes.CDLL(args.nvrtc)
        except OSError as exc:
            p.error(f"--nvrtc {args.nvrtc!r}: {exc}")
    nvcc = find_nvcc()
    if nvcc is None and lib is None:
        print("cuda_check: nvcc is not on PATH (the CUDA toolkit provides it)", file=sys.stderr)
        return 2
    texts = _texts(sources, args.kernels_dir, nvrtc_source if lib is not None else wrapped_source)
    others = _texts(sources, args.same_ptx_as, wrapped_source) if args.same_ptx_as else {}
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(max(1, args.jobs)) as ex:
        if lib is not None:
            results = list(ex.map(lambda s: compile_nvrtc(s, texts[s], lib, args.arch), sources))
        else:
            results = list(ex.map(lambda s: compile_one(s, texts[s], work, nvcc, args.resources), sources))
        differ: list[CudaSource] = []
        if others:
            theirs = os.path.join(work, "other")
            os.mkdir(theirs)
            results_other = list(ex.map(lambda s: compile_one(s, others[s], theirs, nvcc, False), sources))
            if not any(rc for _, rc, _ in results + results_other):
                differ = [s for s in sources if comparable_ptx(s, work) != comparable_ptx(s, theirs)]
    failed = [(s.label, out) for s, rc, out in results if rc]
    if others:
        failed += [(f"{s.label} (from {args.same_ptx_as})", out) for s, rc, out in results_other if rc]
    for s, rc, out in results:
        if args.resources and not rc:
            print(f"{s.label}: {resources_line(out)}")
    for label, out in failed[:10]:
        errors = [ln for ln in out.splitlines() if "error" in ln]
        print(f"FAILED {label}:\n  " + "\n  ".join(errors[:8]), file=sys.stderr)
    how = f"NVRTC {args.nvrtc}, {' '.join(nvrtc_options(args.arch))}" if lib is not None else \
        f"{nvcc}, {' '.join(NVCC_ARGS)}"
    if others:
        for s in differ:
            print(f"DIFFERENT PTX {s.label}")
        print(f"{len(sources)} CUDA sources compiled twice, {len(failed)} failed; "
              f"{len(sources) - len(differ)} with the same PTX as from {args.same_ptx_as}, {len(differ)} different "
              f"({how})")
        return 1 if failed or differ else 0
    print(f"{len(results)} CUDA sources, {len(failed)} failed ({how})")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
