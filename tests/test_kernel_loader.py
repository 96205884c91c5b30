"""The kernel loader's host side: the text handed to MLX has its comments stripped (MLX copies
the whole text on every call) and nothing else changed, line numbers kept; kernel objects are
kept, and dropped with their sources.

The oracle for "nothing else changed" is GCC's own comment removal (``g++ -fpreprocessed -E``:
comments out, directives kept, no macro expanded), compared token for token.
"""

from __future__ import annotations

import subprocess

import pytest
from metal_attn.providers import gpu_common as gc

from metal_attn import kernels
from metal_attn._layout import kernels_dir
from metal_attn.kernels import strip_comments


def test_line_and_block_comments_go_lines_stay():
    text = ("int a = 1;  // one\n"
            "/* two\n   lines */ int b = 2;\n"
            "int c = a/*x*/+b;\n"
            "// whole line\n"
            "int d;\n")
    out = strip_comments(text)
    assert out == "int a = 1;\n\n int b = 2;\nint c = a +b;\n\nint d;\n"
    assert out.count("\n") == text.count("\n")


def test_comment_markers_inside_literals_are_code():
    text = 'asm("mov %0; // not a comment /* nor this */" : "=r"(x));  // this is\nchar q = \'"\'; char s = \'/\';\n'
    out = strip_comments(text)
    assert out == 'asm("mov %0; // not a comment /* nor this */" : "=r"(x));\nchar q = \'"\'; char s = \'/\';\n'


def test_escaped_quotes_do_not_end_a_literal():
    text = 'const char* s = "a \\" // still the string";  // gone\n'
    assert strip_comments(text) == 'const char* s = "a \\" // still the string";\n'


def test_a_backslash_continued_line_comment_is_kept():
    # C joins the next line into such a comment: dropping the comment would make that line code.
    text = "int a; // continued \\\nint not_code;\nint b;\n"
    assert strip_comments(text) == text


def test_assembled_kernels_carry_no_comments_and_keep_their_lines():
    header, body = kernels.assemble("paged_attention", gc.PAGED_FILES, "cuda",
                                    {"PA_SPLIT": 1, "PA_STAGED": 1, "PA_MMA": 1})
    raw_body = kernels.sections("pagedattention.metal")["paged_attention"]
    assert body.count("\n") == raw_body.count("\n")
    assert body == strip_comments(raw_body)
    for text in (header, body):
        lines = [ln for ln in text.splitlines() if ln.lstrip().startswith(("//", "/*"))]
        assert lines == [], lines[:3]
    assert len(body) < 0.8 * len(raw_body)  # the point of it: the commented text is much longer


def _gcc_tokens(gxx: str, text: str, tmp_path) -> list[str]:
    src = tmp_path / "kernel.txt"
    src.write_text(text)
    out = subprocess.run([gxx, "-x", "c++", "-fpreprocessed", "-dD", "-E", "-P", str(src)],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize("filename", sorted(f.name for f in kernels_dir().iterdir() if f.suffix in (".h", ".metal")))
def test_every_kernel_file_loses_only_its_comments(filename, gxx, tmp_path):
    text = (kernels_dir() / filename).read_text()
    assert strip_comments(text).split() == _gcc_tokens(gxx, text, tmp_path)
    assert strip_comments(text).count("\n") == text.count("\n")


def test_kernel_objects_are_kept_and_follow_the_source_folder(planted_kernels, seq_line):
    """Kernel objects are kept per (backend, kernel, sources, defines). Launchers pass the defines as
    pairs, others as a mapping: both reach the same object. A new source folder (any
    `kernels.clear_cache`) drops them, or planted sources would run the old text."""
    geo = gc.geometry(128, "bfloat16", "metal", split=True)
    first = gc.per_token_kernel("metal", True, geo)
    reducer = gc.reducer_kernel("metal")
    assert gc.per_token_kernel("metal", True, geo) is first and gc.reducer_kernel("metal") is reducer
    as_mapping = kernels.load_kernel("paged_attention", gc.PAGED_FILES, gc.PA_INPUTS, gc.PA_OUTPUTS[1], "metal",
                                     defines=dict(gc.paged_defines(True, geo)))
    assert as_mapping is first
    kernels.use_source_dir(planted_kernels("pagedattention.metal", seq_line, seq_line))
    try:
        planted = gc.per_token_kernel("metal", True, geo)
        assert planted is not first and gc.reducer_kernel("metal") is not reducer
    finally:
        kernels.use_source_dir(None)
    assert gc.per_token_kernel("metal", True, geo) is not planted  # rebuilt from the package's text again
