"""The device datasheet table (``experiments/devices.toml``): peak fp16 tensor FLOP/s and memory bandwidth per
GPU, for %-of-peak figures and roofline projections; memory capacity and what the runtime keeps of it, for what fits
(``harness.fit``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from llm_attn.envinfo import REPO_ROOT

DEFAULT_TABLE = REPO_ROOT / "experiments" / "devices.toml"
_REQUIRED = ("slug", "name", "match", "mem_bandwidth_gb_s", "fp16_tensor_tflops")


@dataclass(frozen=True)
class Device:
    slug: str
    name: str
    match: tuple[str, ...]
    mem_bandwidth_gb_s: float
    fp16_tensor_tflops: float
    arch: str | None = None
    sms: int | None = None
    device_class: str | None = None
    memory_gib: float | None = None    # device memory as torch reports it (Jetson: the unified memory)
    reserved_gib: float | None = None  # of it, what torch's allocator cannot have: CUDA context, display, OS
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.mem_bandwidth_gb_s * 1e9

    @property
    def peak_flops(self) -> float:
        return self.fp16_tensor_tflops * 1e12

    def matches(self, gpu_name: str) -> bool:
        name = gpu_name.lower()
        return any(m in name for m in self.match)


def load_devices(path: str | Path | None = None) -> list[Device]:
    """Parse and check the table; a missing field or a non-positive figure is an error, not a silent None."""
    path = Path(path) if path is not None else DEFAULT_TABLE
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    devices = []
    for i, entry in enumerate(data.get("device", [])):
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise ValueError(f"{path}: device #{i + 1} misses {missing}")
        for k in ("mem_bandwidth_gb_s", "fp16_tensor_tflops"):
            if not isinstance(entry[k], (int, float)) or entry[k] <= 0:
                raise ValueError(f"{path}: device {entry['slug']!r}: {k} must be a positive number, got {entry[k]!r}")
        if not isinstance(entry["match"], list) or not entry["match"]:
            raise ValueError(f"{path}: device {entry['slug']!r}: match must be a non-empty list of strings")
        for k in ("memory_gib", "reserved_gib"):
            if k in entry and (not isinstance(entry[k], (int, float)) or entry[k] < 0):
                raise ValueError(f"{path}: device {entry['slug']!r}: {k} must be a number >= 0, got {entry[k]!r}")
        known = set(_REQUIRED) | {"arch", "sms", "class", "memory_gib", "reserved_gib"}
        devices.append(Device(
            slug=entry["slug"], name=entry["name"], match=tuple(m.lower() for m in entry["match"]),
            mem_bandwidth_gb_s=float(entry["mem_bandwidth_gb_s"]),
            fp16_tensor_tflops=float(entry["fp16_tensor_tflops"]), arch=entry.get("arch"), sms=entry.get("sms"),
            device_class=entry.get("class"), memory_gib=entry.get("memory_gib"),
            reserved_gib=entry.get("reserved_gib"), extra={k: v for k, v in entry.items() if k not in known}))
    if not devices:
        raise ValueError(f"{path}: no [[device]] entries")
    return devices


def find_device(gpu_name: str | None, devices: list[Device]) -> Device | None:
    """The table entry for a GPU name as torch reports it; None for the CPU or an unknown GPU."""
    if not gpu_name or gpu_name == "cpu":
        return None
    hits = [d for d in devices if d.matches(gpu_name)]
    if len(hits) > 1:
        raise ValueError(f"GPU {gpu_name!r} matches several devices: {[d.slug for d in hits]}; make 'match' stricter")
    return hits[0] if hits else None
