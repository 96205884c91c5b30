"""Metal source check: generate the MSL of every kernel specialization on Linux and type-check it.

What it proves: for each specialization a provider can choose, the complete
source that ``mx.fast.metal_kernel`` would hand to the Metal compiler (MLX's
generated signature and explicit instantiation, our prelude, generated defines,
headers and body) parses and type-checks as C++17 against ``kernels_v2/msl_shim.h``,
with every template instantiated: undeclared names, wrong argument types,
``T*``/``float*`` mismatches, missing outputs and bad template arithmetic fail.

What it does not prove: it never runs Metal. It does not check Metal-only rules
(address spaces are erased by the shim, attribute placement, threadgroup memory
limits, ``constant``-buffer rules), numerical behaviour, races or speed. The
kernels' logic is verified by running the same text through the CUDA prelude on
an NVIDIA GPU (``tests/gpu``).

How: one child Python process builds every ``metal_kernel`` object and traces a
call of each through ``mx.export_function`` with ``verbose=True``; MLX prints the
generated source from C++, so the child's stdout is captured. The sources are
rewritten for clang (``[[kernel]]``/``[[host_name]]`` and argument attributes
dropped, the explicit instantiation kept so dependent types are checked), each
wrapped in its own namespace, with every macro an earlier source defined undefined
before it (each source sees only its own), and checked in one clang run. An error
names its specialization and the file and line it is on: the kernel text's own
(``kernels_v2/FILE:LINE``, from the ``#line`` directives `metal_attn.kernels.assemble`
writes), ``(generated source)`` for MLX's signature and instantiation (lines of the
source `generate_msl` returns), or the shim's.

Usage: ``python -m metal_attn.msl_check [--provider NAME ...] [--set module:function] [--only REGEX]
[--kernels-dir DIR]``. The specializations come from every registered provider
(`Provider.msl_specializations`, built-in and third-party alike), or from the providers named
with ``--provider``; ``--set`` names a function returning `Specialization` objects instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from metal_attn.source_specs import Specialization

CLANG_ARGS = ("-x", "c++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-attributes", "-ferror-limit=50")

_BLOCK = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", re.DOTALL)
_HOST_NAME = re.compile(r"\[\[host_name\(\"[^\"]*\"\)\]\]\s*")
_ATTR = re.compile(r"\[\[[A-Za-z_]\w*(?:\([^)\]]*\))?\]\]")
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE)
_LINE = re.compile(r'^([ \t]*#[ \t]*line[ \t]+\d+[ \t]+)"([^"\n]*)"', re.MULTILINE)
#: An error of clang's: file, line, message.
_ERROR = re.compile(r"^(.+?):(\d+):\d+: (?:fatal )?error: (.*)$", re.MULTILINE)
#: What ends a file name ``#line`` gives in the translation unit: the index of its source.
_TAG = "@msl_spec_"
#: The file name of MLX's own lines (the signature, the explicit instantiation) in error messages.
GENERATED = "(generated source)"


def registered_specializations(providers: Sequence[str] | None = None) -> list[Specialization]:
    """Every registered provider's `Provider.msl_specializations` (or only the ``providers`` named)."""
    from metal_attn.source_sets import provider_sets

    return provider_sets("msl_specializations", providers)


def _load_set(spec: str | None, providers: Sequence[str] | None = None) -> list[Specialization]:
    """The set ``spec`` ("module:function") names, else the registered providers' (`registered_specializations`)."""
    if spec is None:
        return registered_specializations(providers)
    if providers:
        raise ValueError(f"set={spec!r} with providers={list(providers)} (allowed: one of the two)")
    module, _, func = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError, ValueError) as exc:  # ValueError: an empty module name
        raise ValueError(f"--set {spec!r}: {type(exc).__name__}: {exc} (allowed: module:function, a function "
                         "returning the Specialization objects, importable here)") from None
    return list(fn())


def _set_args(set_spec: str | None, providers: Sequence[str] | None) -> list[str]:
    """The command-line arguments that select the same set in the child."""
    if set_spec is not None:
        return ["--set", set_spec]
    return [arg for name in providers or () for arg in ("--provider", name)]


# -- child process: emit the generated sources ------------------------------------------------------


def _emit(set_spec: str | None, providers: Sequence[str] | None, only: str | None) -> None:
    """Child side: trace each specialization's metal_kernel call with verbose=True (MLX prints to stdout)."""
    import mlx.core as mx

    from metal_attn import kernels

    specs = [s for s in _load_set(set_spec, providers) if only is None or re.search(only, s.label)]
    labels = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            kern = kernels.load_kernel(spec.kernel, spec.source_files, spec.input_names, spec.output_names, "metal",
                                       defines=dict(spec.defines))
            template = [(n, getattr(mx, v) if n in spec.is_dtype else v) for n, v in spec.template]
            args = [mx.zeros(shape, getattr(mx, dt)) for shape, dt in spec.inputs]

            def fn(*xs, kern=kern, template=template, spec=spec):
                return kern(inputs=list(xs), template=template, grid=(32, 1, 1), threadgroup=(32, 1, 1),
                            output_shapes=[o[0] for o in spec.outputs],
                            output_dtypes=[getattr(mx, o[1]) for o in spec.outputs], verbose=True)

            sys.stdout.flush()
            print(f"@@spec {i} {spec.label}", flush=True)
            mx.export_function(os.path.join(tmp, f"k{i}.mlxfn"), fn, *args)
            sys.stdout.flush()
            labels[i] = spec.label
    print("@@done " + json.dumps(labels), flush=True)


def generate_msl(set_spec: str | None = None, *, providers: Sequence[str] | None = None, only: str | None = None,
                 kernels_dir: str | os.PathLike | None = None, timeout: float = 600) -> dict[str, str]:
    """Run the child once and return ``{label: generated MSL}`` for every specialization of the set
    (``set_spec``, else the registered providers' or those of ``providers``)."""
    if set_spec is not None and providers:
        raise ValueError(f"set_spec={set_spec!r} with providers={list(providers)} (allowed: one of the two)")
    if providers:
        from metal_attn.plugins import get_registry

        for name in providers:
            get_registry().get(name)  # a name that is not registered fails here, with the registered ones
    cmd = [sys.executable, "-m", "metal_attn.msl_check", "--emit", *_set_args(set_spec, providers)]
    if only:
        cmd += ["--only", only]
    env = dict(os.environ)
    if kernels_dir is not None:
        env["MA_MSL_CHECK_KERNELS_DIR"] = str(kernels_dir)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0 or "@@done" not in proc.stdout:
        raise RuntimeError(f"MSL generation failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, str] = {}
    chunks = re.split(r"^@@spec \d+ (.*)$", proc.stdout.split("@@done", 1)[0], flags=re.MULTILINE)
    for label, text in zip(chunks[1::2], chunks[2::2]):
        m = _BLOCK.search(text)
        if m is None:
            raise RuntimeError(f"no generated source captured for {label!r}")
        out[label] = m.group(2)
    return out


# -- clang ------------------------------------------------------------------------------------------


def to_clang(msl: str) -> str:
    """Rewrite one generated MSL source for clang: drop Metal attributes, keep the instantiation."""
    text = _HOST_NAME.sub("", msl)
    return _ATTR.sub("", text)


def _located(msl: str, i: int) -> str:
    """One generated source for the translation unit, its lines located: a ``#line`` directive before
    MLX's own lines (the signature, the instantiation: `GENERATED`, with the source's line numbers),
    and every ``#line`` file name of the source tagged with the source's index ``i``."""
    lines = _LINE.sub(lambda m: f'{m.group(1)}"{m.group(2)}{_TAG}{i}"', msl).split("\n")
    mark = f'"{GENERATED}{_TAG}{i}"'
    out = [f"#line 1 {mark}"]
    for k, ln in enumerate(lines):
        signature = ln.startswith("[[kernel]]") or (ln.startswith("template <") and k + 1 < len(lines)
                                                    and lines[k + 1].startswith("[[kernel]]"))
        if signature or ln.startswith("template [[host_name("):
            out.append(f"#line {k + 1} {mark}")
        out.append(ln)
    return "\n".join(out)


def translation_unit(sources: dict[str, str], shim: str) -> str:
    """One C++ file: the shim, then each source in its own namespace, after ``#undef`` lines for every
    macro an earlier source defined (so that none leaks into a later one)."""
    parts = ['#line 1 "msl_shim.h"\n', shim, "\n"]
    defined: set[str] = set()
    for i, (label, src) in enumerate(sources.items()):
        body = to_clang(_located(src, i))
        undefs = "".join(f"#undef {n}\n" for n in sorted(defined))
        defined.update(_DEFINE.findall(body))
        parts.append(f"// ---- {label}\n{undefs}namespace msl_spec_{i} {{\n{body}\n}}  // namespace msl_spec_{i}\n")
    return "".join(parts)


def _errors(stderr: str, labels: Sequence[str]) -> list[str]:
    """clang's errors as ``[label] FILE:LINE: message``. An error in the shim (a ``static_assert`` of a
    template there) belongs to the specialization its instantiation notes name, else to ``shim``."""
    out = []
    found = list(_ERROR.finditer(stderr))
    for n, m in enumerate(found):
        file, line, msg = m.groups()
        name, tag, index = file.rpartition(_TAG)
        if not tag:  # the notes after it: "<file>@msl_spec_<i>:<line>:<col>: note: in instantiation ..."
            notes = stderr[m.end():found[n + 1].start() if n + 1 < len(found) else len(stderr)]
            index = next(iter(re.findall(rf"{_TAG}(\d+):\d+:\d+: note:", notes)), "")
        label = labels[int(index)] if index.isdigit() and int(index) < len(labels) else "shim"
        out.append(f"[{label}] {name if tag else file}:{line}: {msg}")
    return out


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check run."""

    ok: bool
    count: int
    errors: list[str]
    output: str

    def summary(self) -> str:
        if self.ok:
            return f"MSL check: {self.count} specializations type-check with clang against the shim"
        return f"MSL check: {len(self.errors)} error(s) in {self.count} specializations:\n" + "\n".join(self.errors)


def find_clang() -> str | None:
    """The clang++ executable (``$CLANGXX``, else ``clang++``), or ``None`` when absent."""
    return shutil.which(clang_name())


def clang_name() -> str:
    """The clang++ the check runs: ``$CLANGXX``, else ``clang++``."""
    return os.environ.get("CLANGXX", "clang++")


def check_sources(sources: dict[str, str], *, clang: str | None = None,
                  kernels_dir: str | os.PathLike | None = None) -> CheckResult:
    """Type-check generated sources in one clang run against ``msl_shim.h`` of ``kernels_dir`` (None: the
    package's), attributing each error to its specialization and the file and line it is on."""
    clang = clang or find_clang()
    if clang is None:
        raise FileNotFoundError(f"clang++ not found: CLANGXX={clang_name()!r} is not on PATH (allowed: a clang++ "
                                "executable; install clang, or set CLANGXX)")
    from metal_attn._layout import kernels_dir as package_kernels_dir

    shim = (Path(kernels_dir) if kernels_dir is not None else package_kernels_dir()) / "msl_shim.h"
    text = translation_unit(sources, shim.read_text())
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        proc = subprocess.run([clang, *CLANG_ARGS, path], capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(path)
    errors = _errors(proc.stderr, list(sources))
    if proc.returncode != 0 and not errors:
        errors.append(proc.stderr.strip()[-2000:] or f"clang exited with {proc.returncode}")
    return CheckResult(proc.returncode == 0, len(sources), errors, proc.stderr)


def selection_problem(kind: str, chosen: Sequence, only: str | None, providers: Sequence[str] | None = None,
                      set_spec: str | None = None) -> str | None:
    """Why a check's selection is empty, as a usage error naming the flag, its value and what exists
    (None when it selects something). ``chosen``: the entries of ``kind`` (`metal_attn.source_sets.KINDS`)
    the set or the providers declare, before ``only`` filters them by label."""
    what = "Metal specializations" if kind == "msl_specializations" else "CUDA sources"
    if only is not None:
        try:
            pattern = re.compile(only)
        except re.error as exc:
            return f"--only {only!r}: not a regular expression ({exc}; allowed: a Python regular expression)"
    if not chosen:
        if set_spec is not None:
            return f"--set {set_spec!r} returned no {what} (allowed: a function returning at least one)"
        from metal_attn.plugins import get_registry

        some = sorted(e.provider.name for e in get_registry().entries if getattr(e.provider, kind)())
        named = ", ".join(f"--provider {n!r}" for n in providers or ()) or "the registered providers"
        return f"{named}: no {what} declared (providers that declare some: {', '.join(some) or 'none'})"
    if only is not None and not any(pattern.search(e.label) for e in chosen):
        kernels = sorted({e.kernel for e in chosen})
        return (f"--only {only!r} matches none of the {len(chosen)} {what} (allowed: a regular expression over "
                f"their labels, which start with the kernel's name: {', '.join(kernels)})")
    return None


def check(set_spec: str | None = None, *, providers: Sequence[str] | None = None, only: str | None = None,
          kernels_dir: str | os.PathLike | None = None) -> CheckResult:
    """Generate (one child process) and check (one clang run) a set of specializations (``set_spec``,
    else every registered provider's or those of ``providers``), with the kernel texts and the shim
    of ``kernels_dir`` (None: the package's)."""
    sources = generate_msl(set_spec, providers=providers, only=only, kernels_dir=kernels_dir)
    if not sources:
        raise RuntimeError(f"no specialization matched (set={set_spec!r}, providers={providers!r}, only={only!r})")
    return check_sources(sources, kernels_dir=kernels_dir)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metal_attn.msl_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", action="append", default=None, metavar="NAME",
                    help="only this registered provider's specializations (repeatable; default: every provider's)")
    ap.add_argument("--set", default=None, help="module:function returning Specialization objects (instead of "
                                                "the providers' sets)")
    ap.add_argument("--only", default=None, help="regex over specialization labels")
    ap.add_argument("--kernels-dir", default=None, help="check kernel sources (and the shim) from this folder instead")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kdir = args.kernels_dir or os.environ.get("MA_MSL_CHECK_KERNELS_DIR")
    if args.emit:  # the child: generates from kdir, then leaves the loader as it found it
        from metal_attn import kernels

        saved = kernels._source_dir
        if kdir:
            kernels.use_source_dir(kdir)
        try:
            _emit(args.set, args.provider, args.only)
        finally:
            if kdir:
                kernels.use_source_dir(saved)
        return 0
    if args.set is not None and args.provider:
        ap.error("--set and --provider select the set in two ways: give one of them")
    from metal_attn.errors import ProviderRefusedError

    try:  # the selection first (cheap, and a usage error wherever clang++ is)
        problem = selection_problem("msl_specializations", _load_set(args.set, args.provider), args.only,
                                    args.provider, args.set)
    except (ProviderRefusedError, ValueError) as exc:
        ap.error(str(exc))
    if problem:
        ap.error(problem)
    if find_clang() is None:
        print(f"msl_check: clang++ is not on PATH (CLANGXX={clang_name()!r}; allowed: a clang++ executable: "
              "install clang, or set CLANGXX)", file=sys.stderr)
        return 2
    result = check(args.set, providers=args.provider, only=args.only, kernels_dir=kdir)
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
