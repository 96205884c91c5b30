"""The public calls: `paged_attention`, `reshape_and_cache`, `explain`, `providers`."""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn import _epoch, diagnostics
from metal_attn.checks import is_integer
from metal_attn.constants import DTYPES, KERNEL_BLOCK_SIZES
from metal_attn.device import DeviceInfo, current_device, detect_backend
from metal_attn.errors import InvalidInputError, MetalAttnError, ProviderContractError
from metal_attn.host_arrays import kernel_input
from metal_attn.log import warn_once
from metal_attn.metadata import AttentionMetadata
from metal_attn.plugins import get_registry
from metal_attn.provider import AttentionInputs
from metal_attn.registry import Explanation
from metal_attn.request import AttentionRequest, check_feature_values
from metal_attn.settings import get_settings

#: The supported dtypes by name, and back.
MX_DTYPES: dict[str, Any] = {name: getattr(mx, name) for name in DTYPES}
DTYPE_NAMES: dict[Any, str] = {dt: name for name, dt in MX_DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """``mx.float16`` -> ``"float16"`` (any MLX dtype)."""
    return DTYPE_NAMES.get(dtype) or str(dtype).rsplit(".", 1)[-1]


def kernel_block_size(page_size: int) -> int | None:
    """The largest kernel block size (32/16/8) that divides ``page_size``, else ``None``."""
    if page_size in KERNEL_BLOCK_SIZES:
        return page_size
    return next((b for b in KERNEL_BLOCK_SIZES if page_size % b == 0), None)


def _check_attention_tensors(q: Any, k_cache: Any, v_cache: Any) -> None:
    for name, x, ndim, layout in (
        ("q", q, 3, "[total_q_tokens, num_heads, head_size]"),
        ("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]"),
        ("v_cache", v_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]"),
    ):
        if not isinstance(x, mx.array):
            raise InvalidInputError(f"{name} must be an mx.array (got {type(x).__name__})")
        if x.ndim != ndim:
            raise InvalidInputError(f"{name} must have rank {ndim} {layout} (got shape {tuple(x.shape)})")
        if x.dtype not in DTYPE_NAMES:
            raise InvalidInputError(f"{name}.dtype={dtype_name(x.dtype)} (supported: float16, bfloat16, float32)")
        if 0 in x.shape:
            raise InvalidInputError(f"{name} has an empty dimension (shape {tuple(x.shape)})")
    if k_cache.shape != v_cache.shape:
        raise InvalidInputError(
            f"k_cache.shape={tuple(k_cache.shape)} and v_cache.shape={tuple(v_cache.shape)} must be equal"
        )
    if k_cache.dtype != v_cache.dtype:
        raise InvalidInputError(
            f"k_cache.dtype={dtype_name(k_cache.dtype)} and v_cache.dtype={dtype_name(v_cache.dtype)} must be equal"
        )
    if q.shape[2] != k_cache.shape[3]:
        raise InvalidInputError(f"q head_size={q.shape[2]} differs from the cache's head_size={k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise InvalidInputError(
            f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]} (GQA needs whole groups)"
        )


def _tensors_look_valid(q: Any, k: Any, v: Any) -> bool:
    """Hot-path check; `_check_attention_tensors` explains any failure."""
    try:
        return (
            q.ndim == 3
            and k.ndim == 4
            and k.shape == v.shape
            and k.dtype == v.dtype
            and q.dtype in DTYPE_NAMES
            and k.dtype in DTYPE_NAMES
            and q.shape[2] == k.shape[3]
            and q.shape[1] % k.shape[2] == 0
            and 0 not in q.shape
            and 0 not in k.shape
        )
    except AttributeError:
        return False


def _check_tensors(q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata) -> None:
    """The tensor checks of `paged_attention`, against the batch ``md`` too."""
    if not _tensors_look_valid(q, k_cache, v_cache):
        _check_attention_tensors(q, k_cache, v_cache)  # raises with the precise message
    if q.shape[0] != md.total_q_tokens:
        raise InvalidInputError(
            f"q has {q.shape[0]} rows but cu_seqlens_q[-1]={md.total_q_tokens} (they must be equal)"
        )


def _check_features(
    num_heads: int, scale: Any, sinks: Any, sliding_window: Any, softcap: Any, provider: Any = None
) -> None:
    check_feature_values(scale=scale, sliding_window=sliding_window, softcap=softcap)
    if provider is not None and (not isinstance(provider, str) or not provider):  # "" read as None before
        raise InvalidInputError(
            f"provider={provider!r} (allowed: a provider name as a str, or None for the registry's choice)"
        )
    if sinks is not None:
        if not isinstance(sinks, mx.array):
            raise InvalidInputError(f"sinks must be an mx.array of shape [{num_heads}] (got {type(sinks).__name__})")
        if tuple(sinks.shape) != (num_heads,):
            raise InvalidInputError(
                f"sinks.shape={tuple(sinks.shape)} (allowed: [{num_heads}], one logit per query head)"
            )
        if not mx.issubdtype(sinks.dtype, mx.floating):
            raise InvalidInputError(
                f"sinks.dtype={dtype_name(sinks.dtype)} (allowed: a floating dtype; float32 is used)"
            )


def _resolve_metadata(metadata: Any, block_tables: Any, seq_lens: Any, cu_seqlens_q: Any) -> AttentionMetadata:
    if metadata is not None:
        if not isinstance(metadata, AttentionMetadata):
            raise InvalidInputError(f"metadata must be a metal_attn.AttentionMetadata (got {type(metadata).__name__})")
        if block_tables is not None or seq_lens is not None or cu_seqlens_q is not None:
            raise InvalidInputError("pass either metadata= or block_tables/seq_lens/cu_seqlens_q, not both")
        return metadata
    return AttentionMetadata.build(block_tables, seq_lens, cu_seqlens_q)


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    *,
    block_tables: Any = None,
    seq_lens: Any = None,
    cu_seqlens_q: Any = None,
    metadata: AttentionMetadata | None = None,
    scale: float | None = None,
    sinks: mx.array | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    provider: str | None = None,
) -> mx.array:
    """Attention over a paged KV cache for a batch of decode rows and prefill chunks.

    Shapes: ``q`` ``[total_q_tokens, num_heads, head_size]``; pools
    ``[num_blocks, block_size, num_kv_heads, head_size]``; ``block_tables``
    ``[num_seqs, max_blocks]``; ``seq_lens`` ``[num_seqs]`` (KV length including
    this step's tokens); ``cu_seqlens_q`` ``[num_seqs + 1]``. Query row ``i`` of a
    sequence with ``q_len`` rows attends to KV positions ``[0, seq_len - q_len + i + 1)``
    (the last ``sliding_window`` of them when given). ``sinks`` is one float32
    logit per query head; ``softcap`` applies ``c * tanh(s / c)``. ``provider``
    forces one provider (checked alone; its reasons are raised if it refuses).

    Returns ``[total_q_tokens, num_heads, head_size]`` in the query dtype (lazy).
    """
    md = _resolve_metadata(metadata, block_tables, seq_lens, cu_seqlens_q)
    if not (type(q) is mx.array and type(k_cache) is mx.array and type(v_cache) is mx.array):
        _check_attention_tensors(q, k_cache, v_cache)  # raises with the precise message
    # The key holds every value the tensor checks read (shapes and dtypes; the metadata is the
    # cache's owner), so a hit is a call like one already checked: they run on misses only.
    key = (
        q.shape,
        q.dtype,
        k_cache.shape,
        k_cache.dtype,
        v_cache.shape,
        v_cache.dtype,
        sinks is not None,
        sliding_window,
        softcap,
        provider,
        _epoch.current(),
    )
    try:
        hit = md._selections.get(key)
    except TypeError:  # an unhashable sliding_window, softcap or provider: `_check_features` names it below
        hit = None
    if hit is None:
        _check_tensors(q, k_cache, v_cache, md)
    num_heads = q.shape[1]
    _check_features(num_heads, scale, sinks, sliding_window, softcap, provider)
    first = hit is None
    if first:
        hit = _select(md, q, k_cache, num_heads, sinks, sliding_window, softcap, provider)
        md._selections[key] = hit
    sel, eff_md, ratio, record, poison, keep = hit
    if ratio > 1:
        nb, bs, kvh, d = k_cache.shape
        k_cache = k_cache.reshape(nb * ratio, bs // ratio, kvh, d)
        v_cache = v_cache.reshape(nb * ratio, bs // ratio, kvh, d)
    if sinks is not None and sinks.dtype != mx.float32:
        sinks = sinks.astype(mx.float32)
    inputs = AttentionInputs(
        q,
        k_cache,
        v_cache,
        eff_md,
        float(scale) if scale is not None else q.shape[2] ** -0.5,
        sinks,
        sliding_window,
        float(softcap) if softcap is not None else None,
    )
    try:
        out = sel.provider.run(inputs, sel.plan)
    except (MetalAttnError, MemoryError):
        raise
    except Exception as exc:  # a provider's bug, named as such (its admission let in a call it cannot run)
        raise ProviderContractError(f"provider {sel.provider.name!r} (route {sel.plan.route!r}): run() raised "
                                    f"{type(exc).__name__}: {exc}") from exc
    # The provider's output contract, checked on a selection's first call (not on the hot path).
    if first and (type(out) is not mx.array or out.shape != q.shape or out.dtype != q.dtype):
        md._selections.pop(key, None)
        _refuse_output(sel.provider.name, sel.plan.route, out, q)
    if poison is not None:  # validate_metadata off and a table outside the pool: those rows are NaN
        out = mx.where(poison, mx.array(float("nan"), dtype=out.dtype), out)
    diagnostics.record(record, keep)
    return out


def _refuse_output(provider: str, route: str, out: Any, q: mx.array) -> None:
    got = _describe_output(out)
    raise ProviderContractError(
        f"provider {provider!r} (route {route!r}): run() returned {got} (allowed: an mx.array of q's shape "
        f"{tuple(q.shape)} and dtype {dtype_name(q.dtype)})"
    )


def _select(
    md: AttentionMetadata,
    q: mx.array,
    k_cache: mx.array,
    num_heads: int,
    sinks: Any,
    sliding_window: Any,
    softcap: Any,
    provider: str | None,
) -> tuple:
    """Selection-cache miss: page-size translation, pool checks, request, registry."""
    if md.lengths_are_bounds and sliding_window is not None:
        raise InvalidInputError(
            f"sliding_window={sliding_window} with decode_bounds metadata (allowed: None): a window's first "
            "position depends on each sequence's length, which such a batch does not give the host"
        )
    nb, page, kvh, head = k_cache.shape
    kbs = kernel_block_size(page)
    ratio = page // kbs if kbs else 1
    # In the caller's terms (pages), before any split: raises on a bad table (validation on), or
    # gives a table every provider can read safely and the rows to make NaN (validation off).
    safe, poison = md.pool_guard(nb, page)
    eff = safe.split_blocks(ratio)
    device = current_device()
    settings = get_settings()
    request = AttentionRequest(
        backend=device.backend,
        phase=eff.phase,
        dtype=dtype_name(q.dtype),
        cache_dtype=dtype_name(k_cache.dtype),
        num_heads=num_heads,
        num_kv_heads=kvh,
        head_size=head,
        block_size=page // ratio,
        num_seqs=eff.num_seqs,
        total_q_tokens=eff.total_q_tokens,
        max_q_len=eff.max_q_len,
        max_seq_len=eff.max_seq_len,
        length_plan=eff.length_plan,
        num_decode_seqs=eff.num_decode_seqs,
        max_decode_seq_len=eff.max_decode_seq_len,
        sinks=sinks is not None,
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        softcap=float(softcap) if softcap is not None else None,
        lengths_are_bounds=eff.lengths_are_bounds,
    )
    registry = get_registry()
    sel = registry.select(request, device, settings, forced=provider)
    real = settings.backend_override and detect_backend()
    if settings.backend_override is not None and settings.backend_override != real:
        warn_once("backend_override_call", (settings.backend_override, sel.provider.name),
                  reason=f"METAL_ATTN_BACKEND_OVERRIDE={settings.backend_override} routes this call as on "
                         f"{settings.backend_override}, but MLX computes on {real} here: it ran on "
                         f"{sel.provider.name!r} (the override is for routing inspection: metal-attn explain "
                         "--device, providers --device; unset it to run the kernels of this machine)")
    elif sel.provider.name == FALLBACK_PROVIDER and not (provider or settings.provider):
        _warn_slow_fallback(registry, request, device, settings)
    record = diagnostics.DispatchRecord(
        "paged_attention",
        sel.provider.name,
        sel.plan.route,
        sel.plan.partition_size,
        device.backend,
        sel.fallbacks,
        request,
    )
    # METAL_ATTN_DIAGNOSTICS, as this settings scope has it (a new scope or reload moves the epoch, a new key)
    return sel, eff, ratio, record, poison, settings.diagnostics


#: The always-available fallback: correct everywhere, fast nowhere.
FALLBACK_PROVIDER = "reference"


def _warn_slow_fallback(registry: Any, request: AttentionRequest, device: DeviceInfo, settings: Any) -> None:
    """The automatic choice fell back to the reference provider although a kernel provider is
    meant for this backend: say so once per reason (a float32 q over a float16 cache used to land
    there silently), naming what each kernel refused. Providers for other backends are left out;
    one for this backend that cannot run here (a CPU kernel whose native module is missing) is
    named with its reason."""
    table = registry.explain(request, device, settings)
    refusals = [(r.name, r.reasons) for r in table.rows
                if r.name != FALLBACK_PROVIDER and not r.admitted
                and device.backend in getattr(registry.get(r.name), "backends", ())]
    if not refusals:
        return
    reasons = "; ".join(f"{name}: {', '.join(why)}" for name, why in refusals)
    hint = (f" (cast q to the cache dtype, {request.cache_dtype}, to use the kernels)"
            if request.dtype != request.cache_dtype else "")
    warn_once("slow_fallback", (request.dtype, request.cache_dtype, reasons), provider=FALLBACK_PROVIDER,
              reason=f"paged_attention runs on the reference provider (gather + dense MLX ops: correct, slow) "
                     f"because no kernel provider admits the request: {reasons}{hint}",
              request=repr(request))


def _check_slots(slot_mapping: Any, num_tokens: int, num_slots: int) -> mx.array:
    """Validate ``slot_mapping`` on every call (MLX arrays can be edited in place, so an
    identity cache would let a bad slot through); ``validate_metadata=False`` skips the value checks,
    whatever container the slots come in."""
    if isinstance(slot_mapping, mx.array):
        if not mx.issubdtype(slot_mapping.dtype, mx.integer):  # as for NumPy slots: any integer dtype
            raise InvalidInputError(f"slot_mapping.dtype={dtype_name(slot_mapping.dtype)} (allowed: an integer "
                                    "dtype, e.g. int64 or int32)")
        if tuple(slot_mapping.shape) != (num_tokens,):
            raise InvalidInputError(
                f"slot_mapping.shape={tuple(slot_mapping.shape)} (allowed: [{num_tokens}], one slot per token)"
            )
        if not get_settings().validate_metadata:
            return slot_mapping if slot_mapping.dtype == mx.int64 else slot_mapping.astype(mx.int64)
        host = np.array(slot_mapping, copy=False)
    else:
        host = np.asarray(slot_mapping)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise InvalidInputError(f"slot_mapping must hold integers (got dtype {host.dtype})")
        if host.shape != (num_tokens,):
            raise InvalidInputError(
                f"slot_mapping.shape={tuple(host.shape)} (allowed: [{num_tokens}], one slot per token)"
            )
        if not get_settings().validate_metadata:  # as for MLX slots: the writers skip what is outside the pool
            return kernel_input(slot_mapping, host, mx.int64)
    valid = host[host >= 0]
    if valid.size:
        hi = int(valid.max())
        if hi >= num_slots:
            raise InvalidInputError(
                f"slot_mapping holds slot {hi}, out of range (pool has {num_slots} slots: 0..{num_slots - 1}; "
                "negative slots mean padding)"
            )
        vals, counts = np.unique(valid, return_counts=True)
        if vals.size != valid.size:
            raise InvalidInputError(f"slot_mapping holds slot {int(vals[counts > 1][0])} more than once")
    return kernel_input(slot_mapping, host, mx.int64)


def check_cache_write_tensors(key: Any, value: Any, k_cache: Any, v_cache: Any) -> None:
    """The tensor checks of `reshape_and_cache` (ranks, shapes, dtypes; not the slots): raises
    `InvalidInputError` naming the first argument that is wrong."""
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, mx.array) or x.ndim != 3:
            raise InvalidInputError(
                f"{name} must be an mx.array of rank 3 [num_tokens, num_kv_heads, head_size] "
                f"(got {type(x).__name__} {tuple(getattr(x, 'shape', ()))})"
            )
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise InvalidInputError(
                f"{name} must be an mx.array of rank 4 [num_blocks, block_size, num_kv_heads, head_size] "
                f"(got {type(x).__name__} {tuple(getattr(x, 'shape', ()))})"
            )
    if key.shape != value.shape:
        raise InvalidInputError(f"key.shape={tuple(key.shape)} and value.shape={tuple(value.shape)} must be equal")
    if k_cache.shape != v_cache.shape:
        raise InvalidInputError(
            f"k_cache.shape={tuple(k_cache.shape)} and v_cache.shape={tuple(v_cache.shape)} must be equal"
        )
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise InvalidInputError(
            f"key has [num_kv_heads, head_size]={list(key.shape[1:])} but the pool has {list(k_cache.shape[2:])}"
        )
    for name, x in (("key", key), ("value", value), ("v_cache", v_cache)):
        if x.dtype != k_cache.dtype:
            raise InvalidInputError(
                f"{name}.dtype={dtype_name(x.dtype)} differs from "
                f"k_cache.dtype={dtype_name(k_cache.dtype)} (they must match)"
            )
    if k_cache.dtype not in DTYPE_NAMES:
        raise InvalidInputError(f"k_cache.dtype={dtype_name(k_cache.dtype)} (supported: float16, bfloat16, float32)")


def reshape_and_cache(
    key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array, slot_mapping: Any
) -> tuple[mx.array, mx.array]:
    """Scatter new tokens' K/V into their pages: ``pool[slot] = kv``; negative slots are skipped.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]`` in the pool dtype;
    ``slot_mapping``: ``[num_tokens]`` ints, ``block_id * block_size + offset``.
    Returns the updated ``(k_cache, v_cache)``: MLX arrays are values, so rebind
    them (the write is in place when nothing else references the pools).
    """
    check_cache_write_tensors(key, value, k_cache, v_cache)
    slots = _check_slots(slot_mapping, key.shape[0], k_cache.shape[0] * k_cache.shape[1])
    return write_checked(key, value, k_cache, v_cache, slots)


def write_checked(key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array,
                  slots: mx.array) -> tuple[mx.array, mx.array]:
    """`reshape_and_cache` after its checks: for callers whose tensors and int64 ``slots`` are
    valid by construction (`PagedKVCache.write_step` writes the slots its own step plan built)."""
    writer, device, record, keep = _cache_writer(k_cache.dtype)
    try:
        out = writer.write_cache(key, value, k_cache, v_cache, slots, device)
    except (MetalAttnError, MemoryError):
        raise
    except Exception as exc:  # a plugin's bug, named as such
        raise ProviderContractError(f"provider {writer.name!r}: write_cache() raised {type(exc).__name__}: "
                                    f"{exc}") from exc
    # The writer's output contract (two type and shape comparisons: cheap enough for every layer).
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(
            type(a) is mx.array and a.shape == k_cache.shape and a.dtype == k_cache.dtype for a in out)):
        raise ProviderContractError(
            f"provider {writer.name!r}: write_cache() returned {_describe_output(out)} (allowed: a (k_cache, "
            f"v_cache) pair of mx.arrays of the pools' shape {tuple(k_cache.shape)} and dtype "
            f"{dtype_name(k_cache.dtype)})")
    diagnostics.record(record, keep)
    return out[0], out[1]


def _describe_output(out: Any) -> str:
    """What a provider returned, for a contract error: ``list of 2: mx.array (3, 4) float16, ...``, ``None``."""
    def one(a: Any) -> str:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            kind = "mx.array" if type(a) is mx.array else type(a).__name__
            return f"{kind} {tuple(a.shape)} {dtype_name(a.dtype)}"
        return "None" if a is None else type(a).__name__

    if isinstance(out, (tuple, list)):
        more = ", ..." if len(out) > 3 else ""
        return f"{type(out).__name__} of {len(out)}" + (": " + ", ".join(map(one, out[:3])) + more if out else "")
    return one(out)


#: (pool dtype, dispatch epoch) -> (writer, device, dispatch record): every layer of every step
#: writes with the same answer, so it is looked up once per epoch (settings, registry and kernel
#: failures bump the epoch).
_writers: dict[tuple[Any, int], tuple[Any, DeviceInfo, diagnostics.DispatchRecord, bool]] = {}


def _cache_writer(dtype: Any) -> tuple[Any, DeviceInfo, diagnostics.DispatchRecord, bool]:
    """The writer for ``dtype`` pools, its device, its dispatch record and whether METAL_ATTN_DIAGNOSTICS keeps
    every record, per settings scope (`metal_attn._epoch`)."""
    key = (dtype, _epoch.current())
    hit = _writers.get(key)
    if hit is None:
        device, settings = current_device(), get_settings()
        writer = get_registry().select_cache_writer(dtype_name(dtype), device, settings)
        record = diagnostics.DispatchRecord("reshape_and_cache", writer.name, "reshape_and_cache", 0, device.backend)
        if len(_writers) > 64:
            _writers.clear()
        hit = _writers[key] = (writer, device, record, settings.diagnostics)
    return hit


def _device_arg(device: DeviceInfo | str | None) -> DeviceInfo:
    if device is None:
        return current_device()
    if isinstance(device, str):
        return DeviceInfo.preset(device)
    if not isinstance(device, DeviceInfo):
        raise InvalidInputError(
            f"device={device!r} (allowed: a metal_attn.DeviceInfo, a preset name such as 'h200' or 'm5-max', "
            "or None for this machine)"
        )
    return device


def explain(
    request: AttentionRequest | None = None,
    *,
    device: DeviceInfo | str | None = None,
    provider: str | None = None,
    **request_fields: Any,
) -> Explanation:
    """The decision table for a request: every provider in priority order, with reasons and plan.

    Pass an `AttentionRequest`, or its fields as keywords for
    `AttentionRequest.from_lengths` (``q_lens``, ``seq_lens``, ``num_heads``, ...). There
    ``block_size`` is the pool's page size, re-expressed as a real call does: a page of 64
    is read as two kernel blocks of 32 (`kernel_block_size`), as ``metal-attn explain`` does.
    ``device`` may be a `DeviceInfo` or a preset name (``"m5-max"``, ``"h200"``,
    ``"m3-10core"``) to inspect routing on a machine you do not have.
    """
    dev = _device_arg(device)
    if request is None:
        known = inspect.signature(AttentionRequest.from_lengths).parameters
        unknown = sorted(set(request_fields) - set(known))
        if unknown:
            raise InvalidInputError(f"explain: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(known)})")
        if "q_lens" not in request_fields or "seq_lens" not in request_fields:
            raise InvalidInputError("explain: q_lens and seq_lens are required (or pass an AttentionRequest)")
        backend = request_fields.setdefault("backend", dev.backend)
        if backend != dev.backend:
            raise InvalidInputError(
                f"backend={backend!r} differs from the device's backend={dev.backend!r} (allowed: leave backend out, "
                "or pass device= a DeviceInfo or preset of that backend, such as 'm5-max' or 'h200')")
        page = request_fields.get("block_size")
        if is_integer(page) and page >= 1:  # the pool's page, as a real call re-expresses it (64 -> 32)
            request_fields["block_size"] = kernel_block_size(int(page)) or int(page)
        request = AttentionRequest.from_lengths(**request_fields)
    elif request_fields:
        raise InvalidInputError("pass either an AttentionRequest or its fields, not both")
    elif not isinstance(request, AttentionRequest):
        raise InvalidInputError(
            f"request={request!r} (allowed: a metal_attn.AttentionRequest, or its fields as keywords)"
        )
    if provider is not None and (not isinstance(provider, str) or not provider):
        raise InvalidInputError(f"provider={provider!r} (allowed: a provider name as a str, or None)")
    return get_registry().explain(request, dev, get_settings(), forced=provider)


def providers(device: DeviceInfo | str | None = None) -> list[dict[str, Any]]:
    """Every registered provider: origin, declaration, whether enabled and available here, and why not."""
    dev = _device_arg(device)
    reg = get_registry()
    settings = get_settings()
    out = []
    for e in reg.ordered(dev.backend):
        avail = reg.availability_reasons(e.provider, dev)
        disabled = settings.is_disabled(e.provider.name)
        out.append(
            dict(e.provider.info())
            | {
                "priority_here": e.provider.priority_on(dev.backend),
                "origin": e.origin.describe(),
                "distribution": e.origin.distribution,
                "version": e.origin.version,
                "plugin": e.origin.plugin,
                "enabled": disabled is None,
                "disabled_reason": disabled,
                "available": not avail,
                "availability_reasons": list(avail),
            }
        )
    return out
