"""Named benchmark suites, as data: shapes, default candidates, warm-up and iterations.

GPU suites use the shapes of the peer table in KERNELS.md ("Peer figures
measured here"), so a run can be read next to those figures; CPU suites use
the geometry of KERNELS.md's "CPU facts". ``smoke`` is tiny and runs anywhere.
``decode-step`` and ``decode-step-cpu`` time whole decode steps (`metal_attn.bench.decode_step`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence

from metal_attn.bench import decode_step, peers
from metal_attn.bench.candidates import Candidate
from metal_attn.bench.shapes import Rows, Shape
from metal_attn.constants import GQA_DECODE_GEOMETRIES


@dataclasses.dataclass(frozen=True)
class Suite:
    """A named set of shapes and the candidates measured on them by default."""

    name: str
    description: str
    target: str  # "gpu", "cpu" or "any": where the suite is meant to run
    shapes: tuple[Shape, ...]
    candidates: tuple[str, ...]
    warmup: int
    iters: int
    #: How long a run with the default candidates took, and where (for ``--help`` and ``--list``).
    runtime: str = ""
    #: Candidate names -> candidates measurable on this suite's shapes.
    resolve: Callable[[Sequence[str]], list[Candidate]] = peers.resolve

    def select(self, patterns: list[str] | None) -> tuple[Shape, ...]:
        """Shapes whose label matches any pattern (a substring, or a glob with ``*``/``?``; case-insensitive)."""
        if not patterns:
            return self.shapes

        def hit(label: str, pat: str) -> bool:
            label, pat = label.lower(), pat.lower()
            return fnmatch.fnmatchcase(label, pat) if any(c in pat for c in "*?[") else pat in label

        return tuple(s for s in self.shapes if any(hit(s.label, p) for p in patterns))


def _decode(batch: int, heads: int, kv_heads: int, head: int, context: int, dtype: str = "bfloat16") -> Shape:
    return Shape(batch, heads, kv_heads, head, context, dtype)


#: KERNELS.md peer table: (batch, q heads, kv heads, head, context), bf16, block 16.
PEER_TABLE_SHAPES: tuple[Shape, ...] = tuple(
    _decode(*t)
    for t in (
        (1, 32, 8, 128, 32768),
        (8, 32, 8, 128, 4096),
        (32, 32, 8, 128, 4096),
        (64, 32, 8, 128, 8192),
        (8, 32, 8, 128, 32768),
        (1, 24, 4, 256, 65536),
        (16, 16, 2, 128, 16384),
        (128, 32, 8, 128, 1024),
    )
)

#: Geometries (q heads, kv heads, head size) the GQA decode kernel admits at block size 16.
GQA_GEOMETRIES: frozenset[tuple[int, int, int]] = frozenset(
    g[:3] for table in GQA_DECODE_GEOMETRIES.values() for g in table if g[3] == 16)

_MIXED = (
    Shape.mix((Rows(8, 1, 4096), Rows(1, 512, 2048)), 32, 8, 128),
    Shape.mix((Rows(32, 1, 1024), Rows(1, 256, 1024), Rows(1, 256, 2048)), 32, 8, 128),
)

#: KERNELS.md's causal prefill peer shapes (batch, q heads, kv heads, head, prompt), bf16, single
#: 8K and 32K prompts and 8 prompts of 2,048; then chunks after earlier context: 1,024 rows after 7K
#: tokens, 512 after 32K; and a 64-row chunk after 2K (the small end of the route rule).
_PREFILL = tuple(Shape(b, h, kvh, d, n, "bfloat16", q_len=n)
                 for b, h, kvh, d, n in ((1, 32, 8, 128, 4096), (4, 32, 8, 128, 2048), (1, 16, 2, 128, 16384),
                                         (1, 32, 8, 128, 8192), (1, 32, 8, 128, 32768), (8, 32, 8, 128, 2048)))
_PREFILL += tuple(Shape(1, 32, 8, 128, n, "bfloat16", q_len=q)
                  for q, n in ((1024, 8192), (512, 32768 + 512), (64, 2048 + 64)))

#: What the CPU suites put next to each other.
_CPU_CANDIDATES = ("classic", "reference", "gather_sdpa", "mlx_sdpa", "ceiling")


def _gqa_shapes() -> tuple[Shape, ...]:
    table = [s for s in PEER_TABLE_SHAPES if (s.num_heads, s.num_kv_heads, s.head_size) in GQA_GEOMETRIES]
    singles = [_decode(1, 24, 4, 256, n) for n in (16384, 32768, 65536, 131072)]
    singles += [_decode(1, 32, 8, 128, n) for n in (32768, 131072)]
    # The fourth admitted geometry has no peer-table shape: measure it like its head-128 sibling.
    singles.append(_decode(16, 16, 2, 256, 16384))
    out: list[Shape] = []
    for s in table + singles:
        if s not in out:
            out.append(s)
    return tuple(out)


#: The GPU suites' runtime note: their kernels need a GPU backend.
_GPU_ONLY = "needs a GPU backend (not timed on a CPU)"

#: issue #17's decode step: the 8 peer-table shapes, 32 layers (b64 L8192: 18, as measured there).
_STEP_GPU = decode_step.step_shapes(PEER_TABLE_SHAPES, layers={(64, 8192): 18})

#: Small steps for the CPU backend: a few layers of short contexts, float32 and bfloat16.
_STEP_CPU = (
    decode_step.StepShape(4, 8, 2, 64, 256, "float32", layers=8),
    decode_step.StepShape(1, 8, 2, 64, 2048, "float32", layers=8),
    decode_step.StepShape(2, 32, 8, 128, 512, "bfloat16", layers=4),
)
_STEP_CANDIDATES = ("auto", "auto_compiled", "classic", "gqa_decode", "mlx_sdpa", "torch_sdpa", "ceiling")

SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "decode-gpu",
            "bf16 decode: the 8 shapes of the peer table (benchmarks/README.md), plus two mixed batches (decode rows "
            "and prefill chunks)",
            "gpu",
            PEER_TABLE_SHAPES + _MIXED,
            ("auto", "classic", "gqa_decode", "tiled_prefill", "gather_sdpa", "mlx_sdpa", "torch_sdpa", "ceiling"),
            warmup=3,
            iters=20,
            runtime=_GPU_ONLY,
        ),
        Suite(
            "prefill-gpu",
            "bf16 causal prefill: the three prefill peer shapes (benchmarks/README.md), 8K and 32K prompts, 8 prompts "
            "of 2,048, chunks after 2K, 7K and 32K of context, the two mixed batches and one with a 2,048-row chunk",
            "gpu",
            _PREFILL + _MIXED + (Shape.mix((Rows(8, 1, 4096), Rows(1, 2048, 4096)), 32, 8, 128),),
            ("auto", "sdpa_prefill", "tiled_prefill", "gather_sdpa", "mlx_sdpa", "mlx_sdpa_packed", "torch_sdpa"),
            warmup=2,
            iters=10,
            runtime=_GPU_ONLY,
        ),
        Suite(
            "gqa-gpu",
            "bf16 decode on the GQA kernel's geometries: peer-table shapes, and single requests from 16K to 128K",
            "gpu",
            _gqa_shapes(),
            ("auto", "gqa_decode", "classic", "gather_sdpa", "mlx_sdpa", "torch_sdpa", "ceiling"),
            warmup=3,
            iters=20,
            runtime=_GPU_ONLY,
        ),
        Suite(
            "decode-cpu",
            "decode on the CPU: batch 8, 32/8 heads, head 128, contexts 1K/4K/16K, float32 and bfloat16",
            "cpu",
            tuple(_decode(8, 32, 8, 128, n, dt) for dt in ("float32", "bfloat16") for n in (1024, 4096, 16384)),
            _CPU_CANDIDATES,
            warmup=1,
            iters=5,
            runtime="about 4.5 min on a 2-core CPU (278 s; the peers take most of it: --candidates classic,ceiling "
                    "takes under a minute)",
        ),
        Suite(
            "prefill-cpu",
            "causal prefill on the CPU: one 2048-token prompt, 32/8 heads, head 128, float32",
            "cpu",
            (Shape(1, 32, 8, 128, 2048, "float32", q_len=2048),),
            _CPU_CANDIDATES,
            warmup=1,
            iters=3,
            runtime="about 5.5 min on a 2-core CPU (325 s; MLX SDPA and the gathers take seconds a call)",
        ),
        Suite(
            "decode-step",
            "a 32-layer bf16 decode step (b64 L8192: 18 layers) on the 8 peer-table shapes: one metadata "
            "shared by the layers, every call queued, one eval per step",
            "gpu",
            _STEP_GPU,
            _STEP_CANDIDATES,
            warmup=3,
            iters=10,
            runtime=_GPU_ONLY,
            resolve=decode_step.resolve,
        ),
        Suite(
            "decode-step-cpu",
            "decode steps on the CPU: 4 to 8 layers of small batches, one metadata shared by the layers, "
            "one eval per step",
            "cpu",
            _STEP_CPU,
            _STEP_CANDIDATES,
            warmup=1,
            iters=5,
            runtime="about 5 s on a 2-core CPU",
            resolve=decode_step.resolve,
        ),
        Suite(
            "smoke",
            "tiny shapes of every phase, for tests and a quick check that everything runs",
            "any",
            (
                Shape(3, 4, 2, 64, 100, "float32"),
                Shape(2, 4, 1, 64, 70, "bfloat16", block_size=32),
                Shape(1, 4, 2, 64, 48, "float32", q_len=48),
                Shape(2, 4, 2, 64, 40, "float16", block_size=8, q_len=12),
                Shape.mix((Rows(2, 1, 50), Rows(1, 12, 30)), 4, 2, 64, dtype="float32"),
            ),
            ("auto", "classic", "reference", "gather_sdpa", "mlx_sdpa", "torch_sdpa", "ceiling"),
            warmup=1,
            iters=3,
            runtime="about 2 s on a 2-core CPU",
        ),
    )
}


def get_suite(name: str) -> Suite:
    """The suite called ``name``; the error lists the known ones."""
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"suite={name!r} is unknown (known: {', '.join(SUITES)})") from None


def default_suite(backend: str) -> str:
    """The suite ``metal-attn bench`` runs without ``--suite``: decode on this backend."""
    return "decode-cpu" if backend == "cpu" else "decode-gpu"
