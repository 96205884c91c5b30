"""The device probe: presets, architecture parsing, backend detection, overrides."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys

import mlx.core as mx
import pytest

from metal_attn import device as device_mod
from metal_attn.device import DEVICE_PRESETS, DeviceInfo, current_device, detect_backend, probe
from metal_attn.errors import InvalidInputError
from metal_attn.settings import override_settings

HAS_GPU = mx.is_available(mx.gpu)


pytestmark = pytest.mark.usefixtures("clean_settings_env")


@pytest.mark.parametrize(
    ("preset", "backend", "name", "arch", "cores", "generation", "variant"),
    [
        ("m3-10core", "metal", "Apple M3", "applegpu_g15g", 10, 15, "g"),
        ("m3-max", "metal", "Apple M3 Max", "applegpu_g15s", 40, 15, "s"),
        ("m4-max", "metal", "Apple M4 Max", "applegpu_g16s", 40, 16, "s"),
        ("m5-10core", "metal", "Apple M5", "applegpu_g17g", 10, 17, "g"),
        ("m5-max", "metal", "Apple M5 Max", "applegpu_g17s", 40, 17, "s"),
        ("h200", "cuda", "NVIDIA H200", "sm_90", 132, 90, None),
        ("cpu-2core", "cpu", "x86_64 CPU", "x86_64", None, None, None),
    ],
)
def test_presets(preset, backend, name, arch, cores, generation, variant):
    d = DeviceInfo.preset(preset)
    assert (d.backend, d.name, d.architecture, d.gpu_cores) == (backend, name, arch, cores)
    assert (d.generation, d.variant) == (generation, variant)
    assert d.hypothetical is True
    assert d is DEVICE_PRESETS[preset]


def test_preset_resources():
    assert DeviceInfo.preset("m5-max").max_threadgroup_memory == 32768
    assert DeviceInfo.preset("h200").max_threadgroup_memory == 227 * 1024
    assert DeviceInfo.preset("h200").memory_bytes == 141 << 30


def test_unknown_preset_lists_the_known_ones():
    # The library's own input error (a ValueError too), as explain(device=...) and providers(...) raise it.
    with pytest.raises(InvalidInputError) as err:
        DeviceInfo.preset("m9-ultra")
    assert str(err.value) == (
        "device preset 'm9-ultra' is unknown (known: cpu-2core, h200, m3-10core, m3-max, m4-max, m5-10core, m5-max)"
    )


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        DEVICE_PRESETS["mine"] = DeviceInfo("cpu")  # type: ignore[index]


@pytest.mark.parametrize(
    ("arch", "generation", "variant"),
    [
        ("applegpu_g13p", 13, "p"),
        ("applegpu_g14d", 14, "d"),
        ("applegpu_g17c", 17, "c"),
        ("applegpu_g18s", 18, "s"),
        ("sm_80", 80, None),
        ("sm_90a", 90, None),
        ("sm_100", 100, None),
        ("x86_64", None, None),
        ("applegpu_gXs", None, None),
        ("applegpu_g17", None, None),
        (None, None, None),
    ],
)
def test_generation_and_variant_parsing(arch, generation, variant):
    d = DeviceInfo("metal", architecture=arch)
    assert (d.generation, d.variant) == (generation, variant)


def test_describe():
    assert DeviceInfo.preset("m5-max").describe() == "metal Apple M5 Max applegpu_g17s 40 cores (hypothetical)"
    # On the CPU the kernels' thread count is what is known and what counts, not GPU cores.
    assert DeviceInfo("cpu", "CPU", "x86_64", cpu_threads=2).describe() == "cpu CPU x86_64 2 threads"
    assert DeviceInfo("cpu", "CPU", "x86_64").describe() == "cpu CPU x86_64 threads unknown"
    assert DeviceInfo("cuda", cpu_threads=16).describe() == "cuda cores unknown"


def test_device_info_is_a_frozen_hashable_value():
    a = DeviceInfo.preset("m3-10core")
    b = a.replace(gpu_cores=10)
    assert a == b and hash(a) == hash(b) and a is not b
    assert {a: 1}[b] == 1
    assert a.replace(gpu_cores=12) != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.gpu_cores = 4  # type: ignore[misc]


@pytest.mark.skipif(HAS_GPU, reason="this MLX build has a usable GPU; the CPU-only assertions do not apply")
def test_this_cpu_build_detects_cpu():
    assert detect_backend() == "cpu"
    d = probe()
    assert d.backend == "cpu"
    assert (d.gpu_cores, d.max_threadgroup_memory, d.generation) == (None, None, None)
    assert d.cpu_threads == os.cpu_count()
    assert d.architecture == (platform.machine() or None)
    assert d.hypothetical is False
    assert current_device().backend == "cpu"


@pytest.mark.parametrize(
    ("gpu", "metal", "cuda", "expected"),
    [
        (False, True, False, "cpu"),  # a Metal build without a usable GPU computes on the CPU
        (False, False, True, "cpu"),
        (True, True, False, "metal"),
        (True, False, True, "cuda"),
    ],
)
def test_detect_backend_asks_for_a_usable_gpu_first(monkeypatch, gpu, metal, cuda, expected):
    monkeypatch.setattr(mx, "is_available", lambda dev: gpu if dev == mx.gpu else True)
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    assert detect_backend() == expected


@pytest.mark.skipif(sys.platform == "darwin", reason="the IORegistry exists on macOS")
def test_apple_core_count_is_unknown_off_macos():
    assert device_mod._apple_gpu_cores() is None


def test_overrides_replace_only_the_given_fields():
    base = current_device()
    with override_settings(gpu_cores=24):
        d = current_device()
        assert d.gpu_cores == 24
        assert d.replace(gpu_cores=base.gpu_cores) == base
    assert current_device() == base


def test_current_device_is_cached_per_settings():
    with override_settings(gpu_cores=16, gpu_architecture="applegpu_g16s"):
        assert current_device() is current_device()
