"""`metal-attn demo`: a small serving loop through the paged path, checked against dense MLX.

Three sequences go through a few scheduler steps on a `PagedKVCache` with
several layers: a prompt prefill (the longest prompt split into chunks), a
mixed step (decode rows plus the prompt's continuation chunk), then decode
steps. Every layer of every step writes its new K/V with `reshape_and_cache`,
runs `paged_attention` with automatic provider selection, and is compared with
a dense computation: the sequence's contiguous K/V and
`mx.fast.scaled_dot_product_attention` with the causal mask of that sequence,
in float32. Nothing is downloaded; the data are seeded random numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from metal_attn import diagnostics
from metal_attn.api import MX_DTYPES, paged_attention
from metal_attn.cache import PagedKVCache
from metal_attn.checks import is_int
from metal_attn.device import current_device, memory_shortfall
from metal_attn.errors import InvalidInputError
from metal_attn.metadata import AttentionMetadata
from metal_attn.testing.conformance import rel_l2

#: Per dtype: (atol, rtol) of the element-wise check and the bound on the relative L2 error.
#: The relative L2 bound catches wrong-but-small outputs (a zero-filled output has error 1).
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (1e-4, 1e-4, 1e-4),
    "float16": (3e-3, 3e-3, 2e-3),
    "bfloat16": (2e-2, 2e-2, 1.6e-2),
}



@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. ``steps`` counts scheduler steps: prefill, mixed, then decodes."""

    dtype: str = "float16"
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    num_layers: int = 2
    steps: int = 5
    seed: int = 0
    repeats: int = 5
    prompt_lens: tuple[int, ...] = (37, 90, 150)
    chunk_size: int = 96
    provider: str | None = None

    def validate(self) -> None:
        """Raise `InvalidInputError` naming the first bad option, its value and what is allowed."""
        if self.dtype not in MX_DTYPES:
            raise InvalidInputError(f"dtype={self.dtype!r} (allowed: {', '.join(MX_DTYPES)})")
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "num_layers", "repeats", "chunk_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InvalidInputError(f"{name}={value!r} (allowed: an int >= 1)")
        if not is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise InvalidInputError(f"seed={self.seed!r} (allowed: an int from 0 to 2**64 - 1, MLX's seed range)")
        if self.num_heads % self.num_kv_heads:
            raise InvalidInputError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} "
                "(GQA needs whole groups)"
            )
        if self.block_size % 8:
            raise InvalidInputError(f"block_size={self.block_size} (allowed: a multiple of 8, e.g. 8, 16, 32)")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise InvalidInputError(f"steps={self.steps!r} (allowed: an int >= 2: one prefill step, one mixed step, "
                                    "then decode steps)")
        if not self.prompt_lens or any(n < 2 for n in self.prompt_lens):
            raise InvalidInputError(f"prompt_lens={self.prompt_lens} (allowed: one or more ints >= 2)")
        if max(self.prompt_lens) <= self.chunk_size:
            raise InvalidInputError(
                f"chunk_size={self.chunk_size} must be below the longest prompt ({max(self.prompt_lens)}) "
                "so that one prompt needs a continuation chunk"
            )
        _check_working_set(self, self.batches)

    @functools.cached_property
    def batches(self) -> list[list[tuple[int, int]]]:
        """`schedule` of this config, computed once: `validate` checks its memory, `run_demo` runs it."""
        return schedule(self)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One scheduler step: what ran, how fast, how close to dense attention."""

    step: int
    phase: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    providers: tuple[str, ...]
    routes: tuple[str, ...]
    partition_sizes: tuple[int, ...]
    time_ms_median: float
    max_abs_error: float
    rel_l2_error: float
    checks: int
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    def describe_batch(self) -> str:
        dec = sum(1 for q in self.q_lens if q == 1)
        chunks = [q for q in self.q_lens if q > 1]
        parts = []
        if dec:
            parts.append(f"{dec} decode")
        if chunks:
            parts.append(f"{len(chunks)} chunk{'s' if len(chunks) > 1 else ''} ({'+'.join(map(str, chunks))} tok)")
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ok": self.ok}


@dataclasses.dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    device: str
    steps: tuple[StepResult, ...]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def checks(self) -> int:
        return sum(s.checks for s in self.steps)

    @property
    def failures(self) -> list[str]:
        return [f for s in self.steps for f in s.failures]

    def to_dict(self) -> dict[str, Any]:
        atol, rtol, rel_l2 = TOLERANCES[self.config.dtype]
        return {
            "ok": self.ok,
            "config": dataclasses.asdict(self.config),
            "device": self.device,
            "tolerance": {"atol": atol, "rtol": rtol, "rel_l2": rel_l2},
            "checks": {"total": self.checks, "passed": self.checks - len(self.failures), "failed": len(self.failures)},
            "failures": self.failures,
            "steps": [s.to_dict() for s in self.steps],
            "elapsed_s": round(self.elapsed_s, 3),
        }


def schedule(cfg: DemoConfig) -> list[list[tuple[int, int]]]:
    """The batches of every step as ``[(seq_id, new_tokens), ...]``, decode rows first.

    Step 0 prefills every prompt (prompts longer than ``chunk_size`` only their
    first chunk); each later step decodes the finished prompts and runs the
    next chunk of the unfinished ones.
    """
    done = [0] * len(cfg.prompt_lens)
    steps = []
    for _ in range(cfg.steps):
        decodes, chunks = [], []
        for i, n in enumerate(cfg.prompt_lens):
            if done[i] >= n:
                decodes.append((i, 1))
                done[i] += 1
            else:
                take = min(cfg.chunk_size, n - done[i])
                chunks.append((i, take))
                done[i] += take
        steps.append(decodes + chunks)
    return steps


def working_set_bytes(cfg: DemoConfig, batches: list[list[tuple[int, int]]]) -> int:
    """The most memory one step of the demo holds besides the pools, estimated from above: the step's
    new K/V, queries and outputs in ``cfg.dtype`` plus their float32 copies for the dense check, and the
    dense check's float32 scores and mask for its largest sequence (MLX's CPU SDPA materialises them)."""
    item = MX_DTYPES[cfg.dtype].size
    lens = [0] * len(cfg.prompt_lens)
    most = 0
    for batch in batches:
        n_tok = sum(n for _, n in batch)
        rows = n_tok * cfg.head_size * (2 * cfg.num_kv_heads * item + cfg.num_heads * (2 * item + 8))
        scores = 0
        for seq, n in batch:
            lens[seq] += n
            scores = max(scores, n * lens[seq] * (cfg.num_heads * 8 + 1))
        most = max(most, rows + scores)
    return most


def _check_working_set(cfg: DemoConfig, batches: list[list[tuple[int, int]]]) -> None:
    """Refuse a demo whose steps need more memory than there is, before allocating anything (MLX's CPU
    backend crashes the process on an allocation the machine cannot back)."""
    need = working_set_bytes(cfg, batches)
    short = memory_shortfall(need)
    if short:
        raise InvalidInputError(
            f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, head_size={cfg.head_size} with "
            f"prompt_lens={list(cfg.prompt_lens)}: one step of the demo needs about {need / 2**30:.2f} GiB (queries, "
            f"outputs and the dense check's scores), {short} (allowed: fewer heads, a smaller head size or shorter "
            "prompts)")


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Causal attention of one sequence from contiguous K/V, in float32.

    ``q``: ``[q_len, H, D]`` (the last ``q_len`` positions of the sequence);
    ``k``/``v``: ``[seq_len, KVH, D]``. Row ``i`` sees positions ``<= seq_len - q_len + i``.
    """
    q_len, seq_len = q.shape[0], k.shape[0]
    rows = mx.arange(q_len)[:, None] + (seq_len - q_len)
    mask = mx.arange(seq_len)[None, :] <= rows
    out = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32).transpose(1, 0, 2)[None],
        k.astype(mx.float32).transpose(1, 0, 2)[None],
        v.astype(mx.float32).transpose(1, 0, 2)[None],
        scale=scale,
        mask=mask,
    )
    return out[0].transpose(1, 0, 2)


def compare(out: mx.array, ref: mx.array, dtype: str) -> tuple[float, float, bool]:
    """Max absolute error, relative L2 error, and whether both are within the dtype's tolerance."""
    atol, rtol, rel_l2_max = TOLERANCES[dtype]
    o = np.array(out.astype(mx.float32), dtype=np.float64)
    r = np.array(ref, dtype=np.float64)
    diff = np.abs(o - r)
    max_err = float(diff.max())
    rel = rel_l2(o, r)
    within = bool(np.all(diff <= atol + rtol * np.abs(r))) and rel <= rel_l2_max
    return max_err, rel, within and np.isfinite(o).all()


def _worst(a: float, b: float) -> float:
    """The larger error, NaN winning (`max` keeps its first argument when the second is NaN, so an all-NaN
    output read as error 0)."""
    return b if math.isnan(b) or b > a else a


def _median_ms(fn: Callable[[], mx.array], repeats: int) -> float:
    """Median wall time of ``mx.eval(fn())`` in milliseconds (the caller has warmed it up)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_demo(cfg: DemoConfig, *, on_step: Callable[[StepResult], None] | None = None) -> DemoResult:
    """Run the demo; every step's outputs are checked (see `StepResult.failures`)."""
    cfg.validate()
    t_start = time.perf_counter()
    dt = MX_DTYPES[cfg.dtype]
    mx.random.seed(cfg.seed)
    batches = cfg.batches
    final_lens = [0] * len(cfg.prompt_lens)
    for batch in batches:
        for seq, n in batch:
            final_lens[seq] += n
    num_blocks = sum(-(-n // cfg.block_size) for n in final_lens) + 4
    cache = PagedKVCache(cfg.num_layers, num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size, dt)
    for seq in range(len(cfg.prompt_lens)):
        cache.add_sequence(seq)
    # Contiguous copies of what was written, per layer and sequence (the dense side of the check).
    dense_k: list[list[list[mx.array]]] = [[[] for _ in cfg.prompt_lens] for _ in range(cfg.num_layers)]
    dense_v: list[list[list[mx.array]]] = [[[] for _ in cfg.prompt_lens] for _ in range(cfg.num_layers)]
    scale = cfg.head_size**-0.5
    kv_shape = (cfg.num_kv_heads, cfg.head_size)
    results = []
    for step, batch in enumerate(batches):
        plan = cache.prepare_step(batch)
        md = plan.metadata
        n_tok = plan.num_tokens
        max_err = rel_err = 0.0
        failures: list[str] = []
        records = []
        samples = []
        for layer in range(cfg.num_layers):
            k_new = mx.random.normal((n_tok, *kv_shape)).astype(dt)
            v_new = mx.random.normal((n_tok, *kv_shape)).astype(dt)
            q = mx.random.normal((n_tok, cfg.num_heads, cfg.head_size)).astype(dt)
            mx.eval(k_new, v_new, q)
            cache.write(layer, k_new, v_new, plan.slot_mapping)
            row = 0
            for seq, n in batch:
                dense_k[layer][seq].append(k_new[row : row + n])
                dense_v[layer][seq].append(v_new[row : row + n])
                row += n

            def call(layer: int = layer, q: mx.array = q, md: AttentionMetadata = md) -> mx.array:
                k_pool, v_pool = cache.pools(layer)
                return paged_attention(q, k_pool, v_pool, metadata=md, provider=cfg.provider)

            out = call()
            mx.eval(out)  # the first call is the warm-up (selection, kernel build)
            records.append(diagnostics.last_dispatch())
            refs, row = [], 0
            for seq, n in batch:
                k_seq = mx.concatenate(dense_k[layer][seq], axis=0)
                v_seq = mx.concatenate(dense_v[layer][seq], axis=0)
                refs.append(dense_attention(q[row : row + n], k_seq, v_seq, scale))
                row += n
            ref = mx.concatenate(refs, axis=0)
            if out.shape != ref.shape:  # checked by the contract on a selection's first call only
                rec = records[-1]
                failures.append(f"step {step} layer {layer}: {rec.provider}/{rec.route} returned shape "
                                f"{tuple(out.shape)} (expected {tuple(ref.shape)})" if rec is not None else
                                f"step {step} layer {layer}: output shape {tuple(out.shape)} "
                                f"(expected {tuple(ref.shape)})")
                samples.append(_median_ms(call, cfg.repeats))
                continue
            err, rel, within = compare(out, ref, cfg.dtype)
            max_err, rel_err = _worst(max_err, err), _worst(rel_err, rel)
            if not within:
                atol, rtol, rel_l2 = TOLERANCES[cfg.dtype]
                failures.append(
                    f"step {step} layer {layer}: max_abs_error={err:.3g}, rel_l2_error={rel:.3g} "
                    f"(allowed for {cfg.dtype}: |err| <= {atol:g} + {rtol:g}*|ref| and rel_l2 <= {rel_l2:g})"
                )
            samples.append(_median_ms(call, cfg.repeats))
            del out
        result = StepResult(
            step=step,
            phase=md.phase.value,
            q_lens=plan.q_lens,
            seq_lens=plan.seq_lens,
            providers=_unique(r.provider for r in records),
            routes=_unique(r.route for r in records),
            partition_sizes=_unique(r.partition_size for r in records),
            time_ms_median=statistics.median(samples),
            max_abs_error=max_err,
            rel_l2_error=rel_err,
            checks=cfg.num_layers,
            failures=tuple(failures),
        )
        results.append(result)
        if on_step is not None:
            on_step(result)
    return DemoResult(cfg, current_device().describe(), tuple(results), time.perf_counter() - t_start)


def _unique(values: Any) -> tuple:
    out: list = []
    for v in values:
        if v not in out:
            out.append(v)
    return tuple(out)

