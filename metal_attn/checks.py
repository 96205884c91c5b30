"""The value checks public entry points share: what counts as an int, a number, an ordered list of ints.

Python's ``bool`` is an ``int`` (``True + 1 == 2``), so every check here refuses bools: a flag passed
where a count belongs is a mistake, never a 1. Each entry point still writes its own message, naming
its argument, the value and what is allowed; these functions only decide.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from metal_attn.errors import InvalidInputError

__all__ = [
    "int_at_least",
    "is_decimal",
    "is_finite_real",
    "is_int",
    "is_integer",
    "is_real",
    "is_real_scalar",
    "not_unicode_at",
    "ordered_ints",
]


def is_int(x: object) -> bool:
    """A Python ``int``, not a bool: for values a config or request keeps and later prints or serializes."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_integer(x: object) -> bool:
    """A Python or NumPy integer, not a bool: for values that often come out of an array."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x: object) -> bool:
    """A Python ``int`` or ``float``, not a bool (NaN and infinities included)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_real_scalar(x: object) -> bool:
    """A Python or NumPy int or float, not a bool (NaN and infinities included)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def is_finite_real(x: object) -> bool:
    """A Python ``int`` or ``float``, not a bool, neither NaN nor infinite (an int of any size is finite:
    ``math.isfinite`` would raise ``OverflowError`` converting one past float's range)."""
    return is_real(x) and (isinstance(x, int) or math.isfinite(x))


def is_decimal(text: str) -> bool:
    """``text`` is one or more ASCII digits: what ``int(text)`` reads as a count. ``str.isdigit`` also takes
    '²' (which ``int`` refuses) and other scripts' digits ('١٢', which it reads as 12)."""
    return text.isascii() and text.isdigit()


def not_unicode_at(text: str) -> int | None:
    """The index of the first character of ``text`` that is no Unicode text (a lone surrogate: what Python
    makes of bytes in ``sys.argv`` or a file name that are not UTF-8), or ``None``. Tokenizers refuse such
    strings with errors that do not name the argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def int_at_least(name: str, value: object, low: int = 1) -> int:
    """``value`` when it is a Python int (not a bool) of at least ``low``; else `InvalidInputError` naming it."""
    if not is_int(value) or value < low:
        raise InvalidInputError(f"{name}={value!r} (allowed: an int >= {low})")
    return value


def ordered_ints(name: str, values: Any, allowed: str = "a list, tuple or 1-D array of ints, in order") -> list[int]:
    """``values`` as a list of Python ints, else `InvalidInputError` naming ``name``.

    Allowed: a list, tuple, range or other sequence, or a one-dimensional NumPy or MLX array, of
    integers (0-d integer arrays among them included). Refused: text and bytes (``b"ab"`` would read
    as ``[97, 98]``), sets and mappings (no order, or keys only), iterators (a second pass would find
    them empty), floats and bools. ``allowed`` is the message's "allowed" part.
    """
    if hasattr(values, "ndim") and hasattr(values, "tolist"):  # NumPy or MLX
        if values.ndim != 1:
            raise InvalidInputError(f"{name} has shape {tuple(values.shape)} (allowed: {allowed})")
        values = values.tolist()
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name}={_short(values)} (allowed: {allowed})")
    out = [_scalar(v) for v in values]
    bad = next((v for v in out if not is_integer(v)), None)
    if bad is not None:
        raise InvalidInputError(f"{name} holds {bad!r} (allowed: {allowed})")
    return [int(v) for v in out]


def _scalar(v: Any) -> Any:
    """A 0-d NumPy or MLX array as its Python value (iterating an MLX array yields those); else ``v``."""
    return v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
