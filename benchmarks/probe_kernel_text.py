"""GPU kernel time of the registry's decode route under several versions of the kernel texts, in one
process (not a test).

    python3 benchmarks/probe_kernel_text.py OUT.json --texts NAME=DIR[,NAME=DIR...]
        [--set NAME:SETTING=VALUE ...] [--shapes b8:32:8:128:4096,...] [--rounds 4] [--calls 20]

``NAME=DIR``: one version's ``kernels_v2`` folder (``-``: the package's own); the first is the base.
``--set NAME:SETTING=VALUE`` (repeatable): version NAME runs under that setting too
(`metal_attn.settings.override_settings`, e.g. ``--set s4:reducer_slices=4``), so one text can be two versions.
Per shape (batch:heads:kv_heads:head_size:context, bf16, 16-token pages) and round, every version in
turn, the order rotated each round, times ``--calls`` traced calls of `metal_attn.paged_attention`
(the registry's choice) with CUPTI (`kernel_trace`): the median µs of each kernel times its launches
per call, summed. This is the kernels' time, not the call's wall time: on some machines a slower host
moves the wall time of one same call by 10% or more from run to run (`ab_kernel_text.py` measures that
figure), which hides a kernel change of a few percent. Printed per shape: each version's kernel µs per
round, their median, its ratio to the base's, and % of the copy ceiling measured in the same process
(`metal_attn.bench.peers.gpu_copy_ceiling`, the bench's); then torch SDPA's kernel time on contiguous K/V of
the shape (`kernel_trace.torch_decode_sdpa`), the peer. Needs MLX's CUDA backend and torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from probe_args import decode_shapes

#: Shapes by default: the decode shapes issue #17 misses or nearly misses.
SHAPES = ((8, 32, 8, 128, 4096), (1, 32, 8, 128, 32768), (16, 16, 2, 128, 16384), (1, 24, 4, 256, 65536),
          (8, 32, 8, 128, 32768))


def parse_texts(text: str) -> dict[str, Path | None]:
    """``NAME=DIR,...`` as {name: folder or None (the package's own)}, in order; refuses a folder without
    kernel texts and repeated names."""
    out: dict[str, Path | None] = {}
    for item in text.split(","):
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise argparse.ArgumentTypeError(f"--texts item {item!r} (allowed: NAME=DIR, DIR '-' for the "
                                             "package's own kernel texts)")
        if name in out:
            raise argparse.ArgumentTypeError(f"--texts names {name!r} twice")
        path = None if folder == "-" else Path(folder)
        if path is not None and not (path / "pagedattention.metal").is_file():
            raise argparse.ArgumentTypeError(f"--texts {name}={folder!r}: no kernel texts there "
                                             "(no pagedattention.metal)")
        out[name] = path
    return out


def parse_set(text: str) -> tuple[str, str, str]:
    """``NAME:SETTING=VALUE`` as (name, setting, value)."""
    name, sep, rest = text.partition(":")
    setting, eq, value = rest.partition("=")
    if not sep or not eq or not name or not setting:
        raise argparse.ArgumentTypeError(f"--set {text!r} (allowed: NAME:SETTING=VALUE, e.g. s4:reducer_slices=4)")
    return name, setting, value


def version_settings(sets: list[tuple[str, str, str]], names: list[str]) -> dict[str, dict[str, str]]:
    """Per version its settings overrides; refuses a name that is not a version."""
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for name, setting, value in sets:
        if name not in out:
            raise ValueError(f"--set {name}:{setting}={value}: no version {name!r} in --texts "
                             f"(allowed: {', '.join(names)})")
        out[name][setting] = value
    return out


def rotate(names: list[str], rnd: int) -> list[str]:
    """The versions' order in round ``rnd``: each goes first in turn."""
    k = rnd % len(names)
    return names[k:] + names[:k]


def summary(label: str, per: dict[str, list[float]], ceiling_us: float | None) -> dict:
    """One shape's figures: per version its rounds' µs, median, ratio to the first version's median
    (above 1: slower) and % of the copy ceiling."""
    base = statistics.median(next(iter(per.values())))
    out = {"shape": label, "ceiling_us": ceiling_us, "versions": {}}
    for name, us in per.items():
        med = statistics.median(us)
        out["versions"][name] = {"kernel_us": us, "median_us": med, "vs_base": med / base,
                                 "ceiling_pct": 100 * ceiling_us / med if ceiling_us else None}
    return out


def line(row: dict) -> str:
    parts = []
    for name, v in row["versions"].items():
        pct = f", {v['ceiling_pct']:.1f}%" if v["ceiling_pct"] is not None else ""
        parts.append(f"{name} [{', '.join(f'{u:.1f}' for u in v['kernel_us'])}] {v['median_us']:.1f} µs"
                     f" (x{v['vs_base']:.3f}{pct})")
    torch = row.get("torch_sdpa_us")
    if torch:
        ceiling = f", {100 * row['ceiling_us'] / torch:.1f}%" if row["ceiling_us"] else ""
        parts.append(f"torch SDPA {torch:.1f} µs{ceiling}")
    return f"{row['shape']}: " + " | ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--texts", type=parse_texts, required=True)
    ap.add_argument("--set", dest="sets", type=parse_set, action="append", default=[])
    ap.add_argument("--shapes", type=decode_shapes, default=SHAPES)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        ap.error(f"--rounds={args.rounds} --calls={args.calls}: both must be at least 1")
    names = list(args.texts)
    try:
        overrides = version_settings(args.sets, names)
    except ValueError as err:
        ap.error(str(err))

    import mlx.core as mx
    from kernel_trace import kernel_us, summarise, torch_decode_sdpa, trace

    import metal_attn
    from metal_attn import kernels
    from metal_attn.bench.peers import gpu_copy_ceiling
    from metal_attn.bench.shapes import Shape, build_case
    from metal_attn.settings import override_settings

    def call_us(call) -> float:
        return kernel_us(summarise(trace(call, args.calls), args.calls, 1)["kernels"])

    ceiling_gbps = gpu_copy_ceiling(warmup=3, iters=10)["gbps"]
    print(f"copy ceiling {ceiling_gbps:,.0f} GB/s", flush=True)
    rows = []
    for batch, heads, kv_heads, head, context in args.shapes:
        label = f"b{batch} h{heads}/{kv_heads} d{head} L{context}"
        case = build_case(Shape(batch, heads, kv_heads, head, context, "bfloat16"), seed=context)
        kv_bytes = case.shape.kv_bytes

        def call(case=case):
            return metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=case.metadata,
                                              scale=case.scale)

        per: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            for name in rotate(names, rnd):
                kernels.use_source_dir(args.texts[name])
                with override_settings(**overrides[name]):
                    mx.eval(call())
                    per[name].append(call_us(call))
        kernels.use_source_dir(None)
        row = summary(label, per, kv_bytes / ceiling_gbps / 1e3)
        row["route"] = metal_attn.diagnostics.last_dispatch().route
        row["torch_sdpa_us"] = kernel_us(torch_decode_sdpa(case, args.calls)["kernels"])
        rows.append(row)
        print(line(row), flush=True)
        del case
        mx.clear_cache()
    Path(args.out).write_text(json.dumps({"texts": {n: str(p) if p else "-" for n, p in args.texts.items()},
                                          "settings": overrides,
                                          "rounds": args.rounds, "calls": args.calls, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
