"""CUDA source check: compile every CUDA specialization of the kernel texts with nvcc, on any machine.

What it proves: for the specializations the CUDA tables choose (classic's direct, staged and matrix
paths on both routes, the shared reducer, every gqa_decode geometry at both partition sizes, every
tiled tile), our part of the source (the CUDA prelude, generated defines, headers, body) inside a
wrapper shaped like the one ``mx.fast.cuda_kernel`` generates (``namespace mlx::core::cu``, one
``__global__`` function, the inputs as ``const T*``, template arguments as ``using`` / ``constexpr``
lines at the top of the body) compiles for ``sm_90a`` with nvcc; with ``--resources``, ptxas's
registers and spills per kernel, to compare two versions of a kernel text.

What it does not prove: MLX compiles with NVRTC, not nvcc, and its real wrapper also includes MLX's
device headers; nvcc has no ``--device-as-default-execution-space``, so the wrapper restores
``__device__`` that the prelude's ``#define device`` empties. Nothing runs: numerics, races and
speed are for ``tests/gpu`` on a GPU. The sources come from every registered provider
(`Provider.cuda_sources`, built-in and third-party alike), or from those named with ``--provider``.
Usage: ``python -m metal_attn.cuda_check [--provider NAME ...] [--only REGEX] [--kernels-dir DIR]
[--resources] [--jobs N]``; exit 1 when a source fails, 2 without nvcc.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from metal_attn.source_specs import CudaSource

NVCC_ARGS = ("-std=c++17", "-arch=sm_90a")
_CT = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t", "int64": "int64_t"}
#: Restores CUDA's __device__ after the prelude's `#define device` (NVRTC's default-device mode makes it moot).
_PRE = "#include <cuda_runtime.h>\n#undef __device__\n#define __device__ __attribute__((__device__))\n"


def wrapped_source(src: CudaSource) -> str:
    """The wrapped source (prelude, defines and headers, then one __global__ function)."""
    from metal_attn import kernels

    header, body = kernels.assemble(src.kernel, src.source_files, "cuda", dict(src.defines))
    name = re.sub(r"\W", "_", src.label)
    sig = ", ".join([f"const {_CT[t]}* {n}" for n, t in src.inputs] + [f"{_CT[t]}* {n}" for n, t in src.outputs])
    lines = [f"  using {k} = {_CT[v]};" if isinstance(v, str) and v in _CT else f"  constexpr int {k} = {int(v)};"
             for k, v in src.template]
    return f"{_PRE}{header}\nnamespace mlx::core::cu {{\n__global__ void {name}({sig}) {{\n" + "\n".join(lines) \
        + f"\n{body}\n}}\n}}\n"


def cuda_sources(providers: Sequence[str] | None = None) -> list[CudaSource]:
    """Every registered provider's `Provider.cuda_sources` (or only the ``providers`` named): the
    specializations their CUDA tables choose."""
    from metal_attn.source_sets import provider_sets

    return provider_sets("cuda_sources", providers)


def find_nvcc() -> str | None:
    return shutil.which("nvcc")


def compile_one(src: CudaSource, text: str, workdir: str, nvcc: str, resources: bool) -> tuple[CudaSource, int, str]:
    """nvcc on one source's text (PTX, or a cubin with ptxas's resource report); (source, return code, output)."""
    path = os.path.join(workdir, re.sub(r"\W", "_", src.label) + ".cu")
    with open(path, "w") as f:
        f.write(text)
    args = [nvcc, *NVCC_ARGS, *(("-cubin", "-Xptxas", "-v") if resources else ("--ptx",)),
            "-o", path + (".cubin" if resources else ".ptx"), path]
    res = subprocess.run(args, capture_output=True, text=True)
    return src, res.returncode, res.stdout + res.stderr


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
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes")
    args = p.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("cuda_check: nvcc is not on PATH (the CUDA toolkit provides it)", file=sys.stderr)
        return 2
    from metal_attn import kernels
    from metal_attn.errors import ProviderRefusedError

    if args.kernels_dir:
        kernels.use_source_dir(args.kernels_dir)
    try:
        try:
            sources = [s for s in cuda_sources(args.provider) if not args.only or re.search(args.only, s.label)]
        except ProviderRefusedError as exc:
            p.error(str(exc))
        texts = {s: wrapped_source(s) for s in sources}
    finally:
        if args.kernels_dir:
            kernels.use_source_dir(None)
            kernels.clear_cache()
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(max(1, args.jobs)) as ex:
        results = list(ex.map(lambda s: compile_one(s, texts[s], work, nvcc, args.resources), sources))
    failed = [(s, out) for s, rc, out in results if rc]
    for s, rc, out in results:
        if args.resources and not rc:
            print(f"{s.label}: {resources_line(out)}")
    for s, out in failed[:10]:
        errors = [ln for ln in out.splitlines() if "error" in ln]
        print(f"FAILED {s.label}:\n  " + "\n  ".join(errors[:8]), file=sys.stderr)
    print(f"{len(results)} CUDA sources, {len(failed)} failed ({nvcc}, {' '.join(NVCC_ARGS)})")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
