"""The third-party example package (``examples/third_party_provider``), installed for real.

CI installs it (`.ci/run`: ``pip install ./examples/third_party_provider``); these
tests then check that it arrives through the ``metal_attn.providers`` entry point
with its distribution and version, that the registry picks it when its priority
and admission say so, that it refuses with its reasons otherwise, that the
deny- and allow-lists remove it, and that it passes the conformance suite.
Where the package is not installed, the module is skipped with that reason.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn import diagnostics
from metal_attn.cli import main
from metal_attn.errors import ProviderRefusedError
from metal_attn.plugins import get_registry
from metal_attn.settings import override_settings

DIST = "metal-attn-example-provider"
PLUGIN = "example"
NAME = "example_dense_prefill"

try:
    VERSION = md.version(DIST)
except md.PackageNotFoundError:
    if os.environ.get("CI"):
        raise RuntimeError(f"{DIST} must be installed in CI (.ci/run installs it from examples/)") from None
    pytest.skip(
        f"{DIST} is not installed (install it with: pip install ./examples/third_party_provider; .ci/run does)",
        allow_module_level=True,
    )

from metal_attn.testing import (  # noqa: E402 - after the skip, like the package import it guards
    CONFORMANCE_SPECS,
    admission_reasons,
    attention_oracle,
    check_case,
    conformance_ids,
    make_case,
)

SMALL = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16)

# The suite loads no third-party plugin unless a test asks (tests/conftest.py): these do.
pytestmark = pytest.mark.usefixtures("restore_logging", "third_party_plugins")


def _only_example_and_reference():
    """Settings under which only the example and the reference provider compete."""
    others = tuple(e.provider.name for e in get_registry().entries if e.provider.name not in (NAME, "reference"))
    return override_settings(disabled_providers=others)


def _run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_entry_point_is_declared_by_the_distribution():
    eps = [ep for ep in md.distribution(DIST).entry_points if ep.group == "metal_attn.providers"]
    assert [(ep.name, ep.value) for ep in eps] == [(PLUGIN, "metal_attn_example")]


def test_listed_by_providers_command_with_distribution_and_version(capsys):
    code, out = _run_cli(capsys, "providers", "--json")
    assert code == 0
    rows = {p["name"]: p for p in json.loads(out)["providers"]}
    row = rows[NAME]
    assert row["distribution"] == DIST
    assert row["version"] == VERSION
    assert row["plugin"] == PLUGIN
    assert row["origin"] == f"{DIST} {VERSION} ({PLUGIN})"
    assert row["priority"] == 5 and row["priority"] > rows["reference"]["priority"]
    assert row["enabled"] is True and row["available"] is True and row["availability_reasons"] == []
    assert row["phases"] == ["prefill", "verify"]

    code, out = _run_cli(capsys, "providers")
    assert code == 0
    assert NAME in out and DIST in out


def _short_prefill(dtype=mx.float16):
    """Two prompts on a paged cache (one continuation chunk), written with reshape_and_cache."""
    cache = metal_attn.PagedKVCache(1, 16, SMALL["block_size"], SMALL["num_kv_heads"], SMALL["head_size"], dtype)
    cache.add_sequence("a")
    cache.add_sequence("b")
    rng = np.random.default_rng(7)
    first = cache.prepare_step([("a", 20)])  # the first chunk of "a"; the step below continues it
    k0 = mx.array(rng.standard_normal((20, 2, 64)).astype(np.float32)).astype(dtype)
    cache.write(0, k0, -k0, first.slot_mapping)
    plan = cache.prepare_step([("a", 13), ("b", 37)])
    n = plan.num_tokens
    k = mx.array(rng.standard_normal((n, 2, 64)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((n, 2, 64)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((n, 8, 64)).astype(np.float32)).astype(dtype)
    cache.write(0, k, v, plan.slot_mapping)
    return q, cache, plan


def test_selected_for_a_short_prefill_and_matches_the_oracle():
    q, cache, plan = _short_prefill()
    with _only_example_and_reference():
        out = metal_attn.paged_attention(q, *cache.pools(0), metadata=plan.metadata)
        mx.eval(out)
    rec = diagnostics.last_dispatch()
    assert (rec.provider, rec.route) == (NAME, "example_dense_prefill")
    assert plan.metadata.phase.value == "prefill"
    k_pool, v_pool = cache.pools(0)
    ref = attention_oracle(
        np.array(q.astype(mx.float32)), np.array(k_pool.astype(mx.float32)), np.array(v_pool.astype(mx.float32)),
        np.array(plan.metadata.block_tables), np.array(plan.metadata.seq_lens), np.array(plan.metadata.cu_seqlens_q),
        scale=64**-0.5,
    )
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 3e-3
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3


def test_explain_ranks_it_above_reference_and_chooses_it(capsys):
    with _only_example_and_reference():
        code, out = _run_cli(capsys, "explain", "--json", "--q-lens", "64,32", "--seq-lens", "64,32",
                             "--heads", "8", "--kv-heads", "2", "--head-size", "64")
    assert code == 0
    table = json.loads(out)
    assert table["chosen"] == NAME
    names = [r["name"] for r in table["providers"]]
    assert names.index(NAME) < names.index("reference")
    row = next(r for r in table["providers"] if r["name"] == NAME)
    assert row["origin"] == f"{DIST} {VERSION} ({PLUGIN})"
    assert row["plan"]["route"] == "example_dense_prefill"


def test_refused_with_its_reasons_for_long_context_and_decode():
    long_prefill = metal_attn.explain(q_lens=[64], seq_lens=[4096], **SMALL)
    row = next(r for r in long_prefill.rows if r.name == NAME)
    assert not row.admitted
    assert any(r.startswith("max_seq_len=4096 (supported: <= 1024") for r in row.reasons), row.reasons
    assert long_prefill.chosen is not None and long_prefill.chosen.name != NAME

    decode = metal_attn.explain(q_lens=[1, 1], seq_lens=[30, 40], **SMALL)
    row = next(r for r in decode.rows if r.name == NAME)
    assert "phase=decode (supported: prefill, verify)" in row.reasons

    softcap = metal_attn.explain(q_lens=[16], seq_lens=[16], softcap=2.0, **SMALL)
    row = next(r for r in softcap.rows if r.name == NAME)
    assert "softcap=2 (supported: none)" in row.reasons


def test_forcing_it_on_a_request_it_refuses_raises_its_reason():
    case = make_case(q_lens=[8], seq_lens=[1100], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype="float32", seed=3)
    with pytest.raises(ProviderRefusedError, match=r"max_seq_len=1100 \(supported: <= 1024"):
        metal_attn.paged_attention(**case.kwargs(), provider=NAME)


def test_removed_by_the_deny_list_and_an_empty_allow_list():
    def names():
        return {p["name"] for p in metal_attn.providers()}

    assert NAME in names()
    with override_settings(plugins_deny=(PLUGIN,)):
        assert NAME not in names() and "reference" in names()
    with override_settings(plugins_allow=()):
        assert NAME not in names() and "reference" in names()
    with override_settings(plugins_allow=(PLUGIN,)):
        assert NAME in names()
    with override_settings(plugin_autoload=False):
        assert NAME not in names()
    assert NAME in names()


@pytest.mark.parametrize(("variable", "value"), [("METAL_ATTN_PLUGINS_DENY", PLUGIN), ("METAL_ATTN_PLUGINS_ALLOW", "")])
def test_environment_variables_remove_it_in_a_fresh_process(tmp_path, variable, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")}
    env[variable] = value
    proc = subprocess.run([sys.executable, "-m", "metal_attn", "providers", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {p["name"] for p in json.loads(proc.stdout)["providers"]}
    assert NAME not in names and "reference" in names


_CONFORMANCE = [s for s in CONFORMANCE_SPECS if not s["label"].startswith("long-")]


@pytest.mark.parametrize("spec", _CONFORMANCE, ids=conformance_ids(_CONFORMANCE))
def test_conformance(spec):
    reasons = admission_reasons(spec, provider=NAME)
    if reasons:
        pytest.skip(f"{NAME}: " + "; ".join(reasons))
    record = check_case(make_case(**spec), provider=NAME)
    assert (record.provider, record.route) == (NAME, "example_dense_prefill")


def test_conformance_admits_a_real_share_of_the_suite():
    """The skips above are the support matrix; make sure it is not empty."""
    admitted = [s["label"] for s in _CONFORMANCE if not admission_reasons(s, provider=NAME)]
    assert len(admitted) >= 10, admitted
    assert {"prefill-single", "verify", "sinks-prefill", "window1-prefill"} <= set(admitted)
