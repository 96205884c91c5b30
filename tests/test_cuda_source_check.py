"""The CUDA source check (`metal_attn.cuda_check`): nvcc compiles the CUDA specializations, and fails a
planted error. Needs nvcc (the CUDA toolkit): skipped with that reason where it is missing (CI has none;
the kernels run for real only in tests/gpu on a GPU)."""

from __future__ import annotations

import pytest

from metal_attn import cuda_check

pytestmark = pytest.mark.skipif(cuda_check.find_nvcc() is None,
                                reason="nvcc is not installed (the CUDA toolkit provides it; CI has none)")

#: One source per kernel and code path (the whole table: python -m metal_attn.cuda_check); the tiled
#: pattern takes its split-KV path and its short-chunk tile's split too; each split per-token pattern
#: takes its fused-reducer variant (`PA_FUSED`) too; the matrix pattern its A/B layouts (swizzled by default;
#: rows padded by 16 and by 32) and the keys-as-rows path (`PA_MMA 2`); the reducer at each of its partition
#: slice counts (`SLICE_COUNTS`); sdpa_prefill's three kernels (gather_kv, first_flagged, sdpa_finish).
SAMPLE = ("tiled_prefill bfloat16 h128|gqa_decode float16 32/8/128/bs16 P512|paged_attention_v2_reduce bfloat16 h128"
          "|paged_attention bfloat16 h128 g4 split=1.*matrix|paged_attention float32 h128 g4 split=0.*staged"
          "|paged_attention float16 h64 g2 split=1.*direct|gather_kv bfloat16 h128|sdpa_finish bfloat16 h128"
          "|first_flagged")


def test_every_path_compiles(capsys):
    assert cuda_check.main(["--only", SAMPLE, "--jobs", "2"]) == 0
    assert "22 CUDA sources, 0 failed" in capsys.readouterr().out


def test_a_planted_error_fails(planted_kernels, seq_line, capsys):
    folder = planted_kernels("pagedattention.metal", seq_line, seq_line + "\n  undeclared_name += 1;")
    assert cuda_check.main(["--only", "paged_attention float16 h64 g2 split=1", "--kernels-dir", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "FAILED paged_attention float16 h64 g2 split=1" in captured.err and "undeclared_name" in captured.err
    # The message names the kernel file's own line (kernels.assemble's #line directives).
    text = (folder / "pagedattention.metal").read_text()
    line = text[:text.index("undeclared_name")].count("\n") + 1
    assert f"kernels_v2/pagedattention.metal({line}): error" in captured.err, captured.err


ONE = "paged_attention bfloat16 h128 g4 split=1 .*2 in flight( fused)?$"  # the table's layout, both reducers


def test_a_change_that_generates_the_same_code_has_the_same_ptx(planted_kernels, capsys):
    """--same-ptx-as: a comment and a constant spelled another way give the same PTX (exit 0)."""
    folder = planted_kernels("pagedattention.metal", "constexpr int PITCH = HEAD_SIZE + STAGE_PAD / int(sizeof(T));",
                             "// spelled another way, the same value\n"
                             "constexpr int PITCH = STAGE_PAD / int(sizeof(T)) + HEAD_SIZE;")
    assert cuda_check.main(["--only", ONE, "--same-ptx-as", str(folder), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 CUDA sources compiled twice, 0 failed; 2 with the same PTX" in out and "DIFFERENT" not in out


def test_a_change_of_generated_code_is_different_ptx(planted_kernels, capsys):
    """--same-ptx-as: another row pitch in the other texts is other PTX (exit 1, the source named)."""
    folder = planted_kernels("pagedattention.metal", "constexpr int PITCH = HEAD_SIZE + STAGE_PAD / int(sizeof(T));",
                             "constexpr int PITCH = HEAD_SIZE + 2 * STAGE_PAD / int(sizeof(T));")
    assert cuda_check.main(["--only", ONE, "--same-ptx-as", str(folder), "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT PTX paged_attention bfloat16 h128 g4 split=1" in out and "2 different" in out


def test_same_ptx_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--same-ptx-as", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cuda_check.main(["--same-ptx-as", str(tmp_path), "--resources"])
    assert "goes without --nvrtc and --resources" in capsys.readouterr().err
