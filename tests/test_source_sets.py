"""The source checks' sets come from the registered providers (`Provider.msl_specializations`,
`Provider.cuda_sources`), never from a list of provider modules: a third-party provider installed
through the entry-point group contributes its entries to ``python -m metal_attn.msl_check`` and
``python -m metal_attn.cuda_check`` (in the check's child process too), each provider declares
exactly the entries it launches, and ``--provider`` restricts the checks to one provider."""

from __future__ import annotations

import os
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


def test_an_unknown_provider_is_refused_with_the_registered_ones(capsys):
    with pytest.raises(ProviderRefusedError, match=r"provider='nope' is not registered \(registered: .*classic"):
        provider_sets("cuda_sources", ["nope"])
    with pytest.raises(SystemExit) as exc:
        msl_check.main(["--provider", "nope"])
    assert exc.value.code == 2 and "provider='nope' is not registered" in capsys.readouterr().err
    if cuda_check.find_nvcc() is not None:
        with pytest.raises(SystemExit) as exc:
            cuda_check.main(["--provider", "nope"])
        assert exc.value.code == 2 and "provider='nope' is not registered" in capsys.readouterr().err


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
