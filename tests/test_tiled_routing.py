"""Routing of the ``tiled_prefill`` provider, with the device probe overridden (CPU only).

Admission, the mixed-batch split and the plans are asserted through
`metal_attn.explain` on hypothetical devices (the H200, a 40-core M5 Max); the
query-tile map against a plain loop; the Metal source of every specialization
with clang. The kernel's numerics run in tests/gpu.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import metal_attn as ma
from metal_attn._layout import import_builtin_providers
from metal_attn.constants import MIXED_DECODE_MIN_CONTEXT
from metal_attn.device import DeviceInfo
from metal_attn.metadata import AttentionMetadata
from metal_attn.settings import override_settings

H200 = DeviceInfo.preset("h200")
M5 = DeviceInfo.preset("m5-max")

import_builtin_providers()
from metal_attn.providers import tiled_prefill as tp  # noqa: E402

#: On CUDA ``sdpa_prefill`` (priority 55) takes the prefill batches its rule admits
#: (tests/test_sdpa_prefill.py); here it is disabled so that the tiles' own choices are asserted.
WITHOUT_SDPA = ("sdpa_prefill",)


@pytest.fixture(autouse=True)
def _tiles_first():
    with override_settings(disabled_providers=WITHOUT_SDPA):
        yield


@pytest.fixture(autouse=True)
def _without_nax():
    """On the M5 preset the NAX provider (priority 60) outranks the tiles for prefill and mixed
    batches; these tests are about the tiles, so it is disabled here (tests/test_nax_routing.py)."""
    with override_settings(disable_nax=True):
        yield


def _explain(device, q_lens, seq_lens, *, heads=(32, 8, 128), dtype="bfloat16", block_size=16, **features):
    h, kvh, d = heads
    return ma.explain(q_lens=q_lens, seq_lens=seq_lens, num_heads=h, num_kv_heads=kvh, head_size=d,
                      block_size=block_size, dtype=dtype, device=device, **features)


def _row(ex, name="tiled_prefill"):
    return next(r for r in ex.rows if r.name == name)


@pytest.mark.parametrize(("device", "threads", "tile"),
                         [(H200, 256, "BQ=128 query rows (8 simdgroups x 16), BKV=32"),
                          (M5, 128, "BQ=32 query rows (4 simdgroups x 8), BKV=32")], ids=("h200", "m5"))
@pytest.mark.parametrize(("q_lens", "seq_lens"), [([4096], [4096]), ([64, 7], [1000, 7]), ([4, 4], [90, 300])],
                         ids=("prompt", "chunks", "verify"))
def test_prefill_and_verify_batches_take_the_tiles(device, threads, tile, q_lens, seq_lens):
    with override_settings(tiled_partition_size=-1):  # the tile, not the split (tested below)
        ex = _explain(device, q_lens, seq_lens)
    row = _row(ex)
    assert row.chosen, str(ex)
    assert row.plan.route == "tiled_prefill" and row.plan.partition_size == 0
    assert row.plan.threadgroup == (threads, 1, 1)
    assert any(tile in n for n in row.plan.notes), row.plan.notes


@pytest.mark.parametrize(("device", "threads", "tile"),
                         [(H200, 256, "BQ=128 query rows (8 simdgroups x 16), BKV=16 keys, 16896 bytes"),
                          (M5, 64, "BQ=16 query rows (2 simdgroups x 8), BKV=16 keys, 16896 bytes")],
                         ids=("h200", "m5"))
def test_head_256_tile(device, threads, tile):
    row = _row(_explain(device, [100], [100], heads=(16, 2, 256)))
    assert row.chosen and row.plan.threadgroup == (threads, 1, 1)
    assert any(tile in n for n in row.plan.notes), row.plan.notes


def test_decode_dtype_and_head_refusals_fall_back_to_classic():
    for kwargs, needle in [
        (dict(q_lens=[1, 1], seq_lens=[50, 60]), "phase=decode (supported: mixed, prefill, verify)"),
        (dict(q_lens=[40], seq_lens=[40], dtype="float32"), "dtype=float32 (supported: bfloat16, float16)"),
        (dict(q_lens=[40], seq_lens=[40], heads=(4, 2, 80)), "head_size=80 (supported: 64, 96, 128, 256)"),
    ]:
        ex = _explain(H200, **kwargs)
        assert not _row(ex).admitted and needle in "\n".join(_row(ex).reasons), str(ex)
        assert ex.chosen.name in ("classic", "gqa_decode"), str(ex)


def test_every_backend_tiles_the_same_head_sizes():
    assert {frozenset(t) for t in tp.TILE_CONFIGS.values()} == {tp.TiledPrefillProvider.head_sizes}


def test_every_feature_is_admitted():
    ex = _explain(M5, [40], [300], sinks=True, sliding_window=64, softcap=30.0)
    assert _row(ex).chosen, str(ex)


def test_threadgroup_memory_must_fit():
    small = dataclasses.replace(H200, max_threadgroup_memory=16 * 1024)
    ex = _explain(small, [40], [40])
    reasons = "\n".join(_row(ex).reasons)
    assert "K/V tiles need 17408 bytes of threadgroup memory for head_size=128" in reasons
    assert "allowed: <= 16384 bytes" in reasons
    unknown = dataclasses.replace(H200, max_threadgroup_memory=None)
    assert "max_threadgroup_memory unknown" in "\n".join(_row(_explain(unknown, [40], [40])).reasons)


@pytest.mark.parametrize("device", (H200, M5), ids=("h200", "m5"))
def test_mixed_split_threshold(device):
    threshold = MIXED_DECODE_MIN_CONTEXT[device.backend]
    below = _row(_explain(device, [1, 1, 300], [threshold - 1, 100, 800]))
    assert below.chosen and below.plan.route == "tiled_prefill"
    assert any(f"{threshold - 1} < MIXED_DECODE_MIN_CONTEXT" in n for n in below.plan.notes)
    at = _row(_explain(device, [1, 1, 300], [threshold, 100, 800]))
    assert at.chosen and at.plan.route == "mixed_prefill_decode"
    assert any(f"{threshold} >= MIXED_DECODE_MIN_CONTEXT" in n for n in at.plan.notes)
    assert any(n.startswith("decode rows: per_token_ps") for n in at.plan.notes), at.plan.notes
    # The decode rows' own plan (the classic kernel's occupancy gate on 2 rows) rides along.
    long = _row(_explain(device, [1, 1, 300], [8192, 100, 800]))
    assert long.plan.route == "mixed_prefill_decode"
    assert any(n.startswith("decode rows: per_token_ps512") for n in long.plan.notes), long.plan.notes
    assert long.plan.partition_size == 512
    decode_spec = long.plan.specialization[6]
    assert decode_spec.per_token[0] == device.backend and decode_spec.per_token[4] == 512


def test_mixed_split_needs_the_classic_provider():
    with override_settings(disabled_providers=["classic", *WITHOUT_SDPA]):
        row = _row(_explain(H200, [1, 1, 300], [8192, 100, 800]))
    assert row.chosen and row.plan.route == "tiled_prefill"
    assert any("the classic provider is disabled" in n for n in row.plan.notes), row.plan.notes


def test_disable_switch():
    with override_settings(disable_tiled_prefill=True):
        ex = _explain(H200, [40], [40])
    assert "METAL_ATTN_DISABLE_TILED_PREFILL=1" in "\n".join(_row(ex).reasons)
    assert ex.chosen.name == "classic"


def test_cpu_backend_is_unavailable():
    ex = _explain(DeviceInfo.preset("cpu-2core"), [40], [40])
    assert "backend=cpu (supported: cuda, metal)" in "\n".join(_row(ex).reasons)


# -- the query-tile map -------------------------------------------------------------------------------


def _tiles_by_loop(q_lens, bq, first):
    out = []
    for s, n in enumerate(q_lens):
        if s < first:
            continue
        row = 0
        while row < n:
            out.append((s, row))
            row += bq
    return out


@pytest.mark.parametrize("bq", (8, 16, 32))
@pytest.mark.parametrize("first", (0, 2))
def test_query_tiles_match_a_loop(bq, first):
    q_lens = [1, 1, 33, 32, 7, 100]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    md = AttentionMetadata.build(np.zeros((6, 7), np.int32), [max(q, 50) for q in q_lens], cu)
    got = [tuple(map(int, r)) for r in np.array(md.query_tiles(bq, first))]
    assert got == _tiles_by_loop(q_lens, bq, first)
    assert md.query_tiles(bq, first) is md.query_tiles(bq, first)  # built once


def test_query_tiles_refuse_bad_arguments():
    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 3])
    with pytest.raises(ValueError, match=r"first_seq=1\) \(allowed: .*0 <= first_seq < num_seqs=1"):
        md.query_tiles(8, 1)
    with pytest.raises(ValueError, match=r"rows_per_tile=0"):
        md.query_tiles(0)


@pytest.mark.parametrize("config", [tp.TileConfig(12, 32), tp.TileConfig(32, 4), tp.TileConfig(0, 16),
                                    tp.TileConfig(32, 8), tp.TileConfig(8, 16, rb=2), tp.TileConfig(32, 32, rb=3)])
def test_launch_refuses_a_bad_tile_before_any_kernel(config):
    import mlx.core as mx

    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 3])
    q = mx.zeros((3, 4, 128), mx.bfloat16)
    kc = mx.zeros((1, 16, 2, 128), mx.bfloat16)
    with pytest.raises(ValueError, match=r"config=TileConfig.*multiple of 8 \* rb, BKV a positive multiple of 16"):
        tp.launch(q, kc, kc, md, scale=1.0, sinks=None, sliding_window=None, softcap=None, backend="cuda",
                  config=config)


def test_classic_decode_rows_launch_refuses_bad_rows():
    import mlx.core as mx
    from metal_attn.providers import gpu_common as gc

    md = AttentionMetadata.build(np.zeros((1, 1), np.int32), [3], [0, 3])
    q = mx.zeros((3, 4, 128), mx.bfloat16)
    kc = mx.zeros((1, 16, 2, 128), mx.bfloat16)
    with pytest.raises(ValueError, match=r"rows=4 \(allowed: 1\.\.3"):
        gc.launch_paged(q, kc, kc, md, scale=1.0, sinks=None, sliding_window=None, softcap=None,
                        partition_size=0, backend="cuda", rows=4)


def test_one_buffer_tile_takes_half_the_memory_and_its_own_code_path():
    two, one = tp.TileConfig(32, 32), tp.TileConfig(32, 32, one_buffer=True)
    assert two.threadgroup_bytes(512, 2) == 2 * 32 * (512 + tp.ROW_PADDING) * 2 == 2 * one.threadgroup_bytes(512, 2)
    assert one.threadgroup_bytes(512, 2) <= 48 * 1024 < two.threadgroup_bytes(512, 2)
    assert tp.kernel_defines(one) == (("TP_KV_SERIAL", 1), ("TP_SPLIT", 0))
    assert tp.kernel_defines(two) == (("TP_KV_SERIAL", 0), ("TP_SPLIT", 0))
    # No table picks it: the production tiles keep K and V in two buffers.
    assert not any(cfg.one_buffer for table in tp.TILE_CONFIGS.values() for cfg in table.values())


# -- the Metal generated-source check ------------------------------------------------------------------

_MSL_PROVIDER = ["tiled_prefill"]


def test_msl_specializations_cover_every_choice():
    labels = {s.label for s in tp.TiledPrefillProvider().msl_specializations()}
    for dtype in ("float16", "bfloat16"):
        for head in tp.TILE_CONFIGS["metal"]:
            for block in (8, 16, 32):
                assert f"tiled_prefill {dtype} head={head} block={block}" in labels
    assert "tiled_prefill bfloat16 head=512 block=16 one_buffer" in labels  # K then V through one buffer
    for head in tp.TILE_CONFIGS["metal"]:  # the split-KV path, once per head size
        assert f"tiled_prefill bfloat16 head={head} block=16 split=256" in labels
    assert len(labels) == 29


def test_metal_generated_source_type_checks(needs_clang):
    from metal_attn.msl_check import check

    result = check(providers=_MSL_PROVIDER)
    assert result.ok, result.summary()
    assert result.count == 29


def test_metal_source_check_catches_a_planted_error(needs_clang, planted_kernels):
    from metal_attn.msl_check import check

    # an array where a float belongs
    planted = planted_kernels("tiled_prefill.metal", "pf[b][j] = ma_popnd_pack<T>(p[0], p[1]);",
                              "pf[b][j] = ma_popnd_pack<T>(p, p[1]);")
    result = check(providers=_MSL_PROVIDER, only=r"tiled_prefill bfloat16 head=128 block=16", kernels_dir=planted)
    assert not result.ok and "ma_popnd_pack" in result.summary()


def test_forced_mixed_threshold_routes_both_ways_and_restores():
    """The GPU tests' and sweep's override: 0 splits a short mixed batch, a huge value keeps its
    decode rows in the tiles; the table (and cached selections) come back afterwards."""
    from metal_attn.providers import gpu_common as gc

    from metal_attn.plugins import get_registry
    from metal_attn.settings import get_settings
    from metal_attn.testing import forced_mixed_threshold

    before = gc.decode_rows.MIXED_DECODE_MIN_CONTEXT
    with forced_mixed_threshold(0):
        assert _row(_explain(H200, [1, 1, 300], [50, 100, 800])).plan.route == "mixed_prefill_decode"
    with forced_mixed_threshold(1 << 30):
        assert _row(_explain(H200, [1, 1, 300], [8192, 100, 800])).plan.route == "tiled_prefill"
    assert gc.decode_rows.MIXED_DECODE_MIN_CONTEXT is before
    assert _row(_explain(H200, [1, 1, 300], [8192, 100, 800])).plan.route == "mixed_prefill_decode"
    # Selections are cached: the override drops them on the way in and out.
    req = _explain(H200, [1, 1, 300], [8192, 100, 800]).request

    def route() -> str:
        return get_registry().select(req, H200, get_settings()).plan.route

    assert route() == "mixed_prefill_decode"
    with forced_mixed_threshold(1 << 30):
        assert route() == "tiled_prefill"
    assert route() == "mixed_prefill_decode"


def test_case_metadata_matches_its_call_arguments():
    from metal_attn.testing import make_case

    case = make_case(q_lens=[1, 5], seq_lens=[40, 70], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype="float16", seed=1, label="metadata")
    md = case.metadata()
    kw = case.kwargs()
    assert md.seq_lens.tolist() == kw["seq_lens"].tolist() and md.cu_seqlens_q.tolist() == [0, 1, 6]
    assert md.block_tables.tolist() == kw["block_tables"].tolist() and md.num_decode_seqs == 1


# -- split-KV (TILED_SPLIT_RULES) ------------------------------------------------------------------


def test_short_chunk_after_long_context_splits_on_cuda_with_the_arithmetic():
    # 128 rows after 4K at 32/8 heads: one 128-row tile per head, 32 threadgroups on 132 SMs; too
    # many rows for the short-chunk tile, so the table's tile splits at the rule's own target.
    row = _row(_explain(H200, [128], [4096]))
    rule = tp.TILED_SPLIT_RULES["cuda"]
    grid = 1 * 32
    assert grid < rule.max_threadgroups_per_core * 132
    want = next(p for p in rule.sizes if grid * -(-4096 // p) >= rule.min_threadgroups_per_core * 132)
    assert row.chosen and row.plan.route == f"tiled_prefill_ps{want}", row.plan
    assert row.plan.partition_size == want and row.plan.specialization[-1] == want
    assert row.plan.grid == (256, 32, -(-4096 // want)) and row.plan.specialization[5] == (128, 32, 2, False)
    note = next(n for n in row.plan.notes if n.startswith("tiled split:"))
    assert f"tiles*num_heads=1*32=32 < {rule.max_threadgroups_per_core:g}*gpu_cores=132" in note, note
    assert f"partition size {want}: threadgroups 32*{-(-4096 // want)}=" in note, note
    assert not any("short-chunk tile" in n for n in row.plan.notes)


@pytest.mark.parametrize(("q_len", "seq_len"), [(64, 2112), (32, 2048), (16, 4096), (4, 4096)])
def test_short_chunks_split_with_the_short_tile_at_its_own_target(q_len, seq_len):
    """The suite's 64 rows after 2K and the sweep's shorter chunks: the 64-row tile, split until its
    threadgroups reach the short tile's per-core target, the arithmetic in the notes."""
    rule = tp.TILED_SPLIT_RULES["cuda"]
    short = rule.short_tiles[128]
    assert short.evidence and short.config.bq < tp.tile_config("cuda", 128).bq
    row = _row(_explain(H200, [q_len], [seq_len]))
    want = next((p for p in rule.sizes if 32 * -(-seq_len // p) >= short.min_threadgroups_per_core * 132),
                rule.sizes[-1])
    assert row.plan.route == f"tiled_prefill_ps{want}", row.plan.notes
    assert row.plan.specialization[5] == dataclasses.astuple(short.config)
    assert row.plan.grid == (short.config.threads, 32, -(-seq_len // want)) and row.plan.threadgroup[0] == 128
    tile = row.plan.notes[0]
    assert tile.startswith("tile: BQ=64 query rows (4 simdgroups x 16), BKV=32"), tile
    assert (f"longest chunk {q_len} rows <= TILED_SPLIT_RULES[cuda].short_tiles[128].max_rows=64: the short-chunk "
            f"tile, {short.min_threadgroups_per_core:g} threadgroups per core") in tile
    split = [n for n in row.plan.notes if n.startswith("tiled split:")]
    assert len(split) == 1 and f"{short.min_threadgroups_per_core:g}*gpu_cores=264" in split[0], split


def test_the_short_tile_only_where_a_launch_splits_and_it_is_measured():
    """No short tile: without a split (many sequences fill the GPU), at head sizes the table does not
    list, on Metal, with the setting off; a forced split size takes it (the route's size stays forced)."""
    def tile(row):
        return row.plan.specialization[5]

    table = dataclasses.astuple(tp.tile_config("cuda", 128))
    many = _row(_explain(H200, [4] * 8, [2048] * 8))  # 8 tiles x 32 heads = 256 threadgroups: no split
    assert many.plan.route == "tiled_prefill" and tile(many) == table
    head64 = _row(_explain(H200, [64], [2112], heads=(32, 8, 64)))
    assert head64.plan.route.startswith("tiled_prefill_ps") and tile(head64) == dataclasses.astuple(
        tp.tile_config("cuda", 64))
    assert _row(_explain(M5, [64], [2112])).plan.specialization[5] == dataclasses.astuple(tp.tile_config("metal", 128))
    with override_settings(tiled_short_tile=False):
        off = _row(_explain(H200, [64], [2112]))
    assert tile(off) == table and off.plan.route == "tiled_prefill_ps512"
    assert "TILED_SPLIT_RULES[cuda].short_tiles[128] off (METAL_ATTN_TILED_SHORT_TILE=0)" in off.plan.notes[0]
    with override_settings(tiled_partition_size=512):
        forced = _row(_explain(H200, [64], [2112]))
    assert forced.plan.route == "tiled_prefill_ps512" and tile(forced) == dataclasses.astuple(
        tp.TILED_SPLIT_RULES["cuda"].short_tiles[128].config)
    # Six chunks of 60 rows at 16 heads: the table's tile splits (at most 3 + 5 = 8 tiles, 128 threadgroups),
    # the short tile would not (6 + 5 = 11 tiles, 176 >= 132), so the table's tile keeps its split.
    crowd = _row(_explain(H200, [60] * 6, [2048] * 6, heads=(16, 2, 128)))
    assert tile(crowd) == table and crowd.plan.route.startswith("tiled_prefill_ps"), crowd.plan.notes
    assert "short-chunk tile" not in crowd.plan.notes[0]


def test_long_prompts_fill_the_gpu_and_do_not_split():
    row = _row(_explain(H200, [4096], [4096]))  # 32 tiles x 32 heads = 1,024 threadgroups
    assert row.plan.route == "tiled_prefill" and row.plan.grid[2] == 1
    assert any("tiles*num_heads=32*32=1024 >= " in n and n.endswith("-> no split") for n in row.plan.notes)
    # Several sequences: a bound (each may end in a partial tile), 3 x 128 rows -> at most 5 tiles.
    three = _row(_explain(H200, [128, 128, 128], [4096, 4096, 4096]))
    assert any("tiles*num_heads=5*32=160 >= " in n for n in three.plan.notes), three.plan.notes


def test_metal_has_no_split_rule_and_mixed_batches_never_split():
    row = _row(_explain(M5, [64], [2112]))
    assert row.plan.route == "tiled_prefill"
    assert "tiled split: no rule measured for backend=metal (no split)" in row.plan.notes
    mixed = _row(_explain(H200, [1, 64], [100, 2112]))  # decode rows ride in the tiles here
    assert mixed.plan.route == "tiled_prefill" and "tiled split: mixed batches never split" in mixed.plan.notes


def test_one_partition_is_no_split_even_when_tiles_are_few():
    row = _row(_explain(H200, [64], [100]))  # 100 keys: no size gives two partitions
    assert row.plan.route == "tiled_prefill"
    assert any("no size of" in n and "gives 2 partitions" in n for n in row.plan.notes), row.plan.notes


@pytest.mark.parametrize(("forced", "seq_len", "route"),
                         [(-1, 2112, "tiled_prefill"), (128, 2112, "tiled_prefill_ps128"),
                          (512, 2112, "tiled_prefill_ps512"), (512, 400, "tiled_prefill"),
                          (256, 8192, "tiled_prefill_ps256")])
def test_the_setting_forces_or_turns_off_the_split(forced, seq_len, route):
    with override_settings(tiled_partition_size=forced):
        row = _row(_explain(H200, [64], [seq_len]))
        m5 = _row(_explain(M5, [64], [seq_len]))
    assert row.plan.route == route, row.plan.notes
    assert m5.plan.route == route  # a forced size applies on every backend, Metal included
    assert any("METAL_ATTN_TILED_PARTITION_SIZE" in n for n in row.plan.notes)


def test_split_launch_arguments_are_checked():
    md = AttentionMetadata.build(np.arange(4, dtype=np.int32)[None, :], [60], [0, 60], validate=False)
    import mlx.core as mx

    q = mx.zeros((60, 4, 128), mx.bfloat16)
    kc = mx.zeros((4, 16, 2, 128), mx.bfloat16)
    common = dict(scale=1.0, sinks=None, sliding_window=None, softcap=None, backend="cuda",
                  config=tp.TileConfig(128, 32, rb=2))
    with pytest.raises(ValueError, match=r"partition_size=48 with BKV=32, first_seq=0 \(allowed: 0, or a positive "
                                         r"multiple of BKV"):
        tp.launch(q, kc, kc, md, partition_size=48, **common)
    with pytest.raises(ValueError, match=r"partition_size=128 with BKV=32, first_seq=1"):
        tp.launch(q, kc, kc, md, partition_size=128, first_seq=1, **common)
    with pytest.raises(ValueError, match=r"partition_size=-128"):
        tp.launch(q, kc, kc, md, partition_size=-128, **common)


def test_split_defines_and_template():
    cfg = tp.TileConfig(128, 32, rb=2)
    assert tp.kernel_defines(cfg, split=True) == (("TP_KV_SERIAL", 0), ("TP_SPLIT", 1))
    assert tp.kernel_template("bfloat16", 128, 16, cfg, 256)[-1] == ("PARTITION_SIZE", 256)
    assert all(name != "PARTITION_SIZE" for name, _ in tp.kernel_template("bfloat16", 128, 16, cfg))
    assert all(p % 32 == 0 for p in tp.TILED_PARTITION_SIZES)  # whole KV tiles of every table's BKV


def test_the_selection_cache_tells_settings_and_devices_apart():
    """A selection is cached per (request, device, settings): another setting, or another device of the same
    backend, must not get the cached answer."""
    from metal_attn.plugins import get_registry
    from metal_attn.settings import get_settings

    decode = _explain(H200, [1], [8192]).request
    default = get_registry().select(decode, H200, get_settings()).plan.partition_size
    with override_settings(partition_size=64):
        assert get_registry().select(decode, H200, get_settings()).plan.partition_size == 64 != default
    few_cores = get_registry().select(decode, dataclasses.replace(H200, gpu_cores=8), get_settings())
    assert few_cores.plan.partition_size != default
    assert get_registry().select(decode, H200, get_settings()).plan.partition_size == default


@pytest.mark.parametrize("device", (H200, M5), ids=("h200", "m5"))
def test_mixed_decode_rows_stream_follows_its_rule_and_the_toggle(device):
    from metal_attn.providers import gpu_common as gc

    rule = gc.DECODE_ROWS_STREAM_RULES[device.backend]
    with override_settings(disabled_providers=WITHOUT_SDPA):
        row = _row(_explain(device, [1, 1, 300], [8192, 100, 800]))
    assert row.plan.route == "mixed_prefill_decode"
    assert row.plan.specialization[6].side_stream is rule.side_stream
    assert any(f"DECODE_ROWS_STREAM_RULES[{device.backend}].side_stream={rule.side_stream}" in n
               for n in row.plan.notes), row.plan.notes
    for on in (False, True):
        with override_settings(decode_rows_stream=on, disabled_providers=WITHOUT_SDPA):
            row = _row(_explain(device, [1, 1, 300], [8192, 100, 800]))
        assert row.plan.specialization[6].side_stream is on
        assert any(f"METAL_ATTN_DECODE_ROWS_STREAM={int(on)}" in n for n in row.plan.notes), row.plan.notes


def test_metal_keeps_one_stream_until_measured():
    from metal_attn.providers import gpu_common as gc

    assert gc.DECODE_ROWS_STREAM_RULES["metal"].side_stream is False
    assert "not measured" in gc.DECODE_ROWS_STREAM_RULES["metal"].evidence


def test_the_decode_rows_side_stream_is_one_per_thread():
    """MLX (0.31.2 on) ties a stream to the thread that made it, so each thread gets its own second
    stream, made once there (no GPU here: `mx.new_stream` is stood in for)."""
    import threading
    from unittest import mock

    import mlx.core as mx
    from metal_attn.providers.gpu_common import decode_rows

    made = []

    def new_stream(device):
        made.append((threading.get_ident(), device))
        return object()

    with mock.patch.object(decode_rows, "_side_streams", threading.local()), \
            mock.patch.object(mx, "new_stream", side_effect=new_stream):
        here = decode_rows.side_stream()
        assert decode_rows.side_stream() is here
        there = []
        worker = threading.Thread(target=lambda: there.extend([decode_rows.side_stream(), decode_rows.side_stream()]))
        worker.start()
        worker.join()
    assert there[0] is there[1] and there[0] is not here
    assert [d for _, d in made] == [mx.gpu, mx.gpu] and made[0][0] != made[1][0]
