"""The environment recorded with every result row (GPU, driver, CUDA, library versions, git SHA), and the device
slug that names a machine's results folder. One module for the kernel benchmark (``environment()``) and the
TTFT harness (``capture_env(device)``, which adds the device the run used)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

import torch

from llm_attn._ext import kernel_available, kernel_build

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO = REPO_ROOT  # older name


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


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    """Full SHA of HEAD and whether tracked files differ from it; ``$LLM_ATTN_GIT_SHA`` where the tree is a copy
    without .git (a GPU machine that receives the working tree)."""
    if not (REPO_ROOT / ".git").exists():
        return {"git_sha": os.environ.get("LLM_ATTN_GIT_SHA"), "git_dirty": None}
    sha = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"git_sha": sha or None, "git_dirty": bool(status) if status is not None else None}


def git_sha() -> str | None:
    """Short SHA of HEAD with '-dirty' when tracked files changed (or $LLM_ATTN_GIT_SHA without .git)."""
    info = git_info()
    sha = info["git_sha"]
    if not sha or not (REPO_ROOT / ".git").exists():
        return sha
    return sha[:12] + ("-dirty" if info["git_dirty"] else "")


def _driver() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=10)
    return out.splitlines()[0] if out else None


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    """The machine-wide environment (what the kernel benchmark records with each row)."""
    env = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "transformers": _version("transformers"),
        "gptqmodel": _version("gptqmodel"),
        "autoawq": _version("autoawq"),
        "triton": _version("triton"),
        "numba_cuda": _version("numba-cuda"),
        "llm_attn_git": git_sha(),
        "kernel_build": kernel_build(),  # 'aot', 'nvrtc' or None (no kernel); 'kernel_backend' in schema 1 rows
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   driver=_driver())
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


@functools.lru_cache(maxsize=4)
def capture_env(device: str) -> dict:
    """Everything needed to judge or reproduce a TTFT row: ``environment()`` plus the device the run used and its
    slug, the full SHA, more library versions and whether our kernel is built. Cached per device: it does not
    change during a run, and nvidia-smi costs a subprocess."""
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
        "llm_attn_kernel_build": kernel_build(),  # 'aot' or 'nvrtc' (LLM_ATTN_BACKEND), None without one
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
