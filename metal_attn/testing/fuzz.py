"""Seeded random requests for fuzzing a provider (or the automatic choice) against the oracle.

`random_spec(seed, profile)` draws one `make_case` keyword set: geometry (heads, KV heads, head
size), page size and dtype; a batch of decode rows first, then verification and prefill chunks
(fresh prompts and continuations); lengths drawn near page and partition edges as often as at
random; shared prefix blocks; sinks, sliding window, softcap and scale; and in a share of the
cases NaN/Inf planted in q, K or V (at attended and at masked positions alike: the oracle says
which outputs that reaches). `make_case` fills unread slots and spare blocks with NaN V and huge
K, so a provider reading a position it must not shows.

Profiles say what is drawn (`PROFILES`): ``"cpu"`` (any multiple of 16 up to 256, and some other
head sizes, which only ``reference`` takes), ``"gpu"`` (the GPU kernels' head sizes and GQA-decode
geometries, and a few others). The same seed gives the same spec on every machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from metal_attn.constants import PARTITION_SIZE


@dataclasses.dataclass(frozen=True)
class Profile:
    """What `random_spec` draws from."""

    head_sizes: tuple[int, ...]
    #: (num_heads, num_kv_heads, head_size, page size) drawn whole in a share of the cases.
    geometries: tuple[tuple[int, int, int, int], ...]
    pages: tuple[int, ...] = (8, 16, 32, 64, 128)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    max_seqs: int = 6
    #: Longest sequence drawn (a few per hundred cases), and the usual bound.
    long_len: int = 2600
    usual_len: int = 700
    max_q_len: int = 96


PROFILES: dict[str, Profile] = {
    "cpu": Profile(head_sizes=(16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 8, 24, 40, 72, 100),
                   geometries=((32, 8, 128, 16), (16, 2, 128, 16), (24, 4, 256, 16))),
    "gpu": Profile(head_sizes=(64, 80, 96, 128, 256, 48),
                   geometries=((32, 8, 128, 16), (24, 4, 256, 16), (16, 2, 128, 16), (16, 2, 256, 16),
                               (16, 2, 256, 32)),
                   max_seqs=8, long_len=5000, usual_len=1200, max_q_len=160),
}

_NONFINITE = (float("nan"), float("inf"), float("-inf"))


def _length(rng: np.random.Generator, page: int, p: Profile) -> int:
    """A KV length: near a page or partition edge half the time, else uniform (rarely long)."""
    if rng.random() < 0.5:
        edge = int(rng.choice([page, 2 * page, PARTITION_SIZE, 2 * PARTITION_SIZE]))
        return max(1, edge + int(rng.integers(-1, 2)))
    top = p.long_len if rng.random() < 0.06 else p.usual_len
    return int(rng.integers(1, top + 1))


def random_spec(seed: int, profile: str = "cpu") -> dict[str, Any]:
    """One random request as `make_case` keyword arguments (``label`` names the seed)."""
    p = PROFILES.get(profile) if isinstance(profile, str) else None
    if p is None:
        raise ValueError(f"profile={profile!r} (allowed: {', '.join(map(repr, PROFILES))})")
    rng = np.random.default_rng([seed, 0xA77E])
    if rng.random() < 0.25:
        num_heads, num_kv_heads, head_size, page = (int(x) for x in p.geometries[rng.integers(len(p.geometries))])
    else:
        num_kv_heads = int(rng.choice([1, 2, 4]))
        num_heads = num_kv_heads * int(rng.choice([1, 2, 3, 4, 8]))
        head_size = int(rng.choice(p.head_sizes))
        page = int(rng.choice(p.pages))
    dtype = str(rng.choice(p.dtypes))

    # Decode rows first, then chunks: verification (a few rows on a longer context) and prefill
    # (a fresh prompt, or a continuation after earlier tokens).
    n_seqs = int(rng.integers(1, p.max_seqs + 1))
    n_decode = int(rng.integers(0, n_seqs + 1))
    verify_only = rng.random() < 0.15
    q_lens, seq_lens = [], []
    for i in range(n_seqs):
        if i < n_decode:
            q_lens.append(1)
            seq_lens.append(_length(rng, page, p))
            continue
        if verify_only:
            q = int(rng.integers(2, 9))
            n = q + _length(rng, page, p)
        else:
            q = int(rng.integers(2, p.max_q_len + 1))
            n = q if rng.random() < 0.4 else q + _length(rng, page, p)
        q_lens.append(q)
        seq_lens.append(n)
    if verify_only and n_decode < n_seqs:  # a verification batch: equal row counts
        q_lens[n_decode:] = [q_lens[n_decode]] * (n_seqs - n_decode)
        seq_lens[n_decode:] = [max(n, q_lens[n_decode] + 1) for n in seq_lens[n_decode:]]

    spec: dict[str, Any] = {
        "q_lens": q_lens, "seq_lens": seq_lens, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_size": head_size, "block_size": page, "dtype": dtype, "seed": seed,
    }
    if rng.random() < 0.25:
        spec["sinks"] = True
    if rng.random() < 0.3:
        spec["sliding_window"] = int(rng.choice([1, 3, page, int(rng.integers(1, 700))]))
    if rng.random() < 0.2:
        spec["softcap"] = float(rng.choice([1.0, 5.0, 30.0]))
    if rng.random() < 0.1:
        spec["scale"] = float(rng.uniform(0.02, 0.5))
    if rng.random() < 0.15:
        spec["shared_prefix_blocks"] = int(rng.integers(1, 4))
    if rng.random() < 0.05 and not spec.get("sinks"):  # (with a sink the outputs would underflow half precision)
        spec["score_bias"] = -60.0
    if rng.random() < 0.25:
        spec["poison"] = _poison(rng, q_lens, seq_lens, num_heads, num_kv_heads)
    spec["label"] = f"fuzz-{profile}-{seed}"
    return spec


def _poison(rng, q_lens, seq_lens, num_heads, num_kv_heads) -> list[tuple[str, int, int, int, float]]:
    """One to three non-finite values at random positions of real data (attended or not)."""
    out = []
    for _ in range(int(rng.integers(1, 4))):
        seq = int(rng.integers(len(q_lens)))
        value = float(rng.choice(_NONFINITE))
        what = str(rng.choice(["q", "k", "v"]))
        if what == "q":
            out.append(("q", seq, int(rng.integers(q_lens[seq])), int(rng.integers(num_heads)), value))
        else:
            # Half the time one of the last positions: past some chunk rows' causal end.
            n = seq_lens[seq]
            pos = n - 1 - int(rng.integers(min(n, 4))) if rng.random() < 0.5 else int(rng.integers(n))
            out.append((what, seq, pos, int(rng.integers(num_kv_heads)), value))
    return out


def random_specs(count: int, profile: str = "cpu", first_seed: int = 0) -> list[dict[str, Any]]:
    """``count`` specs with consecutive seeds."""
    return [random_spec(first_seed + i, profile) for i in range(count)]
