"""The NVRTC backend without a GPU: every kernel instantiation compiles with NVRTC for every target architecture
(so the runtime path cannot rot), with no local memory beyond the known cases; the ctypes mirrors of the kernels'
parameter structs have the C++ layout; the disk cache; the host-side plan (the low-precision forwards' launches and
workspaces against the C++ host code they mirror); backend selection. NVRTC runs on a CPU.

    pytest tests/test_nvrtc.py          # skips without cuda-python/NVRTC/headers (pip install -e ".[nvrtc]")

Set LLM_ATTN_REQUIRE_NVRTC=1 (CI does) to fail instead of skipping when they are missing. The every-arch compiles
run in a pool of processes, one per core (``compiled``), all started by the first of those tests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import itertools
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import cpu_check_here, full_grid_requested

from llm_attn import _kernel_table, _plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ["sm_80", "sm_86", "sm_87", "sm_89", "sm_90"]
# NVRTC's code differs slightly from nvcc's (it computes shared-memory addresses in 64 bits, nvcc in 32: more
# registers): these instantiations spill under NVRTC although nvcc compiles them without (kernels/check_ptxas.sh).
# head_dim 128 Wide causal: 8 bytes on sm_80-89; Wide64 (non-causal, sm_90): 80 bytes. Any other spill fails.
KNOWN_SPILLS = {
    **{arch: {_plan.fwd_kernel_name(bf16, _plan.CONFIGS[128].wide, True, False) for bf16 in (False, True)}
       for arch in ARCHS[:4]},
    "sm_90": {_plan.fwd_kernel_name(bf16, _plan.CONFIGS[128].wide64, False, False) for bf16 in (False, True)},
}


# head_dim 128 INT8 with P V in the input dtype (every arch but sm_89) spills 24-64 bytes under NVRTC for the same
# reason (nvcc: 239 registers, none spilled); its sm_89 configuration (P V in e4m3) does not.
KNOWN_SPILLS_INT8 = {arch: {_plan.int8_kernel_name(bf16, _plan.Int8Traits(128, False), causal)
                            for bf16 in (False, True) for causal in (False, True)}
                     for arch in ARCHS if not _plan.int8_pv_fp8(arch)}


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


# The portable backward's instantiations (_plan.bwd_kernels: the dK/dV kernel with each head_dim's tile and narrow
# tile, kernel_tiles.h's BwdTile<D> / BwdTileNarrow<D> through _kernel_table; the separate dQ kernel; the
# preprocessing and the conversions), which the NVRTC build launches (_plan.bwd_plan) on every arch, the Hopper one's
# preprocessing and conversions included. The Hopper dK/dV kernel: _plan.bwd_sm90_kernels, for sm_90a.
BWD_KERNELS = _plan.bwd_kernels()


# -- the every-arch compiles, in a pool of processes ----------------------------------------------------------------
# NVRTC compiles a program on one core. The compile tests below ask `compiled` for their results; the first of them
# starts a process pool (one worker per core) and submits every compile of every compile test this session runs, the
# longest first; each test then waits for its own. A test's kernels are compiled in programs of at most
# _PROGRAM_KERNELS kernels (each kernel's code is its own: it does not depend on the others of its program).
# test name -> (the kernels of an arch, whether it is a CPU check a GPU machine runs only with -m full)
COMPILE_TESTS = {
    "test_every_instantiation_compiles_without_local_memory": (lambda arch: _plan.all_kernels(), True),
    "test_backward_kernels_compile_without_local_memory": (lambda arch: BWD_KERNELS, True),
    "test_int8_instantiations_compile_without_local_memory": (_plan.int8_kernels, True),
    "test_fp8kv_decode_instantiations_compile_without_local_memory": (lambda arch: _plan.decode_fp8kv_kernels(), True),
    "test_fp8kv_prefill_instantiations_compile_without_local_memory": (lambda arch: _plan.prefill_fp8kv_kernels(), True),
    "test_fp8_cache_append_compiles_without_local_memory": (lambda arch: _plan.fp8_cache_append_kernels(), True),
    "test_fp8_cache_dequant_compiles_without_local_memory": (lambda arch: _plan.fp8_cache_dequant_kernels(), True),
    "test_hopper_instantiations_compile_for_sm90a_without_local_memory": (lambda arch: _plan.sm90_kernels(), False),
    "test_fp8_instantiations_compile_for_sm90a_without_local_memory": (lambda arch: _plan.fp8_kernels(), False),
    "test_hopper_backward_compiles_for_sm90a_without_local_memory": (lambda arch: _plan.bwd_sm90_kernels(), False),
}
_PROGRAM_KERNELS = 12
_farm: dict = {}


def _programs(test: str, arch: str) -> list[list[str]]:
    kernels = COMPILE_TESTS[test][0](arch)
    n = -(-len(kernels) // _PROGRAM_KERNELS)
    return [kernels[i::n] for i in range(n)]


def _session_jobs(session) -> list[tuple[str, str]]:
    """(test, arch) of every compile test selected in this session that will not skip as a GPU machine's CPU check."""
    gpu_default = torch.cuda.is_available() and not full_grid_requested(session.config)
    jobs = []
    for item in session.items:
        test = getattr(item, "originalname", "")
        if getattr(item, "module", None) is None or item.module.__name__ != __name__ or test not in COMPILE_TESTS:
            continue
        if COMPILE_TESTS[test][1] and gpu_default:
            continue
        arch = item.callspec.params.get("arch", "sm_90a") if hasattr(item, "callspec") else "sm_90a"
        jobs.append((test, arch))
    return jobs


def compiled(request, arch: str) -> tuple[dict[str, str], str]:
    """({name expression: lowered name}, NVRTC's log) of every kernel of the calling compile test for `arch`, each
    program checked to have produced a cubin."""
    from llm_attn import _nvrtc

    if "pool" not in _farm:
        jobs = list(dict.fromkeys(_session_jobs(request.session) + [(request.node.originalname, arch)]))
        programs = [(job, ks) for job in jobs for ks in _programs(*job)]
        programs.sort(key=lambda jk: -len(jk[1]) * (3 if jk[0][1] == "sm_90a" else 1))  # sm_90a kernels: slower
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = max(1, min(len(programs), cores))
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        request.session.config.add_cleanup(lambda: pool.shutdown(wait=False, cancel_futures=True))
        _farm["pool"], _farm["futures"] = pool, {}
        for job, ks in programs:
            _farm["futures"].setdefault(job, []).append(pool.submit(_nvrtc.compile_cubin, job[1], ks))
    job = (request.node.originalname, arch)
    futures = _farm["futures"].get(job) or [_farm["pool"].submit(_nvrtc.compile_cubin, arch, ks)
                                           for ks in _programs(*job)]
    lowered, logs = {}, []
    for future in futures:
        cubin, low, log = future.result()
        assert cubin[:4] == b"\x7fELF", "NVRTC returned something other than a cubin"
        lowered.update(low)
        logs.append(log)
    return lowered, "\n".join(logs)


def _local_memory(nvrtc, kernels, lowered, log, arch) -> dict[str, tuple[int, int, int]]:
    """{kernel: (stack, spill stores, spill loads)} of the kernels that use local memory; every kernel lowered and
    reported on by ptxas -v."""
    assert set(lowered) == set(kernels) and all(v.startswith("_Z") for v in lowered.values())
    report = nvrtc.local_memory_report(log)
    assert set(report) == set(lowered.values()), f"ptxas -v reported on every kernel ({arch})"
    by_mangled = {v: k for k, v in lowered.items()}
    return {by_mangled[m]: r for m, r in report.items() if any(r)}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_compiles_without_local_memory(arch, request):
    cpu_check_here(request, "every-arch NVRTC compile")
    nvrtc = _nvrtc_or_skip()
    spilled = _local_memory(nvrtc, _plan.all_kernels(), *compiled(request, arch), arch)
    unexpected = {k: r for k, r in spilled.items() if k not in KNOWN_SPILLS[arch]}
    assert not unexpected, f"local memory (stack, spill stores, spill loads) on {arch}: {unexpected}"


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_kernels_compile_without_local_memory(arch, request):
    """Every portable backward instantiation, in programs that static_assert the FlashBwdParams mirror: no stack,
    no spills (the dK/dV kernels' registers: kernels/NOTES.md "The backward through NVRTC")."""
    cpu_check_here(request, "every-arch NVRTC compile")
    nvrtc = _nvrtc_or_skip()
    assert len(BWD_KERNELS) == 40  # per (head_dim, dtype): 3 + per mask (dK/dV tiles, the 2d kernel, the dQ kernel)
    assert "FlashBwdParams" in nvrtc.program_source(BWD_KERNELS)
    spilled = _local_memory(nvrtc, BWD_KERNELS, *compiled(request, arch), arch)
    assert not spilled, f"local memory (stack, spill stores, spill loads) on {arch}: {spilled}"


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_instantiations_compile_without_local_memory(arch, request):
    """The INT8 forward on every arch it runs on: per (head_dim, dtype, causal) the kernel with the P V this arch
    takes (e4m3 on sm_89, the input dtype elsewhere), and the two pre-pass kernels; no local memory beyond
    KNOWN_SPILLS_INT8."""
    cpu_check_here(request, "every-arch NVRTC compile")
    nvrtc = _nvrtc_or_skip()
    kernels = _plan.int8_kernels(arch)
    fp8_pv = {bool(re.search(r"Int8FwdTraits<\d+, true>|, \d+, true>$", k)) for k in kernels}
    assert len(kernels) == 16 and fp8_pv == {arch == "sm_89"}
    spilled = _local_memory(nvrtc, kernels, *compiled(request, arch), arch)
    unexpected = {k: r for k, r in spilled.items() if k not in KNOWN_SPILLS_INT8.get(arch, ())}
    assert not unexpected, f"local memory (stack, spill stores, spill loads) on {arch}: {unexpected}"


def _compiles_for_its_arch(arch: str, request, kernels: list[str], count: int, header: str, struct: str,
                           registers_ok) -> None:
    """The body of the every-arch compile tests of kernels built for the device's own arch: the `count` `kernels`,
    in programs that include `header` and static_assert the `struct` mirror, compile for `arch` itself with no
    stack and no spills, and each kernel's register count passes `registers_ok`."""
    cpu_check_here(request, "every-arch NVRTC compile")
    nvrtc = _nvrtc_or_skip()
    assert len(kernels) == count
    src = nvrtc.program_source(kernels)
    assert f'#include "{header}"' in src and struct in src
    assert {nvrtc.kernel_arch(arch, k) for k in kernels} == {arch}
    lowered, log = compiled(request, arch)
    spilled = _local_memory(nvrtc, kernels, lowered, log, arch)
    assert not spilled, f"local memory (stack, spill stores, spill loads) on {arch}: {spilled}"
    regs = nvrtc.register_report(log)
    assert all(registers_ok(regs[lowered[k]][0]) for k in kernels), {k: regs[lowered[k]] for k in kernels}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8kv_decode_instantiations_compile_without_local_memory(arch, request):
    """The decode kernel over the FP8 KV cache on every arch it runs on (the device's own: it needs no FP8 hardware):
    per (head_dim, dtype) the three configs of DecodeFp8KvConfig<D> (one and two m16 row tiles, one tile in two warp
    groups), in programs that static_assert the FlashDecodeFp8KvParams mirror: no stack, no spills (registers:
    kernels/NOTES.md "The FP8-cache decode through NVRTC")."""
    # 2 head dims x 2 dtypes x (OneTile, TwoTiles, OneTileWG2)
    _compiles_for_its_arch(arch, request, _plan.decode_fp8kv_kernels(), 12, "flash_decode_fp8kv_kernel.cuh",
                           "FlashDecodeFp8KvParams", lambda regs: 100 < regs <= 255)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8kv_prefill_instantiations_compile_without_local_memory(arch, request):
    """The prefill kernel over the FP8 KV cache on every arch it runs on (the device's own, as the decode kernel): per
    (head_dim, dtype) PrefillFp8KvConfig<D>::Tile, in programs that static_assert the FlashDecodeFp8KvParams mirror:
    no stack, no spills (registers: kernels/NOTES.md "Prefill over the FP8 KV cache")."""
    # 2 head dims x 2 dtypes x (v1, v2)
    _compiles_for_its_arch(arch, request, _plan.prefill_fp8kv_kernels(), 8, "flash_prefill_fp8kv_kernel.cuh",
                           "FlashDecodeFp8KvParams", lambda regs: 100 < regs <= 255)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_cache_append_compiles_without_local_memory(arch, request):
    """The FP8 static cache's one-token append (kernels/fp8_cache_append_kernel.cuh) on every arch, as the AOT build
    has it: head_dim 64 and 128, fp16 and bf16 tokens, in programs that static_assert the Fp8CacheAppendParams
    mirror: no stack, no spills, at most 64 registers (1024 threads a block)."""
    _compiles_for_its_arch(arch, request, _plan.fp8_cache_append_kernels(), 4, "fp8_cache_append_kernel.cuh",
                           "Fp8CacheAppendParams", lambda regs: regs <= 64)


def test_fp8_cache_append_constants_match_cpp():
    """The append's block size and slot count, as _plan and the NVRTC launcher use them, are the header's."""
    _nvrtc_or_skip()
    _assert_constants(["fp8_cache_append_kernel.cuh"], "sm_80",
                      {"llm_attn::fp8cache::kAppendThreads": _plan.FP8_CACHE_APPEND_THREADS,
                       "llm_attn::kFp8CacheBlock": 64})


def test_fp8_cache_append_checks_are_the_bindings():
    """_nvrtc.fp8_cache_append is the binding's (so llm_attn.ops runs either build through one path): binding.cpp
    has each refusal _nvrtc.fp8_cache_append_problem words, and without a GPU the first of them comes before any
    GPU work."""
    nvrtc = _nvrtc_or_skip()
    binding = _binding_literals()
    assert 'm.def("fp8_cache_append"' in binding and callable(nvrtc.fp8_cache_append)
    for text in ("k_data must be a 4-D CUDA tensor (batch, kv_heads, capacity, head_dim)",
                 "head_dim must be 64 or 128, got ", "the capacity must be a positive multiple of 64 tokens, got ",
                 "max_cache_len must be in [1, ", " must be on k_data's device", " must be contiguous",
                 "position must be one int64 on k_data's device", " must be float16 or bfloat16, got ",
                 " contiguous in head_dim, got ", "k_new and v_new must have one dtype"):
        assert text in binding, text
    b, h, c, d = 1, 2, 128, 64
    args = [torch.zeros(b, h, 1, d, dtype=torch.float16), torch.zeros(b, h, 1, d, dtype=torch.float16),
            torch.zeros(b, h, 64, d), torch.zeros(b, h, 64, d), torch.zeros(b, h, d),
            torch.zeros(b, h, c, d, dtype=torch.uint8), torch.zeros(b, h, c, d, dtype=torch.uint8),
            torch.zeros(b, h, c // 64), torch.zeros(b, h, c // 64), torch.zeros(1, dtype=torch.int64),
            torch.zeros(b, dtype=torch.int32), c]
    with pytest.raises(RuntimeError, match=r"^llm_attn.fp8_cache_append: k_data must be a 4-D CUDA tensor"):
        nvrtc.fp8_cache_append(*args)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_cache_dequant_compiles_without_local_memory(arch, request):
    """The FP8 cache's dequantised copy (kernels/fp8_cache_dequant_kernel.cuh) on every arch, as the AOT build has it:
    head_dim 64 and 128, an fp16 and a bf16 copy, in programs that static_assert the Fp8CacheDequantParams mirror: no
    stack, no spills, at most 48 registers (40 on every arch with NVRTC 13.0, as with nvcc: the copy is memory-bound,
    and above 48 fewer than five 256-thread blocks fit an SM)."""
    _compiles_for_its_arch(arch, request, _plan.fp8_cache_dequant_kernels(), 4, "fp8_cache_dequant_kernel.cuh",
                           "Fp8CacheDequantParams", lambda regs: regs <= 48)


def test_fp8_cache_dequant_constants_match_cpp():
    """The copy's block size, as _plan's launch uses it, and its tokens per scale are the header's."""
    _nvrtc_or_skip()
    _assert_constants(["fp8_cache_dequant_kernel.cuh"], "sm_80",
                      {"llm_attn::fp8dequant::kDequantThreads": _plan.FP8_CACHE_DEQUANT_THREADS,
                       "llm_attn::fp8dequant::kScaleBlock": 64})


def test_fp8_cache_dequant_checks_are_the_bindings():
    """_nvrtc.fp8_cache_dequant is the binding's (so llm_attn.ops runs either build through one path): binding.cpp
    has each refusal _nvrtc.fp8_cache_dequant_problem words, in that order, and without a GPU the first of them comes
    before any GPU work."""
    nvrtc = _nvrtc_or_skip()
    binding = _binding_literals()
    assert 'm.def("fp8_cache_dequant"' in binding and callable(nvrtc.fp8_cache_dequant)
    body = binding[binding.index("void fp8_cache_dequant("):binding.index("#undef CHECK_DEQUANT")]
    texts = ("k_data must be a 4-D CUDA tensor (batch, kv_heads, capacity, head_dim)",
             "head_dim must be 64 or 128, got ", "batch x kv_heads must be in [1, 65535], got ",
             "k_out must be 4-D (batch, kv_heads, n, head_dim)", " tokens, more than the cache's capacity ",
             "k_scale must be (batch, kv_heads, >= ceil(n / 64)) float32, got ", " must be on k_data's device",
             ", not one this kernel takes", " must be contiguous", " must be 16-byte aligned")
    at = [body.find(text) for text in texts]
    assert -1 not in at and at == sorted(at), dict(zip(texts, at))
    # `same` on each operand in fp8_cache_dequant_problem's order
    same = [body.find(f'"{name}", {{') for name in ("k_data", "v_data", "k_scale", "v_scale", "k_shift", "k_out",
                                                     "v_out")]
    assert -1 not in same and same == sorted(same), same
    b, h, c, d = 1, 2, 128, 64
    args = [torch.zeros(b, h, c, d, dtype=torch.uint8), torch.zeros(b, h, c, d, dtype=torch.uint8),
            torch.zeros(b, h, c // 64), torch.zeros(b, h, c // 64), torch.zeros(b, h, d),
            torch.zeros(b, h, 100, d, dtype=torch.float16), torch.zeros(b, h, 100, d, dtype=torch.float16)]
    with pytest.raises(RuntimeError, match=r"^llm_attn.fp8_cache_dequant: k_data must be a 4-D CUDA tensor"):
        nvrtc.fp8_cache_dequant(*args)


def test_fp8_cache_dequant_launch_is_the_cpp_one():
    """_plan's launch of the copy is fp8_cache_dequant.cu's launch(): ceil(n x head_dim / 16 / 256) blocks, then
    batch x KV heads, then K and V; and _nvrtc refuses before launching what run_fp8_cache_dequant refuses, on the
    params as narrowed to int (a capacity past int's range), with n == 0 launching nothing whatever its pointers."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn._cuda_abi import Fp8CacheDequantParams

    cu = _kernels_text("fp8_cache_dequant.cu")
    assert "(chunks + kDequantThreads - 1) / kDequantThreads" in cu and "p.batch * p.kv_heads), 2)" in cu
    for b, h, d, n, bf16 in ((1, 8, 64, 1, False), (2, 3, 128, 65, True), (3, 1, 64, 4099, True),
                             (1, 8, 128, 4096, False)):
        launch = _plan.fp8_cache_dequant_launch(b, h, d, n, bf16)
        assert launch.grid == (-(-(n * d // 16) // 256), b * h, 2) and launch.threads == 256 and launch.smem == 0
        assert launch.kernel == _plan.fp8_cache_dequant_kernel_name(bf16, d) in _plan.fp8_cache_dequant_kernels()

    def params(**kw):
        p = Fp8CacheDequantParams(k_data=256, v_data=512, k_scale=64, v_scale=96, k_shift=None, k_out=1024,
                                  v_out=2048, batch=1, kv_heads=8, head_dim=128, capacity=256, scale_blocks=4, n=200)
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    assert not nvrtc._fp8_cache_dequant_refused(params())
    assert not nvrtc._fp8_cache_dequant_refused(params(n=0, k_data=8, k_out=None))  # n == 0: nothing to launch
    for bad in (dict(head_dim=96), dict(n=257), dict(capacity=1 << 31), dict(batch=0), dict(kv_heads=65536),
                dict(scale_blocks=3), dict(k_data=8), dict(v_out=2056), dict(k_shift=4100)):
        assert nvrtc._fp8_cache_dequant_refused(params(**bad)), bad


def test_hopper_instantiations_compile_for_sm90a_without_local_memory(request):
    """Every Hopper kernel instantiation the AOT build has (flash_fwd_sm90_*.cu through sm90::launch), compiled by
    NVRTC for sm_90a in programs that also static_assert the Sm90Params mirror: no stack, no spills, and the
    real body (the non-sm_90a one is a trap: a handful of registers, no named barriers)."""
    nvrtc = _nvrtc_or_skip()
    kernels = _plan.sm90_kernels()
    assert len(kernels) == 14  # 2 head dims x 2 dtypes x 2 masks, + the 176-key and three-consumer tuning tiles
    src = nvrtc.program_source(kernels)
    assert '#include "flash_fwd_sm90_kernel.cuh"' in src and "Sm90Params" in src
    lowered, log = compiled(request, "sm_90a")
    spilled = _local_memory(nvrtc, kernels, lowered, log, "sm_90a")
    assert not spilled, f"local memory (stack, spill stores, spill loads) on sm_90a: {spilled}"
    used = re.findall(r"Used (\d+) registers, used (\d+) barriers", log)
    assert len(used) == len(kernels) and all(int(r) > 100 and int(b) > 1 for r, b in used), used


def test_fp8_instantiations_compile_for_sm90a_without_local_memory(request):
    """Every FP8 instantiation the AOT build has (flash_fwd_fp8_sm90_*.cu through launch_fp8: each key tile of
    Fp8Tiles<D>, the 128-key one with 2 and 3 stages; Q K^T in e4m3 and in int8; the 128-key int8 tile with P V in
    the input dtype, Fp8Traits<D, 2, 128 or 192, true, true>) and its pre-pass kernels, compiled
    by NVRTC for sm_90a in programs that static_assert FlashFwdFp8Params and Fp8Sm90Params: no stack, no spills, the
    kernels' real bodies (setmaxnreg: 168 registers a thread at launch, 16 named barriers), the pre-pass's e4m3 and
    int8 conversions."""
    nvrtc = _nvrtc_or_skip()
    kernels = _plan.fp8_kernels()
    main = [k for k in kernels if "flash_fwd_fp8_sm90_kernel<" in k]
    tiles = sum(len(t) + (1 if 128 in t else 0) for t in (_kernel_table.FP8_BLOCK_N[d] for d in (64, 128)))
    # x 2 dtypes x 2 masks x 2 Q K^T types, + P V in the input dtype per (head_dim, dtype, mask); per (head_dim,
    # dtype) the statistics, and Q's and K's per type, + K's statistics and K without V (P V in the input dtype)
    pv_input = [k for k in main if re.search(r"Fp8Traits<\d+, 2, (128|192), true, true>, (true|false)>$", k)]
    assert len(pv_input) == 16 and len(main) == 8 * tiles + 16 and len(kernels) == len(main) + 7 * 2 * 2
    assert {n for bf16, d in itertools.product((False, True), (64, 128))
            for n in _plan.fp8_prepass_names(bf16, d, True, True)} <= set(kernels)
    src = nvrtc.program_source(kernels)
    assert all(f'#include "{h}"' in src for h in ("quant_fp8.cuh", "flash_fwd_fp8_sm90_kernel.cuh"))
    assert "Fp8Sm90Params" in src and "FlashFwdFp8Params" in src
    lowered, log = compiled(request, "sm_90a")
    spilled = _local_memory(nvrtc, kernels, lowered, log, "sm_90a")
    assert not spilled, f"local memory (stack, spill stores, spill loads) on sm_90a: {spilled}"
    regs = nvrtc.register_report(log)
    assert all(regs[lowered[k]][0] > 100 and regs[lowered[k]][1] > 1 for k in main), {k: regs[lowered[k]] for k in main}
    # the pre-pass: > 32 registers, but K's statistics alone (kStatsV false: sums, no amax, no conversion) have 32
    k_stats = {n for n in kernels if "fp8_kv_stats_kernel<" in n and n.endswith(", false>")}
    assert len(k_stats) == 4 and all(regs[lowered[k]][0] >= 24 for k in k_stats), regs
    assert all(regs[lowered[k]][0] > 32 for k in kernels if k not in main and k not in k_stats), regs


def test_hopper_backward_compiles_for_sm90a_without_local_memory(request):
    """The Hopper backward's dK/dV kernel (flash_bwd_sm90_*.cu through run_flash_bwd_sm90_: Sm90BwdTraits<D, 2> per
    head_dim, dtype and mask) compiled by NVRTC for sm_90a, in programs that static_assert FlashBwdParams and
    Sm90BwdParams: no stack, no spills, the real body (setmaxnreg: 168 registers a thread at launch, named
    barriers); kernel_arch sends it to sm_90a and its preprocessing to the device's arch."""
    nvrtc = _nvrtc_or_skip()
    kernels = _plan.bwd_sm90_kernels()
    assert len(kernels) == 8
    src = nvrtc.program_source(kernels)
    assert '#include "flash_bwd_sm90_kernel.cuh"' in src and "Sm90BwdParams" in src and "FlashBwdParams" in src
    assert {nvrtc.kernel_arch("sm_90", k) for k in kernels} == {"sm_90a"}
    assert nvrtc.kernel_arch("sm_90", _plan.bwd_kernel_names(True, 128)[0]) == "sm_90"
    lowered, log = compiled(request, "sm_90a")
    spilled = _local_memory(nvrtc, kernels, lowered, log, "sm_90a")
    assert not spilled, f"local memory (stack, spill stores, spill loads) on sm_90a: {spilled}"
    regs = nvrtc.register_report(log)
    assert all(regs[lowered[k]][0] == 168 and regs[lowered[k]][1] > 1 for k in kernels), regs


def test_hopper_kernel_compiles_for_sm90a_only():
    """The Hopper kernel runs only from an sm_90a cubin: kernel_arch picks it on an sm_90 device, and the plain
    sm_90 compile (what the portable kernels use) gets the trap body."""
    nvrtc = _nvrtc_or_skip()
    k = _plan.sm90_kernels()[0]
    assert nvrtc.kernel_arch("sm_90", k) == "sm_90a"
    assert nvrtc.kernel_arch("sm_90", _plan.combine_kernel_name(False, 64)) == "sm_90"
    _, _, log = nvrtc.compile_cubin("sm_90", [k])
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and regs[0] < 32, log[-1000:]


@pytest.mark.parametrize("struct", ["Sm90Params", "Fp8Sm90Params", "Sm90BwdParams"])
def test_sm90_params_layout_matches_cpp(struct):
    """Every field's offset of a Hopper kernel's parameter struct (Sm90Params; the FP8 kernel's Fp8Sm90Params) as
    NVRTC lays out the C++ struct (a probe kernel's PTX: NVRTC has no offsetof), against the ctypes mirror; size and
    alignment are static_asserted in the same program."""
    _nvrtc_or_skip()
    from llm_attn import _nvrtc, _nvrtc_sm90

    _, mirror, fields, _ = _nvrtc_sm90.STRUCTS[struct]
    cpp = _nvrtc.sm90_probe_offsets(struct)
    assert set(cpp) == set(fields), cpp
    assert cpp == {f: getattr(mirror, f).offset for f in fields}
    assert ctypes.sizeof(mirror) == {"Sm90BwdParams": 1024, "Fp8Sm90Params": 896}.get(struct, 768)
    assert cpp["tma_q"] % 128 == 0


def test_params_struct_layout_matches_cpp(tmp_path):
    """Offsets of every field of FlashFwdParams, FlashFwdFp8Params, FlashFwdInt8Params, FlashBwdParams,
    FlashDecodeFp8KvParams, Fp8CacheAppendParams and Fp8CacheDequantParams, checked by the host C++ compiler on
    kernels/flash.h, flash_fp8.h, flash_int8.h, flash_decode_fp8kv.h, fp8_cache_append.h and fp8_cache_dequant.h
    (NVRTC has no offsetof; every NVRTC program checks the sizes). The structs hold no CUDA type, so a small
    cuda_runtime.h stands in for the toolkit's (the pip headers lack its host parts)."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import _cuda_abi

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to check the struct offsets with")
    assert [ctypes.sizeof(m) for _, m in _cuda_abi.STRUCTS] == [216, 280, 232, 376, 264, 144, 88]
    src = ('#include <cstddef>\n#include "flash.h"\n#include "flash_fp8.h"\n#include "flash_int8.h"\n'
           '#include "flash_decode_fp8kv.h"\n#include "fp8_cache_append.h"\n#include "fp8_cache_dequant.h"\n'
           + nvrtc.params_struct_asserts(offsets=True, structs=_cuda_abi.STRUCTS))
    (tmp_path / "cuda_runtime.h").write_text("#pragma once\nenum cudaError_t { cudaSuccess = 0 };\n"
                                             "typedef struct CUstream_st* cudaStream_t;\n"
                                             "#define __host__\n#define __device__\n")
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", f"-I{nvrtc._kernels_dir()}", "-x",
                        "c++", "-"], input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_nvrtc_outputs_leave_the_interpreters_bytes_alone():
    """NVRTC writes its log, cubin and PTX into the buffer it is given. Given `b" " * 1` (an empty log is one NUL),
    it wrote into the interpreter's shared b" " object, and every b" " of the process became b"\\0": on the H200
    torch's pickling then failed ("storage has wrong byte size") in every later test (tests/test_patches_copy.py).
    In a new process, so that a regression cannot break the rest of the suite."""
    _nvrtc_or_skip()
    code = textwrap.dedent("""
        import pickle, torch
        from llm_attn import _nvrtc, _plan
        nvrtc = _nvrtc._nvrtc()
        prog = _nvrtc._check(nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void k() {}', b"k.cu", 0, [], []),
                             "nvrtcCreateProgram")
        assert int(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_80"])[0]) == 0
        assert _nvrtc._output(nvrtc, prog, "ProgramLog") == b"\\0"  # the empty log: the case that hit b" "
        assert _nvrtc._output(nvrtc, prog, "CUBIN")[:4] == b"\\x7fELF"
        nvrtc.nvrtcDestroyProgram(prog)
        _nvrtc.compile_cubin("sm_86", [_plan.combine_kernel_name(False, 64)])
        assert b" " == bytes([32]) and b" " * 3 == bytes([32] * 3), repr(b" ")
        x = torch.arange(32.0)
        assert torch.equal(pickle.loads(pickle.dumps(x)), x)
        print("intact")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "intact" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


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


def test_disk_cache_keys_the_hopper_kernel_by_arch(tmp_path, monkeypatch):
    """The sm_90a cubin is cached like every other kernel: its own key (arch in it), compiled once, then read."""
    nvrtc = _nvrtc_or_skip()
    monkeypatch.setenv("LLM_ATTN_CACHE", str(tmp_path))
    kernel = _plan.sm90_kernel_name(True, _plan.Sm90Traits(64), True)
    assert nvrtc.cache_key("sm_90a", [kernel]) != nvrtc.cache_key("sm_90", [kernel])
    cubin, low = nvrtc.get_cubin("sm_90a", kernel)
    assert nvrtc.compile_stats[("sm_90a", kernel)]["source"] == "nvrtc" and cubin[:4] == b"\x7fELF"
    again, low2 = nvrtc.get_cubin("sm_90a", kernel)
    assert nvrtc.compile_stats[("sm_90a", kernel)]["source"] == "cache" and (again, low2) == (cubin, low)
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == 1


def test_compile_error_is_reported_with_the_log():
    nvrtc = _nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="no_such_kernel"):
        nvrtc.compile_cubin("sm_80", ["llm_attn::no_such_kernel<half>"])


# -- the host-side plan (pure Python) ---------------------------------------------------------------------------
H100 = _plan.Device(num_sms=132, smem_per_sm=228 * 1024, smem_per_block_optin=227 * 1024, cc_major=9)
RTX4060TI = _plan.Device(num_sms=34, smem_per_sm=100 * 1024, smem_per_block_optin=99 * 1024, cc_major=8)
ORIN = _plan.Device(num_sms=16, smem_per_sm=164 * 1024, smem_per_block_optin=163 * 1024, cc_major=8)
# An H100 whose backend runs the Hopper kernel (extension with sm_90a code, or NVRTC >= 12.0): H100 above is one
# without (an AOT build without sm_90a), where the portable tiles run.
H100_SM90 = _plan.Device(num_sms=132, smem_per_sm=228 * 1024, smem_per_block_optin=227 * 1024, cc_major=9, sm90=True)


def test_every_planned_kernel_is_in_the_compiled_set():
    """Whatever the plan launches, on any device and shape, is one of the instantiations CI compiles above."""
    known = set(_plan.all_kernels()) | set(_plan.sm90_kernels())
    seen = set()
    for dev, (b, hq, hkv), sq, sk, d, causal, bf16, tile in itertools.product(
            (H100, H100_SM90, RTX4060TI, ORIN), ((1, 32, 8), (2, 8, 8), (4, 32, 32), (1, 8, 1)),
            (1, 3, 17, 64, 129, 2049), (1, 100, 4097, 32768), (64, 128), (False, True), (False, True), range(5)):
        if tile == _plan.TILE_HOPPER and not dev.sm90:
            continue
        p = _plan.plan(_plan.Shape(b, hq, hkv, sq, sk, d, causal, bf16, tile), dev)
        for launch in p.launches:
            assert launch.kernel in known, launch.kernel
            assert launch.smem <= dev.smem_per_block_optin
            assert all(0 < g for g in launch.grid) and launch.grid[1] <= 65535 and launch.grid[2] <= 65535
            seen.add(launch.kernel)
        assert (len(p.launches) == 2) == (p.num_splits > 1 and not p.decode)
    # Only the 2-stage head_dim-64 decode tile is never chosen here: 3 stages (50 KB) fit every GPU listed; the
    # 4-stage decode tile only when forced (llm_attn.ops.force_decode, test_decode_overrides_in_the_plan).
    # The 176-key Hopper tile runs only with LLM_ATTN_SM90_BLOCKN=176, head_dim 64 non-causal on two consumer
    # warpgroups only with LLM_ATTN_SM90_CONSUMERS=2 (test_hopper_block_n_tuning_env, test_hopper_consumers_...).
    never = {_plan.decode_kernel_name(bf16, _plan.DecodeTraits(64, 1, 2)) for bf16 in (False, True)}
    never |= {_plan.decode_kernel_name(bf16, _plan.DecodeTraits(d, 1, 4)) for bf16 in (False, True) for d in (64, 128)}
    never |= {_plan.sm90_kernel_name(bf16, _plan.Sm90Traits(128, 176), False) for bf16 in (False, True)}
    never |= {_plan.sm90_kernel_name(bf16, _plan.Sm90Traits(64), False) for bf16 in (False, True)}
    assert known - seen == never, known - seen


def test_plan_known_cases():
    # Llama 3 8B decode on an H100: 8 (batch x KV head) blocks, 132 // 8 = 16 splits (one block per SM), fused combine.
    p = _plan.plan(_plan.Shape(1, 32, 8, 1, 32768, 128, True, True), H100)
    assert (p.num_splits, p.decode, len(p.launches)) == (16, True, 1)
    assert p.launches[0].grid == (16, 8, 1) and p.launches[0].kernel.endswith("DecodeTraits<128, 1, 3>>")
    # Batch 16: 128 blocks already fill the SMs, no split; 512 keys at batch 1: one 64-key tile per split (rule v4,
    # the H200 grid: 1.14x cuDNN against 0.90x with none).
    assert _plan.plan(_plan.Shape(16, 32, 8, 1, 32768, 128, True, True), H100).num_splits == 1
    assert _plan.plan(_plan.Shape(1, 32, 8, 1, 512, 128, True, True), H100).num_splits == 8
    assert [_plan.plan(_plan.Shape(1, 32, 8, 1, kv, 128, True, True), H100).num_splits for kv in (100, 200)] == [1, 4]
    assert _plan.plan(_plan.Shape(4, 32, 8, 1, 2048, 128, True, True), H100).num_splits == 4
    # Batch 8 (64 blocks on 132 SMs): 2 splits from 1024 keys on (the H200 grid: 1.17x at KV 2048, 1.37x at 8192
    # over no split), none below (KV 512: 0.93x).
    assert [_plan.plan(_plan.Shape(8, 32, 8, 1, kv, 128, True, True), H100).num_splits
            for kv in (512, 1023, 1024, 2048, 32768)] == [1, 1, 2, 2, 2]
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


def test_decode_overrides_in_the_plan():
    """The decode tuning overrides (flash_decode_force_splits / _config in kernels/flash_fwd.cu and
    flash_decode_launch.cuh, mirrored by Shape.decode_splits / decode_config): a forced split count is clamped to
    the 64-key tiles; a forced config is taken where its row tiles hold the rows; prefill shapes are unaffected."""
    ids = _plan.DECODE_CONFIG_IDS
    assert list(ids) == [name for name, _, _ in _plan._table.DECODE_TRAITS] and sorted(ids.values()) == [1, 2, 3, 4]
    for line in ("if (g_decode_splits > 0) return g_decode_splits < n_tiles ? g_decode_splits : n_tiles;",
                 "case kDecodeDeep4: if (rows <= 16) return launch_decode<T, typename Config::Deep4>(params, stream); "
                 "break;"):
        assert line in _kernels_text("flash_fwd.cu") + _kernels_text("flash_decode_launch.cuh"), line
    assert f"kDecodeConfigCount = {len(ids) + 1};" in _kernels_text("kernel_tiles.h")
    s = _plan.Shape(1, 32, 8, 1, 8192, 128, False, True)
    assert _plan.plan(s, H100).num_splits == 16
    for forced, want in ((1, 1), (16, 16), (500, 128)):
        p = _plan.plan(dataclasses.replace(s, decode_splits=forced), H100)
        assert p.num_splits == want and p.launches[0].grid == (want, 8, 1)
    deep4 = _plan.plan(dataclasses.replace(s, decode_config=ids["Deep4"]), H100).launches[0]
    assert deep4.kernel.endswith("DecodeTraits<128, 1, 4>>") and deep4.smem == (16 * 128 + 2 * 4 * 64 * 128) * 2
    shallow = _plan.plan(dataclasses.replace(s, decode_config=ids["Shallow"]), H100).launches[0]
    assert shallow.kernel.endswith("DecodeTraits<128, 1, 2>>")
    # 8 query heads per KV head x q_len 4 = 32 rows: only TwoTiles holds them, a one-tile config is ignored.
    wide = _plan.Shape(1, 32, 4, 4, 8192, 128, False, True, decode_config=ids["Deep4"])
    assert _plan.plan(wide, H100).launches[0].kernel.endswith("DecodeTraits<128, 2, 2>>")
    prefill = _plan.Shape(1, 32, 8, 2048, 2048, 128, True, True)
    assert _plan.plan(dataclasses.replace(prefill, decode_splits=7, decode_config=3), H100) == _plan.plan(prefill, H100)


def test_nvrtc_decode_override_setters():
    """_nvrtc's set_decode_splits / set_decode_config behave as binding.cpp's (previous value; -1 out of range) and
    num_splits reads them."""
    nvrtc = _nvrtc_or_skip()
    try:
        assert nvrtc.set_decode_splits(5) == 0 and nvrtc.set_decode_splits(-1) == -1
        assert nvrtc.num_splits(1, 32, 8, 1, 8192, 128, 132) == 5
        assert nvrtc.set_decode_config(4) == 0 and nvrtc.set_decode_config(99) == -1
        assert nvrtc.set_decode_config(0) == 4
    finally:
        nvrtc.set_decode_splits(0)
        nvrtc.set_decode_config(0)
    assert nvrtc.num_splits(1, 32, 8, 1, 8192, 128, 132) == 16


def _kernels_text(name: str) -> str:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", name)
    with open(path) as f:
        return " ".join(f.read().split())


def test_smem_carveout_knob_is_the_extensions():
    """LLM_ATTN_SMEM_CARVEOUT (a measurement knob, kernels/launch_smem.h) means the same in the NVRTC build: the same
    variable, 0..100 set as the preferred shared-memory carveout of every kernel above 48 KB, anything else the
    driver's choice."""
    import inspect

    from llm_attn import _nvrtc

    for line in ('const char* v = std::getenv("LLM_ATTN_SMEM_CARVEOUT");', "return p >= 0 && p <= 100 ? p : -1;",
                 "if constexpr (kSmemBytes <= 48 * 1024) { return cudaSuccess; }",
                 "err = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, "
                 "smem_carveout_from_env());"):
        assert line in _kernels_text("launch_smem.h"), f"launch_smem.h no longer has `{line}`: update _nvrtc._function"
    src = " ".join(inspect.getsource(_nvrtc._function).split())
    assert ('if smem > 48 * 1024:' in src and 'carveout = _plan._tuning_env("LLM_ATTN_SMEM_CARVEOUT", -1)' in src
            and "if 0 <= carveout <= 100:" in src and "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout" in src)


def test_hopper_choice_mirrors_the_extension():
    """_plan takes the Hopper kernel exactly where kernels/flash_fwd.cu does: use_sm90 (forced, or automatic when
    the portable kernel would not split and the device runs sm_90a code) after the decode check, no split when
    forced; sm90::launch_tile's grid and tile. The C++ lines this mirrors are checked to be the ones in kernels/,
    so a change there fails here until _plan follows."""
    for name, line in (
            ("flash_fwd.cu", "return p.tile == kTileHopper || (p.tile == kTileAuto && p.num_splits == 1 && "
                             "flash_fwd_sm90_available());"),
            ("flash_fwd.cu", "if (p.tile == kTileWide || p.tile == kTileHopper) return 1;"),
            ("flash_fwd.cu", "cc90 = device_attribute(cudaDevAttrComputeCapabilityMajor, 0) == 9 && "
                             "device_attribute(cudaDevAttrComputeCapabilityMinor, -1) == 0;"),
            ("flash_fwd_sm90_launch.cuh", "const dim3 grid = kCausal ? dim3(p.num_heads, m_blocks, p.batch) : "
                                          "dim3(m_blocks, p.num_heads, p.batch);"),
            ("flash_fwd_sm90_launch.cuh", "if (block_n == 176) return launch_tile<T, Config<128, 176>, kCausal>(p, "
                                          "stream);"),
            # the tensor maps (tma_host.h, shared with the backward): boxes of one 128-byte row of columns (64
            # bf16/fp16, what _nvrtc_sm90.py encodes) x box_rows
            ("tma_host.h", "const cuuint32_t box[4] = {128 / sizeof(T), static_cast<cuuint32_t>(box_rows), 1, 1};"),
            ("tma_host.h", "CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, "
                                          "CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);"),
            ("flash_fwd_sm90_kernel.cuh", "kSmemBytes = kTileBytesQ + 2 * kStages * kTileBytesKV + kNumBarriers * 8 "
                                          "+ 1024;")):
        assert line in _kernels_text(name), f"{name} no longer has `{line}`: update llm_attn/_plan.py / _nvrtc_sm90.py"

    shapes = [_plan.Shape(b, hq, hkv, sq, sk, d, causal, bf16, tile)
              for (b, hq, hkv), sq, sk, d, causal, bf16, tile in itertools.product(
                  ((1, 32, 8), (1, 8, 8), (4, 32, 32), (1, 8, 1)), (1, 4, 64, 129, 2048), (1, 300, 8192), (64, 128),
                  (False, True), (False, True), range(5))]
    hopper = {False: 0, True: 0}
    for dev in (H100, H100_SM90, RTX4060TI):
        for s in shapes:
            decode = _plan.use_decode_kernel(s)  # run_flash_fwd takes the decode kernel first, whatever the tile
            if s.tile == _plan.TILE_HOPPER and not dev.sm90 and not decode:  # cudaErrorInvalidDeviceFunction
                with pytest.raises(ValueError, match="Hopper kernel"):
                    _plan.plan(s, dev)
                continue
            p = _plan.plan(s, dev)
            splits = _plan.num_splits(s, dev.num_sms)
            want = not decode and (s.tile == _plan.TILE_HOPPER or (s.tile == _plan.TILE_AUTO and splits == 1
                                                                   and dev.sm90))
            got = p.launches[0].sm90 is not None
            assert got == want, (dev, s, splits)
            hopper[got] += 1
            if got:
                t = p.launches[0].sm90
                # head_dim 64: three consumer warpgroups (192 rows) but for causal prompts up to 1024 tokens
                c = 3 if s.head_dim == 64 and not (s.causal and s.seqlen_q <= 1024) else 2
                m = _plan._cdiv(s.seqlen_q, 64 * c)
                assert t.consumers == c and p.launches[0].threads == 128 * (1 + c)
                assert p.num_splits == 1 and len(p.launches) == 1
                assert p.launches[0].grid == ((s.num_heads, m, s.batch) if s.causal else (m, s.num_heads, s.batch))
                assert p.launches[0].kernel == _plan.sm90_kernel_name(s.is_bf16, t, s.causal)
                # Q + 2 stages x (K + V) + barriers + 1 KB: 80 KB (88 KB with 192 rows) / 160 KB
                assert p.launches[0].smem == {(64, 2): 83016, (64, 3): 91208, (128, 2): 164936}[s.head_dim, c]
    assert hopper[True] > 500 and hopper[False] > 500, hopper

    # Known cases on an H100 that runs it: Llama 3 8B prefill 2048 causal; a short prompt splits (portable kernel);
    # forcing 'hopper' there runs it unsplit; decode ignores the tile.
    p = _plan.plan(_plan.Shape(1, 32, 8, 2048, 2048, 128, True, True), H100_SM90)
    assert p.launches[0].kernel.startswith("llm_attn::sm90::flash_fwd_sm90_kernel<__nv_bfloat16, "
                                           "llm_attn::sm90::Sm90Traits<128, 128, 2, 2>, true>")
    assert p.launches[0].grid == (32, 16, 1)
    short = _plan.Shape(1, 8, 8, 64, 8192, 128, False, False)
    assert _plan.plan(short, H100_SM90).num_splits > 1 and _plan.plan(short, H100_SM90).launches[0].sm90 is None
    forced = _plan.plan(_plan.Shape(1, 8, 8, 64, 8192, 128, False, False, _plan.TILE_HOPPER), H100_SM90)
    assert forced.num_splits == 1 and forced.launches[0].grid == (1, 8, 1) and forced.launches[0].sm90 is not None
    dec = _plan.plan(_plan.Shape(1, 32, 8, 1, 8192, 128, True, True, _plan.TILE_HOPPER), H100_SM90)
    assert dec.decode and dec.launches[0].sm90 is None


def test_hopper_block_n_tuning_env(monkeypatch):
    """LLM_ATTN_SM90_BLOCKN=176 (read once, as sm90::tuning_env) picks Config<128, 176> for head_dim 128
    non-causal only; LLM_ATTN_SM90_PINGPONG defaults to 1."""
    monkeypatch.setenv("LLM_ATTN_SM90_BLOCKN", "176")
    monkeypatch.delenv("LLM_ATTN_SM90_PINGPONG", raising=False)
    monkeypatch.delenv("LLM_ATTN_SM90_CONSUMERS", raising=False)
    _plan.sm90_tuning.cache_clear()
    try:
        assert _plan.sm90_tuning() == (176, 1, 0)
        launch = _plan.plan(_plan.Shape(1, 32, 8, 4096, 4096, 128, False, True), H100_SM90).launches[0]
        assert launch.sm90 == _plan.Sm90Traits(128, 176) and launch.smem == 214088 <= H100.smem_per_block_optin
        assert _plan.plan(_plan.Shape(1, 32, 8, 4096, 4096, 128, True, True), H100_SM90).launches[0].sm90.block_n == 128
        assert _plan.plan(_plan.Shape(1, 32, 8, 4096, 4096, 64, False, True), H100_SM90).launches[0].sm90.block_n == 128
    finally:
        _plan.sm90_tuning.cache_clear()


@pytest.mark.parametrize("env", ["", "2", "3"])
def test_hopper_consumers_tuning_env(monkeypatch, env):
    """head_dim 64 runs on three consumer warpgroups (Config<64, 128, 2, 3>: 192 query rows, 512 threads) except
    causal prompts up to 1024 tokens; LLM_ATTN_SM90_CONSUMERS=2|3 forces either; head_dim 128 always has two."""
    monkeypatch.setenv("LLM_ATTN_SM90_CONSUMERS", env)
    monkeypatch.delenv("LLM_ATTN_SM90_BLOCKN", raising=False)
    _plan.sm90_tuning.cache_clear()
    try:
        for causal, sq in itertools.product((False, True), (1024, 1025, 4096)):
            launch = _plan.plan(_plan.Shape(4, 32, 32, sq, sq, 64, causal, True), H100_SM90).launches[0]
            c = int(env) if env else (2 if causal and sq <= 1024 else 3)
            assert launch.sm90 == _plan.Sm90Traits(64, 128, 2, c) and launch.threads == 128 * (1 + c)
            m = -(-sq // (64 * c))
            assert launch.grid == ((32, m, 4) if causal else (m, 32, 4))
            assert launch.smem == 64 * c * 128 + 2 * 2 * 128 * 128 + 9 * 8 + 1024  # Q + 2 x (K + V) + barriers + 1 KB
            assert launch.kernel.endswith(f"Sm90Traits<64, 128, 2, {c}>, {str(causal).lower()}>")
            assert launch.kernel in _plan.sm90_kernels()
        for causal in (False, True):
            assert _plan.plan(_plan.Shape(1, 32, 8, 4096, 4096, 128, causal, True), H100_SM90).launches[0].threads == 384
    finally:
        _plan.sm90_tuning.cache_clear()


# -- the low-precision forwards' host side -------------------------------------------------------------------------
# The C++ host code _plan's fp8_launches / int8_launches / fp8_workspace / fp8_block_n mirror, line by line: a change
# there fails here until _plan (and this list) follows.
QUANT_HOST_LINES = (
    ("flash_fwd_fp8_sm90_launch.cuh", "const int q_blocks = (p.seqlen_q + kFp8QBlock - 1) / kFp8QBlock;"),
    ("flash_fwd_fp8_sm90_launch.cuh", "const int kv_chunks = fp8_seqlen_k_pad(p.seqlen_k) / kFp8KvChunk;"),
    ("flash_fwd_fp8_sm90_launch.cuh", "constexpr bool kV8 = !Traits::kPvInput; fp8::fp8_kv_stats_kernel<T, kHeadDim, "
                                      "kV8><<<dim3((p.seqlen_k + 511) / 512, p.num_kv_heads, p.batch), fp8::kThreads, "
                                      "0, stream>>>(f); fp8::fp8_quant_q_kernel<T, kHeadDim, Traits::kQkInt8><<<dim3("
                                      "q_blocks, p.num_heads, p.batch), fp8::kThreads, 0, stream>>>(f); "
                                      "fp8::fp8_quant_kv_kernel<T, kHeadDim, Traits::kQkInt8, kV8><<<dim3(kv_chunks, "
                                      "p.num_kv_heads, p.batch), fp8::kThreads, 0, stream>>>(f);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "static const int pingpong = tuning_env(\"LLM_ATTN_SM90_PINGPONG\", 1);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "Fp8Sm90Params sp{};"),  # the map a kernel does not read stays zeroed
    ("flash_fwd_fp8_sm90_launch.cuh", "encode_fp8_map(&sp.tma_q, f.q8, kHeadDim, p.seqlen_q, p.num_heads, p.batch, "
                                      "kHeadDim, Traits::kBlockM) && encode_fp8_map(&sp.tma_k, f.k8, kHeadDim, "
                                      "p.seqlen_k, p.num_kv_heads, p.batch, kHeadDim, Traits::kBlockN) && "
                                      "(Traits::kPvInput ? make_tensor_map<T>(&sp.tma_v, p.v, kHeadDim, p.seqlen_k, "
                                      "p.num_kv_heads, p.batch, p.v_batch_stride, p.v_head_stride, p.v_row_stride, "
                                      "Traits::kBlockN) : encode_fp8_map(&sp.tma_vt, f.vt8, pad, kHeadDim, "
                                      "p.num_kv_heads, p.batch, Traits::kVtBoxKeys, kHeadDim));"),
    ("flash_fwd_fp8_sm90_launch.cuh", "box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, "
                                      "CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "const dim3 grid = kCausal ? dim3(p.num_heads, m_blocks, p.batch) : "
                                      "dim3(m_blocks, p.num_heads, p.batch); flash_fwd_fp8_sm90_kernel<T, Traits, "
                                      "kCausal><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "static const int stages = tuning_env(\"LLM_ATTN_FP8_STAGES\", 2); if (block_n "
                                      "== 256) {"),
    ("flash_fwd_fp8_sm90_launch.cuh", "return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 256, kQkInt8>, kCausal>(f, "
                                      "stream);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "return cudaErrorInvalidValue; } if (block_n == 192) {"),
    ("flash_fwd_fp8_sm90_launch.cuh", "return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 192, kQkInt8>, kCausal>(f, "
                                      "stream);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "if (stages == 3) return launch_fp8_tile<T, Fp8Traits<kHeadDim, 3, 128, kQkInt8>, "
                                      "kCausal>(f, stream); return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 128, kQkInt8>, "
                                      "kCausal>(f, stream);"),
    ("flash_fwd_fp8_sm90_launch.cuh", "if (pv == kFp8PvInput) { if (qk != kFp8QkInt8) return cudaErrorInvalidValue; "
                                      "if (block_n == 192) return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 192, true, "
                                      "true>, kCausal>(f, stream); if (block_n == 128) return launch_fp8_tile<T, "
                                      "Fp8Traits<kHeadDim, 2, 128, true, true>, kCausal>(f, stream); return "
                                      "cudaErrorInvalidValue; } if (pv != kFp8PvE4m3) return cudaErrorInvalidValue;"),
    ("flash_fp8.cu", "if (pv != kFp8PvE4m3 && pv != kFp8PvInput) return 0;"),
    ("flash_fp8.cu", "const int def = int8_e4m3 ? Fp8Tiles<kHeadDim>::kDefaultBlockNInt8 : "
                     "Fp8Tiles<kHeadDim>::kDefaultBlockN; const int n = requested ? requested : env ? env : def; "
                     "return Fp8Tiles<kHeadDim>::has(n) ? n : 0;"),
    ("flash_fp8.cu", "const bool i8 = !input && flash_fwd_fp8_qk(qk) == kFp8QkInt8;"),
    ("flash_fp8.cu", "block_n = flash_fwd_fp8_block_n(p.head_dim, block_n, pv, qk);"),
    ("flash_fp8.cu", "static const int env = sm90::tuning_env(\"LLM_ATTN_FP8_BLOCK_N\", 0);"),
    ("flash_fp8.cu", "if (input && requested > kFp8PvInputMaxBlockN) return 0; const int e = input && env > "
                     "kFp8PvInputMaxBlockN ? 0 : env;"),
    ("flash_fp8.h", "constexpr int kFp8PvInputMaxBlockN = 192;"),
    ("binding.cpp", "const int64_t n_q8 = b * hq * sq * d, n_k8 = b * hkv * sk * d;"),
    ("binding.cpp", "const int64_t n_vt8 = pv_input ? 0 : b * hkv * d * pad;"),
    ("binding.cpp", "const int64_t n_stats = 2 * b * hkv * d, n_qs = b * hq * sq, n_ks = b * hkv * k_blocks, "
                    "n_vs = b * hkv * d; const int64_t n_qm = b * hq * sq;"),
    ("binding.cpp", "floats.narrow(0, 0, n_stats).zero_();"),
    ("binding.cpp", "f.q8 = base, f.k8 = base + n_q8, f.vt8 = pv_input ? nullptr : base + n_q8 + n_k8;"),
    ("binding.cpp", "f.stats = fb, f.q_scale = fb + n_stats, f.k_scale = fb + n_stats + n_qs, f.v_scale = fb + n_stats "
                    "+ n_qs + n_ks; f.q_dot_kmean = fb + n_stats + n_qs + n_ks + n_vs;"),
    ("binding.cpp", "f.p.num_splits = 1;"),
    ("binding.cpp", "p.fp8_pv = llm_attn::flash_fwd_int8_fp8_pv_available();"),
    ("flash_fwd_int8.cu", "const int heads = p.batch * p.num_kv_heads; const dim3 stats_grid(int8_stat_chunks("
                          "p.seqlen_k), heads); const dim3 quant_grid(int8_seqlen_k_pad(p.seqlen_k) / kInt8BlockN, "
                          "heads);"),
    ("flash_fwd_int8.cu", "int8_kv_stats_kernel<T, kHeadDim, true><<<stats_grid, kQuantThreads, 0, stream>>>(p);"),
    ("flash_fwd_int8.cu", "if (p.seqlen_k > 0) {"),
    ("flash_fwd_int8.cu", "cache[dev] = major == 8 && minor == 9 ? 2 : 1;"),
    ("flash_fwd_int8_launch.cuh", "dim3 grid(kCausal ? params.num_heads : m_blocks, kCausal ? m_blocks : "
                                  "params.num_heads, params.batch); flash_fwd_int8_kernel<T, Traits, kCausal><<<grid, "
                                  "Traits::kThreads, smem, stream>>>(params);"),
    ("flash_fwd_int8_launch.cuh", "return params.fp8_pv ? launch_fwd_int8<T, int8fwd::Int8FwdTraits<kHeadDim, true>, "
                                  "kCausal>(params, stream) : launch_fwd_int8<T, int8fwd::Int8FwdTraits<kHeadDim, "
                                  "false>, kCausal>(params, stream);"),
)


def test_quant_launches_mirror_the_cpp_host_code():
    """fp8_launches / int8_launches / the workspaces follow the C++ host code (QUANT_HOST_LINES), and give the launch
    sequence it gives on known shapes."""
    for name, line in QUANT_HOST_LINES:
        assert line in _kernels_text(name), f"{name} no longer has `{line}`: update llm_attn/_plan.py"
    # Llama 3 8B prefill, 2049 tokens, causal bf16: the pre-pass, then 17 x 32 blocks of 128 rows, heads first.
    s = _plan.Shape(1, 32, 8, 2049, 2049, 128, True, True)
    stats, qq, kv, main = _plan.fp8_launches(s, _plan.fp8_traits(128, 128))
    assert (stats.grid, qq.grid, kv.grid) == ((5, 8, 1), (33, 32, 1), (18, 8, 1))
    assert {stats.threads, qq.threads, kv.threads} == {256} and {stats.smem, qq.smem, kv.smem} == {0}
    assert main.kernel == ("llm_attn::sm90::flash_fwd_fp8_sm90_kernel<__nv_bfloat16, "
                           "llm_attn::sm90::Fp8Traits<128, 2>, true>")
    assert (main.grid, main.threads, main.smem) == ((32, 17, 1), 384, 128 * 128 + 2 * 2 * 128 * 128 + 9 * 8 + 1024)
    big = _plan.fp8_launches(dataclasses.replace(s, causal=False), _plan.Fp8Traits(128, 2, 192))[-1]
    assert big.grid == (17, 32, 1) and big.kernel.endswith("Fp8Traits<128, 2, 192>, false>")
    ws = _plan.fp8_workspace(s)
    assert (ws.q8, ws.k8, ws.vt8) == (32 * 2049 * 128, 8 * 2049 * 128, 8 * 128 * (17 + 1) * 128)
    assert (ws.stats, ws.q_scale, ws.k_scale, ws.v_scale, ws.q_dot_kmean) == (2048, 32 * 2049, 8 * 33, 1024, 32 * 2049)
    # P V in the input dtype: the same grids; K's statistics and K only (V untouched), the kernel Fp8Traits<D, 2,
    # 128, true, true> with the caller's V in shared memory (2 bytes an element); no V^T workspace.
    pv = _plan.fp8_launches(s, _plan.fp8_traits(128, 128, True, True))
    assert [x.grid for x in pv] == [x.grid for x in (stats, qq, kv, main)]
    assert [x.kernel for x in pv] == ["llm_attn::fp8::fp8_kv_stats_kernel<__nv_bfloat16, 128, false>",
                                      "llm_attn::fp8::fp8_quant_q_kernel<__nv_bfloat16, 128, true>",
                                      "llm_attn::fp8::fp8_quant_kv_kernel<__nv_bfloat16, 128, true, false>",
                                      "llm_attn::sm90::flash_fwd_fp8_sm90_kernel<__nv_bfloat16, "
                                      "llm_attn::sm90::Fp8Traits<128, 2, 128, true, true>, true>"]
    assert (pv[-1].threads, pv[-1].smem) == (384, 128 * 128 + 2 * (128 * 128 + 128 * 128 * 2) + 9 * 8 + 1024)
    assert _plan.Fp8Traits(64, 2, 128, True, True).smem_bytes == 128 * 64 + 2 * (128 * 64 + 128 * 64 * 2) + 72 + 1024
    # ... and K scales per 32 keys (kFp8KBlockPvInput), the rest as the e4m3 P V's.
    pw = _plan.fp8_workspace(s, True)
    assert dataclasses.replace(pw, vt8=ws.vt8, k_scale=ws.k_scale) == ws and pw.vt8 == 0 and pw.k_scale == 8 * 65
    assert pw.bytes_ == ws.q8 + ws.k8 and pw.floats == ws.floats + 8 * 32
    # INT8: the two pre-pass kernels over (chunks, batch x KV heads), then the kernel; e4m3 P V only on sm_89.
    for fp8_pv in (False, True):
        st, qk, kern = _plan.int8_launches(s, fp8_pv)
        assert st.grid == (_plan.int8_stat_chunks(2049), 8, 1) == (9, 8, 1) and qk.grid == (17, 8, 1)
        assert kern.grid == (32, 17, 1) and kern.threads == 256
        assert kern.smem == (80 if fp8_pv else 96) * 1024  # 2 x (K + V) + the int8 Q fragments with e4m3 P V
        assert kern.kernel.endswith(f"<128, {str(fp8_pv).lower()}>, true>")
        assert st.kernel.endswith(f"<__nv_bfloat16, 128, {str(fp8_pv).lower()}>")
    offsets, size = _plan.int8_workspace(s, False)
    assert offsets["v_fp8"] == offsets["v_scale"] == offsets["stats"] and size % 256 == 0
    assert [_plan.int8_pv_fp8(a) for a in ARCHS] == [False, False, False, True, False]


@pytest.fixture
def fp8_env(monkeypatch):
    def set_env(block_n: str | None = None, stages: str | None = None):
        for name, value in (("LLM_ATTN_FP8_BLOCK_N", block_n), ("LLM_ATTN_FP8_STAGES", stages)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        _plan.fp8_tuning.cache_clear()

    yield set_env
    monkeypatch.delenv("LLM_ATTN_FP8_BLOCK_N", raising=False)
    monkeypatch.delenv("LLM_ATTN_FP8_STAGES", raising=False)
    _plan.fp8_tuning.cache_clear()


def test_fp8_key_tile_and_stages(fp8_env, monkeypatch):
    """flash_fwd_fp8_block_n and launch_fp8: a requested tile, else LLM_ATTN_FP8_BLOCK_N, else Fp8Tiles<D>'s default
    for the S operands (int8 Q K^T with e4m3 P V: kDefaultBlockNInt8; "" resolved through LLM_ATTN_FP8_QK); 0
    (refused) for a tile not built; three stages (LLM_ATTN_FP8_STAGES=3) for the 128-key tile only."""
    fp8_env()
    monkeypatch.delenv("LLM_ATTN_FP8_QK", raising=False)
    tiles, int8_default = _kernel_table.FP8_BLOCK_N, _kernel_table.FP8_INT8_DEFAULT
    assert _plan.fp8_block_n(128, qk="e4m3") == tiles[128][0] and _plan.fp8_block_n(64, 0, qk="e4m3") == tiles[64][0]
    assert _plan.fp8_block_n(128) == _plan.fp8_block_n(128, qk="int8") == int8_default[128] == 256
    assert _plan.fp8_block_n(64) == int8_default[64] == tiles[64][0]
    monkeypatch.setenv("LLM_ATTN_FP8_QK", "e4m3")  # "" then means e4m3: its default tile
    assert _plan.fp8_block_n(128) == tiles[128][0] and _plan.fp8_block_n(128, qk="int8") == 256
    monkeypatch.delenv("LLM_ATTN_FP8_QK")
    assert all(_plan.fp8_block_n(d, n) == n for d, t in tiles.items() for n in t)
    assert _plan.fp8_block_n(128, 100) == 0 and _plan.fp8_block_n(96) == 0
    assert _plan.fp8_traits(128, 128) == _plan.Fp8Traits(128) and _plan.Fp8Traits(128).cpp().endswith("<128, 2>")
    fp8_env(block_n="192", stages="3")
    assert _plan.fp8_block_n(128) == _plan.fp8_block_n(128, qk="e4m3") == 192 and _plan.fp8_block_n(128, 128) == 128
    assert _plan.fp8_traits(128, 128) == _plan.Fp8Traits(128, 3) and _plan.fp8_traits(64, 192).stages == 2
    fp8_env(block_n="100")
    assert _plan.fp8_block_n(64) == 0 and _plan.fp8_block_n(64, 128) == 128


@pytest.mark.parametrize("block_n_env,stages_env", [(None, None), ("192", "3"), ("100", None)])
def test_fp8_pv_input_tile(fp8_env, block_n_env, stages_env):
    """P V in the input dtype (flash_fwd_fp8_block_n's kFp8PvInput, launch_fp8's pv branch): the e4m3 P V's tile rule
    (the request, else LLM_ATTN_FP8_BLOCK_N, else Fp8Tiles<D>'s default; 0 for a tile not built); two stages
    whatever LLM_ATTN_FP8_STAGES says; int8 Q K^T. A pv that is neither e4m3 nor input gets no tile."""
    fp8_env(block_n=block_n_env, stages=stages_env)
    for d in (64, 128):
        for n in (0, 128, 192, 64):  # e4m3 Q K^T's rule (int8 Q K^T with e4m3 P V has its own default tile)
            assert _plan.fp8_block_n(d, n, "input") == _plan.fp8_block_n(d, n, "e4m3", "e4m3") \
                == _plan.fp8_block_n(d, n, qk="e4m3")
        assert _plan.fp8_block_n(d, 128, "input") == 128 and _plan.fp8_block_n(d, 64, "input") == 0
        assert _plan.fp8_block_n(d, 0, "bogus") == _plan.fp8_block_n(d, 128, "bogus") == 0
        for n in (128, 192):
            t = _plan.fp8_traits(d, n, True, True)
            assert t == _plan.Fp8Traits(d, 2, n, True, True) and t.qk_int8 and t.pv_input
            assert t.cpp() == f"llm_attn::sm90::Fp8Traits<{d}, 2, {n}, true, true>"
    assert _plan.fp8_block_n(96, 0, "input") == 0
    # the 256-key tile (head_dim 128) runs e4m3 P V only: refused with P V in the input dtype, where a process default
    # of 256 falls back to the build's default
    assert _plan.fp8_block_n(128, 256) == 256 and _plan.fp8_block_n(128, 256, "input") == 0
    fp8_env(block_n="256")
    assert _plan.fp8_block_n(128, qk="e4m3") == 256
    assert _plan.fp8_block_n(128, 0, "input") == _kernel_table.FP8_BLOCK_N[128][0]
    # the e4m3 P V instantiations keep the spelling the AOT build's launch gives them (defaults left out)
    assert [_plan.Fp8Traits(128, *a).cpp()[len("llm_attn::sm90::"):] for a in ((2,), (3,), (2, 192), (2, 128, True))] \
        == ["Fp8Traits<128, 2>", "Fp8Traits<128, 3>", "Fp8Traits<128, 2, 192>", "Fp8Traits<128, 2, 128, true>"]


def test_every_planned_quant_kernel_is_compiled():
    """Whatever fp8_launches / int8_launches launch, on any shape and tile, is one of the instantiations the compile
    tests above check, fits the shared memory of the GPUs it runs on and a grid's y and z limits."""
    fp8_known = set(_plan.fp8_kernels())
    seen = set()
    for (b, hq, hkv), sq, sk, d, causal, bf16 in itertools.product(
            ((1, 32, 8), (2, 8, 8), (1, 8, 1)), (1, 17, 129, 2049), (1, 100, 4097), (64, 128), (False, True),
            (False, True)):
        s = _plan.Shape(b, hq, hkv, sq, sk, d, causal, bf16)
        variants = [_plan.Fp8Traits(d, stages, block_n, qk_int8)
                    for block_n, qk_int8 in itertools.product(_kernel_table.FP8_BLOCK_N[d], (False, True))
                    for stages in ((2, 3) if block_n == 128 else (2,))]
        for traits in variants + [_plan.fp8_traits(d, n, True, True) for n in _kernel_table.FP8_BLOCK_N[d]
                                  if n <= _plan.FP8_PV_INPUT_MAX_BLOCK_N]:  # + pv input
            for launch in _plan.fp8_launches(s, traits):
                assert launch.kernel in fp8_known and launch.smem <= H100.smem_per_block_optin
                assert launch.grid[1] <= 65535 and launch.grid[2] <= 65535 and min(launch.grid) > 0
                seen.add(launch.kernel)
        for arch, dev in (("sm_89", RTX4060TI), ("sm_87", ORIN), ("sm_90", H100)):
            for launch in _plan.int8_launches(s, _plan.int8_pv_fp8(arch)):
                assert launch.kernel in _plan.int8_kernels(arch) and launch.smem <= dev.smem_per_block_optin
                assert min(launch.grid) > 0
                seen.add(launch.kernel)
    assert fp8_known <= seen and set(_plan.int8_kernels("sm_89")) | set(_plan.int8_kernels("sm_80")) <= seen


def test_quant_constants_match_cpp():
    """The numbers _plan uses for the low-precision forwards are the headers': NVRTC compiles a probe kernel that
    stores each C++ value (the block constants, every Fp8Traits / Int8FwdTraits' smem, threads and tile, the
    padding and chunking functions, flash_fwd_int8_workspace's layout) and its PTX is read back."""
    _nvrtc_or_skip()
    want = {"llm_attn::kFp8QBlock": _plan.FP8_Q_BLOCK, "llm_attn::kFp8KBlock": _plan.FP8_K_BLOCK,
            "llm_attn::kFp8KBlockPvInput": _plan.FP8_K_BLOCK_PV_INPUT,
            "llm_attn::kFp8KvChunk": _plan.FP8_KV_CHUNK, "llm_attn::fp8::kThreads": _plan.QUANT_THREADS,
            "llm_attn::int8fwd::kQuantThreads": _plan.QUANT_THREADS, "llm_attn::kInt8BlockN": _plan.INT8_BLOCK_N,
            "llm_attn::kInt8KBlock": _plan.INT8_K_BLOCK,
            "llm_attn::kInt8BlockM": _plan.Int8Traits.block_m,
            "llm_attn::kInt8MaxStatChunks": _plan.INT8_MAX_STAT_CHUNKS}
    traits = {t for d in (64, 128) for n in _kernel_table.FP8_BLOCK_N[d] for t in
              {_plan.fp8_traits(d, n), _plan.Fp8Traits(d, 3, n) if n == 128 else _plan.Fp8Traits(d, 2, n)}}
    traits |= {_plan.fp8_traits(d, 128, True, True) for d in (64, 128)}  # P V in the input dtype
    for t in traits:
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockM": t.block_m, f"{t.cpp()}::kBlockN": t.block_n,
                 f"{t.cpp()}::kVtBoxKeys": t.vt_box_keys}
    for d, pv in itertools.product((64, 128), (False, True)):
        t = _plan.Int8Traits(d, pv)
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockM": t.block_m}
    lengths = (1, 63, 128, 129, 255, 1000, 8193, 100000, 1 << 20)
    for n in lengths:
        want |= {f"llm_attn::fp8_seqlen_k_pad({n})": _plan.fp8_seqlen_k_pad(n),
                 f"llm_attn::int8_seqlen_k_pad({n})": _plan.int8_seqlen_k_pad(n),
                 f"llm_attn::int8_stat_chunks({n})": _plan.int8_stat_chunks(n)}
    body = []
    for i, (b, hkv, sk, d, pv) in enumerate(itertools.product((1, 3), (1, 8), (1, 129, 5000), (64, 128),
                                                              (False, True))):
        offsets, size = _plan.int8_workspace(_plan.Shape(b, hkv, hkv, 1, sk, d), pv)
        body.append(f"llm_attn::FlashFwdInt8Params p{i}{{}}; p{i}.batch = {b}; p{i}.num_kv_heads = {hkv}; "
                    f"p{i}.seqlen_k = {sk}; p{i}.head_dim = {d}; p{i}.fp8_pv = {str(pv).lower()}; "
                    f"const llm_attn::FlashFwdInt8Workspace w{i} = llm_attn::flash_fwd_int8_workspace(p{i});")
        want |= {f"w{i}.{f}": off for f, off in offsets.items() if pv or f not in ("v_fp8", "v_scale")}
        want[f"w{i}.bytes"] = size
    _assert_constants(["flash_fwd_int8_quant.cuh", "flash_fwd_int8_kernel.cuh", "flash_fwd_fp8_sm90_kernel.cuh",
                       "quant_fp8.cuh"], "sm_90a", want, body)


def test_quant_entry_points_are_the_bindings(monkeypatch):
    """_nvrtc has the extension's low-precision functions (so llm_attn.ops runs either build through one path),
    which refuse bad input with binding.cpp's words (check_fwd's, before any GPU work) and, without a GPU, claim no
    kernel."""
    nvrtc = _nvrtc_or_skip()
    binding = _kernels_text("binding.cpp")
    for name in ("mha_fwd_fp8", "mha_fwd_int8", "fp8_available", "int8_available", "int8_pv_fp8", "fp8_block_n"):
        assert f'm.def("{name}"' in binding and callable(getattr(nvrtc, name)), name
    assert nvrtc.fp8_block_n(128) == _plan.fp8_block_n(128) and nvrtc.fp8_block_n(64, 100) == 0
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    for fn in (nvrtc.mha_fwd_fp8, nvrtc.mha_fwd_int8):
        with pytest.raises(RuntimeError, match="^llm_attn.mha_fwd: q must be a CUDA tensor$"):
            fn(q, q, q, None, 0.125, True)
        with pytest.raises(RuntimeError, match="^llm_attn.mha_fwd: only float16 and bfloat16 are supported"):
            fn(q.float(), q.float(), q.float(), None, 0.125, True)
    if not torch.cuda.is_available():
        assert not nvrtc.fp8_available() and not nvrtc.int8_available() and not nvrtc.int8_pv_fp8()


def _binding_literals() -> str:
    """binding.cpp as _kernels_text gives it, with adjacent string literals joined (a message split over lines)."""
    return re.sub(r'"\s+"', "", _kernels_text("binding.cpp"))


def test_fp8_pv_checks_are_the_bindings(monkeypatch, fp8_env):
    """mha_fwd_fp8's pv (P V in the input dtype) refusals in binding.cpp's words and order, without a GPU: after
    check_fwd and fp8_qk_code's, fp8_pv_code's, then pv='input' with e4m3 Q K^T; after the availability check (the
    device stood in for), the tile's (the same for both P V types). fp8_block_n takes pv as the binding's does
    (fp8_pv_code's refusal included)."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import kernel_contract

    fp8_env()
    binding = _binding_literals()
    pre = "llm_attn.mha_fwd_fp8: "
    bad_pv = "pv must be 'e4m3' or 'input' (the operands of P V), not '"
    e4m3 = "pv='input' runs with int8 Q K^T only (qk 'int8' or ''), not qk='e4m3'"
    bad_qk = "qk must be 'int8' or 'e4m3' (the operands of Q K^T), not '"
    for text in (f'"{pre}{bad_pv}", pv, "\'"', f'"{pre}{e4m3}"'):
        assert text in binding, text
    for line in ("check_fwd(q, k, v, nullptr, nullptr, seqused_k, scale, causal); const int qk_asked = "
                 "fp8_qk_code(qk); const int pv_code = fp8_pv_code(pv); const bool pv_input = pv_code == llm_attn::kFp8PvInput; "
                 "TORCH_CHECK(!pv_input || qk != \"e4m3\",",
                 "const int qk_code = pv_input ? llm_attn::kFp8QkInt8 : qk_asked;",
                 'py::arg("block_n") = 0, py::arg("qk") = "", py::arg("pv") = "");',
                 'py::arg("head_dim"), py::arg("block_n") = 0, py::arg("pv") = "", py::arg("qk") = "");',
                 "llm_attn::flash_fwd_fp8_block_n(static_cast<int>(q.size(3)), static_cast<int>(block_n), pv_code, "
                 "qk_code);"):
        assert line in binding, line
    assert binding.index(f'"{pre}{e4m3}"') < binding.index("FP8 attention needs a compute capability 9.0") \
        < binding.index("the FP8 kernel has no ")
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)

    def refused(message: str, **kw):
        with pytest.raises(RuntimeError, match="^" + re.escape(pre + message) + "$"):
            nvrtc.mha_fwd_fp8(q, q, q, None, 0.125, True, **kw)

    with pytest.raises(RuntimeError, match="^llm_attn.mha_fwd: q must be a CUDA tensor$"):  # check_fwd first
        nvrtc.mha_fwd_fp8(q, q, q, None, 0.125, True, qk="bogus", pv="bogus")
    monkeypatch.setattr(kernel_contract, "launcher_problem", lambda *a: None)  # CPU tensors past check_fwd
    for pv in ("", "e4m3", "input", "bogus"):
        refused(bad_qk + "bogus'", qk="bogus", pv=pv)
    refused(bad_pv + "bogus'", qk="e4m3", pv="bogus")
    refused(bad_pv + "INPUT'", pv="INPUT")
    refused(e4m3, qk="e4m3", pv="input")
    refused(e4m3, qk="e4m3", pv="input", block_n=192)
    monkeypatch.setattr(nvrtc, "_device_of", lambda q: contextlib.nullcontext((0, 1234)))
    monkeypatch.setattr(nvrtc, "fp8_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^llm_attn.mha_fwd_fp8: FP8 attention needs a compute capability 9.0"):
        nvrtc.mha_fwd_fp8(q, q, q, None, 0.125, True, 192, "int8", "input")
    monkeypatch.setattr(nvrtc, "fp8_available", lambda: True)
    for pv, with_pv in (("e4m3", ""), ("input", " with pv='input' (128 or 192)")):
        refused(f"the FP8 kernel has no 100-key tile for head_dim 64{with_pv} in this build (kernel_tiles.h "
                "Fp8Tiles)", block_n=100, pv=pv)
    for d in (64, 128):
        assert nvrtc.fp8_block_n(d, 0, "input") == nvrtc.fp8_block_n(d, pv="e4m3", qk="e4m3") \
            == _plan.fp8_block_n(d, qk="e4m3")
        assert nvrtc.fp8_block_n(d, qk="int8") == _plan.fp8_block_n(d, qk="int8") == _kernel_table.FP8_INT8_DEFAULT[d]
        assert nvrtc.fp8_block_n(d, 192, "input") == 192 and nvrtc.fp8_block_n(d, 100, "input") == 0
    with pytest.raises(RuntimeError, match="^" + re.escape(pre + bad_pv + "fp8'") + "$"):
        nvrtc.fp8_block_n(128, 0, "fp8")


@pytest.mark.parametrize("pv,qk,env_qk", [("", "", None), ("e4m3", "e4m3", None), ("input", "", "e4m3"),
                                          ("input", "int8", None)])
def test_mha_fwd_fp8_fills_what_the_binding_fills(monkeypatch, fp8_env, pv, qk, env_qk):
    """_nvrtc.mha_fwd_fp8 without a GPU (the device, the launches and the tensor maps stood in for, CPU tensors past
    the checks): the workspaces as binding.cpp's mha_fwd_fp8 lays them out (no V^T and a null vt8 with P V in the
    input dtype), the launches of launch_fp8_tile in order (one FlashFwdFp8Params for the pre-pass and inside
    Fp8Sm90Params), and Fp8Sm90Params' maps: e4m3 Q and K, then V^T (encode_fp8_map) or, for pv 'input' (int8
    Q K^T whatever LLM_ATTN_FP8_QK says), the caller's V as the bf16 kernel's (make_tensor_map, 128-key boxes), the
    other map left zeroed."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import _cuda_abi, _nvrtc_sm90, kernel_contract

    fp8_env()
    if env_qk is None:
        monkeypatch.delenv("LLM_ATTN_FP8_QK", raising=False)
    else:
        monkeypatch.setenv("LLM_ATTN_FP8_QK", env_qk)
    monkeypatch.setattr(kernel_contract, "launcher_problem", lambda *a: None)
    monkeypatch.setattr(nvrtc, "_device_of", lambda q: contextlib.nullcontext((0, 1234)))
    monkeypatch.setattr(nvrtc, "fp8_available", lambda: True)
    launched, maps = [], []

    def launch(i, lc, params, stream):
        assert (i, stream) == (0, 1234)
        launched.append((lc, type(params).from_buffer_copy(params)))

    def encoder(kind):
        def encode(*args):
            maps.append((kind, *args))
            return bytes([len(maps)]) * 128
        return encode

    monkeypatch.setattr(nvrtc, "_launch", launch)
    monkeypatch.setattr(_nvrtc_sm90, "fp8_tensor_map", encoder("e4m3"))
    monkeypatch.setattr(_nvrtc_sm90, "tensor_map", encoder("input"))
    b, hq, hkv, sq, sk, d = 2, 8, 2, 77, 300, 128
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) memory
    k = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16).transpose(1, 2)  # its own strides, which the map takes
    out, lse = nvrtc.mha_fwd_fp8(q, k, v, None, 0.125, True, 0, qk, pv)
    assert out.shape == q.shape and lse.shape == (b, hq, sq)
    pv_input = pv == "input"
    shape = _plan.Shape(b, hq, hkv, sq, sk, d, True, True)
    traits = _plan.fp8_traits(d, _plan.fp8_block_n(d, 0, pv, "int8" if pv_input else qk),
                              pv_input or nvrtc.fp8_qk(qk) == "int8", pv_input)
    assert traits.pv_input == pv_input and traits.qk_int8 == (pv != "e4m3")
    assert [lc for lc, _ in launched] == list(_plan.fp8_launches(shape, traits)) and len(launched) == 4
    *pre, (_, sp) = launched
    assert isinstance(sp, _nvrtc_sm90.Fp8Sm90Params)
    assert all(isinstance(x, _cuda_abi.FlashFwdFp8Params) and bytes(x) == bytes(sp.f) for _, x in pre)
    f = sp.f
    assert (f.p.q, f.p.k, f.p.v, f.p.o, f.p.lse) == tuple(t.data_ptr() for t in (q, k, v, out, lse))
    ws = _plan.fp8_workspace(shape, pv_input)
    assert ws.vt8 == (0 if pv_input else b * hkv * d * _plan.fp8_seqlen_k_pad(sk))
    assert f.k8 - f.q8 == ws.q8 and (f.vt8 is None if pv_input else f.vt8 - f.k8 == ws.k8)
    at = f.stats
    for name in ("stats", "q_scale", "k_scale", "v_scale", "q_dot_kmean"):
        assert getattr(f, name) == at, name
        at += 4 * getattr(ws, name)
    assert sp.pingpong == _plan.sm90_tuning()[1]
    n = traits.block_n  # the default tile: int8 Q K^T with e4m3 P V has its own, the others Fp8Tiles<128>'s first
    int8_e4m3 = not pv_input and nvrtc.fp8_qk(qk) == "int8"
    assert n == (_kernel_table.FP8_INT8_DEFAULT[d] if int8_e4m3 else _kernel_table.FP8_BLOCK_N[d][0])
    want = [("e4m3", f.q8, d, sq, hq, b, d, 128), ("e4m3", f.k8, d, sk, hkv, b, d, n)]
    if pv_input:
        want.append(("input", v.data_ptr(), 0, d, sk, hkv, b, *v.stride()[:3], n))
    else:
        want.append(("e4m3", f.vt8, _plan.fp8_seqlen_k_pad(sk), d, hkv, b, traits.vt_box_keys, d))
    assert maps == want
    got = {name: bytes(getattr(sp, name)) for name in ("tma_q", "tma_k", "tma_vt", "tma_v")}
    assert got == {"tma_q": b"\1" * 128, "tma_k": b"\2" * 128, "tma_vt": b"\0" * 128 if pv_input else b"\3" * 128,
                   "tma_v": b"\3" * 128 if pv_input else b"\0" * 128}


# -- the decode over the FP8 KV cache ----------------------------------------------------------------------------
# The C++ host code _plan's decode_fp8kv_plan and _nvrtc.mha_decode_fp8kv mirror (binding.cpp's mha_decode_fp8kv,
# flash_decode_fp8kv.cu, flash_decode_fp8kv_launch.cuh): a change there fails here until they follow.
FP8KV_HOST_LINES = (
    ("flash_decode_fp8kv.cu", "if (!use_decode_kernel(p.base)) return 1; const int splits = flash_fwd_num_splits("
                              "p.base, num_sms); if (flash_decode_forced_splits() > 0) return splits;"),
    ("flash_decode_fp8kv_launch.cuh", "dim3 grid(params.base.num_splits, params.base.num_kv_heads, params.base.batch); "
                                      "flash_decode_fp8kv_kernel<T, Traits><<<grid, Traits::kThreads, smem, stream>>>("
                                      "params);"),
    ("flash_decode_fp8kv_launch.cuh", "if (flash_decode_fp8kv_two_groups(params, params.base.num_splits, "
                                      "num_sms_current_device(), max_smem_per_block_current_device())) return "
                                      "launch_decode_fp8kv<T, typename Config::OneTileWG2>(params, stream); "
                                      "return rows > 16 ? launch_decode_fp8kv<T, typename Config::TwoTiles>(params, "
                                      "stream) : launch_decode_fp8kv<T, typename Config::OneTile>(params, stream);"),
    ("flash_decode_fp8kv.cu", "return rows <= 16 && smem <= smem_per_block_optin && static_cast<int64_t>(splits) * "
                              "p.base.batch * p.base.num_kv_heads <= num_sms;"),
    ("flash_decode_fp8kv.cu", "if (!use_decode_kernel(p.base)) { // a prefill over the cache: never split if "
                              "(p.base.num_splits != 1) return cudaErrorInvalidValue;"),
    ("flash_prefill_fp8kv_launch.cuh", "dim3 grid((rows + Traits::kRows - 1) / Traits::kRows, "
                                       "params.base.num_kv_heads, params.base.batch); flash_prefill_fp8kv_kernel<T, "
                                       "Traits><<<grid, Traits::kThreads, smem, stream>>>(params);"),
    ("flash_prefill_fp8kv_launch.cuh", "if (flash_prefill_fp8kv_version(params, V2::kRows, num_sms) == 1) return "
                                       "launch_prefill_fp8kv<T, typename PrefillFp8KvConfig<kHeadDim>::Tile>(params, "
                                       "stream); return launch_prefill_fp8kv<T, V2>(params, stream);"),
    ("flash_decode_fp8kv.cu", 'if (v != nullptr && std::strcmp(v, "1") == 0) return 1; if (v != nullptr && '
                              'std::strcmp(v, "2") == 0) return 2;'),
    ("flash_decode_fp8kv.cu", "return 2 * blocks > num_sms ? 2 : 1;"),
    ("binding.cpp", "p.tile = llm_attn::kTileAuto;"),
    ("binding.cpp", "p.num_splits = llm_attn::flash_decode_fp8kv_num_splits(fp, props->multiProcessorCount, "
                    "static_cast<int>(props->sharedMemPerBlockOptin));"),
    ("binding.cpp", "const int64_t n_counters = static_cast<int64_t>(p.batch) * p.num_kv_heads; int* pooled = "
                    "pooled_counters(q.get_device(), stream, n_counters); workspace = at::empty({rows * (p.head_dim + "
                    "1) + (pooled ? 0 : n_counters)}, q.options().dtype(at::kFloat));"),
    ("binding.cpp", "at::Tensor out = at::empty({batch, seqlen_q, num_heads, head_dim}, q.options()).transpose(1, 2);"),
)


def test_fp8kv_decode_plan_mirrors_the_cpp_host_code():
    """decode_fp8kv_plan follows the C++ host code (FP8KV_HOST_LINES): the decode rule's split count (a forced count
    clamped to the 64-key tiles; the forced decode config ignored), one row tile up to 16 rows and two above, the
    grid (splits, KV heads, batch); above 32 rows the prefill kernel, unsplit, on (row blocks, KV heads, batch);
    whatever it launches is compiled above and fits every device's shared memory."""
    for name, line in FP8KV_HOST_LINES:
        assert line in _kernels_text(name), f"{name} no longer has `{line}`: update llm_attn/_plan.py / _nvrtc.py"
    # Llama 3 8B decode on an H100 at 32k keys: 8 (batch x KV head) pairs; about two blocks an SM asks 33 splits,
    # cut to 32 (the 33rd would get none of the 512 tiles), of 16 tiles: more than one combine batch of short splits,
    # so halved to 16 in blocks of two warp groups (one m16 row tile, 3 stages a group: 100.3 KB, 256 threads).
    s = _plan.Shape(1, 32, 8, 1, 32768, 128, True, True)
    p = _plan.decode_fp8kv_plan(s, H100)
    assert (p.num_splits, p.decode, len(p.launches)) == (16, True, 1)
    launch = p.launches[0]
    assert launch.kernel == ("llm_attn::flash_decode_fp8kv_kernel<__nv_bfloat16, "
                             "llm_attn::DecodeFp8KvTraits<128, 1, 3, 2>>")
    assert (launch.grid, launch.threads, launch.smem) == ((16, 8, 1), 256,
                                                          16 * 128 * 2 + 256 + 2 * 2 * 3 * 64 * 128)
    # At 64k keys the splits are 32 tiles long: 32 splits of one-group blocks (53 KB, 128 threads); on an RTX 4060 Ti
    # (99 KB a block) two-group blocks of head_dim 128 do not fit: one-group blocks whatever the grid.
    p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_k=65536), H100)
    assert p.num_splits == 32 and p.launches[0].kernel.endswith("DecodeFp8KvTraits<128, 1, 3, 1>>")
    assert (p.launches[0].threads, p.launches[0].smem) == (128, 16 * 128 * 2 + 128 + 2 * 3 * 64 * 128)
    # 8k keys: the rule's 16 splits x 8 pairs = 128 blocks, at most one an SM: two groups; not on the 4060 Ti.
    p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_k=8192), H100)
    assert p.num_splits == 16 and p.launches[0].kernel.endswith("DecodeFp8KvTraits<128, 1, 3, 2>>")
    for kv in (8192, 32768):
        p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_k=kv), RTX4060TI)
        assert p.launches[0].kernel.endswith("DecodeFp8KvTraits<128, 1, 3, 1>>")
    # head_dim 64's two-group blocks (50.3 KB) fit it: at 1024 keys the grid is at most one block an SM there too.
    p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_k=1024, head_dim=64), RTX4060TI)
    assert p.num_splits * 8 <= 34 and p.launches[0].kernel.endswith("DecodeFp8KvTraits<64, 1, 3, 2>>")
    # The split count at every shape against the fp16 kernel's (flash_fwd_num_splits), whatever the tile or decode
    # config.
    for (b, hq, hkv), sq, sk, dev in itertools.product(((1, 32, 8), (4, 32, 8), (16, 32, 8), (1, 8, 8), (2, 32, 1)),
                                                       (1, 2, 4), (1, 100, 1000, 8192), (H100, RTX4060TI, ORIN)):
        shape = _plan.Shape(b, hq, hkv, sq, sk, 64, False, False, _plan.TILE_LARGE, 0, 3)
        rows = hq // hkv * sq
        if rows > _plan.DECODE_MAX_ROWS:  # the prefill kernel: never split, whatever is forced
            p = _plan.decode_fp8kv_plan(shape, dev)
            assert (p.num_splits, p.decode, len(p.launches)) == (1, False, 1)
            v2 = 2 * -(-rows // 128) * hkv * b > dev.num_sms  # the grid rule: v2 where its blocks fill half the SMs
            want = ((-(-rows // 128), hkv, b), "PrefillFp8KvV2Traits") if v2 else ((-(-rows // 64), hkv, b),
                                                                                   "PrefillFp8KvTraits<")
            assert p.launches[0].grid == want[0] and want[1] in p.launches[0].kernel
            p = _plan.decode_fp8kv_plan(shape, dev, 2)
            assert p.launches[0].grid == (-(-rows // 128), hkv, b) and "PrefillFp8KvV2Traits" in p.launches[0].kernel
            p = _plan.decode_fp8kv_plan(shape, dev, 1)
            assert p.launches[0].grid == (-(-rows // 64), hkv, b) and "PrefillFp8KvTraits" in p.launches[0].kernel
            continue
        # The fp16 rule's count, or more: up to ~2 blocks an SM, each split keeping >= 8 tiles; either cut to the
        # splits that get a tile (the kernel gives each ceil(tiles / splits)); or about half that in two-group
        # blocks, one an SM at most.
        p = _plan.decode_fp8kv_plan(shape, dev)
        got, fp16 = p.num_splits, _plan.num_splits(shape, dev.num_sms)
        tiles = -(-sk // 64)
        cut = -(-tiles // -(-tiles // fp16))
        two_groups = p.launches[0].kernel.endswith(", 2>>")
        assert not two_groups or (rows <= 16 and got * b * hkv <= dev.num_sms), (shape, dev, got)
        assert (got == cut or fp16 < got <= min(2 * dev.num_sms // (b * hkv), sk // 64 // 8)
                or two_groups), (shape, dev, got, fp16)
    # MQA (32 rows): two row tiles, 3 stages, 76 KB (the merge buffer); 16 rows still one.
    assert _plan.decode_fp8kv_plan(_plan.Shape(1, 32, 1, 1, 4096, 128), H100).launches[0].kernel.endswith(
        "DecodeFp8KvTraits<128, 2, 3, 1>>")
    # (Shape, splits, device): a grid above one block an SM, 17-32 rows, a grid of at most one block an SM.
    traits = _plan.decode_fp8kv_traits
    assert traits(_plan.Shape(1, 32, 8, 4, 4096, 128), 32, H100) == _plan.DecodeFp8KvTraits(128, 1, 3)
    assert traits(_plan.Shape(1, 32, 8, 5, 4096, 128), 8, H100) == _plan.DecodeFp8KvTraits(128, 2, 3)
    assert traits(_plan.Shape(1, 32, 8, 4, 4096, 128), 16, H100) == _plan.DecodeFp8KvTraits(128, 1, 3, 2)
    # A forced split count (force_decode(splits=)) is clamped to the 64-key tiles.
    for forced, want in ((1, 1), (7, 7), (500, 16)):
        p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_k=1000, decode_splits=forced), H100)
        assert p.num_splits == want and p.launches[0].grid == (want, 8, 1)
    with pytest.raises(ValueError, match="head_dim 96"):
        _plan.decode_fp8kv_plan(dataclasses.replace(s, head_dim=96), H100)
    with pytest.raises(ValueError, match="head_dim 96"):
        _plan.decode_fp8kv_plan(dataclasses.replace(s, head_dim=96, seqlen_q=100), H100)
    # A chunked prefill of Llama 3 8B: 8192 queries x 4 heads per KV head = 256 row blocks of 128 (v2, the default),
    # 96.1 KB; v1 (LLM_ATTN_FP8KV_PREFILL_V=1): 512 row blocks of 64, 48.1 KB.
    p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_q=8192, decode_splits=7), H100)
    assert p.launches[0] == _plan.Launch("llm_attn::flash_prefill_fp8kv_kernel<__nv_bfloat16, "
                                         "llm_attn::PrefillFp8KvV2Traits<128, 8, 2>>", (256, 8, 1), 256,
                                         128 + 2 * 2 * 64 * 128 + 2 * 2 * 64 * 128 * 2)
    p = _plan.decode_fp8kv_plan(dataclasses.replace(s, seqlen_q=8192, decode_splits=7), H100, 1)
    assert p.launches[0] == _plan.Launch("llm_attn::flash_prefill_fp8kv_kernel<__nv_bfloat16, "
                                         "llm_attn::PrefillFp8KvTraits<128, 4, 3>>", (512, 8, 1), 128,
                                         128 + 3 * 2 * 64 * 128)
    # A 256-token chunk: 8 row blocks of 128 x 8 KV heads = 64 blocks, under half the H100's 132 SMs: v1 (its 128
    # blocks of 64 rows); on a 34-SM RTX 4060 Ti the same 64 blocks fill the SMs: v2. Forced: as forced.
    chunk = dataclasses.replace(s, seqlen_q=256)
    assert "PrefillFp8KvTraits<128, 4, 3>" in _plan.decode_fp8kv_plan(chunk, H100).launches[0].kernel
    assert "PrefillFp8KvV2Traits<128, 8, 2>" in _plan.decode_fp8kv_plan(chunk, RTX4060TI).launches[0].kernel
    assert "PrefillFp8KvV2Traits<128, 8, 2>" in _plan.decode_fp8kv_plan(chunk, H100, 2).launches[0].kernel
    known = set(_plan.decode_fp8kv_kernels()) | set(_plan.prefill_fp8kv_kernels())
    seen = set()
    for (b, hq, hkv), sq, d, bf16, dev, version in itertools.product(
            ((1, 32, 8), (3, 8, 8), (1, 32, 1), (2, 16, 2)), (1, 2, 3, 33, 300), (64, 128), (False, True),
            (H100, RTX4060TI, ORIN), (1, 2)):
        for launch in _plan.decode_fp8kv_plan(_plan.Shape(b, hq, hkv, sq, 777, d, True, bf16), dev, version).launches:
            assert launch.kernel in known and launch.smem <= dev.smem_per_block_optin
            assert min(launch.grid) > 0 and launch.grid[1] <= 65535 and launch.grid[2] <= 65535
            seen.add(launch.kernel)
    assert seen == known, known - seen


def test_fp8kv_decode_splits_are_the_cpp(tmp_path, monkeypatch):
    """decode_fp8kv_num_splits against kernels/flash_decode_fp8kv.cu's flash_decode_fp8kv_num_splits itself (with
    flash_fwd.cu's rule it calls): the host C++ compiler builds both (stand-in CUDA headers, the kernels' launches
    stubbed) and runs them on every (shape, SM count, forced split count) case below."""
    monkeypatch.delenv("LLM_ATTN_FP8KV_PREFILL_V", raising=False)  # the grid rule, in the C++ process and here
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to run flash_decode_fp8kv_num_splits with")
    (tmp_path / "cuda_runtime.h").write_text(textwrap.dedent("""
        #pragma once
        enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidDeviceFunction = 98 };
        enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                              cudaDevAttrMaxSharedMemoryPerMultiprocessor, cudaDevAttrComputeCapabilityMajor,
                              cudaDevAttrComputeCapabilityMinor };
        typedef struct CUstream_st* cudaStream_t;
        inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
        inline cudaError_t cudaDeviceGetAttribute(int*, cudaDeviceAttr, int) { return cudaErrorInvalidValue; }
        #define __host__
        #define __device__
    """))
    (tmp_path / "cuda_bf16.h").write_text("#pragma once\nstruct __nv_bfloat16 {};\n")
    (tmp_path / "cuda_fp16.h").write_text("#pragma once\nstruct half {};\n")
    (tmp_path / "run.cpp").write_text(textwrap.dedent("""
        #include "flash_fwd.cu"
        #include "flash_decode_fp8kv.cu"
        #include <cstdio>
        namespace llm_attn {
        template <typename T, int D, bool C>
        cudaError_t run_flash_fwd_(FlashFwdParams&, cudaStream_t) { return cudaSuccess; }
        template <typename T, int D>
        cudaError_t run_flash_decode_(FlashFwdParams&, cudaStream_t) { return cudaSuccess; }
        template <typename T, int D, bool C>
        cudaError_t run_flash_fwd_sm90_(FlashFwdParams&, cudaStream_t) { return cudaSuccess; }
        template <typename T, int D, bool C>
        bool flash_fwd_sm90_built_() { return false; }
        template <typename T, int D>
        cudaError_t run_flash_decode_fp8kv_(FlashDecodeFp8KvParams&, cudaStream_t) { return cudaSuccess; }
        template <typename T, int D>
        cudaError_t run_flash_prefill_fp8kv_(FlashDecodeFp8KvParams&, cudaStream_t) { return cudaSuccess; }
        }
        int main() {
            int b, hq, hkv, sq, sk, d, sms, smem, forced;
            while (std::scanf("%d %d %d %d %d %d %d %d %d", &b, &hq, &hkv, &sq, &sk, &d, &sms, &smem, &forced) == 9) {
                llm_attn::flash_decode_force_splits(forced);
                llm_attn::FlashDecodeFp8KvParams fp{};
                llm_attn::FlashFwdParams& p = fp.base;
                p.batch = b, p.num_heads = hq, p.num_kv_heads = hkv, p.seqlen_q = sq, p.seqlen_k = sk, p.head_dim = d;
                p.tile = llm_attn::kTileAuto;
                const int splits = llm_attn::flash_decode_fp8kv_num_splits(fp, sms, smem);
                std::printf("%d %d %d\\n", splits, llm_attn::flash_prefill_fp8kv_version(fp, 128, sms),
                            llm_attn::flash_decode_fp8kv_two_groups(fp, splits, sms, smem) ? 1 : 0);
            }
        }
    """))
    exe = tmp_path / "run"
    r = subprocess.run([cxx, "-std=c++17", "-O1", f"-I{tmp_path}", f"-I{os.path.join(ROOT, 'kernels')}",
                        str(tmp_path / "run.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = [(_plan.Shape(b, hq, hkv, sq, sk, d, decode_splits=forced), sms, smem)
             for (b, hq, hkv), sq, sk, d, sms, smem, forced in itertools.product(
                 ((1, 32, 8), (2, 32, 8), (4, 32, 8), (8, 32, 8), (16, 32, 8), (64, 32, 8), (1, 8, 8), (3, 32, 1),
                  (5, 16, 2), (1, 64, 1)),
                 (1, 2, 4, 5), (1, 63, 64, 65, 300, 1000, 1023, 1024, 2049, 8192, 32768, 131072), (64, 128),
                 (16, 34, 108, 132, 144), (99 * 1024, 227 * 1024), (0, 1, 2, 7, 500))]
    lines = "".join(f"{s.batch} {s.num_heads} {s.num_kv_heads} {s.seqlen_q} {s.seqlen_k} {s.head_dim} {sms} {smem} "
                    f"{s.decode_splits}\n" for s, sms, smem in cases)
    run = subprocess.run([str(exe)], input=lines, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout.split()
    got, versions, groups = out[0::3], out[1::3], out[2::3]
    assert len(got) == len(versions) == len(groups) == len(cases)
    bad = [(s, sms, smem, g, _plan.decode_fp8kv_num_splits(s, sms, smem)) for (s, sms, smem), g in zip(cases, got)
           if int(g) != _plan.decode_fp8kv_num_splits(s, sms, smem)]
    assert not bad, f"{len(bad)} of {len(cases)} cases differ (shape, SMs, smem, C++, Python), e.g. {bad[:3]}"
    assert {int(g) for g in got} >= {1, 2, 7, 16, 128}  # the rule's branches were all reached
    want_groups = [_plan.decode_fp8kv_two_groups(s, int(g), sms, smem) for (s, sms, smem), g in zip(cases, got)]
    bad = [c for c, g, w in zip(cases, groups, want_groups) if (g == "1") != w]
    assert not bad, f"{len(bad)} two-group choices differ, e.g. {bad[:3]}"
    assert {True, False} <= set(want_groups)
    # halved where two-group blocks run it: B = 1, 8 KV heads, 16k-32k keys on 132 SMs (227 KB), not on 99 KB
    assert _plan.decode_fp8kv_num_splits(_plan.Shape(1, 32, 8, 1, 16384, 128), 132, 227 * 1024) == 16
    assert _plan.decode_fp8kv_num_splits(_plan.Shape(1, 32, 8, 1, 16384, 128), 132, 99 * 1024) == 32
    for (s, _sms, _smem), g in zip(cases, got):  # the rule's own counts leave no split without a tile (the kernel)
        n, tiles = int(g), -(-s.seqlen_k // 64)
        assert s.decode_splits or n == 1 or (n - 1) * -(-tiles // n) < tiles, (s, n)
    # B = 1, 8 KV heads, 64k keys on 132 SMs: two blocks an SM asks 33 splits of 1024 tiles; the 33rd got none
    assert _plan.decode_fp8kv_num_splits(_plan.Shape(1, 32, 8, 1, 65536, 128), 132, 227 * 1024) == 32
    # The prefill kernel's version (v2's 128-row blocks against the SM count; LLM_ATTN_FP8KV_PREFILL_V unset here).
    assert all(_plan.prefill_fp8kv_traits(d, 2).rows == 128 for d in (64, 128))
    want = [_plan.prefill_fp8kv_version(s, dataclasses.replace(H100, num_sms=sms), 0) for s, sms, _ in cases]
    bad = [(s, sms, v, w) for (s, sms, _), v, w in zip(cases, versions, want) if int(v) != w]
    assert not bad, f"{len(bad)} prefill versions differ (shape, SMs, C++, Python), e.g. {bad[:3]}"
    assert set(want) == {1, 2}


def test_fp8kv_decode_constants_match_cpp():
    """The numbers decode_fp8kv_plan uses are the header's: every DecodeFp8KvTraits' shared memory, threads and key
    tile, and kDecodeMaxRows, read back from a probe kernel's PTX (NVRTC)."""
    _nvrtc_or_skip()
    want = {"llm_attn::kDecodeMaxRows": _plan.DECODE_MAX_ROWS,
            "llm_attn::kDecodeCombineBatch": _plan.DECODE_COMBINE_BATCH}
    for d in (64, 128):
        t = _plan.PrefillFp8KvTraits(d, *_plan.PREFILL_FP8KV_CONFIG)
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockN": t.block_n, f"{t.cpp()}::kRows": t.rows,
                 f"llm_attn::PrefillFp8KvConfig<{d}>::Tile::kNWarps": t.n_warps,
                 f"llm_attn::PrefillFp8KvConfig<{d}>::Tile::kStages": t.stages}
        t = _plan.PrefillFp8KvV2Traits(d, *_plan.PREFILL_FP8KV_V2_CONFIG)
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockN": t.block_n, f"{t.cpp()}::kRows": t.rows,
                 f"llm_attn::PrefillFp8KvConfig<{d}>::V2::kNWarps": t.n_warps,
                 f"llm_attn::PrefillFp8KvConfig<{d}>::V2::kStages": t.stages}
    for d, cfg in itertools.product((64, 128), _plan.DECODE_FP8KV_CONFIGS.values()):
        t = _plan.DecodeFp8KvTraits(d, *cfg)
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockN": t.block_n, f"{t.cpp()}::kRows": 16 * t.m_tiles,
                 f"{t.cpp()}::kWGroups": t.wgroups,
                 f"llm_attn::DecodeFp8KvSmem<{t.cpp()}>::kBytes": t.smem_bytes}
    for d, cfg in itertools.product((64, 128), _plan.DECODE_FP8KV_CONFIGS):
        want[f"llm_attn::DecodeFp8KvConfig<{d}>::{cfg}::kStages"] = _plan.DECODE_FP8KV_CONFIGS[cfg][1]
        want[f"llm_attn::DecodeFp8KvConfig<{d}>::{cfg}::kMTiles"] = _plan.DECODE_FP8KV_CONFIGS[cfg][0]
        want[f"llm_attn::DecodeFp8KvConfig<{d}>::{cfg}::kWGroups"] = _plan.DECODE_FP8KV_CONFIGS[cfg][2]
    _assert_constants(["flash_decode_fp8kv_kernel.cuh", "flash_prefill_fp8kv_kernel.cuh"], "sm_80", want)


def _assert_constants(headers: list[str], arch: str, want: dict, body: list[str] = ()) -> None:
    """Each C++ expression of ``want`` (after the statements ``body``) as NVRTC evaluates it for ``arch``, stored by
    a probe kernel and read back from its PTX, equals its value in ``want``."""
    from llm_attn import _nvrtc, _nvrtc_sm90

    exprs = list(want)
    src = ("".join(f'#include "{h}"\n' for h in headers)
           + 'extern "C" __global__ void llm_attn_constants_probe(unsigned long long* out) {\n'
           + "".join(f"{line}\n" for line in body)
           + "".join(f"    out[{i}] = static_cast<unsigned long long>({e});\n" for i, e in enumerate(exprs)) + "}\n")
    values = _nvrtc_sm90.stored_values(_nvrtc.compile_ptx(arch, src, "llm_attn_constants_probe.cu"))
    got = {e: values.get(i) for i, e in enumerate(exprs)}
    assert got == want, {e: (got[e], want[e]) for e in exprs if got[e] != want[e]}


def _top_level_args(text: str) -> list[str]:
    """The comma-separated arguments of a C++ call's argument text (commas inside parentheses, braces and string
    literals do not split)."""
    args, depth, cur, quoted = [], 0, "", False
    for i, ch in enumerate(text):
        if quoted:
            quoted = not (ch == '"' and text[i - 1] != "\\")
        elif ch == '"':
            quoted = True
        elif ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return args + [cur.strip()]


def _fp8kv_binding_messages() -> set[str]:
    """binding.cpp's CHECK_FP8KV input checks (not the launch's), each message as its text with every argument that
    is not a string literal as NUL (adjacent literals joined)."""
    src = (Path(ROOT) / "kernels" / "binding.cpp").read_text()
    messages = set()
    for m in re.finditer(r"(?<!define )CHECK_FP8KV\(", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        cond, *parts = _top_level_args(src[m.end():i - 1])
        if "err" in cond:
            continue
        text = ""
        for part in parts:
            literals = re.fullmatch(r'(?:"(?:[^"\\]|\\.)*"\s*)+', part)
            text += "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', part)) if literals else "\0"
        messages.add(text)
    return messages


def _returned_messages(fn) -> set[str]:
    """The strings a Python function returns, as _fp8kv_binding_messages writes them (a formatted value: NUL)."""
    import ast
    import inspect

    out = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        v = node.value if isinstance(node, ast.Return) else None
        if isinstance(v, ast.JoinedStr):
            out.add("".join(x.value if isinstance(x, ast.Constant) else "\0" for x in v.values))
        elif isinstance(v, ast.Constant) and isinstance(v.value, str):
            out.add(v.value)
    return out


def test_fp8kv_decode_entry_is_the_binding():
    """_nvrtc has the extension's FP8-cache decode functions (so llm_attn.ops.decode_fp8_kv runs either build through
    one path, and fp8_kv_kernel_available says so): mha_decode_fp8kv refuses bad input with binding.cpp's words
    (every message its checks can return is one of binding.cpp's CHECK_FP8KV texts, and every CHECK_FP8KV text is
    one of them), before any GPU work."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import ops

    binding = _kernels_text("binding.cpp")
    for name in ("mha_decode_fp8kv", "decode_fp8kv_max_rows", "fp8kv_prefill"):
        assert f'm.def("{name}"' in binding and callable(getattr(nvrtc, name)), name
    assert nvrtc.decode_fp8kv_max_rows() == ops.FP8_KV_MAX_ROWS == _plan.DECODE_MAX_ROWS
    assert ops.fp8_kv_kernel_available(nvrtc) and ops.fp8_kv_prefill_available(nvrtc) and nvrtc.fp8kv_prefill()
    q = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
    kd = torch.zeros(1, 2, 100, 64, dtype=torch.uint8)
    ks = torch.ones(1, 2, 2)
    with pytest.raises(RuntimeError, match=r"^llm_attn.mha_decode_fp8kv: q must be a 4-D CUDA tensor \(batch, heads, "
                                           r"q_len, head_dim\)$"):
        nvrtc.mha_decode_fp8kv(q, kd, kd, ks, ks, None, 0.125, True)
    # c10's dtype names, as the binding prints them
    with pytest.raises(RuntimeError, match="^llm_attn.mha_decode_fp8kv: q must be float16 or bfloat16, got Float$"):
        nvrtc.mha_decode_fp8kv(q.float(), kd, kd, ks, ks, None, 0.125, True)
    returned = _returned_messages(nvrtc.decode_fp8kv_problem) | _returned_messages(nvrtc._fp8kv_data_problem)
    cpp = _fp8kv_binding_messages()
    assert len(cpp) >= 20 and "\0 must be a CUDA tensor on q's device" in cpp, cpp
    assert returned == cpp, {"only here": returned - cpp, "only in binding.cpp": cpp - returned}


@pytest.mark.parametrize("pooled,eager,forced,sq", [(True, False, 0, 1), (False, False, 0, 1), (True, True, 0, 1),
                                                   (False, True, 0, 1), (True, False, 3, 1), (False, False, 1, 1),
                                                   (True, True, 3, 40)])
def test_mha_decode_fp8kv_fills_what_the_binding_fills(monkeypatch, pooled, eager, forced, sq):
    """_nvrtc.mha_decode_fp8kv without a GPU (the device, the counter pool, the stream's eager buffer and the launch
    stood in for, CPU tensors past the checks): FlashDecodeFp8KvParams as binding.cpp's mha_decode_fp8kv fills it
    (set_shared_params with the byte strides of the e4m3 K/V, the scales and their strides, the automatic tile, the
    split count), the split workspace (partials in the stream's buffer when the counters are pooled, else with the
    counters zeroed after them in one allocation), the outputs' layout, one launch."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import _cuda_abi

    index, counters, buffer = 0, 0x10000, 0x200000
    asked = []
    monkeypatch.setattr(nvrtc, "decode_fp8kv_problem", lambda *a: None)
    monkeypatch.setattr(nvrtc, "_device_of", lambda q: contextlib.nullcontext((index, 1234)))
    monkeypatch.setattr(nvrtc, "device_info", lambda i: ("sm_90", H100))
    monkeypatch.setattr(nvrtc, "_pooled_counters", lambda i, stream, n: counters if pooled else None)
    # The full path every call: on a GPU machine an earlier case's call kind (the same shapes) would serve this one
    # through the real stream and device, past the stand-ins.
    monkeypatch.setattr(nvrtc, "_kinds_enabled", False)
    monkeypatch.setattr(nvrtc, "_eager_workspace",
                        lambda i, stream, nbytes: asked.append((i, stream, nbytes)) or (buffer if eager else None))
    nvrtc._decode_fp8kv_plan_for.cache_clear()
    launched = []

    def launch(i, lc, params, stream):
        assert (i, stream) == (index, 1234) and isinstance(params, _cuda_abi.FlashDecodeFp8KvParams)
        launched.append((lc, type(params).from_buffer_copy(params)))

    monkeypatch.setattr(nvrtc, "_launch", launch)
    b, hq, hkv, cap, n, d = 3, 32, 8, 1536, 1500, 128  # sq 40: 160 rows, the prefill kernel (never split)
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16).transpose(1, 2)
    kd = torch.zeros(b, hkv, cap, d, dtype=torch.float8_e4m3fn)[:, :, :n]  # a view of the cache's first n slots
    vd = torch.zeros(b, hkv, cap, d, dtype=torch.uint8)[:, :, :n]
    ks, vs = torch.ones(b, hkv, cap // 64), torch.ones(b, hkv, 32)[:, :, :24]
    used = torch.tensor([1500, 777, 0], dtype=torch.int32)
    prev = nvrtc.set_decode_splits(forced)
    try:
        out, lse = nvrtc.mha_decode_fp8kv(q, kd, vd, ks, vs, used, 0.125, True)
    finally:
        nvrtc.set_decode_splits(prev)
        nvrtc._decode_fp8kv_plan_for.cache_clear()
    plan = _plan.decode_fp8kv_plan(_plan.Shape(b, hq, hkv, sq, n, d, True, True, decode_splits=forced), H100)
    assert [lc for lc, _ in launched] == list(plan.launches) and len(launched) == 1
    assert plan.num_splits == ((forced or 5) if sq == 1 else 1)  # 132 SMs // 24 blocks
    fp = launched[0][1]
    p = fp.base
    assert out.shape == q.shape and out.dtype == q.dtype and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    for name, t in (("q", q), ("k", kd), ("v", vd), ("o", out)):
        assert (getattr(p, f"{name}_batch_stride"), getattr(p, f"{name}_head_stride"),
                getattr(p, f"{name}_row_stride")) == t.stride()[:3], name
    for name, t in (("q", q), ("k", kd), ("v", vd), ("o", out), ("lse", lse), ("seqused_k", used)):
        assert getattr(p, name) == t.data_ptr(), name
    assert (p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) == (b, hq, hkv, sq, n, d)
    assert p.scale == 0.125 and p.scale_log2 == ctypes.c_float(0.125 * 1.4426950408889634).value
    assert p.causal and p.is_bf16 and p.tile == _plan.TILE_AUTO and p.num_splits == plan.num_splits
    assert (fp.k_scale, fp.v_scale) == (ks.data_ptr(), vs.data_ptr())
    assert (fp.ks_batch_stride, fp.ks_head_stride, fp.vs_batch_stride, fp.vs_head_stride) == (*ks.stride()[:2],
                                                                                              *vs.stride()[:2])
    if plan.num_splits == 1:
        assert not p.o_accum and not p.lse_accum and not p.split_counters
        return
    rows = plan.num_splits * b * hq * sq
    assert p.lse_accum - p.o_accum == 4 * rows * d
    assert p.split_counters == (counters if pooled else p.lse_accum + 4 * rows)
    # the stream's buffer is asked only where the counters are pooled (else they share one zeroed allocation)
    assert asked == ([(index, 1234, (4 * rows * (d + 1) + 15) // 16 * 16)] if pooled else [])
    assert (p.o_accum == buffer) == (pooled and eager)


# -- the backward's plan --------------------------------------------------------------------------------------------
BWD_HOST_LINES = (
    ("flash_bwd_launch.cuh", "dim3 grid(kCausal ? params.num_kv_heads : n_blocks, kCausal ? n_blocks : "
                             "params.num_kv_heads, params.batch * params.num_splits); kKernel<<<grid, Traits::kThreads, "
                             "smem, stream>>>(params);"),
    ("flash_bwd_launch.cuh", "constexpr int kPreThreads = 128; const int64_t pre_blocks = (rows * kChunks + "
                             "kPreThreads - 1) / kPreThreads; flash_bwd_preprocess_kernel<T, kHeadDim><<<static_cast<"
                             "unsigned>(pre_blocks), kPreThreads, 0, stream>>>(params);"),
    ("flash_bwd_launch.cuh", "err = dkdv(); if (err != cudaSuccess) return err; constexpr int kConvThreads = 256; if "
                             "(!params.dq_separate) { const int64_t conv_blocks = (rows * kChunks + kConvThreads - 1) "
                             "/ kConvThreads; flash_bwd_convert_dq_kernel<T, kHeadDim><<<static_cast<unsigned>("
                             "conv_blocks), kConvThreads, 0, stream>>>(params); } if (params.num_splits == 1) return "
                             "cudaGetLastError();"),
    ("flash_bwd_launch.cuh", "const int64_t kv_rows = static_cast<int64_t>(params.batch) * params.num_kv_heads * "
                             "params.seqlen_k; const int64_t kv_blocks = (kv_rows * kChunks + kConvThreads - 1) / "
                             "kConvThreads; flash_bwd_convert_dkdv_kernel<T, kHeadDim><<<static_cast<unsigned>("
                             "kv_blocks), kConvThreads, 0, stream>>>(params);"),
    ("flash_bwd_launch.cuh", "const dim3 grid(kCausal ? params.num_heads : m_blocks, kCausal ? m_blocks : "
                             "params.num_heads, params.batch); flash_bwd_dq_kernel<T, Traits, kCausal><<<grid, "
                             "Traits::kThreads, Traits::kSmemBytes, stream>>>(params);"),
    ("flash_bwd_launch.cuh", "err = params.narrow ? launch_flash_bwd_dkdv<T, Narrow, kCausal>(params, stream) : "
                             "launch_flash_bwd_dkdv<T, Tile, kCausal>(params, stream); } if (err != cudaSuccess || "
                             "!params.dq_separate) return err; return launch_flash_bwd_dq<T, kHeadDim, kCausal>("
                             "params, stream);"),
    ("flash_bwd_sm90_launch.cuh", "using BwdConfig = Sm90BwdTraits<kHeadDim, 2>;"),
    ("flash_bwd_sm90_launch.cuh", "make_qkv_maps<T>(p, kHeadDim, Traits::kBlockM, Traits::kBlockN, &sp.tma_q, "
                                  "&sp.tma_k, &sp.tma_v) && make_tensor_map<T>(&sp.tma_do, p.dout, kHeadDim, "
                                  "p.seqlen_q, p.num_heads, p.batch, p.do_batch_stride, p.do_head_stride, "
                                  "p.do_row_stride, Traits::kBlockM) && make_tensor_map<float>(&sp.tma_dq, p.dq_accum, "
                                  "kHeadDim, p.seqlen_q, p.num_heads, p.batch, static_cast<int64_t>(p.num_heads) * "
                                  "p.seqlen_q * kHeadDim, static_cast<int64_t>(p.seqlen_q) * kHeadDim, kHeadDim, "
                                  "Traits::kDqRows);"),
    ("flash_bwd_sm90_launch.cuh", "const dim3 grid(kCausal ? p.num_kv_heads : n_blocks, kCausal ? n_blocks : "
                                  "p.num_kv_heads, p.batch * p.num_splits); flash_bwd_sm90_kernel<T, Traits, kCausal>"
                                  "<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);"),
    ("tma_host.h", "const cuuint32_t box[4] = {128 / sizeof(T), static_cast<cuuint32_t>(box_rows), 1, 1};"),
    ("binding.cpp", "const int64_t slabs = p.num_splits > 1 ? (deterministic ? p.num_splits : 1) : 0; const int64_t "
                    "dq_bytes = p.dq_separate ? 0 : part(rows * head_dim); const int64_t dkv_bytes = part(slabs * "
                    "batch * num_kv_heads * seqlen_k * head_dim);"),
    ("binding.cpp", "if (!p.dq_separate) p.dq_accum = reinterpret_cast<float*>(acc); if (slabs > 0) { p.dk_accum = "
                    "reinterpret_cast<float*>(acc + dq_bytes); p.dv_accum = reinterpret_cast<float*>(acc + dq_bytes + "
                    "dkv_bytes); }"),
    ("binding.cpp", "CHECK_BWD(!deterministic || g_bwd_tile < llm_attn::kBwdHopper || g_bwd_tile > "
                    "llm_attn::kBwdHopperSharedDq, \"deterministic=True, but the Hopper backward was forced "
                    "(force_bwd_tile('hopper...')): its dQ is summed \" \"in no fixed order; force 'auto', "
                    "'portable', 'narrow' or 'portable_separate_dq'\"); p.deterministic = deterministic;"),
    ("binding.cpp", "const char* v = std::getenv(\"LLM_ATTN_BWD_SPLITS\"); return v != nullptr && std::atoi(v) > 0 ? "
                    "std::atoi(v) : 0;"),
    ("binding.cpp", "if (tile < llm_attn::kBwdAuto || tile > llm_attn::kBwdPortable2d) return -1;"),
    ("binding.cpp", "if (splits < 0) return -1;"),
)
A100 = _plan.Device(num_sms=108, smem_per_sm=164 * 1024, smem_per_block_optin=163 * 1024, cc_major=8)
BWD_DEVICES = (H100, H100_SM90, RTX4060TI, ORIN, A100)
BWD_SHAPES = tuple(itertools.product(((1, 32, 8), (2, 8, 8), (4, 32, 32), (1, 8, 1), (3, 6, 2)),
                                     ((1, 1), (17, 17), (63, 129), (129, 63), (300, 1000), (1000, 300), (2048, 2048),
                                      (8192, 8192), (2049, 2049), (16384, 16384)),
                                     (64, 128), (False, True)))


def test_backward_launches_mirror_the_cpp_host_code():
    """bwd_plan follows the C++ host code (BWD_HOST_LINES) and gives its launch sequence on known shapes."""
    for name, line in BWD_HOST_LINES:
        assert line in _kernels_text(name), f"{name} no longer has `{line}`: update llm_attn/_plan.py"
    # Llama 3 8B, 2048 tokens, causal bf16 on an H100 running the Hopper kernel: 16 key blocks x 8 KV heads = 128
    # blocks < 2 x 132, 8704 steps: shares of at most 1.25 x 8704 / 132 -> 83 steps, so the 128 steps of the first
    # key block split in 2 shares of 64, dQ shared by the warpgroups; then the dQ and dK/dV conversions.
    s = _plan.BwdShape(1, 32, 8, 2048, 2048, 128, True, True)
    p = _plan.bwd_plan(s, H100_SM90)
    assert (p.splits.hopper, p.splits.num_splits, p.splits.iters_per_split, p.splits.dq_shared) == (True, 2, 64, True)
    assert [x.kernel for x in p.launches] == [
        "llm_attn::flash_bwd_preprocess_kernel<__nv_bfloat16, 128>",
        "llm_attn::sm90::flash_bwd_sm90_kernel<__nv_bfloat16, llm_attn::sm90::Sm90BwdTraits<128, 2>, true>",
        "llm_attn::flash_bwd_convert_dq_kernel<__nv_bfloat16, 128>",
        "llm_attn::flash_bwd_convert_dkdv_kernel<__nv_bfloat16, 128>"]
    assert p.preprocess.grid == (2048 * 32 * 16 // 128, 1, 1) and p.convert_dkdv.grid == (8 * 2048 * 16 // 256, 1, 1)
    assert (p.dkdv.grid, p.dkdv.threads, p.dkdv.smem) == ((8, 16, 2), 384, _plan.Sm90BwdTraits(128).smem_bytes)
    assert p.sm90 == _plan.Sm90BwdTraits(128)
    # The same on an RTX 4060 Ti (99 KB a block): the narrow tile, 4 warps x 64 keys, two blocks an SM.
    p = _plan.bwd_plan(s, RTX4060TI)
    assert p.splits.narrow and not p.splits.hopper and p.sm90 is None
    assert p.dkdv.kernel.endswith("BwdTraits<128, 32, 64, 4, 1>, true>") and p.dkdv.threads == 128
    # On an A100 (163 KB a block) head_dim 128 takes the two-dimensional kernel (161 KB, 8 warps), head_dim 64 the
    # 16-keys-a-warp tile; forced 'portable' keeps that tile at 128 too.
    p = _plan.bwd_plan(s, A100)
    assert p.splits.layout2d and not p.splits.narrow and p.dkdv.kernel == (
        "llm_attn::flash_bwd_dkdv_2d_kernel<__nv_bfloat16, llm_attn::Bwd2dTraits<128>, true>")
    assert (p.dkdv.threads, p.dkdv.smem) == (256, _plan.bwd_2d_smem_bytes(128)) == (256, 164864)
    for other in (dataclasses.replace(s, head_dim=64), dataclasses.replace(s, force_tile=_plan.BWD_PORTABLE)):
        p = _plan.bwd_plan(other, A100)
        assert not p.splits.layout2d and p.dkdv.kernel.startswith("llm_attn::flash_bwd_dkdv_kernel<")
    # Non-causal, 8192 tokens, forced onto the separate dQ kernel: no dQ conversion, no split.
    p = _plan.bwd_plan(_plan.BwdShape(1, 32, 8, 8192, 8192, 128, False, False,
                                      force_tile=_plan.BWD_PORTABLE_SEPARATE_DQ), H100_SM90)
    assert [x.kernel.split("<")[0] for x in p.launches] == [
        "llm_attn::flash_bwd_preprocess_kernel", "llm_attn::flash_bwd_dkdv_kernel", "llm_attn::flash_bwd_dq_kernel"]
    assert p.dkdv.grid == (64, 8, 1) and p.dq.grid == (128, 32, 1) and p.dq.smem == 6 * 64 * 128 * 2
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _plan.bwd_plan(dataclasses.replace(s, force_tile=_plan.BWD_HOPPER), H100)


def test_backward_splits_are_the_cpp(tmp_path):
    """bwd_set_splits against kernels/flash_bwd.cu's flash_bwd_set_splits itself: the host C++ compiler builds it
    (stand-in CUDA headers, the device queries answering what each case says) and runs it on every (device, shape,
    forced tile, forced split, deterministic) case below; every field it sets must be the mirror's."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to run flash_bwd_set_splits with")
    (tmp_path / "cuda_runtime.h").write_text(
        "#pragma once\nenum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, "
        "cudaErrorInvalidDeviceFunction = 98 };\ntypedef struct CUstream_st* cudaStream_t;\n"
        "#define __host__\n#define __device__\n")
    (tmp_path / "cuda_bf16.h").write_text("#pragma once\nstruct __nv_bfloat16 {};\n")
    (tmp_path / "cuda_fp16.h").write_text("#pragma once\nstruct half {};\n")
    (tmp_path / "run.cpp").write_text(textwrap.dedent("""
        #include "flash_bwd.cu"
        #include <cstdio>
        static int g_smem = 0;
        static bool g_sm90 = false;
        bool llm_attn::flash_fwd_sm90_available() { return g_sm90; }
        int llm_attn::max_smem_per_block_current_device() { return g_smem; }
        namespace llm_attn {
        template <typename T, int D, bool C>
        cudaError_t run_flash_bwd_(FlashBwdParams&, cudaStream_t) { return cudaSuccess; }
        template <typename T, int D, bool C>
        cudaError_t run_flash_bwd_sm90_(FlashBwdParams&, cudaStream_t) { return cudaSuccess; }
        }
        int main() {
            int b, hq, hkv, sq, sk, d, causal, sms, smem, sm90, splits, tile, det;
            while (std::scanf("%d %d %d %d %d %d %d %d %d %d %d %d %d", &b, &hq, &hkv, &sq, &sk, &d, &causal, &sms,
                              &smem, &sm90, &splits, &tile, &det) == 13) {
                g_smem = smem, g_sm90 = sm90;
                llm_attn::FlashBwdParams p{};
                p.batch = b, p.num_heads = hq, p.num_kv_heads = hkv, p.seqlen_q = sq, p.seqlen_k = sk, p.head_dim = d;
                p.causal = causal, p.deterministic = det;
                llm_attn::flash_bwd_set_splits(p, sms, splits, tile);
                std::printf("%d %d %d %d %d %d %d\\n", p.hopper, p.narrow, p.num_splits, p.iters_per_split,
                            p.dq_shared, p.dq_separate, p.layout2d);
            }
        }
    """))
    exe = tmp_path / "run"
    r = subprocess.run([cxx, "-std=c++17", "-O1", f"-I{tmp_path}", f"-I{os.path.join(ROOT, 'kernels')}",
                        str(tmp_path / "run.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = [(_plan.BwdShape(b, hq, hkv, sq, sk, d, causal, False, splits, tile, det), dev)
             for ((b, hq, hkv), (sq, sk), d, causal), dev, splits, tile, det in itertools.product(
                 BWD_SHAPES, BWD_DEVICES, (0, 1, 3), range(len(_plan.BWD_TILE_IDS)), (False, True))]
    lines = "".join(f"{s.batch} {s.num_heads} {s.num_kv_heads} {s.seqlen_q} {s.seqlen_k} {s.head_dim} {int(s.causal)} "
                    f"{dev.num_sms} {dev.smem_per_block_optin} {int(dev.sm90)} {s.force_splits} {s.force_tile} "
                    f"{int(s.deterministic)}\n"
                    for s, dev in cases)
    run = subprocess.run([str(exe)], input=lines, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = run.stdout.splitlines()
    assert len(got) == len(cases)
    bad = []
    for (s, dev), line in zip(cases, got):
        sp = _plan.bwd_set_splits(s, dev)
        want = " ".join(str(int(x)) for x in (sp.hopper, sp.narrow, sp.num_splits, sp.iters_per_split, sp.dq_shared,
                                              sp.dq_separate, sp.layout2d))
        if line != want:
            bad.append((s, dev, line, want))
    assert not bad, f"{len(bad)} of {len(cases)} cases differ, e.g. {bad[:3]}"


def test_every_planned_backward_kernel_is_compiled():
    """Whatever bwd_plan launches, on any device, shape, forced tile and split, is one of the instantiations the
    compile tests above check, fits the device's shared memory and the grid's limits; and every one is reached."""
    known = set(_plan.bwd_kernels()) | set(_plan.bwd_sm90_kernels())
    seen = set()
    for ((b, hq, hkv), (sq, sk), d, causal), dev, bf16, splits, tile, det in itertools.product(
            BWD_SHAPES, BWD_DEVICES, (False, True), (0, 3), range(len(_plan.BWD_TILE_IDS)), (False, True)):
        s = _plan.BwdShape(b, hq, hkv, sq, sk, d, causal, bf16, splits, tile, det)
        if _plan.BWD_HOPPER <= tile <= _plan.BWD_HOPPER_SHARED_DQ and (not dev.sm90 or det):
            with pytest.raises(ValueError):
                _plan.bwd_plan(s, dev)
            continue
        p = _plan.bwd_plan(s, dev)
        for launch in p.launches:
            assert launch.kernel in known, launch.kernel
            assert launch.smem <= dev.smem_per_block_optin, (launch, dev)
            assert min(launch.grid) > 0 and launch.grid[1] <= 65535 and launch.grid[2] <= 65535
            seen.add(launch.kernel)
        assert (p.sm90 is not None) == p.splits.hopper == ("sm90::" in p.dkdv.kernel)
        assert (p.dq is None) == (p.convert_dq is not None)
        assert (p.convert_dkdv is not None) == (p.splits.num_splits > 1)
        if det:  # no atomics anywhere: dQ by its own kernel, dK/dV stored (per split) and summed in order
            assert p.sm90 is None and p.dq is not None and p.dkdv_slabs in (0, p.splits.num_splits)
    assert seen == known, known - seen


def test_backward_constants_match_cpp():
    """The numbers bwd_plan uses are the headers': every BwdTraits / Sm90BwdTraits / BwdDqTraits' shared memory,
    threads and tile, and the BwdTileId values, read back from a probe kernel's PTX (NVRTC, sm_90a)."""
    _nvrtc_or_skip()
    want = {f"llm_attn::kBwd{''.join(w.capitalize() for w in name.split('_'))}": i
            for name, i in _plan.BWD_TILE_IDS.items()}
    for d in (64, 128):
        for t in (*_plan.BWD_CONFIGS[d], _plan.Sm90BwdTraits(d)):
            want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                     f"{t.cpp()}::kBlockM": t.block_m, f"{t.cpp()}::kBlockN": t.block_n}
        t = _plan.BwdDqTraits(d)
        want |= {f"{t.cpp()}::kSmemBytes": t.smem_bytes, f"{t.cpp()}::kThreads": t.threads,
                 f"{t.cpp()}::kBlockM": t.block_m}
        for t in _plan.BWD_CONFIGS[d]:
            want[f"llm_attn::bwd_smem_bytes({d}, {t.block_m}, {t.block_n})"] = t.smem_bytes
    _assert_constants(["flash_bwd_sm90_kernel.cuh"], "sm_90a", want)


def test_backward_entry_points_are_the_bindings(monkeypatch):
    """_nvrtc has the extension's backward functions (so llm_attn.backward runs either build through one path):
    mha_bwd refuses bad input with binding.cpp's words before any GPU work; set_bwd_splits / set_bwd_tile answer as
    the binding's (the previous value, -1 and no change when out of range); LLM_ATTN_BWD_SPLITS / LLM_ATTN_BWD_TILE
    are read as the binding reads them."""
    nvrtc = _nvrtc_or_skip()
    binding = _kernels_text("binding.cpp")
    for name in ("mha_bwd", "set_bwd_splits", "set_bwd_tile", "bwd_splits"):
        assert f'm.def("{name}"' in binding and callable(getattr(nvrtc, name)), name
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match=r"^llm_attn.mha_bwd: q must be a 4-D CUDA tensor \(batch, heads, seq, "
                                           r"head_dim\)$"):
        nvrtc.mha_bwd(q, q, q, q, q, lse, None, q, q, q, None, 0.125, True)
    with pytest.raises(RuntimeError, match="^llm_attn.mha_bwd: only float16 and bfloat16 are supported"):
        nvrtc.mha_bwd(q.float(), q.float(), q.float(), q.float(), q.float(), lse, None, q, q, q, None, 0.125, True)
    assert "CHECK_BWD(q.is_cuda() && q.dim() == 4, \"q must be a 4-D CUDA tensor (batch, heads, seq, head_dim)\");" \
        in binding
    prev_splits, prev_tile = nvrtc.set_bwd_splits(0), nvrtc.set_bwd_tile(0)
    try:
        assert nvrtc.set_bwd_splits(5) == 0 and nvrtc.set_bwd_splits(-1) == -1 and nvrtc.set_bwd_splits(0) == 5
        assert nvrtc.set_bwd_tile(7) == 0 and nvrtc.set_bwd_tile(8) == -1 and nvrtc.set_bwd_tile(-1) == -1
        assert nvrtc.set_bwd_tile(0) == 7
    finally:
        nvrtc.set_bwd_splits(prev_splits)
        nvrtc.set_bwd_tile(prev_tile)
    for value, want in (("", 0), ("3", 3), ("-2", 0), ("x", 0)):
        monkeypatch.setenv("LLM_ATTN_BWD_SPLITS", value)
        assert nvrtc._bwd_splits_from_env() == want
    for name, i in _plan.BWD_TILE_IDS.items():
        monkeypatch.setenv("LLM_ATTN_BWD_TILE", name)
        assert nvrtc._bwd_tile_from_env() == i
        assert f'std::strcmp(v, "{name}") == 0' in binding
    monkeypatch.setenv("LLM_ATTN_BWD_TILE", "wide")
    with pytest.warns(UserWarning, match="LLM_ATTN_BWD_TILE=wide is not auto, portable, narrow"):
        assert nvrtc._bwd_tile_from_env() == 0


@pytest.mark.parametrize("tile,splits,det,want_sm90", [("auto", 0, False, True), ("portable", 3, False, False),
                                                       ("portable_separate_dq", 1, False, False),
                                                       ("auto", 3, True, False), ("narrow", 0, True, False)])
def test_mha_bwd_fills_what_the_binding_fills(monkeypatch, tile, splits, det, want_sm90):
    """_nvrtc.mha_bwd without a GPU (the device, the launches and the tensor maps stood in for, CPU tensors past the
    checks): FlashBwdParams as binding.cpp's mha_bwd fills it (set_shared_params, the gradient strides, the split
    fields), the workspaces (dsum, lse_log2, the zeroed accumulators, each 256-byte aligned inside one allocation),
    the plan's launches in order, and for the Hopper kernel Sm90BwdParams with make_tensor_map's arguments for Q,
    K, V, dO and the float32 dQ accumulator."""
    nvrtc = _nvrtc_or_skip()
    from llm_attn import _nvrtc_sm90, kernel_contract

    index = 0
    monkeypatch.setattr(kernel_contract, "backward_launcher_problem", lambda *a: None)
    monkeypatch.setattr(nvrtc, "_device_of", lambda q: contextlib.nullcontext((index, 1234)))
    monkeypatch.setattr(nvrtc, "device_info", lambda i: ("sm_90", H100_SM90))
    nvrtc._bwd_plan_for.cache_clear()
    launched, maps = [], []

    def launch(i, lc, params, stream):
        assert (i, stream) == (index, 1234)
        launched.append((lc, type(params).from_buffer_copy(params)))

    def tensor_map(*args):
        maps.append(args)
        return bytes([len(maps)]) * 128

    monkeypatch.setattr(nvrtc, "_launch", launch)
    monkeypatch.setattr(_nvrtc_sm90, "tensor_map", tensor_map)
    b, hq, hkv, sq, sk, d = 2, 8, 2, 77, 300, 128
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) memory
    k, v = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16), torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
    out, dout = torch.randn_like(q), torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    lse, dlse = torch.randn(b, hq, sq), torch.randn(b, hq, sq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    used = torch.tensor([300, 5], dtype=torch.int32)
    prev = (nvrtc.set_bwd_tile(_plan.BWD_TILE_IDS[tile]), nvrtc.set_bwd_splits(splits))
    try:
        nvrtc.mha_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, used, 0.125, True, det)
    finally:
        nvrtc.set_bwd_tile(prev[0])
        nvrtc.set_bwd_splits(prev[1])
        nvrtc._bwd_plan_for.cache_clear()
    plan = _plan.bwd_plan(_plan.BwdShape(b, hq, hkv, sq, sk, d, True, True, splits, _plan.BWD_TILE_IDS[tile], det),
                          H100_SM90)
    assert [lc for lc, _ in launched] == list(plan.launches) and (plan.sm90 is not None) == want_sm90
    ps = [x.p if isinstance(x, _nvrtc_sm90.Sm90BwdParams) else x for _, x in launched]
    assert all(bytes(x) == bytes(ps[0]) for x in ps)  # one FlashBwdParams for every launch
    p = ps[0]
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert (getattr(p, f"{name}_batch_stride"), getattr(p, f"{name}_head_stride"),
                getattr(p, f"{name}_row_stride")) == t.stride()[:3], name
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv),
                    ("lse", lse), ("dlse", dlse), ("seqused_k", used)):
        assert getattr(p, name) == t.data_ptr(), name
    assert (p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) == (b, hq, hkv, sq, sk, d)
    assert p.scale == 0.125 and p.scale_log2 == ctypes.c_float(0.125 * 1.4426950408889634).value
    assert p.causal and p.is_bf16
    sp = plan.splits
    assert (p.hopper, p.narrow, p.num_splits, p.iters_per_split, p.dq_shared, p.dq_separate) == \
        (sp.hopper, sp.narrow, sp.num_splits, sp.iters_per_split, sp.dq_shared, sp.dq_separate)
    rows = b * hq * sq
    # (offsets from the allocation's start, dsum: torch's CUDA allocator aligns that to 512 bytes, the CPU's less)
    assert p.lse_log2 - p.dsum >= 4 * rows and (p.lse_log2 - p.dsum) % 256 == 0
    assert (not p.dq_accum) == sp.dq_separate and (not p.dk_accum) == (not p.dv_accum) == (sp.num_splits == 1)
    for ptr in (p.dq_accum, p.dk_accum, p.dv_accum):
        assert ptr is None or (ptr - p.dsum) % 256 == 0 and ptr - p.lse_log2 >= 4 * rows
    assert p.deterministic == det and (not det or (p.dq_separate and not p.hopper))
    if p.dk_accum:  # one slab, or (deterministic) one per split
        assert p.dv_accum - p.dk_accum == 4 * b * hkv * sk * d * (sp.num_splits if det else 1)
    if want_sm90:
        sm = launched[1][1]
        assert [bytes(getattr(sm, f)) for f in ("tma_q", "tma_k", "tma_v", "tma_do", "tma_dq")] == \
            [bytes([i]) * 128 for i in range(1, 6)]
        qs, ks, vs, ds = (t.stride()[:3] for t in (q, k, v, dout))
        assert maps == [(q.data_ptr(), 0, d, sq, hq, b, *qs, 64), (k.data_ptr(), 0, d, sk, hkv, b, *ks, 128),
                        (v.data_ptr(), 0, d, sk, hkv, b, *vs, 128), (dout.data_ptr(), 0, d, sq, hq, b, *ds, 64),
                        (p.dq_accum, 2, d, sq, hq, b, hq * sq * d, sq * d, d, 64)]
    else:
        assert not maps


def test_sm90_available_needs_a_cc90_device():
    """Without a GPU the backend never claims the Hopper kernel; an NVRTC >= 12.0 can compile it."""
    nvrtc = _nvrtc_or_skip()
    import torch

    assert nvrtc.sm90_compilable() == (nvrtc.nvrtc_version() >= (12, 0))
    if not torch.cuda.is_available():
        assert nvrtc.sm90_available() is False
    assert nvrtc.set_tile(_plan.TILE_HOPPER) == _plan.TILE_AUTO and nvrtc.set_tile(5) == -1
    assert nvrtc.set_tile(_plan.TILE_AUTO) == _plan.TILE_HOPPER


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


class _PoolDriver:
    """The driver calls _nvrtc._grow_pool makes, recorded in order; the one named `fail` returns
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900)."""

    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_RELAXED = 2

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    CUresult = int

    def __init__(self, fail=None):
        self.fail, self.calls, self.mode = fail, [], 0

    def _result(self, name, *rest):
        self.calls.append(name)
        return (900 if name == self.fail else 0, *rest)

    def cuCtxGetCurrent(self):
        return (0, 1)

    def cuThreadExchangeStreamCaptureMode(self, mode):
        prev, self.mode = self.mode, mode
        return (0, prev)

    def cuStreamCreate(self, flags):
        assert flags == 1
        return self._result("cuStreamCreate", "zero stream")

    def cuMemAlloc(self, nbytes):
        assert self.mode == 2, "the chunk is allocated in relaxed capture mode"
        return self._result("cuMemAlloc", 0x1000)

    def cuMemsetD32Async(self, ptr, value, n, stream):
        assert (ptr, value, stream) == (0x1000, 0, "zero stream")
        return self._result("cuMemsetD32Async")

    def cuStreamSynchronize(self, stream):
        assert stream == "zero stream"
        return self._result("cuStreamSynchronize")

    def cuMemFree(self, ptr):
        return self._result("cuMemFree")

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" if int(err) == 900 else b"CUDA_ERROR_UNKNOWN")


@pytest.mark.parametrize("fail", [None, "cuStreamCreate", "cuMemAlloc", "cuMemsetD32Async", "cuStreamSynchronize"])
def test_counter_pool_growth_names_a_failed_driver_call(monkeypatch, fail):
    """_nvrtc._grow_pool without a GPU (a stand-in driver): a chunk is allocated in relaxed capture mode and zeroed and
    waited for on the pool's own stream, and the thread's capture mode is put back. A failed step leaves the pool as it
    was (the chunk freed) and keeps the call's name and result, and a launch that then fails (the capture that call
    invalidated, in the README run of kernels/NOTES.md "The README's two commands on a clean copy at 1ef7b36") names it
    in its error; a launch error with no pool failure says nothing more."""
    nvrtc = _nvrtc_or_skip()
    drv = _PoolDriver(fail)
    pool = {"chunks": [], "total": 0, "failed": False, "zero_stream": None, "eager": {}}
    grew = nvrtc._grow_pool(drv, 0, pool, 600)
    assert drv.mode == 0, "the thread's capture mode is restored"
    steps = ["cuStreamCreate", "cuMemAlloc", "cuMemsetD32Async", "cuStreamSynchronize"]
    if fail is None:
        assert grew and drv.calls == steps and "error" not in pool
        assert pool["chunks"] == [[0x1000, nvrtc._COUNTER_CHUNK_INTS, 0]] and pool["total"] == nvrtc._COUNTER_CHUNK_INTS
    else:
        assert not grew and pool["chunks"] == [] and pool["total"] == 0
        assert pool["error"] == f"{fail} returned CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
        freed = ["cuMemFree"] if fail in ("cuMemsetD32Async", "cuStreamSynchronize") else []
        assert drv.calls == steps[:steps.index(fail) + 1] + freed

    def check(result, what):
        raise RuntimeError(what)

    monkeypatch.setattr(nvrtc, "_pools", {0: pool})
    monkeypatch.setattr(nvrtc, "_drv_check", check)
    monkeypatch.setattr(nvrtc, "_driver", lambda: drv)
    monkeypatch.setattr(nvrtc, "_cu_launch", lambda *args: 901)  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    monkeypatch.setitem(nvrtc._handles, (0, "k<1>"), ctypes.c_void_p(1))
    params = ctypes.c_int(0)
    with pytest.raises(RuntimeError) as e:
        nvrtc._launch(0, _plan.Launch("k<1>", (1, 1, 1), 32, 0), params, 0)
    hint = f" (the decode counter pool could not grow earlier: device 0: {pool['error']})" if fail else ""
    assert str(e.value) == f"launching k<1>{hint}"
