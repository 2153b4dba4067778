"""The environment recorded with every result row, and the device slug that names a machine's results folder."""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; 'NVIDIA GeForce RTX 4060 Ti' -> 'rtx-4060-ti'; 'cpu' -> 'cpu'."""
    s = name.lower()
    for vendor in ("nvidia ", "geforce "):
        s = s.replace(vendor, "")
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    if not s:
        raise ValueError(f"cannot make a device slug from {name!r}")
    return s


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    sha = _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


@functools.lru_cache(maxsize=4)
def capture_env(device: str) -> dict:
    """Everything needed to judge or reproduce a number: the project-wide environment (``llm_attn.envinfo``: GPU,
    compute capability, SMs, driver, CUDA, torch, transformers, AWQ packages, git SHA, hostname) plus what this
    harness adds: the device the run used and its slug, the full SHA, more library versions, whether our kernel
    is built. Cached per device: it does not change during a run, and nvidia-smi costs a subprocess."""
    from llm_attn import kernel_available  # noqa: PLC0415 (keeps this module importable on its own)
    from llm_attn.envinfo import environment  # noqa: PLC0415

    dev = torch.device(device)
    env = dict(environment())
    env.update({
        "device_type": dev.type,
        "device_name": device_name(dev),
        "device_slug": device_slug(device_name(dev)),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "accelerate": _version("accelerate"),
        "flash_attn": _version("flash-attn"),
        "llm_attn": _version("llm-attn"),
        "llm_attn_kernel_built": kernel_available(),
        **git_info(),
    })
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update({
            "compute_capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "gpu_memory_bytes": props.total_memory,
            "cudnn": torch.backends.cudnn.version(),
        })
    return env
