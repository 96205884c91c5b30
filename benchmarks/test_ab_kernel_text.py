"""`benchmarks/ab_kernel_text.py`: the run order, the per-shape figures and summary, the refusals, and one
real A/B of two kernel-text folders on the CPU (the smoke suite's smallest decode shape)."""

from __future__ import annotations

import shutil

import ab_kernel_text as ab
import pytest

from metal_attn._layout import kernels_dir


def _run(shape_ratios: dict[str, tuple[float, float, float | None]]) -> dict:
    """A bench JSON with one suite: per label, (candidate median s, peer median s, fraction of the ceiling)."""
    results = []
    for label, (cand, peer, frac) in shape_ratios.items():
        results.append({"shape": {"label": label}, "candidates": [
            {"name": "auto", "median_s": cand, "fraction_of_ceiling": frac},
            {"name": "torch_sdpa", "median_s": peer},
        ]})
    return {"suites": [{"results": results}]}


def test_the_sides_alternate_which_goes_first():
    assert ab.order(3) == [(0, "base"), (0, "new"), (1, "new"), (1, "base"), (2, "base"), (2, "new")]


def test_a_shape_figure_is_the_peer_over_the_candidate_and_none_without_a_time():
    run = _run({"a": (2.0, 3.0, 0.5), "b": (None, 1.0, None)})
    assert ab.shape_figures(run, "auto", "torch_sdpa") == {"a": (1.5, 0.5), "b": (None, None)}
    assert ab.shape_figures(run, "auto", "not_there") == {"a": (None, 0.5), "b": (None, None)}


def test_the_summary_gives_each_sides_median_and_new_over_base():
    runs = {
        (0, "base"): _run({"s": (1.0, 1.0, 0.60)}),
        (0, "new"): _run({"s": (1.0, 1.2, 0.70)}),
        (1, "new"): _run({"s": (1.0, 1.1, 0.66)}),
        (1, "base"): _run({"s": (1.0, 0.9, 0.55)}),
    }
    lines = ab.summarize(runs, "auto", "torch_sdpa")
    assert "auto vs torch_sdpa" in lines[0]
    (line,) = lines[1:]
    assert "base [1.000, 0.900] median 0.950; 57.5% of the ceiling" in line
    assert "new [1.200, 1.100] median 1.150; 68.0% of the ceiling" in line
    assert line.endswith(f"new / base {1.15 / 0.95:.3f}")


def test_a_shape_one_side_could_not_time_has_no_gain():
    runs = {(0, "base"): _run({"s": (None, 1.0, None)}), (0, "new"): _run({"s": (1.0, 1.0, None)})}
    (line,) = ab.summarize(runs, "auto", "torch_sdpa")[1:]
    assert "base [-]" in line and line.endswith("new / base -")


@pytest.mark.parametrize(("argv", "needle"), [
    (["{tmp}", "{tmp}/out", "--", "--suite", "smoke"], "holds no kernel texts"),
    (["{kern}", "{tmp}/out", "--rounds", "0", "--", "--suite", "smoke"], "--rounds=0"),
    (["{kern}", "{tmp}/out", "--new-dir", "{tmp}", "--", "--suite", "smoke"], "--new-dir="),
    (["{kern}", "{tmp}/out"], "after '--'"),
    (["{kern}", "{tmp}/out", "--", "--suite", "smoke", "--json", "x.json"], "without --json"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, capsys, argv, needle):
    argv = [a.format(tmp=tmp_path, kern=kernels_dir()) for a in argv]
    with pytest.raises(SystemExit) as exc:
        ab.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_real_ab_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("METAL_ATTN_PLUGIN_AUTOLOAD", "0")
    base = tmp_path / "base"
    shutil.copytree(kernels_dir(), base)
    out = tmp_path / "out"
    rc = ab.main([str(base), str(out), "--rounds", "1", "--peer", "mlx_sdpa", "--new-dir", str(base), "--",
                  "--suite", "smoke", "--candidates", "auto,mlx_sdpa", "--shapes", "decode b3", "--iters", "1",
                  "--warmup", "1", "--quiet"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["base-0.json", "new-0.json"]
    text = capsys.readouterr().out
    assert "decode b3 h4/2 d64 L100 f32: base [" in text and "new / base " in text
