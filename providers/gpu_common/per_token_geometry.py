"""How the per-token kernel (``kernels_v2/pagedattention.metal``) lays a launch out: its geometry
rules per backend (data: `GEOMETRY_RULES`, `STAGING_RULES`, the threadgroup-memory limits), the
`Geometry` of one launch, `geometry` (the rules applied) and `geometry_problem` (why a geometry
cannot run)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from metal_attn.providers.gpu_common.reducer import NUM_THREADS, SIMDGROUPS

from metal_attn.kernels import SIMD_WIDTH

if TYPE_CHECKING:  # pragma: no cover
    pass

#: Threadgroup sizes a per-token geometry may take.
THREAD_CHOICES = (64, 128, 256)
#: Tokens a simdgroup takes per step on the matrix path (the columns of one 8x8 block).
MMA_TOKENS = 8
#: Tokens a simdgroup takes per step on the keys-as-rows matrix path (``Geometry.mma == 2``: the rows
#: of one 16x8 tensor-core product).
KEY_ROWS_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class GeometryRule:
    """How the per-token kernel lays a head out on a simdgroup, per backend (data, not code paths).

    - lanes per token: the largest power of two up to ``max_lanes`` dividing ``head_size / 4``
      that still leaves each lane at least ``min_elements`` head elements;
    - tokens unrolled per lane: 2 while a lane holds at most ``unroll_up_to`` elements (split
      route) or ``unroll_up_to_unsplit`` (unsplit route), else 1;
    - heads per threadgroup (HPS): the largest of ``hps_choices`` dividing the GQA group with
      ``HPS * elements per lane <= hps_element_budget`` (q and the accumulators of every head
      live in registers).
    """

    max_lanes: int
    min_elements: int
    unroll_up_to: int
    unroll_up_to_unsplit: int
    hps_choices: tuple[int, ...]
    hps_element_budget: int


#: Metal: upstream's shape (8 lanes per token, 2 tokens unrolled up to 16 elements, one head
#: per threadgroup, its simdgroups striding over the tokens). CUDA: the H200 sweep
#: (docs/bench-h200-classic.md): 16 elements per lane (8 lanes for head 128), two heads of a
#: GQA group per threadgroup so each K/V row is read once for both, one token per lane on
#: the split route and two on the unsplit one.
GEOMETRY_RULES: dict[str, GeometryRule] = {
    "metal": GeometryRule(max_lanes=8, min_elements=4, unroll_up_to=16, unroll_up_to_unsplit=16, hps_choices=(1,),
                          hps_element_budget=0),
    "cuda": GeometryRule(max_lanes=32, min_elements=16, unroll_up_to=0, unroll_up_to_unsplit=16,
                         hps_choices=(4, 3, 2, 1), hps_element_budget=32),
}
@dataclasses.dataclass(frozen=True)
class StagingRule:
    """When and how the per-token kernel stages K/V chunks through threadgroup memory (data).

    Staged launches give one threadgroup every head of a GQA group (``HPS`` = the group, or its
    largest divisor up to ``max_heads``), so each K/V row is read from the pools once. They apply
    to groups of at least ``min_group`` heads and to the ``head_sizes`` the sweep measured; other
    requests keep direct loads (the established geometry).

    - heads per simdgroup (HPW): ``hpw_small_grid`` on split launches with fewer than
      ``small_grid_per_core`` threadgroups per GPU core (short partitions, few of them: each
      simdgroup needs its own instruction-level parallelism), else ``hpw``; raised to the first
      divisor of HPS whose simdgroups across heads (HPS/HPW) divide the NUM_THREADS/32 simdgroups;
    - tokens unrolled per lane: ``unroll_one_head`` when a simdgroup holds one head, else
      ``unroll_more_heads``;
    - ``chunk`` tokens per staged chunk (halved until the chunks fit the threadgroup-memory
      limit), ``stages`` chunks in flight;
    - the matrix path (``Geometry.mma``: the heads as rows of 8x8 products) for 16-bit dtypes at
      the ``mma_head_sizes``: the first of ``mma_launches`` (threads, chunk) whose chunks fit;
    - on a grid of fewer than ``key_rows_max_per_core`` threadgroups per GPU core whose threadgroups
      each walk at most ``key_rows_max_tokens`` KV tokens (the partition, or the row when unsplit), with
      ``METAL_ATTN_MMA_KEY_ROWS`` and ``METAL_ATTN_MMA_STAGE_SWIZZLE`` on (the defaults), first the
      keys-as-rows matrix path
      (``Geometry.mma == 2``, CUDA: 16 keys x the heads per tensor-core product, swizzled rows) at the
      first of ``key_rows_launches`` (threads, chunk, stages) whose chunks fit, else the matrix path
      above. (Its threadgroups have half the simdgroups: on larger grids, where threadgroup memory
      bounds the threadgroups an SM holds, that halves the resident warps.)
    """

    min_group: int
    head_sizes: tuple[int, ...]
    max_heads: int
    hpw: int
    hpw_small_grid: int
    small_grid_per_core: float
    unroll_one_head: int
    unroll_more_heads: int
    chunk: int
    stages: int
    mma_head_sizes: tuple[int, ...] = ()
    mma_launches: tuple[tuple[int, int], ...] = ()
    key_rows_launches: tuple[tuple[int, int, int], ...] = ()
    key_rows_max_per_core: float = 0.0
    key_rows_max_tokens: int = 0


#: CUDA: the H200 sweep (docs/bench-h200-classic.md, `benchmarks/sweep_gpu_tuning.py classic`).
#: Metal: none (direct loads, upstream's shape; nothing here measures an Apple GPU).
STAGING_RULES: dict[str, StagingRule] = {
    "cuda": StagingRule(min_group=4, head_sizes=(128, 256), max_heads=8, hpw=2, hpw_small_grid=1,
                        small_grid_per_core=6.0, unroll_one_head=4, unroll_more_heads=2, chunk=32, stages=2,
                        mma_head_sizes=(128, 256), mma_launches=((128, 32), (64, 16)),
                        key_rows_launches=((64, 32, 2),), key_rows_max_per_core=6.0, key_rows_max_tokens=2048),
}
#: Threadgroup memory the staged chunks may take, per backend (the rule's budget: the rest of
#: `THREADGROUP_BYTES_LIMIT` holds the matrix path's Q operands and the fused reducer's scratch; the
#: merge's partial outputs and statistics reuse the stages).
STAGE_BYTES_LIMIT = {"metal": 24 * 1024, "cuda": 40 * 1024}
#: All of the per-token kernel's threadgroup memory, per backend: CUDA's static limit is 48 KiB
#: a threadgroup, Apple GPUs have 32 KiB.
THREADGROUP_BYTES_LIMIT = {"metal": 32 * 1024, "cuda": 48 * 1024}
#: Bytes of padding after each staged K/V row, by path (`Geometry.stage_pad`'s default). Scalar:
#: 64, so that the two tokens a half-simdgroup reads sit in different banks. Matrix: 16, so that
#: the 8 rows of a fragment read do. On CUDA the matrix path's rows are not padded but swizzled
#: (`Geometry.swizzle`, ``METAL_ATTN_MMA_STAGE_SWIZZLE``, on by default): ncu on the H200 counts
#: 1.5x the L2 reads of the bytes with 16-byte padding (rows not 32-byte aligned), 1.0x with 32
#: (but 32x the bank conflicts) and 1.0x swizzled with as few conflicts as at 16
#: (docs/bench-h200-classic.md, nineteenth session). Metal keeps the padding: the swizzle's
#: fragment loads are written for CUDA's ``ldmatrix`` only.
STAGE_PAD = {"scalar": 64, "mma": 16}
#: Whether the kernel asks L2 for the next iteration's K/V rows (CUDA ``prefetch.global.L2``;
#: Metal has no such instruction and the kernel's prefetch is a no-op there).
PREFETCH_NEXT = {"metal": 0, "cuda": 1}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One launch shape of the per-token kernel."""

    lanes: int  # lanes per token (TPT)
    unroll: int  # tokens per lane per iteration
    hps: int  # query heads per threadgroup (all of one KV head)
    hpw: int = 0  # query heads per simdgroup (0: all ``hps``, the simdgroups split the tokens)
    stage: int = 0  # tokens per chunk staged through threadgroup memory (0: direct loads)
    stages: int = 2  # staged chunks in flight
    #: 1: the heads as rows of 8x8 matrix products; 2 (CUDA): the keys as rows of 16x8 products, the heads
    #: as their columns (both staged and 16-bit; lanes/unroll unused)
    mma: int = 0
    threads: int = NUM_THREADS  # threads per threadgroup
    #: Bytes of padding after each staged row (0: the path's default, `STAGE_PAD`: 64 for the
    #: scalar path, 16 for the matrix path's fragment reads).
    stage_pad: int = 0
    #: 1 (matrix path, CUDA): rows unpadded, each row's 16-byte pieces XOR-swizzled by the row's index
    #: mod 8 (``stage_pad`` unused; `row_pad` is 0).
    swizzle: int = 0

    def __post_init__(self) -> None:
        if self.hpw == 0:
            object.__setattr__(self, "hpw", self.hps)
        if self.stage_pad == 0:
            object.__setattr__(self, "stage_pad", STAGE_PAD["mma" if self.mma else "scalar"])

    @property
    def simdgroups(self) -> int:
        return self.threads // SIMD_WIDTH

    @property
    def row_pad(self) -> int:
        """Bytes between the end of one staged row and the start of the next (the kernel's ``STAGE_PAD``)."""
        return 0 if self.swizzle else self.stage_pad

    def grid_x(self, num_heads: int) -> int:
        """The launch grid's x extent in threads: one threadgroup per ``hps`` query heads."""
        return num_heads // self.hps * self.threads

    @property
    def simdgroups_across_heads(self) -> int:
        return self.hps // self.hpw

    @property
    def token_simdgroups(self) -> int:
        """Simdgroups that split the tokens (each holding its own softmax state until the merge)."""
        return self.simdgroups // self.simdgroups_across_heads

    @property
    def tokens_per_pass(self) -> int:
        """Tokens the simdgroups that split the tokens take per iteration (a staged chunk is whole passes)."""
        per_simdgroup = (KEY_ROWS_TOKENS if self.mma == 2 else MMA_TOKENS if self.mma
                         else (SIMD_WIDTH // self.lanes) * self.unroll)
        return self.token_simdgroups * per_simdgroup

    def stage_bytes(self, head_size: int, itemsize: int) -> int:
        """Threadgroup memory of the staged chunks (rows padded as the kernel lays them out:
        `row_pad` bytes)."""
        return self.stages * 2 * self.stage * (head_size * itemsize + self.row_pad) if self.stage else 0

    def threadgroup_bytes(self, head_size: int, itemsize: int, backend: str) -> int:
        """All the threadgroup memory the kernel declares for this geometry: the stages, which the
        merge's partial outputs and statistics reuse (with direct loads, those two), and on the matrix
        path Q's packed operands (a 32-bit register each on CUDA, two floats on Metal; the keys-as-rows
        path keeps them in registers)."""
        merge = self.token_simdgroups * self.hps * (head_size + 2) * 4
        main = max(self.stage_bytes(head_size, itemsize), merge) if self.stage else merge
        q_ops = (head_size // 8) * SIMD_WIDTH * (4 if backend == "cuda" else 8) if self.mma == 1 else 0
        return main + q_ops


def geometry(head_size: int, dtype: str | None, backend: str = "metal", group: int = 1,
             split: bool = False, kv_items_per_core: float | None = None, mma_stage_pad: int = 0,
             mma_stage_swizzle: bool = True, mma_key_rows: bool = True, kv_tokens: int | None = None) -> Geometry:
    """The kernel geometry for ``head_size`` on ``backend``, GQA ``group`` query heads per KV head, route ``split``.

    ``kv_items_per_core``: (KV heads x query rows x partitions) / GPU cores of the launch, for
    the staging rule's small-grid choice (None: treated as a large grid). ``mma_stage_pad``: the
    matrix path's row padding (``METAL_ATTN_MMA_STAGE_PAD``; 0: `STAGE_PAD`'s); ``mma_stage_swizzle``: its
    rows unpadded and swizzled instead (``METAL_ATTN_MMA_STAGE_SWIZZLE``, the default; where
    `geometry_problem` refuses the swizzle, as on Metal, the padded rows); ``mma_key_rows``: the
    keys-as-rows matrix path where `StagingRule.key_rows_launches` fit (``METAL_ATTN_MMA_KEY_ROWS``) and the
    rule's grid and ``kv_tokens`` (KV tokens one threadgroup walks: the partition size, or the longest row
    when unsplit; None, unknown: the rule does not take the path) allow it.
    """
    vecs = head_size // 4
    if head_size % 4 or vecs == 0:
        raise ValueError(f"head_size={head_size} has no lane geometry (need a positive multiple of 4)")
    rule = GEOMETRY_RULES.get(backend, GEOMETRY_RULES["metal"])
    lanes = next(t for t in (32, 16, 8, 4, 2, 1)
                 if t <= rule.max_lanes and vecs % t == 0 and (head_size // t >= rule.min_elements or t == 1))
    itemsize = 4 if dtype in (None, "float32") else 2  # unknown dtype: size the chunks for the widest
    mma = _mma_geometry(STAGING_RULES.get(backend), backend, head_size, dtype, lanes, group, mma_stage_pad,
                        mma_stage_swizzle, mma_key_rows, kv_items_per_core, kv_tokens)
    if mma is not None:
        return mma
    staged = _staged_geometry(STAGING_RULES.get(backend), backend, head_size, itemsize, lanes, group, split,
                              kv_items_per_core)
    if staged is not None:
        return staged
    elements = head_size // lanes
    unroll = 2 if elements <= (rule.unroll_up_to if split else rule.unroll_up_to_unsplit) else 1
    hps = next((h for h in rule.hps_choices if group % h == 0 and h * elements <= rule.hps_element_budget), 1)
    return Geometry(lanes, unroll, hps)


def _group_heads(rule: StagingRule, group: int) -> int:
    """Heads per threadgroup on a staged launch: the GQA group, or its largest divisor up to ``max_heads``."""
    return max(d for d in range(1, min(group, rule.max_heads) + 1) if group % d == 0)


def _mma_geometry(rule: StagingRule | None, backend: str, head_size: int, dtype: str | None, lanes: int,
                  group: int, pad: int, swizzle: bool, key_rows: bool = False,
                  kv_items_per_core: float | None = None, kv_tokens: int | None = None) -> Geometry | None:
    """The matrix-path geometry `StagingRule` gives, or None where it does not apply: the keys as rows
    on small grids (``kv_items_per_core`` x group / heads per threadgroup under
    ``key_rows_max_per_core``; None, cores unknown: a large grid) of threadgroups that walk at most
    ``key_rows_max_tokens`` (``kv_tokens``; None: unknown, not taken), else the heads as rows (the same
    for both routes and any grid: the sweep found no split or small-grid variant worth a rule)."""
    if (rule is None or dtype not in ("float16", "bfloat16") or group < rule.min_group
            or head_size not in rule.mma_head_sizes):
        return None
    hps = _group_heads(rule, group)
    if key_rows and swizzle and key_rows_rule(rule, group, kv_items_per_core, kv_tokens)[0]:
        for threads, chunk, stages in rule.key_rows_launches:
            geo = Geometry(lanes, 1, hps, hps, chunk, stages, mma=2, threads=threads, swizzle=1)
            if geometry_problem(geo, head_size, group, 2, backend) is None:
                return geo
    for threads, chunk in rule.mma_launches:
        geo = Geometry(lanes, 1, hps, hps, chunk, rule.stages, mma=1, threads=threads, stage_pad=pad)
        if geometry_problem(geo, head_size, group, 2, backend) is None:
            swizzled = dataclasses.replace(geo, swizzle=1)
            return swizzled if swizzle and geometry_problem(swizzled, head_size, group, 2, backend) is None else geo
    return None


def key_rows_rule(rule: StagingRule, group: int, kv_items_per_core: float | None,
                  kv_tokens: int | None) -> tuple[bool, str]:
    """Whether `StagingRule`'s grid and length bounds let a matrix-path launch take the keys as rows, and
    their arithmetic as a diagnostics note (the setting, the swizzle and the launches' fit come on top:
    `per_token.plan_per_token` adds the verdict)."""
    hps = _group_heads(rule, group)
    if kv_items_per_core is None or kv_tokens is None:
        return False, "keys as rows: GPU cores or the KV tokens a threadgroup walks unknown"
    per_core = kv_items_per_core * group / hps
    grid_ok = per_core < rule.key_rows_max_per_core
    tokens_ok = kv_tokens <= rule.key_rows_max_tokens
    return grid_ok and tokens_ok, (
        f"keys as rows: threadgroups per core {per_core:.2f} {'<' if grid_ok else '>='} "
        f"key_rows_max_per_core={rule.key_rows_max_per_core:g}, KV tokens a threadgroup walks {kv_tokens} "
        f"{'<=' if tokens_ok else '>'} key_rows_max_tokens={rule.key_rows_max_tokens}")


def _staged_geometry(rule: StagingRule | None, backend: str, head_size: int, itemsize: int, lanes: int,
                     group: int, split: bool, kv_items_per_core: float | None) -> Geometry | None:
    """The staged geometry `StagingRule` gives, or None where it does not apply."""
    if rule is None or group < rule.min_group or head_size not in rule.head_sizes:
        return None
    hps = _group_heads(rule, group)
    small = split and kv_items_per_core is not None and kv_items_per_core * group / hps < rule.small_grid_per_core
    target = rule.hpw_small_grid if small else rule.hpw
    hpw = next((h for h in range(target, hps + 1) if hps % h == 0 and SIMDGROUPS % (hps // h) == 0), None)
    if hpw is None:
        return None
    unroll = rule.unroll_one_head if hpw == 1 else rule.unroll_more_heads
    per_pass = Geometry(lanes, unroll, hps, hpw).tokens_per_pass
    chunk = rule.chunk
    while chunk >= per_pass:
        geo = Geometry(lanes, unroll, hps, hpw, chunk, rule.stages)
        if geometry_problem(geo, head_size, group, itemsize, backend) is None:
            return geo
        chunk //= 2
    return None


def source_check_launches(head_size: int, dtype: str | None = None) -> list[tuple[bool, Geometry]]:
    """(split, geometry) pairs whose Metal text the source check type-checks, for both routes: Metal's
    own geometry (direct loads), one staged chunk per token simdgroup pass, and for 16-bit ``dtype``
    and head sizes that are multiples of 32 the matrix path (the staged code paths the CUDA tables
    choose; the text is checked, whether or not Apple's threadgroup memory would hold that chunk)."""
    launches = []
    for split in (False, True):
        geo = geometry(head_size, None, "metal", split=split)
        one_pass = Geometry(geo.lanes, 1, 1, 1).tokens_per_pass
        launches += [(split, geo), (split, Geometry(geo.lanes, 1, 1, 1, one_pass, 2))]
        if dtype in ("float16", "bfloat16") and head_size % 32 == 0:
            mma_pass = Geometry(geo.lanes, 1, 1, 1, mma=1).tokens_per_pass
            launches.append((split, Geometry(geo.lanes, 1, 1, 1, mma_pass, 2, mma=1)))
    return launches


def _bytes_limit(table: dict[str, int], backend: str) -> int:
    """A per-backend threadgroup-memory ``table``'s value for ``backend`` (Apple's, the smaller, for any other)."""
    return table.get(backend, table["metal"])


def kv_items_per_core(num_kv_heads: int, rows: int, parts: int, gpu_cores: int | None) -> float | None:
    """(KV heads x query rows x partitions) per GPU core, the staging rule's grid measure (None: cores unknown)."""
    return num_kv_heads * rows * parts / gpu_cores if gpu_cores else None


def geometry_problem(geo: Geometry, head_size: int, group: int, itemsize: int, backend: str) -> str | None:
    """Why ``geo`` cannot lay out ``head_size`` for a GQA ``group`` (None when it can)."""
    lanes = geo.lanes
    if lanes not in (1, 2, 4, 8, 16, 32) or head_size % (4 * lanes):
        return f"lanes={lanes} (allowed: a power of two up to 32 dividing head_size/4={head_size // 4})"
    if geo.unroll < 1:
        return f"unroll={geo.unroll} (allowed: >= 1)"
    if geo.hps < 1 or group % geo.hps:
        return f"hps={geo.hps} (allowed: a divisor of the GQA group {group})"
    if geo.threads not in THREAD_CHOICES:
        return f"threads={geo.threads} (allowed: {', '.join(map(str, THREAD_CHOICES))})"
    if geo.hpw < 1 or geo.hps % geo.hpw or geo.simdgroups % (geo.hps // geo.hpw):
        return (f"hpw={geo.hpw} (allowed: a divisor of hps={geo.hps} with hps/hpw dividing {geo.simdgroups} "
                f"simdgroups)")
    if geo.stage_pad < 16 or geo.stage_pad % 16:
        return f"stage_pad={geo.stage_pad} (allowed: a positive multiple of 16 bytes, the staged copies' size)"
    if geo.swizzle and (geo.swizzle != 1 or not geo.mma or backend != "cuda" or head_size * itemsize % 128):
        return (f"swizzle={geo.swizzle} (allowed: 0, or 1 on the matrix path (mma={geo.mma}) on cuda "
                f"(backend={backend}) with rows of whole groups of eight 16-byte pieces (head_size={head_size}, "
                f"itemsize={itemsize}))")
    if geo.mma:
        if (geo.mma not in (1, 2) or not geo.stage or itemsize != 2 or geo.hpw != geo.hps or geo.hps > 8
                or head_size % 32):
            return (f"mma={geo.mma} (allowed: 0, or 1 or 2 with staged chunks, a 16-bit dtype (itemsize={itemsize}), "
                    f"hpw == hps <= 8 (hps={geo.hps}, hpw={geo.hpw}) and head_size a multiple of 32 "
                    f"(head_size={head_size}))")
        if geo.mma == 2 and (backend != "cuda" or not geo.swizzle):
            return (f"mma=2 (the keys-as-rows path: allowed on cuda (backend={backend}) with swizzled rows "
                    f"(swizzle={geo.swizzle}) only)")
    if geo.stage:
        if geo.stage < 0 or geo.stage % geo.tokens_per_pass:
            return (f"stage={geo.stage} (allowed: 0, or a multiple of the {geo.tokens_per_pass} tokens the token "
                    f"simdgroups take per iteration)")
        if geo.stages < 2:
            return f"stages={geo.stages} (allowed: >= 2)"
        limit = _bytes_limit(STAGE_BYTES_LIMIT, backend)
        if geo.stage_bytes(head_size, itemsize) > limit:
            return (f"stage={geo.stage} stages={geo.stages}: {geo.stage_bytes(head_size, itemsize)} bytes of "
                    f"threadgroup memory on {backend} (allowed: <= {limit})")
    total = geo.threadgroup_bytes(head_size, itemsize, backend)
    total_limit = _bytes_limit(THREADGROUP_BYTES_LIMIT, backend)
    if total > total_limit:
        return (f"{geo}: {total} bytes of threadgroup memory in all at head_size={head_size} on {backend} "
                f"(allowed: <= {total_limit})")
    return None


def describe_geometry(geo: Geometry, kv_items_per_core: float | None) -> str:
    """The geometry as a diagnostics note."""
    loads = (f"staged chunks of {geo.stage} tokens, {geo.stages} in flight" if geo.stage else "direct loads")
    if geo.stage and geo.swizzle:
        loads += ", rows unpadded and swizzled"
    elif geo.stage and geo.stage_pad != STAGE_PAD["mma" if geo.mma else "scalar"]:
        loads += f", rows padded by {geo.stage_pad} bytes"
    grid = "" if kv_items_per_core is None else f" (kv_items_per_core={kv_items_per_core:.1f})"
    if geo.mma == 2:
        return (f"heads_per_threadgroup={geo.hps} as the columns of 16x8 matrix products with the keys as rows, "
                f"{KEY_ROWS_TOKENS} tokens a simdgroup step, {loads}{grid}")
    if geo.mma:
        return (f"heads_per_threadgroup={geo.hps} as the rows of 8x8 matrix products, {MMA_TOKENS} tokens a "
                f"simdgroup step, {loads}{grid}")
    return (f"lanes_per_token={geo.lanes} unroll={geo.unroll} heads_per_threadgroup={geo.hps} "
            f"heads_per_simdgroup={geo.hpw}, {loads}{grid}")


@functools.lru_cache(maxsize=256)
def plan_geometry(specialization: tuple) -> Geometry:
    """The `Geometry` a classic plan's specialization carries."""
    return Geometry(*specialization[5:])
