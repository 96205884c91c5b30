"""Launch descriptors (`gpu_common.cached_launch`): built once per batch and call geometry, shared by
the layers of a step, never by another metadata, pool or call constant; the tensor checks of
`paged_attention` run once per selection key and never let a new shape through; the reference
cache writer's fast path skips what its slow path skips.

The GPU paths run on the CPU through `metal_attn.testing.fake_cuda` (the H200's admission and plans,
fake kernel objects that record their launches); nothing is computed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_attn.providers import gpu_common as gc
from metal_attn.providers import tiled_prefill as tp
from metal_attn.providers.reference import ReferenceProvider

import metal_attn as ma
from metal_attn import diagnostics, kernels
from metal_attn.constants import LOG2E
from metal_attn.device import DeviceInfo
from metal_attn.errors import InvalidInputError
from metal_attn.metadata import AttentionMetadata
from metal_attn.provider import AttentionInputs
from metal_attn.testing.fake_cuda import fake_cuda

H, KVH, D, BS = 32, 8, 128, 16
PAGES = 2400


def _md(seq_lens, q_lens=None, first_page=0):
    """A batch over distinct consecutive pages from ``first_page``."""
    q_lens = q_lens or [1] * len(seq_lens)
    need = [-(-n // BS) for n in seq_lens]
    table = np.zeros((len(seq_lens), max(need)), np.int32)
    at = first_page
    for i, n in enumerate(need):
        table[i, :n] = np.arange(at, at + n)
        at += n
    return AttentionMetadata.build(table, seq_lens, np.concatenate([[0], np.cumsum(q_lens)]))


def _q(md, dtype=mx.bfloat16):
    return mx.zeros((md.total_q_tokens, H, D), dtype)


def _pool(num_blocks=PAGES, dtype=mx.bfloat16, kvh=KVH):
    return mx.zeros((num_blocks, BS, kvh, D), dtype)


def _attend(q, pool, md, scale=0.1, **kw):
    return ma.paged_attention(q, pool, pool, metadata=md, scale=scale, **kw)


@pytest.fixture
def cuda():
    # 512-token partitions, the parameters these tests spell out (the partition rule's own choices
    # are test_classic_routing's).
    with fake_cuda() as fake, ma.override_settings(partition_size=512):
        yield fake


@pytest.fixture
def builds(monkeypatch):
    """Counts descriptor builds per kind."""
    counts = {"per_token": 0, "tiled": 0}

    def counting(kind, build):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return build(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gc.per_token, "per_token_launch", counting("per_token", gc.per_token_launch))
    monkeypatch.setattr(tp, "tiled_launch", counting("tiled", tp.tiled_launch))
    return counts


def _of(fake, kernel):
    """The launches of ``kernel`` (names are ``ma_<kernel>_<digest>``, `kernels.kernel_name`)."""
    return [launch for launch in fake.launches if launch.kernel.rsplit("_", 1)[0] == f"ma_{kernel}"]


def _paged(fake):
    return _of(fake, "paged_attention")


def _ints(arr):
    return np.array(arr).tolist()


def test_the_layers_of_a_step_share_one_descriptor(cuda, builds):
    md = _md([4096])
    layers = [(_q(md), _pool()) for _ in range(32)]
    for q, pool in layers:
        _attend(q, pool, md)
    assert diagnostics.last_dispatch().route == "per_token_ps512"
    assert builds["per_token"] == 1
    paged = _paged(cuda)
    reduce = _of(cuda, "paged_attention_v2_reduce")
    assert len(paged) == len(reduce) == 32
    first = paged[0].args
    for (q, pool), launch in zip(layers, paged):
        args = launch.args
        assert args["inputs"][0] is q and args["inputs"][1] is pool and args["inputs"][2] is pool  # the layer's own
        assert args["template"] is first["template"] and args["grid"] is first["grid"]
        assert all(args["inputs"][i] is first["inputs"][i] for i in range(3, 9))  # metadata, sinks, params
    assert first["grid"][1:] == (1, 8) and _ints(first["inputs"][7]) == [1, H, KVH, 256, 0, 8, 0]


def test_another_metadata_gets_its_own_descriptor(cuda, builds):
    """A stale descriptor would launch the old grid and lengths silently: each metadata has its own,
    also one with the same lengths over other pages."""
    a, b = _md([4096]), _md([1000, 3000])
    same_lengths = _md([4096], first_page=512)
    pool = _pool()
    for md in (a, b, a, same_lengths):
        _attend(_q(md), pool, md)
    assert builds["per_token"] == 3
    la, lb, la_again, lsame = (launch.args for launch in _paged(cuda))
    assert la["grid"][1:] == (1, 8) and _ints(la["inputs"][7]) == [1, H, KVH, 256, 0, 8, 0]
    assert lb["grid"][1:] == (2, 6) and _ints(lb["inputs"][7]) == [2, H, KVH, 188, 0, 6, 0]
    assert lb["inputs"][3] is b.block_tables and lb["inputs"][4] is b.seq_lens and lb["inputs"][5] is b.cu_seqlens_q
    assert la_again["template"] is la["template"] and la_again["inputs"][3] is a.block_tables
    assert lsame["inputs"][3] is same_lengths.block_tables and lsame["template"] is not la["template"]
    assert _ints(lsame["inputs"][7]) == _ints(la["inputs"][7])


def test_other_pools_and_call_constants_get_their_own_descriptor(cuda, builds):
    md = _md([4096])
    q, pool = _q(md), _pool()
    _attend(q, pool, md)
    _attend(q, _pool(PAGES + 1), md)  # another pool geometry
    _attend(q, pool, md, scale=0.2)
    sinks = mx.ones((H,), mx.float32)
    _attend(q, pool, md, sinks=sinks)
    _attend(q, pool, md, sliding_window=100)
    _attend(q, pool, md, softcap=30.0)
    _attend(q, _pool(kvh=4), md)  # another GQA group: another geometry and kernel object
    assert builds["per_token"] == 7
    base, other_pool, scaled, sunk, windowed, capped, group8 = (launch.args for launch in _paged(cuda))
    assert other_pool["inputs"][1].shape[0] == PAGES + 1 and other_pool["template"] is not base["template"]
    assert np.allclose(_ints(scaled["inputs"][8]), [0.2 * LOG2E, 0.0])
    assert sunk["inputs"][6] is sinks and _ints(sunk["inputs"][7])[-1] == 1
    assert _ints(windowed["inputs"][7])[4] == 100
    assert np.allclose(_ints(capped["inputs"][8]), [0.1, 30.0])
    assert _ints(group8["inputs"][7])[2] == 4
    reduces = [launch.args for launch in _of(cuda, "paged_attention_v2_reduce")]
    assert reduces[3]["inputs"][5] is sinks and _ints(reduces[3]["inputs"][6])[-1] == 1
    assert _ints(reduces[0]["inputs"][6])[-1] == 0


def test_new_kernel_objects_are_not_served_from_an_old_descriptor(cuda, builds):
    md = _md([4096])
    q, pool = _q(md), _pool()
    _attend(q, pool, md)
    kernels.clear_cache()  # e.g. a new source folder: new kernel objects
    built = len(cuda.kernels)
    _attend(q, pool, md)
    assert builds["per_token"] == 2 and len(cuda.kernels) == built + 2  # the per-token kernel and the reducer


def test_a_split_page_size_shares_its_descriptor_too(cuda, builds):
    """64-token pages run as 32-token kernel blocks: the descriptor lives on the re-expressed metadata."""
    table = np.arange(64, dtype=np.int32)[None, :]
    md = AttentionMetadata.build(table, [4096], [0, 1])
    pool = mx.zeros((64, 64, KVH, D), mx.bfloat16)
    for _ in range(3):
        _attend(_q(md), pool, md)
    assert builds["per_token"] == 1
    launches = _paged(cuda)
    assert launches[0].template()["BLOCK_SIZE"] == 32 and launches[0].args["inputs"][1].shape == (128, 32, KVH, D)
    assert launches[2].args["template"] is launches[0].args["template"]
    assert launches[0].args["inputs"][3] is not md.block_tables  # the kernel-block table


def test_the_mixed_split_shares_both_descriptors(cuda, builds):
    md = _md([4096] * 8 + [1024], q_lens=[1] * 8 + [256])
    pool = _pool()
    for _ in range(4):  # forced: by SDPA_PREFILL_RULES this batch is sdpa_prefill's on CUDA
        _attend(_q(md), pool, md, provider="tiled_prefill")
    assert diagnostics.last_dispatch().route == "mixed_prefill_decode"
    assert builds == {"per_token": 1, "tiled": 1}
    assert len(cuda.launches) == 4 * 3  # decode rows, reducer, prefill tiles
    tiled = [launch.args for launch in _of(cuda, "tiled_prefill")]
    assert tiled[3]["template"] is tiled[0]["template"] and tiled[3]["inputs"][6] is tiled[0]["inputs"][6]
    assert tiled[0]["inputs"][6] is md.query_tiles(tp.tile_config("cuda", D).bq, 8)
    decode = _paged(cuda)[0].args
    assert decode["grid"][1] == 8 and decode["output_shapes"][0][0] == 8


def test_the_gathered_route_shares_its_run_launches(cuda, monkeypatch):
    """``sdpa_prefill``'s calls (gather, first_flagged, finish per run of equal sequences) are built once
    per metadata and call geometry: the layers of a mixed step launch the same templates, grids and
    parameter arrays with their own pools; the first run's finish writes the decode rows in front."""
    from metal_attn.providers import sdpa_prefill as sp

    built, real = [], sp.run_launches
    monkeypatch.setattr(sp, "run_launches", lambda *a: built.append(a) or real(*a))
    md = _md([4096] * 8 + [2048, 2048, 1024], q_lens=[1] * 8 + [512, 512, 256])
    layers = [(_q(md), _pool()) for _ in range(3)]
    outs = [_attend(q, pool, md) for q, pool in layers]
    assert diagnostics.last_dispatch().route == "sdpa_prefill_decode"
    assert len(built) == 1 and all(o.shape == (8 + 1280, H, D) for o in outs)
    gathers, finishes = _of(cuda, "gather_kv"), _of(cuda, "sdpa_finish")
    assert len(gathers) == len(finishes) == 3 * 2  # two runs a layer: 2 x 512 rows after 2K, 256 after 1K
    for layer, (_, pool) in enumerate(layers):
        g0, g1 = gathers[2 * layer].args, gathers[2 * layer + 1].args
        assert g0["inputs"][0] is pool and g0["inputs"][2] is md.block_tables
        assert g0["template"] is gathers[0].args["template"] and g0["inputs"][3] is gathers[0].args["inputs"][3]
        assert _ints(g0["inputs"][3]) == [8, 2, 2048, PAGES, 256, BS, KVH]
        assert _ints(g1["inputs"][3])[:3] == [10, 1, 1024]
        f0, f1 = finishes[2 * layer].args, finishes[2 * layer + 1].args
        assert f0["output_shapes"] == [(8 + 1024, H, D)] and _ints(f0["inputs"][4])[5:] == [8, 0, 0, 1]  # lead in front
        assert f1["output_shapes"] == [(256, H, D)] and _ints(f1["inputs"][4])[5:] == [0, 0, 0, 1]
        assert f0["grid"] is finishes[0].args["grid"]


def test_gqa_decode_layers_share_one_descriptor(monkeypatch):
    """Forced on a 4-core H200 stand-in (its work budget admits these batches)."""
    from metal_attn.providers import gqa_decode as gq

    counted, real = [], gq.gqa_launch

    def counting(*args, **kwargs):
        counted.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gq, "gqa_launch", counting)
    a, b = _md([4096, 2000]), _md([1000, 600])
    pool = _pool()
    with fake_cuda(DeviceInfo.preset("h200").replace(gpu_cores=4)) as cuda:
        for md in (a, a, a, b):
            _attend(_q(md), pool, md, provider="gqa_decode")
        assert diagnostics.last_dispatch().route == "gqa_decode"
    assert len(counted) == 2
    decode = _of(cuda, "gqa_decode")
    assert len(decode) == 4 and decode[2].args["template"] is decode[0].args["template"]
    assert decode[3].args["template"] is not decode[0].args["template"]
    assert decode[3].args["inputs"][3] is b.block_tables and decode[3].args["grid"] != decode[0].args["grid"]


def test_a_cached_descriptor_launches_what_the_bare_launch_does(cuda):
    """`run_per_token` (cached) and `launch_paged` (built per call, sweeps) agree, argument for argument."""
    md = _md([1000, 3000])
    q, pool = _q(md), _pool()
    _attend(q, pool, md)
    sel_md = next(iter(md._selections.values()))[1]
    cached = [launch.args for launch in cuda.launches]
    cuda.launches.clear()
    entries = list(md._launches)
    gc.launch_paged(q, pool, pool, sel_md, scale=0.1, sinks=None, sliding_window=None, softcap=None,
                    partition_size=512, backend="cuda")
    assert list(md._launches) == entries  # the bare launch keeps nothing
    bare = [launch.args for launch in cuda.launches]
    assert len(bare) == len(cached) == 2
    for c, b in zip(cached, bare):
        assert {k: v for k, v in c.items() if k != "inputs"} == {k: v for k, v in b.items() if k != "inputs"}
        for x, y in zip(c["inputs"], b["inputs"]):
            assert x is y or (x.shape == y.shape and _ints(x) == _ints(y))


def test_a_full_descriptor_cache_starts_over(cuda):
    md = _md([4096])
    q, pool = _q(md), _pool()
    for i in range(gc.MAX_LAUNCHES_PER_METADATA + 1):
        _attend(q, pool, md, scale=0.1 + i / 1000)
    assert 1 <= len(md._launches) <= gc.MAX_LAUNCHES_PER_METADATA


# -- the tensor checks run once per selection key, and on every new one -------------------------------------


def _cpu_batch():
    md = AttentionMetadata.build(np.array([[0, 1]], np.int32), [20], [0, 2])
    return md, mx.zeros((2, 4, 64)), mx.zeros((4, 16, 2, 64))


@pytest.mark.parametrize(("make", "needle"), [
    (lambda q, k: (q[:1], k, k), "q has 1 rows but cu_seqlens_q[-1]=2"),
    (lambda q, k: (q, k, k.astype(mx.float16)), "v_cache.dtype=float16 must be equal"),
    (lambda q, k: (q, k, k[:3]), "must be equal"),
    (lambda q, k: (np.zeros((2, 4, 64), np.float32), k, k), "q must be an mx.array"),
    (lambda q, k: (q.reshape(2, 256), k, k), "q must have rank 3"),
    (lambda q, k: (mx.zeros((2, 3, 64)), k, k), "num_heads=3 is not a multiple of num_kv_heads=2"),
    (lambda q, k: (q.astype(mx.int32), k, k), "q.dtype=int32"),
])
def test_a_call_unlike_the_checked_ones_is_checked(make, needle):
    md, q, k = _cpu_batch()
    mx.eval(ma.paged_attention(q, k, k, metadata=md))  # a checked call fills the selection cache
    bad_q, bad_k, bad_v = make(q, k)
    with pytest.raises(InvalidInputError, match=needle.replace("[", r"\[")):
        ma.paged_attention(bad_q, bad_k, bad_v, metadata=md)
    mx.eval(ma.paged_attention(q, k, k, metadata=md))  # and the good call still runs


def test_checks_of_the_call_constants_run_on_every_call():
    md, q, k = _cpu_batch()
    mx.eval(ma.paged_attention(q, k, k, metadata=md, scale=0.5))
    with pytest.raises(InvalidInputError, match="scale="):
        ma.paged_attention(q, k, k, metadata=md, scale=-0.5)
    with pytest.raises(InvalidInputError, match=r"sinks.shape=\(3,\)"):
        ma.paged_attention(q, k, k, metadata=md, sinks=mx.zeros((3,)))


# -- the reference cache writer (the MLX scatter the GPU backends use) ---------------------------------------


_SLOTS = [[3, 17, 0], [3, -1, 40], [-1, -2, -3], [5, 64, 2], [63, 2**31 - 1, -(2**31)]]


@pytest.mark.parametrize(("slots", "dtype"), [(s, np.int64) for s in [*_SLOTS, [63, 2**40, -(2**62)]]]
                         + [(s, np.int32) for s in _SLOTS])
def test_reference_writer_skips_padding_and_slots_past_the_pool(slots, dtype):
    nb, bs, kvh, d = 4, 16, 2, 8
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((nb, bs, kvh, d)).astype(np.float32)
    key = rng.standard_normal((len(slots), kvh, d)).astype(np.float32)
    k_out, v_out = ReferenceProvider().write_cache(mx.array(key), mx.array(-key), mx.array(kc), mx.array(kc),
                                                   mx.array(np.array(slots, dtype)), DeviceInfo.preset("h200"))
    want_k, want_v = kc.reshape(nb * bs, kvh, d).copy(), kc.reshape(nb * bs, kvh, d).copy()
    for row, slot in enumerate(slots):
        if 0 <= slot < nb * bs:
            want_k[slot], want_v[slot] = key[row], -key[row]
    assert np.array_equal(np.array(k_out).reshape(nb * bs, kvh, d), want_k)
    assert np.array_equal(np.array(v_out).reshape(nb * bs, kvh, d), want_v)


def test_attention_inputs_reach_the_cached_launch_unchanged(cuda):
    """`run_per_token` called directly (a provider's run) takes the same descriptor as the API's call."""
    md = _md([4096])
    q, pool = _q(md), _pool()
    _attend(q, pool, md)
    plan = next(iter(md._selections.values()))[0].plan
    entries = len(md._launches)
    gc.run_per_token(AttentionInputs(q, pool, pool, md, 0.1), plan.specialization)
    assert len(md._launches) == entries


@pytest.mark.parametrize("psize", [0, 512, 64])
def test_prepare_compiles_the_plans_partition_size(psize):
    """`prepare_per_token` launches the plan's exact specialization: its partition size reaches the
    kernel's template (and the reducer's when split)."""
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import get_settings

    device = DeviceInfo.preset("h200").replace(hypothetical=False)
    req = AttentionRequest.from_lengths(q_lens=[1], seq_lens=[600], backend="cuda", dtype="bfloat16")
    with fake_cuda(device) as cuda, ma.override_settings(partition_size=psize or 512):
        plan = gc.plan_per_token("classic", req, device, get_settings())
        if psize == 0:
            plan = gc.plan_per_token("classic", AttentionRequest.from_lengths(
                q_lens=[1], seq_lens=[300], backend="cuda", dtype="bfloat16"), device, get_settings())
        gc.prepare_per_token(plan, device)
    assert plan.partition_size == psize
    paged = _paged(cuda)
    assert len(paged) == 1 and paged[0].template()["PARTITION_SIZE"] == psize
    reduce = _of(cuda, "paged_attention_v2_reduce")
    assert [r.template()["PARTITION_SIZE"] for r in reduce] == ([psize] if psize else [])
