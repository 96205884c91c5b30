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
from metal_attn.errors import KernelCompileError
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


def test_a_digit_separator_opens_no_character_literal():
    # 1'024 is one number (C++14): its quote must not start a literal that hides the comment after it
    # (and, across lines, would keep comments until the next quote).
    text = "constexpr int N = 1'024; // it's big\nint after; // gone\nchar c = u8'x'; // too\n"
    assert strip_comments(text) == "constexpr int N = 1'024;\nint after;\nchar c = u8'x';\n"


def test_a_backslash_continued_line_comment_is_kept():
    # C joins the next line into such a comment: dropping the comment would make that line code.
    text = "int a; // continued \\\nint not_code;\nint b;\n"
    assert strip_comments(text) == text


def test_assembled_kernels_carry_no_comments_and_keep_their_lines():
    header, body = kernels.assemble("paged_attention", gc.PAGED_FILES, "cuda",
                                    {"PA_SPLIT": 1, "PA_STAGED": 1, "PA_MMA": 1})
    raw_body = kernels.sections("pagedattention.metal")["paged_attention"]
    directive, rest = body.split("\n", 1)
    assert directive == '#line 9 "kernels_v2/pagedattention.metal"'  # the section's first line
    assert rest.count("\n") == raw_body.count("\n")
    assert rest == strip_comments(raw_body)
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


# -- sections, parts and line numbers ----------------------------------------------------------------


@pytest.fixture
def kernel_folder(tmp_path):
    """``folder(**files)``: kernels_v2 plus ``files`` (name -> text) in ``tmp_path``, the loader reading
    from it for the test."""
    import shutil

    def make(**files: str):
        for f in kernels_dir().iterdir():
            if f.is_file():
                shutil.copy(f, tmp_path / f.name)
        for name, text in files.items():
            (tmp_path / name.replace("_dot_", ".")).write_text(text)
        kernels.use_source_dir(tmp_path)
        return tmp_path

    yield make
    kernels.use_source_dir(None)


@pytest.mark.parametrize(("text", "error"), [
    ("// @kernel foo\nint a;\n// @kernel foo\nint b;\n",
     r"'x.metal' line 3: `// @kernel foo` again \(its first section starts at line 1; allowed: each kernel name once"),
    ("// @kernel foo\nint a;\n// @kernel bar (the reducer)\nint b;\n",
     r"'x.metal' line 3: '// @kernel bar \(the reducer\)' is not a section marker \(allowed: `// @kernel NAME`"),
    ("// @kernel foo\nint a;\n  // @kernel bar\nint b;\n", r"'x.metal' line 3: '// @kernel bar' is not a section"),
    ("// @kernel foo\nint a;\n// @kernel bar-v2\nint b;\n", r"'x.metal' line 3: '// @kernel bar-v2' is not a section"),
    ("// about it\n\nconstexpr int SHARED = 3;\n// @kernel foo\nint a = SHARED;\n",
     r"'x.metal' line 3: code before the first `// @kernel` line, which no kernel gets \(allowed: comments"),
    ("// @kernel foo\nint a;\n/* an example:\n// @kernel bar\n*/\nint b;\n",
     r"'x.metal' line 4: '// @kernel bar' inside a /\* \*/ comment"),
    ("int whole_file;\n", r"'x.metal' has no `// @kernel NAME` line \(allowed: a body file holds one or more"),
], ids=["duplicate", "words after", "indented", "not an identifier", "code before", "in a block comment",
        "no sections"])
def test_a_malformed_section_file_is_an_error_naming_file_and_line(kernel_folder, text, error):
    """Each of these changed a kernel's text without a word: the second body won, the near miss became
    part of the kernel before it, the code before the first marker vanished, the comment was split,
    and a file without markers was any kernel's body."""
    kernel_folder(x_dot_metal=text)
    with pytest.raises(KernelCompileError, match=error):
        kernels.sections("x.metal")
    with pytest.raises(KernelCompileError, match=error):
        kernels.assemble("foo", ["x.metal"], "metal")


def test_a_missing_kernel_names_the_files_kernels(kernel_folder):
    kernel_folder(x_dot_metal="// @kernel foo\nint a;\n// @kernel bar\nint b;\n")
    with pytest.raises(KernelCompileError, match=r"kernel 'baz' not found in x.metal \(their kernels: foo, bar\)"):
        kernels.assemble("baz", ["x.metal"], "metal")


def test_a_part_without_a_final_newline_does_not_run_into_the_next(kernel_folder):
    kernel_folder(a_dot_h="MA_FUNC int helper_a() { return 1; }  // the end of a.h",
                  b_dot_h="MA_FUNC int helper_b() { return 2; }\n",
                  k_dot_metal="// @kernel k\nout[0] = helper_a() + helper_b();")
    header, body = kernels.assemble("k", ["a.h", "b.h", "k.metal"], "metal")
    assert "MA_FUNC int helper_a() { return 1; }\n#line 1 \"kernels_v2/b.h\"\nMA_FUNC int helper_b()" in header
    assert body == '#line 2 "kernels_v2/k.metal"\nout[0] = helper_a() + helper_b();\n'


def _every_assembly():
    from metal_attn.cuda_check import cuda_sources
    from metal_attn.msl_check import registered_specializations

    for s in registered_specializations():
        yield s.kernel, s.source_files, "metal", s.defines
    for s in cuda_sources():
        yield s.kernel, s.source_files, "cuda", s.defines


def test_every_line_of_every_assembled_kernel_is_its_files_line():
    """Each part starts with ``#line N "kernels_v2/FILE"`` and then holds FILE's lines from N on, comments
    stripped: a compiler message (Metal's, NVRTC's, the checks') names the kernel file's own line. Every
    specialization the checks cover, both backends (so every kernels_v2 file still assembles)."""
    files: dict[str, list[str]] = {}
    seen = set()
    for name, source_files, backend, defines in _every_assembly():
        header, body = kernels.assemble(name, source_files, backend, dict(defines))
        parts = (header + body).split("#line ")[1:]
        assert len(parts) == 2 + sum(f.endswith(".h") for f in source_files) + 1
        for part in parts:
            first, rest = part.split("\n", 1)
            n, quoted = first.split(" ", 1)
            fname = quoted.strip('"')
            assert rest.endswith("\n")
            if fname == kernels.GENERATED_DEFINES:
                assert all(ln.startswith("#define ") for ln in rest.splitlines())
                continue
            assert fname.startswith("kernels_v2/")
            if fname not in files:
                files[fname] = strip_comments(kernels.read_source(fname.removeprefix("kernels_v2/"))).split("\n")
            start = int(n) - 1
            lines = rest[:-1].split("\n")
            assert lines == files[fname][start:start + len(lines)], (name, fname)
            seen.add(fname)
    assert {f.name for f in kernels_dir().iterdir() if f.suffix in (".h", ".metal")} - {"msl_shim.h"} == \
        {f.removeprefix("kernels_v2/") for f in seen}


def test_every_generated_define_is_used():
    """A generated define no kernel reads is noise in every kernel's text (MA_PARTITION_SIZE was one:
    the partition size is a template argument)."""
    texts = "".join(strip_comments(f.read_text()) for f in kernels_dir().iterdir() if f.suffix in (".h", ".metal"))
    for name in kernels.generated_defines():
        assert name in texts, f"{name} is generated but no kernel file uses it"


def test_kernel_objects_are_per_define_type():
    """1 and 1.0 are equal keys but two texts ("#define X 1" and "#define X 1.0"): two objects."""
    files = ("reshape_and_cache.metal",)
    a = kernels.load_kernel("reshape_and_cache", files, ("a",), ("o",), "metal", defines=(("MA_PROBE", 1),))
    b = kernels.load_kernel("reshape_and_cache", files, ("a",), ("o",), "metal", defines=(("MA_PROBE", 1.0),))
    c = kernels.load_kernel("reshape_and_cache", files, ("a",), ("o",), "metal", defines={"MA_PROBE": 1})
    assert a is not b and a is c
