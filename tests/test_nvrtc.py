"""The NVRTC backend without a GPU: every kernel instantiation compiles with NVRTC for every target architecture
(so the runtime path cannot rot), with no local memory beyond the known cases; FlashFwdParams' ctypes mirror has
the C++ layout; the disk cache; the host-side plan; backend selection. NVRTC runs on a CPU.

    pytest tests/test_nvrtc.py          # skips without cuda-python/NVRTC/headers (pip install -e ".[nvrtc]")

Set LLM_ATTN_REQUIRE_NVRTC=1 (CI does) to fail instead of skipping when they are missing.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_attn import _plan

ARCHS = ["sm_80", "sm_86", "sm_87", "sm_89", "sm_90"]
# NVRTC's code differs slightly from nvcc's (it computes shared-memory addresses in 64 bits, nvcc in 32: more
# registers): these instantiations spill under NVRTC although nvcc compiles them without (kernels/check_ptxas.sh).
# head_dim 128 Wide causal: 8 bytes on sm_80-89; Wide64 (non-causal, sm_90): 80 bytes. Any other spill fails.
KNOWN_SPILLS = {
    **{arch: {_plan.fwd_kernel_name(bf16, _plan.CONFIGS[128].wide, True, False) for bf16 in (False, True)}
       for arch in ARCHS[:4]},
    "sm_90": {_plan.fwd_kernel_name(bf16, _plan.CONFIGS[128].wide64, False, False) for bf16 in (False, True)},
}


def _nvrtc_or_skip():
    from llm_attn import _nvrtc

    try:
        _nvrtc.nvrtc_version()
        _nvrtc._cuda_include_dir()
    except _nvrtc.NvrtcUnavailableError as e:
        if os.environ.get("LLM_ATTN_REQUIRE_NVRTC") == "1":
            pytest.fail(f"LLM_ATTN_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}")
        pytest.skip(f"NVRTC not usable here: {e}")
    return _nvrtc


@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_compiles_without_local_memory(arch):
    nvrtc = _nvrtc_or_skip()
    kernels = _plan.all_kernels()
    cubin, lowered, log = nvrtc.compile_cubin(arch, kernels)
    assert cubin[:4] == b"\x7fELF", "NVRTC returned something other than a cubin"
    assert set(lowered) == set(kernels) and all(v.startswith("_Z") for v in lowered.values())
    report = nvrtc.local_memory_report(log)
    assert set(report) == set(lowered.values()), "ptxas -v reported on every kernel"
    by_mangled = {v: k for k, v in lowered.items()}
    spilled = {by_mangled[m]: r for m, r in report.items() if any(r)}
    unexpected = {k: r for k, r in spilled.items() if k not in KNOWN_SPILLS[arch]}
    assert not unexpected, f"local memory (stack, spill stores, spill loads) on {arch}: {unexpected}"


# The backward's instantiations (kernels/flash_bwd_launch.cuh: BwdConfig<D> = BwdTraits<D, D == 128 ? 32 : 64, 64, 4,
# 1>). The NVRTC backend does not launch them (backward() needs the compiled extension), but they are compiled here
# for every arch so that they stay NVRTC-compilable and spill-free, as check_ptxas.sh keeps them under nvcc.
BWD_KERNELS = [
    name
    for d in (64, 128) for t in ("half", "__nv_bfloat16")
    for name in (f"llm_attn::flash_bwd_preprocess_kernel<{t}, {d}>",
                 f"llm_attn::flash_bwd_convert_dq_kernel<{t}, {d}>",
                 f"llm_attn::flash_bwd_convert_dkdv_kernel<{t}, {d}>",
                 *(f"llm_attn::flash_bwd_dkdv_kernel<{t}, llm_attn::BwdTraits<{d}, {32 if d == 128 else 64}, 64, 4, 1>, "
                   f"{c}>" for c in ("false", "true")))
]


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_kernels_compile_without_local_memory(arch):
    nvrtc = _nvrtc_or_skip()
    cubin, lowered, log = nvrtc.compile_cubin(arch, BWD_KERNELS)
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(BWD_KERNELS)
    report = nvrtc.local_memory_report(log)
    assert set(report) == set(lowered.values()), "ptxas -v reported on every kernel"
    by_mangled = {v: k for k, v in lowered.items()}
    spilled = {by_mangled[m]: r for m, r in report.items() if any(r)}
    assert not spilled, f"local memory (stack, spill stores, spill loads) on {arch}: {spilled}"


def test_params_struct_layout_matches_cpp(tmp_path):
    """Offsets of every FlashFwdParams field, checked by the host C++ compiler on kernels/flash.h (NVRTC has no
    offsetof; every NVRTC program checks the size). The struct holds no CUDA type, so a two-line cuda_runtime.h
    stands in for the toolkit's (the pip headers lack its host parts)."""
    nvrtc = _nvrtc_or_skip()
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to check the struct offsets with")
    assert ctypes.sizeof(nvrtc.FlashFwdParams) == 216
    src = '#include <cstddef>\n#include "flash.h"\n' + nvrtc.params_struct_asserts(offsets=True)
    (tmp_path / "cuda_runtime.h").write_text("#pragma once\nenum cudaError_t { cudaSuccess = 0 };\n"
                                             "typedef struct CUstream_st* cudaStream_t;\n")
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", f"-I{nvrtc._kernels_dir()}", "-x",
                        "c++", "-"], input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_disk_cache_roundtrip(tmp_path, monkeypatch):
    nvrtc = _nvrtc_or_skip()
    monkeypatch.setenv("LLM_ATTN_CACHE", str(tmp_path))
    kernel = _plan.combine_kernel_name(False, 64)  # the smallest kernel: fast to compile
    cubin, low = nvrtc.get_cubin("sm_86", kernel)
    assert nvrtc.compile_stats[("sm_86", kernel)]["source"] == "nvrtc"
    files = sorted(p.suffix for p in (tmp_path / "nvrtc").iterdir())
    assert files == [".cubin", ".json"]
    again, low2 = nvrtc.get_cubin("sm_86", kernel)
    assert nvrtc.compile_stats[("sm_86", kernel)]["source"] == "cache"
    assert (again, low2) == (cubin, low)
    assert nvrtc.cache_key("sm_86", [kernel]) != nvrtc.cache_key("sm_89", [kernel])
    # A damaged entry is recompiled, not loaded, and replaced. (Not compared with `cubin` byte for byte: two NVRTC
    # compiles of the same program can differ in a few bytes of the ELF.)
    damaged = next((tmp_path / "nvrtc").glob("*.cubin"))
    damaged.write_bytes(b"junk")
    fresh, low3 = nvrtc.get_cubin("sm_86", kernel)
    assert nvrtc.compile_stats[("sm_86", kernel)]["source"] == "nvrtc"
    assert fresh[:4] == b"\x7fELF" and low3 == low and damaged.read_bytes() == fresh


def test_compile_error_is_reported_with_the_log():
    nvrtc = _nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="no_such_kernel"):
        nvrtc.compile_cubin("sm_80", ["llm_attn::no_such_kernel<half>"])


# -- the host-side plan (pure Python) ---------------------------------------------------------------------------
H100 = _plan.Device(num_sms=132, smem_per_sm=228 * 1024, smem_per_block_optin=227 * 1024, cc_major=9)
RTX4060TI = _plan.Device(num_sms=34, smem_per_sm=100 * 1024, smem_per_block_optin=99 * 1024, cc_major=8)
ORIN = _plan.Device(num_sms=16, smem_per_sm=164 * 1024, smem_per_block_optin=163 * 1024, cc_major=8)


def test_every_planned_kernel_is_in_the_compiled_set():
    """Whatever the plan launches, on any device and shape, is one of the instantiations CI compiles above."""
    known = set(_plan.all_kernels())
    seen = set()
    for dev, (b, hq, hkv), sq, sk, d, causal, bf16, tile in itertools.product(
            (H100, RTX4060TI, ORIN), ((1, 32, 8), (2, 8, 8), (4, 32, 32), (1, 8, 1)), (1, 3, 17, 64, 129, 2049),
            (1, 100, 4097, 32768), (64, 128), (False, True), (False, True), range(4)):
        p = _plan.plan(_plan.Shape(b, hq, hkv, sq, sk, d, causal, bf16, tile), dev)
        for launch in p.launches:
            assert launch.kernel in known, launch.kernel
            assert launch.smem <= dev.smem_per_block_optin
            assert all(0 < g for g in launch.grid) and launch.grid[1] <= 65535 and launch.grid[2] <= 65535
            seen.add(launch.kernel)
        assert (len(p.launches) == 2) == (p.num_splits > 1 and not p.decode)
    # Only the 2-stage head_dim-64 decode tile is never chosen here: 3 stages (50 KB) fit every GPU listed.
    never = {_plan.decode_kernel_name(bf16, _plan.DecodeTraits(64, 1, 2)) for bf16 in (False, True)}
    assert known - seen == never, known - seen


def test_plan_known_cases():
    # Llama 3 8B decode on an H100: 8 (batch x KV head) blocks, 2 x 132 / 8 = 33 splits, fused combine.
    p = _plan.plan(_plan.Shape(1, 32, 8, 1, 32768, 128, True, True), H100)
    assert (p.num_splits, p.decode, len(p.launches)) == (33, True, 1)
    assert p.launches[0].grid == (33, 8, 1) and p.launches[0].kernel.endswith("DecodeTraits<128, 1, 3>>")
    # RTX 4060 Ti: 99 KB per block; the 3-stage decode tile needs (16 x 128 + 2 x 3 x 64 x 128) x 2 B = 100 KB.
    dt = _plan.decode_traits(_plan.Shape(1, 32, 8, 1, 4096, 128), RTX4060TI.smem_per_block_optin)
    assert (dt.stages, dt.smem_bytes) == (2, 69632)
    # Prefill 2048 causal, B=1, 32 heads, hd128 on an H100: 16 x 32 = 512 blocks >= 3 x 132: Wide, heads first.
    p = _plan.plan(_plan.Shape(1, 32, 8, 2048, 2048, 128, True, False), H100)
    assert p.num_splits == 1 and p.launches[0].grid == (32, 16, 1) and "FwdTraits<128, 128, 32, 4, 2" in p.launches[0].kernel
    # Non-causal hd128 on sm_90: Wide64; forced large: Large; on an sm_89: Wide (no Wide64 below sm_90).
    s = _plan.Shape(1, 32, 8, 4096, 4096, 128, False, False)
    assert ", 900>" in _plan.plan(s, H100).launches[0].kernel
    large = _plan.plan(_plan.Shape(1, 32, 8, 4096, 4096, 128, False, False, _plan.TILE_LARGE), H100).launches[0]
    assert large.kernel == _plan.fwd_kernel_name(False, _plan.CONFIGS[128].large, False, False)
    assert large.grid == (32, 32, 1)
    # A short prompt leaves SMs idle: small tiles, KV split, then the combine kernel.
    p = _plan.plan(_plan.Shape(1, 8, 8, 64, 8192, 128, False, False), H100)
    assert p.num_splits > 1 and p.launches[1].kernel == _plan.combine_kernel_name(False, 128)
    assert p.launches[1].grid == (_plan._cdiv(8 * 64, 4), 1, 1)


def test_backend_selection_errors(monkeypatch):
    from llm_attn import _ext

    monkeypatch.setenv("LLM_ATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match="LLM_ATTN_BACKEND must be"):
        _ext.kernel_backend()
    with pytest.raises(ValueError, match="backend must be one of"):
        _ext.set_backend("cuda")
    monkeypatch.delenv("LLM_ATTN_BACKEND")
    import torch

    if not torch.cuda.is_available():
        assert _ext.kernel_backend() is None
        assert "nvrtc" in _ext.backend_status() and _ext.backend_status()["nvrtc"] != "available"
        monkeypatch.setenv("LLM_ATTN_BACKEND", "nvrtc")
        with pytest.raises(_ext.KernelNotBuiltError, match="requested: nvrtc"):
            _ext.get_ext()


def test_wheel_ships_the_kernel_headers(tmp_path):
    """A regular (non-editable) install carries kernels/*.h, *.cuh as llm_attn/_kernels for the NVRTC backend."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "LLM_ATTN_NO_CUDA": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    shipped = {p.name for p in (tmp_path / "llm_attn" / "_kernels").iterdir()}
    headers = {p.name for pat in ("*.h", "*.cuh") for p in Path(repo, "kernels").glob(pat)}
    # every header the kernels include: the named parts (smem_tile.cuh, softmax.cuh, mask.cuh, mma_frag.cuh,
    # combine.cuh) and the generated kernel_tiles.h as well as the kernels' own
    assert {"flash.h", "flash_fwd_kernel.cuh", "flash_decode_kernel.cuh", "ptx.cuh", "flash_fwd_config.h",
            "softmax.cuh", "kernel_tiles.h"} <= headers
    assert headers <= shipped, sorted(headers - shipped)
    assert (tmp_path / "llm_attn" / "patches" / "__init__.py").is_file() and not (tmp_path / "patches").exists()


def test_build_env_var_new_name_wins_and_old_name_still_works(monkeypatch):
    """LLM_ATTN_BUILD is the build's name (aot | nvrtc); LLM_ATTN_BACKEND, its older name, keeps working."""
    from llm_attn import _ext

    monkeypatch.delenv("LLM_ATTN_BACKEND", raising=False)
    monkeypatch.setenv("LLM_ATTN_BUILD", "fast")
    with pytest.raises(ValueError, match="LLM_ATTN_BUILD must be"):
        _ext.kernel_build()
    monkeypatch.setenv("LLM_ATTN_BUILD", "nvrtc")
    monkeypatch.setenv("LLM_ATTN_BACKEND", "aot")
    assert _ext._requested() == "nvrtc"
    monkeypatch.delenv("LLM_ATTN_BUILD")
    assert _ext._requested() == "aot"
    assert _ext.kernel_backend is _ext.kernel_build
