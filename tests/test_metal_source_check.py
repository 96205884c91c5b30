"""The Metal source check: generated MSL of every classic specialization type-checks with clang,
and the check fails on planted errors (so it is a check that can fail). How the sets are gathered
from the providers: tests/test_source_sets.py.

What this proves and what it does not: see metal_attn/msl_check.py and kernels_v2/README.md.
"""

from __future__ import annotations

import pytest

from metal_attn import msl_check

pytestmark = pytest.mark.usefixtures("needs_clang")


def test_every_classic_specialization_type_checks():
    from metal_attn.plugins import get_registry

    specs = get_registry().get("classic").msl_specializations()
    result = msl_check.check(providers=["classic"])
    assert result.ok, result.summary()
    assert result.count == len(specs)
    # dtypes x heads x blocks x {unsplit, split} x {direct, staged loads}, plus the matrix path for the
    # two 16-bit dtypes at the five head sizes that are multiples of 32; a reducer per (dtype, head), and
    # per head in float16 one with 8 partition slices; a cache writer per dtype
    assert sum(" mma" in s.label for s in specs) == 2 * 5 * 3 * 2
    assert sum(s.label.endswith(" slices=8") for s in specs) == 7
    assert result.count == 3 * 7 * 3 * 2 * 2 + 2 * 5 * 3 * 2 + 3 * 7 + 7 + 3


def test_generated_source_is_mlx_signature_plus_our_text():
    src = msl_check.generate_msl(only=r"^paged_attention split=1 bfloat16 head=80 block=8$")
    (_label, text), = src.items()
    assert "[[kernel]] void custom_kernel_ma_paged_attention_" in text  # MLX's generated signature
    assert "device float* tmp_out" in text and "const device bfloat16_t* k_cache" in text
    assert "#define PA_SPLIT 1" in text and "#define MA_LOG2E" in text  # generated defines
    assert "template [[host_name(" in text  # the explicit instantiation we keep
    clang_text = msl_check.to_clang(text)
    assert "[[" not in clang_text and "template  decltype(" in clang_text


ONLY = r"^paged_attention split=0 float16 head=128 block=16$"


def test_planted_undeclared_name_fails(planted_kernels, seq_line):
    d = planted_kernels("pagedattention.metal", seq_line,
                        seq_line.replace("qtok);", "qtok) + not_declared_anywhere;"))
    result = msl_check.check(only=ONLY, kernels_dir=d)
    assert not result.ok
    assert any("not_declared_anywhere" in e for e in result.errors), result.summary()
    assert all(e.startswith("[paged_attention split=0 float16 head=128 block=16]") for e in result.errors)
    # The error names the kernel file's own line (kernels.assemble's #line directives), not a line of
    # the check's deleted translation unit.
    text = (d / "pagedattention.metal").read_text()
    line = text[:text.index("not_declared_anywhere")].count("\n") + 1
    assert any(f"] kernels_v2/pagedattention.metal:{line}: " in e for e in result.errors), result.summary()


def test_an_error_in_a_header_names_its_file_and_line(planted_kernels):
    d = planted_kernels("paged_common.h", "metal::tanh(", "metal::tanhh(")
    text = (d / "paged_common.h").read_text()
    line = text[:text.index("tanhh")].count("\n") + 1
    result = msl_check.check(only=ONLY, kernels_dir=d)
    assert not result.ok
    assert result.errors[0].startswith(f"[{ONLY[1:-1]}] kernels_v2/paged_common.h:{line}: "), result.summary()


def test_a_macro_of_one_source_does_not_reach_another(planted_kernels):
    """Every source is checked after #undef of every macro an earlier one defined: a kernel using a macro only
    another kernel defines (PA_SPLIT, the per-token kernel's variant define) fails as it would alone (and on
    Metal), not only when checked without the other."""
    d = planted_kernels("sdpa_finish.metal", "const int seq_len = params[0];",
                        "const int seq_len = params[0] + PA_SPLIT * 0;")
    result = msl_check.check(providers=["classic", "sdpa_prefill"], only=rf"{ONLY}|^first_flagged$", kernels_dir=d)
    assert result.count == 2 and not result.ok, result.summary()
    assert all(e.startswith("[first_flagged] kernels_v2/sdpa_finish.metal:") and "'PA_SPLIT'" in e
               for e in result.errors), result.summary()


def test_the_shim_comes_from_the_kernels_dir(planted_kernels):
    """--kernels-dir / kernels_dir= checks against that folder's msl_shim.h too, not the package's."""
    d = planted_kernels("msl_shim.h", "float exp2(float);\nfloat tanh", "float tanh")
    result = msl_check.check(only=ONLY, kernels_dir=d)
    assert not result.ok and any("'exp2'" in e for e in result.errors), result.summary()


def test_as_type_needs_equal_sizes(planted_kernels):
    """Metal's as_type reinterprets bits of the same size; the shim's asserts it (it took any pair)."""
    d = planted_kernels("prelude_metal.h", "as_type<float>(0x7fc00000u)", "as_type<float>(ushort(0x7fc0))")
    result = msl_check.check(only=ONLY, kernels_dir=d)
    assert not result.ok, result.summary()
    assert any(e.startswith(f"[{ONLY[1:-1]}] msl_shim.h:") and "as_type" in e for e in result.errors), \
        result.summary()


def test_main_leaves_the_loaders_source_folder_as_it_was(planted_kernels, seq_line, capsys):
    from metal_attn import kernels

    d = planted_kernels("pagedattention.metal", seq_line, seq_line)
    before = kernels._source_dir
    assert msl_check.main(["--kernels-dir", str(d), "--only", r"^reshape_and_cache float16$"]) == 0
    assert kernels._source_dir == before
    assert "1 specializations type-check" in capsys.readouterr().out


def test_planted_type_mismatch_fails(planted_kernels):
    # A dependent-type error (T* vs float*): only an instantiated template reveals it.
    d = planted_kernels("pagedattention.metal", "float q_reg[HPW][E];",
                        "device float* wrong = k_cache;\nfloat q_reg[HPW][E];")
    result = msl_check.check(only=ONLY, kernels_dir=d)
    assert not result.ok
    assert any("cannot initialize" in e or "incompatible" in e for e in result.errors), result.summary()


def test_unplanted_copy_passes(planted_kernels, seq_line):
    d = planted_kernels("pagedattention.metal", seq_line, seq_line)
    assert msl_check.check(only=ONLY, kernels_dir=d).ok


def test_planted_error_on_the_matrix_path_fails(planted_kernels):
    # The matrix path is its own code under PA_MMA: the check must instantiate it too.
    d = planted_kernels("pagedattention.metal", "ma_mma_p<T>(ofr[d + x], pf, vb[x]);",
                        "ma_mma_p<T>(ofr[d + x], pf, vb_not_declared[x]);")
    result = msl_check.check(only=r"paged_attention split=1 bfloat16 head=128 block=16", kernels_dir=d)
    assert not result.ok
    assert any("vb_not_declared" in e for e in result.errors), result.summary()
    assert all(" mma]" in e.split("line")[0] for e in result.errors), result.summary()
