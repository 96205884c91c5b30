"""The ``gqa_decode`` provider on a GPU backend (run on the H200 through MLX CUDA).

Against the float64 oracle (`metal_attn.testing`): every geometry of the
backend's table, both partition sizes (forced through `launch`, and chosen by
the budget through `paged_attention(provider="gqa_decode")`), lengths around the
thresholds and up to 131,072 tokens, ragged multi-request batches, scattered block
tables with garbage elsewhere in the pool; bitwise-identical output on repeat; the
route and partition size asserted through diagnostics, and the route `auto` takes on
this backend (CUDA: classic, which ranks above gqa_decode there).

``python3 tests/gpu/test_gqa_decode_gpu.py --sweep OUT.json`` times the kernel
against the classic split path at growing work sizes: the measurement behind
``SIMDGROUPS_PER_CORE["cuda"]`` (docs/gqa-decode.md).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_attn as ma
from metal_attn import compat
from metal_attn._layout import import_builtin_providers
from metal_attn.constants import SIMDGROUPS_PER_CORE
from metal_attn.device import current_device
from metal_attn.errors import ProviderRefusedError
from metal_attn.metadata import AttentionMetadata
from metal_attn.testing import assert_close_to_oracle, make_case, run_case
from metal_attn.testing.cases import to_numpy

import_builtin_providers()
from metal_attn.providers import gqa_decode as gq  # noqa: E402

# Off a GPU, tests/gpu/conftest.py skips every test here with the reason; a device probe that
# fails is an error, not a reason to skip.
BACKEND = current_device().backend
pytestmark = pytest.mark.gpu
# Off a GPU the CUDA table still parametrizes the tests, so that each skips with the conftest's reason
# (an empty table would skip them as "got empty parameter set").
TABLE = gq.geometry_table(BACKEND if BACKEND in ("cuda", "metal") else "cuda")
GEOM_IDS = [gq._fmt_geom(g) for g in TABLE]


def test_the_backend_has_a_geometry_table():
    assert TABLE, f"no GQA geometry table for backend={BACKEND}: every table-driven test here would be empty"


def _case(geom, seq_lens, dtype="bfloat16", seed=0):
    h, kvh, d, bs = geom
    return make_case(q_lens=[1] * len(seq_lens), seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d,
                     block_size=bs, dtype=dtype, seed=seed, label=f"{gq._fmt_geom(geom)} {dtype} {seq_lens}")


def _forced(case, partition_size: int) -> mx.array:
    md = case.metadata()
    out = gq.launch(case.q, case.k_cache, case.v_cache, md, scale=case.scale, partition_size=partition_size,
                    backend=BACKEND)
    mx.eval(out)
    return out


def _budget() -> int:
    dev = current_device()
    return dev.gpu_cores * SIMDGROUPS_PER_CORE[dev.backend]


def _thresholds(num_heads: int) -> dict[int, int]:
    """Shortest single row for which the budget admits P256 and P512."""
    b = _budget()
    return {p: -(-b // num_heads) * p for p in (256, 512)}


RAGGED = [1, 3, 255, 256, 257, 511, 512, 513, 1_000, 4_099, 9_001]


@pytest.mark.parametrize("partition_size", [256, 512])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("geom", TABLE, ids=GEOM_IDS)
def test_forced_partition_ragged_batch(geom, dtype, partition_size):
    case = _case(geom, RAGGED, dtype, seed=partition_size)
    out = _forced(case, partition_size)
    assert out.dtype == case.q.dtype and tuple(out.shape) == tuple(case.q.shape)
    assert_close_to_oracle(out, case.oracle(), dtype, label=f"{case.label} P{partition_size}")


#: Every (CHUNK, PREFETCH) load-pipelining variant a tuning table may ship.
TUNINGS = [(4, 0), (4, 1), (8, 0), (8, 1), (16, 1), (32, 1)]
#: Each geometry with every variant whose CHUNK divides its block size (the launcher refuses the others).
GEOM_TUNINGS = [pytest.param(g, t, id=f"{gid}-chunk{t[0]}-prefetch{t[1]}")
                for g, gid in zip(TABLE, GEOM_IDS) for t in TUNINGS if g[3] % t[0] == 0]


@pytest.mark.parametrize(("geom", "tuning"), GEOM_TUNINGS)
def test_every_tuning_matches_oracle(geom, tuning):
    """Partial pages, chunk tails and 1-3 token scalar tails under each variant."""
    case = _case(geom, [1, 2, 3, 5, 13, 31, 257, 530, 2_061], seed=tuning[0] + tuning[1])
    md = case.metadata()
    for p in (256, 512):
        out = gq.launch(case.q, case.k_cache, case.v_cache, md, scale=case.scale, partition_size=p,
                        backend=BACKEND, tuning=tuning)
        assert_close_to_oracle(out, case.oracle(), "bfloat16", label=f"{case.label} P{p} tuning={tuning}")


@pytest.mark.parametrize("partition_size", [256, 512])
@pytest.mark.parametrize("geom", TABLE, ids=GEOM_IDS)
def test_forced_partition_long_rows(geom, partition_size):
    case = _case(geom, [131_072, 70_001, 17, 40_960], seed=7)
    assert_close_to_oracle(_forced(case, partition_size), case.oracle(), "bfloat16",
                           label=f"{case.label} P{partition_size}")


@pytest.mark.parametrize("geom", TABLE, ids=GEOM_IDS)
def test_chosen_partition_around_thresholds(geom):
    """gqa_decode's own choice (forced: on CUDA `auto` ranks classic first); below the first
    threshold it refuses, and `auto` takes another provider."""
    t = _thresholds(geom[0])
    for length, expected in ((t[256] - 1, None), (t[256], 256), (t[512] - 1, 256), (t[512], 512)):
        case = _case(geom, [length], seed=length)
        if expected is None:
            with pytest.raises(ProviderRefusedError, match="full partitions x heads below the budget"):
                run_case(case, provider="gqa_decode")
            got = run_case(case)
            assert compat.last_paged_dispatch() != "gqa_decode"
        else:
            got = run_case(case, provider="gqa_decode")
            assert compat.last_paged_dispatch() == "gqa_decode"
        assert_close_to_oracle(got, case.oracle(), "bfloat16", label=case.label)
        assert compat.last_gqa_partition_size() == expected, (length, ma.diagnostics.last_dispatch())


@pytest.mark.parametrize("geom", TABLE, ids=GEOM_IDS)
def test_chosen_single_request_131072(geom):
    case = _case(geom, [131_072], seed=3)
    got = run_case(case, provider="gqa_decode")
    assert compat.last_paged_dispatch() == "gqa_decode"
    assert compat.last_gqa_partition_size() == 512
    assert_close_to_oracle(got, case.oracle(), "bfloat16", label=case.label)


def test_ragged_multi_request_batch_is_routed_and_correct():
    geom = TABLE[0]
    lens = [131_072, 65_537, 4_097, 1, 300, 20_000, 511, 99_999]
    case = _case(geom, lens, seed=11)
    got = run_case(case, provider="gqa_decode")
    rec = ma.diagnostics.last_dispatch()
    assert rec.route == "gqa_decode" and rec.partition_size in (256, 512)
    assert_close_to_oracle(got, case.oracle(), "bfloat16", label=case.label)


def test_auto_route_follows_the_backend_priority():
    """`auto` asks providers in their priority order on this backend: on CUDA classic (10) before
    gqa_decode (5, measured slower there), on Metal gqa_decode (80) first."""
    case = _case(TABLE[0], [131_072, 4_097], seed=13)
    got = run_case(case)
    expected = {"cuda": "classic", "metal": "gqa_decode"}[BACKEND]
    # (the provider, not the route: classic's partition size follows its own rules, 4,096 here)
    assert ma.diagnostics.last_dispatch().provider == expected, ma.diagnostics.last_dispatch()
    assert_close_to_oracle(got, case.oracle(), "bfloat16", label=case.label)


@pytest.mark.parametrize("partition_size", [256, 512])
def test_bitwise_identical_on_repeat(partition_size):
    case = _case(TABLE[1], [50_000, 3_333, 131_072], seed=5)
    first = np.array(to_numpy(_forced(case, partition_size)))
    for _ in range(3):
        again = to_numpy(_forced(case, partition_size))
        assert np.array_equal(first, again), "gqa_decode output changed between identical launches"


def test_disable_switch_routes_to_classic():
    case = _case(TABLE[0], [131_072], seed=2)
    with ma.override_settings(disable_gqa_decode=True):
        # On CUDA auto takes classic anyway: the switch shows in gqa_decode refusing when forced.
        with pytest.raises(
            ProviderRefusedError,
            match=r"disabled by the disable_gqa_decode setting \(its variable: METAL_ATTN_DISABLE_GQA_DECODE=1\)",
        ):
            run_case(case, provider="gqa_decode")
        got = run_case(case)
        assert ma.diagnostics.last_dispatch().provider == "classic"
    assert_close_to_oracle(got, case.oracle(), "bfloat16", label=case.label)


# -- the budget sweep (not a test): python3 tests/gpu/test_gqa_decode_gpu.py --sweep OUT.json ---------------


def _sweep_point(geom, batch: int, n: int, backend: str) -> dict:
    """One sweep row: gqa_decode at P256 and P512, and the classic path, on the same inputs."""
    from metal_attn.bench.timing import time_fn

    h, kvh, d, bs = geom
    nblk = -(-n // bs)
    pool = batch * nblk + 1
    k = mx.random.normal((pool, bs, kvh, d)).astype(mx.bfloat16)
    v = mx.random.normal((pool, bs, kvh, d)).astype(mx.bfloat16)
    q = mx.random.normal((batch, h, d)).astype(mx.bfloat16)
    perm = np.random.default_rng(n).permutation(pool)[: batch * nblk].reshape(batch, nblk)
    md = AttentionMetadata.build(perm.astype(np.int32), [n] * batch, list(range(batch + 1)))
    mx.eval(k, v, q)
    row: dict = {"geometry": list(geom), "batch": batch, "context": n}
    for p in (256, 512):
        row[f"full_x_heads_P{p}"] = batch * (n // p) * h

        def gqa(p: int = p) -> None:
            mx.eval(gq.launch(q, k, v, md, scale=d**-0.5, partition_size=p, backend=backend))

        row[f"gqa_P{p}_us"] = time_fn(gqa, warmup=3, iters=15).median_s * 1e6

    def classic() -> None:
        mx.eval(ma.paged_attention(q, k, v, metadata=md, provider="classic"))

    row["classic_us"] = time_fn(classic, warmup=3, iters=15).median_s * 1e6
    row["classic_route"] = ma.diagnostics.last_dispatch().route
    return row


def sweep(out_path: str) -> None:
    """Time gqa_decode (P256, P512) against the classic path at growing work; write rows as JSON."""
    import json

    mx.set_cache_limit(1 << 34)
    dev = current_device()
    plans = [((32, 8, 128, 16), [1], (2_048, 4_096, 6_144, 8_192, 12_288, 16_384, 24_576, 32_768)),
             ((16, 2, 128, 16), [1], (4_096, 8_192, 16_384, 24_576, 32_768, 49_152, 65_536)),
             ((24, 4, 256, 16), [1], (4_096, 8_192, 12_288, 16_384, 24_576, 32_768)),
             ((32, 8, 128, 16), [4, 8], (1_024, 2_048, 4_096, 8_192))]
    rows = []
    for geom, batches, lengths in plans:
        for batch in batches:
            for n in lengths:
                row = _sweep_point(geom, batch, n, dev.backend)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": dev.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--sweep":
        sweep(sys.argv[2])
    else:
        raise SystemExit("usage: python3 tests/gpu/test_gqa_decode_gpu.py --sweep OUT.json")
