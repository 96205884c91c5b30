"""`benchmarks/probe_sdpa_bias.py` without a GPU: its argument parsing, and the meaning of its mask: the stacked
call with it gives what one causal call per run gives (MLX's CPU SDPA, unfused; the cuDNN bias path itself
runs only on the GPU)."""

from __future__ import annotations

import mlx.core as mx
import probe_sdpa_bias as pb
import pytest


def test_runs_parse_and_a_bad_one_is_named():
    assert pb.parse_runs("256@1024,256@2048") == [(256, 1024), (256, 2048)]
    for bad, part in (("256@1024,300@200", "'300@200'"), ("x@4,2@4", "'x@4'")):
        with pytest.raises(ValueError, match=part):
            pb.parse_runs(bad)
    for bad in ("256@1024", "256@1024,128@2048"):
        with pytest.raises(ValueError, match="two or more runs of one query length"):
            pb.parse_runs(bad)


def test_heads_parse_and_a_bad_pair_is_named():
    assert pb.parse_heads("32/8") == (32, 8)
    for bad in ("32", "32/0", "32/5", "a/b"):
        with pytest.raises(ValueError, match=f"--heads '{bad}'"):
            pb.parse_heads(bad)


def test_the_mask_keeps_each_runs_own_bottom_right_causal_pairs_and_never_the_padding():
    keep = pb.attended([(2, 3), (2, 5)])
    assert keep.shape == (2, 1, 2, 5)
    assert keep[0, 0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]
    assert keep[1, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


@pytest.mark.parametrize("runs", [[(4, 8), (4, 16)], [(3, 3), (3, 9), (3, 5)]])
def test_one_masked_call_equals_one_causal_call_per_run(runs):
    fns, kv_bytes = pb.variants(runs, heads=4, kv_heads=2, head=16, force_fused=False)
    assert [label for label, _ in fns] == ["per_run", "masked"]
    assert kv_bytes == sum(2 * 2 * k * 16 * 2 for _, k in runs)
    per_run = fns[0][1]()
    assert [o.shape for o in per_run] == [(runs[0][0], 4, 16)] * len(runs)  # packed rows, one array a run
    ref = pb.stacked_output(per_run).astype(mx.float32)
    got = pb.stacked_output(fns[1][1]()).astype(mx.float32)
    assert got.shape == ref.shape == (len(runs) * runs[0][0], 4, 16)
    assert mx.max(mx.abs(got - ref)).item() <= pb.TOLERANCE
    # and the mask matters: without it the padded zeros and the later keys are attended
    _, (q, k, v) = pb.operands(runs, heads=4, kv_heads=2, head=16)
    unmasked = mx.fast.scaled_dot_product_attention(q, k, v, scale=16 ** -0.5).transpose(0, 2, 1, 3)
    assert mx.max(mx.abs(unmasked.reshape(got.shape).astype(mx.float32) - ref)).item() > 10 * pb.TOLERANCE


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    for argv, said in ((["--head", "12"], "--head 12 (allowed: a positive multiple of 8"),
                       (["--rounds", "0"], "--rounds 0 (allowed: 1 or more)"),
                       (["--runs", "256@1024"], "two or more runs of one query length")):
        with pytest.raises(SystemExit) as exc:
            pb.main([str(tmp_path / "out.json"), *argv])
        assert exc.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
