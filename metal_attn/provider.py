"""The provider contract: what a kernel implementation declares and answers.

A provider is an algorithm with one implementation per backend it lists.
Admission is derived from `Provider.not_supported_reasons` alone: declarative
class attributes (phases, dtypes, head sizes, block sizes, features) give most
reasons, and a subclass extends `extra_reasons` with bespoke checks. Each
reason names the observed value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from metal_attn.checks import is_int

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The launch decision a provider made for a request (cheap, pure, printable)."""

    provider: str
    route: str
    partition_size: int = 0
    grid: tuple[int, ...] | None = None
    threadgroup: tuple[int, ...] | None = None
    #: Hashable key of the kernel specialization this plan needs; the registry
    #: records compile failures per (provider, specialization).
    specialization: tuple[Any, ...] = ()
    #: Human-readable facts behind the decision (gate arithmetic, tile sizes...).
    notes: tuple[str, ...] = ()

    def problem(self) -> str | None:
        """Why the registry cannot use this plan (None when it can): its fields' types, which a
        provider's ``plan()`` fills in."""
        if not isinstance(self.route, str) or not self.route:
            return f"route={self.route!r} (allowed: a non-empty str)"
        if not is_int(self.partition_size) or self.partition_size < 0:
            return f"partition_size={self.partition_size!r} (allowed: an int >= 0)"
        for name in ("grid", "threadgroup"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, tuple) and all(is_int(x) for x in value)):
                return f"{name}={value!r} (allowed: a tuple of ints, or None)"
        if not isinstance(self.specialization, tuple):
            return f"specialization={self.specialization!r} (allowed: a hashable tuple)"
        try:
            hash(self.specialization)
        except TypeError:
            return f"specialization={self.specialization!r} (allowed: a hashable tuple)"
        if not isinstance(self.notes, tuple) or not all(isinstance(n, str) for n in self.notes):
            return f"notes={self.notes!r} (allowed: a tuple of str)"
        return None

    def describe(self) -> str:
        parts = [f"route={self.route}"]
        if self.partition_size:
            parts.append(f"partition={self.partition_size}")
        if self.grid is not None:
            parts.append(f"grid={'x'.join(map(str, self.grid))}")
        if self.threadgroup is not None:
            parts.append(f"threadgroup={'x'.join(map(str, self.threadgroup))}")
        return " ".join(parts + list(self.notes))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class AttentionInputs:
    """Everything `Provider.run` needs for one call (arrays are validated)."""

    q: mx.array
    k_cache: mx.array
    v_cache: mx.array
    metadata: AttentionMetadata
    scale: float
    sinks: mx.array | None = None
    sliding_window: int | None = None
    softcap: float | None = None


def reason_list(value: Any, method: str) -> list[str]:
    """A provider method's reasons (``availability_reasons``, ``extra_reasons``, ...) as a list of str; raises
    `TypeError` naming ``method`` otherwise. A bare ``"too long"`` would read as eight one-letter reasons; ``None``
    is a forgotten return; a generator is read once."""
    listed = list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
    if listed is None or not all(isinstance(r, str) for r in listed):
        raise TypeError(f"{method}() returned {value!r} (allowed: a list of str, empty to admit)")
    return listed


def scatter_slots(pool: mx.array, rows: mx.array, slots: mx.array) -> mx.array:
    """``pool[slot] = row`` for each row of ``rows`` (``[n, kv_heads, head]``) and its slot, through
    MLX's scatter on the pool seen as ``[num_blocks * block_size, kv_heads, head]``: in place when
    the pool is donated. Every slot must be inside the pool: MLX's scatter does not bounds-check its
    indices, and a negative slot wraps to the pool's end. A cache writer's slots may hold padding:
    `write_slots` skips it."""
    nb, bs, kvh, head = pool.shape
    flat = pool.reshape(nb * bs, kvh, head)
    flat[slots] = rows
    return flat.reshape(nb, bs, kvh, head)


def write_slots(key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array,
                slots: mx.array) -> tuple[mx.array, mx.array]:
    """`Provider.write_cache`'s contract through MLX's scatter: ``pool[slot] = row`` for every slot inside the
    pool; negative slots (padding) are skipped, and so are slots past the pool (which reach a writer when
    ``METAL_ATTN_VALIDATE_METADATA=0``). Reads the slots on the host (one synchronization)."""
    import mlx.core as mx
    import numpy as np

    nb, bs = k_cache.shape[:2]
    host = np.array(slots, copy=False)
    if host.size and host.dtype == np.int64 and not np.count_nonzero(host.view(np.uint64) >= nb * bs):
        idx, rows = slots, None  # every slot in the pool (a negative one wraps past it as uint64)
    else:
        keep = np.nonzero((host >= 0) & (host < nb * bs))[0]
        if keep.size == 0:
            return k_cache, v_cache
        if keep.size == host.size:  # every slot in the pool: the slots are the indices
            idx, rows = slots, None
        else:
            idx, rows = mx.array(host[keep].astype(np.int64)), mx.array(keep.astype(np.int64))
    k_new = key if rows is None else key[rows]
    v_new = value if rows is None else value[rows]
    return scatter_slots(k_cache, k_new, idx), scatter_slots(v_cache, v_new, idx)


def _fmt(values: Any) -> str:
    return ", ".join(str(v) for v in values)


class Provider:
    """Base class of every attention provider (built-in and third-party).

    Subclasses set the class attributes below and implement `run`; they may
    override `availability_reasons`, `extra_reasons`, `plan`, `prepare` and
    `write_cache`, and declare the kernel sets of the source checks
    (`msl_specializations`, `cuda_sources`).
    """

    #: Unique name (also the forced-provider value and the disable-list entry).
    name: ClassVar[str] = ""
    #: Higher runs first. Explicit data: registration order never matters.
    priority: ClassVar[int] = 0
    #: Priorities on single backends where measurement ranks the provider differently there
    #: (``{"cuda": 5}``); a backend not listed uses `priority`.
    backend_priority: ClassVar[Mapping[str, int]] = MappingProxyType({})
    #: Backends this provider has an implementation for.
    backends: ClassVar[frozenset[str]] = frozenset()
    #: Phases it computes.
    phases: ClassVar[frozenset[str]] = frozenset({"decode", "prefill", "mixed", "verify"})
    #: Query/cache dtypes (by name); ``None`` means any.
    dtypes: ClassVar[frozenset[str] | None] = None
    #: Head sizes; ``None`` means any.
    head_sizes: ClassVar[frozenset[int] | None] = None
    #: Kernel block sizes; ``None`` means any.
    block_sizes: ClassVar[frozenset[int] | None] = None
    #: Optional features it implements (subset of sinks, sliding_window, softcap).
    features: ClassVar[frozenset[str]] = frozenset()
    #: Whether the query and cache dtypes may differ.
    mixed_dtypes: ClassVar[bool] = False
    #: Whether it also implements `write_cache` (reshape_and_cache).
    writes_cache: ClassVar[bool] = False
    #: Whether `run` reads every per-sequence length and table entry from the metadata's device
    #: arrays and derives launch shapes only from the host bounds (``max_seq_len``, the table's
    #: width, the row counts), never from a host length of one sequence. Such a provider may run
    #: `AttentionMetadata.decode_bounds` batches, the decode steps an engine traces once under
    #: ``mx.compile`` and replays with other lengths.
    reads_lengths_on_device: ClassVar[bool] = False
    #: One line for inventories and docs.
    description: ClassVar[str] = ""

    # -- availability: per device (the registry's inventory asks once per device; admission asks once per
    # request shape, whose selection is then cached) ------------------------------------------------

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        """Why this provider cannot run on ``device`` at all (empty when it can)."""
        if device.backend not in self.backends:
            return [f"backend={device.backend} (supported: {_fmt(sorted(self.backends))})"]
        return []

    # -- admission: every reason, each naming the value and the allowed set -----------------

    def not_supported_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        """Every reason this provider refuses ``request`` on ``device``."""
        reasons: list[str] = []
        if type(self).run is Provider.run:  # a misspelled `run` would be chosen, then fail every call
            reasons.append(f"does not implement run(inputs, plan) ({type(self).__qualname__} inherits Provider's)")
        disabled = settings.is_disabled(self.name)
        if disabled:
            reasons.append(disabled)
        reasons.extend(reason_list(self.availability_reasons(device), "availability_reasons"))
        if request.backend != device.backend:
            reasons.append(f"request backend={request.backend} differs from device backend={device.backend}")
        if request.phase.value not in self.phases:
            reasons.append(f"phase={request.phase.value} (supported: {_fmt(sorted(self.phases))})")
        if self.dtypes is not None:
            if request.dtype not in self.dtypes:
                reasons.append(f"dtype={request.dtype} (supported: {_fmt(sorted(self.dtypes))})")
        if not self.mixed_dtypes and request.cache_dtype != request.dtype:
            reasons.append(f"cache_dtype={request.cache_dtype} (supported: same as dtype={request.dtype})")
        if self.head_sizes is not None and request.head_size not in self.head_sizes:
            reasons.append(f"head_size={request.head_size} (supported: {_fmt(sorted(self.head_sizes))})")
        if self.block_sizes is not None and request.block_size not in self.block_sizes:
            reasons.append(f"block_size={request.block_size} (supported: {_fmt(sorted(self.block_sizes))})")
        if request.sinks and "sinks" not in self.features:
            reasons.append("sinks given (supported: no sinks)")
        if request.sliding_window is not None and "sliding_window" not in self.features:
            reasons.append(f"sliding_window={request.sliding_window} (supported: none)")
        if request.softcap is not None and "softcap" not in self.features:
            reasons.append(f"softcap={request.softcap:g} (supported: none)")
        if request.lengths_are_bounds and not self.reads_lengths_on_device:
            reasons.append("lengths_are_bounds (a compiled decode step's metadata, AttentionMetadata.decode_bounds): "
                           "this provider reads per-sequence lengths on the host (supported: exact host lengths)")
        reasons.extend(reason_list(self.extra_reasons(request, device, settings), "extra_reasons"))
        return reasons

    def extra_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        """Bespoke admission checks beyond the declarative attributes."""
        return []

    def supports(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> bool:
        """Derived from `not_supported_reasons`; never written separately."""
        return not self.not_supported_reasons(request, device, settings)

    # -- planning and running ------------------------------------------------------------------

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        """The launch decision for an admitted request (cheap and pure)."""
        return Plan(provider=self.name, route=self.name, specialization=(request.dtype, request.head_size))

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Build (compile) the kernels ``plan`` needs; raise `KernelCompileError` on failure.

        Called the first time the registry chooses this provider for a
        specialization, while a fallback is still possible.
        """

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        """The lazy MLX computation: returns ``[total_q_tokens, num_heads, head_size]``."""
        raise NotImplementedError(f"provider {self.name!r} does not implement run()")

    def write_cache(
        self,
        key: mx.array,
        value: mx.array,
        k_cache: mx.array,
        v_cache: mx.array,
        slots: mx.array,
        device: DeviceInfo,
    ) -> tuple[mx.array, mx.array]:
        """reshape_and_cache for providers with ``writes_cache = True``: the ``(k_cache, v_cache)`` pools with
        ``pool[slot] = row`` for each of ``key``/``value``'s rows. ``slots`` is int64, one per row, each checked
        to be inside the pool or negative; a negative slot is padding and must be skipped, and with
        ``METAL_ATTN_VALIDATE_METADATA=0`` unchecked slots past the pool must be skipped too
        (`write_slots` does both)."""
        raise NotImplementedError(f"provider {self.name!r} does not write the cache")

    def cache_write_reasons(self, dtype: str, device: DeviceInfo, settings: Settings) -> list[str]:
        """Why this provider cannot write a cache of ``dtype`` here (empty when it can)."""
        reasons = []
        if not self.writes_cache:
            reasons.append("does not implement reshape_and_cache")
        elif type(self).write_cache is Provider.write_cache:
            reasons.append(f"writes_cache=True but does not implement write_cache(...) ({type(self).__qualname__} "
                           "inherits Provider's)")
        disabled = settings.is_disabled(self.name)
        if disabled:
            reasons.append(disabled)
        reasons.extend(reason_list(self.availability_reasons(device), "availability_reasons"))
        if self.dtypes is not None and dtype not in self.dtypes:
            reasons.append(f"dtype={dtype} (supported: {_fmt(sorted(self.dtypes))})")
        return reasons

    # -- source checks (optional) --------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """Every Metal kernel specialization this provider can launch, as
        `metal_attn.msl_check.Specialization` objects: ``python -m metal_attn.msl_check`` asks every
        registered provider and type-checks each one's generated Metal source. Labels must be
        unique across providers. Default: none (a provider without Metal kernels)."""
        return []

    def cuda_sources(self) -> list[CudaSource]:
        """Every CUDA kernel specialization this provider can launch, as
        `metal_attn.cuda_check.CudaSource` objects: ``python -m metal_attn.cuda_check`` asks every
        registered provider and compiles each one with nvcc. Labels must be unique across providers.
        Default: none (a provider without CUDA kernels)."""
        return []

    def priority_on(self, backend: str) -> int:
        """The priority on ``backend``: its `backend_priority` entry, else `priority`."""
        return self.backend_priority.get(backend, self.priority)

    def info(self) -> Mapping[str, Any]:
        """Declarative facts for inventories (`metal-attn providers`)."""

        def _s(v: Any) -> Any:
            return sorted(v) if v is not None else "any"

        return {
            "name": self.name,
            "priority": self.priority,
            "backend_priority": dict(sorted(self.backend_priority.items())),
            "backends": sorted(self.backends),
            "phases": sorted(self.phases),
            "dtypes": _s(self.dtypes),
            "head_sizes": _s(self.head_sizes),
            "block_sizes": _s(self.block_sizes),
            "features": sorted(self.features),
            "writes_cache": self.writes_cache,
            "description": self.description,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority}>"
