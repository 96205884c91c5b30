"""The ``tiled_prefill`` provider: FlashAttention-2 tiles over the paged cache (Metal and CUDA).

One threadgroup per (tile of BQ query rows of one sequence, query head); K and V
tiles gathered through the block table into threadgroup memory; S = Q K^T and
O += P V as 8x8 simdgroup-matrix products (``kernels_v2/tiled_prefill.metal``;
on CUDA the prelude maps the 8x8 product onto the tensor-core ``mma.m16n8k16``).
Admission is data plus two rules, and every refusal is a reason ``explain`` prints:

- batches with prefill rows (``prefill``, ``mixed``, ``verify``), float16/bfloat16
  with the same cache dtype, sinks, sliding window and softcap allowed;
- the head size has a tile configuration (`TILE_CONFIGS`, per backend) and its
  K/V tiles fit the device's threadgroup memory.

Mixed batches: the decode rows ride in the tiles (one tile each) unless the
longest of them reaches `MIXED_DECODE_MIN_CONTEXT` tokens; then they go through
the per-token kernel (``classic``'s, split or not by its occupancy gate: the
decode-rows sub-plan of `metal_attn.providers.gpu_common`) and only the prefill
rows through the tiles: route ``mixed_prefill_decode``.

Split-KV: where a batch's tiles are too few to fill the GPU (a short chunk after long context:
one 128-row tile per head is 32 threadgroups at 32 heads), a launch splits every tile's keys into
partitions (`TILED_SPLIT_RULES`, per backend; route ``tiled_prefill_psP``) and the per-token
kernel's reducer combines their partials. Mixed batches never split.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from metal_attn.providers import gpu_common as gc

from metal_attn import _epoch, kernels
from metal_attn.constants import KERNEL_BLOCK_SIZES
from metal_attn.kernels import SIMD_WIDTH
from metal_attn.provider import Plan, Provider

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

ROUTE = "tiled_prefill"
SPLIT_ROUTE = "mixed_prefill_decode"
#: Elements of padding per K/V tile row in threadgroup memory (the kernel's ``LD``).
ROW_PADDING = 8


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch shape of the tiled kernel.

    ``bq`` query rows per threadgroup, ``bkv`` keys per K/V tile, ``rb`` 8-row blocks per
    simdgroup (2: the blocks share every right operand). ``one_buffer``: the tile's K rows, then
    its V rows, through one threadgroup buffer (four barriers a tile instead of two), so that
    32-key tiles fit at head 512 in 48 KB. No table picks it; the NAX kernel's GPU tests take it
    as their reference at head 512, where the NAX kernel walks 32-key tiles.
    """

    bq: int
    bkv: int
    rb: int = 1
    one_buffer: bool = False

    @property
    def simdgroups(self) -> int:
        return self.bq // (8 * self.rb)

    @property
    def threads(self) -> int:
        return self.simdgroups * SIMD_WIDTH

    def threadgroup_bytes(self, head_size: int, itemsize: int) -> int:
        """Threadgroup memory of the K and V tiles (padded rows; one tile's worth with ``one_buffer``)."""
        return (1 if self.one_buffer else 2) * self.bkv * (head_size + ROW_PADDING) * itemsize


#: Upstream's shape: 8 rows per simdgroup.
_UPSTREAM = MappingProxyType({
    64: TileConfig(32, 32),
    96: TileConfig(32, 32),
    128: TileConfig(32, 32),
    256: TileConfig(16, 16),
})
#: Tile per backend and head size (data, not code paths; every backend covers the same head
#: sizes). Metal: upstream's table for a 32 KB threadgroup budget (heads 64/96/128: 32 query
#: rows = 4 simdgroups and 32-key tiles; head 256: 16 and 16). CUDA: the H200 sweep
#: (`benchmarks/sweep_tiled.py`, docs/bench-h200-tiled.md): 128 query rows as 8 warps of two
#: 8-row blocks (whole 16-row tensor-core products); 1.6x-3x upstream's shape.
TILE_CONFIGS: Mapping[str, Mapping[int, TileConfig]] = MappingProxyType({
    "metal": _UPSTREAM,
    "cuda": MappingProxyType({
        64: TileConfig(128, 32, rb=2),
        96: TileConfig(128, 32, rb=2),
        128: TileConfig(128, 32, rb=2),
        256: TileConfig(128, 16, rb=2),
    }),
})


def tile_config(backend: str, head_size: int) -> TileConfig | None:
    """The tile of ``head_size`` on ``backend`` (``None``: no configuration)."""
    return TILE_CONFIGS.get(backend, _UPSTREAM).get(head_size)


#: Element sizes of the dtypes the kernel takes (its products need 16-bit operands).
ITEMSIZE = {"float16": 2, "bfloat16": 2}

KERNEL_FILES = ("paged_common.h", "tiled_prefill.metal")
KERNEL_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "tiles", "sinks", "params",
                 "fparams")
KERNEL_OUTPUTS = ("out",)
#: The split launch's outputs: the split-KV contract's partials (`gpu_common.split_scratch`).
SPLIT_OUTPUTS = ("max_logits", "exp_sums", "tmp_out")
#: The partition sizes a split launch may take (multiples of every table's BKV).
TILED_PARTITION_SIZES = (512, 256, 128)


@dataclasses.dataclass(frozen=True)
class ShortTile:
    """The tile of a split launch over short chunks: where a batch splits and its longest chunk has at
    most ``max_rows`` rows, ``config`` replaces `TILE_CONFIGS`' tile (fewer idle simdgroups: a
    128-row tile over a 64-row chunk leaves half of them without rows), and the partition size
    aims at ``min_threadgroups_per_core`` of its smaller threadgroups. ``evidence``: the
    measurement behind it."""

    max_rows: int
    config: TileConfig
    min_threadgroups_per_core: float
    evidence: str = ""


@dataclasses.dataclass(frozen=True)
class TiledSplitRule:
    """When a tiled launch splits its keys on one backend, and the measurement behind it.

    A batch splits when its tiles times its query heads (the unsplit grid) stay below
    ``max_threadgroups_per_core`` per GPU core and its longest row spans at least two partitions
    of the smallest size. It then takes the largest of ``sizes`` whose threadgroups (tiles x heads x
    partitions) reach ``min_threadgroups_per_core`` per core, else the smallest; never one whose
    split-KV scratch exceeds `SCRATCH_CAP_BYTES`. ``short_tiles`` (per head size): the tile of a
    split launch whose chunks are all short (`ShortTile`).
    """

    max_threadgroups_per_core: float
    min_threadgroups_per_core: float
    sizes: tuple[int, ...]
    evidence: str
    short_tiles: Mapping[int, ShortTile] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


#: One rule per backend (data; ``explain`` prints the arithmetic). A backend without one never splits.
TILED_SPLIT_RULES: Mapping[str, TiledSplitRule] = MappingProxyType({
    "cuda": TiledSplitRule(
        1.0, 1.0, TILED_PARTITION_SIZES,
        "H200, MLX 0.32.4, bf16, 32/8 heads, head 128, one sequence (benchmarks/probe_tiled_split.py, blocking "
        "calls; docs/bench-h200-prefill.md): unsplit against split ms, 4 rows after 4K 0.499 against 0.219-0.257, "
        "16 after 4K 0.547 against 0.242-0.252, 32 after 2K 0.338 against 0.182-0.196, 64 after 2K 0.325 against "
        "0.185-0.199, 128 after 4K 0.602 against 0.292-0.389 (the grid: 1 tile x 32 heads; 512-key partitions "
        "fastest or within 5% of it at every one); 256 rows after 4K (64 threadgroups) 0.604 against 0.457 at "
        "512; 8 sequences of 4 rows after 2K (256 threadgroups, no split) 0.486 against 0.511-0.607",
        short_tiles=MappingProxyType({128: ShortTile(64, TileConfig(64, 32, rb=2), 2.0, evidence=(
            "H200, MLX 0.32.4, bf16, 32/8 heads, head 128, one chunk, bare launches queued (benchmarks/sweep_tiled.py "
            "--chunks, thirteenth session; docs/bench-h200-prefill.md), us: 64 rows after 2K 77.1 with the 128-row "
            "tile at 512-key partitions (the rule's choice before it), 59.8 with the 64-row tile at 256 (this rule's "
            "choice at 2 threadgroups per core; 70.4 at 512); 32 after 2K 68.6 against 64.4 (128; 66.2 at 256); 16 "
            "after 4K 96.2 against 71.9 (256; 67.5 at 512); 128 after 4K keeps the 128-row tile (137.9 against "
            "150.7); two 256-row chunks unsplit within 0.5% of the best split, a 512-row one fastest unsplit. GPU "
            "busy at the rule's choice (CUPTI, probe_tiled_split.py, short tile on / off): 64 after 2K 54 / 61 us, 32 "
            "after 2K 42 / 53, 16 after 4K 63 / 86, 4 after 4K 61 / 85"))})),
})


def _fmt(values: Any) -> str:
    return ", ".join(str(v) for v in sorted(values))


class TiledPrefillProvider(Provider):
    """FlashAttention-2 style prefill over the paged cache with 8x8 simdgroup matrices."""

    name = ROUTE
    priority = 50
    backends = frozenset({"metal", "cuda"})
    phases = frozenset({"prefill", "mixed", "verify"})
    dtypes = frozenset(ITEMSIZE)
    head_sizes = frozenset(_UPSTREAM)
    block_sizes = frozenset(KERNEL_BLOCK_SIZES)
    features = frozenset({"sinks", "sliding_window", "softcap"})
    description = "Tiled FlashAttention-2 prefill (8x8 simdgroup matrices); decode rows of mixed batches split off."

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = super().availability_reasons(device)
        if reasons:
            return reasons
        return gc.availability_reasons(device)

    def extra_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        cfg = tile_config(device.backend, request.head_size)
        if cfg is None or request.dtype not in ITEMSIZE:
            return []  # the declarative reasons already say why
        need = cfg.threadgroup_bytes(request.head_size, ITEMSIZE[request.dtype])
        limit = device.max_threadgroup_memory
        if limit is None:
            return ["max_threadgroup_memory unknown (the K/V tiles' fit needs it)"]
        if need > limit:
            return [f"K/V tiles need {need} bytes of threadgroup memory for head_size={request.head_size} "
                    f"(BKV={cfg.bkv}; allowed: <= {limit} bytes on this device)"]
        return []

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        cfg = tile_config(device.backend, request.head_size)
        decode_spec, partition, split_notes = gc.tiles_decode_part(request, device.backend, device, settings)
        tiles = tile_count(request, cfg)
        kv_split, tile_note, split_note = 0, "", None
        if not decode_spec:
            kv_split, split_note = split_choice(request, tiles, device, settings)
            short, tile_note = short_tile(request, device, settings) if kv_split else (None, "")
            if short is not None:  # the short tile's own split (its grid has more tiles when there are sequences)
                short_tiles = tile_count(request, short.config)
                short_split, short_note = split_choice(request, short_tiles, device, settings,
                                                       short.min_threadgroups_per_core)
                if short_split:
                    cfg, tiles, kv_split, split_note = short.config, short_tiles, short_split, short_note
                else:
                    tile_note = ""
        notes = [f"tile: BQ={cfg.bq} query rows ({cfg.simdgroups} simdgroups x {8 * cfg.rb}), BKV={cfg.bkv} keys, "
                 f"{cfg.threadgroup_bytes(request.head_size, ITEMSIZE[request.dtype])} bytes of threadgroup memory"
                 + (f" ({tile_note})" if tile_note else ""),
                 *split_notes, *([split_note] if split_note else [])]
        parts = request.partitions(kv_split) if kv_split else 1
        return Plan(
            provider=self.name,
            route=SPLIT_ROUTE if decode_spec else split_route(kv_split),
            partition_size=partition or kv_split,
            grid=(tiles * cfg.threads, request.num_heads, parts),
            threadgroup=(cfg.threads, 1, 1),
            specialization=(ROUTE, device.backend, request.dtype, request.head_size, request.block_size,
                            dataclasses.astuple(cfg), decode_spec, kv_split),
            notes=tuple(notes),
        )

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Compile the plan's kernels with tiny launches (skipped for hypothetical devices)."""
        _, backend, dtype, head, block, tile, decode_spec, kv_split = plan.specialization
        cfg = TileConfig(*tile)
        # The path the plan runs: split, over two partitions so that the reducer compiles too, or not.
        gc.compile_eagerly(
            device, f"tiled_prefill {plan.specialization[:6]}" + (f" split {kv_split}" if kv_split else ""),
            lambda b: launch(b.q, b.cache, b.cache, b.metadata, scale=1.0, sinks=None, sliding_window=None,
                             softcap=None, backend=backend, config=cfg, partition_size=kv_split),
            dtype=dtype, head_size=head, block_size=block, seq_len=kv_split + 2, q_rows=2)
        if decode_spec:
            gc.prepare_decode_rows(decode_spec, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        # The plan's tile is valid by construction (`tile_config`): no checks, the batch's descriptor.
        _, backend, _, _, _, tile, decode_spec, kv_split = plan.specialization
        md = inputs.metadata
        n_dec = md.num_decode_seqs if decode_spec else 0
        prefill = _launch(inputs.q, inputs.k_cache, inputs.v_cache, md, scale=inputs.scale, sinks=inputs.sinks,
                          sliding_window=inputs.sliding_window, softcap=inputs.softcap, backend=backend,
                          config=_tile(tile), first_seq=n_dec, partition_size=kv_split)
        if not decode_spec:
            return prefill
        import mlx.core as mx

        decode = gc.run_decode_rows(inputs, decode_spec)
        return mx.concatenate([decode, prefill[n_dec:]], axis=0)

    # -- source checks ----------------------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """Every Metal specialization this provider can choose, for `metal_attn.msl_check`:
        the kernel over {float16, bfloat16} x the tile table's head sizes x kernel block sizes
        (2 x 4 x 3 = 24), and the one-buffer path once. The decode rows of a split mixed batch use
        the classic provider's specializations, which its own set covers."""
        from metal_attn.source_specs import Specialization

        specs = []
        for dtype in sorted(ITEMSIZE):
            for head, cfg in sorted(TILE_CONFIGS["metal"].items()):
                for block in sorted(KERNEL_BLOCK_SIZES):
                    specs.append(Specialization(
                        label=f"tiled_prefill {dtype} head={head} block={block}",
                        kernel=ROUTE, source_files=KERNEL_FILES, input_names=KERNEL_INPUTS, output_names=KERNEL_OUTPUTS,
                        template=tuple(kernel_template(dtype, head, block, cfg)),
                        inputs=_msl_inputs(dtype, head, block),
                        outputs=(((5, 4, head), dtype),), defines=kernel_defines(cfg),
                    ))
        # The one-buffer path (no Metal table picks it; the NAX tests' reference at head 512 on CUDA).
        one = TileConfig(32, 32, one_buffer=True)
        specs.append(Specialization(
            label="tiled_prefill bfloat16 head=512 block=16 one_buffer", kernel=ROUTE, source_files=KERNEL_FILES,
            input_names=KERNEL_INPUTS, output_names=KERNEL_OUTPUTS,
            template=tuple(kernel_template("bfloat16", 512, 16, one)),
            inputs=_msl_inputs("bfloat16", 512, 16),
            outputs=(((5, 4, 512), "bfloat16"),), defines=kernel_defines(one),
        ))
        # The split-KV path at each head size (no Metal rule splits: it is CUDA's, measured there).
        psize = 256
        for head, cfg in sorted(TILE_CONFIGS["metal"].items()):
            specs.append(Specialization(
                label=f"tiled_prefill bfloat16 head={head} block=16 split={psize}", kernel=ROUTE,
                source_files=KERNEL_FILES, input_names=KERNEL_INPUTS, output_names=SPLIT_OUTPUTS,
                template=tuple(kernel_template("bfloat16", head, 16, cfg, psize)),
                inputs=_msl_inputs("bfloat16", head, 16),
                outputs=(((5, 4, 2), "float32"), ((5, 4, 2), "float32"), ((5, 4, 2, head), "float32")),
                defines=kernel_defines(cfg, split=True),
            ))
        return specs

    def cuda_sources(self) -> list[CudaSource]:
        """The kernel at every CUDA tile (float16, bfloat16), for `metal_attn.cuda_check`."""
        from metal_attn.source_specs import CudaSource

        out = []
        tiles = [(head, cfg, "") for head, cfg in sorted(TILE_CONFIGS["cuda"].items())]
        tiles.append((512, TileConfig(32, 32, one_buffer=True), " one_buffer"))  # the NAX tests' reference
        for dt, (head, cfg, tag) in itertools.product(("float16", "bfloat16"), tiles):
            out.append(CudaSource(f"tiled_prefill {dt} h{head}{tag}", ROUTE, KERNEL_FILES, _cuda_inputs(dt),
                                  (("out", dt),),
                                  tuple(kernel_template(dt, head, 16, cfg)), kernel_defines(cfg)))
        for dt, (head, cfg) in itertools.product(("float16", "bfloat16"), sorted(TILE_CONFIGS["cuda"].items())):
            out.append(CudaSource(f"tiled_prefill {dt} h{head} split", ROUTE, KERNEL_FILES, _cuda_inputs(dt),
                                  tuple((name, "float32") for name in SPLIT_OUTPUTS),
                                  tuple(kernel_template(dt, head, 16, cfg, 256)), kernel_defines(cfg, split=True)))
        shorts = sorted(TILED_SPLIT_RULES["cuda"].short_tiles.items())
        for dt, (head, short) in itertools.product(("float16", "bfloat16"), shorts):
            out.append(CudaSource(f"tiled_prefill {dt} h{head} split short tile", ROUTE, KERNEL_FILES,
                                  _cuda_inputs(dt), tuple((name, "float32") for name in SPLIT_OUTPUTS),
                                  tuple(kernel_template(dt, head, 16, short.config, 256)),
                                  kernel_defines(short.config, split=True)))
        return out


def _msl_inputs(dtype: str, head: int, block: int) -> tuple:
    """The source check's input shapes and dtypes of one specialization (`KERNEL_INPUTS`' order): five
    query rows of 4 heads, four pages of 2 KV heads, two sequences, two tiles."""
    return (((5, 4, head), dtype), ((4, block, 2, head), dtype), ((4, block, 2, head), dtype), ((2, 4), "int32"),
            ((2,), "int32"), ((3,), "int32"), ((2, 2), "int32"), ((4,), "float32"), ((7,), "int32"),
            ((2,), "float32"))


def _cuda_inputs(dtype: str) -> tuple[tuple[str, str], ...]:
    """`KERNEL_INPUTS` with their dtypes, for the CUDA source check."""
    return tuple(zip(KERNEL_INPUTS, (dtype, dtype, dtype, "int32", "int32", "int32", "int32", "float32", "int32",
                                     "float32")))


@functools.lru_cache(maxsize=64)
def _tile(fields: tuple[int, ...]) -> TileConfig:
    """The `TileConfig` a plan's specialization carries (built once per value)."""
    return TileConfig(*fields)


def kernel_defines(config: TileConfig, split: bool = False) -> tuple[tuple[str, int], ...]:
    """The kernel's code-path defines: K and V through one buffer (`TileConfig.one_buffer`) or two;
    the split-KV partials (``split``) or the output."""
    return (("TP_KV_SERIAL", int(config.one_buffer)), ("TP_SPLIT", int(split)))


def kernel_object(backend: str, config: TileConfig, split: bool = False) -> Any:
    """The ``mx.fast`` kernel object of ``tiled_prefill`` on ``backend`` for ``config``'s code path,
    split or not (built once)."""
    return kernels.load_kernel(ROUTE, KERNEL_FILES, KERNEL_INPUTS, SPLIT_OUTPUTS if split else KERNEL_OUTPUTS,
                               backend, defines=kernel_defines(config, split))


def kernel_template(dtype: Any, head_size: int, block_size: int, config: TileConfig,
                    partition_size: int = 0) -> list[tuple[str, Any]]:
    """The template arguments of one specialization (``partition_size`` > 0: the split launch's)."""
    template = [("T", dtype), ("HEAD_SIZE", head_size), ("BLOCK_SIZE", block_size), ("BQ", config.bq),
                ("BKV", config.bkv), ("RB", config.rb)]
    return [*template, ("PARTITION_SIZE", partition_size)] if partition_size else template


def split_route(partition_size: int) -> str:
    """The route name of a tiled launch: ``tiled_prefill``, or ``tiled_prefill_psP`` when split."""
    return f"{ROUTE}_ps{partition_size}" if partition_size else ROUTE


def split_choice(request: AttentionRequest, tiles: int, device: DeviceInfo, settings: Settings | None,
                 min_threadgroups_per_core: float | None = None) -> tuple[int, str]:
    """The partition size of a tiled launch of ``tiles`` tiles for ``request`` (0: unsplit;
    `TILED_SPLIT_RULES`, or ``METAL_ATTN_TILED_PARTITION_SIZE``), and the arithmetic for ``explain``.
    ``min_threadgroups_per_core`` replaces the rule's own (a `ShortTile`'s)."""
    from metal_attn.request import Phase

    if request.phase is Phase.MIXED:
        return 0, "tiled split: mixed batches never split"

    forced = settings.tiled_partition_size if settings is not None else 0
    if forced < 0:
        return 0, "tiled split: off (METAL_ATTN_TILED_PARTITION_SIZE=-1)"
    if forced:
        ok = request.partitions(forced) >= 2 and gc.scratch_fits(request, forced)
        return (forced if ok else 0), (
            f"tiled split: partition size {forced} forced by METAL_ATTN_TILED_PARTITION_SIZE -> "
            + (f"{request.partitions(forced)} partitions" if ok else
               "no split (fewer than 2 partitions, or the scratch exceeds its cap)"))
    rule = TILED_SPLIT_RULES.get(device.backend)
    if rule is None:
        return 0, f"tiled split: no rule measured for backend={device.backend} (no split)"
    cores = device.gpu_cores
    if not cores:
        return 0, "tiled split: gpu_cores unknown (no split; set METAL_ATTN_GPU_CORES)"
    grid = tiles * request.num_heads
    limit = rule.max_threadgroups_per_core * cores
    sizes = [p for p in rule.sizes if request.partitions(p) >= 2 and gc.scratch_fits(request, p)]
    head = f"tiled split: tiles*num_heads={tiles}*{request.num_heads}={grid}"
    if grid >= limit or not sizes:
        why = (f">= {rule.max_threadgroups_per_core:g}*gpu_cores={limit:g}" if grid >= limit else
               f"< {limit:g}, but no size of {list(rule.sizes)} gives 2 partitions of "
               f"max_seq_len={request.max_seq_len} within the scratch cap")
        return 0, f"{head} {why} -> no split"
    per_core = rule.min_threadgroups_per_core if min_threadgroups_per_core is None else min_threadgroups_per_core
    want = per_core * cores
    chosen = next((p for p in sizes if grid * request.partitions(p) >= want), sizes[-1])
    return chosen, (f"{head} < {rule.max_threadgroups_per_core:g}*gpu_cores={limit:g} -> split; partition size "
                    f"{chosen}: threadgroups {grid}*{request.partitions(chosen)}={grid * request.partitions(chosen)} "
                    f"{'>=' if grid * request.partitions(chosen) >= want else '<'} "
                    f"{per_core:g}*gpu_cores={want:g} (TILED_SPLIT_RULES[{device.backend}] "
                    f"takes the largest of {list(rule.sizes)} reaching it, else the smallest)")


def tile_count(request: AttentionRequest, config: TileConfig) -> int:
    """Query tiles of ``config`` over ``request``'s rows: exact for one sequence, an upper bound for
    more (each may end in a partial tile; the launch counts them exactly per batch)."""
    return -(-request.total_q_tokens // config.bq) + request.num_seqs - 1


def short_tile(request: AttentionRequest, device: DeviceInfo,
               settings: Settings | None) -> tuple[ShortTile | None, str]:
    """The `ShortTile` of a split launch for ``request`` (``None``: `TILE_CONFIGS`' tile stays), and
    why, for ``explain``. The caller has decided that the launch splits."""
    rule = TILED_SPLIT_RULES.get(device.backend)
    short = rule.short_tiles.get(request.head_size) if rule is not None else None
    if short is None:
        return None, ""
    where = f"TILED_SPLIT_RULES[{device.backend}].short_tiles[{request.head_size}]"
    if settings is not None and not settings.tiled_short_tile:
        return None, f"{where} off (METAL_ATTN_TILED_SHORT_TILE=0)"
    if request.max_q_len > short.max_rows:
        return None, ""
    limit = device.max_threadgroup_memory
    if limit is not None and short.config.threadgroup_bytes(request.head_size, ITEMSIZE[request.dtype]) > limit:
        return None, f"{where} needs more threadgroup memory than {limit} bytes: the table's tile stays"
    return short, (f"split launch, longest chunk {request.max_q_len} rows <= {where}.max_rows={short.max_rows}: "
                   f"the short-chunk tile, {short.min_threadgroups_per_core:g} threadgroups per core")


def launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
           sinks: mx.array | None, sliding_window: int | None, softcap: float | None, backend: str,
           config: TileConfig | None = None, first_seq: int = 0, partition_size: int = 0) -> mx.array:
    """Run the tiled kernel over the sequences from ``first_seq`` on; returns ``[T, H, D]``.

    Rows of sequences before ``first_seq`` are left unwritten (the caller fills them).
    ``config`` overrides `TILE_CONFIGS` (BQ a positive multiple of 8, BKV a positive
    multiple of 16), for sweeps and tests. ``partition_size`` > 0 splits every tile's keys into
    partitions of that many (a multiple of BKV; the whole batch, so ``first_seq`` must be 0) and
    reduces them with the per-token kernel's reducer.
    """
    _, _, head = q.shape
    cfg = config or tile_config(backend, head)
    if cfg is None:
        raise ValueError(f"head_size={head} has no tile configuration on {backend} "
                         f"(configured: {_fmt(TILE_CONFIGS.get(backend, _UPSTREAM))})")
    if (cfg.rb not in (1, 2) or cfg.bq < 8 * cfg.rb or cfg.bq % (8 * cfg.rb)
            or cfg.bkv < 16 or cfg.bkv % 16 or head % 32):
        raise ValueError(f"config={cfg} with head_size={head} (allowed: rb 1 or 2, BQ a positive "
                         "multiple of 8 * rb, BKV a positive multiple of 16, head_size a multiple of 32: "
                         "products go two 8x8 blocks at a time, K operands four at a time)")
    if partition_size and (type(partition_size) is not int or partition_size < 0 or partition_size % cfg.bkv
                           or first_seq):
        raise ValueError(f"partition_size={partition_size!r} with BKV={cfg.bkv}, first_seq={first_seq} (allowed: 0, "
                         "or a positive multiple of BKV with first_seq=0: a split launch reduces every row)")
    return _launch(q, k_cache, v_cache, metadata, scale=scale, sinks=sinks, sliding_window=sliding_window,
                   softcap=softcap, backend=backend, config=cfg, first_seq=first_seq, partition_size=partition_size)


def _launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
            sinks: mx.array | None, sliding_window: int | None, softcap: float | None, backend: str,
            config: TileConfig, first_seq: int, partition_size: int = 0) -> mx.array:
    """`launch` after its checks, through the batch's launch descriptor (`gc.cached_launch`: the
    layers of a step share it)."""
    key = (_epoch.current(), ROUTE, backend, config, first_seq, partition_size, q.shape, q.dtype, k_cache.shape,
           scale, softcap, sliding_window, sinks is not None)
    got = metadata._launches.get(key)
    if got is None:
        got = gc.cached_launch(metadata, key, lambda: tiled_launch(
            q.shape, q.dtype, k_cache.shape, metadata, scale=scale, use_sinks=sinks is not None,
            sliding_window=sliding_window, softcap=softcap, backend=backend, config=config, first_seq=first_seq,
            partition_size=partition_size))
    return got(q, k_cache, v_cache, metadata, sinks)


@dataclasses.dataclass(frozen=True, slots=True)
class TiledLaunch:
    """A tiled launch over one batch (`tiled_launch`), with the reducer when split: call it with the
    query, the pools, the metadata it was built for and the sinks (or ``None`` when it was built
    without). A split launch's kernel does not read the sinks (its ``use_sinks`` parameter is 0): the
    reducer folds them."""

    launch: gc.KernelLaunch
    tiles: mx.array
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array
    reduce: gc.ReduceLaunch | None = None

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        outs = self.launch([q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, self.tiles,
                            self.zero_sinks if sinks is None else sinks, self.params, self.fparams])
        return outs[0] if self.reduce is None else self.reduce(*outs, md, sinks)


def tiled_launch(q_shape: tuple[int, ...], dtype: Any, k_shape: tuple[int, ...], metadata: AttentionMetadata, *,
                 scale: float, use_sinks: bool, sliding_window: int | None, softcap: float | None, backend: str,
                 config: TileConfig, first_seq: int, partition_size: int = 0) -> TiledLaunch | ChainedTiledLaunch:
    """The tiled kernel's launch for a query of ``q_shape`` in ``dtype`` over pools of ``k_shape`` and
    the batch ``metadata``, from sequence ``first_seq`` on (``config`` and ``partition_size`` checked by
    `launch`); split into partitions of ``partition_size`` keys when it is > 0. On CUDA with chains and
    ``cuda_tiled_chains`` on, the same launches as one chain (`chained_tiled_launch`)."""
    import mlx.core as mx

    total, num_heads, head = q_shape
    _, block_size, num_kv_heads, _ = k_shape
    tiles = metadata.query_tiles(config.bq, first_seq)
    num_tiles = tiles.shape[0]
    split = partition_size > 0
    max_parts = -(-metadata.max_seq_len // partition_size) if split else 1
    params = gc.pack_int32((num_tiles, num_heads, num_kv_heads, metadata.max_blocks_per_seq,
                            int(sliding_window or 0), int(use_sinks and not split), max_parts))
    if backend == "cuda" and gc.cuda_chains_enabled():
        from metal_attn.settings import get_settings

        if get_settings().cuda_tiled_chains:
            reduce_params = (gc.pack_int32((metadata.num_seqs, num_heads, max_parts, int(use_sinks))) if split
                             else None)
            shapes = (tuple(q_shape), tuple(k_shape), tuple(k_shape), tuple(metadata.block_tables.shape),
                      tuple(metadata.seq_lens.shape), tuple(metadata.cu_seqlens_q.shape))
            return chained_tiled_launch(dtype, total, num_heads, head, block_size, config, partition_size,
                                        max_parts, tiles, params, gc.pack_scale(scale, softcap), reduce_params,
                                        shapes)
    out = (gc.split_scratch(total, num_heads, max_parts, head) if split
           else {"output_shapes": [(total, num_heads, head)], "output_dtypes": [dtype]})
    kernel = gc.kernel_launch(kernel_object(backend, config, split),
                              template=kernel_template(dtype, head, block_size, config, partition_size),
                              grid=(num_tiles * config.threads, num_heads, max_parts),
                              threadgroup=(config.threads, 1, 1), **out)
    reduce = (gc.reduce_launch((total, num_heads, max_parts, head), mx.float32, dtype, metadata, use_sinks,
                               partition_size, backend) if split else None)
    return TiledLaunch(kernel, tiles, params, gc.pack_scale(scale, softcap), gc.zeros_f32(num_heads), reduce)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainedTiledLaunch:
    """`TiledLaunch` as one MLX operation on CUDA (`metal_attn.cuda_ops`, ``cuda_tiled_chains``): the tiled
    kernel and, when split, the reducer, with the partials as the chain's scratch. Same kernel texts, grids
    and parameters; called the same way. The chain takes float32 sinks (the reducer's), as the per-token
    kernel's chain does."""

    chain: Any
    tiles: mx.array
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array
    #: The reducer's parameters after the kernel's inputs (split), else ``None``.
    reduce_params: mx.array | None

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        inputs = [q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, self.tiles,
                  gc.reducer_sinks(sinks, self.zero_sinks), self.params, self.fparams]
        if self.reduce_params is not None:
            inputs.append(self.reduce_params)
        return self.chain(inputs)[0]


def chained_tiled_launch(dtype: Any, total: int, num_heads: int, head: int, block_size: int, config: TileConfig,
                         partition_size: int, max_parts: int, tiles: mx.array, params: mx.array, fparams: mx.array,
                         reduce_params: mx.array | None,
                         shapes: tuple[tuple[int, ...], ...]) -> ChainedTiledLaunch:
    """The `ChainedTiledLaunch` of a tiled launch (`tiled_launch` builds both kinds) over ``total`` query
    rows; ``shapes``: the query's, the pools' and the metadata's (``q``, ``k``, ``v``, ``block_tables``,
    ``seq_lens``, ``cu_seqlens_q``), which every call of the chain checks."""
    import mlx.core as mx

    from metal_attn import cuda_ops
    from metal_attn.api import dtype_name

    split = partition_size > 0
    dn = dtype_name(dtype)
    sig = _cuda_inputs(dn)
    in_dtypes = [getattr(mx, t) for _, t in sig]
    outputs = [(n, "float32") for n in SPLIT_OUTPUTS] if split else [(KERNEL_OUTPUTS[0], dn)]
    kernel = cuda_ops.kernel_function(ROUTE, KERNEL_FILES, kernel_defines(config, split), sig, outputs,
                                      kernel_template(dn, head, block_size, config, partition_size))
    num_tiles = tiles.shape[0]
    grid = cuda_ops.threadgroups((num_tiles * config.threads, num_heads, max_parts), (config.threads, 1, 1))
    block = (config.threads, 1, 1)
    in_shapes = [*shapes, tuple(tiles.shape), (num_heads,), tuple(params.shape), tuple(fparams.shape)]
    out_spec = [((total, num_heads, head), dtype)]
    n_in = len(KERNEL_INPUTS)
    zero_sinks = gc.zeros_f32(num_heads)
    if not split:  # buffer indices: the inputs, then the output
        ch = cuda_ops.chain(f"metal_attn.{ROUTE}", in_dtypes, out_spec, [],
                            [(kernel, grid, block, [*range(n_in), n_in], n_in)], in_shapes)
        return ChainedTiledLaunch(ch, tiles, params, fparams, zero_sinks, None)
    launches, scratch = gc.chained_split_reduce((kernel, grid, block), KERNEL_INPUTS, dn, head, partition_size,
                                                total, num_heads, max_parts)
    ch = cuda_ops.chain(f"metal_attn.{ROUTE}_ps{partition_size}", [*in_dtypes, mx.int32], out_spec, scratch,
                        launches, [*in_shapes, tuple(reduce_params.shape)])
    return ChainedTiledLaunch(ch, tiles, params, fparams, zero_sinks, reduce_params)
