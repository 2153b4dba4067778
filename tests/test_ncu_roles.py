"""experiments/ncu_roles.py on CPU: roles follow control flow (an out-of-line wait loop belongs to the role that
branches to it, code before both entries is the prologue), samples are summed per role and reason, and a file that
is not an ncu source export is a clear error.

    pytest tests/test_ncu_roles.py
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import load_script


def _mod():
    return load_script("experiments/ncu_roles.py")


# (source, all samples, stall_barrier, stall_long_sb, stall_selected): a prologue branching to the producer, the
# consumer's code with a wait loop placed after the producer's, as nvcc lays them out.
SASS = [
    ("LDC R1, c[0x0][0x28]", 5, 0, 0, 5),                      # 0x00 prologue
    ("@!P0  BRA 0x50", 1, 0, 0, 1),                            # 0x10 prologue: the producer branches away
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 2, 0, 0, 2),    # 0x20 consumer entry
    ("@!P1  BRA 0x80", 10, 0, 10, 0),                          # 0x30 consumer: its wait loop is out of line
    ("EXIT", 2, 0, 0, 2),                                      # 0x40 consumer exit
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 1, 0, 0, 1),           # 0x50 producer entry
    ("@!P2  BRA 0x60", 30, 0, 30, 0),                          # 0x60 producer waits
    ("EXIT", 1, 0, 0, 1),                                      # 0x70 producer exit
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 40, 0, 0),           # 0x80 consumer (reached only from 0x30)
    ("BRA 0x30", 1, 0, 0, 1),                                  # 0x90 back into the consumer
]


def _write(path: Path, rows=SASS):
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void k<(int)128>(Params)"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb",
                    "stall_selected", "stall_barrier (Not Issued)"])
        for i, (src, n, bar, lsb, sel) in enumerate(rows):
            w.writerow([hex(i * 0x10), f"      {src}", n, bar, lsb, sel, 999])


def test_roles_follow_control_flow_and_samples_sum_per_role(tmp_path):
    mod = _mod()
    path = tmp_path / "src.csv"
    _write(path)
    name, rows = mod.read_source_csv(path)
    assert name.startswith("void k<")
    assert mod.roles(rows) == ["prologue", "prologue", "consumer", "consumer", "consumer", "producer", "producer",
                               "producer", "consumer", "consumer"]
    total, per = mod.summarise(rows, mod.roles(rows))
    assert total == {"prologue": 6, "consumer": 55, "producer": 32}
    assert per["consumer"] == {"barrier": 40, "long_sb": 10, "selected": 5}  # "(Not Issued)" columns not counted
    text = mod.table("k", total, per)
    assert "| consumer | 59.1 %" in text and "barrier 73 %" in text


def test_kernel_without_both_role_entries_is_a_clear_error(tmp_path):
    mod = _mod()
    path = tmp_path / "src.csv"
    _write(path, [row for row in SASS if "DEALLOC" not in row[0]])
    _, rows = mod.read_source_csv(path)
    with pytest.raises(SystemExit, match="not the warp-specialised kernel"):
        mod.roles(rows)


def test_other_csv_is_a_clear_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not an `ncu --page source"):
        _mod().read_source_csv(path)
