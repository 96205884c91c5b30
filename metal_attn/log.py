"""structlog routed through the standard `logging` module.

The library never configures logging: events go to the ``metal_attn`` stdlib
logger, and the host application (or the CLI, through `configure_cli_logging`)
decides where they end up. Events carry fields (``provider``, ``route``,
``reason``, ``request``), not formatted sentences. A record carries them as
attributes (``record.event``, ``record.reason``, ...) for handlers and
formatters that want data, and its message reads on its own
(``slow_fallback: <reason> (provider=reference, ...)``) for an application that
configured nothing, where Python prints the bare message.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import structlog

_LOGGER_NAME = "metal_attn"


def _message(event: str, fields: dict[str, Any]) -> str:
    """An event as one line of text: ``event: reason (key=value, ...)``."""
    text = f"{event}: {fields['reason']}" if "reason" in fields else event
    rest = ", ".join(f"{k}={v}" for k, v in fields.items() if k != "reason")
    return f"{text} ({rest})" if rest else text


def _to_log_kwargs(_: logging.Logger, __: str, event_dict: Any) -> dict[str, Any]:
    """The last processor: an event as a stdlib logging call's arguments. The message is `_message`
    (the event and its fields as text); ``extra`` puts the event and each field on the record as
    attributes; ``exc_info``, ``stack_info`` and ``stacklevel`` stay logging's own arguments."""
    kwargs = {kw: event_dict.pop(kw) for kw in structlog.stdlib.LOG_KWARG_NAMES if kw in event_dict}
    event = event_dict.pop("event")
    event_dict.pop("level", None)  # the record's own levelname says it
    return {"msg": _message(event, event_dict), "extra": {"event": event, **event_dict}, **kwargs}


_logger = structlog.wrap_logger(
    logging.getLogger(_LOGGER_NAME),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.stdlib.add_log_level,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        _to_log_kwargs,
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
        # The record's attributes (the library's event name and fields) as the rendered event's keys.
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), structlog.stdlib.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso")],
    )
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    lg = logging.getLogger(_LOGGER_NAME)
    lg.handlers[:] = [handler]
    lg.setLevel(level.upper())
    lg.propagate = False
