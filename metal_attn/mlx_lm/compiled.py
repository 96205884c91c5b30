"""Decode steps of a `PagedModel` traced once under ``mx.compile`` and replayed.

Building a step's graph in Python costs the host about as much per layer as the kernels take
on a GPU at small batches (docs/serving.md). A decode step (one new token per sequence) has the
same graph every time but for its lengths, so `CompiledDecode` traces the model's forward once
per (rows, table width) with `AttentionMetadata.decode_bounds` metadata, whose host view holds
only bounds, and MLX replays the traced graph on later steps with the step's own tokens,
positions, slots, block tables and lengths as inputs, and the pools as inputs and outputs.

What it needs (a refusal leaves the eager path in charge, with the reason in ``disabled``):

- when it is built: no sliding-window layer (a window's start depends on each length) and a
  page size that is a kernel block size (8, 16, 32: no host re-split of the table);
- on each trace: every layer's attention admitted by a provider that reads its lengths on the
  device (`Provider.reads_lengths_on_device`: classic); the registry chooses among those only,
  so a forced provider that does not (``reference``) fails the trace, as does any error while
  tracing; a new dispatch epoch (settings, registry, kernel failures) retraces and retries;
- table widths are padded up to a power of two, so a sequence growing does not retrace every
  page (`table_width`), and, given a scratch page (``pad_block``), so are row counts
  (`row_bucket`), so requests arriving and finishing retrace once per power of two instead of
  once per batch size. A padding row is token 0 at position 0 whose K/V goes to the scratch page
  and whose attention reads one token of it; its logits are dropped;
- a decode shape (row count or bucket, table width) traces on its ``trace_after``-th step; the
  steps before run eagerly (`run` returns ``None``), so with 2 a shape seen on one step only never
  traces (`EngineConfig.compile_trace_after`; the engine's default is 1);
- a row bucket smaller than one already traced at the same table width runs padded in the larger
  one for its first ``shrink_after`` steps (and any before its ``trace_after``-th), and is traced
  only if it lasts (`EngineConfig.compile_shrink_after`). At the end of a run requests finish a few per step, and
  each smaller power of two would otherwise cost a trace for a handful of steps: 3 of the 4
  traces of the generate suite at 64 requests on the H200, 85 of its 114 ms of tracing
  (docs/serving.md, "Eleventh session"). A padding row reads one token and writes to the scratch
  page.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from metal_attn import _epoch
from metal_attn.api import kernel_block_size
from metal_attn.cache import StepPlan
from metal_attn.checks import int_at_least
from metal_attn.log import get_logger
from metal_attn.metadata import AttentionMetadata
from metal_attn.mlx_lm.runner import array_slots, model_lock

__all__ = ["CompiledDecode", "row_bucket", "table_width"]

log = get_logger(component="compiled_decode")


def table_width(blocks: int) -> int:
    """The padded table width a step of ``blocks`` columns is traced with: the next power of two."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks} (allowed: >= 1)")
    return 1 << (blocks - 1).bit_length()


def row_bucket(rows: int) -> int:
    """The row count a step of ``rows`` decode rows is traced with (when padding): the next power of two."""
    if rows < 1:
        raise ValueError(f"rows={rows} (allowed: >= 1)")
    return 1 << (rows - 1).bit_length()


class CompiledDecode:
    """Decode steps of one `PagedModel` through a compiled forward (see the module docstring).

    ``model``: a `metal_attn.mlx_lm.runner.PagedModel`. ``pad_block``: a page of its pool that no
    sequence uses (the engine reserves one), where padding rows write; ``None``: no padding, one
    trace per row count. ``trace_after``: the step of a shape (rows, table width) that traces it;
    earlier ones are left to the eager forward, or, when a larger row bucket of the same width is
    traced, run padded in it. ``shrink_after``: how many steps a smaller bucket runs padded in a
    traced larger one before it is traced itself (padding rows only). Call `run` with a decode-only
    plan; it returns ``None`` (and the caller runs the eager forward) when compiled steps do not apply.
    """

    def __init__(self, model: Any, pad_block: int | None = None, *, trace_after: int = 1,
                 shrink_after: int = 16) -> None:
        for name, value, low in (("trace_after", trace_after, 1), ("shrink_after", shrink_after, 0)):
            int_at_least(name, value, low)
        self.model = model
        self.pad_block = pad_block
        self.trace_after = trace_after
        self.shrink_after = shrink_after
        #: Traces recorded (one per distinct row count, or row bucket when padding, x table width and
        #: dispatch epoch), steps run compiled, steps left eager because their shape had not been
        #: seen ``trace_after`` times yet, and steps run padded in a larger traced bucket.
        self.traces = 0
        self.steps = 0
        self.early_steps = 0
        self.shrunk_steps = 0
        self._sightings: dict[tuple[int, int], int] = {}
        #: Shapes traced in this dispatch epoch (`_reset` empties it).
        self._traced: set[tuple[int, int]]
        self._reset()

    def _reset(self) -> None:
        """A fresh compiled function for the current dispatch epoch: a replay runs no Python, so the
        providers and routes a trace chose stay in it; settings, registry and kernel-failure
        changes bump the epoch, and the next step traces again (a refusal is retried then too)."""
        self._epoch = _epoch.current()
        self.disabled: str | None = self._static_reasons()
        # The weights are read at every call (``inputs``), not captured at the trace: a model updated
        # in place (``model.update``, ``load_weights``, an adapter swap) decodes with its new weights.
        # MLX flattens the tree on each call: about 37 us for a 32-layer llama (323 arrays) on the 2-core
        # CPU (benchmarks/host_cost_compiled_inputs.py; docs/serving.md, "Compiled steps and updated weights").
        self._fn = mx.compile(self._forward, inputs=self.model.model.state)
        self._traced = set()

    def _static_reasons(self) -> str | None:
        windows = [i for i, spec in enumerate(self.model.resolved.layers) if spec.sliding_window]
        if windows:
            return f"layers {windows[:4]}{'...' if len(windows) > 4 else ''} have a sliding window"
        page = self.model.kv.block_size
        if kernel_block_size(page) != page:
            return f"page size {page} is not a kernel block size (8, 16, 32)"
        return None

    def applies(self, plan: StepPlan) -> bool:
        """Whether ``plan`` can run compiled: compiled steps are on and every row is one new token
        (the caller also makes sure every row samples: the logits are every row's)."""
        return self.disabled is None and all(n == 1 for n in plan.q_lens)

    def run(self, plan: StepPlan, tokens: mx.array) -> mx.array | None:
        """Logits ``[rows, vocab]`` of a decode step (lazy), one per row in the plan's order, the
        pools rebound to the step's; or ``None`` when the step does not apply, its shape has been
        seen fewer than ``trace_after`` times with no larger traced bucket to run padded in
        (counted in ``early_steps``; padded steps in ``shrunk_steps``), or its trace failed (then
        ``disabled`` says why); the caller then runs the eager forward. Replays record no dispatch
        diagnostics: the trace's are the step's."""
        if self._epoch != _epoch.current():
            self._reset()
        if not self.applies(plan):
            return None
        md = plan.metadata
        rows, width = len(plan.q_lens), table_width(md.max_blocks_per_seq)
        shape = (row_bucket(rows) if self.pad_block is not None else rows, width)
        seen = self._sightings.get(shape, 0)
        larger = self._larger_traced(shape)
        if larger is not None and (seen < self.shrink_after or seen + 1 < self.trace_after):
            self._sightings[shape] = seen + 1
            self.shrunk_steps += 1
            shape = larger
        elif seen + 1 < self.trace_after:
            self._sightings[shape] = seen + 1
            self.early_steps += 1
            return None
        else:
            self._sightings[shape] = max(seen, self.trace_after)
        inputs = [tokens, plan.positions, plan.slot_mapping, md.padded_block_tables(width), md.seq_lens]
        if shape[0] > rows:
            inputs = self._padded(inputs, shape[0] - rows)
        kv = self.model.kv
        pools = kv.take_pools()
        traces = self.traces
        # While tracing, MLX puts tracers in place of the weights in the model's own tree and does not
        # put them back if the trace raises: keep the weights to restore them (traces only: cheap).
        # A trace swaps the weights for tracers: other threads building graphs on this model wait, until
        # the weights are back (`model_lock`).
        with model_lock(self.model.model):
            weights = None if shape in self._traced else array_slots(self.model.model.state)
            try:
                out = self._fn(*inputs, *pools)
            except BaseException as exc:  # Ctrl-C included: the pools and the weights go back first
                kv.put_pools(pools)
                traced = self.traces != traces
                if traced and weights is not None:
                    for node, key, value in weights:
                        node[key] = value
                if not traced or not isinstance(exc, Exception):  # not a trace failure: the caller's to see
                    raise
                if weights is None:
                    raise RuntimeError(f"a compiled decode step retraced unexpectedly and failed "
                                       f"({type(exc).__name__}: {exc}); the model's weights were left as tracers "
                                       "by mx.compile") from exc
                # Refused or failed while tracing (a provider that reads host lengths, an op that reads
                # a tracer on the host, ...): the eager path takes over until the dispatch epoch moves.
                self.disabled = f"{type(exc).__name__}: {exc}"
                log.info("compiled_decode_off", reason=self.disabled)
                return None
            if weights is not None and self.traces != traces:
                # MLX put the weights back as new Python objects of the same arrays: put back the
                # objects themselves, so the model's tree stays what its owner gave it (the engine
                # tells a weight update from the identity of these objects).
                for node, key, value in weights:
                    node[key] = value
        del pools  # the graph holds the old pools alone, so the scatters write in place
        kv.put_pools(out[1:])
        self._traced.add(shape)
        self.steps += 1
        return out[0] if out[0].shape[0] == rows else out[0][:rows]

    def _larger_traced(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The smallest traced shape of the same table width with more rows than ``shape`` (padding
        rows only: ``None`` without a scratch page, or when ``shape`` itself is traced)."""
        if self.pad_block is None or shape in self._traced:
            return None
        rows, width = shape
        larger = [s for s in self._traced if s[1] == width and s[0] > rows]
        return min(larger) if larger else None

    def _padded(self, inputs: list[mx.array], extra: int) -> list[mx.array]:
        """``inputs`` (tokens, positions, slots, tables, lengths) with ``extra`` padding rows: token 0
        at position 0, written to slots of the scratch page, reading one token of it."""
        tokens, positions, slots, tables, seq_lens = inputs
        bs = self.model.kv.block_size
        pad_slots = self.pad_block * bs + mx.arange(extra, dtype=slots.dtype) % bs
        pad_table = mx.zeros((extra, tables.shape[1]), dtype=tables.dtype) + self.pad_block
        return [
            mx.concatenate([tokens, mx.zeros((extra,), dtype=tokens.dtype)]),
            mx.concatenate([positions, mx.zeros((extra,), dtype=positions.dtype)]),
            mx.concatenate([slots, pad_slots]),
            mx.concatenate([tables, pad_table]),
            mx.concatenate([seq_lens, mx.ones((extra,), dtype=seq_lens.dtype)]),
        ]

    def _forward(self, tokens, positions, slots, tables, seq_lens, *pools):
        """What the trace records (Python runs here only while tracing)."""
        self.traces += 1
        kv = self.model.kv
        kv.put_pools(pools)
        n, width = tables.shape
        md = AttentionMetadata.decode_bounds(tables, seq_lens, max_seq_len=width * kv.block_size)
        plan = StepPlan(seq_ids=tuple(range(n)), q_lens=(1,) * n, seq_lens=md.seq_lens_host, slot_mapping=slots,
                        positions=positions, metadata=md)
        logits = self.model.forward(plan, tokens)
        return (logits, *kv.take_pools())
