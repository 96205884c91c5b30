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
    """Import ``metal_attn.providers``, installed or from ``<checkout>/providers``."""
    install_checkout_finder()
    return importlib.import_module("metal_attn.providers")


class _CheckoutProvidersFinder:
    """Meta-path finder for ``metal_attn.providers`` in a source checkout (not installed)."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None):
        if fullname != "metal_attn.providers":
            return None
        src = _checkout_dir("providers")
        if src is None or (_PKG_DIR / "providers").is_dir():
            return None
        return importlib.util.spec_from_file_location(
            fullname, src / "__init__.py", submodule_search_locations=[str(src)]
        )


def install_checkout_finder() -> None:
    """Make ``import metal_attn.providers`` work from a source checkout (idempotent, lazy)."""
    if (_PKG_DIR / "providers").is_dir() or _checkout_dir("providers") is None:
        return
    if not any(isinstance(f, _CheckoutProvidersFinder) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutProvidersFinder())


def kernels_dir() -> Path:
    """The folder holding the kernel sources (``kernels_v2``)."""
    installed = _PKG_DIR / "kernels_v2"
    if installed.is_dir():
        return installed
    src = _checkout_dir("kernels_v2")
    if src is not None:
        return src
    raise FileNotFoundError(f"kernel sources not found (looked in {installed} and {_CHECKOUT_ROOT / 'kernels_v2'})")
