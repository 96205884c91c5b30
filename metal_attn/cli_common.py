"""What every command line here shares: argparse types whose errors name the value and what is allowed,
messages in the command line's terms (`flagify`), and one error handling (`guarded`) for ``metal-attn``,
``metal-attn generate`` and ``python -m metal_attn.bench.cli``.

It imports no command module, so each of them can use it (``metal_attn.cli`` dispatches to
``metal_attn.generate`` and ``metal_attn.bench.cli``; they must not import it back).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import re
import select
import sys
import warnings
from collections.abc import Callable, Mapping

from metal_attn.errors import MetalAttnError, SettingsError, SettingsWarning


def int_flag(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum`` (`metal_attn.checks.int_at_least` checks values in code)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} (allowed: an integer >= {minimum})")
        return value

    return parse


def flagify(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with each ``field=`` that ``flags`` maps named as the flag (or variable) that set it
    (whole names only: ``seq_lens=`` is not ``q_lens=``)."""
    return re.sub(r"(?<![\w-])(\w+)=", lambda m: f"{flags.get(m.group(1), m.group(1))}=", message)


def guarded(command: str, body: Callable[[], int], verbose: int = 0) -> int:
    """Run a command's ``body`` as every command line here does: logging configured from the settings, a
    settings warning shown as its log event only, and an error as a line on stderr with the exit code
    (2 bad settings, 1 another metal-attn error, 0 a closed pipe, 130 Ctrl-C), never a traceback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SettingsWarning)
        try:
            _configure_logging(verbose)
            return body()
        except SettingsError as exc:
            print(f"metal-attn: error: {exc}", file=sys.stderr)
            return 2
        except MetalAttnError as exc:
            print(f"{command}: error: {exc}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # `metal-attn providers | head`: done; stderr's reader gone: stopped short
            if not _stdout_gone():
                return 1
            _quiet_stdout()
            return 0
        except KeyboardInterrupt:  # Ctrl-C: what was printed stays; no traceback
            print(f"\n{command}: interrupted", file=sys.stderr)
            return 130


def _configure_logging(verbose: int) -> None:
    """The one place that configures logging: the settings' level, raised one step per ``-v``. What reading
    the settings logs (an unknown or conflicting variable) is held until then, and so takes the format and
    level it sets; it was printed bare, at any level."""
    from metal_attn.log import configure_cli_logging
    from metal_attn.settings import get_settings

    lg = logging.getLogger("metal_attn")
    held = logging.handlers.BufferingHandler(capacity=1 << 20)  # never flushes on its own at that size
    saved = (lg.handlers[:], lg.propagate)
    lg.handlers[:], lg.propagate = [held], False
    try:
        s = get_settings()
    finally:
        lg.handlers[:], lg.propagate = saved
        if sys.exc_info()[0] is not None:  # the settings failed: said as an unconfigured library says it
            for record in held.buffer:
                lg.handle(record)
    level = s.log_level
    if verbose:
        order = ["error", "warning", "info", "debug"]
        level = order[min(len(order) - 1, max(order.index(level), 1 + verbose))]
    configure_cli_logging(level, s.log_format)
    for record in held.buffer:
        if record.levelno >= lg.getEffectiveLevel():
            lg.handle(record)


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (its pipe reports an error); True where that cannot be told."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or a stdout with no descriptor
        return True


def _quiet_stdout() -> None:
    """stdout to /dev/null after its reader went away, so the interpreter's last flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # captured: no file descriptor
        pass
