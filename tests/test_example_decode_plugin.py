"""The second example package (``examples/decode_provider``), installed for real: a decode provider
ranked above the built-in ``classic`` provider, written from the README alone.

CI installs it next to the first example (`.ci/run`), which is what proves the rest of the suite
hermetic: with this plugin loaded, ``classic`` no longer takes decode batches, yet every built-in
test passes (tests/conftest.py loads third-party plugins only for the tests about them). These
tests check that it arrives through the entry point with its distribution and version, that its
priority wins against the built-ins exactly as the README says, that it refuses with its reasons,
that the deny-list removes it, and that it passes the conformance suite. Where the package is not
installed, the module is skipped with that reason (in CI it must be installed).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

import metal_attn
from metal_attn.cli import main
from metal_attn.settings import override_settings

DIST = "metal-attn-example-decode"
PLUGIN = "example_decode"
NAME = "example_gather_decode"

try:
    VERSION = md.version(DIST)
except md.PackageNotFoundError:
    if os.environ.get("CI"):
        raise RuntimeError(f"{DIST} must be installed in CI (.ci/run installs it from examples/)") from None
    pytest.skip(f"{DIST} is not installed (install it with: pip install ./examples/decode_provider; .ci/run does)",
                allow_module_level=True)

from metal_attn.testing import (  # noqa: E402 - after the skip, like the package import it guards
    CONFORMANCE_SPECS,
    admission_reasons,
    check_case,
    conformance_ids,
    make_case,
)

pytestmark = pytest.mark.usefixtures("restore_logging", "third_party_plugins")
SMALL = dict(num_heads=8, num_kv_heads=2, head_size=64)


def test_listed_with_distribution_version_and_priority(capsys):
    assert main(["providers", "--json"]) == 0
    rows = {p["name"]: p for p in json.loads(capsys.readouterr().out)["providers"]}
    row = rows[NAME]
    assert (row["distribution"], row["version"], row["plugin"]) == (DIST, VERSION, PLUGIN)
    assert row["phases"] == ["decode"] and row["available"] is True
    assert rows["classic"]["priority_here"] < row["priority_here"] == 20


def test_it_takes_decode_batches_from_classic_and_nothing_else():
    """The README's rule: a provider is asked before the built-ins whose priority (on this backend)
    is lower; classic is 10 everywhere, so at 20 this one wins every decode batch it admits."""
    decode = metal_attn.explain(q_lens=[1] * 4, seq_lens=[100, 30, 7, 512], **SMALL)
    assert decode.chosen.name == NAME
    classic = next(r for r in decode.rows if r.name == "classic")
    assert classic.admitted and not classic.chosen
    prefill = metal_attn.explain(q_lens=[16], seq_lens=[16], **SMALL)
    row = next(r for r in prefill.rows if r.name == NAME)
    assert "phase=prefill (supported: decode)" in row.reasons and prefill.chosen.name != NAME
    big = metal_attn.explain(q_lens=[1] * 64, seq_lens=[8192] * 64, **SMALL)
    row = next(r for r in big.rows if r.name == NAME)
    assert any(r.startswith("num_seqs*max_seq_len*num_kv_heads*head_size=67108864 (supported: <= 16777216")
               for r in row.reasons), row.reasons
    assert big.chosen.name == "classic"


def test_denied_by_name_in_a_fresh_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")}
    env["METAL_ATTN_PLUGINS_DENY"] = PLUGIN
    proc = subprocess.run([sys.executable, "-m", "metal_attn", "providers", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {p["name"] for p in json.loads(proc.stdout)["providers"]}
    assert NAME not in names and "classic" in names
    with override_settings(plugins_deny=(PLUGIN,)):
        assert NAME not in {p["name"] for p in metal_attn.providers()}


_CONFORMANCE = [s for s in CONFORMANCE_SPECS if not s["label"].startswith("long-")]


@pytest.mark.parametrize("spec", _CONFORMANCE, ids=conformance_ids(_CONFORMANCE))
def test_conformance(spec):
    reasons = admission_reasons(spec, provider=NAME)
    if reasons:
        pytest.skip(f"{NAME}: " + "; ".join(reasons))
    record = check_case(make_case(**spec), provider=NAME)
    assert (record.provider, record.route) == (NAME, "example_gather_decode")


def test_conformance_admits_every_decode_spec():
    decode = [s for s in _CONFORMANCE if all(q == 1 for q in s["q_lens"])]
    refused = {s["label"]: admission_reasons(s, provider=NAME) for s in decode}
    assert {k: v for k, v in refused.items() if v} == {}
    assert len(decode) >= 20 and any(s.get("poison") for s in decode)
