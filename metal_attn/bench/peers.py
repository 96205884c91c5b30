"""The peers a user would pick instead of a provider, and the bandwidth ceiling.

- ``mlx_sdpa``: MLX's own ``mx.fast.scaled_dot_product_attention`` on contiguous
  ``[batch, kv_heads, context, head]`` K/V (GQA through its native support,
  ``mask="causal"`` for prefill rows, which MLX aligns to the end of the context);
- ``mlx_sdpa_packed``: the same calls from and to packed rows: each group's query rows sliced
  from the batch's ``[total_q_tokens, heads, head]`` query, one SDPA call per group, and the outputs
  put back into that packed layout, which the paged API takes and returns (``mlx_sdpa`` gets its
  per-group queries ready-made and leaves its outputs per group, so on a host-bound batch the
  difference between the two is what the packed layout costs MLX SDPA);
- ``gather_sdpa``: the naive paged path, gathering pages with ``mx.take`` through
  the block table inside the timed call, then MLX SDPA;
- ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on contiguous
  K/V on the GPU (``enable_gqa`` when this torch has it, else K/V repeated per
  group before timing), only when torch with CUDA is importable and MLX runs on CUDA;
- ``ceiling``: on GPUs the copy bandwidth measured in the same run (MLX ``x * 1``
  and torch's device-to-device copy over a large buffer, queued calls, read +
  write bytes; the larger is the ceiling); on the CPU the read bandwidth of the
  native module's multi-threaded read (`metal_attn._native.read_bytes`: as many threads
  as the CPU kernels use, the widest vector loads, four independent accumulators) over
  as many bytes as the shape's K+V, which a kernel that reads those bytes and computes
  cannot exceed (without the native module: a single-threaded numpy sum, which a
  multi-threaded kernel can exceed, and the row says so).

Each peer computes exactly what the provider computes on the same data, so the
runner can check their outputs against each other.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn.bench.candidates import (
    Candidate,
    CandidateResult,
    Prepared,
    ProviderCandidate,
    Skip,
    TimedCandidate,
    f32_rows,
    mlx_prepared,
)
from metal_attn.bench.core import is_gpu
from metal_attn.bench.shapes import Case
from metal_attn.bench.timing import Timing, time_fn
from metal_attn.device import current_device

#: Names that are peers, not providers (a provider of the same name is shadowed).
PEER_NAMES: tuple[str, ...] = ("gather_sdpa", "mlx_sdpa", "mlx_sdpa_packed", "torch_sdpa", "ceiling")

#: Size of the GPU copy-bandwidth buffer (bytes), well beyond any GPU's last-level cache.
GPU_COPY_BYTES = 1 << 30


def mlx_rows(outs: list[mx.array]) -> np.ndarray:
    """Per-group ``[n, heads, q_len, head]`` outputs -> float32 ``[total_q_tokens, heads, head]``."""
    flat = [o.transpose(0, 2, 1, 3).reshape(-1, o.shape[1], o.shape[3]) for o in outs]
    return f32_rows(flat[0] if len(flat) == 1 else mx.concatenate(flat, axis=0))


def sdpa_per_group(case: Case) -> Callable[[], list[mx.array]]:
    """``mlx_sdpa``'s call on ``case``: a function building one MLX SDPA call per group on its contiguous
    K/V and ready-made ``[count, heads, q_len, head]`` queries, returning the outputs per group (lazy)."""
    kv = case.contiguous_kv()
    qs = case.group_queries()
    masks = ["causal" if g.rows.q_len > 1 else None for g in case.groups]
    scale = case.scale

    def compute() -> list[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)
                for q, (k, v), m in zip(qs, kv, masks)]

    return compute


def sdpa_packed(case: Case) -> Callable[[], mx.array]:
    """``mlx_sdpa_packed``'s call on ``case``: a function building the same SDPA calls, each group's
    queries a view of ``case.q``'s packed ``[total_q_tokens, heads, head]`` rows, and returning the
    outputs in that layout (lazy)."""
    kv = case.contiguous_kv()
    s, q, scale = case.shape, case.q, case.scale
    runs = [(g.tokens, g.rows.count, g.rows.q_len) for g in case.groups]

    def compute() -> mx.array:
        outs = []
        for (tokens, n, q_len), (k, v) in zip(runs, kv):
            qg = q[tokens].reshape(n, q_len, s.num_heads, s.head_size).transpose(0, 2, 1, 3)
            o = mx.fast.scaled_dot_product_attention(qg, k, v, scale=scale, mask="causal" if q_len > 1 else None)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n * q_len, s.num_heads, s.head_size))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    return compute


class MlxSdpa(TimedCandidate):
    """MLX SDPA on contiguous K/V, one call per group of identical sequences (`sdpa_per_group`)."""

    name = "mlx_sdpa"
    kind = "peer"

    def prepare(self, case: Case) -> Prepared:
        return mlx_prepared(sdpa_per_group(case), mlx_rows, "contiguous K/V + mx.fast SDPA")


class MlxSdpaPacked(TimedCandidate):
    """MLX SDPA on contiguous K/V from and to packed rows (`sdpa_packed`; the module docstring says why)."""

    name = "mlx_sdpa_packed"
    kind = "peer"

    def prepare(self, case: Case) -> Prepared:
        return mlx_prepared(sdpa_packed(case), f32_rows, "packed rows + contiguous K/V + mx.fast SDPA")


class GatherSdpa(TimedCandidate):
    """The naive paged path: gather pages (``mx.take``) inside the timed call, then MLX SDPA."""

    name = "gather_sdpa"
    kind = "peer"

    def prepare(self, case: Case) -> Prepared:
        s = case.shape
        qs = case.group_queries()
        groups = case.groups
        tables = [case.group_tables(g) for g in groups]
        mx.eval(tables)
        kp, vp, scale = case.k_pool, case.v_pool, case.scale

        def kv(pool: mx.array, table: mx.array, context: int) -> mx.array:
            pages = mx.take(pool, table, axis=0)  # [n, blocks, block_size, kv_heads, head]
            n, nblk = pages.shape[:2]
            flat = pages.reshape(n, nblk * s.block_size, s.num_kv_heads, s.head_size)[:, :context]
            return flat.transpose(0, 2, 1, 3)

        def compute() -> list[mx.array]:
            outs = []
            for q, t, g in zip(qs, tables, groups):
                k, v = kv(kp, t, g.rows.context), kv(vp, t, g.rows.context)
                outs.append(mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=scale, mask="causal" if g.rows.q_len > 1 else None))
            return outs

        return mlx_prepared(compute, mlx_rows, "mx.take pages + mx.fast SDPA")


# -- torch --------------------------------------------------------------------------------------------


def torch_reasons() -> tuple[Any, list[str]]:
    """``(torch, [])`` when torch SDPA can run next to MLX here, else ``(None, reasons)``."""
    reasons = []
    backend = current_device().backend
    if backend != "cuda":
        reasons.append(f"backend={backend} (torch_sdpa runs only when MLX runs on cuda)")
    try:
        import torch
    except ImportError as exc:
        return None, [*reasons, f"torch is not importable ({exc})"]
    if not torch.cuda.is_available():
        reasons.append(f"torch {torch.__version__} has no usable CUDA device (torch.cuda.is_available() is False)")
    return (None, reasons) if reasons else (torch, [])


def _to_torch(x: mx.array, torch: Any, device: Any) -> Any:
    """Copy an MLX array to a torch tensor on ``device`` (bfloat16 travels as its bits)."""
    if x.dtype == mx.bfloat16:
        bits = np.array(mx.view(x, mx.uint16)).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.array(x)).to(device)


@functools.lru_cache(maxsize=1)
def _torch_has_enable_gqa() -> bool:
    import torch
    import torch.nn.functional as F

    t = torch.zeros(1, 2, 1, 8, device="cuda")
    try:
        F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


class TorchSdpa(TimedCandidate):
    """torch SDPA on contiguous K/V on the GPU, timed with ``torch.cuda.synchronize``."""

    name = "torch_sdpa"
    kind = "peer"

    def prepare(self, case: Case) -> Prepared:
        torch, reasons = torch_reasons()
        if torch is None:
            raise Skip("unavailable", reasons)
        import torch.nn.functional as F

        s = case.shape
        dev = torch.device("cuda")
        gqa = s.num_heads != s.num_kv_heads
        native_gqa = not gqa or _torch_has_enable_gqa()
        group = s.num_heads // s.num_kv_heads
        held: dict[str, list] = {"q": [], "k": [], "v": [], "mask": []}
        for g, q, (k, v) in zip(case.groups, case.group_queries(), case.contiguous_kv()):
            tk, tv = _to_torch(k, torch, dev), _to_torch(v, torch, dev)
            if not native_gqa:
                tk, tv = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
            held["q"].append(_to_torch(q, torch, dev))
            held["k"].append(tk)
            held["v"].append(tv)
            ql, ctx = g.rows.q_len, g.rows.context
            if 1 < ql < ctx:  # torch's is_causal aligns to the start: build the end-aligned rule
                allowed = torch.arange(ctx, device=dev)[None, :] <= torch.arange(ql, device=dev)[:, None] + (ctx - ql)
                held["mask"].append(allowed)
            else:
                held["mask"].append(None)
        causal = [1 < g.rows.q_len == g.rows.context for g in case.groups]
        extra = {"enable_gqa": True} if gqa and native_gqa else {}
        scale = case.scale
        torch.cuda.synchronize()

        def launch() -> list:
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, scale=scale, **extra)
                    for q, k, v, m, c in zip(held["q"], held["k"], held["v"], held["mask"], causal)]

        def run() -> list:  # like mx.eval: the call returns when its result is there
            outs = launch()
            torch.cuda.synchronize()
            return outs

        def to_rows(outs: list) -> np.ndarray:
            flat = [o.float().permute(0, 2, 1, 3).reshape(-1, o.shape[1], o.shape[3]) for o in outs]
            return torch.cat(flat, dim=0).cpu().numpy()

        def close() -> None:
            held.clear()
            torch.cuda.empty_cache()

        route = "contiguous K/V + torch SDPA" + (" (enable_gqa)" if extra else
                                                   " (K/V repeat_interleave)" if gqa else "")
        return Prepared(run=run, launch=launch, sync=torch.cuda.synchronize, to_rows=to_rows, route=route,
                        details={"torch_version": torch.__version__}, close=close)


# -- the ceiling ---------------------------------------------------------------------------------------

#: GPU copy ceiling, measured once per process: {"mlx_copy_gbps", "torch_copy_gbps", "gbps", "source", ...}.
_gpu_ceiling: dict[str, Any] = {}


def _noop() -> None:
    return None


def gpu_copy_ceiling(*, warmup: int, iters: int, nbytes: int = GPU_COPY_BYTES) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes per second) with MLX ``x * 1`` and, when available, torch."""
    if _gpu_ceiling:
        return _gpu_ceiling
    mem = current_device().memory_bytes
    if mem:
        nbytes = min(nbytes, mem // 16)
    n = nbytes // 4
    t_mlx = _mlx_copy(n, warmup=warmup, iters=iters)
    out: dict[str, Any] = {"bytes": 4 * n, "mlx_copy_gbps": 2 * 4 * n / t_mlx.median_s / 1e9,
                           "mlx_timing": t_mlx, "torch_copy_gbps": None}
    torch, reasons = torch_reasons()
    if torch is not None:
        out.update(_torch_copy(torch, 4 * n, warmup=warmup, iters=iters))
        torch.cuda.empty_cache()
    else:
        out["torch_reasons"] = reasons
    best = max(("mlx", out["mlx_copy_gbps"]), ("torch", out["torch_copy_gbps"] or 0.0), key=lambda kv: kv[1])
    out["source"] = {"mlx": "MLX x*1 copy", "torch": "torch device-to-device copy"}[best[0]]
    out["gbps"] = best[1]
    out["timing"] = out[f"{best[0]}_timing"]
    out["method"] = "copy bandwidth: 2 * bytes (read + write) / median"
    mx.clear_cache()
    _gpu_ceiling.update(out)
    return _gpu_ceiling


def _mlx_copy(n: int, *, warmup: int, iters: int) -> Timing:
    x = mx.full((n,), 1.0, dtype=mx.float32)
    mx.eval(x)
    return time_fn(lambda: mx.async_eval(x * 1), warmup=warmup, iters=iters)  # queued: the best case


def _torch_copy(torch: Any, nbytes: int, *, warmup: int, iters: int) -> dict[str, Any]:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=warmup, iters=iters, sync=torch.cuda.synchronize)
    return {"torch_copy_gbps": 2 * nbytes / t.median_s / 1e9, "torch_timing": t}


class Ceiling:
    """The bandwidth a decode kernel is compared with, measured in the same run."""

    name = "ceiling"
    kind = "ceiling"

    def __init__(self) -> None:
        self._cpu: dict[int, CandidateResult] = {}

    def measure(self, case: Case, *, warmup: int, iters: int, pipelined: bool = False) -> CandidateResult:
        if is_gpu():
            c = gpu_copy_ceiling(warmup=max(warmup, 2), iters=max(iters, 5))
            t = c["timing"]
            details = {k: c[k] for k in ("source", "method", "bytes", "mlx_copy_gbps", "torch_copy_gbps")}
            return CandidateResult(self.name, self.kind, "ok", timing=t, gbps=c["gbps"], route=c["source"],
                                   details=details)
        nbytes = case.shape.kv_bytes
        hit = self._cpu.get(nbytes)
        if hit is None:
            hit = self._cpu[nbytes] = cpu_read_ceiling(nbytes, warmup=max(warmup, 1), iters=iters)
        return dataclasses.replace(hit, details=dict(hit.details))

    def summary(self) -> dict[str, Any] | None:
        """The run-wide ceiling (GPUs), without raw samples; ``None`` on the CPU (it is per shape)."""
        if not _gpu_ceiling:
            return None
        return {k: v for k, v in _gpu_ceiling.items() if not k.endswith("timing")}


def cpu_read_ceiling(nbytes: int, *, warmup: int, iters: int) -> CandidateResult:
    """The CPU's read bandwidth over ``nbytes`` bytes: the native multi-threaded read with the CPU
    kernels' thread count, or (native module missing) a single-threaded numpy sum."""
    from metal_attn import native

    mod = native.load()
    if mod is None:
        buf = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        t = time_fn(buf.sum, warmup=warmup, iters=iters, sync=_noop)
        return CandidateResult("ceiling", "ceiling", "ok", timing=t, gbps=buf.nbytes / t.median_s / 1e9,
                               route="numpy sum (read, one thread: not a bound for a multi-threaded kernel)",
                               details={"method": "read bandwidth: bytes / median of a single-threaded numpy sum "
                                                  "(the native module is not built)", "bytes": buf.nbytes})
    threads = current_device().cpu_threads or int(mod.hardware_threads())
    buf = mx.ones((max(nbytes // 4, 1),), dtype=mx.float32)  # written: every page is committed
    mx.eval(buf)
    t = time_fn(lambda: mod.read_bytes(buf, threads), warmup=warmup, iters=iters, sync=_noop)
    return CandidateResult("ceiling", "ceiling", "ok", timing=t, gbps=buf.nbytes / t.median_s / 1e9,
                           route=f"native read ({threads} threads, {mod.resolve_isa('auto')})",
                           details={"method": f"read bandwidth: bytes / median of the native {threads}-thread "
                                              "read (metal_attn._native.read_bytes)", "bytes": buf.nbytes,
                                    "threads": threads})


PEERS: dict[str, type] = {"mlx_sdpa": MlxSdpa, "mlx_sdpa_packed": MlxSdpaPacked, "gather_sdpa": GatherSdpa,
                          "torch_sdpa": TorchSdpa, "ceiling": Ceiling}


def timed(names: Sequence[str]) -> tuple[str, ...]:
    """The names among ``names`` (deduplicated, in order) whose candidates pytest-benchmark can time:
    every provider and peer but the copy ceiling, a reference line of `metal-attn bench`."""
    return tuple(c.name for c in resolve(names) if isinstance(c, TimedCandidate))


def resolve(names: Sequence[str]) -> list[Candidate]:
    """Candidates by name: peers and the ceiling by their names, anything else a provider (``auto``: the
    registry's choice). Unregistered providers are reported as such when measured, never raised here."""
    out: list[Candidate] = []
    seen = set()
    for raw in names:
        name = raw.strip()
        if not name or name in seen:
            continue
        seen.add(name)
        out.append(PEERS[name]() if name in PEERS else ProviderCandidate(name))
    return out
