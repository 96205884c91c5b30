"""The ``decode-step`` suites: a model's whole decode step of attention calls, against its peers.

What an engine does on every step: one `AttentionMetadata` built once and shared by all layers,
then per layer one `paged_attention` call over that layer's own K/V pools, all queued lazily,
and one ``mx.eval`` for the step. Per-call benchmarks time one call and wait for it; a step
amortizes the wait over the layers and shows whether the host (graph building, launches) or
the kernels set the pace.

As in a model, each layer's query is the layer before's output (`chain`), so a layer's kernels
cannot start before the last layer's are done. Independent layers would let MLX's CUDA graphs run
several layers' kernels at once (MLX links graph nodes by data only), one layer's tail overlapping
the next one's start, which no model's step allows and torch's one stream does not do
(docs/bench-h200-decode-step.md, twenty-eighth session).

- `StepShape`: a decode `Shape` plus ``layers``; its ``kv_bytes`` and ``flops`` are the whole
  step's, so GB/s, the ceiling and every ratio are per step;
- `StepCase`: the first layer's query, the shared block tables and metadata, and one pair of pools per layer
  (random, distinct per layer); contiguous ``[batch, kv_heads, context, head]`` K/V per layer
  for the peers, built on demand;
- the candidates (`resolve`): providers by name (``auto`` = the registry's choice),
  ``mlx_sdpa`` (MLX SDPA on contiguous K/V, every layer queued, one eval), ``torch_sdpa``
  (torch SDPA on contiguous K/V, every layer launched, one synchronize; GPU only),
  ``gather_sdpa`` (pages gathered with ``mx.take`` inside the step, then MLX SDPA), ``auto_compiled``
  (``auto`` with the whole step under ``mx.compile``: what a compiled step takes off the host) and
  ``ceiling`` (the K+V bytes of all layers read once at the bandwidth measured in the same
  run: `metal_attn.bench.peers.Ceiling`).

Memory on a GPU: the pools, the MLX contiguous copies and torch's copies live at once (about
three times the step's K+V bytes); MLX's buffer cache is emptied before torch allocates, and
torch's cache after it. The largest peer shape (b64 L8192, 18 layers) needs about 116 GB.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

import metal_attn
from metal_attn.bench import peers
from metal_attn.bench.candidates import Candidate, Prepared, ProviderCandidate, Skip, TimedCandidate, mlx_prepared
from metal_attn.bench.shapes import _RANDOM_PERIOD_ELEMENTS, DTYPES, Shape, build_case
from metal_attn.checks import int_at_least
from metal_attn.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class StepShape(Shape):
    """A decode step: ``layers`` `paged_attention` calls of one decode batch, one metadata for all.

    ``kv_bytes`` and ``flops`` count every layer (``layer_kv_bytes`` is one layer's), so the
    metrics of `metal_attn.bench.candidates` read per step.
    """

    layers: int = 32

    def __post_init__(self) -> None:
        int_at_least("StepShape.layers", self.layers)
        if self.q_len != 1 or self.mixed is not None:
            raise ValueError(f"StepShape: q_len={self.q_len}, mixed={self.mixed!r} (allowed: decode rows only, "
                             "q_len=1 and mixed=None)")
        super().__post_init__()

    def _auto_label(self) -> str:
        return "step" + super()._auto_label().removeprefix("decode") + f" x{self.layers}"

    @property
    def layer_kv_bytes(self) -> int:
        """K+V bytes one layer reads."""
        return super().kv_bytes

    @property
    def kv_bytes(self) -> int:
        """K+V bytes the whole step reads once: ``layers * layer_kv_bytes``."""
        return self.layers * self.layer_kv_bytes

    @property
    def flops(self) -> int:
        return self.layers * super().flops

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"layers": self.layers, "layer_kv_bytes": self.layer_kv_bytes}

    def memory_estimate(self) -> int:
        """Pools + MLX contiguous copies + torch's copies (3x the step's K+V), one layer's gather, slack."""
        return (3 * self.kv_bytes + 2 * self.layer_kv_bytes + 4 * _RANDOM_PERIOD_ELEMENTS * self.itemsize
                + (64 << 20))

    def build(self, *, seed: int = 0) -> StepCase:
        return build_step_case(self, seed=seed)


@dataclasses.dataclass(eq=False)
class StepCase:
    """The inputs of one decode step: the first layer's query, the metadata shared by the layers, pools
    per layer."""

    shape: StepShape
    q: mx.array  # [batch, num_heads, head_size], the first layer's (each further layer's: the last output)
    pools: list[tuple[mx.array, mx.array]]  # per layer (K, V): [num_blocks, block_size, kv_heads, head]
    block_tables: np.ndarray  # [batch, max_blocks] int32, shared by the layers
    metadata: AttentionMetadata
    scale: float
    _contiguous: list[tuple[mx.array, mx.array]] | None = dataclasses.field(default=None, repr=False)
    _query4: mx.array | None = dataclasses.field(default=None, repr=False)

    def tables(self) -> mx.array:
        """The block tables cut to the blocks the context needs."""
        nblk = -(-self.shape.context // self.shape.block_size)
        return mx.array(self.block_tables[:, :nblk])

    def gather(self, pool: mx.array, tables: mx.array) -> mx.array:
        """One layer's pages gathered to ``[batch, kv_heads, context, head]`` (lazy, not contiguous)."""
        s = self.shape
        pages = mx.take(pool, tables, axis=0)  # [batch, nblk, block_size, kv_heads, head]
        flat = pages.reshape(s.batch, -1, s.num_kv_heads, s.head_size)[:, : s.context]
        return flat.transpose(0, 2, 1, 3)

    def contiguous_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer, K and V as contiguous ``[batch, kv_heads, context, head]`` (built once, layer by layer)."""
        if self._contiguous is None:
            tables = self.tables()
            out = []
            for kp, vp in self.pools:
                k, v = mx.contiguous(self.gather(kp, tables)), mx.contiguous(self.gather(vp, tables))
                mx.eval(k, v)
                out.append((k, v))
            self._contiguous = out
        return self._contiguous

    def query4(self) -> mx.array:
        """The query as contiguous ``[batch, num_heads, 1, head_size]`` (built once)."""
        if self._query4 is None:
            self._query4 = mx.contiguous(self.q[:, :, None, :])
            mx.eval(self._query4)
        return self._query4

    def release(self) -> None:
        """Drop the peers' copies (the pools go with the case)."""
        self._contiguous = None
        self._query4 = None


def build_step_case(shape: StepShape, *, seed: int = 0) -> StepCase:
    """Random inputs for a step: `build_case`'s query, tables and metadata (and its pools as layer 0),
    then each further layer's pools drawn with MLX's generator (on the device), one layer at a time."""
    base = build_case(shape, seed=seed)
    dtype = DTYPES[shape.dtype][0]
    pools = [(base.k_pool, base.v_pool)]
    key = mx.random.key(seed)
    for _ in range(1, shape.layers):
        key, kk, kv = mx.random.split(key, 3)
        k = mx.random.uniform(-1.0, 1.0, base.k_pool.shape, dtype=dtype, key=kk)
        v = mx.random.uniform(-1.0, 1.0, base.v_pool.shape, dtype=dtype, key=kv)
        mx.eval(k, v)
        pools.append((k, v))
    return StepCase(shape, base.q, pools, base.block_tables, base.metadata, base.scale)


def _layer_rows(outs: list[mx.array]) -> np.ndarray:
    """Per-layer ``[batch, heads, head]`` outputs -> float32 ``[layers * batch, heads, head]``."""
    return np.array(mx.concatenate(outs, axis=0).astype(mx.float32))


def _need_step(case: Any) -> StepCase:
    if not isinstance(case, StepCase):
        raise Skip("skipped", [f"{type(case).__name__} is not a decode step (decode-step candidates need a "
                               "StepShape's inputs)"])
    return case


def chain(first: Any, layers: Sequence[Any], attend: Callable[[Any, Any], Any]) -> list[Any]:
    """Each layer's output, the first layer's query being ``first`` and each further layer's the output
    before it: ``attend(query, layer)`` per layer, in order."""
    outs = []
    query = first
    for layer in layers:
        query = attend(query, layer)
        outs.append(query)
    return outs


class StepProvider(ProviderCandidate):
    """A provider (``auto``: the registry's choice) on every layer, one metadata, one eval per step."""

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        forced, route = self.admit(case.shape)
        q, md, scale, pools = case.q, case.metadata, case.scale, case.pools

        def compute() -> list[mx.array]:
            return chain(q, pools, lambda x, kv: metal_attn.paged_attention(x, *kv, metadata=md, scale=scale,
                                                                            provider=forced))

        return mlx_prepared(compute, _layer_rows, f"{route}; {len(pools)} chained layers, one eval")


class StepCompiled(StepProvider):
    """The registry's choice on every layer, the whole step under ``mx.compile``.

    The bench's metadata and pools are fixed, so they are constants of the compiled graph and
    the step is traced once: what this measures is the most a compiled step can take off the
    host (Python graph building of every layer; MLX replays the traced graph), not an engine
    step, whose metadata changes every step (the engine's compiled steps trace with
    `AttentionMetadata.decode_bounds` instead: `metal_attn.mlx_lm.compiled`, docs/serving.md).
    """

    name = "auto_compiled"
    #: Not a route `auto` could take (so never the "fastest admitted provider" auto is held to); stored in
    #: baselines with the providers (`metal_attn.bench.baselines.TRACKED_KINDS`): the engine's path on CUDA.
    kind = "compiled"

    def __init__(self, name: str = "auto_compiled") -> None:
        super().__init__(name)

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        _, route = StepProvider("auto").admit(case.shape)
        q, pools = case.q, case.pools
        step = mx.compile(lambda: chain(q, pools, _auto_layer(case)))
        return mlx_prepared(step, _layer_rows, f"{route}; {len(pools)} chained layers under mx.compile, one eval")

    def route_after(self, prep: Prepared) -> str | None:
        return prep.route  # a replayed compiled graph dispatches nothing: the route is the traced one


def _auto_layer(case: Any) -> Callable[[mx.array, Any], mx.array]:
    """One layer of the compiled steps: the registry's choice over that layer's pools, the case's metadata."""
    md, scale = case.metadata, case.scale
    return lambda x, kv: metal_attn.paged_attention(x, *kv, metadata=md, scale=scale)


#: `StepStaged`'s segments: layers per compiled segment, in order, the last one taking every layer left.
#: Each is queued (``mx.async_eval``) as soon as it is built, each about as long as all before it: the
#: hope was that its host time would hide behind their GPU time. Measured, it did not (an H100,
#: docs/bench-h200-decode-step.md, thirty-seventh session).
STAGED_SEGMENTS = (1, 1, 2, 4, 8)


def staged_segments(layers: int, sizes: Sequence[int] = STAGED_SEGMENTS) -> list[range]:
    """``range(layers)`` cut into `STAGED_SEGMENTS`' consecutive runs (the last run takes the rest; empty
    runs dropped)."""
    cuts, start = [], 0
    for size in sizes:
        if start >= layers:
            break
        cuts.append(range(start, min(layers, start + size)))
        start += size
    if start < layers:
        cuts.append(range(start, layers))
    return cuts


class StepStaged(StepCompiled):
    """``auto_compiled`` cut into compiled segments of `STAGED_SEGMENTS` layers, each queued as soon as it is
    built, one wait per step (issue #17, the step boundary).

    A blocking compiled step leaves the GPU idle while the host builds all 32 layers' graph and encodes up
    to the first kernel (about 200-300 µs on an H100, thirty-sixth session); a segment of one layer starts
    the GPU after one layer's building, and each further segment is built while the ones before run."""

    name = "auto_staged"

    def __init__(self) -> None:
        super().__init__("auto_staged")

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        _, route = StepProvider("auto").admit(case.shape)
        pools, layer = case.pools, _auto_layer(case)

        def segment(layers: range) -> Callable[[mx.array], list[mx.array]]:
            return mx.compile(lambda x: chain(x, [pools[i] for i in layers], layer))

        cuts = staged_segments(len(pools))
        segments = [segment(layers) for layers in cuts]

        def launch() -> list[mx.array]:
            outs: list[mx.array] = []
            query = case.q
            for fn in segments:
                part = fn(query)
                mx.async_eval(part)
                outs.extend(part)
                query = part[-1]
            return outs

        def run() -> list[mx.array]:
            outs = launch()
            mx.eval(outs)
            return outs

        sizes = "+".join(str(len(c)) for c in cuts)
        return Prepared(run=run, launch=launch, to_rows=_layer_rows,
                        route=f"{route}; {len(pools)} chained layers in compiled segments of {sizes}, each queued "
                              "when built, one wait")


class StepMlxSdpa(TimedCandidate):
    """MLX SDPA on each layer's contiguous K/V, every layer queued, one eval per step."""

    name = "mlx_sdpa"
    kind = "peer"

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        kv, q, scale = case.contiguous_kv(), case.query4(), case.scale

        def compute() -> list[mx.array]:
            return chain(q, kv, lambda x, layer: mx.fast.scaled_dot_product_attention(x, *layer, scale=scale))

        return mlx_prepared(compute, peers.mlx_rows,
                            f"contiguous K/V + mx.fast SDPA; {len(kv)} chained layers, one eval")


class StepGatherSdpa(TimedCandidate):
    """The naive paged step: each layer gathers its pages (``mx.take``) then runs MLX SDPA; one eval."""

    name = "gather_sdpa"
    kind = "peer"

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        tables, q, scale, pools = case.tables(), case.query4(), case.scale, case.pools
        mx.eval(tables)

        def compute() -> list[mx.array]:
            return chain(q, pools, lambda x, kv: mx.fast.scaled_dot_product_attention(
                x, case.gather(kv[0], tables), case.gather(kv[1], tables), scale=scale))

        return mlx_prepared(compute, peers.mlx_rows,
                            f"mx.take pages + mx.fast SDPA; {len(pools)} chained layers, one eval")


class StepTorchSdpa(TimedCandidate):
    """torch SDPA on each layer's contiguous K/V on the GPU: every layer launched, one synchronize."""

    name = "torch_sdpa"
    kind = "peer"

    def prepare(self, case: Any) -> Prepared:
        case = _need_step(case)
        torch, reasons = peers.torch_reasons()
        if torch is None:
            raise Skip("unavailable", reasons)
        import torch.nn.functional as F

        s = case.shape
        dev = torch.device("cuda")
        gqa = s.num_heads != s.num_kv_heads
        native_gqa = not gqa or peers._torch_has_enable_gqa()
        group = s.num_heads // s.num_kv_heads
        kv = case.contiguous_kv()
        mx.clear_cache()  # MLX's cached free buffers back to the device before torch allocates
        held: list[tuple[Any, Any]] = []
        for k, v in kv:  # one layer at a time through the host
            tk, tv = peers._to_torch(k, torch, dev), peers._to_torch(v, torch, dev)
            if not native_gqa:
                tk, tv = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
            held.append((tk, tv))
        tq = peers._to_torch(case.query4(), torch, dev)
        extra = {"enable_gqa": True} if gqa and native_gqa else {}
        scale = case.scale
        torch.cuda.synchronize()

        def launch() -> list:
            return chain(tq, held, lambda x, kv: F.scaled_dot_product_attention(x, *kv, scale=scale, **extra))

        def run() -> list:
            outs = launch()
            torch.cuda.synchronize()
            return outs

        def to_rows(outs: list) -> np.ndarray:
            return torch.cat([o.float().reshape(s.batch, s.num_heads, s.head_size) for o in outs], dim=0).cpu().numpy()

        def close() -> None:
            held.clear()
            torch.cuda.empty_cache()

        how = " (enable_gqa)" if extra else " (K/V repeat_interleave)" if gqa else ""
        return Prepared(run=run, launch=launch, sync=torch.cuda.synchronize, to_rows=to_rows,
                        route=f"contiguous K/V + torch SDPA{how}; {len(held)} chained layers, one synchronize",
                        details={"torch_version": torch.__version__}, close=close)


#: Peers of a decode step by name; any other name is a provider.
STEP_PEERS: dict[str, type] = {"mlx_sdpa": StepMlxSdpa, "gather_sdpa": StepGatherSdpa, "torch_sdpa": StepTorchSdpa,
                               "ceiling": peers.Ceiling, "auto_compiled": StepCompiled, "auto_staged": StepStaged}


def resolve(names: Sequence[str]) -> list[Candidate]:
    """Decode-step candidates by name (deduplicated, in order): the peers of `STEP_PEERS`, anything else a
    provider (``auto``: the registry's choice)."""
    out: list[Candidate] = []
    for name in dict.fromkeys(n.strip() for n in names if n.strip()):
        out.append(STEP_PEERS[name]() if name in STEP_PEERS else StepProvider(name))
    return out


def step_shapes(shapes: Sequence[Shape], layers: dict[tuple[int, int], int] | None = None,
                default_layers: int = 32) -> tuple[StepShape, ...]:
    """Decode shapes as steps: ``layers[(batch, context)]`` layers where given, else ``default_layers``."""
    fields = ("batch", "num_heads", "num_kv_heads", "head_size", "context", "dtype", "block_size")
    return tuple(StepShape(**{f: getattr(s, f) for f in fields},
                           layers=(layers or {}).get((s.batch, s.context), default_layers)) for s in shapes)
