"""The kernel loader: one kernel text for Metal and CUDA.

Kernel bodies live in ``kernels_v2/*.metal`` in the Metal dialect that
``mx.fast.metal_kernel`` expects; a body file may hold several kernels, each
starting at a ``// @kernel NAME`` line. A kernel object is assembled from

    backend prelude + generated defines + headers (``*.h``) + the body section

and built lazily, once per (backend, name, sources, defines): a CUDA kernel
object cannot even be constructed on a non-CUDA MLX build. Template arguments
(dtype, head size, block size, ...) travel at call time, so one object serves
many instantiations. Constants come from `metal_attn.constants` as generated
``#define`` lines, never retyped in a kernel.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metal_attn import _epoch, constants
from metal_attn._layout import kernels_dir
from metal_attn.errors import KernelCompileError

#: Lanes per simdgroup (Apple) / warp (NVIDIA); the kernels assume 32.
SIMD_WIDTH = 32

#: Prelude file per backend.
PRELUDES: Mapping[str, str] = {"metal": "prelude_metal.h", "cuda": "prelude_cuda.h"}

_SECTION = re.compile(r"^//\s*@kernel\s+(\w+)\s*$", re.MULTILINE)
_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}
_source_dir: Path | None = None


def use_source_dir(path: str | Path | None) -> None:
    """Read kernel sources from ``path`` instead of the package's ``kernels_v2`` (checks, tests)."""
    global _source_dir
    _source_dir = Path(path) if path is not None else None
    clear_cache()


def generated_defines() -> dict[str, str]:
    """``#define`` values every kernel sees, generated from `metal_attn.constants`."""
    return {
        "MA_LOG2E": f"{constants.LOG2E!r}f",
        "MA_NEG_FLT_MAX": f"({constants.NEG_FLT_MAX!r}f)",
        "MA_SOFTMAX_EPS": f"{constants.SOFTMAX_EPS!r}f",
        "MA_RESCALE_SLACK": f"{constants.RESCALE_SLACK!r}f",
        "MA_PARTITION_SIZE": str(constants.PARTITION_SIZE),
        "MA_SIMD_WIDTH": str(SIMD_WIDTH),
    }


@functools.cache
def read_source(filename: str) -> str:
    """The text of one file of ``kernels_v2`` (read once per process)."""
    path = (_source_dir or kernels_dir()) / filename
    try:
        return path.read_text()
    except OSError as exc:
        raise KernelCompileError(f"kernel source {filename!r} could not be read from {path}: {exc}") from None


@functools.cache
def sections(filename: str) -> Mapping[str, str]:
    """The ``// @kernel NAME`` sections of a body file: name -> body text."""
    text = read_source(filename)
    marks = list(_SECTION.finditer(text))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out[m.group(1)] = text[m.end():end].strip("\n") + "\n"
    return out


def strip_comments(text: str) -> str:
    """``text`` without its C/C++ comments, line for line.

    MLX copies a kernel's whole text into a new source string on every call, so comments
    cost host time per launch (about 4 µs a classic split call on the H200's host, a third
    of the text). Each comment's newlines stay, so compiler messages and the Metal source
    check keep the files' line numbers; string and character literals are left alone, and
    a ``//`` comment continued by a trailing backslash is kept whole (removing it would
    turn the next line into code).
    """
    return _COMMENT_OR_LITERAL.sub(_drop_comment, text)


#: A string or character literal (kept), or a comment with the blanks before it (dropped).
_COMMENT_OR_LITERAL = re.compile(
    r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[ \t]*//[^\n]*|[ \t]*/\*.*?\*/', re.DOTALL)


def _drop_comment(m: re.Match) -> str:
    text = m.group(0)
    stripped = text.lstrip(" \t")
    if stripped.startswith("/*"):  # C reads a comment as one space
        return "\n" * text.count("\n") or " "
    if stripped.startswith("//"):
        return text if text.endswith("\\") else ""
    return text


def _format_defines(defines: Mapping[str, Any]) -> str:
    lines = []
    for key, value in defines.items():
        if isinstance(value, bool):
            value = int(value)
        lines.append(f"#define {key} {value}")
    return "\n".join(lines) + "\n"


def assemble(
    name: str, source_files: Sequence[str], backend: str,
    defines: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
) -> tuple[str, str]:
    """``(header, body)`` of kernel ``name``: prelude, defines and ``*.h`` files, then the body.

    ``source_files`` lists headers (``*.h``, in order) and body files
    (``*.metal``); the body is the section ``name`` of the first body file that
    has one, or a whole body file without sections.
    """
    if backend not in PRELUDES:
        raise ValueError(f"backend={backend!r} (supported: {', '.join(sorted(PRELUDES))})")
    all_defines = generated_defines() | dict(defines or {})
    parts = [read_source(PRELUDES[backend]), "\n// generated from metal_attn.constants and the variant\n",
             _format_defines(all_defines)]
    body = None
    for f in source_files:
        if f.endswith(".h"):
            parts.append(read_source(f))
        elif body is None:
            secs = sections(f)
            if name in secs:
                body = secs[name]
            elif not secs:
                body = read_source(f)
    if body is None:
        raise KernelCompileError(f"kernel {name!r} not found in {', '.join(source_files)}")
    return strip_comments("".join(parts)), strip_comments(body)


def kernel_name(name: str, header: str, body: str) -> str:
    """A name unique per source text (MLX caches compiled code by name)."""
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:10]
    return f"ma_{name}_{digest}"


def load_kernel(
    name: str,
    source_files: Sequence[str],
    input_names: Sequence[str],
    output_names: Sequence[str],
    backend: str,
    *,
    defines: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
    ensure_row_contiguous: bool = True,
) -> Callable[..., list]:
    """The ``mx.fast`` kernel object for ``name`` on ``backend`` (built once, cached).

    Call it like any ``mx.fast.metal_kernel`` object (``inputs=``, ``template=``,
    ``grid=``, ``threadgroup=``, ``output_shapes=``, ``output_dtypes=``). Raises
    `KernelCompileError` when the backend cannot build kernels here. ``defines`` is a mapping
    or a tuple of ``(name, value)`` pairs; launchers on a hot path pass pairs (and tuples of
    names), so the lookup only hashes what it was given (pairs in another order make another
    object of the same text and name, which MLX compiles once).
    """
    dkey = defines if type(defines) is tuple else tuple(sorted((defines or {}).items()))
    key = (backend, name, tuple(source_files), tuple(input_names), tuple(output_names), dkey,
           ensure_row_contiguous)
    got = _kernels.get(key)
    if got is not None:
        return got
    with _lock:
        got = _kernels.get(key)
        if got is not None:
            return got
        import mlx.core as mx

        header, body = assemble(name, source_files, backend, defines)
        kname = kernel_name(name, header, body)
        try:  # assemble() accepted the backend: mx.fast.metal_kernel or mx.fast.cuda_kernel
            got = getattr(mx.fast, f"{backend}_kernel")(
                name=kname, input_names=list(input_names), output_names=list(output_names),
                source=body, header=header, ensure_row_contiguous=ensure_row_contiguous,
            )
        except (RuntimeError, ValueError, AttributeError) as exc:
            raise KernelCompileError(f"could not build kernel {kname!r} for {backend}: {exc}") from exc
        _kernels[key] = got
        return got


def compile_now(run: Callable[[], Any], what: str) -> None:
    """Evaluate a tiny launch of a specialization now, turning any failure into `KernelCompileError`.

    MLX compiles lazily at evaluation; providers call this from ``prepare`` so
    that a compile failure becomes a recorded fallback instead of an error later.
    """
    import mlx.core as mx

    try:
        out = run()
        mx.eval(out)
    except KernelCompileError:
        raise
    except Exception as exc:
        raise KernelCompileError(f"{what}: {type(exc).__name__}: {exc}") from exc


@functools.lru_cache(maxsize=256)
def param_array(values: tuple, dtype: str) -> Any:
    """A small kernel-parameter array (``dtype`` by name), built and evaluated once per distinct
    value: a fresh host-to-GPU array per call costs more than the kernel on short batches, and
    MLX arrays are values, so sharing one is safe. Its buffer is over MLX CUDA's small-allocation
    pool (`metal_attn.host_arrays`)."""
    import mlx.core as mx
    import numpy as np

    from metal_attn.host_arrays import device_array

    out = device_array(np.array(values, dtype=dtype))
    mx.eval(out)
    return out


def clear_cache() -> None:
    """Forget every kernel object (tests), and bump the dispatch epoch (`metal_attn._epoch`) so that
    no launch descriptor holding an old object is reused."""
    with _lock:
        _kernels.clear()
    read_source.cache_clear()
    sections.cache_clear()
    _epoch.bump()
