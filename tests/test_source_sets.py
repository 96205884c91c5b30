"""The source checks' sets come from the registered providers (`Provider.msl_specializations`,
`Provider.cuda_sources`), never from a list of provider modules: a third-party provider installed
through the entry-point group contributes its entries to ``python -m metal_attn.msl_check`` and
``python -m metal_attn.cuda_check`` (in the check's child process too), each provider declares
exactly the entries it launches, and ``--provider`` restricts the checks to one provider."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from metal_attn import cuda_check, msl_check
from metal_attn.errors import ProviderRefusedError
from metal_attn.plugins import get_registry
from metal_attn.provider import Provider
from metal_attn.registry import Registry
from metal_attn.settings import override_settings
from metal_attn.source_sets import provider_sets

PLUGIN = "fake_kernels"
MODULE = "ma_fake_kernels_plugin"
#: The plugin's one entry per check: the shared reducer at a partition size no built-in set checks.
MSL_LABEL = "fake_kernels reducer float16 head=64 P256"
CUDA_LABEL = "fake_kernels reducer float16 h64 P256"
PLUGIN_SOURCE = f'''
import metal_attn as ma
from metal_attn.providers import gpu_common


class FakeKernels(ma.Provider):
    name = "{PLUGIN}"
    priority = 1
    backends = frozenset({{"metal", "cuda"}})

    def msl_specializations(self):
        return [gpu_common.reducer_msl_specialization("{MSL_LABEL}", "float16", 64, 256)]

    def cuda_sources(self):
        return [gpu_common.reducer_cuda_source("{CUDA_LABEL}", "float16", 64, 256)]


@ma.hookimpl
def metal_attn_register_providers(registrar):
    registrar.add(FakeKernels)
'''

#: What each built-in provider declares (unchanged by moving the sets into the providers).
BUILTIN_MSL = {"classic": 343, "gqa_decode": 28, "tiled_prefill": 29, "sdpa_prefill": 13, "nax_prefill": 30,
               "reference": 0}
BUILTIN_CUDA = {"classic": 169, "gqa_decode": 20, "tiled_prefill": 20, "sdpa_prefill": 13, "nax_prefill": 30,
                "reference": 0}


@pytest.fixture
def fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed third-party plugin (a module and its dist-info with the entry point) on the path
    of this process and of the checks' child processes, the only third-party plugin allowed."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    info = tmp_path / f"{MODULE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[metal_attn.providers]\n{PLUGIN} = {MODULE}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("METAL_ATTN_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("METAL_ATTN_PLUGINS_ALLOW", PLUGIN)
    with override_settings(plugin_autoload=True, plugins_allow=(PLUGIN,)):
        yield tmp_path


def test_each_builtin_provider_declares_its_own_sets():
    reg = get_registry()
    assert {e.provider.name: len(e.provider.msl_specializations()) for e in reg.entries} == BUILTIN_MSL
    assert {e.provider.name: len(e.provider.cuda_sources()) for e in reg.entries} == BUILTIN_CUDA
    assert len(msl_check.registered_specializations()) == sum(BUILTIN_MSL.values())
    assert len(cuda_check.cuda_sources()) == sum(BUILTIN_CUDA.values())
    # Restricting to one provider gives exactly its set, in its own order.
    classic = reg.get("classic")
    assert provider_sets("msl_specializations", ["classic"]) == classic.msl_specializations()
    assert cuda_check.cuda_sources(["gqa_decode"]) == reg.get("gqa_decode").cuda_sources()


def test_a_provider_without_kernels_declares_none():
    class NoKernels(Provider):
        name = "no_kernels"
        backends = frozenset({"cpu"})

    assert NoKernels().msl_specializations() == [] and NoKernels().cuda_sources() == []


def test_a_third_party_providers_set_is_gathered(fake_plugin):
    labels = [s.label for s in msl_check.registered_specializations()]
    assert MSL_LABEL in labels and len(labels) == sum(BUILTIN_MSL.values()) + 1
    assert [s.label for s in cuda_check.cuda_sources()].count(CUDA_LABEL) == 1
    assert [s.label for s in provider_sets("msl_specializations", [PLUGIN])] == [MSL_LABEL]


def test_msl_check_type_checks_a_third_party_providers_set(fake_plugin, needs_clang, capsys):
    # The child process builds its own registry: the plugin reaches it through the entry point.
    result = msl_check.check(providers=[PLUGIN])
    assert result.ok and result.count == 1, result.summary()
    assert msl_check.main(["--only", f"^{MSL_LABEL}$"]) == 0
    assert "MSL check: 1 specializations type-check" in capsys.readouterr().out


def test_msl_check_fails_a_third_party_set_on_a_planted_error(fake_plugin, needs_clang, planted_kernels):
    line = "const int use_sinks = params[3];"  # the reducer's, the file's only such line
    d = planted_kernels("pagedattention.metal", line, line + "\nundeclared_in_reducer += 1;")
    result = msl_check.check(providers=[PLUGIN], kernels_dir=d)
    assert not result.ok and any("undeclared_in_reducer" in e for e in result.errors), result.summary()
    assert all(e.startswith(f"[{MSL_LABEL}]") for e in result.errors), result.summary()


@pytest.mark.skipif(cuda_check.find_nvcc() is None, reason="nvcc is not installed (the CUDA toolkit provides it)")
def test_cuda_check_compiles_a_third_party_providers_set(fake_plugin, capsys):
    assert cuda_check.main(["--provider", PLUGIN, "--jobs", "1"]) == 0
    assert "1 CUDA sources, 0 failed" in capsys.readouterr().out


@pytest.fixture
def no_compilers(monkeypatch):
    """Neither clang++ nor nvcc here: the selection is a usage error all the same (it is checked first)."""
    monkeypatch.setenv("CLANGXX", "ma-no-such-clang++")
    monkeypatch.setattr(cuda_check, "find_nvcc", lambda: None)


def test_an_unknown_provider_is_refused_with_the_registered_ones(no_compilers, capsys):
    with pytest.raises(ProviderRefusedError, match=r"provider='nope' is not registered \(registered: .*classic"):
        provider_sets("cuda_sources", ["nope"])
    with pytest.raises(SystemExit) as exc:
        msl_check.main(["--provider", "nope"])
    assert exc.value.code == 2 and "provider='nope' is not registered" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--provider", "nope"])
    assert exc.value.code == 2 and "provider='nope' is not registered" in capsys.readouterr().err


@pytest.mark.parametrize("check", [msl_check, cuda_check], ids=["msl_check", "cuda_check"])
@pytest.mark.parametrize(("argv", "error"), [
    (["--only", "paged_atention"], r"--only 'paged_atention' matches none of the \d+ (Metal specializations|CUDA "
                                   r"sources) \(allowed: a regular expression over their labels, which start with "
                                   r"the kernel's name: .*paged_attention, paged_attention_v2_reduce"),
    (["--provider", "reference"], r"--provider 'reference': no (Metal specializations|CUDA sources) declared "
                                  r"\(providers that declare some: classic, gqa_decode, nax_prefill"),
    (["--only", "("], r"--only '\(': not a regular expression \(missing \)"),
], ids=["--only matches nothing", "--provider without sources", "--only not a regex"])
def test_an_empty_selection_is_a_usage_error(check, argv, error, no_compilers, capsys):
    """It printed "0 CUDA sources, 0 failed" and exited 0 (cuda_check), or a traceback (msl_check)."""
    with pytest.raises(SystemExit) as exc:
        check.main(argv)
    assert exc.value.code == 2
    assert re.search(error, capsys.readouterr().err)


@pytest.mark.parametrize(("spec", "error"), [
    ("nosuch_module_ma:fn", "ModuleNotFoundError: No module named 'nosuch_module_ma'"),
    ("metal_attn.msl_check:nosuch", "AttributeError: module 'metal_attn.msl_check' has no attribute 'nosuch'"),
])
def test_a_set_that_cannot_be_imported_is_a_usage_error(spec, error, no_compilers, capsys):
    """`--set nosuch:fn` printed the import's traceback and exited 1, as if the check had found errors."""
    with pytest.raises(SystemExit) as exc:
        msl_check.main(["--set", spec])
    assert exc.value.code == 2
    assert f"--set {spec!r}: {error} (allowed: module:function" in capsys.readouterr().err


def test_a_missing_compiler_is_a_message(no_compilers, capsys):
    assert msl_check.main(["--only", "^reshape_and_cache float16$"]) == 2
    assert ("msl_check: clang++ is not on PATH (CLANGXX='ma-no-such-clang++'; allowed: a clang++ executable"
            in capsys.readouterr().err)
    assert cuda_check.main(["--only", "^first_flagged$"]) == 2
    assert "cuda_check: nvcc is not on PATH" in capsys.readouterr().err


def test_the_readme_counts_are_the_providers():
    """kernels_v2/README.md's table of sources per provider and check, and its totals, are the providers'
    sets (they drifted: the README said 436 and 133 when the checks ran 443 and 252)."""
    from metal_attn._layout import kernels_dir

    readme = (kernels_dir() / "README.md").read_text()
    rows = {k: tuple(map(int, re.findall(r"\d+", line))) for k, line in
            re.findall(r"^\| `?(\w+)`? \|((?: \d+ \|){2})$", readme, re.MULTILINE)}
    reg = get_registry()
    actual = {e.provider.name: (len(e.provider.msl_specializations()), len(e.provider.cuda_sources()))
              for e in reg.entries}
    assert rows == {**actual, "total": tuple(map(sum, zip(*actual.values())))}


def test_the_readme_lists_every_template_argument_and_define():
    """kernels_v2/README.md's table of template arguments and variant defines per kernel is what the
    providers' sets pass (it missed PA_FUSED, PA_SWIZZLE, TP_KV_SERIAL, TP_SPLIT, STAGE_PAD and whole
    kernels), and each header's "used by" names every body file assembled with it."""
    from metal_attn._layout import kernels_dir

    readme = (kernels_dir() / "README.md").read_text()
    table = {m.group(1): (set(re.findall(r"`([A-Z_][A-Z0-9_]*)`", m.group(2))),
                          set(re.findall(r"`([A-Z_][A-Z0-9_]*)`", m.group(3))))
             for m in re.finditer(r"^\| `(\w+)` \|(.*)\|(.*)\|$", readme, re.MULTILINE)
             if not m.group(2).strip().isdigit()}  # not the table of counts
    used: dict[str, set[str]] = {}
    actual: dict[str, tuple[set, set]] = {}
    for entry in [*msl_check.registered_specializations(), *cuda_check.cuda_sources()]:
        targs, defs = actual.setdefault(entry.kernel, (set(), set()))
        targs.update(n for n, _ in entry.template)
        defs.update(n for n, _ in entry.defines)
        for header in (f for f in entry.source_files if f.endswith(".h")):
            used.setdefault(header, set()).update(f for f in entry.source_files if f.endswith(".metal"))
    assert set(table) == set(actual)
    for kernel, (targs, defs) in actual.items():
        listed_targs, listed_defs = table[kernel]
        assert targs <= listed_targs, f"{kernel}: template arguments {sorted(targs - listed_targs)} not in the README"
        assert defs <= listed_defs, f"{kernel}: defines {sorted(defs - listed_defs)} not in the README"
    rows = dict(re.findall(r"^\| `(\w+\.h)` \| .* \| (.*) \|$", readme, re.MULTILINE))
    for header, bodies in used.items():
        assert all(f"`{b}`" in rows[header] for b in bodies), (header, bodies, rows[header])


def test_set_and_provider_are_one_choice(capsys):
    with pytest.raises(SystemExit) as exc:
        msl_check.main(["--set", "metal_attn.msl_check:registered_specializations", "--provider", "classic"])
    assert exc.value.code == 2 and "--set and --provider" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"set_spec=.* with providers=\['classic'\]"):
        msl_check.generate_msl("metal_attn.msl_check:registered_specializations", providers=["classic"])


def test_a_label_declared_twice_is_refused():
    classic = get_registry().get("classic")
    taken = classic.cuda_sources()[0]

    class Copycat(Provider):
        name = "copycat"
        backends = frozenset({"cuda"})

        def cuda_sources(self):
            return [taken]

    reg = Registry()
    reg.add(classic)
    reg.add(Copycat())
    with pytest.raises(ValueError, match=rf"label='{taken.label}' of provider 'copycat' is already declared by "
                                         r"provider 'classic'"):
        provider_sets("cuda_sources", registry=reg)
    with pytest.raises(ValueError, match=r"kind='hip_sources' \(allowed: msl_specializations, cuda_sources\)"):
        provider_sets("hip_sources", registry=reg)


def test_set_option_still_names_a_function(needs_clang):
    result = msl_check.check("metal_attn.msl_check:registered_specializations",
                             only=r"^paged_attention_v2_reduce \(gqa\) float16 head=128 P256$")
    assert result.ok and result.count == 1, result.summary()


def test_a_provider_whose_source_list_is_none_is_named():
    """It raised a bare TypeError ('NoneType' object is not iterable) from the loop."""
    from metal_attn.provider import Provider
    from metal_attn.registry import Registry
    from metal_attn.source_sets import provider_sets

    class NoList(Provider):
        name = "no_list"
        backends = frozenset({"cpu"})

        def msl_specializations(self):
            return None

    reg = Registry()
    reg.add(NoList())
    with pytest.raises(ValueError, match=r"msl_specializations\(\) of provider 'no_list' returned None \(allowed: a "
                                         r"list of entries"):
        provider_sets("msl_specializations", registry=reg)
