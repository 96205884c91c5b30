"""Host values as MLX arrays for kernel inputs, kept out of MLX CUDA's small-allocation pool.

MLX's CUDA allocator serves every buffer of 8 bytes or less from one pool of managed memory
(advised read-mostly). A kernel's read from that pool took about a microsecond longer than from
an ordinary buffer on the H200, and the kernels read their small inputs first: a decode row's
sequence length, a one-sequence query-start table, the score scale. Measured with
`benchmarks/probe_launch_floor.py` (one decode row, 32/8 heads, head 128, bf16, 600 tokens of
context): the per-token kernel took 20.9 us and its reducer 7.9 us with those inputs in the pool,
16.3 and 2.9 us with the same values in larger buffers.

So every small array this package builds for a kernel comes from `device_array`: an array over
8 bytes as it is, a smaller one as the leading elements of a 16-byte buffer (a view with the
same shape, dtype and values). Other backends gain nothing and lose a few bytes.

Every other buffer is managed memory too, and a fresh host array costs the GPU more still: the
first kernel to read a buffer the host has just written took 42-60 us for 64 bytes (the same
probe, "fresh host array per call"), against 1 us for one it had read before. A decode step's
successor therefore derives its positions, slots and lengths on the device from the step's own
(`metal_attn.cache.next_decode_plan`), from the 16-byte `padded_base` buffers they are views of.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

#: MLX CUDA's small-pool threshold: buffers of at most this many bytes come from the pool.
SMALL_POOL_BYTES = 8
#: The smallest buffer `device_array` allocates.
PADDED_BYTES = 16


def padded_length(n: int, itemsize: int) -> int:
    """Elements of a buffer that holds ``n`` elements of ``itemsize`` bytes and is over the pool."""
    return max(n, -(-PADDED_BYTES // itemsize))


def device_array(values: Any, dtype: Any = None) -> mx.array:
    """``values`` (numpy array, list or scalar; ``dtype`` a numpy dtype, default theirs) as an MLX
    array whose buffer is larger than `SMALL_POOL_BYTES`."""
    host = np.asarray(values, dtype=dtype)
    if host.nbytes > SMALL_POOL_BYTES:
        return _allocate(host)
    return padded_base(host)[: host.size].reshape(host.shape)


def padded_base(values: Any, dtype: Any = None) -> mx.array:
    """``values`` flattened into a 1-D MLX array of `padded_length` elements (zeros after them):
    the buffer `device_array` views. Arithmetic on the whole base keeps its result over the pool
    too, where the same arithmetic on a view of one or two elements would land back in it."""
    host = np.asarray(values, dtype=dtype).reshape(-1)
    n = padded_length(host.size, host.itemsize)
    if n == host.size:
        return _allocate(host)
    flat = np.zeros(n, dtype=host.dtype)
    flat[: host.size] = host
    return _allocate(flat)


def kernel_input(given: mx.array | None, host: np.ndarray, dtype: Any) -> mx.array:
    """``given`` when it is already a ``dtype`` MLX array over the pool, else `device_array` of its
    host copy ``host``."""
    if isinstance(given, mx.array) and given.dtype == dtype and given.nbytes > SMALL_POOL_BYTES:
        return given
    return device_array(host, _NUMPY[dtype])


def _allocate(host: np.ndarray) -> mx.array:
    """The one place this module makes an MLX buffer (tests watch it)."""
    return mx.array(host)


_NUMPY = {mx.int32: np.int32, mx.int64: np.int64, mx.float32: np.float32}
