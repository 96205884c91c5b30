"""structlog routed through the standard `logging` module.

The library never configures logging: events go to the ``metal_attn`` stdlib
logger, and the host application (or the CLI, through `configure_cli_logging`)
decides where they end up. Events carry fields (``provider``, ``route``,
``reason``, ``request``), not formatted sentences.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import structlog

_LOGGER_NAME = "metal_attn"

_logger = structlog.wrap_logger(
    logging.getLogger(_LOGGER_NAME),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.stdlib.add_log_level,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        structlog.stdlib.render_to_log_kwargs,
    ],
    cache_logger_on_first_use=True,
)

_warned: set[tuple[Any, ...]] = set()
_warned_lock = threading.Lock()


def get_logger(**bound: Any) -> structlog.stdlib.BoundLogger:
    """The library's logger, optionally with bound fields."""
    return _logger.bind(**bound) if bound else _logger


def warn_once(event: str, key: tuple[Any, ...], **fields: Any) -> None:
    """Log a warning the first time ``(event, *key)`` is seen in this process."""
    k = (event, *key)
    with _warned_lock:
        if k in _warned:
            return
        _warned.add(k)
    _logger.warning(event, **fields)


def configure_cli_logging(level: str = "warning", fmt: str = "console") -> None:
    """Configure stdlib logging for the ``metal-attn`` command (never called by the library)."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.processors.TimeStamper(fmt="iso")],
    )
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    lg = logging.getLogger(_LOGGER_NAME)
    lg.handlers[:] = [handler]
    lg.setLevel(level.upper())
    lg.propagate = False
