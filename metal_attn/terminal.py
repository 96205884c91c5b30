"""Rich consoles for the command line, made in one place so that they all end a closed pipe alike.

rich's `Console` answers a closed stdout (``metal-attn explain | head -1``) with ``SystemExit(1)``,
which a pipeline under ``set -o pipefail`` reads as a failure. Ours raise `BrokenPipeError` instead,
which the command lines (`metal_attn.cli_common.guarded`) turn into exit 0 when stdout's reader went away, as
for a plain ``print``, and 1 when stderr's did (the run stopped short).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

__all__ = ["console"]


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(f"the reader of this command's {'stderr' if self.stderr else 'output'} went away")


def console(*, min_width: int | None = None, **kwargs: Any) -> Console:
    """A rich `Console` (``kwargs`` as rich's) that raises `BrokenPipeError` on a closed pipe.
    ``min_width``: at least that many columns, wider where the terminal is."""
    con = _Console(**kwargs)
    if min_width is not None and con.width < min_width:
        con.width = min_width
    return con
