"""The environment behind the noise, sampled at the start and the end of every measurement (``host_env`` in a row).

- GPU SM and memory clocks, whether application or locked clocks are set, and the other processes on the GPU:
  through NVML (``pynvml``, from the ``nvidia-ml-py`` package) when it imports, else ``nvidia-smi --query-gpu``,
  else absent (``source: null`` and the reason).
- CPU frequency and governor of cpu0 from ``/sys/devices/system/cpu/cpu0/cpufreq`` where readable.

``span(start, end)`` puts the two snapshots in a row with the SM clock's change in percent; the summary table
warns where it moved by more than ``CLOCK_MOVED_PCT``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CLOCK_MOVED_PCT = 5.0
CPUFREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_state() -> dict:
    """cpu0's current frequency (MHz) and governor, where the kernel exposes them (absent in many containers)."""
    cur = _read(CPUFREQ / "scaling_cur_freq")
    return {"cpu0_mhz": int(cur) / 1000 if cur and cur.isdigit() else None,
            "governor": _read(CPUFREQ / "scaling_governor"),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _nvml_state(index: int) -> dict:
    import pynvml  # noqa: PLC0415 (optional: nvidia-ml-py)

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        out = {"source": "nvml",
               "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
               "mem_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)}
        try:
            out["app_sm_mhz"] = pynvml.nvmlDeviceGetApplicationsClock(h, pynvml.NVML_CLOCK_SM)
            out["default_app_sm_mhz"] = pynvml.nvmlDeviceGetDefaultApplicationsClock(h, pynvml.NVML_CLOCK_SM)
        except pynvml.NVMLError:
            pass
        try:
            reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        except (AttributeError, pynvml.NVMLError):
            try:
                reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            except pynvml.NVMLError:
                reasons = None
        out["clock_event_reasons"] = reasons
        # Locked clocks show as application clocks set away from their defaults; NVML has no direct "locked" query
        # on every driver, so both facts are recorded.
        app, default = out.get("app_sm_mhz"), out.get("default_app_sm_mhz")
        out["clocks_locked"] = (app != default) if app is not None and default is not None else None
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            me = os.getpid()
            out["other_processes"] = [{"pid": p.pid, "used_bytes": getattr(p, "usedGpuMemory", None)}
                                      for p in procs if p.pid != me]
        except pynvml.NVMLError:
            out["other_processes"] = None
        return out
    finally:
        pynvml.nvmlShutdown()


def _smi_state(index: int) -> dict:
    q = ("clocks.sm,clocks.mem,clocks.applications.graphics,clocks.default_applications.graphics,"
         "clocks_event_reasons.active")
    res = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10, check=True)
    vals = [v.strip() for v in res.stdout.strip().splitlines()[0].split(",")]

    def num(v):
        try:
            return float(v)
        except ValueError:
            return None

    sm, mem, app, default = (num(v) for v in vals[:4])
    out = {"source": "nvidia-smi", "sm_mhz": sm, "mem_mhz": mem, "app_sm_mhz": app, "default_app_sm_mhz": default,
           "clocks_locked": (app != default) if app is not None and default is not None else None,
           "clock_event_reasons": vals[4] if len(vals) > 4 else None}
    apps = subprocess.run(["nvidia-smi", f"--id={index}", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                          check=False)
    me = os.getpid()
    others = []
    for line in apps.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit() and int(parts[0]) != me:
            others.append({"pid": int(parts[0]), "used_mib": num(parts[1]) if len(parts) > 1 else None})
    out["other_processes"] = others if apps.returncode == 0 else None
    return out


def gpu_state(device) -> dict:
    """Clocks, clock locks and other processes of a CUDA device; ``{"source": None, "why": ...}`` elsewhere."""
    dev = str(device)
    if not dev.startswith("cuda"):
        return {"source": None, "why": "not a CUDA device"}
    index = int(dev.split(":")[1]) if ":" in dev else 0
    try:
        return _nvml_state(index)
    except Exception as nvml_err:  # noqa: BLE001 (ImportError, or an NVML error: try nvidia-smi)
        if shutil.which("nvidia-smi") is None:
            return {"source": None, "why": f"no pynvml ({type(nvml_err).__name__}: {nvml_err}) and no nvidia-smi"}
        try:
            return _smi_state(index)
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            return {"source": None, "why": f"nvidia-smi failed: {e}"}


def snapshot(device) -> dict:
    return {"gpu": gpu_state(device), "cpu": cpu_state()}


def span(start: dict, end: dict) -> dict:
    """A row's ``host_env``: both snapshots and how far the SM clock moved (percent of the start value)."""
    a, b = start["gpu"].get("sm_mhz"), end["gpu"].get("sm_mhz")
    moved = 100.0 * abs(b - a) / a if a and b is not None else None
    return {"start": start, "end": end, "sm_clock_change_pct": moved,
            "sm_clock_moved": bool(moved is not None and moved > CLOCK_MOVED_PCT)}
