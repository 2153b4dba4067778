"""experiments/decode_gap.py's ncu parsing (CPU): kernels split at the marker kernels, mapped back to (shape, impl),
and the graph-minus-kernel column (issue 19's decode gap reading).

    pytest tests/test_decode_gap.py
"""

from __future__ import annotations

import json

import pytest

from conftest import load_script

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed"
"","","","nsecond","%"
"0","1","spin_kernel(long)","1000","0"
"1","1","void llm_attn::flash_decode_kernel<__nv_bfloat16, llm_attn::DecodeTraits<128, 1, 3>>(llm_attn::FlashFwdParams)","9,000","40"
"2","1","spin_kernel(long)","1000","0"
"3","1","cudnn_generated_sdpa_a(x)","5000","50"
"4","1","cudnn_generated_sdpa_b(x)","2000","10"
'''


def _mod():
    return load_script("experiments/decode_gap.py")


def test_kernels_are_assigned_to_calls_by_markers(tmp_path, capsys):
    (tmp_path / "ncu.csv").write_text(CSV)
    order = [dict(batch=1, kv_len=2048, impl="ours"), dict(batch=1, kv_len=2048, impl="cudnn")]
    (tmp_path / "order.json").write_text(json.dumps(order))
    (tmp_path / "t.json").write_text(json.dumps({"rows": [{"batch": 1, "kv_len": 2048,
                                                           "us": {"ours": 11.5, "cudnn": 8.8}}]}))
    assert _mod().main(["--parse-ncu", str(tmp_path / "ncu.csv"), "--order", str(tmp_path / "order.json"),
                        "--timing", str(tmp_path / "t.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2
    assert "| ours |" in rows[0] and "| 9.00 | 40 | 11.50 | 2.50 |" in rows[0]
    # Two kernels of one SDPA call add up; the DRAM column is the busiest of them.
    assert "| cudnn |" in rows[1] and "| 7.00 | 50 | 8.80 | 1.80 |" in rows[1]


def test_a_marker_count_that_does_not_match_the_order_is_an_error(tmp_path):
    (tmp_path / "ncu.csv").write_text(CSV)
    (tmp_path / "order.json").write_text(json.dumps([dict(batch=1, kv_len=2048, impl="ours")]))
    with pytest.raises(SystemExit, match="2 marked calls, 1 expected"):
        _mod().main(["--parse-ncu", str(tmp_path / "ncu.csv"), "--order", str(tmp_path / "order.json")])
