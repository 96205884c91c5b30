"""Rule-table overrides for GPU tests and sweeps (not for serving)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from unittest import mock

from metal_attn.settings import override_settings


@contextlib.contextmanager
def forced_mixed_threshold(value: int) -> Iterator[None]:
    """Patch the mixed-batch split threshold of the tiled prefill kernels (`gpu_common.decode_rows.mixed_split`,
    every backend) to ``value`` for the block: 0 sends every decode row of a mixed batch to the
    per-token kernel, a huge value keeps them in the tiles. Cached selections are dropped on entry
    and exit."""
    from metal_attn.plugins import get_registry
    from metal_attn.providers.gpu_common import decode_rows

    get_registry().forget_selections()
    try:
        with mock.patch.object(decode_rows, "MIXED_DECODE_MIN_CONTEXT",
                               dict.fromkeys(decode_rows.MIXED_DECODE_MIN_CONTEXT, value)):
            yield
    finally:
        get_registry().forget_selections()


@contextlib.contextmanager
def opened_sdpa_prefill_rule(backend: str | None = None) -> Iterator[None]:
    """``SDPA_PREFILL_RULES`` admitting every chunk, mixed or not, on ``backend`` (default: this
    machine's) for the block (to measure the route below its rule); a new dispatch epoch and no cached
    selections on entry and exit, so no plan or selection made under one rule serves the other."""
    from metal_attn import _epoch
    from metal_attn.device import current_device
    from metal_attn.plugins import get_registry
    from metal_attn.providers import sdpa_prefill as sp

    rules = dict(sp.SDPA_PREFILL_RULES)
    backend = backend or current_device().backend
    rules[backend] = dataclasses.replace(rules[backend], min_chunk_rows=1, min_chunk_pairs=0, mixed=())
    try:
        with mock.patch.object(sp, "SDPA_PREFILL_RULES", rules):
            _epoch.bump()
            get_registry().forget_selections()
            yield
    finally:
        _epoch.bump()
        get_registry().forget_selections()


def rule_opened_for(provider: str | None) -> contextlib.AbstractContextManager:
    """`opened_sdpa_prefill_rule` when ``provider`` is ``sdpa_prefill``, else nothing: for tests of a
    forced provider's numerics on batches its measured rule would leave to the tiles."""
    return opened_sdpa_prefill_rule() if provider == "sdpa_prefill" else contextlib.nullcontext()


#: The routes the GPU suites force: unsplit, the 512-token partitions of the occupancy gate, and the
#: smallest partitions `PARTITION_RULES` may take on CUDA.
PER_TOKEN_TEST_ROUTES = ("per_token_ps0", "per_token_ps512", "per_token_ps64")


def partition_size_of(route: str) -> int:
    """``per_token_psP`` -> ``P`` (0: unsplit)."""
    return int(route.removeprefix("per_token_ps"))


@contextlib.contextmanager
def forced_per_token_route(route: str) -> Iterator[None]:
    """Force classic's occupancy gate to ``route``: 4096 cores always split (given two 512-token
    partitions), at the route's partition size; for the unsplit route one core is not enough on
    CUDA, where the gate factor is 16 and a grid of 4 heads x 2 rows = 8 < 16 * 1 still splits,
    so the factor is set to 0 as well."""
    from metal_attn.providers.gpu_common import per_token

    psize = partition_size_of(route)
    factors = dict(per_token.SPLIT_GATE_FACTOR)
    if psize == 0:
        factors = dict.fromkeys(factors, 0)
    with (override_settings(gpu_cores=4096 if psize else 1, partition_size=psize),
          mock.patch.object(per_token, "SPLIT_GATE_FACTOR", factors)):
        yield


def expected_route(route: str, seq_lens: Sequence[int]) -> str:
    """The route a forced ``route`` gives a batch: unsplit when no sequence has two 512-token partitions."""
    return route if max(seq_lens) > 512 else "per_token_ps0"
