"""The NAX kernel's text executed on the CPU: a simulation of one Apple simdgroup (32 threads as lanes,
shuffles through shared slots, `matmul2d` in float through a scratch, the cooperative tensors in the
layout of ``kernels_v2/nax_layout.h``), built with g++ from ``tests/nax_sim/``.

This runs in CI, before any GPU: the kernel's indexing, its four block-table lookups per tile, the
masks, the online softmax, sinks, the window skip and the NaN handling, against the float64 oracle.
It models neither Apple's tensor units nor their rounding (float products and sums; fp16 inputs as
``_Float16``, bfloat16 inputs as their float values), which is why the oracle's tolerance is the
dtype's. The CUDA twin on a GPU (tests/gpu/test_nax_gpu.py) runs the same text on tensor cores.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from metal_attn import kernels
from metal_attn._layout import import_builtin_providers, kernels_dir
from metal_attn.constants import LOG2E
from metal_attn.testing import assert_close_to_oracle, make_case

import_builtin_providers()
from metal_attn.providers import nax_prefill as nx  # noqa: E402

SIM_DIR = Path(__file__).parent / "nax_sim"
#: The simulated element type per dtype (bfloat16 values are exact in float).
SIM_TYPES = {"float16": ("_Float16", np.float16), "bfloat16": ("float", np.float32)}


@pytest.fixture(scope="module")
def build(tmp_path_factory, request, gxx):
    """``build(dtype, head, block)``: the simulator of one specialization (compiled once; g++ from the
    conftest's ``gxx``, which skips where it is missing and fails in CI)."""
    root = tmp_path_factory.mktemp("nax_sim")
    defines = kernels.generated_defines() | dict(nx.KERNEL_DEFINES)
    (root / "defines.h").write_text("".join(f"#define {k} {v}\n" for k, v in defines.items()))
    (root / "body.inc").write_text(kernels.sections("nax_prefill.metal")["nax_prefill"])
    built: dict[tuple, Path] = {}

    def _build(dtype: str, head: int, block: int) -> Path:
        key = (dtype, head, block)
        if key not in built:
            exe = root / f"sim_{dtype}_{head}_{block}"
            cmd = [gxx, "-std=c++20", "-O1", "-pthread", f"-DSIM_T={SIM_TYPES[dtype][0]}", f"-DSIM_HEAD={head}",
                   f"-DSIM_BLOCK={block}", f"-I{root}", f"-I{SIM_DIR}", f"-I{kernels_dir()}",
                   str(SIM_DIR / "sim_main.cpp"), "-o", str(exe)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-4000:]
            built[key] = exe
        return built[key]

    return _build


def _simulate(build, case, tmp_path) -> np.ndarray:
    """Run the kernel's body over every (tile, head, simdgroup) of ``case``; returns float64 output."""
    dtype = case.dtype
    head = int(case.q.shape[2])
    block = int(case.k_cache.shape[1])
    exe = build(dtype, head, block)
    host = case._host_arrays()
    np_t = SIM_TYPES[dtype][1]
    md = case.metadata()
    tiles = np.array(md.query_tiles(nx.NAX_BQ, 0)).astype(np.int32)
    sinks = host["sinks"] if host["sinks"] is not None else np.zeros(case.q.shape[1], np.float32)
    params = np.array([tiles.shape[0], case.q.shape[1], case.k_cache.shape[2], case.block_tables.shape[1],
                       int(case.sliding_window or 0), int(host["sinks"] is not None)], np.int32)
    fparams = np.array([case.scale if case.softcap else case.scale * LOG2E, float(case.softcap or 0.0)], np.float32)
    arrays = {"q": host["q"].astype(np_t), "k": host["k_cache"].astype(np_t), "v": host["v_cache"].astype(np_t),
              "block_tables": case.block_tables.astype(np.int32), "seq_lens": case.seq_lens.astype(np.int32),
              "cu_seqlens_q": case.cu_seqlens_q.astype(np.int32), "tiles": tiles, "sinks": sinks.astype(np.float32),
              "params": params, "fparams": fparams}
    for name, arr in arrays.items():
        np.ascontiguousarray(arr).tofile(tmp_path / f"{name}.bin")
    proc = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = np.fromfile(tmp_path / "out.bin", dtype=np_t).reshape(case.q.shape)
    return out.astype(np.float64)


#: (dtype, head, block, q_lens, seq_lens): every head size once, both dtypes and every block size, a
#: prefill batch (a chunk with context, a fresh prompt past one 64-row tile, a one-row chunk) or a mixed
#: one (decode rows first).
_MATRIX = [
    ("float16", 64, 8, [37, 70, 1], [300, 70, 45]),
    ("bfloat16", 96, 16, [1, 1, 33], [90, 1, 200]),
    ("float16", 128, 32, [37, 70, 1], [300, 70, 45]),
    ("bfloat16", 256, 8, [17, 40], [100, 40]),
    ("float16", 512, 16, [1, 20], [50, 70]),
]


@pytest.mark.parametrize(("dtype", "head", "block", "q_lens", "seq_lens"), _MATRIX,
                         ids=[f"{d}-h{h}-b{b}" for d, h, b, _, _ in _MATRIX])
def test_kernel_text_on_a_simulated_simdgroup(build, tmp_path, dtype, head, block, q_lens, seq_lens):
    case = make_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=2, num_kv_heads=1, head_size=head,
                     block_size=block, dtype=dtype, seed=head + block, label=f"sim {dtype} h{head} b{block}")
    assert_close_to_oracle(_simulate(build, case, tmp_path), case.oracle(), dtype, label=case.label)


@pytest.mark.parametrize(("features", "label"), [
    (dict(sinks=True), "sinks"),
    (dict(sliding_window=40, score_bias=-120.0), "window far below zero (leading tiles skipped)"),
    (dict(sliding_window=1), "window 1"),
    (dict(softcap=5.0, scale=0.5), "softcap"),
    (dict(sinks=True, sliding_window=70, softcap=20.0, shared_prefix_blocks=2), "every feature"),
])
def test_features_on_a_simulated_simdgroup(build, tmp_path, features, label):
    case = make_case(q_lens=[20, 81], seq_lens=[260, 150], num_heads=2, num_kv_heads=1, head_size=64,
                     block_size=16, dtype="float16", seed=3, label=f"sim {label}", **features)
    assert_close_to_oracle(_simulate(build, case, tmp_path), case.oracle(), "float16", label=case.label)


def test_nan_contract_on_a_simulated_simdgroup(build, tmp_path):
    # A NaN V element at a key the diagonal tile holds but earlier rows of the simdgroup do not attend,
    # +inf in K at an attended position, NaN in q: exactly the pairs the oracle marks are non-finite.
    case = make_case(q_lens=[40, 20], seq_lens=[40, 300], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype="float16", seed=11, label="sim nan contract",
                     poison=[("v", 0, 30, 1, float("nan")), ("k", 1, 100, 0, float("inf")),
                             ("q", 1, 3, 2, float("nan"))])
    got = _simulate(build, case, tmp_path)
    assert_close_to_oracle(got, case.oracle(), "float16", label=case.label)
    assert not np.isfinite(got).all()


def _lanes_of_row(row_of) -> dict[int, set[int]]:
    rows: dict[int, set[int]] = {}
    for lane in range(32):
        rows.setdefault(row_of(lane), set()).add(lane)
    return rows


def test_row_reductions_follow_the_nax_layout_not_a_prelude_fragment():
    """The NAX layout (Apple's, on both GPUs) puts a row on lanes that differ in bits 0 and 3, so
    its reductions are nax_layout.h's own. The CUDA prelude's `ma_frag_row_*` reduce over bits 0
    and 1 (the mma.sync layout): using them in the NAX kernel made the CUDA twin's H200 tests fail
    (2026-12-01) while the Metal check and this simulation still passed."""
    nax_row = lambda lane: ((lane >> 2) & 4) | ((lane >> 1) & 3)  # noqa: E731  (nax_layout.h, ma_nax_row)
    cuda_frag_row = lambda lane: lane >> 2  # noqa: E731  (prelude_cuda.h, ma_frag_row)
    for lanes in _lanes_of_row(nax_row).values():
        assert lanes == {min(lanes) ^ x for x in (0, 1, 8, 9)}
    assert any({min(ls) ^ x for x in (0, 1, 8, 9)} != ls for ls in _lanes_of_row(cuda_frag_row).values())
    layout = (kernels_dir() / "nax_layout.h").read_text()
    assert "ma_nax_row(int lane) { return ((lane >> 2) & 4) | ((lane >> 1) & 3); }" in layout
    assert "simd_shuffle_xor(x, ushort(1))" in layout and "simd_shuffle_xor(x, ushort(8))" in layout
    text = (kernels_dir() / "nax_prefill.metal").read_text()
    assert "ma_frag_row_" not in text, "nax_prefill.metal must reduce rows with ma_nax_row_max / ma_nax_row_sum"
    assert "ma_nax_row_max(" in text and "ma_nax_row_sum(" in text
