"""The README's "Measured" figures equal the docs they cite.

Each figure in the README's bullets is recomputed from the cited document's table (the ranges are
the table's smallest and largest values, as printed there) or, where the document states it in a
sentence, found verbatim: a new benchmark run that updates a doc and not the README (or the
reverse) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measured() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Measured")
    return " ".join(text[start:text.index("\n## ", start + 1)].split())


def _table_after(text: str, anchor: str) -> list[list[str]]:
    """The Markdown table that starts at the first table line after ``anchor``: rows of cells."""
    lines = text[text.index(anchor):].splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[first:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return [r for r in rows if not set("".join(r)) <= set("-: ")]


def _num(cell: str, pattern: str) -> str:
    m = re.search(pattern, cell)
    assert m, f"{pattern!r} not in {cell!r}"
    return m.group(1)


def _span(values: list[str]) -> str:
    nums = sorted(values, key=float)
    return f"{nums[0]}-{nums[-1]}"


def test_cpu_figures_equal_docs_bench_cpu():
    doc = (ROOT / "docs" / "bench-cpu.md").read_text()
    header, *rows = _table_after(doc, "Times and ratios from the same run")
    assert header[:3] == ["shape", "classic ms", "vs mlx_sdpa"], header
    ratio = {r[0]: r[2].rstrip("x") for r in rows}
    f32 = _span([v for k, v in ratio.items() if k.startswith("decode") and k.endswith("f32")])
    bf16 = _span([v for k, v in ratio.items() if k.startswith("decode") and k.endswith("bf16")])
    (prefill,) = [v for k, v in ratio.items() if k.startswith("prefill")]
    header, *rows = _table_after(doc, "#### decode-cpu")
    ceil = _span([_num(r[header.index("classic")], r"\((\d+(?:\.\d+)?)%\)") for r in rows])
    text = _measured()
    assert (f"{f32}x faster than MLX SDPA on contiguous K/V in float32 and {bf16}x in bfloat16" in text
            and f"a 2048-token causal prefill {prefill}x faster" in text
            and f"at {ceil}% of the CPU's read bandwidth" in text), (
        f"README's CPU bullet should quote docs/bench-cpu.md: float32 {f32}x, bfloat16 {bf16}x, prefill "
        f"{prefill}x, {ceil}% of the read ceiling")


def test_h200_decode_figures_equal_the_marked_table():
    doc = (ROOT / "docs" / "bench-h200-classic.md").read_text()
    header, *rows = _table_after(doc, "<!-- readme-figures:")
    col = {name: header.index(name) for name in ("classic", "x gather", "auto (gqa_decode)", "torch SDPA, contiguous")}
    decode = [r for r in rows if r[0].startswith("decode")]
    mixed = [r for r in rows if r[0].startswith("mixed")]
    pct = r"\((\d+(?:\.\d+)?)%\)"
    x_gather = _span([_num(r[col["x gather"]], r"(\d+(?:\.\d+)?)x") for r in decode])
    classic = _span([_num(r[col["classic"]], pct) for r in decode])
    torch = _span([_num(r[col["torch SDPA, contiguous"]], pct) for r in decode])
    gqa = _span([_num(r[col["auto (gqa_decode)"]], pct) for r in decode])
    tiled = _span([_num(r[col["classic"]], r"tiled_prefill \d+, \*\*(\d+(?:\.\d+)?)x") for r in mixed])
    per_token = _span([_num(r[col["x gather"]], r"(\d+(?:\.\d+)?)x") for r in mixed])
    text = _measured()
    for phrase in (f"`classic` decode {x_gather}x faster than gathering pages + MLX SDPA",
                   f"at {classic}% of the copy ceiling", f"torch SDPA on contiguous K/V reaches {torch}%",
                   f"`gqa_decode` at {gqa}%", f"makes mixed batches {tiled}x faster than gather + SDPA",
                   f"(the per-token kernel alone: {per_token}x)"):
        assert phrase in text, f"README's H200 bullet should say {phrase!r} (docs/bench-h200-classic.md's table)"


def test_h200_latest_decode_figures_equal_the_marked_table():
    doc = (ROOT / "docs" / "bench-h200-classic.md").read_text()
    header, *rows = _table_after(doc, "<!-- readme-figures-latest:")
    auto, torch = header.index("auto"), header.index("torch SDPA")
    pct = r"\((\d+(?:\.\d+)?)%\)"
    gbs = r"^\**([\d,]+) "
    decode = [r for r in rows if r[0].startswith("b")]
    assert len(decode) == 8, decode
    ours = _span([_num(r[auto], pct) for r in decode])
    theirs = _span([_num(r[torch], pct) for r in decode])
    ratios = [float(_num(r[auto], gbs).replace(",", "")) / float(_num(r[torch], gbs).replace(",", "")) for r in decode]
    speed = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    phrase = f"`auto` at {ours}% against torch SDPA's {theirs}% in the same run, {speed} its speed"
    assert phrase in _measured(), f"README's H200 bullet should say {phrase!r} (docs/bench-h200-classic.md's table)"


def test_h200_prefill_figures_are_the_tiled_doc_sentence():
    doc = " ".join((ROOT / "docs" / "bench-h200-tiled.md").read_text().split())
    m = re.search(r"the tiles run at (\d+-\d+) TFLOP/s where cuDNN \(behind MLX SDPA on contiguous K/V\) "
                  r"reaches (\d+-\d+)", doc)
    assert m, "docs/bench-h200-tiled.md no longer states the prefill range in its sentence"
    text = _measured()
    assert f"causal prompts at {m.group(1)} TFLOP/s" in text and f"contiguous K/V reaches {m.group(2)}" in text


def test_dispatch_figure_equals_docs_bench_cpu():
    doc = " ".join((ROOT / "docs" / "bench-cpu.md").read_text().split())
    m = re.search(r"the registry adds (\d+(?:\.\d+)?) µs of host time per `paged_attention` call", doc)
    assert m, "docs/bench-cpu.md no longer states the dispatch overhead"
    assert f"about {m.group(1)} µs added per `paged_attention` call by the registry" in _measured()


def test_h200_decode_step_figures_equal_the_forty_eighth_session_table():
    """The decode-step bullet, recomputed from the forty-eighth session's queued table: the span of the
    step's ratios to torch where it is at or below torch's time, the shapes where it is not, and the single
    calls' share of the ceiling (512 MiB of K+V or more, the two 256 MiB shapes, b8 L4096)."""
    doc = (ROOT / "docs" / "bench-h200-decode-step.md").read_text()
    header, *rows = _table_after(doc, "## Forty-eighth session (2026-12-07): the H200 at last")
    assert len(rows) == 8, rows
    step = {r[0]: _num(r[header.index("the step: ours / torch SDPA (time)")], r"^\**(\d\.\d\d)") for r in rows}
    call = {r[0]: _num(r[header.index("one call: ours %, torch %, MLX SDPA %")], r"^\**(\d+)") for r in rows}
    kv = {r[0]: r[header.index("K+V")] for r in rows}
    met = [v for v in step.values() if float(v) >= 1.0]
    short = lambda shape: re.sub(r" \d+/\d+(?:/\d+)?", "", shape).replace(", 18 layers", "")  # noqa: E731
    missed = ", ".join(f"{v}x on {short(k)}" for k, v in step.items() if float(v) < 1.0)
    large = _span([call[k] for k, size in kv.items() if size in ("512 MiB", "1 GiB", "2 GiB")])
    (b1,) = [k for k in kv if k.startswith("b1 24/4/256")]
    (b16,) = [k for k in kv if k.startswith("b16 16/2")]
    (b8,) = [k for k in kv if k.startswith("b8 32/8 L4096")]
    phrases = [f"{_span(met)}x torch SDPA on contiguous K/V on {len(met)} of the {len(rows)} shapes, {missed},",
               f"Single calls at {large}% of the ceiling where K+V is 512 MiB or more",
               f"b1 24/4/256 and b16 16/2 ({kv[b1]}) at {call[b1]}% and {call[b16]}%, b8 L4096 at {call[b8]}%"]
    for phrase in phrases:
        assert phrase in _measured(), f"README's decode-step bullet should say {phrase!r}"


def test_h200_serving_ratios_equal_the_generate_tables():
    """The README's H200 serving ratios, recomputed from docs/serving.md's eighth-session tables: the
    single stream's per-machine medians of the rounds' ratios and the median over every round, the
    one-round suite's engine / `BatchGenerator` at 8, 32, 64 requests, and prefix caching's
    time-to-first-token gain per machine (median of the rounds' off / on)."""
    import statistics

    doc = (ROOT / "docs" / "serving.md").read_text()
    anchor = doc.index("**One request, eighth session**")
    header, *rounds = _table_after(doc[anchor:], "| machine | `generate_step` tok/s")
    per_round = [[float(x) for x in r[header.index("engine / `generate_step`, per round")].split(",")] for r in rounds]
    for r, values in zip(rounds, per_round):
        assert abs(float(_num(r[-1], r"(\d\.\d\d)x")) - statistics.median(values)) <= 0.0051, r
    medians = [statistics.median(v) for v in per_round]
    overall = statistics.median([x for v in per_round for x in v])

    header, *rows = _table_after(doc[anchor:], "| concurrency | candidate | generation tok/s")
    gen = header.index("generation tok/s")
    cell = {(r[0], r[1]): float(r[gen].replace(",", "")) for r in rows}
    vs_bg = [cell[(c, "engine")] / cell[(c, "`BatchGenerator`")] for c in ("8", "32", "64")]

    header, *rows = _table_after(doc[anchor:], "| machine | round | TTFT ms")
    gains: dict[str, list[float]] = {}
    for r in rows:
        gains.setdefault(r[0], []).append(float(r[3].replace(",", "")) / float(r[2].replace(",", "")))
    prefix = sorted(statistics.median(v) for v in gains.values())

    text = _measured()
    m = re.search(r"single stream (\d\.\d\d)x, (\d\.\d\d)x and (\d\.\d\d)x `generate_step` on three machines "
                  r"\(each the median of 6 alternating rounds, `--repeat 6`; (\d\.\d\d)x over all 18\), and "
                  r"(\d\.\d\d)x / (\d\.\d\d)x / (\d\.\d\d)x `BatchGenerator` at 8 / 32 / 64 requests \(one round\); "
                  r"prefix caching gives a (\d\.\d)-(\d\.\d)x better time to first token", text)
    assert m, "README's serving bullet no longer states the H200 ratios in its sentence"
    said = [float(x) for x in m.groups()]
    want = [*medians, overall, *vs_bg]
    assert len(per_round) == 3 and sum(len(v) for v in per_round) == 18
    for got, w in zip(said[:7], want):
        assert abs(got - w) <= 0.0051, f"README says {got}x; docs/serving.md's tables give {w:.3f}x"
    assert said[7:] == [round(prefix[0], 1), round(prefix[-1], 1)], (said[7:], prefix)


def test_h200_prefill_figures_equal_the_forty_eighth_session_table():
    """The README's prefill bullet, recomputed from docs/bench-h200-prefill.md's forty-eighth-session suite
    table: `auto` against MLX SDPA on the prefill shapes (the range, in percent), `auto` ahead of torch SDPA
    on each, and the mixed batches' ratios in the table's order."""
    doc = (ROOT / "docs" / "bench-h200-prefill.md").read_text()
    header, *rows = _table_after(doc, "## Forty-eighth session (2026-12-07): the suite on the H200 again")
    col = header.index("`auto` / MLX SDPA (time)")
    prefill = [r for r in rows if not r[0].startswith("mixed")]
    mixed = [r for r in rows if r[0].startswith("mixed")]
    pct = [str(round(100 * float(_num(r[col], r"^\**(\d\.\d\d)")))) for r in prefill]
    figure = lambda cell: float(cell.replace(",", ""))  # noqa: E731
    ahead = all(figure(r[header.index("`auto`")]) > figure(r[header.index("torch SDPA")]) for r in prefill)
    mix = [_num(r[col], r"^\**(\d\.\d\d)") for r in mixed]
    assert ahead, "the README says `auto` is ahead of torch SDPA on every prefill shape"
    phrases = [f"`auto` at {_span(pct)}% of MLX SDPA on contiguous K/V on all {len(prefill)} prefill shapes",
               f"mixed batches at {mix[0]}x, {mix[1]}x and {mix[2]}x MLX SDPA contiguous in that reading"]
    for phrase in phrases:
        assert phrase in _measured(), f"README's prefill bullet should say {phrase!r}"


def test_h100_finish_in_place_figures_equal_the_whole_calls_table():
    """The README's thirty-third-session sentence, recomputed from docs/bench-h200-prefill.md's "Whole
    calls" table: the span of the queued readings on the gathered shapes with the finish in place and
    with the copying finish (each cell "in place (copying)"), and the 64-row chunk's two readings."""
    doc = (ROOT / "docs" / "bench-h200-prefill.md").read_text()
    header, *rows = _table_after(doc, "**Whole calls.**")
    cells = [r[header.index(c)] for r in rows for c in ("queued, reading 1", "queued, reading 2")
             if not r[0].startswith("q64")]
    pct = lambda x: str(round(float(x) * 100))  # noqa: E731
    ours = _span([pct(_num(c, r"^(\d\.\d\d) ")) for c in cells])
    copying = _span([pct(_num(c, r"\((\d\.\d\d)\)")) for c in cells])
    (chunk,) = [r for r in rows if r[0].startswith("q64")]
    first, second = (pct(_num(chunk[header.index(c)], r"^(\d\.\d\d) ")) for c in ("queued, reading 1",
                                                                                     "queued, reading 2"))
    phrase = (f"queued calls at {ours}% of MLX SDPA on the {len(cells) // 2} gathered shapes in two readings of "
              f"one run, {copying}% with the copying finish in the same run; the 64-row chunk after 2K (the "
              f"tiles' route, no finish) at {first}% and {second}%")
    assert phrase in _measured(), f"README's prefill bullet should say {phrase!r}"


def test_h100_counted_finish_figures_equal_the_finish_table():
    """The README's forty-third-session sentence, recomputed from docs/bench-h200-prefill.md's table of
    `sdpa_finish`'s GPU time: the span of counted / before in place, and the q4096 and b8 q2048 pairs."""
    doc = (ROOT / "docs" / "bench-h200-prefill.md").read_text()
    header, *rows = _table_after(doc, "## Forty-third session")
    before, counted = header.index("in place: before"), header.index("in place: counted")
    times = {r[0]: (float(_num(r[before], r"([\d.]+) µs")), float(_num(r[counted], r"([\d.]+) µs"))) for r in rows}
    ratios = [f"{c / b:.2f}" for b, c in times.values()]
    q, b8 = times["q4096"], times["b8 q2048"]
    phrase = (f"the in-place finish takes {min(ratios)}-{max(ratios)}x its former GPU time ({q[1]} µs against "
              f"{q[0]} at q4096, {b8[1]} against {b8[0]} at b8 q2048)")
    assert phrase in _measured(), f"README's prefill bullet should say {phrase!r}"


def test_h100_idle_commit_figures_equal_the_cuda_ops_table():
    """The README's thirty-fourth-session sentence, recomputed from docs/cuda-ops.md's "Starting an idle GPU"
    table: per shape, the span of the readings with the rule and of the setting off's (a shape a reading
    left out is "-")."""
    doc = (ROOT / "docs" / "cuda-ops.md").read_text()
    header, *rows = _table_after(doc, "## Starting an idle GPU")
    on_cols = [c for c in header if c.startswith("reading")]
    assert len(on_cols) == 4, header
    spans = {}
    for r in rows:
        on = _span([r[header.index(c)] for c in on_cols if r[header.index(c)] != "-"])
        off = _span([x.strip() for x in r[header.index("setting off, same runs")].split(",")])
        spans[r[0].split(" x32")[0]] = (on, off)
    (b1,) = [v for k, v in spans.items() if k.startswith("b1 h32/8")]
    (b8,) = [v for k, v in spans.items() if k.startswith("b8 h32/8 d128 L4096")]
    (b16,) = [v for k, v in spans.items() if k.startswith("b16")]
    phrase = (f"the compiled step at {b1[0]}x torch on b1 L32768 ({b1[1]}x with it off, same runs), {b8[0]}x on "
              f"b8 L4096 ({b8[1]}x) and {b16[0]}x on b16 16/2 ({b16[1]}x), four readings on three machines")
    assert phrase in _measured(), f"README's decode-step bullet should say {phrase!r}"
