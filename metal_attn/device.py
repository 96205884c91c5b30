"""The device probe: which backend MLX runs on here, and what the GPU is.

Unknown values are ``None``; rules that need them fail closed with a reason.
Every probed value can be overridden by a setting (``METAL_ATTN_GPU_CORES``,
``METAL_ATTN_GPU_ARCHITECTURE``, ...), and `DeviceInfo.preset` gives the
machines the routing tests and ``metal-attn explain --device`` talk about.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import subprocess
import sys
from types import MappingProxyType

from metal_attn.errors import InvalidInputError

BACKENDS: tuple[str, ...] = ("metal", "cuda", "cpu")

_APPLE_ARCH = re.compile(r"applegpu_g(\d+)([a-z])")
_SM_ARCH = re.compile(r"sm_(\d+)")
_VERSION = re.compile(r"\d+(?:\.\d+)*")


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the providers may ask about the machine."""

    backend: str
    name: str | None = None
    architecture: str | None = None
    gpu_cores: int | None = None
    memory_bytes: int | None = None
    max_threadgroup_memory: int | None = None
    cpu_threads: int | None = None
    hypothetical: bool = False
    #: The macOS version on Apple machines (``"26.2"``), else ``None``; Metal 4 tensor ops need 26.2.
    macos_version: str | None = None

    @property
    def macos(self) -> tuple[int, ...] | None:
        """`macos_version` as numbers (``"26.2"`` -> ``(26, 2)``); ``None`` when unknown or unparsable."""
        m = _VERSION.fullmatch((self.macos_version or "").strip())
        return tuple(int(x) for x in m.group(0).split(".")) if m else None

    @property
    def generation(self) -> int | None:
        """Apple GPU generation (``applegpu_g17s`` -> 17) or CUDA SM major*10+minor."""
        if self.architecture is None:
            return None
        m = _APPLE_ARCH.fullmatch(self.architecture)
        if m:
            return int(m.group(1))
        m = _SM_ARCH.match(self.architecture)
        return int(m.group(1)) if m else None

    @property
    def variant(self) -> str | None:
        """Apple GPU variant letter (``g``, ``s``, ``c``, ``d``, ``p``), else ``None``."""
        m = _APPLE_ARCH.fullmatch(self.architecture or "")
        return m.group(2) if m else None

    def describe(self) -> str:
        parts = [self.backend]
        if self.name:
            parts.append(self.name)
        if self.architecture:
            parts.append(self.architecture)
        if self.backend == "cpu":  # no GPU here: the CPU kernels' threads are what counts
            parts.append(f"{self.cpu_threads} threads" if self.cpu_threads else "threads unknown")
        else:
            parts.append(f"{self.gpu_cores} cores" if self.gpu_cores is not None else "cores unknown")
        if self.hypothetical:
            parts.append("(hypothetical)")
        return " ".join(parts)

    def replace(self, **changes: object) -> DeviceInfo:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def preset(name: str) -> DeviceInfo:
        """A named hypothetical machine (see `DEVICE_PRESETS`)."""
        try:
            return DEVICE_PRESETS[name]
        except KeyError:
            raise InvalidInputError(
                f"device preset {name!r} is unknown (known: {', '.join(sorted(DEVICE_PRESETS))})"
            ) from None


#: The macOS version the Apple presets run (current at the time of writing: every Apple preset has it,
#: so that what tells an M3 from an M5 in their explanations is the GPU alone).
PRESET_MACOS = "26.2"

#: Machines that routing tests and ``explain --device`` can stand in for.
DEVICE_PRESETS = MappingProxyType(
    {
        "m3-10core": DeviceInfo("metal", "Apple M3", "applegpu_g15g", 10, 16 << 30, 32768, 8, True, PRESET_MACOS),
        "m3-max": DeviceInfo("metal", "Apple M3 Max", "applegpu_g15s", 40, 128 << 30, 32768, 16, True, PRESET_MACOS),
        "m4-max": DeviceInfo("metal", "Apple M4 Max", "applegpu_g16s", 40, 128 << 30, 32768, 16, True, PRESET_MACOS),
        "m5-10core": DeviceInfo("metal", "Apple M5", "applegpu_g17g", 10, 32 << 30, 32768, 10, True, PRESET_MACOS),
        "m5-max": DeviceInfo("metal", "Apple M5 Max", "applegpu_g17s", 40, 128 << 30, 32768, 18, True, PRESET_MACOS),
        "h200": DeviceInfo("cuda", "NVIDIA H200", "sm_90", 132, 141 << 30, 232448, 16, True),
        "cpu-2core": DeviceInfo("cpu", "x86_64 CPU", "x86_64", None, 24 << 30, None, 2, True),
    }
)


def detect_backend() -> str:
    """The backend MLX computes on by default here: ``metal``, ``cuda`` or ``cpu``.

    ``mx.metal.is_available()`` / ``mx.cuda.is_available()`` only say what the
    build contains, so a usable GPU is asked for first.
    """
    import mlx.core as mx

    if not mx.is_available(mx.gpu):
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"  # pragma: no cover - a GPU build of an unknown kind


def _apple_gpu_cores() -> int | None:
    """GPU core count from the IORegistry (``AGXAccelerator`` / ``gpu-core-count``)."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(
            ["ioreg", "-rc", "AGXAccelerator", "-d", "1"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', out)
    return int(m.group(1)) if m else None


def _cuda_multiprocessors() -> int | None:
    """Streaming multiprocessor count from the CUDA driver (through ctypes)."""
    import ctypes

    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return None
    count = ctypes.c_int(0)
    dev = ctypes.c_int(0)
    attr_multiprocessor_count = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(count), attr_multiprocessor_count, dev) != 0:
        return None
    return count.value or None


def _macos_version() -> str | None:
    """This Mac's macOS version (``"26.2"``), or ``None`` elsewhere."""
    if sys.platform != "darwin":
        return None
    return platform.mac_ver()[0] or None


def _host_memory() -> int | None:
    """Physical memory of this machine (the CPU backend's device memory), or ``None``."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return None


def available_host_memory() -> int | None:
    """Memory the kernel says it can still give this process without swapping (Linux
    ``MemAvailable``), or ``None`` where unknown. Read at each call: it changes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit(device: DeviceInfo) -> tuple[int | None, str]:
    """The most bytes work on ``device`` may take, and what that limit is: the device's memory, and on the
    CPU backend the host memory still available if that is less (MLX's CPU backend crashes the process
    on an allocation the machine cannot back). ``(None, ...)`` where neither is known."""
    limit, what = device.memory_bytes, f"this {device.backend} device's memory"
    if device.backend == "cpu":
        available = available_host_memory()
        if available is not None and (limit is None or available < limit):
            limit, what = available, "the host memory available now (MemAvailable)"
    return limit, what


def memory_shortfall(need: int, device: DeviceInfo | None = None) -> str | None:
    """``"more than <what the limit is>, <limit> GiB"`` when ``need`` bytes exceed `memory_limit` of
    ``device`` (the current one by default), for an error message; ``None`` when they fit or no limit is known."""
    limit, what = memory_limit(device or current_device())
    if limit and need > limit:
        return f"more than {what}, {limit / 2**30:.2f} GiB"
    return None


def probe() -> DeviceInfo:
    """Probe this machine (no setting overrides applied)."""
    import mlx.core as mx

    backend = detect_backend()
    info: dict = {}
    if backend != "cpu":
        try:
            info = dict(mx.device_info())
        except Exception:  # pragma: no cover - defensive: device_info is best-effort
            info = {}
    arch = info.get("architecture")
    name = info.get("device_name")
    memory = info.get("memory_size") or info.get("total_memory")
    if backend == "metal":
        cores: int | None = _apple_gpu_cores()
        tg_mem = info.get("max_threadgroup_memory") or 32768
    elif backend == "cuda":
        cores = _cuda_multiprocessors()
        # Opt-in shared memory per block: 227 KiB on Hopper, 48 KiB without opt-in elsewhere.
        tg_mem = 232448 if arch == "sm_90" else 49152
    else:
        cores, tg_mem = None, None
        name = name or "CPU"
        arch = arch or platform.machine() or None
        memory = memory or _host_memory()
    return DeviceInfo(
        backend=backend,
        name=name,
        architecture=arch,
        gpu_cores=cores,
        memory_bytes=int(memory) if memory else None,
        max_threadgroup_memory=int(tg_mem) if tg_mem else None,
        cpu_threads=os.cpu_count(),
        macos_version=_macos_version(),
    )


@functools.lru_cache(maxsize=1)
def _probed() -> DeviceInfo:
    return probe()


def current_device() -> DeviceInfo:
    """The probed device with every ``METAL_ATTN_*`` override applied (cached per settings)."""
    from metal_attn.settings import get_settings

    s = get_settings()
    return _apply_overrides(_probed(), s.device_overrides())


@functools.lru_cache(maxsize=32)
def _apply_overrides(base: DeviceInfo, overrides: tuple[tuple[str, object], ...]) -> DeviceInfo:
    return dataclasses.replace(base, **dict(overrides)) if overrides else base
