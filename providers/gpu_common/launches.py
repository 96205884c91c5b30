"""What every GPU provider's launches go through: availability, zero buffers and parameter packing,
launch descriptors (built once per metadata and shared by a step's layers), and eager compilation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import numpy as np

from metal_attn import kernels
from metal_attn.constants import LOG2E

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.device import DeviceInfo
    from metal_attn.metadata import AttentionMetadata
    from metal_attn.request import AttentionRequest

# -- availability ----------------------------------------------------------------------------------


def availability_reasons(device: DeviceInfo) -> list[str]:
    """Why the GPU kernels cannot run on ``device`` (a hypothetical device is taken at its word)."""
    if device.hypothetical:
        return []
    if not mx.is_available(mx.gpu):
        return [f"backend={device.backend}: MLX has no usable GPU here"]
    if device.backend == "metal" and not mx.metal.is_available():
        return ["backend=metal: this MLX build has no Metal backend"]
    if device.backend == "cuda" and not mx.cuda.is_available():
        return ["backend=cuda: this MLX build has no CUDA backend"]
    return []


# -- zero buffers, scratch and parameter packing -----------------------------------------------------


@functools.lru_cache(maxsize=64)
def zeros_f32(n: int) -> mx.array:
    """``n`` float32 zeros (the sink logits of a call without sinks), built once per ``n``."""
    return kernels.param_array((0.0,) * n, "float32")


@functools.lru_cache(maxsize=8)
def placeholder(dtype: mx.Dtype) -> mx.array:
    """One element of ``dtype`` for a kernel input a launch does not read (so the kernel's signature,
    and its compiled specialization, stay those of the launches that do), built once per dtype."""
    out = mx.zeros((1,), dtype)
    mx.eval(out)
    return out


def sink_logits(sinks: mx.array | None, num_heads: int) -> mx.array:
    """The ``sinks`` input of a kernel: the sink logits given, else `zeros_f32` (the kernel's
    ``use_sinks`` parameter says which)."""
    return sinks if sinks is not None else zeros_f32(num_heads)


def pack_int32(values: tuple[int, ...]) -> mx.array:
    """A kernel's integer parameters as one int32 array, built once per distinct tuple
    (`metal_attn.kernels.param_array`)."""
    return kernels.param_array(values, "int32")


def pack_scale(scale: float, softcap: float | None) -> mx.array:
    """The float parameters ``(score scale, softcap)`` of the kernels that take ``fparams``: the scale
    in log2 space (times `LOG2E`, for ``exp2``) unless a softcap applies (the kernel scales before the
    ``tanh``, then converts), and the softcap (0: none)."""
    return kernels.param_array((scale if softcap else scale * LOG2E, float(softcap or 0.0)), "float32")


def split_scratch(rows: int, num_heads: int, max_parts: int, head_size: int) -> dict[str, list]:
    """The partials of the split-KV contract as ``mx.fast`` output arguments (``output_shapes`` and
    ``output_dtypes``): ``max_logits`` and ``exp_sums`` ``[rows, num_heads, max_parts]`` and
    ``tmp_out`` ``[rows, num_heads, max_parts, head_size]``, all float32 (their bytes:
    `metal_attn.request.split_scratch_bytes`)."""
    return {"output_shapes": [(rows, num_heads, max_parts), (rows, num_heads, max_parts),
                              (rows, num_heads, max_parts, head_size)],
            "output_dtypes": [mx.float32, mx.float32, mx.float32]}


# -- launch descriptors ------------------------------------------------------------------------------

#: Most launch descriptors one metadata keeps (a step needs one per kind of layer).
MAX_LAUNCHES_PER_METADATA = 64


@dataclasses.dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One ``mx.fast`` kernel call without its per-call arrays: the kernel object and every other
    keyword argument (template, grid, threadgroup, output shapes and dtypes), built once."""

    kernel: Any
    kwargs: dict[str, Any]

    def __call__(self, inputs: list[mx.array]) -> list[mx.array]:
        return self.kernel(inputs=inputs, **self.kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainLaunch:
    """Launches of our kernels as one MLX operation on CUDA (a `metal_attn.cuda_ops.chain`), called
    like a `KernelLaunch`: the inputs in order, the outputs back."""

    chain: Any

    def __call__(self, inputs: list[mx.array]) -> list[mx.array]:
        return self.chain(inputs)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainPart:
    """Launches of our kernels that run as a CUDA chain of their own (`build`) or inside another chain
    (`launches_at`). Buffer indices are the part's own, numbered as `metal_attn.cuda_ops.chain` numbers
    a chain's buffers: its inputs, then its outputs, then its scratch. ``input_shapes``: what a chain of
    its own checks each call against (empty: no check); ``state``: inputs the launches update in place."""

    name: str
    input_dtypes: tuple[Any, ...]
    outputs: tuple[tuple[tuple[int, ...], Any], ...]
    scratch: tuple[tuple[tuple[int, ...], Any], ...]
    launches: tuple[tuple[int, tuple[int, int, int], tuple[int, int, int], tuple[int, ...], int], ...]
    input_shapes: tuple[tuple[int, ...], ...] = ()
    state: tuple[int, ...] = ()

    def build(self, **options: Any) -> Any:
        """The part as a chain of its own (``options``: `metal_attn.cuda_ops.chain`'s keywords)."""
        from metal_attn import cuda_ops

        return cuda_ops.chain(self.name, self.input_dtypes, self.outputs, self.scratch, self.launches,
                              self.input_shapes, self.state, **options)

    def launches_at(self, inputs: Sequence[int], outputs: Sequence[int],
                    scratch: Sequence[int]) -> list[tuple[int, tuple[int, int, int], tuple[int, int, int], list[int],
                                                          int]]:
        """The launches inside a host chain, each buffer index replaced by its place there: the part's
        input ``i`` at ``inputs[i]``, output ``j`` at ``outputs[j]``, scratch buffer ``k`` at ``scratch[k]``."""
        if (len(inputs), len(outputs), len(scratch)) != (len(self.input_dtypes), len(self.outputs), len(self.scratch)):
            raise ValueError(f"ChainPart {self.name}: places for {len(inputs)} inputs, {len(outputs)} outputs and "
                             f"{len(scratch)} scratch buffers (it has {len(self.input_dtypes)}, {len(self.outputs)} "
                             f"and {len(self.scratch)})")
        where = [*inputs, *outputs, *scratch]
        return [(fn, grid, block, [where[a] for a in args], reads) for fn, grid, block, args, reads in self.launches]


def kernel_launch(kernel: Any, *, template: list, grid: tuple[int, ...], threadgroup: tuple[int, ...],
                  output_shapes: list, output_dtypes: list) -> KernelLaunch:
    """A `KernelLaunch` of ``kernel`` with these arguments."""
    return KernelLaunch(kernel, {"template": template, "grid": grid, "threadgroup": threadgroup,
                                 "output_shapes": output_shapes, "output_dtypes": output_dtypes})


def cuda_chains_enabled() -> bool:
    """Whether CUDA launches run as chains, one MLX operation each (`metal_attn.cuda_ops.enabled`:
    the module is built and ``METAL_ATTN_CUDA_CHAINS`` is on)."""
    from metal_attn import cuda_ops

    return cuda_ops.enabled()


def cached_launch(md: AttentionMetadata, key: tuple, build: Callable[[], Any]) -> Any:
    """The launch descriptor ``key`` of the batch ``md``, from ``build()`` on first use.

    A descriptor holds what a launch derives from its plan, the batch and the call's shapes and
    constants (kernel objects, templates, grids, output shapes, parameter arrays). It lives on the
    metadata (``AttentionMetadata._launches``), so the layers of a step share it, it goes with the
    step, and another metadata (other lengths or tables) builds its own. ``key`` must hold every
    value besides ``md`` the descriptor depends on, led by the dispatch epoch
    (`metal_attn._epoch.current`: settings and kernel sources change it).
    """
    cache = md._launches
    got = cache.get(key)
    if got is None:
        if len(cache) >= MAX_LAUNCHES_PER_METADATA:
            cache.clear()
        got = cache[key] = build()
    return got


# -- when a chain starts an idle GPU -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IdleCommitRule:
    """Which CUDA chains launch MLX's encoded graph when they find the GPU idle
    (``_cuda_ops.Chain(commit_when_idle=True)``): per-token chains that are a whole call (not a mixed
    batch's decode rows, which more work follows in the same call) and read at least ``min_kv_bytes`` of
    K/V, so that the GPU stays busy with the chain while the host goes on encoding; and the
    measurement behind it."""

    min_kv_bytes: int
    evidence: str


#: The rule (data; ``METAL_ATTN_CUDA_COMMIT_WHEN_IDLE`` overrides it for A/B runs). Chains are CUDA only.
IDLE_COMMIT_RULE = IdleCommitRule(
    64 << 20,
    "H100, MLX 0.32.4, bf16 (docs/cuda-ops.md, 'Starting an idle GPU', thirty-fourth session). By this rule, the "
    "32-layer decode-step suite's compiled step ran at 0.98-1.21x the speed with it off on the six shapes that fit "
    "(134-537 MB of K/V a layer), 1.12-1.21x on b1 L32768 and b8 L4096. With every chain asking, the generate "
    "suite's engine at 8 requests (about 18 MB a layer) made 13-45% fewer tokens a second, host-bound with about "
    "2,100 extra graph launches; at 1 request (2 MB) it stayed within the runs' spread. The bound sits between "
    "the two; no call between 18 and 134 MB was measured. A mixed batch's decode rows never ask: more work "
    "follows them in the same call, and asking on them (134 MB in two of the prefill-gpu suite's mixed batches) "
    "read 0.86-1.08x the setting off, inside those batches' spread (0.92-1.36x between two runs of the same "
    "code).")


def commit_when_idle(kv_bytes: int, whole_call: bool, settings: Any) -> bool:
    """Whether a per-token chain reading ``kv_bytes`` of K/V launches MLX's encoded graph when it finds the
    GPU idle: ``cuda_commit_when_idle`` when set, else `IDLE_COMMIT_RULE` (``whole_call``: the chain is the
    call's only work, not a mixed batch's decode rows)."""
    if settings.cuda_commit_when_idle is not None:
        return bool(settings.cuda_commit_when_idle)
    return whole_call and kv_bytes >= IDLE_COMMIT_RULE.min_kv_bytes


def kv_bytes_read(seq_lens: Sequence[int], window: int | None, num_kv_heads: int, head_size: int,
                  itemsize: int) -> int:
    """The K and V bytes a per-token call reads over sequences of ``seq_lens`` tokens (a sliding
    ``window`` caps each sequence's): what `commit_when_idle` weighs."""
    cap = window or max(seq_lens, default=0)
    return 2 * sum(min(int(n), cap) for n in seq_lens) * num_kv_heads * head_size * itemsize


def idle_commit_note(request: AttentionRequest, whole_call: bool, settings: Any) -> str:
    """``explain``'s line for `commit_when_idle` on a per-token plan (CUDA chains only). The call decides
    from its metadata's exact lengths; a request keeps them only as whole partitions (`length_plan`), so
    the note gives the bytes as a range and says when the range straddles the bound."""
    head = "idle-GPU launch (CUDA chains)"
    if settings.cuda_commit_when_idle is not None:
        on = bool(settings.cuda_commit_when_idle)
        return f"{head}: {'every' if on else 'no'} per-token chain (METAL_ATTN_CUDA_COMMIT_WHEN_IDLE={int(on)})"
    if not whole_call:
        return f"{head}: no (a mixed batch's decode rows: the call's prefill work follows them)"
    token = 2 * request.num_kv_heads * request.head_size * getattr(mx, request.cache_dtype).size
    longest = min(request.max_seq_len, request.sliding_window or request.max_seq_len)
    low, high = longest, request.num_seqs * longest  # the longest sequence alone; every one as long
    if request.length_plan and request.sliding_window is None:
        size, full = min(request.length_plan)  # whole partitions of the smallest size, over the batch
        low = max(low, size * full)
        high = min(high, size * full + request.num_seqs * (size - 1))
    bound = IDLE_COMMIT_RULE.min_kv_bytes
    mib = f"{low * token / 2**20:.1f}" + ("" if high == low else f"-{high * token / 2**20:.1f}")
    verdict = ("asks" if low * token >= bound else "does not ask" if high * token < bound
               else "depends on the exact lengths")
    return f"{head}: reads {mib} MiB of K/V, IDLE_COMMIT_RULE.min_kv_bytes={bound / 2**20:g} MiB -> {verdict}"


# -- eager compilation (Provider.prepare) ------------------------------------------------------------


class TinyBatch(NamedTuple):
    """A one-sequence batch of zeros for a compile launch (``cache`` serves as both pools)."""

    q: mx.array
    cache: mx.array
    metadata: AttentionMetadata


def tiny_batch(dtype: str, head_size: int, block_size: int, *, seq_len: int = 1, q_rows: int = 1,
               num_heads: int = 1, num_kv_heads: int = 1) -> TinyBatch:
    """One sequence of ``seq_len`` tokens (its pages ``0..``) whose last ``q_rows`` are queries:
    ``q`` ``[q_rows, num_heads, head_size]`` and a pool of exactly those pages, all zeros."""
    from metal_attn.metadata import AttentionMetadata

    mdt = getattr(mx, dtype)
    pages = -(-seq_len // block_size)
    md = AttentionMetadata.build(np.arange(pages, dtype=np.int32)[None, :], [seq_len], [0, q_rows], validate=False)
    return TinyBatch(mx.zeros((q_rows, num_heads, head_size), mdt),
                     mx.zeros((pages, block_size, num_kv_heads, head_size), mdt), md)


def compile_eagerly(device: DeviceInfo, what: str, launch: Callable[[TinyBatch], Any], *, dtype: str,
                    head_size: int, block_size: int, seq_len: int = 1, q_rows: int = 1, num_heads: int = 1,
                    num_kv_heads: int = 1) -> None:
    """A provider's ``prepare``: evaluate ``launch`` over a `tiny_batch` now, so that a compile
    failure raises `KernelCompileError` (named by ``what``) while a fallback is still possible.
    Skipped for hypothetical devices (nothing runs there)."""
    if device.hypothetical:
        return
    batch = tiny_batch(dtype, head_size, block_size, seq_len=seq_len, q_rows=q_rows, num_heads=num_heads,
                       num_kv_heads=num_kv_heads)
    kernels.compile_now(lambda: launch(batch), what)
