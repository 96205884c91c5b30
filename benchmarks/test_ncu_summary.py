"""`benchmarks/ncu_summary.py` on a small ncu --csv log: the metric rows it keeps and the lines it skips."""

from __future__ import annotations

import ncu_summary

LOG = '''==PROF== Connected to process 1 (/usr/bin/python3)
ours: classic route=per_token_ps512
"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"
"0","ma_paged_attention(int, float *)","GPU Speed Of Light Throughput","Duration","us","40.10"
"0","ma_paged_attention(int, float *)","GPU Speed Of Light Throughput","DRAM Throughput","%","72.31"
"0","ma_paged_attention(int, float *)","GPU Speed Of Light Throughput","SM Frequency","Ghz","1.98"
"1","lean_reduction","Launch Statistics","Grid Size","","256"
'''


def test_it_keeps_the_headline_metrics_and_skips_the_program_output(tmp_path, capsys):
    log = tmp_path / "ours.csv"
    log.write_text(LOG)
    assert ncu_summary.rows(str(log)) == [
        ("ma_paged_attention(int, float *)", "Duration", "40.10", "us"),
        ("ma_paged_attention(int, float *)", "DRAM Throughput", "72.31", "%"),
        ("lean_reduction", "Grid Size", "256", ""),
    ]
    assert ncu_summary.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "Duration" in out and "40.10" in out and "SM Frequency" not in out


def test_no_log_prints_the_usage(capsys):
    assert ncu_summary.main([]) == 2
    assert "ncu_summary.py ours.csv torch.csv" in capsys.readouterr().err
