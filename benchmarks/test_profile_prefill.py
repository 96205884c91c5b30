"""`benchmarks/profile_prefill.py` without a GPU: every variant builds its graph against the route's
functions as they are now, with and without CUDA chains (the stand-ins of `metal_attn.testing.fake_cuda`).
The script once called a gather function that no longer existed, and only a GPU run found it."""

from __future__ import annotations

import mlx.core as mx
import profile_prefill as pp
import pytest

from metal_attn import cuda_ops
from metal_attn.bench.shapes import Shape, build_case
from metal_attn.testing.fake_cuda import fake_chains, fake_cuda
from metal_attn.testing.overrides import rule_opened_for


@pytest.mark.parametrize("chains", [True, False], ids=["chains", "mx.fast"])
def test_every_variant_builds_its_graph(monkeypatch, chains):
    shape = Shape(batch=2, num_heads=8, num_kv_heads=2, head_size=64, context=96, q_len=96)
    # A small batch, so the route's rule is opened for the forced provider (the tiles' by the rule).
    with fake_cuda(sdpa="zeros"), fake_chains(), rule_opened_for("sdpa_prefill"):
        if not chains:
            monkeypatch.setattr(cuda_ops, "enabled", lambda: False)
        case = build_case(shape)
        built = {label: fn() for label, fn in pp.variants(case)}
    assert list(built) == ["route", "mlx_sdpa", "gather", "sdpa q_view", "sdpa q_copy"]
    k, v = built["gather"]
    assert k.shape == v.shape == (2, 2, 96, 64)  # [n, KV heads, context, head]
    assert built["route"].shape == (2 * 96, 8, 64)
    for label in ("mlx_sdpa", "sdpa q_view", "sdpa q_copy"):
        assert mx.array(built[label]).shape == (2, 8, 96, 64), label
