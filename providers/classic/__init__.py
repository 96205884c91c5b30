"""The ``classic`` provider: vLLM's per-token paged-attention kernel, on every backend.

- ``metal`` and ``cuda``: one kernel text (``kernels_v2/pagedattention.metal``)
  compiled by ``mx.fast.metal_kernel`` or, through the CUDA prelude,
  ``mx.fast.cuda_kernel``: the per-token kernel of `providers.gpu_common`, run
  through `providers.classic.gpu`. Decode and varlen batches with the causal
  rule, GQA/MQA, sinks, sliding window and softcap; split-KV (512-token
  partitions and the shared reducer) behind the occupancy gate.
- ``cpu``: delegated entirely to ``providers.classic.cpu`` (C++ primitives),
  imported lazily; when it is missing, the cpu backend's availability reason
  says so.

Admission is kept as data per backend (`GPU_ADMISSION`); the CPU module owns
its own table.
"""

from __future__ import annotations

import functools
import importlib
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

from metal_attn.constants import DTYPES, KERNEL_BLOCK_SIZES
from metal_attn.provider import Plan, Provider

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

#: Head sizes the per-token kernel is specialised for on the GPU backends.
GPU_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 112, 128, 192, 256)

#: Per-backend admission tables of the GPU implementation (data, not code paths).
GPU_ADMISSION = MappingProxyType(
    {
        backend: MappingProxyType(
            {
                "dtypes": frozenset(DTYPES),
                "head_sizes": frozenset(GPU_HEAD_SIZES),
                "block_sizes": frozenset(KERNEL_BLOCK_SIZES),
            }
        )
        for backend in ("metal", "cuda")
    }
)

_CPU_MODULE = "metal_attn.providers.classic.cpu"
_GPU_MODULE = "metal_attn.providers.classic.gpu"


def _fmt(values: Any) -> str:
    return ", ".join(str(v) for v in sorted(values))


@functools.cache
def _import(name: str) -> ModuleType:
    """Import a backend half once and keep it (an import lookup per call costs a few µs on the hot
    path); a failed import raises and is tried again next time (exceptions are not cached)."""
    return importlib.import_module(name)


def _load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import ``name``; on failure return the reason instead of raising."""
    try:
        return _import(name), None
    except ImportError as exc:
        return None, f"{name} could not be imported ({type(exc).__name__}: {exc})"


class ClassicProvider(Provider):
    """Per-token paged attention (decode and varlen), split-KV behind an occupancy gate."""

    name = "classic"
    priority = 10
    backends = frozenset({"metal", "cuda", "cpu"})
    phases = frozenset({"decode", "prefill", "mixed", "verify"})
    features = frozenset({"sinks", "sliding_window", "softcap"})
    writes_cache = True
    # Both kernels read lengths and tables from the metadata's arrays; launches use only the bounds.
    reads_lengths_on_device = True
    description = "Per-token paged attention (vLLM v1/v2 style): decode and varlen, split-KV with a shared reducer."

    # -- backend modules -------------------------------------------------------------------------

    def _cpu(self) -> tuple[ModuleType | None, str | None]:
        return _load(_CPU_MODULE)

    def _cpu_or_raise(self) -> ModuleType:
        mod, err = self._cpu()
        if mod is None:
            raise RuntimeError(f"classic: {err}")
        return mod

    def _gpu(self) -> ModuleType:
        return _import(_GPU_MODULE)

    # -- availability and admission ---------------------------------------------------------------

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = super().availability_reasons(device)
        if reasons:
            return reasons
        if device.backend == "cpu":
            mod, err = self._cpu()
            if mod is None:
                return [f"cpu backend not available: {err}"]
            return list(mod.availability_reasons(device))
        return list(self._gpu().availability_reasons(device))

    def not_supported_reasons(
        self, request: AttentionRequest, device: DeviceInfo, settings: Settings
    ) -> list[str]:
        if device.backend != "cpu":
            return super().not_supported_reasons(request, device, settings)
        reasons: list[str] = []
        disabled = settings.is_disabled(self.name)
        if disabled:
            reasons.append(disabled)
        mod, err = self._cpu()
        if mod is None:
            reasons.append(f"cpu backend not available: {err}")
            return reasons
        if request.backend != device.backend:
            reasons.append(f"request backend={request.backend} differs from device backend={device.backend}")
        for r in mod.not_supported_reasons(request, device, settings):
            if r not in reasons:
                reasons.append(r)
        return reasons

    def extra_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        table = GPU_ADMISSION.get(device.backend)
        if table is None:  # pragma: no cover - availability already refused it
            return []
        reasons = []
        if request.dtype not in table["dtypes"]:
            reasons.append(f"dtype={request.dtype} (supported on {device.backend}: {_fmt(table['dtypes'])})")
        if request.head_size not in table["head_sizes"]:
            reasons.append(f"head_size={request.head_size} (supported on {device.backend}: "
                           f"{_fmt(table['head_sizes'])})")
        if request.block_size not in table["block_sizes"]:
            reasons.append(f"block_size={request.block_size} (supported on {device.backend}: "
                           f"{_fmt(table['block_sizes'])})")
        return reasons

    # -- planning and running ---------------------------------------------------------------------

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        if device.backend == "cpu":
            return self._cpu_or_raise().plan(request, device, settings)
        return self._gpu().plan(self.name, request, device, settings)

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        if device.backend == "cpu":
            self._cpu_or_raise().prepare(plan, device)
            return
        self._gpu().prepare(plan, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        # Both backends' plans lead their specialization with the backend they were made for.
        if plan.specialization[0] in GPU_ADMISSION:
            return self._gpu().run(inputs, plan)
        return self._cpu_or_raise().run(inputs, plan)

    def cache_write_reasons(self, dtype: str, device: DeviceInfo, settings: Settings) -> list[str]:
        reasons = super().cache_write_reasons(dtype, device, settings)
        if device.backend != "cpu":
            # mx.fast kernels cannot write into an input, so the GPU kernel produces two whole
            # new pools per call; MLX's own scatter updates a donated pool in place, which is
            # what serving needs. The kernel stays reachable as providers.classic.gpu.write_cache
            # (tested byte-identical in tests/gpu).
            reasons.append(
                f"backend={device.backend}: the reshape_and_cache kernel rewrites both whole pools per call "
                "(mx.fast kernels cannot alias an input); the in-place MLX scatter is used instead"
            )
        return reasons

    def write_cache(
        self, key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array, slots: mx.array,
        device: DeviceInfo,
    ) -> tuple[mx.array, mx.array]:
        if device.backend == "cpu":
            return self._cpu_or_raise().write_cache(key, value, k_cache, v_cache, slots, device)
        return self._gpu().write_cache(key, value, k_cache, v_cache, slots, device)

    # -- source checks ----------------------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """The per-token kernel, the reducer and the cache writer over the Metal admission table."""
        return self._gpu().msl_specializations(GPU_ADMISSION["metal"])

    def cuda_sources(self) -> list[CudaSource]:
        """The per-token kernel's CUDA paths and the reducer."""
        return self._gpu().cuda_sources()

    def info(self) -> dict[str, Any]:
        out = dict(super().info())
        out["head_sizes"] = {b: sorted(t["head_sizes"]) for b, t in GPU_ADMISSION.items()} | {"cpu": "see cpu module"}
        out["block_sizes"] = {b: sorted(t["block_sizes"]) for b, t in GPU_ADMISSION.items()} | {"cpu": "see cpu module"}
        return out
