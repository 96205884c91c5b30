"""The run-time translation units of CUDA chains (`metal_attn.cuda_ops`) under NVRTC, on any machine:
`metal_attn.cuda_check --nvrtc` compiles the specializations the chains would build, with NVRTC's
options, and fails a planted error. Needs a libnvrtc and the CUDA headers, which the
``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime`` and ``nvidia-cuda-cccl`` wheels provide (CI installs
them); skipped with that reason where they are missing."""

from __future__ import annotations

import pytest

from metal_attn import cuda_check, cuda_ops

NVRTC = cuda_check.find_nvrtc()

pytestmark = pytest.mark.skipif(
    NVRTC is None or not cuda_ops.cuda_include_dirs(),
    reason="no libnvrtc or CUDA headers here (pip install nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-cccl)",
)

#: The per-token kernel's three paths and the reducer (what chains run), and the other kernels' texts.
#: Each split per-token pattern takes its fused-reducer variant (`PA_FUSED`) too; the matrix pattern its A/B
#: layouts (swizzled rows by default; rows padded by 16 bytes and by 32); the reducer at each of its partition
#: slice counts; sdpa_prefill's chained kernels (gather_kv, first_flagged, sdpa_finish).
SAMPLE = ("paged_attention_v2_reduce bfloat16 h128|paged_attention bfloat16 h128 g4 split=1.*matrix"
          "|paged_attention float32 h128 g4 split=0.*staged|paged_attention float16 h64 g2 split=1.*direct"
          "|tiled_prefill bfloat16 h128|gqa_decode float16 32/8/128/bs16 P512"
          "|gather_kv bfloat16 h128|sdpa_finish bfloat16 h128|first_flagged")


def test_the_runtime_sources_compile_with_nvrtc(capsys):
    assert cuda_check.main(["--nvrtc", NVRTC, "--only", SAMPLE, "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "22 CUDA sources, 0 failed (NVRTC" in out and "--device-as-default-execution-space" in out


def test_nvrtc_without_a_path_takes_the_setting_then_the_wheel(monkeypatch, capsys):
    """``--nvrtc`` alone loads METAL_ATTN_NVRTC's library, else the wheel's; with neither it is a usage error."""
    from metal_attn import override_settings

    with override_settings(nvrtc=NVRTC):
        assert cuda_check.main(["--nvrtc", "--only", "first_flagged", "--jobs", "1"]) == 0
    assert f"(NVRTC {NVRTC}," in capsys.readouterr().out
    monkeypatch.setattr(cuda_check, "find_nvrtc", lambda: None)
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--nvrtc", "--only", "first_flagged"])
    assert exc.value.code == 2 and "--nvrtc without a path: METAL_ATTN_NVRTC is unset" in capsys.readouterr().err


def test_a_planted_error_fails_under_nvrtc(planted_kernels, seq_line, capsys):
    folder = planted_kernels("pagedattention.metal", seq_line, seq_line + "\n  undeclared_name += 1;")
    rc = cuda_check.main(["--nvrtc", NVRTC, "--only", "paged_attention float16 h64 g2 split=1", "--kernels-dir",
                          str(folder)])
    assert rc == 1
    captured = capsys.readouterr()
    assert "FAILED paged_attention float16 h64 g2 split=1" in captured.err and "undeclared_name" in captured.err
    # The message names the kernel file's own line (kernels.assemble's #line directives).
    text = (folder / "pagedattention.metal").read_text()
    line = text[:text.index("undeclared_name")].count("\n") + 1
    assert f"kernels_v2/pagedattention.metal({line}): error" in captured.err, captured.err
