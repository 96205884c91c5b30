"""The ``classic`` provider on the GPU backends (Metal and CUDA): one kernel text.

Every batch goes through the per-token kernel (`metal_attn.providers.gpu_common`: its geometry,
occupancy gate, launch and the shared reducer, which the mixed split of other providers uses
too); this module adds what only ``classic`` does: its plan, prepare and run on that kernel,
``reshape_and_cache`` (`write_cache`) and the source-check sets of the kernels it launches
(`msl_specializations`, `cuda_sources`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from metal_attn.providers import gpu_common as gc

from metal_attn import kernels
from metal_attn.constants import DTYPES, PARTITION_SIZE
from metal_attn.provider import Plan

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

#: Threads per threadgroup of reshape_and_cache, and its most threadgroups per launch.
CACHE_THREADS = 256
CACHE_MAX_GROUPS = 8192

CACHE_FILES = ("reshape_and_cache.metal",)
CACHE_INPUTS = ("key", "value", "k_cache", "v_cache", "inv_map", "params")
CACHE_OUTPUTS = ("k_out", "v_out")

availability_reasons = gc.availability_reasons


def plan(provider: str, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
    """The launch decision for an admitted request (the per-token kernel's)."""
    return gc.plan_per_token(provider, request, device, settings)


def prepare(plan: Plan, device: DeviceInfo) -> None:
    """Compile the plan's specialization now (a tiny launch), raising `KernelCompileError` on failure."""
    gc.prepare_per_token(plan, device)


def run(inputs: AttentionInputs, plan: Plan) -> mx.array:
    """The provider's lazy computation for an admitted request, in the plan's exact specialization
    (the one `prepare` compiled)."""
    return gc.run_per_token(inputs, plan.specialization)


# -- reshape_and_cache ---------------------------------------------------------------------------


def _cache_kernel(backend: str):
    return kernels.load_kernel("reshape_and_cache", CACHE_FILES,
                               CACHE_INPUTS, CACHE_OUTPUTS, backend)


def write_cache(key: mx.array, value: mx.array, k_cache: mx.array, v_cache: mx.array, slots: mx.array,
                device: DeviceInfo) -> tuple[mx.array, mx.array]:
    """``pool[slot] = kv`` for every slot inside the pool (negative ones are padding; with
    ``validate_metadata`` off, slots past the pool are skipped too), as one GPU pass producing the
    new pools."""
    nb, bs, kvh, head = k_cache.shape
    host = np.array(slots, copy=False).astype(np.int64, copy=False)
    num_slots = nb * bs
    keep = np.nonzero((host >= 0) & (host < num_slots))[0]  # padding and (validation off) slots past the pool
    if keep.size == 0:
        return k_cache, v_cache
    inv = np.full(num_slots, -1, dtype=np.int32)
    inv[host[keep]] = keep.astype(np.int32)
    row = kvh * head
    total = num_slots * row
    groups = max(1, min(CACHE_MAX_GROUPS, math.ceil(total / CACHE_THREADS)))
    threads = groups * CACHE_THREADS
    params = kernels.param_array((total, row, threads), "int64")
    k_out, v_out = _cache_kernel(device.backend)(
        inputs=[key, value, k_cache, v_cache, mx.array(inv), params],
        template=[("T", k_cache.dtype)], grid=(threads, 1, 1), threadgroup=(CACHE_THREADS, 1, 1),
        output_shapes=[k_cache.shape, v_cache.shape], output_dtypes=[k_cache.dtype, v_cache.dtype],
    )
    return k_out, v_out


# -- source-check sets ---------------------------------------------------------------------------


def msl_specializations(admission: Mapping[str, frozenset]) -> list[Specialization]:
    """Every specialization ``classic`` can choose on Metal, for `metal_attn.msl_check`: the
    per-token kernel (both routes, direct and staged loads, the matrix path at 16-bit dtypes and
    head sizes that are multiples of 32), the reducer per (dtype, head) and the cache writer per
    dtype, over ``admission`` (the Metal admission table: dtypes, head sizes, block sizes)."""
    from metal_attn.source_specs import Specialization

    specs: list[Specialization] = []
    t, h, s = 3, 4, 2  # tokens, heads, sequences: shapes only matter for tracing
    for dtype in DTYPES:
        if dtype not in admission["dtypes"]:
            continue
        for head in sorted(admission["head_sizes"]):
            for block in sorted(admission["block_sizes"]):
                for split, geo in gc.source_check_launches(head, dtype):
                    parts = 2 if split else 1
                    common_in = (
                        ((t, h, head), dtype), ((4, block, 2, head), dtype), ((4, block, 2, head), dtype),
                        ((s, 4), "int32"), ((s,), "int32"), ((s + 1,), "int32"), ((h,), "float32"),
                        ((7,), "int32"), ((2,), "float32"),
                    )
                    outs = (((t, h, head), dtype),) if not split else (
                        ((t, h, parts), "float32"), ((t, h, parts), "float32"), ((t, h, parts, head), "float32"))
                    specs.append(Specialization(
                        label=f"paged_attention split={int(split)} {dtype} head={head} block={block}"
                              + (" mma" if geo.mma else " staged" if geo.stage else ""),
                        kernel="paged_attention", source_files=gc.PAGED_FILES, input_names=gc.PA_INPUTS,
                        output_names=gc.PA_OUTPUTS[split],
                        template=tuple(gc.paged_template(dtype, head, block, PARTITION_SIZE if split else 0, geo,
                                                            gc.PREFETCH_NEXT["metal"])),
                        inputs=common_in, outputs=outs, defines=gc.paged_defines(split, geo),
                    ))
            specs.append(gc.reducer_msl_specialization(f"paged_attention_v2_reduce {dtype} head={head}", dtype,
                                                       head, PARTITION_SIZE, rows=t))
            if dtype == "float16":  # the most partition slices (METAL_ATTN_REDUCER_SLICES; Metal's rule keeps one)
                specs.append(gc.reducer_msl_specialization(f"paged_attention_v2_reduce {dtype} head={head} slices=8",
                                                           dtype, head, PARTITION_SIZE, rows=t, slices=8))
        specs.append(Specialization(
            label=f"reshape_and_cache {dtype}",
            kernel="reshape_and_cache", source_files=CACHE_FILES,
            input_names=CACHE_INPUTS, output_names=CACHE_OUTPUTS,
            template=(("T", dtype),),
            inputs=(((3, 2, 64), dtype), ((3, 2, 64), dtype), ((4, 16, 2, 64), dtype), ((4, 16, 2, 64), dtype),
                    ((64,), "int32"), ((3,), "int64")),
            outputs=(((4, 16, 2, 64), dtype), ((4, 16, 2, 64), dtype)),
        ))
    return specs


def _mma_layouts(geo: gc.Geometry, head: int, group: int) -> list[gc.Geometry]:
    """The matrix path's staged-row layouts other than ``geo``'s (swizzled rows, CUDA's default) that
    CUDA can launch: rows padded by 16 bytes (Metal's layout) and by 32 (the A/B toggles)."""
    variants = (dataclasses.replace(geo, swizzle=0, stage_pad=16), dataclasses.replace(geo, swizzle=0, stage_pad=32))
    return [v for v in variants if v != geo and gc.geometry_problem(v, head, group, 2, "cuda") is None]


def cuda_sources() -> list[CudaSource]:
    """The specializations the CUDA tables choose for ``classic``, for `metal_attn.cuda_check`: the
    per-token kernel at the head sizes and GQA groups that pick each path (direct, staged, matrix;
    both routes; a small and a large split grid), and the reducer."""
    from metal_attn.source_specs import CudaSource

    out: list[CudaSource] = []
    for dt, head, split, group in itertools.product(("float32", "float16", "bfloat16"), (64, 128, 256),
                                                    (False, True), (2, 4, 8)):
        for cores_items in (1.0, None):  # a small split grid and a large one (the staging rule's choice)
            table = gc.geometry(head, dt, "cuda", group, split, cores_items if split else None)
            # The matrix path's A/B layouts too (METAL_ATTN_MMA_STAGE_SWIZZLE=0: rows padded by 16, or by 32),
            # and the keys-as-rows path where it applies (METAL_ATTN_MMA_KEY_ROWS=1).
            key_rows = gc.geometry(head, dt, "cuda", group, split, cores_items, mma_key_rows=True,
                                   kv_tokens=PARTITION_SIZE)
            for geo in (table, *(_mma_layouts(table, head, group) if table.mma else ()),
                        *((key_rows,) if key_rows.mma == 2 else ())):
                ins = gc.per_token_signature(dt)
                outs = ((("out", dt),) if not split else tuple((n, "float32") for n in gc.PA_OUTPUTS[1]))
                template = tuple(gc.paged_template(dt, head, 16, PARTITION_SIZE if split else 0, geo,
                                                   gc.PREFETCH_NEXT["cuda"]))
                label = f"paged_attention {dt} h{head} g{group} split={int(split)} {gc.describe_geometry(geo, None)}"
                srcs = [CudaSource(label, "paged_attention", gc.PAGED_FILES, ins, outs, template,
                                   gc.paged_defines(split, geo))]
                if split:  # the fused reducer (CUDA chains): the output and the arrival counters too
                    srcs.append(CudaSource(f"{label} fused", "paged_attention", gc.PAGED_FILES, ins,
                                           outs + tuple(zip(gc.PA_FUSED_OUTPUTS, (dt, "int32"))), template,
                                           gc.paged_defines(split, geo, fused=True)))
                out.extend(src for src in srcs if src not in out)
    for dt, head, slices in itertools.product(("float32", "bfloat16"), (64, 128, 256), gc.SLICE_COUNTS):
        out.append(gc.reducer_cuda_source(f"paged_attention_v2_reduce {dt} h{head}"
                                          + (f" slices={slices}" if slices > 1 else ""), dt, head, PARTITION_SIZE,
                                          slices))
    return out
