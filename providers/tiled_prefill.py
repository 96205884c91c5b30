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
        tiles = request.total_q_tokens // cfg.bq + request.num_seqs  # an upper bound; exact per batch
        notes = [f"tile: BQ={cfg.bq} query rows ({cfg.simdgroups} simdgroups x {8 * cfg.rb}), BKV={cfg.bkv} keys, "
                 f"{cfg.threadgroup_bytes(request.head_size, ITEMSIZE[request.dtype])} bytes of threadgroup memory",
                 *split_notes]
        return Plan(
            provider=self.name,
            route=SPLIT_ROUTE if decode_spec else ROUTE,
            partition_size=partition,
            grid=(tiles * cfg.threads, request.num_heads, 1),
            threadgroup=(cfg.threads, 1, 1),
            specialization=(ROUTE, device.backend, request.dtype, request.head_size, request.block_size,
                            dataclasses.astuple(cfg), decode_spec),
            notes=tuple(notes),
        )

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Compile the plan's kernels with tiny launches (skipped for hypothetical devices)."""
        _, backend, dtype, head, block, tile, decode_spec = plan.specialization
        gc.compile_eagerly(
            device, f"tiled_prefill {plan.specialization[:6]}",
            lambda b: launch(b.q, b.cache, b.cache, b.metadata, scale=1.0, sinks=None, sliding_window=None,
                             softcap=None, backend=backend, config=TileConfig(*tile)),
            dtype=dtype, head_size=head, block_size=block, seq_len=2, q_rows=2)
        if decode_spec:
            gc.prepare_decode_rows(decode_spec, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        # The plan's tile is valid by construction (`tile_config`): no checks, the batch's descriptor.
        _, backend, _, _, _, tile, decode_spec = plan.specialization
        md = inputs.metadata
        n_dec = md.num_decode_seqs if decode_spec else 0
        prefill = _launch(inputs.q, inputs.k_cache, inputs.v_cache, md, scale=inputs.scale, sinks=inputs.sinks,
                          sliding_window=inputs.sliding_window, softcap=inputs.softcap, backend=backend,
                          config=_tile(tile), first_seq=n_dec)
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
                        inputs=(((5, 4, head), dtype), ((4, block, 2, head), dtype), ((4, block, 2, head), dtype),
                                ((2, 4), "int32"), ((2,), "int32"), ((3,), "int32"), ((2, 2), "int32"),
                                ((4,), "float32"), ((6,), "int32"), ((2,), "float32")),
                        outputs=(((5, 4, head), dtype),), defines=kernel_defines(cfg),
                    ))
        # The one-buffer path (no Metal table picks it; the NAX tests' reference at head 512 on CUDA).
        one = TileConfig(32, 32, one_buffer=True)
        specs.append(Specialization(
            label="tiled_prefill bfloat16 head=512 block=16 one_buffer", kernel=ROUTE, source_files=KERNEL_FILES,
            input_names=KERNEL_INPUTS, output_names=KERNEL_OUTPUTS,
            template=tuple(kernel_template("bfloat16", 512, 16, one)),
            inputs=(((5, 4, 512), "bfloat16"), ((4, 16, 2, 512), "bfloat16"), ((4, 16, 2, 512), "bfloat16"),
                    ((2, 4), "int32"), ((2,), "int32"), ((3,), "int32"), ((2, 2), "int32"),
                    ((4,), "float32"), ((6,), "int32"), ((2,), "float32")),
            outputs=(((5, 4, 512), "bfloat16"),), defines=kernel_defines(one),
        ))
        return specs

    def cuda_sources(self) -> list[CudaSource]:
        """The kernel at every CUDA tile (float16, bfloat16), for `metal_attn.cuda_check`."""
        from metal_attn.source_specs import CudaSource

        out = []
        tiles = [(head, cfg, "") for head, cfg in sorted(TILE_CONFIGS["cuda"].items())]
        tiles.append((512, TileConfig(32, 32, one_buffer=True), " one_buffer"))  # the NAX tests' reference
        for dt, (head, cfg, tag) in itertools.product(("float16", "bfloat16"), tiles):
            out.append(CudaSource(f"tiled_prefill {dt} h{head}{tag}", ROUTE, KERNEL_FILES,
                                  tuple(zip(KERNEL_INPUTS, (dt, dt, dt, "int32", "int32", "int32", "int32", "float32",
                                                            "int32", "float32"))), (("out", dt),),
                                  tuple(kernel_template(dt, head, 16, cfg)), kernel_defines(cfg)))
        return out


@functools.lru_cache(maxsize=64)
def _tile(fields: tuple[int, ...]) -> TileConfig:
    """The `TileConfig` a plan's specialization carries (built once per value)."""
    return TileConfig(*fields)


def kernel_defines(config: TileConfig) -> tuple[tuple[str, int], ...]:
    """The kernel's code-path define: K and V through one buffer (`TileConfig.one_buffer`) or two."""
    return (("TP_KV_SERIAL", int(config.one_buffer)),)


def kernel_object(backend: str, config: TileConfig) -> Any:
    """The ``mx.fast`` kernel object of ``tiled_prefill`` on ``backend`` for ``config``'s code path
    (built once)."""
    return kernels.load_kernel(ROUTE, KERNEL_FILES, KERNEL_INPUTS, KERNEL_OUTPUTS, backend,
                               defines=kernel_defines(config))


def kernel_template(dtype: Any, head_size: int, block_size: int, config: TileConfig) -> list[tuple[str, Any]]:
    """The template arguments of one specialization."""
    return [("T", dtype), ("HEAD_SIZE", head_size), ("BLOCK_SIZE", block_size), ("BQ", config.bq),
            ("BKV", config.bkv), ("RB", config.rb)]


def launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
           sinks: mx.array | None, sliding_window: int | None, softcap: float | None, backend: str,
           config: TileConfig | None = None, first_seq: int = 0) -> mx.array:
    """Run the tiled kernel over the sequences from ``first_seq`` on; returns ``[T, H, D]``.

    Rows of sequences before ``first_seq`` are left unwritten (the caller fills them).
    ``config`` overrides `TILE_CONFIGS` (BQ a positive multiple of 8, BKV a positive
    multiple of 16), for sweeps and tests.
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
    return _launch(q, k_cache, v_cache, metadata, scale=scale, sinks=sinks, sliding_window=sliding_window,
                   softcap=softcap, backend=backend, config=cfg, first_seq=first_seq)


def _launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, metadata: AttentionMetadata, *, scale: float,
            sinks: mx.array | None, sliding_window: int | None, softcap: float | None, backend: str,
            config: TileConfig, first_seq: int) -> mx.array:
    """`launch` after its checks, through the batch's launch descriptor (`gc.cached_launch`: the
    layers of a step share it)."""
    key = (_epoch.current(), ROUTE, backend, config, first_seq, q.shape, q.dtype, k_cache.shape, scale, softcap,
           sliding_window, sinks is not None)
    got = metadata._launches.get(key)
    if got is None:
        got = gc.cached_launch(metadata, key, lambda: tiled_launch(
            q.shape, q.dtype, k_cache.shape, metadata, scale=scale, use_sinks=sinks is not None,
            sliding_window=sliding_window, softcap=softcap, backend=backend, config=config, first_seq=first_seq))
    return got(q, k_cache, v_cache, metadata, sinks)


@dataclasses.dataclass(frozen=True, slots=True)
class TiledLaunch:
    """A tiled launch over one batch (`tiled_launch`): call it with the query, the pools, the metadata
    it was built for and the sinks (or ``None`` when it was built without)."""

    launch: gc.KernelLaunch
    tiles: mx.array
    params: mx.array
    fparams: mx.array
    zero_sinks: mx.array

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, md: AttentionMetadata,
                 sinks: mx.array | None) -> mx.array:
        return self.launch([q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, self.tiles,
                            self.zero_sinks if sinks is None else sinks, self.params, self.fparams])[0]


def tiled_launch(q_shape: tuple[int, ...], dtype: Any, k_shape: tuple[int, ...], metadata: AttentionMetadata, *,
                 scale: float, use_sinks: bool, sliding_window: int | None, softcap: float | None, backend: str,
                 config: TileConfig, first_seq: int) -> TiledLaunch:
    """The tiled kernel's launch for a query of ``q_shape`` in ``dtype`` over pools of ``k_shape`` and
    the batch ``metadata``, from sequence ``first_seq`` on (``config`` checked by `launch`)."""
    total, num_heads, head = q_shape
    _, block_size, num_kv_heads, _ = k_shape
    tiles = metadata.query_tiles(config.bq, first_seq)
    num_tiles = tiles.shape[0]
    params = gc.pack_int32((num_tiles, num_heads, num_kv_heads, metadata.max_blocks_per_seq,
                            int(sliding_window or 0), int(use_sinks)))
    kernel = gc.kernel_launch(kernel_object(backend, config), template=kernel_template(dtype, head, block_size, config),
                              grid=(num_tiles * config.threads, num_heads, 1), threadgroup=(config.threads, 1, 1),
                              output_shapes=[(total, num_heads, head)], output_dtypes=[dtype])
    return TiledLaunch(kernel, tiles, params, gc.pack_scale(scale, softcap), gc.zeros_f32(num_heads))
