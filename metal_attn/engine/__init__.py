"""Continuous batching on the paged cache: requests, scheduler, block manager, step runner.

    from metal_attn.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=32))
    for c in engine.generate(["Hello", "Bonjour"], max_tokens=32):
        print(c.text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.engine.block_manager import BlockManager
    from metal_attn.engine.config import EngineConfig
    from metal_attn.engine.engine import Completion, Engine, RequestOutput
    from metal_attn.engine.request import FinishReason, Request, RequestStatus, SamplingParams
    from metal_attn.engine.scheduler import Scheduler
    from metal_attn.engine.stats import EngineStats, RequestStats

#: Where each public name lives. They load on first use (PEP 562), so that a light submodule
#: (`metal_attn.engine.request`, which `metal-attn generate`'s flag parser uses to check --temp before
#: any model work) does not pay for mlx-lm's import, which the step runner needs (about 1.2 s).
_HOMES = {
    "BlockManager": "block_manager",
    "Completion": "engine",
    "Engine": "engine",
    "EngineConfig": "config",
    "EngineStats": "stats",
    "FinishReason": "request",
    "Request": "request",
    "RequestOutput": "engine",
    "RequestStats": "stats",
    "RequestStatus": "request",
    "SamplingParams": "request",
    "Scheduler": "scheduler",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


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
