"""pytest-benchmark group ``host-cost-python``: the Python host cost of the CUDA launch path, on any machine.

    pytest benchmarks/test_host_cost_python.py --benchmark-only

The cases and the method are `host_cost_python`'s (fake ``cuda_kernel`` objects, the H200 preset, the
built-in providers): one benchmark per case for the steady-state ``paged_attention`` call (layers 2..32
of a step) and one for the cache write. Only graph building is timed; nothing is evaluated. Compare saved runs
with ``--benchmark-compare-fail=median:10%``.
"""

from __future__ import annotations

import host_cost_python
import pytest
from host_cost_python import Case, bound_case, cases

import metal_attn
from metal_attn.plugins import get_registry
from metal_attn.settings import override_settings

CASES = {c.label: c for c in cases()}


@pytest.fixture(params=list(CASES), ids=[label.split(" (")[0].replace(" ", "-") for label in CASES])
def bound(request):
    case: Case = CASES[request.param]
    with bound_case(case) as b:
        yield b


@pytest.mark.benchmark(group="host-cost-python", disable_gc=True, min_rounds=2000)
def test_paged_attention_host_cost(benchmark, bound):
    benchmark.extra_info["provider"] = bound.provider
    benchmark.extra_info["route"] = bound.route
    benchmark.extra_info["launches"] = bound.launches
    benchmark(bound.attn)


@pytest.mark.benchmark(group="host-cost-python", disable_gc=True, min_rounds=2000)
def test_cache_write_host_cost(benchmark, bound):
    benchmark(bound.write)


def test_the_script_times_the_built_in_providers_and_names_each_case_s_provider_and_route(capsys):
    """With autoload on (the default) and the example decode plugin installed (CI installs it through its
    entry point), the b1 decode cases timed `example_gather_decode` under a column that named only its route,
    unless METAL_ATTN_PLUGIN_AUTOLOAD=0 was set. Each line now names the provider and route the H200 gets
    from the built-in providers (as `metal_attn.explain` gives them)."""
    with override_settings(plugin_autoload=False):
        builtin = set(get_registry().names)
        expected = {}
        for case in cases():
            s = case.shape
            with case.scope():
                chosen = metal_attn.explain(q_lens=list(s.q_lens), seq_lens=list(s.seq_lens), device=case.device(),
                                            num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                            head_size=s.head_size, dtype=s.dtype, block_size=s.block_size).chosen
            expected[case.label] = (chosen.name, chosen.plan.route)
    with override_settings(plugin_autoload=True):
        host_cost_python.main(["--calls", "1", "--samples", "1"])
    out = capsys.readouterr().out
    for label, (provider, route) in expected.items():
        line = next((x for x in out.splitlines() if x.startswith(f"{label} ")), None)
        assert line is not None, (label, out)
        assert tuple(line[len(label):].split()[:2]) == (provider, route), line
        assert provider in builtin
    assert "providers: the built-in ones only" in out
    # then MLX SDPA's graph building on each mixed batch: per group (the benchmark's peer) and from packed rows
    mixed = {c.shape.label for c in cases() if c.shape.phase == "mixed"}
    peer_lines = [x for x in out.splitlines() if x.startswith("peers of ")]
    assert {x.split(": ")[0].removeprefix("peers of ") for x in peer_lines} == mixed
    assert all(" mlx_sdpa " in x and " mlx_sdpa_packed " in x for x in peer_lines)


def test_the_cases_take_the_chained_route_unless_told_not_to():
    """As on an H200 with the chains' module built, a decode call is one chain call and a mixed batch two (the
    gathers, then the decode rows and the finishes); with chains off they are the mx.fast route's kernel launches."""
    by_label = {c.label: c for c in cases()}
    decode, mixed = by_label["b8 L4096 split"], by_label["mixed 32x1@1024 + 256@1024 + 256@2048"]
    with bound_case(decode) as b:
        assert (b.launches, b.chain_calls, b.sdpa_calls) == (0, 1, 0)
    with bound_case(mixed) as b:  # the decode rows inside the finish chain (cuda_decode_rows_in_chain)
        assert (b.launches, b.chain_calls, b.sdpa_calls) == (0, 2, 2)  # and MLX's SDPA once a run of chunks
    # METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=0: the decode rows in a chain of their own, one chain call more
    with bound_case(by_label["mixed 32x1@1024 + 256@1024 + 256@2048 (decode rows in their own chain)"]) as b:
        assert (b.provider, b.launches, b.chain_calls, b.sdpa_calls) == ("sdpa_prefill", 0, 3, 2)
    with bound_case(by_label["chunk 64@2112"]) as b:  # below the route's pairs bound: the split tiles' one chain
        assert (b.provider, b.launches, b.chain_calls, b.sdpa_calls) == ("tiled_prefill", 0, 1, 0)
    with bound_case(by_label["chunk 64@2112 (sdpa_prefill rule opened)"]) as b:  # the gathers, cuDNN, the finishes
        assert (b.provider, b.launches, b.chain_calls, b.sdpa_calls) == ("sdpa_prefill", 0, 2, 1)
    with bound_case(decode, chains=False) as b:
        assert (b.launches, b.chain_calls) == (2, 0)  # the split kernel and its reducer
    with bound_case(mixed, chains=False) as b:
        assert b.launches > 3 and b.chain_calls == 0


def test_the_sdpa_stand_in_gives_the_outputs_shape_and_counts_its_calls():
    import mlx.core as mx

    from metal_attn.testing.fake_cuda import fake_cuda

    q, k, v = mx.zeros((2, 8, 5, 64), mx.float16), mx.zeros((2, 2, 9, 64), mx.float16), mx.zeros((2, 2, 9, 32))
    with fake_cuda(sdpa="zeros") as fake:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask="causal")
        again = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1)
        fake.record = False
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1)
    assert out.shape == (2, 8, 5, 32) and out.dtype == mx.float16 and again is out
    assert fake.sdpa_calls == 2
    with pytest.raises(ValueError, match=r"sdpa='fused' \(allowed: unfused, zeros\)"), fake_cuda(sdpa="fused"):
        pass
