"""The ``nax_prefill`` provider on the CPU: routing on M5, M4 and M3 presets, its hardware gate, the
disable switch, admission, the compile-failure fallback, and the checks of its two kernel texts.

- Routing through `metal_attn.explain` on hypothetical devices (the probe is never asked).
- The Metal source check (clang against ``kernels_v2/msl_shim.h``): every specialization passes and
  planted errors (an undeclared name, a wrong cooperative-tensor element type, wrong descriptor
  arguments) fail it.
- The CUDA twin compiles with nvcc for every specialization (skipped where nvcc is missing).
The twin's numerics run in tests/gpu/test_nax_gpu.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import metal_attn as ma
from metal_attn import msl_check
from metal_attn._layout import import_builtin_providers
from metal_attn.device import DeviceInfo
from metal_attn.errors import KernelCompileError
from metal_attn.settings import get_settings, override_settings
from metal_attn.testing.ulp import bit_patterns, ulp_distance, ulp_figures

import_builtin_providers()
from metal_attn.providers import nax_prefill as nx  # noqa: E402

M5_MAX = DeviceInfo.preset("m5-max")
M5 = DeviceInfo.preset("m5-10core")
M4 = DeviceInfo.preset("m4-max")
M3 = DeviceInfo.preset("m3-max")
M3_10 = DeviceInfo.preset("m3-10core")


def _explain(device, q_lens, seq_lens, *, heads=(32, 8, 128), dtype="bfloat16", block_size=16, **features):
    h, kvh, d = heads
    return ma.explain(q_lens=q_lens, seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d,
                      block_size=block_size, dtype=dtype, device=device, **features)


def _row(ex, name="nax_prefill"):
    return next(r for r in ex.rows if r.name == name)


def _reasons(ex, name="nax_prefill") -> str:
    return "\n".join(_row(ex, name).reasons)


# -- routing on the presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", (M5_MAX, M5), ids=("m5-max", "m5-10core"))
@pytest.mark.parametrize(("q_lens", "seq_lens", "phase"),
                         [([4096], [4096], "prefill"), ([64, 7], [1000, 7], "prefill"),
                          ([1, 1, 300], [500, 90, 800], "mixed")], ids=("prompt", "chunks", "mixed"))
def test_m5_chooses_nax_for_prefill_and_mixed(device, q_lens, seq_lens, phase):
    ex = _explain(device, q_lens, seq_lens)
    row = _row(ex)
    assert ex.request.phase.value == phase
    assert row.chosen, str(ex)
    assert row.plan.route == "nax_prefill" and row.plan.threadgroup == (128, 1, 1)
    assert any("BQ=64 query rows (4 simdgroups x 16), TILE_KV=32 keys, matmul2d 16x32x16" in n
               for n in row.plan.notes), row.plan.notes
    assert row.plan.specialization[:5] == ("nax_prefill", "metal", "bfloat16", 128, 16)


@pytest.mark.parametrize(("device", "arch", "gen"),
                         [(M4, "applegpu_g16s", 16), (M3, "applegpu_g15s", 15), (M3_10, "applegpu_g15g", 15)],
                         ids=("m4-max", "m3-max", "m3-10core"))
def test_m4_and_m3_say_why_not(device, arch, gen):
    ex = _explain(device, [4096], [4096])
    assert not _row(ex).admitted
    assert _reasons(ex) == (f"architecture={arch} (generation {gen}; supported: generation >= 17; "
                            "Apple M5-class tensor units)")
    assert ex.chosen.name == "tiled_prefill", str(ex)


@pytest.mark.parametrize(("arch", "admitted"),
                         [("applegpu_g17p", False), ("applegpu_g18p", True), ("applegpu_g17d", True),
                          ("applegpu_g18s", True), ("applegpu_g16p", False)])
def test_p_parts_need_generation_18(arch, admitted):
    ex = _explain(M5_MAX.replace(architecture=arch), [100], [100])
    assert _row(ex).admitted is admitted, str(ex)
    if not admitted:
        assert "supported: generation >= 18 for 'p' parts" in _reasons(ex)


@pytest.mark.parametrize(("version", "reason"),
                         [("26.2", None), ("26.3", None), ("27.0", None), ("26.1", "macos_version=26.1 (supported: "
                          ">= 26.2, Metal 4 tensor ops)"), ("15.6", "macos_version=15.6 (supported: >= 26.2"),
                          (None, "macos_version=None unknown (needs macOS >= 26.2")])
def test_macos_gate(version, reason):
    ex = _explain(M5_MAX.replace(macos_version=version), [100], [100])
    if reason is None:
        assert _row(ex).chosen, str(ex)
    else:
        assert reason in _reasons(ex) and ex.chosen.name == "tiled_prefill"


def test_unknown_architecture_fails_closed():
    ex = _explain(M5_MAX.replace(architecture=None), [100], [100])
    assert "architecture=None unknown (needs macOS >= 26.2 and GPU architecture generation >= 17" in _reasons(ex)


def test_macos_version_setting_overrides_the_probe():
    with override_settings(macos_version="15.6"):
        assert ma.current_device().macos_version == "15.6"
        assert ma.current_device().macos == (15, 6)
    with pytest.raises(ma.errors.SettingsError, match=r"macos_version=.twenty-six."):
        with override_settings(macos_version="twenty-six"):
            pass


def test_never_pure_decode_or_verify():
    decode = _explain(M5_MAX, [1, 1], [500, 600])
    assert "phase=decode (supported: mixed, prefill)" in _reasons(decode)
    verify = _explain(M5_MAX, [4, 4], [90, 300])
    assert "phase=verify (supported: mixed, prefill)" in _reasons(verify)
    assert verify.chosen.name == "tiled_prefill"


def test_mixed_batch_split_as_the_tiled_provider():
    below = _row(_explain(M5_MAX, [1, 1, 300], [4095, 100, 800]))
    assert below.chosen and below.plan.route == "nax_prefill"
    assert any("4095 < MIXED_DECODE_MIN_CONTEXT[metal]=4096" in n for n in below.plan.notes)
    at = _row(_explain(M5_MAX, [1, 1, 300], [8192, 100, 800]))
    assert at.chosen and at.plan.route == "mixed_prefill_decode"
    assert any(n.startswith("decode rows: per_token_ps512") for n in at.plan.notes), at.plan.notes
    assert at.plan.partition_size == 512 and at.plan.specialization[-1].per_token[0] == "metal"
    with override_settings(disabled_providers=["classic"]):
        ride = _row(_explain(M5_MAX, [1, 1, 300], [8192, 100, 800]))
    assert ride.chosen and ride.plan.route == "nax_prefill"


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(dtype="float32"), "dtype=float32 (supported: bfloat16, float16)"),
    (dict(heads=(4, 2, 80)), "head_size=80 (supported: 64, 96, 128, 256, 512)"),
    (dict(heads=(4, 2, 192)), "head_size=192 (supported: 64, 96, 128, 256, 512)"),
    (dict(block_size=4), "block_size=4 (supported: 8, 16, 32)"),
])
def test_declarative_refusals(kwargs, needle):
    ex = _explain(M5_MAX, [40], [40], **kwargs)
    assert needle in _reasons(ex), str(ex)


@pytest.mark.parametrize("head", nx.HEAD_SIZES)
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("block", (8, 16, 32))
def test_every_specialization_is_admitted_with_every_feature(head, dtype, block):
    ex = _explain(M5_MAX, [40], [300], heads=(8, 2, head), dtype=dtype, block_size=block, sinks=True,
                  sliding_window=64, softcap=30.0)
    assert _row(ex).chosen, str(ex)


def test_head_512_goes_to_nax_only_on_an_m5():
    assert _explain(M5_MAX, [40], [40], heads=(8, 1, 512)).chosen.name == "nax_prefill"
    assert _explain(M4, [40], [40], heads=(8, 1, 512)).chosen.name not in ("nax_prefill", "tiled_prefill")


@pytest.mark.parametrize(("env", "value"), [("METAL_ATTN_DISABLE_NAX", "1"), ("VLLM_METAL_DISABLE_NAX", "true")])
def test_disable_switch_and_its_alias(monkeypatch, env, value):
    from metal_attn.settings import reload_settings

    monkeypatch.setenv(env, value)
    try:
        reload_settings()
        ex = _explain(M5_MAX, [100], [100])
        assert f"disabled by {env}={value}" in _reasons(ex)  # the variable and value the user set
        assert ex.chosen.name == "tiled_prefill"
    finally:
        monkeypatch.delenv(env)
        reload_settings()
    assert _explain(M5_MAX, [100], [100]).chosen.name == "nax_prefill"


def test_cuda_and_cpu_refuse():
    h200 = _explain(DeviceInfo.preset("h200"), [100], [100])
    assert _reasons(h200).startswith("backend=cuda: needs Apple M5-class tensor units (Metal 4 tensor ops)")
    assert "run_twin" in _reasons(h200)
    assert h200.chosen.name != "nax_prefill"
    cpu = _explain(DeviceInfo.preset("cpu-2core"), [100], [100])
    assert _reasons(cpu).startswith("backend=cpu (supported: metal, with macOS >= 26.2")


def test_compile_failure_is_a_recorded_fallback_to_the_tiled_kernel(monkeypatch):
    """A real (not hypothetical) M5: the NAX kernel's eager compile fails here (no Metal), which the
    registry records as a fallback; the next admitted provider is the tiled kernel."""
    from metal_attn.providers import tiled_prefill as tp

    from metal_attn.plugins import get_registry
    from metal_attn.request import AttentionRequest

    device = M5_MAX.replace(hypothetical=False)
    monkeypatch.setattr(nx.gc, "availability_reasons", lambda dev: [])
    monkeypatch.setattr(tp.TiledPrefillProvider, "availability_reasons", lambda self, dev: [])
    monkeypatch.setattr(tp.TiledPrefillProvider, "prepare", lambda self, plan, dev: None)
    request = AttentionRequest.from_lengths(q_lens=[100], seq_lens=[100], num_heads=4, num_kv_heads=2,
                                            head_size=128, block_size=16, dtype="bfloat16", backend="metal")
    registry = get_registry()
    registry.forget_selections()
    try:
        sel = registry.select(request, device, get_settings())
    finally:
        registry.forget_selections()
    assert sel.provider.name == "tiled_prefill"
    (name, reason), = sel.fallbacks
    assert name == "nax_prefill" and "failed to build" in reason, sel.fallbacks


def test_prepare_turns_a_failure_into_kernel_compile_error():
    plan = nx.make_plan(_explain(M5_MAX, [100], [100]).request, M5_MAX, get_settings(), kernel_backend="metal")
    with pytest.raises(KernelCompileError, match=r"nax_prefill \('nax_prefill', 'metal', 'bfloat16', 128, 16\)"):
        nx.prepare_plan(plan, M5_MAX.replace(hypothetical=False))


def test_run_twin_needs_cuda():
    with pytest.raises(RuntimeError, match=r"run_twin needs MLX's CUDA backend \(this process runs on backend="):
        nx.run_twin(None)


def test_launch_refuses_bad_geometry_before_any_kernel():
    import mlx.core as mx

    from metal_attn.metadata import AttentionMetadata

    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 3])
    q = mx.zeros((3, 4, 80), mx.bfloat16)
    kc = mx.zeros((1, 16, 2, 80), mx.bfloat16)
    with pytest.raises(ValueError, match=r"head_size=80, block_size=16 \(allowed: head_size in 64, 96, 128, 256, 512"):
        nx.launch(q, kc, kc, md, scale=1.0, sinks=None, sliding_window=None, softcap=None, backend="cuda")
    with pytest.raises(ValueError, match=r"backend='cpu' \(supported: cuda, metal\)"):
        nx.kernel_object("cpu")


@pytest.mark.usefixtures("restore_logging")  # the CLI configures logging
def test_explain_cli_on_m5_and_m4(capsys):
    from metal_attn.cli import main

    assert main(["explain", "--q-lens", "1,300", "--seq-lens", "500,300", "--heads", "32", "--kv-heads", "8",
                 "--device", "m5-max", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == "nax_prefill", out
    assert main(["explain", "--q-lens", "300", "--seq-lens", "300", "--heads", "32", "--kv-heads", "8",
                 "--device", "m4-max", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == "tiled_prefill"
    nax = next(r for r in out["providers"] if r["name"] == "nax_prefill")
    assert nax["reasons"] == ["architecture=applegpu_g16s (generation 16; supported: generation >= 17; "
                              "Apple M5-class tensor units)"]


# -- the ULP helper of the GPU comparison --------------------------------------------------------------------


def test_ulp_distance_counts_representable_values():
    one = np.array([1.0])
    for dtype, eps, tiny in (("float16", 2.0**-10, 2.0**-24), ("bfloat16", 2.0**-7, 2.0**-133)):
        assert ulp_distance(one, one + eps, dtype)[0] == 1
        assert ulp_distance(one, one + 2 * eps, dtype)[0] == 2
        assert ulp_distance(-one, -one - 3 * eps, dtype)[0] == 3
        assert ulp_distance(np.array([0.0]), np.array([-0.0]), dtype)[0] == 0
        assert ulp_distance(np.array([tiny]), np.array([-tiny]), dtype)[0] == 2
    assert bit_patterns(np.array([1.0]), "bfloat16")[0] == 0x3F80
    assert bit_patterns(np.array([1.0]), "float16")[0] == 0x3C00
    assert ulp_figures(np.array([1.0, np.nan, 2.0]), np.array([1.0, 5.0, 2.0 + 2.0**-6]), "bfloat16") == (1, 0.5)
    with pytest.raises(ValueError, match=r"dtype='float32' \(supported: float16, bfloat16\)"):
        bit_patterns(one, "float32")


# -- the Metal source check ------------------------------------------------------------------------------------

_NAX = ["nax_prefill"]
_ONE = r"^nax_prefill float16 head=64 block=8$"


def test_msl_specializations_cover_every_choice():
    labels = {s.label for s in nx.NaxPrefillProvider().msl_specializations()}
    assert labels == {f"nax_prefill {d} head={h} block={b}" for d in ("float16", "bfloat16")
                      for h in (64, 96, 128, 256, 512) for b in (8, 16, 32)}


@pytest.mark.usefixtures("needs_clang")
def test_every_nax_specialization_type_checks():
    result = msl_check.check(providers=_NAX)
    assert result.ok, result.summary()
    assert result.count == 2 * 5 * 3


@pytest.mark.usefixtures("needs_clang")
def test_generated_source_uses_the_tensor_ops():
    (text,) = msl_check.generate_msl(providers=_NAX, only=_ONE).values()
    assert "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>" in text
    assert "mpp::tensor_ops::matmul2d<qk_desc, metal::execution_simdgroup>" in text
    assert "#define MA_NAX_BQ 64" in text and "#define MA_NAX_TILE_KV 32" in text
    body = text.split("[[kernel]]", 1)[1].split(") {", 1)[1]
    assert re.search(r"^\s*threadgroup\s", body, re.MULTILINE) is None  # no threadgroup memory


_PLANTED = [
    ("qk_op.run(ct_q, ct_k, ct_s);", "qk_op.run(ct_q, ct_k, ct_s_not_declared);", "ct_s_not_declared"),
    ("get_left_input_cooperative_tensor<T, T, float>", "get_left_input_cooperative_tensor<int32_t, T, float>",
     "cooperative tensors: inputs half or bfloat16_t"),
    ("get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ct_p0)>",
     "get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ct_p0)>", None),
    ("16, 32, 16, false, true, true,", "16, 32, 8, false, true, true,", "the subset is the 16 x 32 x 16 descriptor"),
    ("16, 32, 16, false, false, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate",
     "16, 32, 16, false, false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate, true",
     "no matching constructor for initialization of 'mpp::tensor_ops::matmul2d_descriptor'"),
    ("16, 32, 16, false, true, true,", "16, 32, 16, true, true, true,", "does not transpose the left input"),
    ("qk_op.run(ct_q, ct_k, ct_s);", "qk_op.run(ct_k, ct_q, ct_s);", "no matching member function for call to 'run'"),
]


@pytest.mark.usefixtures("needs_clang")
@pytest.mark.parametrize(("old", "new", "needle"), _PLANTED,
                         ids=("undeclared-name", "element-type", "unplanted-copy", "descriptor-shape",
                              "descriptor-argument-order", "descriptor-transpose-left", "operand-order"))
def test_planted_errors_fail_the_check(planted_kernels, old, new, needle):
    folder = planted_kernels("nax_prefill.metal", old, new)
    result = msl_check.check(providers=_NAX, only=_ONE, kernels_dir=folder)
    if needle is None:  # the same text, copied: the check passes
        assert result.ok, result.summary()
        return
    assert not result.ok
    assert any(needle in e for e in result.errors), result.summary()


# -- the CUDA twin compiles (nvcc) --------------------------------------------------------------------------------


def _nvcc():
    from metal_attn import cuda_check

    nvcc = cuda_check.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed (the CUDA toolkit provides it; CI has none)")
    return nvcc


def test_cuda_sources_cover_every_specialization():
    sources = nx.NaxPrefillProvider().cuda_sources()
    labels = [s.label for s in sources]
    assert len(labels) == len(set(labels)) == 30
    assert all(s.source_files == nx.KERNEL_FILES["cuda"] for s in sources)


@pytest.mark.slow
def test_every_twin_specialization_compiles_with_nvcc(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from metal_attn import cuda_check

    nvcc = _nvcc()
    sources = nx.cuda_sources()
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(
            lambda s: cuda_check.compile_one(s, cuda_check.wrapped_source(s), str(tmp_path), nvcc, False), sources))
    failed = [(s.label, out[-2000:]) for s, rc, out in results if rc]
    assert not failed, failed


def test_twin_planted_error_fails_nvcc(planted_kernels, tmp_path):
    from metal_attn import cuda_check, kernels

    nvcc = _nvcc()
    folder = planted_kernels("nax_prefill.metal", "get_left_input_cooperative_tensor<T, T, float>",
                             "get_left_input_cooperative_tensor<int32_t, T, float>")
    src = next(s for s in nx.cuda_sources() if s.label == "nax_prefill twin float16 h64 bs8")
    kernels.use_source_dir(folder)
    try:
        text = cuda_check.wrapped_source(src)
    finally:
        kernels.use_source_dir(None)
    _, rc, out = cuda_check.compile_one(src, text, str(tmp_path), nvcc, False)
    assert rc != 0 and "cooperative tensors: inputs half or bfloat16" in out
