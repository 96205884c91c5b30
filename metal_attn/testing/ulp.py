"""Distances in units in the last place (ULP) of a 16-bit output dtype, from the bit patterns.

Used to hold two kernels to a bound such as upstream's for relaxed-precision tensor ops (at most
2 ULP of the output dtype at the maximum, 0.05 ULP on average).
"""

from __future__ import annotations

import numpy as np

#: The output dtypes with a 16-bit pattern.
ULP_DTYPES = ("float16", "bfloat16")


def bit_patterns(x: np.ndarray, dtype: str) -> np.ndarray:
    """The 16-bit patterns of ``x`` as ``dtype`` values (exact for values ``dtype`` represents, such as a
    kernel's output read back as float32 or float64)."""
    x = np.asarray(x)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    raise ValueError(f"dtype={dtype!r} (supported: {', '.join(ULP_DTYPES)})")


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """Elementwise count of ``dtype`` values from ``a`` to ``b`` (both ``dtype`` values; +0 and -0 are
    one place, and a pair across zero counts the places on both sides)."""
    def ordered(x: np.ndarray) -> np.ndarray:
        bits = bit_patterns(x, dtype).astype(np.int64)
        magnitude = bits & 0x7FFF
        return np.where(bits & 0x8000, -magnitude, magnitude)

    return np.abs(ordered(a) - ordered(b))


def ulp_figures(a: np.ndarray, b: np.ndarray, dtype: str) -> tuple[int, float]:
    """``(max, mean)`` ULP distance over the elements finite in both (``(0, 0.0)`` when none is)."""
    a = np.asarray(a)
    b = np.asarray(b)
    finite = np.isfinite(a) & np.isfinite(b)
    d = ulp_distance(a[finite], b[finite], dtype)
    return (int(d.max()), float(d.mean())) if d.size else (0, 0.0)
