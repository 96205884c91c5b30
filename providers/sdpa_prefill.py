"""The ``sdpa_prefill`` provider: prefill chunks through MLX's fused attention over gathered pages.

For each prefill sequence of a batch the pages of its context are gathered through the block
table into contiguous K/V (one ``mx.take`` per pool: a bandwidth-bound copy of the sequence's
``seq_len`` tokens, counted in every figure), and ``mx.fast.scaled_dot_product_attention``
computes the chunk: ``mask="causal"`` is aligned to the end of the keys, so a continuation
chunk's row ``i`` sees ``seq_len - q_len + i + 1`` keys, exactly our causal rule; sinks go
through its ``sinks=`` argument. Consecutive sequences with the same ``(q_len, seq_len)``
share one call. Every call is made with ``force_fused=True``: MLX raises rather than silently
falling back to unfused matmuls, whose score matrix takes ``q_len * seq_len`` floats per head.
On CUDA the fused kernel is cuDNN's.

Mixed batches: the decode rows at the front go through the per-token kernel (the decode-rows
sub-plan of `metal_attn.providers.gpu_common`), the prefill rows through SDPA: route
``sdpa_prefill_decode``.

Admission is data (`SDPA_PREFILL_RULES`, one rule per backend, with the measurement behind
it) plus the declarative attributes:

- CUDA: admitted for chunks of at least ``min_chunk_rows`` rows (32); float16/bfloat16; head sizes
  64, 96 and 128 (where MLX 0.32.4 has a fused kernel for every query length: cuDNN for chunks,
  its vector kernel for single rows; `benchmarks/probe_sdpa_fused.py`); sinks; no sliding window
  or softcap (MLX SDPA has neither; they stay with ``tiled_prefill``).
- Metal: not admitted. The rule stays upstream's (``tiled_prefill``, NAX on M5) until someone
  measures this route on Apple hardware; no machine here has an Apple GPU.
- CPU: not admitted: on the 2-core CPU the gathered-SDPA path is 27x slower than ``classic``'s
  native prefill (docs/bench-cpu.md).

Validation off (``METAL_ATTN_VALIDATE_METADATA=0``): block ids outside the pool are never read
(the gather reads a clamped id) and make their sequence's rows NaN; a table too short for a
sequence's length gives NaN rows; nothing crashes.

Semantics MLX fixes: sink logits are rounded to the query dtype (MLX requires the sinks'
dtype to promote to the output's), and the softmax runs in float32 inside the fused kernel.
MLX scales a sink by log2(e) in float32 with no clamp, so a finite sink past what the query
dtype holds, or past FLT_MAX / log2(e), would turn its head NaN: finite sinks are kept within
`SINK_LIMITS` (`sinks_for_mlx`), where they outweigh every score as the unclamped sink does
(the float64 oracle; our kernels keep the log2 value at FLT_MAX, ``ma_sink_log2``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from metal_attn.providers import gpu_common as gc

from metal_attn import _epoch
from metal_attn.provider import Plan, Provider
from metal_attn.request import Phase

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.provider import AttentionInputs
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import Settings
    from metal_attn.source_specs import CudaSource, Specialization

ROUTE = "sdpa_prefill"
SPLIT_ROUTE = "sdpa_prefill_decode"


@dataclasses.dataclass(frozen=True)
class MixedRow:
    """One row of a rule's mixed-batch table: from a longest decode row of ``min_decode_context``
    tokens on, the longest prefill chunk needs ``min_chunk_rows`` rows."""

    min_decode_context: int
    min_chunk_rows: int


@dataclasses.dataclass(frozen=True)
class SdpaRule:
    """Where the route runs on one backend, and the measurement that put it there.

    ``min_chunk_rows``: the longest prefill chunk of the batch must have at least this many rows
    (``None``: the route is not admitted on this backend). ``min_chunk_pairs``: and its attended
    (query, key) pairs, bounded by `chunk_pairs` from the longest chunk and the longest sequence, at
    least this many (below it the tiles, split over the keys where they are few, are faster; mixed
    batches follow ``mixed`` instead). ``evidence``: what was measured, shown by ``explain`` and the docs.
    """

    min_chunk_rows: int | None
    evidence: str
    min_chunk_pairs: int = 0
    #: Mixed batches (decode rows in front): the first row whose ``min_decode_context`` the longest
    #: decode row reaches sets the chunk rows needed, else the tiles' mixed route is faster (its
    #: fewer launches win on short chunks). Empty: mixed batches follow ``min_chunk_rows``.
    mixed: tuple[MixedRow, ...] = ()

    def mixed_row(self, max_decode_seq_len: int) -> MixedRow | None:
        """The row of ``mixed`` that applies to a longest decode row of ``max_decode_seq_len`` tokens."""
        return next((r for r in self.mixed if max_decode_seq_len >= r.min_decode_context), None)


#: One rule per backend (data, like the split gate; `explain` prints the arithmetic).
SDPA_PREFILL_RULES: Mapping[str, SdpaRule] = MappingProxyType({
    "cuda": SdpaRule(
        32,
        "H200, MLX 0.32.4, bf16, 32/8 heads, head 128 (benchmarks/probe_sdpa_fused.py, "
        "benchmarks/probe_tiled_split.py, prefill-gpu; docs/bench-h200-prefill.md): against the unsplit tiles the "
        "route ran 1.10-3.74x faster on every chunk from 32 rows after 2K tokens to 2,048-token prompts, 0.75x on "
        "24 rows after 1K (chunks of 16 rows or fewer are verification windows, which it does not take). Against "
        "the tiles split over the keys (tenth session, blocking calls, four machines): 0.70x at 32 rows after 2K "
        "(65K pairs), 0.70x at 64 after 2K (133K), 0.80x at 128 after 4K (516K); 1.10x at 64 after 8K (520K), "
        "1.20x at 96 after 8K (780K), 1.41x at 256 after 4K (1.02M), 1.13x at 128 after 8K, 1.16x at 64 after "
        "32K, 2.5x at 512 after 8K, 3.5x at 1,024 after 8K: chunks need 500K attended pairs (516K and 520K "
        "disagree; 500K sends both to the route, so the tiles' 1.26x at 128 after 4K is lost). Mixed "
        "batches (tenth session, the rule opened once around both timings): 8 decode rows at 4K, then one "
        "chunk: 1.27x, 1.46x, 1.25x, 2.02x, 3.14x faster than the tiles' mixed route with chunks of 128, 256, "
        "512, 1,024 and 2,048 rows. Seventeenth session, with the route's kernels as CUDA chains "
        "(probe_sdpa_fused.py --only mixed, queued / blocking, one machine): 8 decode rows at 4K with one chunk "
        "of 32, 64, 128, 256, 512, 1,024, 2,048 rows: 1.83/1.44x, 1.81/1.93x, 2.12/1.39x, 1.83/2.26x, 1.89/1.80x, "
        "3.83/2.84x, 5.18/2.97x faster than the tiles' mixed route; 32 decode rows at 1K with 128 or 256 rows "
        "after 2K: 2.04/2.01x, 1.61/1.99x; 512 after 1K 1.11/1.08x; two chunks of 256 1.16/1.11x; but 32 or 64 "
        "rows after 1K 0.95/1.14x, 0.96/0.86x: so from 4K of decode context chunks need 32 rows, below it 128. "
        "Forty-fifth session (H100, queued, probe_tiled_split.py --pipelined, three readings): the pairs bound holds. "
        "Below it the tiles (their split rule) win by wall time (32-128 rows after 2K: 48-85 us a call against the "
        "route's 83-177) though the route's GPU time is lower (37-40 us against 41-75): its three queued operations "
        "a call cost the host more than the tiles' one; from 516K pairs the route wins (128 rows after 4K: 83-139 "
        "against 140-142 us; 64 after 8K: 137-140 against 151-153; 256 after 4K: 94-154 against 267-276)",
        min_chunk_pairs=500_000, mixed=(MixedRow(4096, 32), MixedRow(0, 128))),
    "metal": SdpaRule(None, "not measured on Apple hardware: the rule stays upstream's (tiled_prefill, NAX on M5)"),
    "cpu": SdpaRule(None, "2-core CPU: gathered SDPA is 27x slower than classic's native prefill "
                          "(docs/bench-cpu.md, prefill-cpu)"),
})

#: Head sizes with a fused MLX SDPA kernel for every query length on CUDA (MLX 0.32.4).
FUSED_HEAD_SIZES = frozenset({64, 96, 128})


def chunk_pairs(max_q_len: int, max_seq_len: int) -> int:
    """The attended (query, key) pairs of a causal chunk of ``max_q_len`` rows ending a sequence of
    ``max_seq_len`` tokens (the longest chunk's, at most: it may end a shorter sequence)."""
    return max_q_len * (max_seq_len - max_q_len) + max_q_len * (max_q_len + 1) // 2


def rule_reasons(request: AttentionRequest, backend: str) -> tuple[list[str], str]:
    """(refusals, the arithmetic) of `SDPA_PREFILL_RULES` for ``request`` on ``backend``."""
    rule = SDPA_PREFILL_RULES.get(backend)
    if rule is None or rule.min_chunk_rows is None:
        why = rule.evidence if rule is not None else "no rule measured"
        return [f"SDPA_PREFILL_RULES[{backend}]: not admitted ({why})"], ""
    rows = request.max_q_len
    mixed = rule.mixed_row(request.max_decode_seq_len) if request.phase is Phase.MIXED else None
    if mixed is not None:
        i = rule.mixed.index(mixed)
        field, need = (f"mixed[{i}].min_chunk_rows (longest decode row {request.max_decode_seq_len} >= "
                       f"{mixed.min_decode_context})", mixed.min_chunk_rows)
    else:
        field, need = "min_chunk_rows", rule.min_chunk_rows
    ok = rows >= need
    arithmetic = (f"longest prefill chunk {rows} rows {'>=' if ok else '<'} "
                  f"SDPA_PREFILL_RULES[{backend}].{field}={need}")
    if ok and mixed is None and rule.min_chunk_pairs:
        pairs = chunk_pairs(rows, request.max_seq_len)
        ok = pairs >= rule.min_chunk_pairs
        arithmetic += (f"; its attended pairs <= {rows}*({request.max_seq_len}-{rows})+{rows}*{rows + 1}/2={pairs} "
                       f"{'>=' if ok else '<'} SDPA_PREFILL_RULES[{backend}].min_chunk_pairs={rule.min_chunk_pairs}")
    if not ok:
        return [f"{arithmetic} (below it tiled_prefill keeps the chunk: {rule.evidence})"], arithmetic
    return [], arithmetic


class SdpaPrefillProvider(Provider):
    """Prefill chunks through MLX's fused SDPA on pages gathered into contiguous K/V."""

    name = ROUTE
    #: Above tiled_prefill (50) where its rule admits it; the rule is per backend.
    priority = 55
    backends = frozenset({"cuda", "metal", "cpu"})
    phases = frozenset({"prefill", "mixed"})
    dtypes = frozenset({"float16", "bfloat16"})
    head_sizes = FUSED_HEAD_SIZES
    features = frozenset({"sinks"})
    description = ("Gather each prefill chunk's pages, then MLX's fused SDPA (cuDNN); admitted where its measured "
                   "rule says (cuda); decode rows split off.")

    def availability_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = super().availability_reasons(device)
        if reasons or device.backend == "cpu":
            return reasons
        return gc.availability_reasons(device)

    def extra_reasons(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> list[str]:
        reasons, _ = rule_reasons(request, device.backend)
        threads = seq_threads(request.max_seq_len, request.max_q_len, request.num_heads, request.num_kv_heads)
        if threads > MAX_GRID_THREADS:
            reasons.append(f"a sequence of {request.max_seq_len} tokens needs {threads} threads in one launch of "
                           f"gather_kv or sdpa_finish (at most {MAX_GRID_THREADS}: their indices are 32-bit)")
        return reasons + gc.decode_rows_reasons(request, settings)

    def plan(self, request: AttentionRequest, device: DeviceInfo, settings: Settings) -> Plan:
        _, arithmetic = rule_reasons(request, device.backend)
        notes = [f"{arithmetic} -> gather pages (gather_kv) + fused MLX SDPA"]
        decode_spec: tuple = ()
        partition = 0
        if request.phase is Phase.MIXED:
            decode_spec, partition, note = gc.decode_rows_part(request, device, settings)
            notes.append(note)
            if device.backend == "cuda":
                notes.append(gc.decode_rows_in_chain_note(settings, decode_spec.side_stream))
        return Plan(
            provider=self.name,
            route=SPLIT_ROUTE if decode_spec else ROUTE,
            partition_size=partition,
            specialization=(ROUTE, device.backend, request.dtype, request.head_size,
                            request.num_heads // request.num_kv_heads, request.sinks, decode_spec),
            notes=tuple(notes),
        )

    def prepare(self, plan: Plan, device: DeviceInfo) -> None:
        """Compile the route's kernels and check that MLX has a fused kernel for the plan's
        configuration, with a tiny call through `prefill_rows` (``force_fused=True`` makes MLX
        raise at call time when it has none); any failure becomes a recorded fallback to the next
        provider. ``gather_kv``, ``first_flagged`` and ``sdpa_finish`` are templated on dtype and
        head size only, so the tiny call compiles the very kernels every geometry of the plan runs.
        Then the decode rows' kernels are compiled."""
        _, backend, dtype, head, group, sinks, decode_spec = plan.specialization

        def launch(b: gc.TinyBatch) -> list[mx.array]:
            from metal_attn.provider import AttentionInputs

            logits = gc.zeros_f32(group) if sinks else None
            return prefill_rows(AttentionInputs(b.q, b.cache, b.cache, b.metadata, 1.0, sinks=logits), b.metadata,
                                backend=backend)

        for rows in (8, 1):  # a chunk (cuDNN) and a one-row chunk (MLX's vector kernel)
            gc.compile_eagerly(device, f"fused MLX SDPA ({dtype} head={head} group={group} sinks={sinks} "
                                       f"rows={rows})", launch,
                               dtype=dtype, head_size=head, block_size=16, seq_len=24, q_rows=rows, num_heads=group)
        if decode_spec:
            gc.prepare_decode_rows(decode_spec, device)

    def run(self, inputs: AttentionInputs, plan: Plan) -> mx.array:
        decode_spec = plan.specialization[-1]
        md = inputs.metadata
        n_dec = md.num_decode_seqs if decode_spec else 0
        parts = prefill_rows(inputs, md, first_seq=n_dec, backend=plan.specialization[1],
                             decode_rows=decode_spec if n_dec else None)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    # -- source checks ----------------------------------------------------------------------------

    def msl_specializations(self) -> list[Specialization]:
        """The route's kernels on Metal, for `metal_attn.msl_check` (the route is not admitted on
        Metal, but the kernel texts are shared): ``gather_kv`` and ``sdpa_finish`` over {float16,
        bfloat16} x head sizes (block size and head counts are runtime parameters), and ``first_flagged``."""
        from metal_attn.source_specs import Specialization

        gathers = [Specialization(
            label=f"gather_kv {dtype} head={head}", kernel="gather_kv", source_files=GATHER_FILES,
            input_names=GATHER_INPUTS, output_names=GATHER_OUTPUTS, template=tuple(gather_template(dtype, head)),
            inputs=(((4, 16, 2, head), dtype), ((4, 16, 2, head), dtype), ((2, 4), "int32"), ((7,), "int32")),
            outputs=(((1, 3, 2, head), dtype), ((1, 3, 2, head), dtype), ((1, 3, 2), "int32")),
        ) for dtype in sorted(self.dtypes) for head in sorted(self.head_sizes)]
        finishes = [Specialization(
            label=f"sdpa_finish {dtype} head={head}", kernel="sdpa_finish", source_files=FINISH_FILES,
            input_names=FINISH_INPUTS, output_names=FINISH_OUTPUTS, template=tuple(finish_template(dtype, head)),
            inputs=(((3, 4, head), dtype), ((3, 4, head), dtype), ((2,), "int32"), ((2, 4, head), dtype),
                    ((9,), "int32")),
            outputs=(((5, 4, head), dtype),),
        ) for dtype in sorted(self.dtypes) for head in sorted(self.head_sizes)]
        first = Specialization(
            label="first_flagged", kernel="first_flagged", source_files=FINISH_FILES, input_names=FIRST_INPUTS,
            output_names=FIRST_OUTPUTS, template=(("THREADS", FIRST_THREADS),),
            inputs=(((2, 5), "int32"), ((1,), "int32")), outputs=(((2,), "int32"),))
        return [*gathers, *finishes, first]

    def cuda_sources(self) -> list[CudaSource]:
        """The route's kernels on CUDA, for `metal_attn.cuda_check`: ``gather_kv`` and ``sdpa_finish``
        per (dtype, head size), and ``first_flagged``."""
        from metal_attn.source_specs import CudaSource

        gathers = [CudaSource(f"gather_kv {dtype} h{head}", "gather_kv", GATHER_FILES, *gather_signature(dtype),
                              tuple(gather_template(dtype, head)))
                   for dtype in sorted(self.dtypes) for head in sorted(self.head_sizes)]
        finishes = [CudaSource(f"sdpa_finish {dtype} h{head}", "sdpa_finish", FINISH_FILES, *finish_signature(dtype),
                               tuple(finish_template(dtype, head)))
                    for dtype in sorted(self.dtypes) for head in sorted(self.head_sizes)]
        first = CudaSource("first_flagged", "first_flagged", FINISH_FILES, *FIRST_SIGNATURE,
                           (("THREADS", FIRST_THREADS),))
        return [*gathers, *finishes, first]


def _runs(md: AttentionMetadata, first_seq: int) -> list[tuple[int, int, int, int]]:
    """Consecutive sequences with equal ``(q_len, seq_len)``: ``(first_seq, count, q_len, seq_len)``."""
    runs: list[tuple[int, int, int, int]] = []
    for i in range(first_seq, md.num_seqs):
        key = (md.q_lens_host[i], md.seq_lens_host[i])
        if runs and runs[-1][2:] == key:
            s, n, ql, sl = runs[-1]
            runs[-1] = (s, n + 1, ql, sl)
        else:
            runs.append((i, 1, *key))
    return runs


@dataclasses.dataclass(frozen=True, slots=True)
class RunLaunch:
    """One fused SDPA call of `prefill_rows`: ``n`` sequences from ``seq`` on, each ``q_len`` rows
    ending ``seq_len`` tokens, rows ``row0 .. row0 + rows`` of the query, their ``pages`` pages. On a
    GPU it carries its kernels' parameter arrays and, on the ``mx.fast`` route, their launches
    (``gather``, ``first``, ``finish``); ``takes_lead``: its ``sdpa_finish`` writes the lead rows in
    front. ``table_short``: the block table is narrower than ``pages`` (validation off): NaN rows."""

    seq: int
    n: int
    q_len: int
    seq_len: int
    row0: int
    rows: int
    pages: int
    table_short: bool
    takes_lead: bool = False
    gather: gc.KernelLaunch | None = None
    gather_params: Any = None
    first: gc.KernelLaunch | None = None
    first_params: Any = None
    finish: gc.KernelLaunch | None = None
    finish_params: Any = None
    #: sdpa_finish's threads over the run's rows and its lead rows (`finish_launch`).
    finish_threads: int = 0

    def gather_flagged(self, k_cache: Any, v_cache: Any, block_tables: Any) -> tuple[Any, Any, Any]:
        """The run's contiguous K and V, and the first flagged position of each (sequence, KV
        head): ``gather_kv`` then ``first_flagged`` (the ``mx.fast`` route)."""
        k, v, bad = self.gather([k_cache, v_cache, block_tables, self.gather_params])
        return k, v, self.first([bad, self.first_params])[0]


@dataclasses.dataclass(frozen=True, slots=True)
class ChainedRuns:
    """Every run of a batch as two CUDA chains (`metal_attn.cuda_ops`), with the kernel texts,
    grids and parameters of the ``mx.fast`` launches: ``gather`` runs each run's ``gather_kv`` then
    its ``first_flagged`` (the flags are scratch), ``finish`` each run's ``sdpa_finish`` into one
    output, the lead rows in front (each launch's ``out_row0`` says where its rows go). So a batch
    of any number of runs is two of our operations, plus one fused SDPA call per run. With
    ``decode`` (``cuda_decode_rows_in_chain``) the finish chain also runs a mixed batch's decode
    rows, straight into the output's first rows: one operation and one copy fewer."""

    gather: gc.ChainLaunch
    finish: gc.ChainLaunch
    #: The gather chain's inputs after the pools and the table: each run's gather and
    #: first_flagged parameters.
    gather_params: tuple[Any, ...]
    #: The decode rows' per-token launches inside the finish chain (their inputs follow the lead rows'
    #: place), or ``None`` (the caller gives the lead rows).
    decode: gc.PerTokenChainPart | None = None

    def gather_flagged(self, k_cache: Any, v_cache: Any, block_tables: Any) -> list[tuple[Any, Any, Any]]:
        """Each run's contiguous K and V and first flagged positions, in one operation."""
        out = self.gather([k_cache, v_cache, block_tables, *self.gather_params])
        return [tuple(out[i:i + 3]) for i in range(0, len(out), 3)]

    def finish_rows(self, runs: tuple[RunLaunch, ...], outs: list[Any], q_rows: list[Any], firsts: list[Any],
                    lead: Any, decode_inputs: list[Any] | None = None) -> Any:
        """The batch's output: the lead rows (``lead``, or with `decode` the rows computed from
        ``decode_inputs``, `PerTokenChainPart.inputs`' list), then each run's rows under the NaN contract."""
        per_run = [a for i, r in enumerate(runs) for a in (outs[i], q_rows[i], firsts[i], r.finish_params)]
        return self.finish([*per_run, lead, *(decode_inputs or ())])[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlan:
    """`prefill_rows`' calls for one batch: its runs and, on CUDA with chains, their chains."""

    runs: tuple[RunLaunch, ...]
    chained: ChainedRuns | None = None


def run_launches(md: AttentionMetadata, first_seq: int, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                 dtype: Any, cache_dtype: Any, lead_rows: int, backend: str | None,
                 decode: Callable[[], gc.PerTokenChainPart] | None = None) -> RunPlan:
    """The fused calls of `prefill_rows` for the batch ``md`` from sequence ``first_seq`` on, with a
    query of ``q_shape`` in ``dtype`` over pools of ``k_shape`` in ``cache_dtype`` and ``lead_rows``
    lead rows; with a GPU ``backend`` each carries its kernels' parameters and launches (on CUDA
    with chains, where every run has pages to read and the lead rows fit the first launch, the batch's
    two chains instead, the finish chain running the lead rows' launches ``decode()`` where given).
    Built once per metadata (`gc.cached_launch`), so the layers of a step share it."""
    from metal_attn import kernels
    from metal_attn.kernels import SIMD_WIDTH
    from metal_attn.settings import get_settings

    _, num_heads, _ = q_shape
    nb, block_size, kvh, head = k_shape
    width = md.block_tables.shape[1]
    row0 = sum(md.q_lens_host[:first_seq])
    base = row0
    runs: list[RunLaunch] = []
    for seq, n, q_len, seq_len in _capped(_runs(md, first_seq), num_heads, kvh):
        rows, pages = n * q_len, -(-seq_len // block_size)
        runs.append(RunLaunch(seq, n, q_len, seq_len, row0, rows, pages, pages > width))
        row0 += rows
    if backend is None:
        return RunPlan(tuple(runs))
    # The first call takes the lead rows, if the finish's 32-bit indices can hold them too.
    lead_fits = bool(runs) and (lead_rows + runs[0].rows) * num_heads * SIMD_WIDTH <= MAX_GRID_THREADS
    chained = (backend == "cuda" and gc.cuda_chains_enabled() and bool(runs) and (lead_fits or not lead_rows)
               and not any(r.table_short for r in runs))
    in_place = chained and len(runs) == 1 and not lead_rows and get_settings().cuda_finish_in_place
    # With the lead rows' launches in the finish chain, they write the output's first rows themselves.
    decode_in_chain = chained and decode is not None
    out: list[RunLaunch] = []
    for i, run in enumerate(runs):
        if run.table_short:
            out.append(run)
            continue
        lead = lead_rows if i == 0 and lead_fits and not decode_in_chain else 0
        # With chains every run's finish writes the batch's one output, the lead rows in front.
        out_row0 = (lead_rows + run.row0 - base) if chained and (i or decode_in_chain) else 0
        per, finish_threads = finish_launch((lead + run.rows) * num_heads)
        run = dataclasses.replace(
            run, takes_lead=lead > 0,
            gather_params=gc.pack_int32((run.seq, run.n, run.seq_len, nb, width, block_size, kvh)),
            first_params=gc.pack_int32((run.seq_len,)),
            finish_params=gc.pack_int32((run.q_len, run.seq_len, run.n, num_heads, kvh, lead, out_row0,
                                         int(in_place), per)),
            finish_threads=finish_threads)
        if chained:
            out.append(run)
            continue
        n, seq_len, rows = run.n, run.seq_len, run.rows
        gather = gc.kernel_launch(
            kernels.load_kernel("gather_kv", GATHER_FILES, GATHER_INPUTS, GATHER_OUTPUTS, backend),
            template=gather_template(cache_dtype, head), grid=(n * seq_len * kvh * SIMD_WIDTH, 1, 1),
            threadgroup=(GATHER_THREADS, 1, 1),
            output_shapes=[(n, kvh, seq_len, head), (n, kvh, seq_len, head), (n, kvh, seq_len)],
            output_dtypes=[cache_dtype, cache_dtype, mx.int32])
        first = gc.kernel_launch(
            kernels.load_kernel("first_flagged", FINISH_FILES, FIRST_INPUTS, FIRST_OUTPUTS, backend),
            template=[("THREADS", FIRST_THREADS)], grid=(n * kvh * FIRST_THREADS, 1, 1),
            threadgroup=(FIRST_THREADS, 1, 1), output_shapes=[(n * kvh,)], output_dtypes=[mx.int32])
        finish = gc.kernel_launch(
            kernels.load_kernel("sdpa_finish", FINISH_FILES, FINISH_INPUTS, FINISH_OUTPUTS, backend),
            template=finish_template(dtype, head), grid=(finish_threads, 1, 1),
            threadgroup=(FINISH_THREADS, 1, 1), output_shapes=[(lead + rows, num_heads, head)], output_dtypes=[dtype])
        out.append(dataclasses.replace(run, gather=gather, first=first, finish=finish))
    runs_t = tuple(out)
    if not chained:
        return RunPlan(runs_t)
    return RunPlan(runs_t, chained_runs(runs_t, kvh, head, lead_rows, num_heads, dtype, cache_dtype, in_place,
                                        decode() if decode_in_chain else None, get_settings().cuda_decode_rows_wait))


#: What a mixed batch's decode rows in the finish chain wait for (``cuda_decode_rows_wait``), as the finish
#: chain's input they wait on: the first run's ``first_flagged`` output (written after its gather, so its
#: fused SDPA call is ready at the same time) or its fused SDPA output; ``None``: nothing but their inputs.
DECODE_ROWS_WAIT_INPUT: Mapping[str, int | None] = MappingProxyType({"none": None, "gathers": 2, "sdpa": 0})


def chained_runs(runs: tuple[RunLaunch, ...], kv_heads: int, head: int, lead_rows: int, num_heads: int,
                 dtype: Any, cache_dtype: Any, in_place: bool = False,
                 decode: gc.PerTokenChainPart | None = None, decode_wait: str = "none") -> ChainedRuns:
    """The batch's `ChainedRuns` for ``runs`` (the first takes the ``lead_rows``). ``in_place`` (one
    run, no lead rows, its finish parameters saying so): the finish chain's output starts as the fused
    kernel's output, in that output's buffer where MLX allows it, and ``sdpa_finish`` writes only the
    NaN rows. ``decode``: the lead rows' launches, run by the finish chain before its own, into the
    output's first rows (the runs' finish parameters then place every run after them and copy no lead
    rows). They read no buffer the gathers or MLX's SDPA write, so MLX's CUDA graph runs them beside
    those, as it ran their chain of their own; the finishes, writing the same output, come after them.
    ``decode_wait`` (`DECODE_ROWS_WAIT_INPUT`): what else the rows' first launch waits for, ordering only."""
    from metal_attn import cuda_ops
    from metal_attn.api import dtype_name
    from metal_attn.kernels import SIMD_WIDTH

    dn, cn, count = dtype_name(dtype), dtype_name(cache_dtype), len(runs)
    g_in, g_out = gather_signature(cn)
    gather_fn = cuda_ops.kernel_function("gather_kv", GATHER_FILES, None, g_in, g_out, gather_template(cn, head))
    first_fn = cuda_ops.kernel_function("first_flagged", FINISH_FILES, None, FIRST_SIGNATURE[0], FIRST_SIGNATURE[1],
                                        [("THREADS", FIRST_THREADS)])
    # Gather chain buffers: inputs k_cache 0, v_cache 1, block_tables 2, then run i's gather and
    # first params at 3 + 2i, 4 + 2i; outputs: run i's K, V, first at o + 3i ..; scratch: run i's
    # flags at o + 3 * count + i.
    o = 3 + 2 * count
    outputs, scratch, launches = [], [], []
    for i, r in enumerate(runs):
        kv = ((r.n, kv_heads, r.seq_len, head), cache_dtype)
        outputs += [kv, kv, ((r.n * kv_heads,), mx.int32)]
        scratch.append(((r.n, kv_heads, r.seq_len), mx.int32))
        k, v, first, bad = o + 3 * i, o + 3 * i + 1, o + 3 * i + 2, o + 3 * count + i
        launches += [
            (gather_fn, cuda_ops.threadgroups((r.n * r.seq_len * kv_heads * SIMD_WIDTH, 1, 1), (GATHER_THREADS, 1, 1)),
             (GATHER_THREADS, 1, 1), [0, 1, 2, 3 + 2 * i, k, v, bad], 4),
            (first_fn, (r.n * kv_heads, 1, 1), (FIRST_THREADS, 1, 1), [bad, 4 + 2 * i, first], 2)]
    gather = cuda_ops.chain("metal_attn.gather_kv", [cache_dtype, cache_dtype, mx.int32, *[mx.int32] * (2 * count)],
                            outputs, scratch, launches)
    # Finish chain buffers: run i's o, q rows, first, params at 4i .. 4i + 3; the lead rows at
    # 4 * count; then the decode part's inputs; the output after them; then the decode part's scratch.
    f_in, f_out = finish_signature(dn)
    fin = cuda_ops.kernel_function("sdpa_finish", FINISH_FILES, None, f_in, f_out, finish_template(dn, head))
    lead_at = 4 * count
    in_dtypes = [*[dtype, dtype, mx.int32, mx.int32] * count, dtype]
    part = decode.part if decode is not None else None
    at = range(len(in_dtypes), len(in_dtypes) + len(part.input_dtypes)) if part is not None else range(0)
    in_dtypes += part.input_dtypes if part is not None else ()
    out_at = len(in_dtypes)
    finishes, state, decode_scratch, after = [], [], (), []
    if part is not None:  # first: the finishes then write after them (MLX orders two writers of one buffer)
        decode_scratch = part.scratch
        finishes += part.launches_at(at, [out_at], range(out_at + 1, out_at + 1 + len(decode_scratch)))
        state = [at[i] for i in part.state]
        wait = DECODE_ROWS_WAIT_INPUT[decode_wait]  # run 0's buffers sit at 0..3 (o, q rows, first, params)
        after = [(0, wait)] if wait is not None else []  # the rows' first launch; the others follow it anyway
    total = lead_rows + sum(r.rows for r in runs)
    finishes += [(fin, cuda_ops.threadgroups((r.finish_threads, 1, 1), (FINISH_THREADS, 1, 1)),
                  (FINISH_THREADS, 1, 1),
                  [out_at if in_place else 4 * i, 4 * i + 1, 4 * i + 2, lead_at, 4 * i + 3, out_at], 5)
                 for i, r in enumerate(runs)]
    finish = cuda_ops.chain("metal_attn.sdpa_finish" + ("_decode" if decode is not None else ""), in_dtypes,
                            [((total, num_heads, head), dtype)], decode_scratch, finishes, state=state,
                            initial=[(0, 0)] if in_place else (), after=after)
    return ChainedRuns(gc.ChainLaunch(gather), gc.ChainLaunch(finish),
                       tuple(p for r in runs for p in (r.gather_params, r.first_params)), decode)


#: The largest finite sink MLX SDPA is given, by query dtype: what the dtype holds and MLX's float32
#: ``sink * log2(e)`` does not overflow (FLT_MAX / log2(e) = 2.3587e38; 2.3e38 rounds within it in
#: bfloat16). A sink that size outweighs any score a finite query and key of the dtype give but for
#: float16, where scores past 65504 are possible (float32 dot products) and a sink past it is taken as
#: 65504 (MLX would round it to inf, a NaN head).
SINK_LIMITS: Mapping[str, float] = MappingProxyType({"float32": 2.3e38, "bfloat16": 2.3e38, "float16": 65504.0})


def sinks_for_mlx(sinks: mx.array, dtype: mx.Dtype) -> mx.array:
    """``sinks`` in ``dtype`` as MLX SDPA takes them: finite ones clipped to ``SINK_LIMITS``; -inf (no
    sink), +inf and NaN as they are (the NaN contract: +inf and NaN make their heads NaN)."""
    limit = SINK_LIMITS[str(dtype).removeprefix("mlx.core.")]
    finite = mx.isfinite(sinks)
    return mx.where(finite, mx.clip(sinks, -limit, limit), sinks).astype(dtype)


def prefill_rows(inputs: AttentionInputs, md: AttentionMetadata, *, first_seq: int = 0, backend: str | None = None,
                 force_fused: bool = True, lead: mx.array | None = None,
                 decode_rows: gc.DecodeRowsSpec | None = None) -> list[mx.array]:
    """Outputs of sequences ``first_seq..`` in batch order: one ``[rows, H, D]`` array per run of
    equal-length sequences, each its pages gathered then one fused SDPA call (`run_launches`), or on
    CUDA with chains one array for the whole batch. ``lead`` (``[lead_rows, H, D]``, a mixed batch's
    decode rows) goes in front of the first output: its ``sdpa_finish`` writes it, so no
    concatenation is needed. ``decode_rows`` instead (a mixed batch's decode-rows sub-plan, its rows
    the first ``first_seq`` sequences): the lead rows are computed here, inside the finish chain where
    `gc.decode_rows_in_chain` says so and the batch is chained, else by `gc.run_decode_rows`.

    On a GPU ``backend`` the pages go through the ``gather_kv`` kernel (one pass: the copy, V's
    non-finite elements zeroed, the flags of the NaN contract), and the contract is applied in one
    pass after the fused kernel (``first_flagged`` and ``sdpa_finish``); without one (the CPU
    tests) MLX ops compute the same (`gather_with_mlx_ops`, `poisoned_rows`). ``force_fused=False``
    lets MLX use its unfused SDPA (the CPU tests; the provider never does)."""
    if lead is not None and decode_rows is not None:
        raise ValueError("prefill_rows: lead and decode_rows were both given (allowed: one of them, or neither)")
    q, kc, vc = inputs.q, inputs.k_cache, inputs.v_cache
    num_heads, head = q.shape[1], kc.shape[3]
    sinks = sinks_for_mlx(inputs.sinks, q.dtype) if inputs.sinks is not None else None
    gpu = backend in ("cuda", "metal")
    lead_rows = first_seq if decode_rows is not None else (0 if lead is None else lead.shape[0])
    # What decode rows inside the finish chain depend on besides the batch and the shapes: their plan and the
    # call's scalars (whether they go there is the settings', which the epoch follows).
    decode_key = ((decode_rows.per_token, inputs.scale, inputs.softcap, inputs.sliding_window,
                   inputs.sinks is not None) if decode_rows is not None else None)
    key = (_epoch.current(), ROUTE, backend if gpu else None, first_seq, q.shape, kc.shape, q.dtype, kc.dtype,
           lead_rows, decode_key)
    plan = md._launches.get(key)
    if plan is None:
        in_chain = decode_rows is not None and gc.decode_rows_in_chain(backend, decode_rows)
        plan = gc.cached_launch(md, key, lambda: run_launches(
            md, first_seq, q.shape, kc.shape, q.dtype, kc.dtype, lead_rows, backend if gpu else None,
            (lambda: gc.plan_chain_part(inputs, decode_rows.per_token, rows=lead_rows)) if in_chain else None))
    runs, chained = plan.runs, plan.chained
    if decode_rows is not None and (chained is None or chained.decode is None):
        lead = gc.run_decode_rows(inputs, decode_rows)

    def fused(r: RunLaunch, q_rows: mx.array, k: mx.array, v: mx.array) -> mx.array:
        # The fused kernel writes its output in the query's layout, so this is packed row order
        # without a copy.
        qs = q_rows.reshape(r.n, r.q_len, num_heads, head).transpose(0, 2, 1, 3)
        o = mx.fast.scaled_dot_product_attention(qs, k, v, scale=inputs.scale, mask="causal" if r.q_len > 1 else None,
                                                 sinks=sinks, force_fused=force_fused)
        return o.transpose(0, 2, 1, 3).reshape(r.rows, num_heads, head)

    # A non-finite query element, or an attended flagged position, makes its row NaN (the
    # contract), whatever the fused kernel's arithmetic does with it (an infinite query can give
    # -inf scores everywhere: a silent 0).
    if chained is not None:
        gathered = chained.gather_flagged(kc, vc, md.block_tables)
        q_rows = [q[r.row0:r.row0 + r.rows] for r in runs]
        outs = [fused(r, qr, k, v) for r, qr, (k, v, _) in zip(runs, q_rows, gathered)]
        ahead = lead if lead is not None else gc.placeholder(q.dtype)
        decode_inputs = None if chained.decode is None else chained.decode.inputs(q, kc, vc, md, inputs.sinks)
        return [chained.finish_rows(runs, outs, q_rows, [f for _, _, f in gathered], ahead, decode_inputs)]
    parts: list[mx.array] = []
    for r in runs:
        if r.table_short:  # a table too short for seq_len (only with validation off): nothing to read
            parts.append(mx.full((r.rows, num_heads, head), mx.nan, dtype=q.dtype))
            continue
        q_rows = q[r.row0:r.row0 + r.rows]
        if gpu:
            k, v, first = r.gather_flagged(kc, vc, md.block_tables)
            ahead = lead if r.takes_lead else gc.placeholder(q.dtype)
            parts.append(r.finish([fused(r, q_rows, k, v), q_rows, first, ahead, r.finish_params])[0])
        else:
            k, v, bad = gather_with_mlx_ops(kc, vc, md.block_tables[r.seq:r.seq + r.n, :r.pages], r.seq_len)
            bad_rows = poisoned_rows(bad, r.q_len, num_heads).transpose(0, 2, 1).reshape(r.rows, num_heads)
            parts.append(mx.where((bad_rows | ~mx.isfinite(q_rows).all(axis=-1))[..., None], mx.nan,
                                  fused(r, q_rows, k, v)))
    led = lead is None or (bool(runs) and runs[0].takes_lead)
    return parts if led else [lead, *parts]  # the lead rows as a part of their own


#: The most threads one launch of ``gather_kv`` or ``sdpa_finish`` may have: their row indices are
#: 32-bit, as the grid's thread index is (MLX takes the grid in threads); the signed limit keeps a
#: margin on both backends.
MAX_GRID_THREADS = 2**31 - 1


def seq_threads(seq_len: int, q_len: int, num_heads: int, kv_heads: int) -> int:
    """Threads one sequence takes in the larger of its ``gather_kv`` and ``sdpa_finish`` launches
    (one simdgroup per (position, KV head) row, and per (query row, head))."""
    from metal_attn.kernels import SIMD_WIDTH

    return max(seq_len * kv_heads, q_len * num_heads) * SIMD_WIDTH


def _capped(runs: list[tuple[int, int, int, int]], num_heads: int,
            kv_heads: int) -> list[tuple[int, int, int, int]]:
    """``runs`` with each split into as few launches as keep every launch within `MAX_GRID_THREADS`."""
    out = []
    for seq, n, q_len, seq_len in runs:
        cap = max(1, MAX_GRID_THREADS // seq_threads(seq_len, q_len, num_heads, kv_heads))
        out += [(seq + i, min(cap, n - i), q_len, seq_len) for i in range(0, n, cap)]
    return out


GATHER_FILES = ("gather_kv.metal",)
GATHER_INPUTS = ("k_cache", "v_cache", "block_tables", "params")
GATHER_OUTPUTS = ("k_out", "v_out", "bad")
#: Threads per threadgroup of gather_kv (four rows, one simdgroup each).
GATHER_THREADS = 128
FINISH_FILES = ("sdpa_finish.metal",)
FIRST_INPUTS, FIRST_OUTPUTS = ("bad", "params"), ("first",)
FINISH_INPUTS, FINISH_OUTPUTS = ("o", "q", "first", "lead", "params"), ("out",)
#: Threads per threadgroup of first_flagged (one threadgroup per (sequence, KV head)) and of
#: sdpa_finish (four simdgroups, each taking `finish_launch`'s share of (row, head) pairs).
FIRST_THREADS = 256
FINISH_THREADS = 128
#: sdpa_finish's (row, head) pairs per simdgroup: as many as keep at least FINISH_SIMDGROUPS
#: simdgroups (about four waves of an H100's resident ones), at most FINISH_MAX_PAIRS. With one pair
#: a simdgroup, a big batch is thousands of short waves: at b4 q2048 the in-place finish took 60 µs
#: to read 67 MB of queries, 52 µs with 8 pairs a simdgroup (thirty-third session, H100, one profile
#: each; docs/bench-h200-prefill.md). The copying finish read the same either way. With the pairs'
#: indices counted on rather than divided out per pair, 34 µs (forty-third session).
FINISH_SIMDGROUPS = 32768
FINISH_MAX_PAIRS = 16


def finish_launch(pairs: int) -> tuple[int, int]:
    """``(pairs per simdgroup, threads)`` of an sdpa_finish launch over ``pairs`` (row, head) pairs."""
    from metal_attn.kernels import SIMD_WIDTH

    per = max(1, min(FINISH_MAX_PAIRS, pairs // FINISH_SIMDGROUPS))
    return per, -(-pairs // per) * SIMD_WIDTH


#: first_flagged's ``(name, dtype name)`` inputs and outputs.
FIRST_SIGNATURE = (tuple(zip(FIRST_INPUTS, ("int32", "int32"))), tuple(zip(FIRST_OUTPUTS, ("int32",))))


def gather_signature(dtype: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """gather_kv's ``(name, dtype name)`` inputs and outputs over pools of ``dtype``."""
    return (tuple(zip(GATHER_INPUTS, (dtype, dtype, "int32", "int32"))),
            tuple(zip(GATHER_OUTPUTS, (dtype, dtype, "int32"))))


def finish_signature(dtype: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """sdpa_finish's ``(name, dtype name)`` inputs and outputs for a query of ``dtype``."""
    return (tuple(zip(FINISH_INPUTS, (dtype, dtype, "int32", dtype, "int32"))),
            tuple(zip(FINISH_OUTPUTS, (dtype,))))


def gather_template(dtype: Any, head_size: int) -> list[tuple[str, Any]]:
    """The template arguments of ``gather_kv`` (its block size and KV head count are parameters)."""
    return [("T", dtype), ("HEAD_SIZE", head_size)]


def finish_template(dtype: Any, head_size: int) -> list[tuple[str, Any]]:
    """The template arguments of ``sdpa_finish`` (its head counts are parameters)."""
    return [("T", dtype), ("HEAD_SIZE", head_size)]


def poisoned_rows(bad: mx.array, q_len: int, num_heads: int) -> mx.array:
    """``[n, num_heads, q_len]``: the query rows whose range ``[0, seq_len - q_len + r + 1)`` holds
    a flagged position of their KV head (prefix counts of ``bad`` ``[n, KVH, seq_len]``)."""
    kvh, seq_len = bad.shape[1], bad.shape[2]
    counts = mx.cumsum(bad, axis=2)
    ends = mx.arange(q_len) + (seq_len - q_len)  # the last position row r attends
    reached = mx.take(counts, ends, axis=2) > 0  # [n, KVH, q_len]
    return mx.repeat(reached, num_heads // kvh, axis=1)  # query head h reads KV head h // group


def gather_with_mlx_ops(k_cache: mx.array, v_cache: mx.array, table: mx.array,
                        seq_len: int) -> tuple[mx.array, mx.array, mx.array]:
    """What ``gather_kv`` computes, with MLX ops in several passes (the path without a GPU)."""
    nb = k_cache.shape[0]
    bad_ids = ((table < 0) | (table >= nb)).any(axis=1).astype(mx.int32)  # [n]
    table = mx.clip(table, 0, nb - 1)
    k = gather_pages(k_cache, table, seq_len).transpose(0, 2, 1, 3)  # [n, KVH, seq_len, D]
    v = gather_pages(v_cache, table, seq_len).transpose(0, 2, 1, 3)
    # x * 0 is 0 for every finite x and NaN otherwise: the row sums find the non-finite rows.
    bad = mx.isnan((k * 0).sum(axis=-1) + (v * 0).sum(axis=-1)).astype(mx.int32)  # [n, KVH, seq_len]
    first = mx.maximum(bad[:, :, :1], bad_ids[:, None, None])
    bad = mx.concatenate([first, bad[:, :, 1:]], axis=2)
    return k, mx.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), bad


def gather_pages(pool: mx.array, table: mx.array, seq_len: int) -> mx.array:
    """The first ``seq_len`` tokens of the sequences whose page ids are ``table`` (``[n, pages]``),
    as ``[n, seq_len, kv_heads, head]``: one gather of whole pages (``mx.take``), then a view."""
    n, pages = table.shape
    _, block_size, kvh, head = pool.shape
    return mx.take(pool, table, axis=0).reshape(n, pages * block_size, kvh, head)[:, :seq_len]
