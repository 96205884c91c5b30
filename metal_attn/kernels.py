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

Each part of the assembled text starts with one ``#line N "kernels_v2/FILE"`` directive (the
body's ``N`` is its section's first line; the generated defines are ``(generated defines)``),
and comments are stripped line for line, so a compiler's message (Metal's, NVRTC's, nvcc's, the
source checks') names the kernel file and its line.
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

#: A section's first line: ``// @kernel NAME`` at the start of a line, NAME a C identifier.
_SECTION = re.compile(r"//[ \t]*@kernel[ \t]+([A-Za-z_]\w*)[ \t]*\r?")
#: Any line that looks like a section marker (a near miss is an error, never body text).
_SECTION_LIKE = re.compile(r"^[ \t]*//[ \t]*@kernel\b[^\n]*", re.MULTILINE)
#: The file name ``#line`` gives the generated defines.
GENERATED_DEFINES = "(generated defines)"
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
def _sections(filename: str) -> Mapping[str, tuple[int, str]]:
    """The ``// @kernel NAME`` sections of a body file: name -> (the body's first line, body text).

    Raises `KernelCompileError`, naming the file and line, for a file without sections, code before
    the first section, a name declared twice, a line that looks like a marker but is none
    (indented, a name that is not a C identifier, more words after it) and a marker inside a
    ``/* */`` comment: each of these would otherwise change a kernel's text without a word.
    """
    text = read_source(filename)

    def where(pos: int) -> str:
        return f"kernel source {filename!r} line {text.count(chr(10), 0, pos) + 1}"

    blocks = [(m.start(), m.end()) for m in _COMMENT_OR_LITERAL.finditer(text)
              if m.group(0).lstrip(" \t").startswith("/*")]
    marks: list[tuple[int, int, str]] = []  # (start, end of the line, name)
    for m in _SECTION_LIKE.finditer(text):
        line = m.group(0).strip()
        if any(start < m.start() < end for start, end in blocks):
            raise KernelCompileError(f"{where(m.start())}: {line!r} inside a /* */ comment (allowed: a "
                                     "`// @kernel NAME` line outside block comments)")
        strict = _SECTION.fullmatch(m.group(0))
        if strict is None:
            raise KernelCompileError(f"{where(m.start())}: {line!r} is not a section marker (allowed: "
                                     "`// @kernel NAME` at the start of a line, NAME a C identifier, nothing after it)")
        marks.append((m.start(), m.end(), strict.group(1)))
    if not marks:
        raise KernelCompileError(f"kernel source {filename!r} has no `// @kernel NAME` line (allowed: a body file "
                                 "holds one or more kernels, each starting at such a line)")
    code = strip_comments(text[:marks[0][0]])  # line for line
    if code.strip():
        line = code.count("\n", 0, len(code) - len(code.lstrip())) + 1
        raise KernelCompileError(f"kernel source {filename!r} line {line}: code before the first `// @kernel` line, "
                                 "which no kernel gets (allowed: comments and blank lines; put shared code in a "
                                 "header, *.h)")
    out: dict[str, tuple[int, str]] = {}
    lines: dict[str, int] = {}
    for i, (start, eol, name) in enumerate(marks):
        if name in out:
            raise KernelCompileError(f"{where(start)}: `// @kernel {name}` again (its first section starts at line "
                                     f"{lines[name]}; allowed: each kernel name once per file)")
        lines[name] = text.count("\n", 0, start) + 1
        begin = eol + 1  # after the marker's newline
        end = marks[i + 1][0] if i + 1 < len(marks) else len(text)
        chunk = text[begin:end]
        body = chunk.lstrip("\n")
        out[name] = (lines[name] + 1 + len(chunk) - len(body), body.rstrip("\n") + "\n")
    return out


def sections(filename: str) -> Mapping[str, str]:
    """The ``// @kernel NAME`` sections of a body file: name -> body text (its first line is the
    first non-blank line after the marker); `KernelCompileError` for a malformed file (`_sections`)."""
    return {name: body for name, (_, body) in _sections(filename).items()}


def strip_comments(text: str) -> str:
    """``text`` without its C/C++ comments, line for line.

    MLX copies a kernel's whole text into a new source string on every call, so comments
    cost host time per launch (about 4 µs a classic split call on the H200's host, a third
    of the text). Each comment's newlines stay, so with the ``#line`` directive `assemble`
    puts before each part, compiler messages and the source checks name the files' own line
    numbers; string and character literals are left alone (a digit separator, ``1'024``, opens
    none), and a ``//`` comment continued by a trailing backslash is kept whole (removing it
    would turn the next line into code).
    """
    return _COMMENT_OR_LITERAL.sub(_drop_comment, text)


#: A number (kept whole: its digit separators open no character literal), a string or character
#: literal (kept), or a comment with the blanks before it (dropped).
_COMMENT_OR_LITERAL = re.compile(
    r"(?<![\w.])\.?\d(?:[eEpP][+-]|'?[\w.])*"
    r'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[ \t]*//[^\n]*|[ \t]*/\*.*?\*/', re.DOTALL)


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


def _part(name: str, first_line: int, text: str) -> str:
    """One part of an assembled text: its ``#line`` directive, its text without comments, a final newline."""
    text = strip_comments(text)
    return f'#line {first_line} "{name}"\n{text}' + ("" if text.endswith("\n") else "\n")


def assemble(
    name: str, source_files: Sequence[str], backend: str,
    defines: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
) -> tuple[str, str]:
    """``(header, body)`` of kernel ``name``: prelude, defines and ``*.h`` files, then the body.

    ``source_files`` lists headers (``*.h``, in order) and body files
    (``*.metal``); the body is the section ``name`` of the first body file that
    has one. Each part starts with its ``#line`` directive and ends with a newline (a file
    without a final newline does not run into the next part).
    """
    if backend not in PRELUDES:
        raise ValueError(f"backend={backend!r} (supported: {', '.join(sorted(PRELUDES))})")
    all_defines = generated_defines() | dict(defines or {})
    parts = [_part(f"kernels_v2/{PRELUDES[backend]}", 1, read_source(PRELUDES[backend])),
             _part(GENERATED_DEFINES, 1, _format_defines(all_defines))]
    body = None
    for f in source_files:
        if f.endswith(".h"):
            parts.append(_part(f"kernels_v2/{f}", 1, read_source(f)))
        elif body is None:
            secs = _sections(f)
            if name in secs:
                body = _part(f"kernels_v2/{f}", *secs[name])
    if body is None:
        found = [k for f in source_files if not f.endswith(".h") for k in _sections(f)]
        raise KernelCompileError(f"kernel {name!r} not found in {', '.join(source_files)} (their kernels: "
                                 f"{', '.join(found) or 'none'})")
    return "".join(parts), body


def kernel_name(name: str, header: str, body: str) -> str:
    """A name unique per source text (MLX caches compiled code by name)."""
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:10]
    return f"ma_{name}_{digest}"


def define_items(defines: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None) -> tuple[tuple[str, Any], ...]:
    """A variant's defines as a cache key's ``(name, value)`` pairs: a tuple as given, a mapping sorted."""
    return defines if type(defines) is tuple else tuple(sorted((defines or {}).items()))


def define_types(items: tuple[tuple[str, Any], ...] | None) -> tuple[type, ...]:
    """The types of ``items``' values, for cache keys beside the items: 1, 1.0 and True are equal keys but
    three texts (``#define X 1``, ``1.0``, ``True``)."""
    return tuple([type(v) for _, v in items or ()])


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
    dkey = define_items(defines)
    key = (backend, name, tuple(source_files), tuple(input_names), tuple(output_names), dkey, define_types(dkey),
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
    _sections.cache_clear()
    _epoch.bump()
