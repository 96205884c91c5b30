"""The conformance suite: named cases, tolerances, and the checks every provider must pass.

Every built-in provider runs through `CONFORMANCE_SPECS` in ``tests/test_conformance.py``;
a third-party provider runs through the same specs from its own test suite. A
spec is a dict of keyword arguments for `make_case` (its ``label`` is the test
id). Cells a provider does not admit are skipped with the provider's own
reasons, so ``pytest -rs`` prints its support matrix::

    # tests/test_my_provider.py in your plugin package
    import pytest

    from metal_attn.testing import CONFORMANCE_SPECS, admission_reasons, check_case, conformance_ids, make_case

    @pytest.mark.parametrize("spec", CONFORMANCE_SPECS, ids=conformance_ids())
    def test_conformance(spec):
        reasons = admission_reasons(spec, provider="my_provider")  # from metal_attn.explain(...)
        if reasons:
            pytest.skip("my_provider: " + "; ".join(reasons))
        record = check_case(make_case(**spec), provider="my_provider")
        assert record.provider == "my_provider"

`check_case` runs ``metal_attn.paged_attention(..., provider=...)``, checks the
output's shape and dtype, compares it with the float64 oracle
(`assert_close_to_oracle`: elementwise tolerance *and* relative L2 error, since
absolute tolerances alone accept an all-zero output at long context) and
returns the dispatch record, whose ``route`` you can assert too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from metal_attn.testing.cases import AttentionCase, dtype_name, make_case, to_numpy


class Tolerance(NamedTuple):
    """Elementwise ``|out - ref| <= atol + rtol * |ref|``, and per query token
    ``||out[t] - ref[t]|| <= rel_l2 * ||ref[t]||`` (norms over all heads and dims)."""

    atol: float
    rtol: float
    rel_l2: float


#: Per output dtype. float32: fp32 accumulation over up to ~33k tokens; float16/bfloat16:
#: a few ulps of the output dtype (partials and output are rounded to it).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4, rel_l2=1e-4),
    "float16": Tolerance(atol=2e-3, rtol=4e-3, rel_l2=1.5e-3),
    "bfloat16": Tolerance(atol=1.6e-2, rtol=3.2e-2, rel_l2=1.2e-2),
}


def rel_l2(got: Any, ref: Any) -> float:
    """``||got - ref|| / ||ref||`` in float64 (MLX arrays or numpy; 0/0 counts as 0)."""
    g, r = _as_f64(got), _as_f64(ref)
    return float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))


def _as_f64(out: Any) -> np.ndarray:
    if isinstance(out, mx.array):
        return to_numpy(out).astype(np.float64)
    return np.asarray(out, dtype=np.float64)


def assert_close_to_oracle(out: Any, ref: np.ndarray, dtype: Any, *, label: str = "") -> None:
    """Assert ``out`` (MLX or numpy) matches the float64 ``ref`` within ``TOLERANCES[dtype]``.

    Checks shape, the non-finite contract, the elementwise bound and the relative L2 bound.
    Where the oracle is NaN (a NaN or infinity in the inputs reaches that (token, head): see
    `attention_oracle`), ``out[token, head]`` must hold at least one non-finite element; everywhere
    else every element must be finite and close. The message shows the first (token, head) that
    breaks the contract, or the worst element (where, got, expected), how many elements fail, and
    the relative L2 error against its bound.
    """
    tol = TOLERANCES[dtype_name(dtype)]
    got = _as_f64(out)
    ref = np.asarray(ref, dtype=np.float64)
    where = f"[{label}] " if label else ""
    if got.shape != ref.shape:
        raise AssertionError(f"{where}output shape {got.shape} != expected {ref.shape}")
    # The non-finite contract, per (token, head) vector.
    want_bad = np.isnan(ref).any(axis=-1) if ref.ndim > 1 else np.isnan(ref)
    got_bad = ~np.isfinite(got).all(axis=-1) if got.ndim > 1 else ~np.isfinite(got)
    hidden = want_bad & ~got_bad
    if hidden.any():
        idx = tuple(int(i) for i in np.argwhere(hidden)[0])
        raise AssertionError(
            f"{where}{int(hidden.sum())} (token, head) outputs are finite where a NaN/Inf input reaches them "
            f"(the contract: a non-finite q, or K/V at an attended position, makes the output non-finite); "
            f"first at (token, head)={idx}: {got[idx][:4]}..."
        )
    leaked = got_bad & ~want_bad
    if leaked.any():
        idx = tuple(int(i) for i in np.argwhere(leaked)[0])
        bad_el = ~np.isfinite(got[idx])
        el = int(np.argmax(bad_el)) if got.ndim > 1 else 0
        value = got[idx][el] if got.ndim > 1 else got[idx]
        raise AssertionError(
            f"{where}{int(leaked.sum())} (token, head) outputs are not finite where the oracle is finite (a value "
            f"the row does not attend to, or none at all, leaked in); first at (token, head, dim)={(*idx, el)}: "
            f"{value} (expected {ref[idx][el] if got.ndim > 1 else ref[idx]:.6g})"
        )
    if want_bad.any():  # compare the finite part only
        got = np.where(want_bad[..., None] if got.ndim > 1 else want_bad, 0.0, got)
        ref = np.where(want_bad[..., None] if ref.ndim > 1 else want_bad, 0.0, ref)
    err = np.abs(got - ref)
    bound = tol.atol + tol.rtol * np.abs(ref)
    excess = err - bound
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape))
    n_bad = int((excess > 0).sum())
    # Relative L2 error per query token (all heads and dims): a long-context row whose output is
    # small cannot hide behind a short row with a large output.
    rows = ref.reshape(ref.shape[0], -1) if ref.ndim > 1 else ref.reshape(1, -1)
    diff = (got - ref).reshape(rows.shape)
    row_norm = np.linalg.norm(rows, axis=1)
    rel = np.linalg.norm(diff, axis=1) / np.maximum(row_norm, np.finfo(np.float64).tiny)
    t = int(np.argmax(rel)) if rel.size else 0
    rel_l2 = float(rel[t]) if rel.size else 0.0
    if n_bad or rel_l2 > tol.rel_l2:
        imax = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape))
        raise AssertionError(
            f"{where}{dtype_name(dtype)} output differs from the float64 oracle: "
            f"{n_bad} of {got.size} elements exceed atol={tol.atol:g} + rtol={tol.rtol:g}*|ref| "
            f"(worst at (token, head, dim)={worst}: got {got[worst]:.6g}, expected {ref[worst]:.6g}); "
            f"max abs error {err[imax]:.3g} at {imax}; relative L2 error {rel_l2:.3g} at token {t} "
            f"(bound {tol.rel_l2:g}, |ref[{t}]|={row_norm[t]:.3g})"
        )


def run_case(case: AttentionCase, provider: str | None = None) -> np.ndarray:
    """Run ``metal_attn.paged_attention`` on ``case`` (optionally forcing ``provider``); float64 result. Asserts
    the output's shape and dtype, and that the call left the caller's arrays (query, pools, sinks) as they were."""
    import metal_attn

    return _call_checked(case, lambda: metal_attn.paged_attention(**case.kwargs(), provider=provider))


def _call_checked(case: AttentionCase, call: Any, what: str = "paged_attention") -> np.ndarray:
    """``call()`` (a `paged_attention` call on ``case``'s arrays), evaluated, as float64; asserts the output's
    shape and dtype and that the call left the caller's arrays (query, pools, sinks) as they were."""
    inputs = {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache, "sinks": case.sinks}
    before = {name: _bits(x) for name, x in inputs.items() if x is not None}
    out = call()
    mx.eval(out)
    if type(out) is not mx.array or out.dtype != case.q.dtype or tuple(out.shape) != tuple(case.q.shape):
        raise AssertionError(
            f"[{case.label}] {what}'s output is {dtype_name(getattr(out, 'dtype', None))} "
            f"{tuple(getattr(out, 'shape', ()))}; the contract is the query's {case.dtype} {tuple(case.q.shape)}"
        )
    _assert_unchanged(inputs, before, f"[{case.label}] {what}")
    return to_numpy(out).astype(np.float64)


def _bits(x: mx.array) -> np.ndarray:
    """``x``'s elements as unsigned integers of their width (bfloat16 included), for bit-for-bit comparisons."""
    return np.array(x.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.itemsize]))


def _assert_unchanged(arrays: Mapping[str, Any], before: Mapping[str, np.ndarray], what: str) -> None:
    """Each of ``arrays`` named in ``before`` (`_bits`) still holds those values, bit for bit."""
    for name, old in before.items():
        now = _bits(arrays[name])
        if now.shape != old.shape or not np.array_equal(now, old):
            raise AssertionError(f"{what} changed the caller's {name} (the contract: a provider never writes its "
                                 "inputs; it returns new arrays)")


def check_cache_writer(provider: str, dtype: str = "float16", *, seed: int = 0) -> None:
    """Assert that ``provider``'s `write_cache` (a provider with ``writes_cache = True``) honours
    `metal_attn.reshape_and_cache`'s contract: ``pool[slot] = row`` for the slots inside the pool, in any
    order; negative slots (padding) skipped, and slots past the pool too (they reach a writer when
    ``METAL_ATTN_VALIDATE_METADATA=0``); everything else in the pools as it was; the caller's ``key``,
    ``value`` and pools unchanged. Compared with a numpy scatter, bit for bit."""
    from metal_attn.device import current_device
    from metal_attn.plugins import get_registry

    writer = get_registry().get(provider)
    rng = np.random.default_rng(seed)
    num_blocks, block_size, kv_heads, head = 6, 16, 2, 64
    slots_total = num_blocks * block_size
    mdt = getattr(mx, dtype)
    pools = [mx.array(rng.standard_normal((num_blocks, block_size, kv_heads, head)).astype(np.float32)).astype(mdt)
             for _ in range(2)]
    in_pool = rng.choice(slots_total, size=20, replace=False)
    cases = {
        "slots in the pool, shuffled": in_pool,
        "padding (negative slots) among them": np.concatenate([in_pool[:5], [-1], in_pool[5:9], [-7, -1]]),
        "slots past the pool (validation off)": np.concatenate([in_pool[:4], [slots_total, slots_total + 40]]),
        "padding only": np.array([-1, -1, -3]),
    }
    for label, slots in cases.items():
        n = slots.size
        key, value = (mx.array(rng.standard_normal((n, kv_heads, head)).astype(np.float32)).astype(mdt)
                      for _ in range(2))
        inputs = {"key": key, "value": value, "k_cache": pools[0], "v_cache": pools[1]}
        before = {name: _bits(x) for name, x in inputs.items()}
        out = writer.write_cache(key, value, pools[0], pools[1], mx.array(slots.astype(np.int64)), current_device())
        mx.eval(out)
        what = f"provider {provider!r}: write_cache ({label}, slots {slots.tolist()})"
        _assert_unchanged(inputs, before, what)
        for got, pool, rows in zip(out, ("k_cache", "v_cache"), ("key", "value")):
            want = before[pool].reshape(slots_total, kv_heads, head).copy()
            keep = (slots >= 0) & (slots < slots_total)
            want[slots[keep]] = before[rows][keep]
            if not (isinstance(got, mx.array) and got.dtype == mdt and tuple(got.shape) == before[pool].shape):
                raise AssertionError(f"{what}: returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))} for "
                                     f"{pool} (allowed: an mx.array of the pool's shape and dtype)")
            diff = (_bits(got).reshape(slots_total, -1) != want.reshape(slots_total, -1)).any(axis=1)
            if diff.any():
                raise AssertionError(f"{what}: the new {pool} differs from pool[slot] = {rows} (padding and slots "
                                     f"past the pool skipped) at slots {np.nonzero(diff)[0][:8].tolist()}")


def check_case(case: AttentionCase, provider: str | None = None) -> Any:
    """Run ``case``, assert it matches the oracle, and return the dispatch record."""
    import metal_attn

    got = run_case(case, provider)
    record = metal_attn.diagnostics.last_dispatch()
    assert_close_to_oracle(got, case.oracle(), case.dtype, label=f"{case.label} via {getattr(record, 'route', '?')}")
    return record


def check_bounds_case(case: AttentionCase, provider: str | None = None) -> Any:
    """Run the decode-only ``case`` with `AttentionMetadata.decode_bounds` metadata (the host sees
    a bound of twice the table's width in blocks for every row, the device the real lengths and
    tables), assert it matches the oracle, and return the dispatch record. A provider that sets
    ``reads_lengths_on_device`` must pass this on every spec of `BOUNDS_SPECS` it admits."""
    import metal_attn
    from metal_attn.metadata import AttentionMetadata

    if any(n != 1 for n in case.q_lens):
        raise ValueError(f"[{case.label}] check_bounds_case needs decode rows only (q_lens={case.q_lens})")
    rows, width = case.block_tables.shape
    tables = np.zeros((rows, 2 * width), dtype=np.int32)
    tables[:, :width] = case.block_tables
    block_size = int(case.k_cache.shape[1])
    md = AttentionMetadata.decode_bounds(mx.array(tables), mx.array(case.seq_lens.astype(np.int32)),
                                         max_seq_len=2 * width * block_size)
    kw = {k: v for k, v in case.kwargs().items() if k not in ("block_tables", "seq_lens", "cu_seqlens_q")}
    got = _call_checked(case, lambda: metal_attn.paged_attention(**kw, metadata=md, provider=provider),
                        "paged_attention with bounds metadata")
    record = metal_attn.diagnostics.last_dispatch()
    assert_close_to_oracle(got, case.oracle(), case.dtype,
                           label=f"{case.label} with bounds metadata via {getattr(record, 'route', '?')}")
    return record


def request_kwargs(spec: Mapping[str, Any] | AttentionCase) -> dict[str, Any]:
    """Keyword arguments for `metal_attn.explain` describing a spec's (or case's) request."""
    if isinstance(spec, AttentionCase):
        return spec.explain_kwargs()
    from metal_attn.api import kernel_block_size

    page = int(spec["block_size"])
    return {
        "q_lens": list(spec["q_lens"]),
        "seq_lens": list(spec["seq_lens"]),
        "dtype": dtype_name(spec.get("dtype", "float32")),
        "num_heads": int(spec["num_heads"]),
        "num_kv_heads": int(spec["num_kv_heads"]),
        "head_size": int(spec["head_size"]),
        "block_size": kernel_block_size(page) or page,
        "sinks": bool(spec.get("sinks", False)),
        "sliding_window": spec.get("sliding_window"),
        "softcap": spec.get("softcap"),
    }


def admission_reasons(spec: Mapping[str, Any] | AttentionCase, provider: str, device: Any = None) -> list[str]:
    """Why ``provider`` refuses a spec's request on ``device`` (empty when it admits it).

    A provider no plugin registered raises `InvalidInputError`: a conformance run that skips on these
    reasons would otherwise skip every case and pass having checked nothing (a misspelled name, a plugin
    that failed to import, autoloading off)."""
    import metal_attn
    from metal_attn.errors import InvalidInputError
    from metal_attn.plugins import get_registry

    registered = get_registry().names
    if provider not in registered:
        raise InvalidInputError(f"provider={provider!r} is not registered (registered: {', '.join(registered)}; "
                                "is its plugin installed, importable and not denied, and METAL_ATTN_PLUGIN_AUTOLOAD "
                                "on?)")
    table = metal_attn.explain(device=device, provider=provider, **request_kwargs(spec))
    row = next((r for r in table.rows if r.name == provider), None)
    if row is None:  # pragma: no cover - explain always lists the forced provider
        return [f"provider={provider!r} is not in the decision table"]
    return list(row.reasons)


def conformance_ids(specs: list[dict[str, Any]] | None = None) -> list[str]:
    """Test ids (the labels) of ``specs`` (default: `CONFORMANCE_SPECS`)."""
    return [s["label"] for s in (CONFORMANCE_SPECS if specs is None else specs)]


def spec_by_label(label: str) -> dict[str, Any]:
    """The spec called ``label``."""
    for s in CONFORMANCE_SPECS:
        if s["label"] == label:
            return s
    raise KeyError(f"no conformance spec is labelled {label!r}")


def _spec(label: str, q_lens: list[int], seq_lens: list[int], **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "label": label, "q_lens": q_lens, "seq_lens": seq_lens,
        "num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16, "dtype": "float32",
    }
    base.update(kw)
    # A stable per-spec seed so that every spec draws different data.
    base.setdefault("seed", sum(ord(c) * (i + 1) for i, c in enumerate(label)) % 100_003)
    return base


def _with_dtype(spec: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {**spec, "label": f"{spec['label']}-{dtype}", "dtype": dtype}


_DTYPE_VARIANTS: list[dict[str, Any]] = [
    _spec("decode-page-edges", [1] * 6, [1, 15, 16, 17, 31, 33]),
    _spec("prefill-continuation", [16, 7], [100, 40], num_heads=8, num_kv_heads=2),
    _spec("mixed", [1, 1, 5, 20], [50, 513, 5, 60]),
    _spec("mixed-sinks", [1, 1, 9], [70, 17, 40], sinks=True, num_heads=8, num_kv_heads=1),
    _spec("window-spans-partitions", [1, 1, 1], [1500, 700, 40], sliding_window=600),
    _spec("softcap-prefill", [24, 9], [24, 60], softcap=1.5),
    _spec("neutral-partial", [1, 1], [2000, 1100], sliding_window=64, score_bias=-120.0),
]

_NAN, _INF = float("nan"), float("inf")

#: The non-finite contract (``docs/providers.md``): a NaN or infinity in q, or in K/V at a position
#: a row attends to, makes that (row, head) non-finite; one at a position the row does not attend
#: (past its causal end, left of its window, in a partition left of the window) changes nothing.
NONFINITE_SPECS: list[dict[str, Any]] = [
    # q: NaN, +Inf and -Inf in three decode rows (one head each), with and without sinks.
    _spec("nonfinite-q-decode", [1, 1, 1], [40, 17, 300],
          poison=[("q", 0, 0, 0, _NAN), ("q", 1, 0, 3, _INF), ("q", 2, 0, 1, -_INF)]),
    _spec("nonfinite-q-sinks", [1, 5], [33, 20], sinks=True, num_heads=8, num_kv_heads=2,
          poison=[("q", 0, 0, 2, _NAN), ("q", 1, 3, 7, _INF)]),
    # K: NaN, -Inf (a score of -inf must not just drop the key) and +Inf at attended positions,
    # at page edges; with a softcap too (tanh would turn an infinite score into a finite one).
    _spec("nonfinite-k-decode", [1, 1, 1], [40, 17, 300],
          poison=[("k", 0, 15, 0, _NAN), ("k", 1, 16, 1, -_INF), ("k", 2, 0, 0, _INF)]),
    _spec("nonfinite-k-softcap", [1, 6], [90, 30], softcap=2.0,
          poison=[("k", 0, 89, 1, -_INF), ("k", 1, 2, 0, _INF)]),
    # V: NaN and +Inf at attended positions (also in the second 512-token partition).
    _spec("nonfinite-v-decode", [1, 1, 1], [40, 17, 1100],
          poison=[("v", 0, 39, 0, _NAN), ("v", 1, 0, 1, _INF), ("v", 2, 700, 0, _NAN)]),
    # Masked positions: a 4-row chunk on 32 tokens with NaN V at position 31 (only the last row
    # attends it) and NaN K at position 30 (rows 2 and 3); the other rows stay finite.
    _spec("nonfinite-masked-causal", [4], [32], poison=[("v", 0, 31, 0, _NAN), ("k", 0, 30, 1, _NAN)]),
    _spec("nonfinite-masked-continuation", [1, 9], [50, 40], num_heads=8, num_kv_heads=2,
          poison=[("v", 1, 39, 0, _NAN), ("v", 1, 35, 1, _INF), ("k", 1, 33, 1, -_INF)]),
    # Left of a sliding window: a decode row (window [32, 40)) and a 6-row chunk whose row i
    # attends [17 + i, 25 + i): V NaN at 31 and 20 reach rows 0-3 of the chunk only.
    _spec("nonfinite-masked-window", [1, 6], [40, 30], sliding_window=8,
          poison=[("v", 0, 31, 0, _NAN), ("k", 0, 39, 1, _NAN), ("v", 1, 20, 0, _NAN), ("k", 1, 16, 1, _NAN)]),
    # A whole partition left of the window (a neutral partial) holds NaN; the last partition
    # of another row holds it where it is attended.
    _spec("nonfinite-window-partitions", [1, 1], [2000, 1300], sliding_window=64,
          poison=[("v", 0, 100, 0, _NAN), ("k", 0, 600, 1, _NAN), ("v", 1, 1299, 1, _NAN)]),
]

#: The conformance cases: dicts of `make_case` keyword arguments, each with a unique ``label``.
CONFORMANCE_SPECS: list[dict[str, Any]] = [
    # -- decode: lengths at page and partition edges, GQA ratios 1/2/4/8 and MQA ----------
    _spec("decode-len1", [1], [1]),
    *_DTYPE_VARIANTS[:1],
    _spec("decode-partition-edges", [1, 1, 1], [511, 512, 513]),
    _spec("decode-two-partitions", [1, 1], [1025, 600], num_heads=8, num_kv_heads=2, head_size=128),
    _spec("decode-gqa1", [1, 1], [40, 100], num_heads=4, num_kv_heads=4),
    _spec("decode-gqa4", [1, 1], [40, 100], num_heads=8, num_kv_heads=2),
    _spec("decode-gqa8", [1, 1], [40, 100], num_heads=16, num_kv_heads=2),
    _spec("decode-mqa", [1, 1], [40, 100], num_heads=8, num_kv_heads=1),
    _spec("decode-head128", [1, 1], [70, 33], head_size=128),
    _spec("decode-bs8", [1] * 4, [7, 8, 9, 65], block_size=8),
    _spec("decode-bs32", [1] * 4, [31, 32, 33, 100], block_size=32),
    # -- prefill and continuation chunks --------------------------------------------------
    _spec("prefill-single", [37], [37]),
    _spec("prefill-page-edges", [15, 16, 17], [15, 16, 17]),
    _spec("prefill-partition-edges", [511, 513], [511, 513]),
    *_DTYPE_VARIANTS[1:2],
    _spec("prefill-continuation-crosses-partition", [64], [1100]),
    _spec("prefill-gqa1", [20, 9], [20, 30], num_heads=4, num_kv_heads=4),
    _spec("prefill-gqa4", [20, 9], [20, 30], num_heads=8, num_kv_heads=2),
    _spec("prefill-gqa8", [20, 9], [20, 30], num_heads=16, num_kv_heads=2),
    _spec("prefill-mqa", [20, 9], [20, 30], num_heads=8, num_kv_heads=1),
    _spec("prefill-head128", [33, 8], [33, 50], head_size=128),
    _spec("prefill-bs8", [9, 17], [9, 40], block_size=8),
    _spec("prefill-bs32", [33, 31], [33, 95], block_size=32),
    # -- mixed batches (decode rows first) and speculative verification -------------------
    *_DTYPE_VARIANTS[2:3],
    _spec("mixed-gqa8", [1, 1, 12], [300, 16, 12], num_heads=16, num_kv_heads=2, head_size=128),
    _spec("verify", [4, 4, 4], [20, 33, 64]),
    # -- sinks -----------------------------------------------------------------------------
    _spec("sinks-decode", [1, 1, 1], [1, 40, 600], sinks=True),
    _spec("sinks-prefill", [30], [30], sinks=True, num_heads=8, num_kv_heads=2),
    *_DTYPE_VARIANTS[3:4],
    # -- sliding windows ---------------------------------------------------------------------
    _spec("window1-prefill", [20], [20], sliding_window=1),
    _spec("window-smaller-than-page-decode", [1, 1, 1], [100, 3, 17], sliding_window=5),
    *_DTYPE_VARIANTS[4:5],
    _spec("window-prefill-continuation", [30, 17], [200, 17], sliding_window=40),
    _spec("window-mixed", [1, 1, 40], [300, 10, 90], sliding_window=24, block_size=8),
    # -- softcap -------------------------------------------------------------------------------
    _spec("softcap-decode", [1, 1], [90, 513], softcap=2.0),
    *_DTYPE_VARIANTS[5:6],
    _spec("all-features-mixed", [1, 1, 25], [600, 30, 80], sinks=True, sliding_window=50, softcap=3.0,
          num_heads=8, num_kv_heads=2),
    # -- a scale other than head_size ** -0.5 (a provider that ignored inputs.scale passed every case) --
    _spec("scale-decode", [1, 1, 1], [40, 513, 100], scale=0.3),
    _spec("scale-mixed-softcap", [1, 20, 9], [300, 20, 40], scale=0.02, softcap=3.0, num_heads=8, num_kv_heads=2),
    # -- a window whose partitions left of it must contribute a neutral partial ---------------
    *_DTYPE_VARIANTS[6:7],
    # -- shared prefix blocks and simple tables ------------------------------------------------
    _spec("shared-prefix-decode", [1, 1, 1], [40, 50, 33], shared_prefix_blocks=2),
    _spec("shared-prefix-prefill", [10, 10], [40, 45], shared_prefix_blocks=2),
    _spec("contiguous-tables", [1, 8], [30, 8], contiguous=True),
    # -- the same cases in float16 and bfloat16 -------------------------------------------------
    *(_with_dtype(s, d) for d in ("float16", "bfloat16") for s in _DTYPE_VARIANTS),
    # -- non-finite inputs in half precision, on the kernels' geometries -------------------------
    *(_with_dtype(s, d) for d in ("float16", "bfloat16") for s in NONFINITE_SPECS[::2]),
    _spec("nonfinite-gqa-decode-32x8x128-bfloat16", [1] * 3, [600, 1030, 17], num_heads=32, num_kv_heads=8,
          head_size=128, dtype="bfloat16",
          poison=[("q", 0, 0, 5, _NAN), ("k", 1, 1029, 3, -_INF), ("v", 2, 3, 7, _INF), ("v", 1, 600, 1, _NAN)]),
    _spec("nonfinite-prefill-head128-float16", [40, 24], [40, 90], num_heads=8, num_kv_heads=2, head_size=128,
          dtype="float16", poison=[("v", 0, 39, 0, _NAN), ("k", 0, 20, 1, _INF), ("v", 1, 89, 1, _NAN),
                                   ("v", 1, 70, 0, _INF), ("q", 1, 5, 6, _NAN)]),
    # -- upstream GQA-decode geometries (heads, kv heads, head, block) in half precision --------
    _spec("gqa-decode-32x8x128-bs16-float16", [1] * 4, [600, 1030, 17, 2049],
          num_heads=32, num_kv_heads=8, head_size=128, dtype="float16"),
    _spec("gqa-decode-32x8x128-bs16-bfloat16", [1] * 3, [513, 96, 1536],
          num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16"),
    _spec("gqa-decode-16x2x128-bs16-bfloat16", [1, 1], [3000, 300],
          num_heads=16, num_kv_heads=2, head_size=128, dtype="bfloat16"),
    _spec("gqa-decode-24x4x256-bs16-float16", [1, 1], [1537, 90],
          num_heads=24, num_kv_heads=4, head_size=256, dtype="float16"),
    _spec("gqa-decode-16x2x256-bs16-bfloat16", [1, 1], [800, 255],
          num_heads=16, num_kv_heads=2, head_size=256, dtype="bfloat16"),
    _spec("gqa-decode-16x2x256-bs32-bfloat16", [1, 1], [700, 2600],
          num_heads=16, num_kv_heads=2, head_size=256, block_size=32, dtype="bfloat16"),
    # -- non-finite inputs: poisoned (row, head) outputs are non-finite, nothing else is -------
    *NONFINITE_SPECS,
    # -- a few longer cases --------------------------------------------------------------------
    _spec("long-decode-32k-bfloat16", [1], [32769], num_heads=8, num_kv_heads=2, head_size=128, dtype="bfloat16"),
    _spec("long-decode-batch-float16", [1] * 4, [4096, 8193, 5000, 1],
          num_heads=32, num_kv_heads=8, head_size=128, dtype="float16"),
    _spec("long-prefill-chunk", [128], [4096], num_heads=8, num_kv_heads=2, head_size=128),
    _spec("long-mixed-decode-rows-bfloat16", [1, 1, 64], [4100, 5000, 64],
          num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16"),
]


#: Decode batches for `check_bounds_case`: lengths at page and partition edges far below the bound
#: (so launches made from it have partitions some rows never reach), sinks, softcap, GQA and MQA,
#: a NaN planted in q (the NaN contract holds there too).
BOUNDS_SPECS: list[dict[str, Any]] = [
    _spec("bounds-decode-edges", [1] * 7, [1, 15, 16, 17, 511, 512, 1100]),
    _spec("bounds-decode-sinks-gqa8", [1, 1, 1], [40, 700, 3], sinks=True, num_heads=8, num_kv_heads=1),
    _spec("bounds-decode-softcap", [1, 1], [90, 1030], softcap=2.0),
    _spec("bounds-decode-nan-q", [1, 1], [40, 600], poison=[("q", 1, 0, 2, _NAN)]),
    _with_dtype(_spec("bounds-decode-edges-h128", [1] * 4, [1, 513, 2048, 77], num_heads=8, num_kv_heads=2,
                      head_size=128), "bfloat16"),
]


def _check_unique_labels() -> None:
    seen: set[str] = set()
    for s in CONFORMANCE_SPECS:
        if s["label"] in seen:
            raise RuntimeError(f"duplicate conformance label {s['label']!r}")
        seen.add(s["label"])


_check_unique_labels()

__all__ = [
    "BOUNDS_SPECS",
    "CONFORMANCE_SPECS",
    "NONFINITE_SPECS",
    "TOLERANCES",
    "Tolerance",
    "admission_reasons",
    "assert_close_to_oracle",
    "check_bounds_case",
    "check_case",
    "conformance_ids",
    "make_case",
    "request_kwargs",
    "run_case",
    "spec_by_label",
]
