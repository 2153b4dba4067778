"""experiments/decode_phases.py on the CPU: the instrumented copy (every anchor found once in both decode kernels, so
an edit of a kernel cannot silently drop a stamp), the phase arithmetic on made-up stamps, and bad arguments.

    pytest tests/test_decode_phases.py
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO as ROOT, load_script


def _mod():
    return load_script("experiments/decode_phases.py")


def test_the_copy_stamps_every_phase_of_both_kernels(tmp_path):
    mod = _mod()
    mod.make_copy(tmp_path / "copy")
    for name in ("flash_decode_kernel.cuh", "flash_decode_fp8kv_kernel.cuh"):
        src = (tmp_path / "copy" / "kernels" / name).read_text()
        for k in range(7):
            assert src.count(f"llm_attn_phase({k});") == 1, (name, k)
        assert (ROOT / "kernels" / name).read_text().count("llm_attn_phase") == 0  # the tree is untouched
    assert (tmp_path / "copy" / "llm_attn" / "patches").resolve() == (tmp_path / "copy" / "patches").resolve()


def test_a_moved_anchor_is_one_line():
    with pytest.raises(SystemExit, match="anchor found 0 times"):
        _mod().instrument("namespace llm_attn {\n", "no such body", "x", "y")


def test_phase_rows_of_made_up_stamps():
    mod = _mod()
    # Two blocks on two SMs (ns): block 1 enters 1 us later and is the last to count, so it combines.
    s = np.zeros((3, mod.SLOTS), dtype=np.int64)
    s[0, :7] = [1000, 2000, 4000, 14000, 15000, 16000, 0]
    s[1, :7] = [2000, 3000, 5000, 17000, 18000, 20000, 23000]
    s[0, 7], s[1, 7] = 5, 9
    r = mod.phase_rows(s, 1)  # the zero row (a block past the grid) is left out
    assert r["blocks"] == 2 and r["SMs"] == 2
    assert r["Q staged"] == 1.0 and r["first tile"] == 2.0 and r["tile loop"] == 11.0
    assert r["merge + partials"] == 1.0 and r["fence + count"] == 1.5 and r["combine (last blocks)"] == 3.0
    assert r["entry ramp"] == 1.0 and r["stamped span"] == 22.0 and r["block time (median)"] == 18.0


def test_where_the_tile_loops_end_of_made_up_stamps():
    """Four blocks, 2 splits x 2 KV heads (block b is split b % 2): blocks 0 and 1 share SM 5, blocks 2 and 3 are alone
    on theirs; loop ends (from the first entry) 10, 12, 6, 8 us."""
    mod = _mod()
    s = np.zeros((4, mod.SLOTS), dtype=np.int64)
    for b, (entry, end, sm) in enumerate([(1000, 11000, 5), (1000, 13000, 5), (2000, 7000, 7), (1000, 9000, 9)]):
        s[b, :6] = [entry, entry + 500, entry + 700, end, end + 500, end + 900]
        s[b, 7] = sm
    r = mod.phase_rows(s, 2)
    assert r["tile loop end, p50"] == 9.0 and r["tile loop end, p10"] == np.percentile([10, 12, 6, 8], 10)
    assert r["tile loop end, blocks sharing an SM (2)"] == 11.0 and r["tile loop end, blocks alone on an SM (2)"] == 7.0
    assert r["tile loop end, later half of the splits - earlier"] == (12 + 8) / 2 - (10 + 6) / 2


def test_bad_arguments_are_one_line():
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "decode_phases.py"), "--kv", "0"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "must be positive" in p.stderr and "Traceback" not in p.stderr
