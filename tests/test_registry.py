"""The provider registry: priority order, validation, explanations, forced and
disabled providers, compile-time fallbacks and the selection observer hook.

Every test builds its own registry from fake providers (fresh plugin manager
each time) and, where a real `metal_attn.paged_attention` call is needed,
installs it as the process-wide registry for the duration of the test.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn import _epoch, diagnostics, plugins
from metal_attn import settings as settings_mod
from metal_attn.device import DeviceInfo
from metal_attn.errors import KernelCompileError, NoProviderError, ProviderRefusedError, RegistryError
from metal_attn.hookspecs import hookimpl
from metal_attn.plugins import registry_from
from metal_attn.provider import Plan, Provider, write_slots
from metal_attn.registry import Origin, ProviderRegistrar, Registry
from metal_attn.request import AttentionRequest

CPU = DeviceInfo("cpu", "test CPU", "x86_64", None, None, None, 2)

# -- fakes -------------------------------------------------------------------------------------


class FakeProvider(Provider):
    """A configurable provider; `run` fills the output with ``fill`` so tests see who ran."""

    def __init__(
        self,
        name: str,
        priority: int,
        *,
        backends: tuple[str, ...] = ("cpu",),
        phases: tuple[str, ...] | None = None,
        head_sizes: tuple[int, ...] | None = None,
        route: str | None = None,
        partition_size: int = 0,
        compile_error: str | None = None,
        fill: float = 0.0,
    ) -> None:
        self.name = name
        self.priority = priority
        self.backends = frozenset(backends)
        if phases is not None:
            self.phases = frozenset(phases)
        if head_sizes is not None:
            self.head_sizes = frozenset(head_sizes)
        self.route = route or name
        self.partition_size = partition_size
        self.compile_error = compile_error
        self.fill = fill
        self.prepared: list[tuple] = []
        self.admission_checks = 0
        self.runs = 0

    def not_supported_reasons(self, request, device, settings):
        self.admission_checks += 1
        return super().not_supported_reasons(request, device, settings)

    def plan(self, request, device, settings) -> Plan:
        return Plan(self.name, self.route, self.partition_size, specialization=(request.dtype, request.head_size))

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        self.prepared.append(plan.specialization)
        if self.compile_error is not None:
            raise KernelCompileError(self.compile_error)

    def run(self, inputs, plan):
        self.runs += 1
        return mx.full(inputs.q.shape, self.fill, dtype=inputs.q.dtype)

    def write_cache(self, key, value, k_cache, v_cache, slots, device):  # used where a test sets writes_cache
        return write_slots(key, value, k_cache, v_cache, slots)


class ProvidersPlugin:
    """A plugin object whose registrar hook adds the given providers."""

    def __init__(self, *providers: Provider) -> None:
        self.providers = providers

    @hookimpl
    def metal_attn_register_providers(self, registrar: ProviderRegistrar) -> None:
        for p in self.providers:
            registrar.add(p)


class SelectionObserver:
    """A plugin implementing the observer hook; remembers every call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    @hookimpl
    def metal_attn_provider_selected(self, request, provider, route, reasons) -> None:
        self.calls.append({"request": request, "provider": provider, "route": route, "reasons": reasons})


# -- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolated(clean_settings_env):
    """Clean METAL_ATTN_/VLLM_METAL_ environment, fresh settings, diagnostics and warn-once memory."""
    diagnostics.reset()
    yield
    diagnostics.reset()


@pytest.fixture
def install(monkeypatch):
    """Make a registry the process-wide one (what `paged_attention` and `ma.explain` use)."""

    def _install(reg: Registry) -> Registry:
        plugins.reset_registry()
        monkeypatch.setitem(plugins._registries, plugins._plugin_key(settings_mod.get_settings()), reg)
        return reg

    return _install


def set_env(monkeypatch, **env: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings_mod.reload_settings()


def decode_request(seq_lens=(100, 300), head_size=64) -> AttentionRequest:
    return AttentionRequest.from_lengths(
        q_lens=[1] * len(seq_lens),
        seq_lens=list(seq_lens),
        backend="cpu",
        dtype="float32",
        num_heads=8,
        num_kv_heads=2,
        head_size=head_size,
    )


def decode_batch(seq_lens=(100, 300), *, heads=8, kv_heads=2, head_size=64, block_size=16, seed=0):
    """q, k_cache, v_cache and AttentionMetadata for a float32 decode batch."""
    rng = np.random.default_rng(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    width = max(need)
    num_blocks = sum(need) + 1
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), width), np.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[start : start + n]
        start += n
    pool_shape = (num_blocks, block_size, kv_heads, head_size)
    k = mx.array(rng.standard_normal(pool_shape, np.float32))
    v = mx.array(rng.standard_normal(pool_shape, np.float32))
    q = mx.array(rng.standard_normal((len(seq_lens), heads, head_size), np.float32))
    md = ma.AttentionMetadata.build(table, np.array(seq_lens, np.int32), np.arange(len(seq_lens) + 1, dtype=np.int32))
    return q, k, v, md


def standard_providers():
    """Four providers for a float32 decode request with head size 64 (see `decode_request`)."""
    return [
        FakeProvider("big", 100, phases=("prefill",), head_sizes=(128, 256)),
        FakeProvider("metal_only", 50, backends=("metal",)),
        FakeProvider("good", 10, route="good_route", partition_size=256, fill=2.0),
        FakeProvider("also_ok", 5, route="also_route", fill=3.0),
    ]


BIG_REASONS = ("phase=decode (supported: prefill)", "head_size=64 (supported: 128, 256)")
METAL_REASONS = ("backend=cpu (supported: metal)",)


# -- priority order and validation -----------------------------------------------------------------


def test_priority_order_is_data_not_registration_order():
    def names(reg: Registry) -> list[str]:
        return [e.provider.name for e in reg.entries]

    def make():
        return [FakeProvider("low", 1), FakeProvider("high", 50), FakeProvider("b_tie", 10), FakeProvider("a_tie", 10)]

    low, high, b_tie, a_tie = make()
    one_plugin = registry_from([ProvidersPlugin(low, high, b_tie, a_tie)])
    low, high, b_tie, a_tie = make()
    reversed_plugins = registry_from(
        [ProvidersPlugin(a_tie), ProvidersPlugin(b_tie), ProvidersPlugin(high), ProvidersPlugin(low)]
    )
    direct = Registry()
    for p in reversed(make()):
        direct.add(p)
    expected = ["high", "a_tie", "b_tie", "low"]  # priority descending, ties by name
    assert names(one_plugin) == expected
    assert names(reversed_plugins) == expected
    assert names(direct) == expected
    # The first admitted provider in that order is selected, whatever the registration order.
    assert direct.select(decode_request(), CPU, settings_mod.get_settings()).provider.name == "high"


def test_duplicate_name_raises_registry_error():
    reg = Registry()
    reg.add(FakeProvider("dup", 1))
    with pytest.raises(RegistryError, match=r"provider name='dup' is already registered \(by direct\)"):
        reg.add(FakeProvider("dup", 99))
    assert [(e.provider.name, e.provider.priority) for e in reg.entries] == [("dup", 1)]


def test_duplicate_name_across_plugins_is_isolated_to_the_second_plugin(log_records):
    first, second, other = FakeProvider("dup", 1), FakeProvider("dup", 2), FakeProvider("other", 3)
    reg = registry_from([ProvidersPlugin(first), ProvidersPlugin(second, other)], names=["first", "second"])
    assert reg.get("dup") is first
    assert reg.load_errors == {"second": "RegistryError: provider name='dup' is already registered (by first)"}
    failed = log_records("plugin_register_failed")
    assert len(failed) == 1 and failed[0].plugin == "second"
    assert "already registered" in failed[0].reason


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_bad_priority_raises_registry_error(bad):
    p = FakeProvider("bad_prio", 0)
    p.priority = bad
    with pytest.raises(RegistryError, match=rf"provider 'bad_prio': priority={bad!r} must be an int"):
        Registry().add(p)


@pytest.mark.parametrize(
    ("name", "backends", "message"),
    [
        ("", ("cpu",), "provider name='' must be a non-empty identifier"),
        ("has space", ("cpu",), "provider name='has space' must be a non-empty identifier"),
        ("rocm_only", ("rocm",), "provider 'rocm_only': backends=frozenset({'rocm'}) (allowed: a non-empty set of"),
        ("no_backend", (), "provider 'no_backend': backends=frozenset() (allowed: a non-empty set of"),
        ("a_str", "cpu", "provider 'a_str': backends='cpu' (allowed: a non-empty set of metal, cuda, cpu, e.g. "
                         "frozenset({'cpu'}))"),  # it read as backends=['c', 'p', 'u']
    ],
)
def test_bad_declarations_raise_registry_error(name, backends, message):
    provider = FakeProvider(name, 1, backends=("cpu",))
    provider.backends = backends if isinstance(backends, str) else frozenset(backends)
    with pytest.raises(RegistryError) as err:
        Registry().add(provider)
    assert message in str(err.value)


def test_a_provider_class_whose_constructor_needs_arguments_is_named():
    class NeedsArgs(FakeProvider):
        def __init__(self, name):
            super().__init__(name, 1)

    class Broken(FakeProvider):
        def __init__(self):
            super().__init__(None + 1, 1)  # a bug inside a constructor that takes no arguments

    with pytest.raises(RegistryError, match=r"registrar\.add\(.*NeedsArgs\) builds the provider with no arguments, "
                                            r"but its constructor needs some \(missing a required argument: 'name'"):
        ProviderRegistrar(Registry(), Origin("unit")).add(NeedsArgs)
    with pytest.raises(TypeError, match="unsupported operand"):  # its own error, not blamed on the signature
        ProviderRegistrar(Registry(), Origin("unit")).add(Broken)


def test_backend_priority_reorders_one_backend_only():
    """A provider ranked differently on one backend (measured there) is asked later only on that
    backend; explain reports the priority in force, forcing it still works."""
    fast_elsewhere = FakeProvider("fast_elsewhere", 80, backends=("cpu", "cuda"), fill=1.0)
    fast_elsewhere.backend_priority = {"cuda": 5}
    general = FakeProvider("general", 10, backends=("cpu", "cuda"), fill=2.0)
    reg = Registry()
    reg.add(general)
    assert [e.provider.name for e in reg.ordered("cuda")] == ["general"]  # rebuilt by the next add
    reg.add(fast_elsewhere)
    cuda = dataclasses.replace(CPU, backend="cuda", name="test GPU")
    assert [e.provider.name for e in reg.ordered("cpu")] == ["fast_elsewhere", "general"]
    assert [e.provider.name for e in reg.ordered("cuda")] == ["general", "fast_elsewhere"]
    assert [e.provider.name for e in reg.entries] == ["fast_elsewhere", "general"]  # declared order
    settings = settings_mod.get_settings()
    cuda_req = dataclasses.replace(decode_request(), backend="cuda")
    assert reg.select(decode_request(), CPU, settings).provider is fast_elsewhere
    assert reg.select(cuda_req, cuda, settings).provider is general
    ex = reg.explain(cuda_req, cuda, settings)
    assert [(r.name, r.priority, r.chosen) for r in ex.rows] == [("general", 10, True), ("fast_elsewhere", 5, False)]
    assert reg.select(cuda_req, cuda, settings, forced="fast_elsewhere").provider is fast_elsewhere
    # The cache writer follows the same order.
    fast_elsewhere.writes_cache = general.writes_cache = True
    assert reg.select_cache_writer("float32", CPU, settings) is fast_elsewhere
    assert reg.select_cache_writer("float32", cuda, settings) is general


def test_backend_priority_default_is_shared_read_only():
    """The base class's empty mapping cannot be written through one provider into all of them."""
    p = FakeProvider("plain", 1)
    with pytest.raises(TypeError):
        p.backend_priority["cpu"] = 5
    assert dict(Provider.backend_priority) == {}


def test_providers_inventory_follows_the_backend_order():
    """`metal_attn.providers(device)` lists providers as selection asks them on that device: by the
    priority in force there (the built-in ranks themselves are asserted in test_gqa_routing)."""
    # gqa_decode declares 80 and {"cuda": 5}; classic 10: they swap places on CUDA.
    expect = {"h200": (5, ["classic", "gqa_decode"]), "m5-max": (80, ["gqa_decode", "classic"]),
              "cpu-2core": (80, ["gqa_decode", "classic"])}
    for preset, (gqa_here, order) in expect.items():
        dev = DeviceInfo.preset(preset)
        rows = ma.providers(dev)
        here = [r["priority_here"] for r in rows]
        assert here == sorted(here, reverse=True), preset
        names = [r["name"] for r in rows]
        assert [n for n in names if n in order] == order, preset
        gqa = next(r for r in rows if r["name"] == "gqa_decode")
        assert (gqa["priority"], gqa["priority_here"]) == (80, gqa_here), preset


@pytest.mark.parametrize(
    ("bad", "why"),
    [({"metal": 5}, "metal is not one of its backends"), ({"cpu": 1.5}, "a float"), ({"cpu": True}, "a bool"),
     ([("cpu", 5)], "not a mapping")],
)
def test_bad_backend_priority_raises_registry_error(bad, why):
    p = FakeProvider("bad_bp", 1)
    p.backend_priority = bad
    with pytest.raises(RegistryError) as err:
        Registry().add(p)
    assert (f"provider 'bad_bp': backend_priority={bad!r} (allowed: a mapping from its backends ['cpu'] "
            "to int priorities)") in str(err.value), why


def test_registrar_accepts_classes_and_rejects_non_providers():
    class ByClass(Provider):
        name = "by_class"
        priority = 7
        backends = frozenset({"cpu"})

    reg = Registry()
    registrar = ProviderRegistrar(reg, Origin("unit"))
    registrar.add(ByClass)
    assert "by_class" not in [e.provider.name for e in reg.entries]  # staged until the hook returns
    registrar.commit()
    assert isinstance(reg.get("by_class"), ByClass)
    assert reg.entries[0].origin.describe() == "unit"
    with pytest.raises(RegistryError, match=r"is not a metal_attn\.Provider subclass"):
        registrar.add(dict)
    with pytest.raises(RegistryError, match=r"is not a metal_attn\.Provider"):
        reg.add(object())


# -- explain and the no-provider error ---------------------------------------------------------------


def test_explain_lists_every_provider_in_priority_order_with_reasons_and_plan():
    reg = registry_from([ProvidersPlugin(*reversed(standard_providers()))], names=["fakes"])
    req = decode_request()
    exp = reg.explain(req, CPU, settings_mod.get_settings())

    assert [r.name for r in exp.rows] == ["big", "metal_only", "good", "also_ok"]
    big, metal_only, good, also_ok = exp.rows
    assert (big.admitted, big.reasons, big.plan) == (False, BIG_REASONS, None)
    assert (metal_only.admitted, metal_only.reasons) == (False, METAL_REASONS)
    assert good.admitted and good.chosen and good.reasons == ()
    assert (good.plan.route, good.plan.partition_size, good.plan.specialization) == ("good_route", 256, ("float32", 64))
    assert also_ok.admitted and not also_ok.chosen and also_ok.plan.route == "also_route"
    assert exp.chosen is good

    lines = str(exp).splitlines()
    assert lines[0] == repr(req)
    assert lines[1] == "device: cpu test CPU x86_64 2 threads"
    assert lines[2:] == [
        "  no big (priority 100, from fakes)",
        "       - phase=decode (supported: prefill)",
        "       - head_size=64 (supported: 128, 256)",
        "  no metal_only (priority 50, from fakes)",
        "       - backend=cpu (supported: metal)",
        "  -> good (priority 10, from fakes)",
        "       plan: route=good_route partition=256",
        "  ok also_ok (priority 5, from fakes)",
        "       plan: route=also_route",
    ]
    d = exp.to_dict()
    assert d["chosen"] == "good" and d["forced"] is None
    assert [(p["name"], p["admitted"], p["chosen"]) for p in d["providers"]] == [
        ("big", False, False),
        ("metal_only", False, False),
        ("good", True, True),
        ("also_ok", True, False),
    ]
    assert d["providers"][0]["reasons"] == list(BIG_REASONS)
    assert d["request"]["phase"] == "decode"


def test_public_explain_uses_the_process_registry(install):
    install(registry_from([ProvidersPlugin(*standard_providers())]))
    exp = ma.explain(decode_request(), device=CPU)
    assert [(r.name, r.chosen) for r in exp.rows] == [
        ("big", False),
        ("metal_only", False),
        ("good", True),
        ("also_ok", False),
    ]
    by_fields = ma.explain(
        q_lens=[1, 1], seq_lens=[100, 300], dtype="float32", num_heads=8, num_kv_heads=2, head_size=64, device=CPU
    )
    assert by_fields.request == decode_request()


def test_no_provider_error_prints_request_first_then_the_table(install):
    refusing = [
        FakeProvider("big", 100, phases=("prefill",), head_sizes=(128, 256)),
        FakeProvider("metal_only", 50, backends=("metal",)),
    ]
    reg = install(registry_from([ProvidersPlugin(*refusing)], names=["fakes"]))
    req = decode_request()
    with pytest.raises(NoProviderError) as err:
        reg.select(req, CPU, settings_mod.get_settings())
    assert not isinstance(err.value, ProviderRefusedError)
    lines = str(err.value).splitlines()
    assert lines[0] == "no provider admits this request:"
    assert lines[1] == repr(req)
    assert lines[2] == "device: cpu test CPU x86_64 2 threads"
    assert lines[3:] == [
        "  no big (priority 100, from fakes)",
        "       - phase=decode (supported: prefill)",
        "       - head_size=64 (supported: 128, 256)",
        "  no metal_only (priority 50, from fakes)",
        "       - backend=cpu (supported: metal)",
    ]
    # The same table reaches a user of the public call.
    q, k, v, md = decode_batch()
    with pytest.raises(
        NoProviderError,
        match=r"(?s)no provider admits this request:\nAttentionRequest\(cpu decode.*"
        r"head_size=64 \(supported: 128, 256\)",
    ):
        ma.paged_attention(q, k, v, metadata=md)
    assert diagnostics.last_dispatch() is None


# -- forced providers ------------------------------------------------------------------------------------


def test_forced_by_argument_wins_over_priority(install):
    provs = standard_providers()
    install(registry_from([ProvidersPlugin(*provs)]))
    q, k, v, md = decode_batch()
    out = ma.paged_attention(q, k, v, metadata=md, provider="also_ok")
    assert np.all(np.array(out) == 3.0)
    rec = diagnostics.last_dispatch()
    assert (rec.provider, rec.route, rec.fallbacks) == ("also_ok", "also_route", ())
    assert provs[2].runs == 0


def test_forced_by_setting_wins_over_priority(install, monkeypatch):
    set_env(monkeypatch, METAL_ATTN_PROVIDER="also_ok")
    install(registry_from([ProvidersPlugin(*standard_providers())]))
    q, k, v, md = decode_batch()
    mx.eval(ma.paged_attention(q, k, v, metadata=md))
    assert diagnostics.last_dispatch().provider == "also_ok"


@pytest.mark.parametrize("how", ["argument", "METAL_ATTN_PROVIDER"])
def test_forced_provider_that_refuses_raises_its_reasons_and_never_falls_back(install, monkeypatch, how):
    provs = standard_providers()
    if how == "METAL_ATTN_PROVIDER":
        set_env(monkeypatch, METAL_ATTN_PROVIDER="big")
        kwargs = {}
    else:
        kwargs = {"provider": "big"}
    install(registry_from([ProvidersPlugin(*provs)], names=["fakes"]))
    q, k, v, md = decode_batch()
    with pytest.raises(ProviderRefusedError) as err:
        ma.paged_attention(q, k, v, metadata=md, **kwargs)
    msg = str(err.value)
    assert msg.startswith("the forced provider 'big' refuses this request:\nAttentionRequest(cpu decode")
    assert "forced provider: big" in msg
    for reason in BIG_REASONS:
        assert f"       - {reason}" in msg
    # Checked alone: the admitted providers are not even listed, and nothing ran.
    assert "good" not in msg and "also_ok" not in msg and "metal_only" not in msg
    assert all(p.runs == 0 for p in provs)
    assert diagnostics.last_dispatch() is None


def test_forced_provider_that_is_not_registered(install):
    reg = install(registry_from([ProvidersPlugin(*standard_providers())]))
    with pytest.raises(ProviderRefusedError) as err:
        reg.select(decode_request(), CPU, settings_mod.get_settings(), forced="nope")
    assert str(err.value) == "provider='nope' is not registered (registered: big, metal_only, good, also_ok)"


def test_explain_with_unregistered_forced_provider_chooses_nothing():
    reg = registry_from([ProvidersPlugin(*standard_providers())])
    exp = reg.explain(decode_request(), CPU, settings_mod.get_settings(), forced="nope")
    assert exp.rows[-1].reasons == ("provider='nope' is not registered (registered: big, metal_only, good, also_ok)",)
    assert exp.chosen is None


def test_forced_provider_whose_kernel_fails_to_build_does_not_fall_back(install):
    flaky = FakeProvider("flaky", 100, compile_error="boom")
    good = FakeProvider("good", 10)
    install(registry_from([ProvidersPlugin(flaky, good)]))
    q, k, v, md = decode_batch()
    with pytest.raises(
        ProviderRefusedError,
        match=r"the forced provider 'flaky' failed to build kernel "
        r"\('float32', 64\): boom",
    ):
        ma.paged_attention(q, k, v, metadata=md, provider="flaky")
    assert good.runs == 0 and flaky.runs == 0


def test_explain_with_forced_provider_lists_it_alone():
    reg = registry_from([ProvidersPlugin(*standard_providers())])
    exp = reg.explain(decode_request(), CPU, settings_mod.get_settings(), forced="also_ok")
    assert exp.forced == "also_ok"
    assert [(r.name, r.chosen) for r in exp.rows] == [("also_ok", True)]
    assert "forced provider: also_ok" in str(exp)


# -- disabled providers ------------------------------------------------------------------------------------


TOGGLED = ("gqa_decode", "nax_prefill", "tiled_prefill")


@pytest.mark.parametrize(
    ("var", "value", "disabled", "reason"),
    [
        ("METAL_ATTN_DISABLE_GQA_DECODE", "1", "gqa_decode", "disabled by METAL_ATTN_DISABLE_GQA_DECODE=1"),
        ("VLLM_METAL_DISABLE_GQA_DECODE", "1", "gqa_decode", "disabled by VLLM_METAL_DISABLE_GQA_DECODE=1"),
        ("METAL_ATTN_DISABLE_NAX", "true", "nax_prefill", "disabled by METAL_ATTN_DISABLE_NAX=true"),
        ("VLLM_METAL_DISABLE_NAX", "1", "nax_prefill", "disabled by VLLM_METAL_DISABLE_NAX=1"),
        ("METAL_ATTN_DISABLE_TILED_PREFILL", "yes", "tiled_prefill",
         "disabled by METAL_ATTN_DISABLE_TILED_PREFILL=yes"),
        (
            "METAL_ATTN_DISABLED_PROVIDERS",
            "other, nax_prefill",
            "nax_prefill",
            "disabled by METAL_ATTN_DISABLED_PROVIDERS=other,nax_prefill",
        ),
    ],
)
def test_disabled_provider_stays_in_the_table_with_its_reason(install, monkeypatch, var, value, disabled, reason):
    provs = [FakeProvider(n, 100 - 10 * i, fill=float(i)) for i, n in enumerate(TOGGLED)]
    provs.append(FakeProvider("gqa_decode_v2", 1, fill=9.0))  # similar name: toggles match names exactly
    set_env(monkeypatch, **{var: value})
    reg = install(registry_from([ProvidersPlugin(*provs)]))
    exp = reg.explain(decode_request(), CPU, settings_mod.get_settings())
    rows = {r.name: r for r in exp.rows}
    assert [r.name for r in exp.rows] == [*TOGGLED, "gqa_decode_v2"]
    assert rows[disabled].reasons == (reason,) and not rows[disabled].admitted
    for name in (*TOGGLED, "gqa_decode_v2"):
        if name != disabled:
            assert rows[name].admitted, f"{var} must only disable {disabled}, not {name}"
    expected_choice = next(n for n in TOGGLED if n != disabled)
    assert exp.chosen.name == expected_choice
    assert f"  no {disabled} (priority" in str(exp) and f"       - {reason}" in str(exp)

    q, k, v, md = decode_batch()
    mx.eval(ma.paged_attention(q, k, v, metadata=md))
    assert diagnostics.last_dispatch().provider == expected_choice
    # A disabled provider cannot be forced either: the toggle can only disable.
    with pytest.raises(ProviderRefusedError, match=rf"(?s)forced provider '{disabled}' refuses.*{reason}"):
        ma.paged_attention(q, k, v, metadata=md, provider=disabled)


def test_disabled_provider_reason_is_listed_with_its_other_reasons():
    p = FakeProvider("gqa_decode", 100, head_sizes=(128,))
    reg = registry_from([ProvidersPlugin(p, FakeProvider("fallback", 1))])
    with ma.override_settings(disable_gqa_decode=True):
        row = reg.explain(decode_request(), CPU, settings_mod.get_settings()).rows[0]
    assert row.reasons == ("disabled by the disable_gqa_decode setting (its variable: METAL_ATTN_DISABLE_GQA_DECODE=1)",
                           "head_size=64 (supported: 128)")


# -- compile-time fallback -------------------------------------------------------------------------------------


COMPILE_MSG = "undeclared identifier 'simd_sum' in gqa_decode_f32_h64"
FLAKY_REASON = f"kernel specialization ('float32', 64) failed to build: {COMPILE_MSG}"


def test_kernel_compile_failure_falls_back_records_and_warns_once(install, log_records):
    flaky = FakeProvider("flaky", 100, route="flaky_route", compile_error=COMPILE_MSG)
    good = FakeProvider("good", 10, route="good_route", fill=2.0)
    reg = install(registry_from([ProvidersPlugin(flaky, good)]))

    q, k, v, md = decode_batch()
    out = ma.paged_attention(q, k, v, metadata=md)
    assert np.all(np.array(out) == 2.0)
    assert flaky.prepared == [("float32", 64)] and flaky.runs == 0 and good.runs == 1
    rec = diagnostics.last_dispatch()
    assert (rec.provider, rec.route) == ("good", "good_route")
    assert rec.fallbacks == (("flaky", FLAKY_REASON),)
    assert reg.failures() == {("flaky", ("float32", 64)): COMPILE_MSG}

    warned = log_records("kernel_unavailable")
    assert len(warned) == 1
    w = warned[0]
    assert w.levelno == logging.WARNING
    assert (w.provider, w.specialization, w.reason) == ("flaky", "('float32', 64)", COMPILE_MSG)

    # Later calls (same metadata, and a new batch with the same specialization) go straight to
    # the fallback: the failed kernel is neither rebuilt nor warned about again.
    mx.eval(ma.paged_attention(q, k, v, metadata=md))
    q2, k2, v2, md2 = decode_batch((40, 70, 500), seed=1)
    mx.eval(ma.paged_attention(q2, k2, v2, metadata=md2))
    assert diagnostics.last_dispatch().provider == "good"
    assert diagnostics.last_dispatch().fallbacks == ()  # refused up front now, not a run-time fallback
    assert flaky.prepared == [("float32", 64)] and flaky.runs == 0
    assert len(log_records("kernel_unavailable")) == 1

    # explain now shows the specialization failure as flaky's reason.
    exp = ma.explain(decode_request(), device=CPU)
    assert [(r.name, r.admitted, r.reasons) for r in exp.rows] == [
        ("flaky", False, (FLAKY_REASON,)),
        ("good", True, ()),
    ]
    assert exp.chosen.name == "good"

    # Another specialization of the same provider is tried (and fails, and warns) on its own.
    other = reg.select(decode_request(head_size=128), CPU, settings_mod.get_settings())
    assert other.provider.name == "good"
    assert other.fallbacks == (("flaky", f"kernel specialization ('float32', 128) failed to build: {COMPILE_MSG}"),)
    assert [w.specialization for w in log_records("kernel_unavailable")] == ["('float32', 64)", "('float32', 128)"]


def test_kernel_compile_failure_without_fallback_raises_with_the_reason(install):
    install(registry_from([ProvidersPlugin(FakeProvider("flaky", 100, compile_error=COMPILE_MSG))], names=["fakes"]))
    q, k, v, md = decode_batch()
    with pytest.raises(NoProviderError) as err:
        ma.paged_attention(q, k, v, metadata=md)
    assert f"  no flaky (priority 100, from fakes)\n       - {FLAKY_REASON}" in str(err.value)


def test_mark_failed_warns_once_per_provider_and_specialization(log_records):
    reg = Registry()
    reg.add(FakeProvider("p", 1))
    epoch = _epoch.current()
    reg.mark_failed("p", ("float16", 128), "first")
    reg.mark_failed("p", ("float16", 128), "again")
    reg.mark_failed("p", ("float16", 256), "other")
    assert [(w.specialization, w.reason) for w in log_records("kernel_unavailable")] == [
        ("('float16', 128)", "first"),
        ("('float16', 256)", "other"),
    ]
    assert reg.failures()[("p", ("float16", 128))] == "again"
    assert _epoch.current() == (epoch[0] + 3, epoch[1])  # each mark invalidates the per-call selection caches


# -- selection cache and observer hook ---------------------------------------------------------------------


def test_observer_hook_is_called_on_a_cache_miss_only(install):
    observer = SelectionObserver()
    provs = standard_providers()
    install(registry_from([ProvidersPlugin(*provs), observer]))
    q, k, v, md = decode_batch()
    for _ in range(3):
        mx.eval(ma.paged_attention(q, k, v, metadata=md))
    assert len(observer.calls) == 1
    call = observer.calls[0]
    assert (call["provider"], call["route"]) == ("good", "good_route")
    assert call["reasons"] == {"big": list(BIG_REASONS), "metal_only": list(METAL_REASONS)}
    assert call["request"] == decode_request()

    # A new metadata object for an identical batch hits the registry's cache: no new call.
    q, k, v, md_same = decode_batch(seed=3)
    mx.eval(ma.paged_attention(q, k, v, metadata=md_same))
    assert len(observer.calls) == 1
    # A batch with other lengths is another request: one more call.
    q, k, v, md_other = decode_batch((10, 20, 30))
    mx.eval(ma.paged_attention(q, k, v, metadata=md_other))
    assert len(observer.calls) == 2
    assert observer.calls[1]["request"].max_seq_len == 30
    # Forced selections are observed too, with no refusals above them.
    mx.eval(ma.paged_attention(q, k, v, metadata=md_other, provider="also_ok"))
    assert observer.calls[2]["provider"] == "also_ok" and observer.calls[2]["reasons"] == {}


def test_repeated_calls_do_not_rerun_admission(install):
    provs = standard_providers()
    install(registry_from([ProvidersPlugin(*provs)]))
    q, k, v, md = decode_batch()
    mx.eval(ma.paged_attention(q, k, v, metadata=md))
    checks = [p.admission_checks for p in provs]
    assert checks[2] >= 1  # the chosen one was asked
    for _ in range(5):
        mx.eval(ma.paged_attention(q, k, v, metadata=md))
    assert [p.admission_checks for p in provs] == checks
    assert provs[2].runs == 6 and provs[2].prepared == [("float32", 64)]


def test_a_provider_whose_admission_check_raises_is_refused_not_fatal():
    class Broken(FakeProvider):
        def not_supported_reasons(self, request, device, settings):
            raise ZeroDivisionError("bug in a third-party provider")

    reg = registry_from([ProvidersPlugin(Broken("broken", 100), FakeProvider("good", 1))])
    exp = reg.explain(decode_request(), CPU, settings_mod.get_settings())
    assert exp.rows[0].reasons == ("admission check raised ZeroDivisionError: bug in a third-party provider",)
    assert exp.chosen.name == "good"


# -- a provider's bugs at plan, prepare, run and cache-write time -------------------------------------------------


class PlanRaises(FakeProvider):
    def plan(self, request, device, settings):
        raise KeyError("geometry table has no row for this head size")


class PlanReturnsNone(FakeProvider):
    def plan(self, request, device, settings):
        return None


class PrepareRaises(FakeProvider):
    def prepare(self, plan, device):
        raise ValueError("vendor SDK returned -3")


@pytest.mark.parametrize(("broken", "reason"), [
    (PlanRaises, "plan() raised KeyError: 'geometry table has no row for this head size'"),
    (PlanReturnsNone, "plan() returned NoneType, not a metal_attn.Plan"),
    (PrepareRaises, "kernel specialization ('float32', 64) failed to build: prepare() raised ValueError: vendor SDK "
                    "returned -3"),
])
def test_a_provider_whose_plan_or_prepare_fails_is_passed_over(install, broken, reason):
    """They used to raise out of every paged_attention and explain call (no fallback)."""
    install(registry_from([ProvidersPlugin(broken("broken", 100), FakeProvider("good", 1, fill=3.0))]))
    q, k, v, md = decode_batch()
    out = ma.paged_attention(q, k, v, metadata=md)
    assert np.all(np.array(out) == 3.0)
    rec = diagnostics.last_dispatch()
    assert rec.provider == "good" and rec.fallbacks == (("broken", reason),)
    exp = ma.explain(decode_request(), device=CPU)
    assert exp.chosen.name == "good"
    assert exp.rows[0].name == "broken" and not exp.rows[0].admitted
    with pytest.raises(ProviderRefusedError, match="forced provider 'broken'"):
        ma.paged_attention(q, k, v, metadata=md, provider="broken")


class WrongShape(FakeProvider):
    def run(self, inputs, plan):
        return mx.zeros((1,), dtype=inputs.q.dtype)


def test_a_run_that_returns_the_wrong_shape_is_refused(install):
    install(registry_from([ProvidersPlugin(WrongShape("wrong", 100), FakeProvider("good", 1))]))
    q, k, v, md = decode_batch()
    with pytest.raises(ma.ProviderContractError,
                       match=r"provider 'wrong' \(route 'wrong'\): run\(\) returned mx.array \(1,\) float32 \(allowed: "
                             r"an mx.array of q's shape \(2, 8, 64\) and dtype float32\)"):
        ma.paged_attention(q, k, v, metadata=md)


def test_a_run_that_returns_a_list_is_described():
    """It read "returned list () None"."""
    from metal_attn.api import _refuse_output

    q = mx.zeros((2, 8, 64))
    with pytest.raises(ma.ProviderContractError, match=r"run\(\) returned list of 2: mx.array \(2, 8, 64\) float32, "
                                                       r"None \(allowed: an mx.array of q's shape"):
        _refuse_output("p", "r", [q, None], q)


@pytest.mark.parametrize(("error", "expected", "message"), [
    (IndexError("list index out of range"), ma.ProviderContractError,
     r"provider 'raiser' \(route 'raiser'\): run\(\) raised IndexError: list index out of range"),
    (ma.InvalidInputError("scale=3 (allowed: 1)"), ma.InvalidInputError, r"^scale=3 \(allowed: 1\)$"),
])
def test_a_run_that_raises_is_named_unless_it_raised_on_purpose(install, error, expected, message):
    """run()'s own exceptions reached the caller raw, naming no provider; this library's errors stay as raised."""
    class Raiser(FakeProvider):
        def run(self, inputs, plan):
            raise error

    install(registry_from([ProvidersPlugin(Raiser("raiser", 100), FakeProvider("good", 1))]))
    q, k, v, md = decode_batch()
    with pytest.raises(expected, match=message):
        ma.paged_attention(q, k, v, metadata=md)


def test_a_cache_writer_whose_check_raises_is_skipped():
    class Broken(FakeProvider):
        writes_cache = True

        def cache_write_reasons(self, dtype, device, settings):
            raise RuntimeError("bug")

    class Writer(FakeProvider):
        writes_cache = True

        def cache_write_reasons(self, dtype, device, settings):
            return []

    reg = registry_from([ProvidersPlugin(Broken("broken", 100), Writer("writer", 1))])
    assert reg.select_cache_writer("float32", CPU, settings_mod.get_settings()).name == "writer"


def test_a_provider_without_run_is_refused_with_its_reason_and_the_next_one_runs():
    """A provider with a misspelled `run` was admitted, shown as chosen, and then every call raised
    ProviderContractError with no fallback."""

    class Typo(Provider):
        name = "typo_run"
        priority = 100
        backends = frozenset({"cpu"})

        def plan(self, request, device, settings) -> Plan:
            return Plan(self.name, self.name)

        def runn(self, inputs, plan):  # misspelled
            return inputs.q

    class Writes(Typo):
        name = "typo_writer"
        writes_cache = True

    reg = registry_from([ProvidersPlugin(Typo(), Writes(), FakeProvider("fine", 1, fill=3.0))])
    settings = settings_mod.get_settings()
    ex = reg.explain(decode_request(), CPU, settings)
    typo = next(r for r in ex.rows if r.name == "typo_run")
    assert list(typo.reasons) == ["does not implement run(inputs, plan) (test_a_provider_without_run_is_refused_"
                                  "with_its_reason_and_the_next_one_runs.<locals>.Typo inherits Provider's)"]
    assert ex.chosen.name == "fine" and reg.select(decode_request(), CPU, settings).provider.name == "fine"
    with pytest.raises(NoProviderError, match=r"typo_writer: writes_cache=True but does not implement write_cache"):
        reg.select_cache_writer("float32", CPU, settings.model_copy(update={"disabled_providers": ("fine",)}))


@pytest.mark.parametrize("where", ["availability", "extra"])
def test_reasons_given_as_a_bare_string_are_named_not_split_into_letters(where):
    """``availability_reasons`` returning "needs a GPU" read as eleven one-letter reasons."""

    class Bare(FakeProvider):
        def availability_reasons(self, device):
            return "needs a GPU" if where == "availability" else []

        def extra_reasons(self, request, device, settings):
            return "too long" if where == "extra" else []

    reg = registry_from([ProvidersPlugin(Bare("bare", 100), FakeProvider("fine", 1))])
    settings = settings_mod.get_settings()
    (row,) = [r for r in reg.explain(decode_request(), CPU, settings).rows if r.name == "bare"]
    method, value = ("availability_reasons", "'needs a GPU'") if where == "availability" else ("extra_reasons",
                                                                                               "'too long'")
    assert list(row.reasons) == [f"admission check raised TypeError: {method}() returned {value} (allowed: a list "
                                 "of str, empty to admit)"]
    if where == "availability":
        assert reg.availability_reasons(Bare("b2", 1), CPU) == (
            "availability check raised TypeError: availability_reasons() returned 'needs a GPU' (allowed: a list "
            "of str, empty to admit)",)


def test_an_admission_check_that_raises_is_passed_over_and_logged_once(log_records):
    """It was passed over with no log line (a failing plan() is logged): `doctor` and a user saw nothing."""

    class Raises(FakeProvider):
        def extra_reasons(self, request, device, settings):
            raise RuntimeError("bug in the plugin")

    reg = registry_from([ProvidersPlugin(Raises("raises", 100), FakeProvider("fine", 1))])
    settings = settings_mod.get_settings()
    for _ in range(3):
        assert reg.select(decode_request(), CPU, settings).provider.name == "fine"
        reg.forget_selections()
    (rec,) = log_records("provider_admission_failed")
    assert rec.provider == "raises" and rec.reason == "admission check raised RuntimeError: bug in the plugin"


# -- a misbehaving provider or observer (probed by a helper, twenty-second session) ----------------


class _OddPlan(FakeProvider):
    def __init__(self, name, priority, **fields):
        super().__init__(name, priority)
        self.fields = fields

    def plan(self, request, device, settings) -> Plan:
        return dataclasses.replace(super().plan(request, device, settings), **self.fields)


@pytest.mark.parametrize(("fields", "problem"), [
    ({"specialization": [1, 2]}, "specialization=[1, 2] (allowed: a hashable tuple)"),
    ({"grid": 5}, "grid=5 (allowed: a tuple of ints, or None)"),
    ({"notes": "one note"}, "notes='one note' (allowed: a tuple of str)"),
    ({"route": ""}, "route='' (allowed: a non-empty str)"),
])
def test_a_plan_with_unusable_fields_passes_the_provider_over(install, fields, problem):
    """An unhashable specialization failed every call (outside the pass-over logic); grid=5 crashed explain."""
    install(registry_from([ProvidersPlugin(_OddPlan("odd", 50, **fields), FakeProvider("good", 1, fill=3.0))]))
    q, k, v, md = decode_batch()
    out = ma.paged_attention(q, k, v, metadata=md)
    assert float(out.flatten()[0]) == 3.0 and diagnostics.last_dispatch().provider == "good"
    row = next(r for r in ma.explain(q_lens=[1], seq_lens=[5], num_heads=8, num_kv_heads=2, head_size=64,
                                     dtype="float32").rows if r.name == "odd")
    assert not row.admitted and row.reasons == (f"plan() returned a Plan with {problem}",)


def test_a_raising_selection_observer_does_not_fail_the_call(install, log_records):
    class Broken:
        @hookimpl
        def metal_attn_provider_selected(self, request, provider, route, reasons) -> None:
            raise RuntimeError("observer bug")

    install(registry_from([ProvidersPlugin(FakeProvider("good", 1, fill=2.0)), Broken()]))
    q, k, v, md = decode_batch()
    for _ in range(2):
        out = ma.paged_attention(q, k, v, metadata=md)
        assert float(out.flatten()[0]) == 2.0
    [rec] = log_records("provider_selected_observer_failed")
    assert rec.reason == "RuntimeError: observer bug"


@pytest.mark.parametrize(("attr", "value", "message"), [
    ("head_sizes", 64, "head_sizes=64 (allowed: a set of positive ints, or None for any)"),
    ("dtypes", frozenset({mx.float16}), "dtypes=frozenset({mlx.core.float16}) (allowed: a set of dtype names"),
    ("features", frozenset({"sink"}), "features=frozenset({'sink'}) (allowed: a set of ['sinks',"),
    ("phases", frozenset({"decoding"}), "phases=frozenset({'decoding'}) (allowed: a set of"),
    ("mixed_dtypes", "no", "mixed_dtypes='no' (allowed: True or False)"),
])
def test_declarations_are_checked_when_added(attr, value, message):
    """providers/doctor crashed on head_sizes=64 or dtypes of mx dtypes; a 'sink' typo or mixed_dtypes='no'
    (truthy) were taken silently."""
    p = FakeProvider("odd", 1)
    setattr(p, attr, value)
    with pytest.raises(RegistryError) as err:
        Registry().add(p)
    assert message in str(err.value)


def test_names_that_differ_only_by_case_are_refused():
    reg = Registry()
    reg.add(FakeProvider("classic_like", 1))
    with pytest.raises(RegistryError, match="differs from the registered 'classic_like' only by case"):
        reg.add(FakeProvider("Classic_Like", 2))


@pytest.mark.parametrize(("returned", "reasons"), [
    (None, ("admission check raised TypeError: extra_reasons() returned None (allowed: a list of str, empty to "
            "admit)",)),  # a forgotten return: 'NoneType' object is not iterable, naming no hook
    ((r for r in ["too long"]), ("too long",)),  # a generator was read by the check and then found empty
])
def test_extra_reasons_that_return_none_or_a_generator(returned, reasons):
    class Sloppy(FakeProvider):
        def extra_reasons(self, request, device, settings):
            return returned

    reg = registry_from([ProvidersPlugin(Sloppy("sloppy", 50), FakeProvider("good", 1))])
    row = next(r for r in reg.explain(AttentionRequest.from_lengths(q_lens=[1], seq_lens=[5]),
                                       DeviceInfo.preset("cpu-2core"), settings_mod.get_settings()).rows
               if r.name == "sloppy")
    assert row.reasons == reasons


def test_extra_reasons_as_a_bare_string_passes_the_provider_over():
    class Sloppy(FakeProvider):
        def extra_reasons(self, request, device, settings):
            return "too long"

    reg = registry_from([ProvidersPlugin(Sloppy("sloppy", 50), FakeProvider("good", 1))])
    row = next(r for r in reg.explain(AttentionRequest.from_lengths(q_lens=[1], seq_lens=[5]),
                                       DeviceInfo.preset("cpu-2core"), settings_mod.get_settings()).rows
               if r.name == "sloppy")
    assert row.reasons == ("admission check raised TypeError: extra_reasons() returned 'too long' (allowed: a "
                           "list of str, empty to admit)",)


@pytest.mark.parametrize("bad", ["none", "shape", "raises"])
def test_a_cache_writer_that_breaks_its_contract_is_named(install, bad):
    """write_cache's output went back to the caller unchecked (None, or pools of another shape and dtype);
    one that raised surfaced as the plugin's raw exception."""
    class Writer(FakeProvider):
        writes_cache = True

        def write_cache(self, key, value, k_cache, v_cache, slot_mapping, device):
            if bad == "raises":
                raise RuntimeError("writer bug")
            return None if bad == "none" else (k_cache[:1], v_cache.astype(mx.int32))

    install(registry_from([plugins._builtin_module(), ProvidersPlugin(Writer("writer", 10_000))],
                          names=["builtin", "fakes"]))
    _, k, v, _ = decode_batch()
    kv = mx.ones((1, k.shape[2], k.shape[3]), dtype=k.dtype)
    with pytest.raises(ma.ProviderContractError, match=r"provider 'writer': write_cache\(\) (returned|raised)"):
        ma.reshape_and_cache(kv, kv, k, v, mx.array([0]))
