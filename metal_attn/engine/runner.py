"""The step runner: turns a `SchedulerOutput` into tensors, runs the model, samples, queues it.

It never decides who runs. A launched step is queued with ``mx.async_eval`` and handed
back as an `InFlight`; its tokens stay on the device, and the next step's decode rows
read them from there, so the host can build step N+1 while step N runs.
"""

from __future__ import annotations

import dataclasses
import time

import mlx.core as mx
import numpy as np

from metal_attn.cache import StepPlan, build_step_plan, next_decode_plan
from metal_attn.engine.block_manager import BlockManager
from metal_attn.engine.sampling import sample
from metal_attn.engine.scheduler import ScheduledRow, SchedulerOutput
from metal_attn.host_arrays import device_array, padded_length
from metal_attn.mlx_lm.compiled import CompiledDecode
from metal_attn.mlx_lm.runner import PagedModel

__all__ = ["InFlight", "StepRunner"]


@dataclasses.dataclass(eq=False)
class InFlight:
    """A launched step: what ran, and its sampled tokens (on the device until `tokens` is called)."""

    output: SchedulerOutput
    plan: StepPlan
    #: The rows that sample, in the order of ``sampled``.
    sampling_rows: tuple[ScheduledRow, ...]
    sampled: mx.array | None
    #: Request id -> its row in ``sampled``.
    index: dict[int, int]
    errors: dict[int, str]
    launched_at: float
    #: Host seconds per phase of building the step: plan, graph, sample, async_eval (the runner's),
    #: schedule, and wait (the time `tokens` blocked; filled by the engine).
    timings: dict[str, float]

    @property
    def build_seconds(self) -> float:
        """Host time from scheduling to queued (everything but the wait)."""
        return sum(v for k, v in self.timings.items() if k != "wait")

    def tokens(self) -> list[int]:
        """Wait for the step and return its sampled tokens (host ints); the wait goes into ``timings``."""
        t = time.perf_counter()
        out = self.sampled.tolist() if self.sampled is not None else []
        self.timings.setdefault("wait", time.perf_counter() - t)
        return out


class StepRunner:
    """Runs scheduled steps of one `PagedModel` whose pages the `BlockManager` hands out."""

    def __init__(self, model: PagedModel, blocks: BlockManager, *, compile_decode: bool = False,
                 trace_after: int = 1, shrink_after: int = 16) -> None:
        self.model = model
        self.blocks = blocks
        #: Decode-only steps through a compiled forward (None: every step eager); ``trace_after``:
        #: the step of a decode shape that traces it, ``shrink_after``: the steps a smaller row
        #: bucket runs padded in a larger traced one first (`CompiledDecode`).
        self.compiled = None
        #: Step plans built on the host (`build_step_plan`) and derived from the step before on the
        #: device (`next_decode_plan`), so far.
        self.plans_built = 0
        self.plans_derived = 0
        if compile_decode:
            self.compiled = CompiledDecode(model, trace_after=trace_after, shrink_after=shrink_after)
            # The scratch page of padding rows, only where compiled steps can run at all (not with a
            # sliding window or a page size that is no kernel block size: `CompiledDecode.disabled`
            # says so from the start); a pool of one page serves without padding rows.
            if self.compiled.disabled is None and blocks.num_free > 1:
                self.compiled.pad_block = blocks.reserve("padding rows of compiled decode steps")

    def launch(self, out: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Build the step's graph and queue it. ``previous``: the step still in flight, whose
        sampled tokens are this step's inputs wherever a request's newest token is pending."""
        t0 = time.perf_counter()
        rows = out.rows
        plan = self._next_decode_plan(rows, previous)
        if plan is None:
            plan = build_step_plan(
                [r.request.id for r in rows],
                [r.start for r in rows],
                [r.num_tokens for r in rows],
                [self.blocks.table(r.request.id) for r in rows],
                self.blocks.block_size,
            )
            self.plans_built += 1
        else:
            self.plans_derived += 1
        tokens = self._input_tokens(rows, previous)
        ends = np.cumsum([r.num_tokens for r in rows]) - 1
        sampling = [(i, r) for i, r in enumerate(rows) if r.samples]
        t1 = time.perf_counter()
        sampled, errors = None, {}
        if sampling:
            every_row_samples = len(sampling) == len(rows)  # a compiled step's logits are every row's
            logits = self.compiled.run(plan, tokens) if self.compiled is not None and every_row_samples else None
            if logits is None:  # not a decode-only step, or compiled steps are off or refused
                logits = self.model.forward(plan, tokens, [int(ends[i]) for i, _ in sampling])
            t2 = time.perf_counter()
            reqs = [r.request for _, r in sampling]
            hists = [self._history(r, previous) if r.request.processors else None for _, r in sampling]
            sampled, errors = sample(logits, reqs, hists)
            queued = sampled
        else:
            # A step of prompt chunks only: nothing to sample, but its K/V writes must run.
            queued = self.model.forward(plan, tokens, [int(ends[-1])])
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        mx.async_eval(queued)
        t4 = time.perf_counter()
        return InFlight(
            output=out,
            plan=plan,
            sampling_rows=tuple(r for _, r in sampling),
            sampled=sampled,
            index={r.request.id: j for j, (_, r) in enumerate(sampling)},
            errors=errors,
            launched_at=t0,
            timings={"plan": t1 - t0, "graph": t2 - t1, "sample": t3 - t2, "async_eval": t4 - t3},
        )

    def _next_decode_plan(self, rows: tuple[ScheduledRow, ...], previous: InFlight | None) -> StepPlan | None:
        """The previous step's plan one token on (`next_decode_plan`: no host arrays, or two small ones
        when rows start pages, whose new blocks the block manager has just given them), when this step
        decodes one more token of each of its rows, in its order, and will run compiled (the eager
        forward's cache writer reads the slots on the host, which would wait for the GPU)."""
        if self.compiled is None or self.compiled.disabled is not None or previous is None:
            return None
        before = previous.output.rows
        if len(before) != len(rows) or not all(
            r.request is p.request and r.num_tokens == 1 and p.num_tokens == 1 and r.start == p.start + 1
            for r, p in zip(rows, before)
        ):
            return None
        bs = self.blocks.block_size
        pages = {i: self.blocks.table(r.request.id)[r.start // bs] for i, r in enumerate(rows) if r.start % bs == 0}
        return next_decode_plan(previous.plan, bs, pages)

    @staticmethod
    def _input_tokens(rows: tuple[ScheduledRow, ...], previous: InFlight | None) -> mx.array:
        """``[T]`` int32 ids: host ids where known, the previous step's samples where pending.

        A steady decode step (every row one token, each the previous step's sample in that step's
        order) takes the samples as they are, like `mlx_lm.generate_step`: no host array and no
        gather or scatter on the device."""
        if previous is not None and previous.sampled is not None and len(rows) == previous.sampled.shape[0] and all(
            r.num_tokens == 1 and r.start == len(r.request.known_ids()) and previous.index.get(r.request.id) == i
            for i, r in enumerate(rows)
        ):
            return previous.sampled
        total = sum(r.num_tokens for r in rows)
        # One buffer over MLX CUDA's small pool (`metal_attn.host_arrays`), the pending samples
        # scattered into it, the rows a view of its front.
        host = np.zeros(padded_length(total, 4), dtype=np.int32)
        dev_at, dev_from = [], []
        at = 0
        for r in rows:
            req = r.request
            known = req.known_ids()
            end = r.start + r.num_tokens
            take = known[r.start : min(end, len(known))]
            host[at : at + len(take)] = take
            if end > len(known):  # the row's last token was sampled by the step in flight
                dev_at.append(at + r.num_tokens - 1)
                dev_from.append(previous.index[req.id])
            at += r.num_tokens
        tokens = mx.array(host)
        if dev_at:
            tokens[device_array(dev_at, np.int32)] = previous.sampled[device_array(dev_from, np.int32)]
        return tokens[:total]

    @staticmethod
    def _history(row: ScheduledRow, previous: InFlight | None) -> mx.array:
        """Every token of the request up to this row's last (for mlx-lm's logits processors)."""
        req = row.request
        known = req.known_ids()
        hist = device_array(known, np.int32)
        if req.num_tokens > len(known) and previous is not None and req.id in previous.index:
            j = previous.index[req.id]
            hist = mx.concatenate([hist, previous.sampled[j : j + 1]])
        return hist
