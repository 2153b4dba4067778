"""Where the ranks of a tensor-parallel run live and how they talk: each rank's identity (``rank_env``) and the
interconnect between their GPUs, read from ``nvidia-smi topo -m`` (``parse_topo``, ``interconnect``).

    python -c "from llm_attn.harness.tp_topology import interconnect; print(interconnect('cuda', 2))"

``nvidia-smi topo -m`` prints a matrix: a header row of device names (GPUs, then NICs), then one row per device
with its link to every other one, then CPU/NUMA affinity columns. On a terminal (and on the lent machines, which
give it a pseudo-terminal) nvidia-smi underlines the header with ANSI escapes: ``\\t\\x1b[4mGPU0\\tGPU1...\\x1b[0m``.
The escapes are stripped before anything is read, and the matrix is read by position (the n-th cell of a row
belongs to the n-th device of the header), never by searching names in the header: an escape glued to ``GPU0``
once hid it, shifted every column by one and turned an NVLink pair into ``PCIe`` with ``{"0-1": "X"}`` (issue 36).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

import torch

# Environment variables recorded per rank (prefixes end with '_').
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_",
            "TORCHELASTIC_RUN_ID")

# nvidia-smi's legend, for the rows: what each link code means.
LINKS = {
    "NV": "NVLink (a bonded set of # links)",
    "PIX": "PCIe through at most one PCIe bridge",
    "PXB": "PCIe through several PCIe bridges, not the host bridge",
    "PHB": "PCIe through a PCIe host bridge (the CPU)",
    "NODE": "PCIe and the interconnect between host bridges of one NUMA node",
    "SYS": "PCIe and the SMP interconnect between NUMA nodes (QPI/UPI/Infinity Fabric)",
    "SOC": "PCIe and the CPU socket interconnect (older drivers' SYS)",
}
_LINK = re.compile(r"^(X|NV\d+|SYS|NODE|PHB|PXB|PIX|SOC)$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# A device column of the header: GPU0, NIC3, or an older driver's NIC name (mlx5_0). "CPU Affinity" and the other
# trailing columns are words without a trailing digit, which ends the device columns.
_DEVICE_COLUMN = re.compile(r"^[A-Za-z][A-Za-z0-9_]*\d$")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank_env(device: torch.device, backend: str) -> dict:
    """What identifies one rank: its ids, host, process, device and the distributed settings in its environment."""
    env = {k: v for k, v in sorted(os.environ.items())
           if any(k == p or (p.endswith("_") and k.startswith(p)) for p in RANK_ENV)}
    out = {"rank": int(os.environ.get("RANK", 0)), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
           "hostname": socket.gethostname(), "pid": os.getpid(), "device": str(device), "backend": backend,
           "torch_threads": torch.get_num_threads(), "env": env}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(device_name=props.name, gpu_memory_bytes=props.total_memory,
                   pci_bus_id=getattr(props, "pci_bus_id", None), uuid=str(getattr(props, "uuid", "")) or None)
    else:
        out["device_name"] = "cpu"
    return out


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (nvidia-smi underlines the topology header with them)."""
    return _ANSI.sub("", text)


def link_kind(cell: str) -> str:
    """'NVLink' for NV#, 'PCIe' for the PCIe paths, 'self' for X."""
    return "self" if cell == "X" else "NVLink" if cell.startswith("NV") else "PCIe"


def describe_link(cell: str) -> str:
    """nvidia-smi's legend for one link code: 'NV18' -> 'NVLink x18', 'PHB' -> 'PCIe through a PCIe host bridge...'."""
    if cell.startswith("NV"):
        return f"NVLink x{cell[2:]}"
    return LINKS.get(cell, cell)


def parse_topo(text: str, gpus: list[int] | None = None) -> dict:
    """``nvidia-smi topo -m`` -> ``{"kind": "NVLink"|"PCIe"|"mixed"|"unknown", "links": {"0-1": "NV18", ...}}``.

    NV# is NVLink (# bonded links); PIX/PXB/PHB/NODE/SYS are PCIe paths (through switches, the host bridge, or
    across CPU sockets). ``gpus`` restricts to those physical indices (the ranks' GPUs). Terminal escapes are
    stripped first; the header's device columns are its leading names (GPU#, NIC#), and the n-th cell of a GPU row
    is its link to the n-th of them."""
    lines = [strip_ansi(ln).rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    rows = [ln.split() for ln in lines]
    # The header is the line whose first name is GPU0 and that is not a matrix row (a row's second cell is a link).
    header = next((r for r in rows if r and re.fullmatch(r"GPU\d+", r[0])
                   and not (len(r) > 1 and _LINK.match(r[1]))), None)
    if header is None:
        return {"kind": "unknown", "links": {}}
    columns = []
    for name in header:
        if not _DEVICE_COLUMN.match(name):
            break
        columns.append(name)
    links = {}
    for r in rows:
        if r is header or not r or not re.fullmatch(r"GPU\d+", r[0]):
            continue
        i = int(r[0][3:])
        for col, cell in zip(columns, r[1:]):
            m = re.fullmatch(r"GPU(\d+)", col)
            if not m or not _LINK.match(cell):
                continue
            j = int(m.group(1))
            if i < j and (gpus is None or (i in gpus and j in gpus)):
                links[f"{i}-{j}"] = cell
    kinds = {link_kind(v) for v in links.values()}
    kind = "unknown" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
    return {"kind": kind, "links": links}


def _physical_indices(visible: str | None, world: int) -> list[int] | None:
    """The nvidia-smi indices of the first ``world`` visible GPUs: CUDA_VISIBLE_DEVICES as indices, as UUIDs
    (mapped through ``nvidia-smi --query-gpu=index,uuid``), or all GPUs from 0. None where they cannot be mapped."""
    if not visible:
        return list(range(world))
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if all(v.isdigit() for v in entries):
        return [int(v) for v in entries][:world]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    by_uuid = {}
    for line in out.splitlines():
        idx, _, uuid = (p.strip() for p in line.partition(","))
        if idx.isdigit():
            by_uuid[uuid] = int(idx)
    found = [next((i for u, i in by_uuid.items() if u.startswith(e)), None) for e in entries[:world]]
    return None if None in found else found


def interconnect(device_type: str, world: int) -> dict:
    """How the ranks talk: gloo on one host for CPU runs; NVLink/PCIe between the ranks' GPUs for CUDA runs, with
    ``nvidia-smi topo -m``'s text kept (escapes and all) so a row can be re-read."""
    if device_type != "cuda":
        return {"kind": "gloo (CPU, one host)" if world > 1 else "none", "links": {}}
    if world <= 1:
        return {"kind": "none (one GPU)", "links": {}}
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"kind": "unknown", "links": {}, "error": f"nvidia-smi topo -m: {e}"}
    gpus = _physical_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), world)
    parsed = parse_topo(text, gpus)
    return {**parsed, "detail": {k: describe_link(v) for k, v in parsed["links"].items()}, "gpus": gpus,
            "topo": text}

