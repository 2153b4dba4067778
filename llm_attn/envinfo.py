"""The environment recorded with every benchmark row: GPU, driver, CUDA, library versions, git SHA."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from llm_attn._ext import kernel_backend

REPO = Path(__file__).resolve().parent.parent


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    """HEAD of this checkout (with -dirty), or $LLM_ATTN_GIT_SHA where the tree is a copy without .git (a GPU
    machine that receives the working tree)."""
    if not (REPO / ".git").exists():
        return os.environ.get("LLM_ATTN_GIT_SHA")
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) if sha else None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    env = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "transformers": _version("transformers"),
        "gptqmodel": _version("gptqmodel"),
        "autoawq": _version("autoawq"),
        "llm_attn_git": git_sha(),
        "kernel_backend": kernel_backend(),  # 'aot', 'nvrtc' or None (no kernel)
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   driver=_driver())
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env
