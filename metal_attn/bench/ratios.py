"""Ratios against same-run peers: the numbers regression tracking compares across runs.

Absolute times differ from machine to machine (and from hour to hour on a shared one); a
candidate's time against a peer measured in the same run on the same inputs varies much less.
One convention for every ratio, so that "fell below its baseline" always means "got worse":

- **higher is better**, and every key ends in ``ratio``;
- ``speedup_vs_<peer>_ratio`` = ``t_peer / t_candidate`` (above 1: faster than the peer), for
  every peer of `SPEEDUP_PEERS` that ran in the same run (``gather_sdpa``, ``mlx_sdpa``,
  ``mlx_sdpa_packed``, ``torch_sdpa``);
- ``ceiling_fraction_ratio`` = ``t_ceiling / t_candidate``, with ``t_ceiling`` = the K+V bytes
  read once / the copy (GPU) or read (CPU) bandwidth measured in the same run; equal to
  ``GB/s / ceiling GB/s``, at most about 1 (decode and mixed shapes only).

`ratios_of` names a result's ratios; `add_peer_ratios` adds them to pytest-benchmark's JSON,
where each candidate is a separate benchmark and its peers are the other benchmarks of its group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: Every stored ratio's key ends with this.
SUFFIX = "ratio"

#: Peers a candidate's speedup is taken against, in display order.
SPEEDUP_PEERS: tuple[str, ...] = ("gather_sdpa", "mlx_sdpa", "mlx_sdpa_packed", "torch_sdpa")

#: ``t_ceiling / t_candidate``: the fraction of the same run's bandwidth ceiling reached.
CEILING_RATIO = "ceiling_fraction_ratio"


def peer_ratio_key(peer: str) -> str:
    """``speedup_vs_<peer>_ratio``: ``t_peer / t_candidate``."""
    return f"speedup_vs_{peer}_{SUFFIX}"


#: Every ratio a result can carry: the names ``--ratios`` patterns are matched against.
RATIO_NAMES: tuple[str, ...] = (*(peer_ratio_key(p) for p in SPEEDUP_PEERS), CEILING_RATIO)


def ratios_of(speedup: Mapping[str, float], fraction_of_ceiling: float | None) -> dict[str, float]:
    """The named ratios of one result: its speedups (peer name -> ``t_peer / t_candidate``) and its
    fraction of the ceiling; non-finite or non-positive values are left out."""
    out = {peer_ratio_key(p): v for p, v in speedup.items()}
    if fraction_of_ceiling is not None:
        out[CEILING_RATIO] = fraction_of_ceiling
    return {k: float(v) for k, v in out.items() if _usable(v)}


def _usable(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def add_peer_ratios(benchmarks: list[dict[str, Any]]) -> None:
    """pytest-benchmark's JSON ``benchmarks``: add ``speedup_vs_<peer>_ratio`` (peer median / own
    median) to the ``extra_info`` of every benchmark whose group holds that peer's benchmark, and
    ``ceiling_fraction_ratio`` where ``extra_info`` carries the ceiling's time (``ceiling_s``);
    benchmarks of ``kind`` ``ceiling`` (bandwidth probes) get none."""
    by_group: dict[Any, dict[str, float]] = {}
    for b in benchmarks:
        name, median = b.get("extra_info", {}).get("candidate"), _median(b)
        if name in SPEEDUP_PEERS and median is not None:
            by_group.setdefault(b.get("group"), {})[name] = median
    for b in benchmarks:
        info, median = b.setdefault("extra_info", {}), _median(b)
        if median is None or info.get("kind") == "ceiling":  # a bandwidth probe, not a candidate
            continue
        own = info.get("candidate")
        speedup = {p: t / median for p, t in by_group.get(b.get("group"), {}).items() if p != own}
        ceiling_s = info.get("ceiling_s")
        fraction = ceiling_s / median if _usable(ceiling_s) else None
        info.update(ratios_of(speedup, fraction))


def _median(b: Mapping[str, Any]) -> float | None:
    stats = b.get("stats") or {}
    m = stats.get("median")
    return float(m) if _usable(m) else None
