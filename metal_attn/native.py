"""Loader of the compiled CPU kernels (`metal_attn._native`).

The package imports without the native module: `load` returns ``None`` and
`unavailable_reason` says why (not built; built against another MLX release,
whose C++ library it links; or the import failed with this error), which is
what the CPU providers report as their availability reason.
Build it with ``pip install .`` / ``pip install -e .``, or in the checkout with
``cmake -S . -B build/dev && cmake --build build/dev`` (puts the module into
``metal_attn/``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> ModuleType | None:
    """The native module, imported once; ``None`` when it is missing or failed to load."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" not in _state:
            module: ModuleType | None = None
            reason: str | None = None
            status = "ok"
            try:
                import mlx.core  # noqa: F401 - MLX's nanobind types must be registered first

                reason = _mlx_mismatch()
                if reason is None:
                    module = importlib.import_module("metal_attn._native")
                else:
                    status = "import failed"
            except ModuleNotFoundError as exc:
                if exc.name == "metal_attn._native":
                    status = "not built"
                    reason = _not_built_reason()
                else:
                    status = "import failed"
                    reason = f"native module metal_attn._native failed to import: {type(exc).__name__}: {exc}"
            except Exception as exc:
                status = "import failed"
                reason = f"native module metal_attn._native failed to import: {type(exc).__name__}: {exc}"
            _state["reason"] = reason
            _state["status"] = status
            _state["module"] = module
    return _state["module"]  # type: ignore[return-value]


#: Written next to the module by the build (csrc/CMakeLists.txt): the MLX release it was compiled against.
BUILD_INFO = "_native.mlx-version"


def _mlx_mismatch() -> str | None:
    """Why the built module must not be imported under the MLX installed now, or ``None``.

    MLX's C++ library promises no ABI across releases, and the module links it at run time: built
    against one release and loaded under another it may fail to import or, worse, misbehave. A
    module without the record (built before it existed) is imported as before."""
    spec = importlib.util.find_spec("metal_attn._native")
    if spec is None or not spec.origin:
        return None  # not built: the import says so
    record = Path(spec.origin).with_name(BUILD_INFO)
    try:
        built = record.read_text().strip()
    except OSError:
        return None
    running = importlib.metadata.version("mlx")
    if built == running:
        return None
    return (f"native module metal_attn._native was built against MLX {built}, but MLX {running} is installed "
            "(MLX's C++ library has no stable ABI across releases): rebuild it (pip install --force-reinstall "
            f"--no-deps . from the checkout, or pip install -e .), or install mlx=={built}")


def _not_built_reason() -> str:
    """Why ``metal_attn._native`` is missing: not built, or this import comes from a source checkout
    (``python -m`` from its root puts it first on ``sys.path``) that hides an installed copy which has it."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        other = Path(entry or os.getcwd()) / "metal_attn"
        try:
            # A whole installed package (an editable install keeps only its built modules there)
            if other.resolve() != here and (other / "__init__.py").is_file() and any(other.glob("_native*")):
                return (f"native module metal_attn._native is not built in {here}, which this process imported "
                        f"instead of the installed copy at {other.resolve()} (which has it): run from outside the "
                        "source checkout, or install it editable (pip install -e .)")
        except OSError:
            continue
    return ("native module metal_attn._native is not built (install the package with pip, "
            "or run: cmake -S . -B build/dev && cmake --build build/dev)")


def unavailable_reason() -> str | None:
    """Why the native module cannot be used here, or ``None`` when it loaded."""
    load()
    return _state.get("reason")  # type: ignore[return-value]


def status() -> str:
    """``"ok"``, ``"not built"`` (no compiled module in the install) or ``"import failed"`` (its import
    raised, or it was built against another MLX release than the one installed)."""
    load()
    return _state["status"]  # type: ignore[return-value]


def _reset_for_tests(module: ModuleType | None = None, reason: str | None = None) -> None:
    """Forget (or replace) the cached load result; tests use it to simulate a missing module."""
    with _lock:
        _state.clear()
        if module is not None or reason is not None:
            _state["module"] = module
            _state["reason"] = reason
            _state["status"] = "ok" if module is not None else "not built"
