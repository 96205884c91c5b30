"""Every registered provider through the conformance suite on this machine's backend.

Cells a provider does not admit are skipped with its own reasons, so
``pytest -rs tests/test_conformance.py`` prints the support matrix. The
reference provider admits every cell and must pass all of them. The checker
itself is tested below with deliberately wrong providers.
"""

from __future__ import annotations

import functools
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

import metal_attn
from metal_attn.plugins import get_registry
from metal_attn.provider import AttentionInputs, Plan, Provider, scatter_slots
from metal_attn.testing import (
    BOUNDS_SPECS,
    CONFORMANCE_SPECS,
    TOLERANCES,
    AttentionCase,
    admission_reasons,
    assert_close_to_oracle,
    attention_oracle,
    check_bounds_case,
    check_cache_writer,
    conformance_ids,
    make_case,
    request_kwargs,
    run_case,
    spec_by_label,
)
from metal_attn.testing.cases import to_numpy

PROVIDERS = [p["name"] for p in metal_attn.providers()]

#: Specs whose default (unforced) dispatch is also checked; the long ones are covered per provider.
SHORT_SPECS = [s for s in CONFORMANCE_SPECS if max(s["seq_lens"]) <= 2100]


@functools.lru_cache(maxsize=2)
def _case(label: str) -> tuple[AttentionCase, np.ndarray]:
    """The case and its oracle, shared by the consecutive tests (one per provider) of a spec."""
    case = make_case(**spec_by_label(label))
    return case, case.oracle()


def _skip_unless_admitted(spec: dict, provider: str) -> None:
    """Skip, with the provider's reasons, a spec it does not admit on this machine."""
    reasons = admission_reasons(spec, provider)
    if reasons:
        pytest.skip(f"{provider} does not admit {spec['label']}: " + "; ".join(reasons))


def _chosen_plan(spec: dict, provider: str | None = None) -> tuple[str, Plan]:
    table = metal_attn.explain(provider=provider, **request_kwargs(spec))
    row = table.chosen
    assert row is not None and row.plan is not None, f"nothing admits {spec['label']}:\n{table}"
    return row.name, row.plan


@pytest.mark.parametrize(
    ("spec", "provider"),
    [pytest.param(s, p, id=f"{p}-{s['label']}") for s in CONFORMANCE_SPECS for p in PROVIDERS],
)
def test_provider_conformance(spec: dict, provider: str) -> None:
    _skip_unless_admitted(spec, provider)
    _, plan = _chosen_plan(spec, provider)
    case, ref = _case(spec["label"])
    got = run_case(case, provider)
    record = metal_attn.diagnostics.last_dispatch()
    assert record is not None and record.op == "paged_attention"
    assert (record.provider, record.route, record.partition_size) == (provider, plan.route, plan.partition_size)
    assert record.backend == metal_attn.current_device().backend
    assert_close_to_oracle(got, ref, case.dtype, label=f"{spec['label']} via {provider}/{record.route}")


BOUNDS_PROVIDERS = [p for p in PROVIDERS if get_registry().get(p).reads_lengths_on_device]


@pytest.mark.parametrize(
    ("spec", "provider"),
    [pytest.param(s, p, id=f"{p}-{s['label']}") for s in BOUNDS_SPECS for p in BOUNDS_PROVIDERS],
)
def test_providers_that_read_lengths_on_the_device_run_bounds_metadata(spec: dict, provider: str) -> None:
    _skip_unless_admitted(spec, provider)
    record = check_bounds_case(make_case(**spec), provider)
    assert record.provider == provider


def test_bounds_metadata_is_refused_by_providers_that_read_lengths_on_the_host() -> None:
    case = make_case(**BOUNDS_SPECS[0])
    with pytest.raises(metal_attn.ProviderRefusedError, match="this provider reads per-sequence lengths on the host"):
        check_bounds_case(case, "reference")
    assert "classic" in BOUNDS_PROVIDERS and "reference" not in BOUNDS_PROVIDERS


@pytest.mark.parametrize("spec", SHORT_SPECS, ids=conformance_ids(SHORT_SPECS))
def test_default_dispatch_is_the_explained_choice(spec: dict) -> None:
    name, plan = _chosen_plan(spec)
    case, ref = _case(spec["label"])
    got = run_case(case)
    record = metal_attn.diagnostics.last_dispatch()
    assert (record.provider, record.route, record.partition_size) == (name, plan.route, plan.partition_size)
    assert_close_to_oracle(got, ref, case.dtype, label=f"{spec['label']} via {name}/{record.route}")


def test_reference_admits_every_spec() -> None:
    refused = {s["label"]: admission_reasons(s, "reference") for s in CONFORMANCE_SPECS}
    assert {k: v for k, v in refused.items() if v} == {}


def test_specs_cover_the_promised_matrix() -> None:
    """The suite keeps covering what its docstring promises (guards against silent pruning)."""
    specs = CONFORMANCE_SPECS
    ratios = {s["num_heads"] // s["num_kv_heads"] for s in specs}
    assert {1, 2, 4, 8} <= ratios and any(s["num_kv_heads"] == 1 for s in specs)
    assert {s["dtype"] for s in specs} == {"float32", "float16", "bfloat16"}
    assert {64, 128} <= {s["head_size"] for s in specs}
    assert {8, 16, 32} <= {s["block_size"] for s in specs}
    lens = {n for s in specs for n in s["seq_lens"]}
    assert {1, 15, 16, 17, 511, 512, 513} <= lens
    phases = {metal_attn.AttentionRequest.from_lengths(q_lens=s["q_lens"], seq_lens=s["seq_lens"]).phase.value
              for s in specs}
    assert phases == {"decode", "prefill", "mixed", "verify"}
    assert any(q < n for s in specs for q, n in zip(s["q_lens"], s["seq_lens"], strict=True) if q > 1)
    assert any(s.get("sinks") for s in specs) and any(s.get("softcap") for s in specs)
    windows = [(s["sliding_window"], s["block_size"], max(s["seq_lens"])) for s in specs if s.get("sliding_window")]
    assert any(w < bs for w, bs, _ in windows), "a window smaller than a page"
    assert any(n - w > 512 for w, _, n in windows), "partitions entirely left of a window"
    assert any(s.get("score_bias") for s in specs) and any(s.get("shared_prefix_blocks") for s in specs)
    assert max(n for s in specs for n in s["seq_lens"]) > 32768
    # The non-finite contract: NaN, +Inf and -Inf in q, K and V; at masked positions (past a row's
    # causal end, left of its window) too; with sinks and softcap; in every dtype.
    planted = [(p[0], p[4], s) for s in specs for p in s.get("poison", ())]
    kinds = {(what, "nan" if math.isnan(v) else ("+inf" if v > 0 else "-inf")) for what, v, _ in planted}
    assert {(w, x) for w in "qk" for x in ("nan", "+inf", "-inf")} | {("v", "nan"), ("v", "+inf")} <= kinds
    assert {"float32", "float16", "bfloat16"} <= {s["dtype"] for _, _, s in planted}
    assert any(s.get("sliding_window") for _, _, s in planted) and any(s.get("sinks") for _, _, s in planted)
    assert any(s.get("softcap") for _, _, s in planted) and any(max(s["q_lens"]) > 1 for _, _, s in planted)
    assert len(set(conformance_ids())) == len(specs)
    assert any(s.get("scale") is not None and abs(s["scale"] - s["head_size"] ** -0.5) > 1e-3 for s in specs)


def test_an_unregistered_provider_is_an_error_not_a_skipped_suite() -> None:
    """admission_reasons gave "not registered" as a refusal reason, so a suite that skips on them skipped every
    case of a misspelled or missing provider and passed having checked nothing."""
    with pytest.raises(metal_attn.InvalidInputError, match=r"provider='no_such' is not registered \(registered: "):
        admission_reasons(CONFORMANCE_SPECS[0], "no_such")


# -- the checker fails wrong providers ------------------------------------------------------------


class _Mutant(Provider):
    """A provider computing attention with one deliberate mistake (numpy, through the oracle)."""

    backends = frozenset({"metal", "cuda", "cpu"})
    features = frozenset({"sinks", "sliding_window", "softcap"})
    mutation = ""

    def __init__(self, mutation: str) -> None:
        self.mutation = mutation
        self.name = f"mutant_{mutation}"

    def plan(self, request, device, settings) -> Plan:
        return Plan(provider=self.name, route=self.name)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        md = inputs.metadata
        q, kc, vc = (to_numpy(x) for x in (inputs.q, inputs.k_cache, inputs.v_cache))
        tables = np.array(md.block_tables)
        sinks = to_numpy(inputs.sinks) if inputs.sinks is not None else None
        window = inputs.sliding_window
        if self.mutation == "zeros":
            return mx.zeros(inputs.q.shape, dtype=inputs.q.dtype)
        if self.mutation in ("writes_q", "writes_pool"):  # the right output, then the caller's array changed
            out = attention_oracle(q, kc, vc, tables, np.array(md.seq_lens), np.array(md.cu_seqlens_q),
                                   scale=inputs.scale, sinks=sinks, sliding_window=window, softcap=inputs.softcap)
            if self.mutation == "writes_q":
                inputs.q[0] = inputs.q[0] * 2
            else:
                inputs.k_cache[int(tables[0, 0])] = 0
            return mx.array(out.astype(np.float32)).astype(inputs.q.dtype)
        scale = inputs.scale
        if self.mutation == "default_scale":  # ignores inputs.scale
            scale = q.shape[2] ** -0.5
        if self.mutation == "sink_twice":
            sinks = sinks + math.log(2.0)
        elif self.mutation == "window_plus_one":
            window = window + 1
        elif self.mutation == "ignores_block_table":
            tables = np.tile(np.arange(tables.shape[1], dtype=np.int32), (tables.shape[0], 1))
        elif self.mutation == "gqa_modulo":  # head h reads kv head h % num_kv_heads
            idx = np.arange(q.shape[1]) % kc.shape[2]
            kc, vc = kc[:, :, idx], vc[:, :, idx]
        elif self.mutation in ("hides_nonfinite", "masked_nan_leaks"):
            out = attention_oracle(q, kc, vc, tables, np.array(md.seq_lens), np.array(md.cu_seqlens_q),
                                   scale=inputs.scale, sinks=sinks, sliding_window=window, softcap=inputs.softcap)
            if self.mutation == "hides_nonfinite":  # classic's old CPU kernel: a NaN row became 0
                out = np.where(np.isfinite(out), out, 0.0)
            else:  # the old reference provider: every row of a sequence sees its whole K/V
                cu = np.concatenate([[0], np.cumsum(md.q_lens_host)])
                for s, (q0, q1) in enumerate(itertools.pairwise(cu)):
                    blocks = tables[s, : -(-md.seq_lens_host[s] // kc.shape[1])]
                    whole = vc[blocks].reshape(-1, *vc.shape[2:])[: md.seq_lens_host[s]]
                    leak = ~np.isfinite(whole).all(axis=(0, 2))  # per kv head
                    group = q.shape[1] // kc.shape[2]
                    out[q0:q1, np.repeat(leak, group)] = np.nan
            return mx.array(out.astype(np.float32)).astype(inputs.q.dtype)
        elif self.mutation == "max_pinned_at_zero":  # the old neutral-partial bug, with the kernel's epsilon
            out = _pinned_max_attention(q, kc, vc, tables, md, inputs.scale, window)
            return mx.array(out.astype(np.float32)).astype(inputs.q.dtype)
        out = attention_oracle(q, kc, vc, tables, np.array(md.seq_lens), np.array(md.cu_seqlens_q),
                               scale=scale, sinks=sinks, sliding_window=window, softcap=inputs.softcap)
        return mx.array(out.astype(np.float32)).astype(inputs.q.dtype)


def _pinned_max_attention(q, kc, vc, tables, md, scale, window):
    """Decode rows only, float32, max clamped at >= 0 as a max=0 neutral partial does."""
    out = np.zeros(q.shape, dtype=np.float32)
    bs, kvh = kc.shape[1], kc.shape[2]
    group = q.shape[1] // kvh
    for i, n in enumerate(md.seq_lens_host):
        lo = max(0, n - window)
        blocks = tables[i, : -(-n // bs)]
        k = kc[blocks].reshape(-1, kvh, q.shape[2])[lo:n].astype(np.float32)
        v = vc[blocks].reshape(-1, kvh, q.shape[2])[lo:n].astype(np.float32)
        for h in range(q.shape[1]):
            s = (k[:, h // group] @ q[i, h].astype(np.float32)) * np.float32(scale)
            p = np.exp(s - max(np.float32(0.0), s.max()))
            out[i, h] = (p @ v[:, h // group]) / (p.sum() + np.float32(1e-6))
    return out


@pytest.mark.parametrize(
    ("mutation", "label"),
    [
        ("zeros", "mixed"),
        ("sink_twice", "sinks-decode"),
        ("sink_twice", "mixed-sinks-bfloat16"),
        ("window_plus_one", "window-spans-partitions-bfloat16"),
        ("window_plus_one", "window-prefill-continuation"),
        ("ignores_block_table", "decode-page-edges-float16"),
        ("gqa_modulo", "decode-gqa4"),
        ("max_pinned_at_zero", "neutral-partial"),
        ("max_pinned_at_zero", "neutral-partial-bfloat16"),
        ("hides_nonfinite", "nonfinite-q-decode"),
        ("hides_nonfinite", "nonfinite-k-softcap"),
        ("masked_nan_leaks", "nonfinite-masked-causal"),
        ("masked_nan_leaks", "nonfinite-masked-window"),
        ("default_scale", "scale-decode"),  # no spec set a scale: such a provider passed everything
        ("default_scale", "scale-mixed-softcap"),
    ],
)
def test_checker_rejects_a_wrong_provider(mutation: str, label: str) -> None:
    get_registry().add(_Mutant(mutation))
    case = make_case(**spec_by_label(label))
    got = run_case(case, provider=f"mutant_{mutation}")
    with pytest.raises(AssertionError, match=r"differs from the float64 oracle|not finite|are finite where"):
        assert_close_to_oracle(got, case.oracle(), case.dtype, label=label)


@pytest.mark.parametrize("mutation", ["writes_q", "writes_pool"])
def test_the_checker_rejects_a_provider_that_changes_the_caller_s_arrays(mutation: str) -> None:
    """A provider that gave the right output and then changed the caller's query or a used page passed every
    conformance case: only the output was compared."""
    get_registry().add(_Mutant(mutation))
    case = make_case(**spec_by_label("mixed"))
    name = {"writes_q": "q", "writes_pool": "k_cache"}[mutation]
    with pytest.raises(AssertionError, match=rf"\[mixed\] paged_attention changed the caller's {name} "):
        run_case(case, provider=f"mutant_{mutation}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_built_in_cache_writers_pass_the_writer_check(dtype: str) -> None:
    writers = sorted(e.provider.name for e in get_registry().entries if e.provider.writes_cache)
    assert writers == ["classic", "reference"]
    for name in writers:
        check_cache_writer(name, dtype)


class _NaiveWriter(_Mutant):
    """A cache writer through `scatter_slots` alone: a padding slot (-1) wraps to the pool's last slot."""

    writes_cache = True

    def __init__(self) -> None:
        super().__init__("naive_writer")

    def write_cache(self, key, value, k_cache, v_cache, slots, device):
        return scatter_slots(k_cache, key, slots), scatter_slots(v_cache, value, slots)


def test_the_writer_check_rejects_a_writer_that_writes_padding() -> None:
    """A third-party writer built on `scatter_slots` as the docs offered it wrote padding rows (slot -1) into the
    pool's last slot; `write_slots` skips them, and the writer check catches a writer that does not."""
    get_registry().add(_NaiveWriter())
    with pytest.raises(AssertionError, match=r"provider 'mutant_naive_writer': write_cache \(padding \(negative "
                                             r"slots\) among them.*differs from pool\[slot\] = key .* at "
                                             r"slots \[89, 95\]"):
        check_cache_writer("mutant_naive_writer")


def test_relative_l2_catches_zero_output_that_absolute_tolerance_accepts() -> None:
    """At 128K context the outputs are small enough that an all-zero output passes atol + rtol alone."""
    case = make_case(q_lens=[1], seq_lens=[131072], num_heads=8, num_kv_heads=1, head_size=128, block_size=32,
                     dtype="bfloat16", contiguous=True)
    ref = case.oracle()
    got = np.zeros_like(ref)
    tol = TOLERANCES["bfloat16"]
    assert (np.abs(got - ref) <= tol.atol + tol.rtol * np.abs(ref)).all()
    with pytest.raises(AssertionError, match=r"0 of \d+ elements exceed.*relative L2 error 1 at token 0"):
        assert_close_to_oracle(got, ref, "bfloat16", label="zeros")


def test_checker_message_names_the_worst_element() -> None:
    ref = np.zeros((3, 2, 4)) + 1.0
    got = ref.copy()
    got[2, 1, 3] += 0.5
    with pytest.raises(AssertionError) as info:
        assert_close_to_oracle(got, ref, "float32", label="demo")
    msg = str(info.value)
    assert "[demo] float32 output differs" in msg
    assert "1 of 24 elements exceed" in msg and "(token, head, dim)=(2, 1, 3): got 1.5, expected 1" in msg
    assert "at token 2" in msg
    got[0, 0, 0] = np.nan
    leaked = (r"1 \(token, head\) outputs are not finite where the oracle is finite .*"
              r"first at \(token, head, dim\)=\(0, 0, 0\): nan")
    with pytest.raises(AssertionError, match=leaked):
        assert_close_to_oracle(got, ref, "float32")
    # Where the oracle is NaN (a NaN/Inf input reaches the pair), a finite output is the failure ...
    got = ref.copy()
    ref_bad = ref.copy()
    ref_bad[1, 0, :] = np.nan
    hidden = r"1 \(token, head\) outputs are finite where a NaN/Inf input reaches them.*\(token, head\)=\(1, 0\)"
    with pytest.raises(AssertionError, match=hidden):
        assert_close_to_oracle(got, ref_bad, "float32")
    # ... and one non-finite element there is enough, while the rest must still match.
    got[1, 0, 2] = np.inf
    assert_close_to_oracle(got, ref_bad, "float32")
    got[2, 1, 0] += 1.0
    with pytest.raises(AssertionError, match=r"1 of 24 elements exceed.*\(2, 1, 0\)"):
        assert_close_to_oracle(got, ref_bad, "float32")
    with pytest.raises(AssertionError, match=r"output shape \(3, 2\) != expected \(3, 2, 4\)"):
        assert_close_to_oracle(ref[..., 0], ref, "float32")
