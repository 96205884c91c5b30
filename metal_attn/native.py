"""Loader of the compiled CPU kernels (`metal_attn._native`).

The package imports without the native module: `load` returns ``None`` and
`unavailable_reason` says why (not built, or the import failed with this
error), which is what the CPU providers report as their availability reason.
Build it with ``pip install .`` / ``pip install -e .``, or in the checkout with
``cmake -S . -B build/dev && cmake --build build/dev`` (puts the module into
``metal_attn/``).
"""

from __future__ import annotations

import importlib
import threading
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

                module = importlib.import_module("metal_attn._native")
            except ModuleNotFoundError as exc:
                if exc.name == "metal_attn._native":
                    status = "not built"
                    reason = (
                        "native module metal_attn._native is not built (install the package with pip, "
                        "or run: cmake -S . -B build/dev && cmake --build build/dev)"
                    )
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


def unavailable_reason() -> str | None:
    """Why the native module cannot be used here, or ``None`` when it loaded."""
    load()
    return _state.get("reason")  # type: ignore[return-value]


def status() -> str:
    """``"ok"``, ``"not built"`` (no compiled module in the install) or ``"import failed"``."""
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
