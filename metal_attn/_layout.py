"""Where the built-in providers and kernel sources are, installed or in a checkout.

The wheel installs the top-level ``providers/`` and ``kernels_v2/`` folders as
``metal_attn/providers`` and ``metal_attn/kernels_v2``. In a plain source
checkout (the GPU machine runs the project that way, on ``PYTHONPATH``) they
stay at the repository's top level; this module finds them in both layouts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PKG_DIR = Path(__file__).resolve().parent
_CHECKOUT_ROOT = _PKG_DIR.parent


def _checkout_dir(name: str) -> Path | None:
    d = _CHECKOUT_ROOT / name
    if d.is_dir() and (_CHECKOUT_ROOT / "pyproject.toml").is_file():
        return d
    return None


def import_builtin_providers() -> ModuleType:
    """Import ``metal_attn.providers`` from the install, else from ``<checkout>/providers``."""
    name = "metal_attn.providers"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
    src = _checkout_dir("providers")
    if src is None:
        raise ModuleNotFoundError(f"{name} is not installed and no source checkout was found", name=name)
    spec = importlib.util.spec_from_file_location(
        name, src / "__init__.py", submodule_search_locations=[str(src)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    import metal_attn

    metal_attn.providers = module  # type: ignore[attr-defined]
    return module


def kernels_dir() -> Path:
    """The folder holding the kernel sources (``kernels_v2``)."""
    installed = _PKG_DIR / "kernels_v2"
    if installed.is_dir():
        return installed
    src = _checkout_dir("kernels_v2")
    if src is not None:
        return src
    raise FileNotFoundError(f"kernel sources not found (looked in {installed} and {_CHECKOUT_ROOT / 'kernels_v2'})")
