"""Greedy token identity against stock mlx-lm, with the near-tie rule.

Two correct attention implementations differ in the last bits, and a greedy choice
whose top-2 logit margin is below the dtype's tolerance may flip between them. The
rule: the tokens must be identical up to the first difference; there, the reference's
own log-probabilities must show a near-tie that our token is part of (its log-prob
within ``tol`` of the best); after it the two continuations are different texts and
are not compared. `NEAR_TIES` counts those events for the test report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

__all__ = ["NEAR_TIES", "GreedyReference", "assert_same_greedy", "reference_greedy"]

#: (label, position, margin) of every accepted near-tie in this process.
NEAR_TIES: list[tuple[str, int, float]] = []
#: Number of `assert_same_greedy` comparisons made (the denominator for the report).
COMPARISONS: list[str] = []


@dataclasses.dataclass(frozen=True)
class GreedyReference:
    tokens: list[int]
    #: ``[vocab]`` log-probabilities of each step (host float32 arrays).
    logprobs: list[Any]


def reference_greedy(model: Any, prompt: Sequence[int], max_tokens: int,
                     stop_ids: frozenset[int] = frozenset()) -> GreedyReference:
    """Stock ``mlx_lm.generate.generate_step`` (greedy, mlx-lm's own KV cache), single stream."""
    import numpy as np
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for (tok, lp), _ in zip(generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(int(tok))
        logprobs.append(np.array(lp.astype(mx.float32)))
        if tok in stop_ids:
            break
    return GreedyReference(tokens, logprobs)


def assert_same_greedy(ours: Sequence[int], ref: GreedyReference, tol: float, label: str = "") -> int:
    """Raise `AssertionError` unless ``ours`` equals ``ref.tokens`` under the near-tie rule.

    Returns the number of positions compared."""
    COMPARISONS.append(label)
    ours = list(ours)
    for k, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a == b:
            continue
        lp = ref.logprobs[k]
        best = float(lp.max())
        margin = best - float(sorted(lp)[-2])
        ours_lp = float(lp[a])
        assert margin < tol and best - ours_lp < tol, (
            f"{label}: token {k} differs: ours {a} (log-prob {ours_lp:.6f}), mlx-lm {b} (log-prob {best:.6f}); "
            f"mlx-lm's top-2 margin there is {margin:.3g}, not a near-tie (tolerance {tol:g}). "
            f"ours={ours[: k + 1]} ref={ref.tokens[: k + 1]}"
        )
        NEAR_TIES.append((label, k, margin))
        return k
    assert len(ours) == len(ref.tokens), (
        f"{label}: {len(ours)} tokens, mlx-lm gave {len(ref.tokens)}: {ours} vs {ref.tokens}"
    )
    return len(ours)
