"""``nvidia-smi topo -m`` as the tensor-parallel rows read it (llm_attn/harness/tp_topology.py), on captures as
nvidia-smi prints them on a terminal: the header underlined with ANSI escapes (``\\t\\x1b[4mGPU0\\tGPU1...\\x1b[0m``),
tab-separated cells, `` X `` on the diagonal, NIC columns, CPU/NUMA affinity columns and the legend after the matrix.

Issue 36: an escape glued to ``GPU0`` hid it from the header, the columns shifted by one, and every TP=2 row of an
NVLink H100 pair said ``PCIe`` with ``links: {"0-1": "X"}``.

    pytest tests/test_tp_topology.py
"""

from __future__ import annotations

import pytest

from llm_attn.harness.tp_topology import describe_link, interconnect, parse_topo, strip_ansi

UNDERLINE, RESET = "\x1b[4m", "\x1b[0m"
LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def capture(header: list[str], rows: list[list[str]], nic_legend: str = "") -> str:
    """A matrix as nvidia-smi writes it to a terminal: an indented, underlined, tab-separated header; rows of tab-
    separated cells; the legend."""
    lines = ["\t" + UNDERLINE + "\t".join(header) + RESET]
    lines += ["\t".join(r) for r in rows]
    return "\n".join(lines) + "\n" + LEGEND + nic_legend


# Two H100 SXM of an HGX board, as the lent nvidia-h100-x2 machine shows them (issue 36's capture).
H100_X2_NVLINK = capture(
    ["GPU0", "GPU1", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
    [["GPU0", " X ", "NV18", "0-15", "0", "", "N/A"],
     ["GPU1", "NV18", " X ", "0-15", "0", "", "N/A"]])

# Eight H100 SXM with NVSwitch and four NICs (a DGX H100's shape): NV18 everywhere, NICs on PIX/SYS paths.
H100_X8_NICS = capture(
    [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(4)] + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
    [[f"GPU{i}"] + [" X " if j == i else "NV18" for j in range(8)]
     + ["PIX" if n == i // 2 else "SYS" for n in range(4)]
     + ["0-55,112-167" if i < 4 else "56-111,168-223", "0" if i < 4 else "1", "", "N/A"] for i in range(8)]
    + [[f"NIC{n}"] + ["PIX" if n == i // 2 else "SYS" for i in range(8)]
       + [" X " if m == n else "SYS" for m in range(4)] for n in range(4)],
    nic_legend="\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n  NIC2: mlx5_2\n  NIC3: mlx5_3\n")

# Four PCIe cards (L40S-style server): pairs behind one switch (PIX), pairs of switches (PXB), the two NUMA nodes (SYS).
PCIE_X4 = capture(
    ["GPU0", "GPU1", "GPU2", "GPU3", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
    [["GPU0", " X ", "PIX", "SYS", "SYS", "0-31,64-95", "0", "", "N/A"],
     ["GPU1", "PIX", " X ", "SYS", "SYS", "0-31,64-95", "0", "", "N/A"],
     ["GPU2", "SYS", "SYS", " X ", "PXB", "32-63,96-127", "1", "", "N/A"],
     ["GPU3", "SYS", "SYS", "PXB", " X ", "32-63,96-127", "1", "", "N/A"]])

# Two PCIe cards on one CPU: through the host bridge (PHB), and on another board between host bridges (NODE).
PCIE_X2_PHB = capture(
    ["GPU0", "GPU1", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
    [["GPU0", " X ", "PHB", "0-23", "0", "", "N/A"],
     ["GPU1", "PHB", " X ", "0-23", "0", "", "N/A"]])
PCIE_X2_NODE = PCIE_X2_PHB.replace("PHB", "NODE")

# An older driver: NICs named by device (mlx5_0), no GPU NUMA ID column.
OLD_DRIVER = capture(
    ["GPU0", "GPU1", "mlx5_0", "CPU Affinity", "NUMA Affinity"],
    [["GPU0", " X ", "NV4", "PXB", "0-19,40-59", "0"],
     ["GPU1", "NV4", " X ", "PXB", "0-19,40-59", "0"],
     ["mlx5_0", "PXB", "PXB", " X ", "", ""]])


def test_the_captures_carry_nvidia_smis_escapes():
    assert H100_X2_NVLINK.startswith("\t\x1b[4mGPU0\tGPU1\t") and "GPU NUMA ID\x1b[0m\n" in H100_X2_NVLINK
    assert strip_ansi(H100_X2_NVLINK).startswith("\tGPU0\tGPU1\tCPU Affinity")


def test_nvlink_pair_is_nvlink():
    # Issue 36: this capture read {"kind": "PCIe", "links": {"0-1": "X"}}.
    assert parse_topo(H100_X2_NVLINK) == {"kind": "NVLink", "links": {"0-1": "NV18"}}
    assert parse_topo(H100_X2_NVLINK, gpus=[0, 1]) == {"kind": "NVLink", "links": {"0-1": "NV18"}}
    assert describe_link("NV18") == "NVLink x18"


def test_eight_gpus_with_nics():
    got = parse_topo(H100_X8_NICS)
    assert got["kind"] == "NVLink" and len(got["links"]) == 28 and set(got["links"].values()) == {"NV18"}
    assert parse_topo(H100_X8_NICS, gpus=[2, 5]) == {"kind": "NVLink", "links": {"2-5": "NV18"}}


@pytest.mark.parametrize("gpus,links", [
    ([0, 1], {"0-1": "PIX"}),
    ([2, 3], {"2-3": "PXB"}),
    ([1, 2], {"1-2": "SYS"}),
    (None, {"0-1": "PIX", "0-2": "SYS", "0-3": "SYS", "1-2": "SYS", "1-3": "SYS", "2-3": "PXB"}),
])
def test_pcie_paths(gpus, links):
    assert parse_topo(PCIE_X4, gpus=gpus) == {"kind": "PCIe", "links": links}


def test_two_pcie_cards_with_affinity_columns():
    assert parse_topo(PCIE_X2_PHB) == {"kind": "PCIe", "links": {"0-1": "PHB"}}
    assert parse_topo(PCIE_X2_NODE) == {"kind": "PCIe", "links": {"0-1": "NODE"}}
    assert "host bridge" in describe_link("PHB") and "NUMA" in describe_link("SYS")


def test_older_driver_and_plain_text():
    assert parse_topo(OLD_DRIVER) == {"kind": "NVLink", "links": {"0-1": "NV4"}}
    # Without escapes (output to a pipe), and with spaces instead of tabs (as pasted), the same answer.
    plain = strip_ansi(H100_X2_NVLINK)
    assert parse_topo(plain) == {"kind": "NVLink", "links": {"0-1": "NV18"}}
    assert parse_topo(plain.replace("\t", "    ")) == {"kind": "NVLink", "links": {"0-1": "NV18"}}


def test_mixed_and_unknown():
    mixed = capture(["GPU0", "GPU1", "GPU2", "CPU Affinity", "NUMA Affinity"],
                    [["GPU0", " X ", "NV4", "NODE", "0-31", "0"], ["GPU1", "NV4", " X ", "NODE", "0-31", "0"],
                     ["GPU2", "NODE", "NODE", " X ", "0-31", "0"]])
    assert parse_topo(mixed) == {"kind": "mixed", "links": {"0-1": "NV4", "0-2": "NODE", "1-2": "NODE"}}
    assert parse_topo("No devices were found") == {"kind": "unknown", "links": {}}
    one = capture(["GPU0", "CPU Affinity", "NUMA Affinity"], [["GPU0", " X ", "0-15", "0"]])
    assert parse_topo(one) == {"kind": "unknown", "links": {}}


def test_interconnect_reads_nvidia_smi_and_maps_visible_devices(monkeypatch):
    """interconnect() runs nvidia-smi: here a stand-in that prints the 4-card capture; CUDA_VISIBLE_DEVICES=2,3
    means the ranks' GPUs are physical 2 and 3."""
    import subprocess
    import types

    def fake_run(cmd, **kw):
        assert cmd[:3] == ["nvidia-smi", "topo", "-m"]
        return types.SimpleNamespace(stdout=PCIE_X4, returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    got = interconnect("cuda", 2)
    assert (got["kind"], got["links"], got["gpus"]) == ("PCIe", {"2-3": "PXB"}, [2, 3])
    assert got["detail"]["2-3"].startswith("PCIe through several PCIe bridges") and got["topo"] == PCIE_X4
    assert interconnect("cpu", 2)["kind"] == "gloo (CPU, one host)"
