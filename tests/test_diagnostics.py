"""Diagnostics: the last dispatch, `collect()`, the history, and the upstream
spellings in `metal_attn.compat`.

Dispatches go through a registry of fake providers installed as the process
registry, so the recorded provider, route and partition size are known exactly.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn import compat, diagnostics, plugins
from metal_attn import settings as settings_mod
from metal_attn.hookspecs import hookimpl
from metal_attn.plugins import registry_from
from metal_attn.provider import Plan, Provider


class RouteProvider(Provider):
    """Admits float32 requests whose head size it lists; plans a fixed route and partition size."""

    backends = frozenset({"cpu"})
    dtypes = frozenset({"float32"})

    def __init__(self, name: str, priority: int, route: str, partition_size: int, head_sizes: tuple[int, ...]):
        self.name, self.priority, self.route, self.ps = name, priority, route, partition_size
        self.head_sizes = frozenset(head_sizes)

    def plan(self, request, device, settings) -> Plan:
        return Plan(self.name, self.route, self.ps, specialization=(request.head_size,))

    def run(self, inputs, plan):
        return mx.zeros(inputs.q.shape, dtype=inputs.q.dtype)


class Writer(Provider):
    name = "writer"
    priority = 0
    backends = frozenset({"cpu"})
    writes_cache = True

    def write_cache(self, key, value, k_cache, v_cache, slots, device):
        return k_cache, v_cache


class Plugin:
    @hookimpl
    def metal_attn_register_providers(self, registrar):
        registrar.add(RouteProvider("gqa", 20, "gqa_decode", 256, head_sizes=(64,)))
        registrar.add(RouteProvider("classic", 10, "per_token_ps512", 512, head_sizes=(64, 32)))
        registrar.add(Writer)


@pytest.fixture(autouse=True)
def registry(monkeypatch, clean_settings_env):
    plugins.reset_registry()
    reg = registry_from([Plugin()])
    monkeypatch.setitem(plugins._registries, plugins._plugin_key(settings_mod.get_settings()), reg)
    diagnostics.reset()
    yield reg
    diagnostics.reset()


def batch(head_size: int = 64, seq_lens=(40, 17)):
    nseq = len(seq_lens)
    q = mx.zeros((nseq, 4, head_size))
    pool = mx.zeros((8, 16, 2, head_size))
    table = np.arange(nseq * 3, dtype=np.int32).reshape(nseq, 3)
    md = ma.AttentionMetadata.build(table, np.array(seq_lens, np.int32), np.arange(nseq + 1, dtype=np.int32))
    return q, pool, pool, md


def test_nothing_recorded_before_the_first_dispatch():
    assert diagnostics.last_dispatch() is None
    assert diagnostics.last_cache_write() is None
    assert diagnostics.history() == []
    assert compat.last_paged_dispatch() is None
    assert compat.last_gqa_partition_size() is None


def test_last_dispatch_records_provider_route_partition_backend_and_request():
    q, k, v, md = batch()
    ma.paged_attention(q, k, v, metadata=md)
    rec = diagnostics.last_dispatch()
    assert (rec.op, rec.provider, rec.route, rec.partition_size, rec.backend, rec.fallbacks) == (
        "paged_attention",
        "gqa",
        "gqa_decode",
        256,
        "cpu",
        (),
    )
    assert rec.request == ma.AttentionRequest.from_lengths(
        q_lens=[1, 1], seq_lens=[40, 17], dtype="float32", num_heads=4, num_kv_heads=2, head_size=64
    )
    q2, k2, v2, md2 = batch(head_size=32)
    ma.paged_attention(q2, k2, v2, metadata=md2)
    assert (diagnostics.last_dispatch().provider, diagnostics.last_dispatch().route) == ("classic", "per_token_ps512")


def test_every_call_is_recorded_even_on_a_selection_cache_hit():
    q, k, v, md = batch()
    q32, k32, v32, md32 = batch(head_size=32)
    with diagnostics.collect() as seen:
        ma.paged_attention(q, k, v, metadata=md)
        ma.paged_attention(q32, k32, v32, metadata=md32)
        ma.paged_attention(q, k, v, metadata=md)
    assert [r.route for r in seen] == ["gqa_decode", "per_token_ps512", "gqa_decode"]
    assert seen[2] is diagnostics.last_dispatch()


def test_collect_is_scoped_and_nests():
    q, k, v, md = batch()
    ma.paged_attention(q, k, v, metadata=md)  # before: not collected
    with diagnostics.collect() as outer:
        ma.paged_attention(q, k, v, metadata=md)
        with diagnostics.collect() as inner:
            ma.paged_attention(q, k, v, metadata=md, provider="classic")
        assert [r.provider for r in inner] == ["classic"]
        assert [r.provider for r in outer] == ["gqa", "classic"]  # the inner block's records reach the outer
    ma.paged_attention(q, k, v, metadata=md)  # after: not collected
    assert [r.provider for r in outer] == ["gqa", "classic"]
    assert diagnostics.history() == []


def test_collect_feeds_an_enabled_history_and_restores_it():
    q, k, v, md = batch()
    diagnostics.enable_history()
    ma.paged_attention(q, k, v, metadata=md)
    with diagnostics.collect() as seen:
        ma.paged_attention(q, k, v, metadata=md, provider="classic")
    ma.paged_attention(q, k, v, metadata=md)
    assert len(seen) == 1
    assert [r.provider for r in diagnostics.history()] == ["gqa", "classic", "gqa"]
    diagnostics.enable_history(False)
    assert diagnostics.history() == []


def test_collect_restores_state_after_an_exception():
    q, k, v, md = batch()
    with pytest.raises(ma.ProviderRefusedError), diagnostics.collect() as seen:
        ma.paged_attention(q, k, v, metadata=md)
        ma.paged_attention(q, k, v, metadata=md, provider="nope")
    assert len(seen) == 1
    ma.paged_attention(q, k, v, metadata=md)
    assert diagnostics.history() == [] and len(seen) == 1


def test_cache_writes_are_recorded_separately():
    q, k, v, md = batch()
    ma.paged_attention(q, k, v, metadata=md)
    attn = diagnostics.last_dispatch()
    with diagnostics.collect() as seen:
        ma.reshape_and_cache(mx.zeros((2, 2, 64)), mx.zeros((2, 2, 64)), k, v, mx.array([0, 17]))
    w = diagnostics.last_cache_write()
    assert (w.op, w.provider, w.route, w.backend) == ("reshape_and_cache", "writer", "reshape_and_cache", "cpu")
    assert diagnostics.last_dispatch() is attn  # a cache write does not replace the attention record
    assert seen == [w]


def test_reset_forgets_everything():
    q, k, v, md = batch()
    diagnostics.enable_history()
    ma.paged_attention(q, k, v, metadata=md)
    diagnostics.reset()
    assert diagnostics.last_dispatch() is None and diagnostics.history() == []


def test_compat_spellings():
    q, k, v, md = batch()
    compat.set_paged_dispatch_diagnostics(True)
    ma.paged_attention(q, k, v, metadata=md)
    assert compat.last_paged_dispatch() == "gqa_decode"
    assert compat.last_gqa_partition_size() == 256
    ma.paged_attention(q, k, v, metadata=md, provider="classic")
    assert compat.last_paged_dispatch() == "per_token_ps512"
    assert compat.last_gqa_partition_size() is None  # only a gqa_decode dispatch has one
    assert [r.route for r in diagnostics.history()] == ["gqa_decode", "per_token_ps512"]
    compat.set_paged_dispatch_diagnostics(False)
    assert diagnostics.history() == []
    ma.paged_attention(q, k, v, metadata=md)
    assert diagnostics.history() == [] and compat.last_paged_dispatch() == "gqa_decode"


def test_diagnostics_setting_turns_the_history_on():
    q, k, v, md = batch()
    with ma.override_settings(diagnostics=True):
        ma.paged_attention(q, k, v, metadata=md)
        assert [r.route for r in diagnostics.history()] == ["gqa_decode"]


def test_diagnostics_setting_keeps_a_cache_write_that_comes_first():
    # A step writes the cache before its attention: with the setting on, that write is in the history too,
    # also after a reset (which turns the history off until the next dispatch).
    q, k, v, md = batch()
    key = mx.ones((2, k.shape[2], k.shape[3]), k.dtype)
    with ma.override_settings(diagnostics=True):
        for _ in range(2):
            diagnostics.reset()
            k, v = ma.reshape_and_cache(key, key, k, v, mx.array([0, 1]))
            ma.paged_attention(q, k, v, metadata=md)
            assert [r.op for r in diagnostics.history()] == ["reshape_and_cache", "paged_attention"]


def test_the_diagnostics_setting_keeps_dispatches_only_while_it_is_set():
    """One `override_settings(diagnostics=True)` block used to turn the process-wide history on for good:
    neither the setting back off nor METAL_ATTN_DIAGNOSTICS=0 stopped it, and the list grew without bound."""
    q, k, v, md = batch()
    with ma.override_settings(diagnostics=True):
        ma.paged_attention(q, k, v, metadata=md)
        assert diagnostics.history_enabled()
    ma.paged_attention(q, k, v, metadata=md)
    with ma.override_settings(diagnostics=False):
        ma.paged_attention(q, k, v, metadata=md)
    assert len(diagnostics.history()) == 1 and not diagnostics.history_enabled()
    diagnostics.enable_history()  # the explicit switch still keeps everything, whatever the setting says
    with ma.override_settings(diagnostics=False):
        ma.paged_attention(q, k, v, metadata=md)
    assert len(diagnostics.history()) == 1 and diagnostics.history_enabled()


def test_collect_blocks_overlapping_across_threads_neither_leak_nor_close_each_other():
    """A opens, B opens, A closes, B closes (the interleaving that left a stale history behind):
    each block has exactly the dispatches made while it was open, and nothing collects afterwards."""
    q, k, v, md = batch()
    opened = {n: threading.Event() for n in "AB"}
    close = {n: threading.Event() for n in "AB"}
    seen: dict[str, list] = {}

    def body(name: str) -> None:
        with diagnostics.collect() as got:
            opened[name].set()
            assert close[name].wait(10)
        seen[name] = got

    ta, tb = threading.Thread(target=body, args=("A",)), threading.Thread(target=body, args=("B",))
    ta.start()
    assert opened["A"].wait(10)
    ma.paged_attention(q, k, v, metadata=md)  # A only
    tb.start()
    assert opened["B"].wait(10)
    ma.paged_attention(q, k, v, metadata=md)  # A and B
    close["A"].set()
    ta.join(10)
    ma.paged_attention(q, k, v, metadata=md)  # B only
    close["B"].set()
    tb.join(10)
    ma.paged_attention(q, k, v, metadata=md)  # nobody
    assert (len(seen["A"]), len(seen["B"])) == (2, 2)
    assert not diagnostics.history_enabled() and diagnostics.history() == []
