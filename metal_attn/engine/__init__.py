"""Continuous batching on the paged cache: requests, scheduler, block manager, step runner.

    from metal_attn.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=32))
    for c in engine.generate(["Hello", "Bonjour"], max_tokens=32):
        print(c.text)
"""

from __future__ import annotations

from metal_attn.engine.block_manager import BlockManager
from metal_attn.engine.config import EngineConfig
from metal_attn.engine.engine import Completion, Engine, RequestOutput
from metal_attn.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from metal_attn.engine.scheduler import Scheduler
from metal_attn.engine.stats import EngineStats, RequestStats

__all__ = [
    "BlockManager",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "Request",
    "RequestOutput",
    "RequestStats",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
]
