"""The scheduler: which requests run next step, and how many tokens each, within the budget.

A pure policy over request states and the block manager; it never touches tensors.
Each `Scheduler.schedule`:

1. running requests, oldest admission first, each gets what it still has to compute:
   one token for a decode row, the rest of its prompt (up to the remaining budget) for a
   chunked prefill; when a running request cannot get a page for it, the most recently
   admitted running request (`EngineConfig.preemption_order`) gives all its pages back
   and waits to be recomputed, never an error and never a lost request;
2. waiting requests, first come first served (preempted ones at the front), while the
   budget and the running cap allow and the pool holds the next chunk plus the watermark;
3. rows are ordered decode rows (one token) first, then prefill chunks: the batch order
   the kernels expect.

The engine runs one step ahead (pipelining), so a request's newest token may still be on
the device; `Request.num_tokens` counts it, and a request whose newest token is still
pending is not admitted from the queue until the token is known.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from metal_attn.engine.block_manager import BlockManager
from metal_attn.engine.config import EngineConfig
from metal_attn.engine.request import Request, RequestStatus

__all__ = ["ScheduledRow", "Scheduler", "SchedulerOutput"]


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """``num_tokens`` tokens of ``request`` starting at position ``start``."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this row's last token's logits are sampled (it reaches the end of the known tokens)."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    """Waiting queue, running set and the per-step policy of `EngineConfig`."""

    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._admissions = 0
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * blocks.num_blocks)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.wants_more or r.num_computed < r.num_tokens for r in self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and give its pages back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.id in self.blocks:
            self.blocks.free(request.id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            todo = req.num_tokens - req.num_computed
            if todo == 0 or not req.wants_more:
                continue  # nothing to feed yet, or nothing more to sample
            n = min(todo, budget)
            while not self.blocks.grow(req.id, req.num_computed + n):
                victim = self._victim(exclude=scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            rows.append(ScheduledRow(req, req.num_computed, n))
            scheduled.add(req.id)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.pending or req in preempted:
                break  # its newest token is still on the device: wait for it (keeps FIFO order)
            ids = req.known_ids()
            reserve = self._watermark_blocks if self.running else 0
            got = self.blocks.admit(req.id, ids, budget, reserve=reserve)
            if got is None:
                break
            n = min(len(ids) - got, budget)
            self.waiting.popleft()
            req.num_computed = got
            req.num_cached_tokens = min(got, len(req.prompt_ids))
            req.admitted = self._admissions
            self._admissions += 1
            req.move_to(RequestStatus.RUNNING)
            self.running.append(req)
            rows.append(ScheduledRow(req, got, n))
            scheduled.add(req.id)
            budget -= n

        rows.sort(key=lambda r: r.num_tokens != 1)  # stable: decode rows first, then prefill chunks
        return SchedulerOutput(tuple(rows), tuple(preempted))

    def _victim(self, exclude: set[int]) -> Request:
        """The running request to preempt: never one already scheduled this step."""
        candidates = [r for r in self.running if r.id not in exclude]
        if self.config.preemption_order == "largest":
            return max(candidates, key=lambda r: (len(self.blocks.table(r.id)), r.admitted))
        return max(candidates, key=lambda r: r.admitted)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.id)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.move_to(RequestStatus.PREEMPTED)
        self.waiting.appendleft(req)
