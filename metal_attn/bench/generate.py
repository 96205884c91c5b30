"""``metal-attn bench --suite generate``: generation throughput against mlx-lm, same model, one run.

Candidates, on the same model and prompts, in one process:

- ``engine``: metal-attn's continuous-batching engine (`metal_attn.engine.Engine`) with its
  defaults, which compile decode steps where the backend's measurement says so
  (`EngineConfig.compile_decode`, `COMPILE_DECODE_BY_BACKEND`: on CUDA, not on Metal or the CPU);
- ``engine_eager`` / ``engine_compiled``: the same engine with compiled decode steps forced off / on;
- ``batch_generator``: ``mlx_lm.generate.BatchGenerator`` (mlx-lm's own batching);
- ``generate_step``: ``mlx_lm.generate.generate_step``, single stream (concurrency 1 only).

Each concurrency level runs ``concurrency`` prompts of ``prompt_len`` random token ids,
every one generating exactly ``gen_tokens`` tokens greedily (no stop token). Reported per
candidate: end-to-end tokens/s (generated tokens over the whole wall time), generation
tokens/s (generated tokens over the wall time minus prompt processing, mlx-lm's
``BatchStats`` definition), mean time to first token, and peak memory. The ``shared``
workload adds a common system prompt to every request and compares the engine's time to
first token with prefix caching on and off.

The model: on the CPU the default SmolLM2 (fetched on first use); on a GPU an 8B-shaped
random-weight llama in bf16 (`metal_attn.testing.models.llama_8b_shaped`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from metal_attn.checks import is_decimal, is_int

if TYPE_CHECKING:  # pragma: no cover
    from metal_attn.engine import EngineConfig

__all__ = ["GenerateResult", "bench_generate", "load_bench_model", "run"]


@dataclasses.dataclass
class GenerateResult:
    workload: str
    concurrency: int
    candidate: str
    prompt_len: int
    gen_tokens: int
    wall_s: float
    prompt_s: float
    generated: int
    mean_ttft_s: float | None
    peak_memory_bytes: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Which round of the workload this is (``--repeat``: every candidate once per round).
    round: int = 0

    @property
    def e2e_tps(self) -> float:
        return self.generated / self.wall_s if self.wall_s else 0.0

    @property
    def generation_tps(self) -> float:
        t = self.wall_s - self.prompt_s
        return self.generated / t if t > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"e2e_tps": self.e2e_tps, "generation_tps": self.generation_tps}


class _NoStopTokenizer:
    """What the engine needs of a tokenizer when only token ids are generated and nothing stops early."""

    eos_token_ids: frozenset[int] = frozenset()
    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The suite's prompts are token ids; a text prompt is refused (the engine checks a tokenizer has this)."""
        from metal_attn.errors import InvalidInputError

        raise InvalidInputError(f"prompt={text[:40]!r}: the generate suite's model has no vocabulary (allowed: token "
                                "ids)")

    @property
    def detokenizer(self) -> Any:
        return _NullDetokenizer()


class _NullDetokenizer:
    text = ""

    def add_token(self, t: int) -> None:
        pass

    def finalize(self) -> None:
        pass


def load_bench_model(backend: str, num_layers: int | None = None) -> tuple[Any, str]:
    """The suite's model on this backend, and a label for it."""
    if backend == "cpu":
        from metal_attn.mlx_lm import load

        model, _ = load("smollm2")
        return model, "SmolLM2-135M-Instruct Q4_1 (float32 activations)"
    from metal_attn.testing.models import llama_8b_shaped

    layers = num_layers or 32
    return llama_8b_shaped(num_layers=layers), f"8B-shaped random llama ({layers} layers, bf16)"


def _prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(1, vocab, size=shared).tolist()
    return [head + rng.integers(1, vocab, size=length).tolist() for _ in range(n)]


def suite_engine_config(prompts: list[list[int]], gen: int, *, budget: int = 4096,
                        **overrides: Any) -> EngineConfig:
    """The suite engine's `EngineConfig` for ``prompts`` generating ``gen`` tokens each: a pool of
    what they need plus two pages a request, a seat for every request, ``budget`` tokens a step;
    ``overrides`` set other fields (``None`` values keep the defaults)."""
    from metal_attn.engine import EngineConfig

    need = sum(len(p) + gen for p in prompts)
    return EngineConfig(num_blocks=-(-need // 16) + 2 * len(prompts) + 8, max_num_seqs=max(len(prompts), 1),
                        max_num_batched_tokens=budget, **{k: v for k, v in overrides.items() if v is not None})


def _run_engine(model: Any, prompts: list[list[int]], gen: int, *, prefix_caching: bool = True,
                budget: int = 4096, compile_decode: bool | None = None,
                compile_trace_after: int | None = None) -> tuple[float, float, int, list[float], dict[str, Any]]:
    from metal_attn.engine import Engine

    cfg = suite_engine_config(prompts, gen, budget=budget, enable_prefix_caching=prefix_caching,
                              compile_decode=compile_decode, compile_trace_after=compile_trace_after)
    eng = Engine(model, _NoStopTokenizer(), cfg)
    ids = [eng.add_request(p, max_tokens=gen) for p in prompts]
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    prompt_s = eng.stats.prompt_seconds(t0)
    ttft = [eng.requests[i].first_token_time - t0 for i in ids]
    generated = sum(len(eng.requests[i].output_ids) for i in ids)
    gaps = [b - a for (a, pa), (b, pb) in itertools.pairwise(eng.stats.completions) if not pb and not pa]
    extra = {"steps": eng.stats.steps, "host_build_s": eng.stats.build_seconds,
             "decode_step_ms": statistics.median(gaps) * 1e3 if gaps else None,
             "prefix_hit_rate": eng.blocks.prefix_hits / max(eng.blocks.prefix_queries, 1),
             "preemptions": eng.stats.preemptions,
             "plans_built": eng.runner.plans_built, "plans_derived": eng.runner.plans_derived}
    if eng.runner.compiled is not None:
        extra |= {"compiled_steps": eng.runner.compiled.steps, "compiled_traces": eng.runner.compiled.traces,
                  "compiled_shrunk_steps": eng.runner.compiled.shrunk_steps,
                  "compiled_off": eng.runner.compiled.disabled}
    del eng
    return wall, prompt_s, generated, ttft, extra


def _run_batch_generator(model: Any, prompts: list[list[int]], gen: int) -> tuple[float, float, int, list[float],
                                                                               dict[str, Any]]:
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=max(32, len(prompts)),
                        prefill_batch_size=min(8, len(prompts)))
    uids = bg.insert(prompts, [gen] * len(prompts))
    first: dict[int, float] = {}
    generated = 0
    t0 = time.perf_counter()
    with bg.stats() as stats:
        while responses := bg.next_generated():
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now - t0)
                generated += 1
    wall = time.perf_counter() - t0
    bg.close()
    return wall, stats.prompt_time, generated, [first[u] for u in uids], {"bg_generation_tps": stats.generation_tps}


def _run_generate_step(model: Any, prompts: list[list[int]], gen: int) -> tuple[float, float, int, list[float],
                                                                             dict[str, Any]]:
    from mlx_lm.generate import generate_step

    (prompt,) = prompts
    t0 = time.perf_counter()
    first = None
    n = 0
    for (_tok, _lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=gen), range(gen)):
        if first is None:
            first = time.perf_counter() - t0
        n += 1
    wall = time.perf_counter() - t0
    return wall, first or 0.0, n, [first or 0.0], {}


def _run_engine_no_chains(*args: Any, **kw: Any) -> tuple[float, float, int, list[float], dict[str, Any]]:
    from metal_attn.settings import override_settings

    with override_settings(cuda_chains=False):
        return _run_engine(*args, **kw)


#: Candidates by name; ``engine`` runs the engine's defaults, ``engine_eager`` / ``engine_compiled``
#: force its compiled decode steps off / on (`EngineConfig.compile_decode`), ``engine_trace_second``
#: forces them on and traces each decode shape on its second step (`EngineConfig.compile_trace_after`),
#: ``engine_no_chains`` runs the defaults with ``METAL_ATTN_CUDA_CHAINS=0`` (one ``mx.fast`` call per
#: kernel on CUDA: `metal_attn.cuda_ops`).
RUNNERS: dict[str, Callable[..., tuple[float, float, int, list[float], dict[str, Any]]]] = {
    "engine": _run_engine,
    "engine_eager": functools.partial(_run_engine, compile_decode=False),
    "engine_compiled": functools.partial(_run_engine, compile_decode=True),
    "engine_trace_second": functools.partial(_run_engine, compile_decode=True, compile_trace_after=2),
    "engine_no_chains": _run_engine_no_chains,
    "batch_generator": _run_batch_generator,
    "generate_step": _run_generate_step,
}


#: The engine's candidates, whose ratios to the peers are reported.
ENGINES = ("engine", "engine_eager", "engine_compiled", "engine_trace_second", "engine_no_chains")

#: What ``--suite generate`` runs unless ``--candidates`` says otherwise (the suite's timed defaults).
DEFAULT_CANDIDATES = ("engine", "batch_generator", "generate_step")


def _candidates(spec: str | None) -> list[str]:
    names = [c.strip() for c in spec.split(",") if c.strip()] if spec else list(DEFAULT_CANDIDATES)
    unknown = [c for c in names if c not in RUNNERS]
    if unknown:
        print(f"metal-attn bench: error: --candidates {spec!r}: {', '.join(unknown)} unknown for the generate suite "
              f"(allowed: {', '.join(RUNNERS)})", file=sys.stderr)
        raise SystemExit(2)
    return names


def bench_generate(
    model: Any,
    *,
    concurrencies: Sequence[int] = (1, 8, 32, 64),
    prompt_len: int = 512,
    gen_tokens: int = 128,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    shared_prefix: int = 0,
    shared_requests: int = 32,
    seed: int = 0,
    rounds: int = 1,
    warm: bool = True,
    progress: Callable[[str], None] | None = None,
    on_result: Callable[[GenerateResult], None] | None = None,
) -> list[GenerateResult]:
    """Run the workloads; every result goes to ``on_result`` as soon as it exists.

    ``rounds`` runs each concurrency's candidates (and the shared-prefix pair) that many times, back
    to back, the order reversed every other round, so that a host whose speed drifts during the run
    weighs on every candidate alike; `ratios` then takes each round's ratio and their median."""
    if not is_int(rounds) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} (allowed: an int >= 1)")
    vocab = int(model.model.embed_tokens.weight.shape[0]) if hasattr(model, "model") else 32000
    results: list[GenerateResult] = []

    def one(workload: str, name: str, prompts: list[list[int]], rnd: int = 0, **kw: Any) -> None:
        if progress:
            progress(f"{workload} c={len(prompts)} {name}" + (f" (round {rnd + 1} of {rounds})" if rounds > 1 else "")
                     + " ...")
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        wall, prompt_s, generated, ttft, extra = RUNNERS[name](model, prompts, gen_tokens, **kw)
        r = GenerateResult(workload, len(prompts), name + ("" if kw.get("prefix_caching", True) else "-noprefix"),
                           len(prompts[0]), gen_tokens, wall, prompt_s, generated,
                           statistics.fmean(ttft) if ttft else None, int(mx.get_peak_memory()), extra, rnd)
        results.append(r)
        if on_result:
            on_result(r)

    # Compile every kernel once before anything is timed: full-length prompts, on a GPU enough of them
    # that the engine chunks its prefill and mixes decode rows into prefill steps (the CPU compiles nothing).
    from metal_attn.device import current_device

    # Then one request alone: its decode steps take other kernel variants (split-KV at one row), and
    # without this the first candidate timed at one request paid their compilation (H200, fifth
    # session: 118-174 ms of time to first token for whichever engine candidate ran first, 39-48 ms
    # for the one after it).
    n_warm = 2 if current_device().backend == "cpu" else max(2, 4096 // prompt_len + 2)
    warm_prompts = _prompts(n_warm, prompt_len, vocab, seed + 99)
    warm_gen = min(4, gen_tokens)  # never longer than the timed requests (the context check covers those)
    for name in candidates if warm else ():
        if progress:
            progress(f"warm-up {name} ...")
        if name != "generate_step":
            RUNNERS[name](model, warm_prompts, warm_gen)
        RUNNERS[name](model, warm_prompts[:1], warm_gen)
    if shared_prefix and warm:
        # The shared-prefix workload's prefill chunks sit on long cached contexts, kernel variants the
        # random prompts never take (H200, eighth session: its first timed run paid them, 5.3 s of
        # time to first token against 0.21-0.23 s in the rounds after it).
        if progress:
            progress("warm-up shared-prefix ...")
        warm_shared = _prompts(4, max(1, prompt_len // 8), vocab, seed + 98, shared=shared_prefix)
        for caching in (True, False):
            RUNNERS["engine"](model, warm_shared, warm_gen, prefix_caching=caching)
    for c in concurrencies:
        prompts = _prompts(c, prompt_len, vocab, seed + c)
        for rnd in range(rounds):
            for name in candidates if rnd % 2 == 0 else candidates[::-1]:
                if name == "generate_step" and c != 1:
                    continue
                one("random", name, prompts, rnd)
    if shared_prefix:
        prompts = _prompts(shared_requests, max(1, prompt_len // 8), vocab, seed + 7, shared=shared_prefix)
        for rnd in range(rounds):
            for caching in (True, False) if rnd % 2 == 0 else (False, True):
                one("shared-prefix", "engine", prompts, rnd, prefix_caching=caching)
    return results


def ratios(results: Sequence[GenerateResult]) -> list[dict[str, Any]]:
    """Engine / peer ratios per (workload, concurrency), for each engine candidate (`ENGINES`)
    against mlx-lm's two peers, the engine without prefix caching and the eager engine:
    generation and end-to-end tokens/s, TTFT (every ``*_ratio`` key higher is better, as
    `metal_attn.bench.ratios` documents), and the engine's peak memory as a fraction of the
    peer's (``peak_memory_of_peer``: lower is better, so not a ``*_ratio`` key). Each ratio compares the two
    candidates' runs of one round; with several rounds it is the median of the rounds' ratios,
    which are listed under ``per_round``."""
    out = []
    keys = sorted({(r.workload, r.concurrency) for r in results})
    for (w, c), cand in itertools.product(keys, ENGINES):
        rounds = sorted({r.round for r in results if (r.workload, r.concurrency) == (w, c)})
        by_round = [{r.candidate: r for r in results if (r.workload, r.concurrency, r.round) == (w, c, n)}
                    for n in rounds]
        for peer in ("batch_generator", "generate_step", "engine-noprefix", "engine_eager"):
            pairs = [(rs[cand], rs[peer]) for rs in by_round if cand in rs and peer in rs and peer != cand]
            if not pairs:
                continue
            each = [_pair_ratios(eng, p) for eng, p in pairs]
            row: dict[str, Any] = {"workload": w, "concurrency": c, "candidate": cand, "peer": peer}
            for key in each[0]:
                vals = [e[key] for e in each if e[key] is not None]
                row[key] = statistics.median(vals) if vals else None
            row["per_round"] = each
            out.append(row)
    return out


def _pair_ratios(eng: GenerateResult, p: GenerateResult) -> dict[str, float | None]:
    """Engine / peer of one round: ``*_ratio`` keys above 1 are better (TTFT as peer / engine); the engine's peak
    memory is ``peak_memory_of_peer``, engine / peer, below 1 being better (a ratio key would read higher as better)."""
    return {"generation_ratio": eng.generation_tps / p.generation_tps if p.generation_tps else None,
            "e2e_ratio": eng.e2e_tps / p.e2e_tps if p.e2e_tps else None,
            "ttft_ratio": (p.mean_ttft_s / eng.mean_ttft_s) if eng.mean_ttft_s else None,
            "peak_memory_of_peer": eng.peak_memory_bytes / p.peak_memory_bytes if p.peak_memory_bytes else None}


def format_row(r: GenerateResult) -> str:
    ttft = f"{r.mean_ttft_s * 1e3:.0f}" if r.mean_ttft_s is not None else "-"
    return (f"| {r.workload} | {r.concurrency} | {r.candidate} | {r.prompt_len} | {r.gen_tokens} | "
            f"{r.generation_tps:,.1f} | {r.e2e_tps:,.1f} | {ttft} | {r.peak_memory_bytes / 2**30:.2f} |")


#: The most requests one ``--concurrency`` entry may run: the suite builds every request's prompt up front
#: (99,999,999,999 grew past 5 GB before failing), and the peers batch them all at once.
MAX_CONCURRENCY = 4096


HEADER = ("| workload | concurrency | candidate | prompt | generated each | generation tok/s | end-to-end tok/s | "
          "mean TTFT ms | peak GiB |\n|---|---|---|---|---|---|---|---|---|")


def _concurrencies(text: str | None, backend: str) -> list[int] | None:
    """``--concurrency`` as ints (the backend's default when not given), or ``None`` when malformed."""
    if text is None:
        text = "1,8,32,64" if backend != "cpu" else "1,8,32"
    items = [x.strip() for x in text.split(",")]
    if not items or not all(is_decimal(x) and 1 <= int(x) <= MAX_CONCURRENCY for x in items):
        return None
    return [int(x) for x in items]


def _too_long(model: Any, prompt_len: int, gen: int, shared_prefix: int) -> str | None:
    """Why the suite's longest request would not fit ``model``'s context (None when every one fits): the
    random-prompt requests (``prompt_len + gen``) and, with a shared prefix, the shared-prefix workload's
    (``shared_prefix + prompt_len // 8 + gen``)."""
    from metal_attn.engine.engine import model_max_len

    context = model_max_len(model) or 8192  # the engine's own default
    if prompt_len + gen > context:
        return (f"--prompt-len {prompt_len} + --gen-tokens {gen} = {prompt_len + gen} tokens a request, over the "
                f"bench model's context of {context} (allowed: at most {context} in all)")
    if shared_prefix and shared_prefix + max(1, prompt_len // 8) + gen > context:
        total = shared_prefix + max(1, prompt_len // 8) + gen
        return (f"--shared-prefix {shared_prefix} + --prompt-len {prompt_len} // 8 + --gen-tokens {gen} = {total} "
                f"tokens a shared-prefix request, over the bench model's context of {context} (allowed: at most "
                f"{context} in all; --shared-prefix 0 leaves that workload out)")
    return None


def run(args: Any) -> int:
    """The ``--suite generate`` path of ``metal-attn bench``: prints each row as it completes."""
    import json

    from metal_attn.device import current_device

    candidates = _candidates(args.candidates)  # a bad name is refused before the model loads
    backend = current_device().backend
    concurrencies = _concurrencies(args.concurrency, backend)
    if concurrencies is None:
        print(f"metal-attn bench: error: --concurrency {args.concurrency!r} (allowed: whole numbers from 1 to "
              f"{MAX_CONCURRENCY}, comma-separated, e.g. 1,8,32)", file=sys.stderr)
        return 2
    prompt_len = args.prompt_len or (512 if backend != "cpu" else 32)
    gen = args.gen_tokens or (128 if backend != "cpu" else 32)
    shared = args.shared_prefix if args.shared_prefix is not None else (2048 if backend != "cpu" else 0)
    if getattr(args, "dry_run", False):
        rounds = getattr(args, "repeat", None) or 1
        to_stdout = getattr(args, "json", None) == "-"  # the plan as JSON there, its text on stderr
        text = sys.stderr if to_stdout else sys.stdout
        print(f"would run generate on {backend}: candidates {', '.join(candidates)} against their peers at "
              f"concurrency {', '.join(map(str, concurrencies))}, prompts of {prompt_len} tokens, {gen} generated "
              f"each, {rounds} round(s)"
              + (f", and the shared-prefix workload ({shared} tokens shared)" if shared else ""), file=text)
        print("dry run: flags and names checked; not checked: the requests' lengths against the model's "
              "context (that needs the model, which a dry run does not load)", file=text)
        if to_stdout:
            print(json.dumps({"dry_run": True, "suite": "generate", "backend": backend, "candidates": candidates,
                              "concurrency": concurrencies, "prompt_len": prompt_len, "gen_tokens": gen,
                              "shared_prefix": shared, "rounds": rounds}))
        return 0
    model, label = load_bench_model(backend, getattr(args, "num_layers", None))
    problem = _too_long(model, prompt_len, gen, shared)
    if problem:  # before any warm-up: the engine would refuse the first request
        print(f"metal-attn bench: error: {problem}", file=sys.stderr)
        return 2
    err = sys.stderr
    out = err if args.json == "-" else sys.stdout  # stdout holds the JSON alone then
    print(f"generate suite on {backend}: {label}; prompts of {prompt_len} tokens, {gen} generated each", file=err)
    print(HEADER, file=out)
    results = bench_generate(
        model, concurrencies=concurrencies, prompt_len=prompt_len, gen_tokens=gen,
        candidates=candidates, rounds=getattr(args, "repeat", None) or 1,
        shared_prefix=shared, seed=getattr(args, "seed", None) or 0,
        progress=None if args.quiet else (lambda m: print(m, file=err, flush=True)),
        on_result=lambda r: print(format_row(r), file=out, flush=True),
    )
    rows = ratios(results)
    for row in rows:
        print(f"ratio {row['workload']} c={row['concurrency']} {row['candidate']}/{row['peer']}: generation "
              f"{_x(row['generation_ratio'])}, end-to-end {_x(row['e2e_ratio'])}, TTFT {_x(row['ttft_ratio'])} "
              f"(peer/engine), peak memory {_x(row['peak_memory_of_peer'])} of the peer's"
              + (f"; generation by round {', '.join(_x(e['generation_ratio']) for e in row['per_round'])}"
                 if len(row["per_round"]) > 1 else ""), file=out)
    if args.json:
        text = json.dumps({"schema": "metal-attn-bench-generate/1", "model": label, "backend": backend,
                           "results": [r.to_dict() for r in results], "ratios": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"metal-attn bench: error: --json {args.json!r}: not written ({exc.strerror or exc})",
                      file=sys.stderr)
                return 1
    return 0


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"
