"""`benchmarks/probe_sdpa_bias.py` without a GPU: its run parsing, its mask, and the masked single call giving
what one causal call per run gives (MLX's CPU SDPA), so the probe's GPU figures compare like with like."""

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
    fns, kv_bytes = pb.variants(runs, heads=4, kv_heads=2, head=16)
    assert [label for label, _ in fns] == ["per_run", "additive", "boolean"]
    assert kv_bytes == sum(2 * 2 * k * 16 * 2 for _, k in runs)
    ref = pb.stacked_output(fns[0][1]()).astype(mx.float32)
    assert ref.shape == (len(runs), 4, runs[0][0], 16)
    for label, fn in fns[1:]:
        got = pb.stacked_output(fn()).astype(mx.float32)
        assert mx.allclose(got, ref, atol=2e-2, rtol=2e-2).item(), label
    # and the mask matters: without it the padded zeros and the later keys are attended
    _, stacked = pb.operands(runs, heads=4, kv_heads=2, head=16)
    unmasked = mx.fast.scaled_dot_product_attention(*stacked, scale=16 ** -0.5).astype(mx.float32)
    assert not mx.allclose(unmasked, ref, atol=2e-2, rtol=2e-2).item()

