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
    r = mod.phase_rows(s)  # the zero row (a block past the grid) is left out
    assert r["blocks"] == 2 and r["SMs"] == 2
    assert r["Q staged"] == 1.0 and r["first tile"] == 2.0 and r["tile loop"] == 11.0
    assert r["merge + partials"] == 1.0 and r["fence + count"] == 1.5 and r["combine (last blocks)"] == 3.0
    assert r["entry ramp"] == 1.0 and r["stamped span"] == 22.0 and r["block time (median)"] == 18.0


def test_bad_arguments_are_one_line():
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "decode_phases.py"), "--kv", "0"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "must be positive" in p.stderr and "Traceback" not in p.stderr
