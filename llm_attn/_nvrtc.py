"""The runtime-compiled kernel backend: the kernels/ headers compiled with NVRTC for the GPU that is present, at
first use, one instantiation at a time, cached on disk, and launched through the CUDA driver API on torch's
current stream. Needs NVIDIA's cuda-python (``cuda-bindings``), NVRTC and the CUDA runtime headers
(``python -m pip install "llm-attn[nvrtc]"``; a CUDA build of torch usually brings the last two); no nvcc, no host
compiler,
no torch headers.

It is a drop-in for the compiled extension: ``mha_fwd``, ``num_splits`` and ``set_tile`` behave as in
kernels/binding.cpp (same checks and messages, same host-side choices through ``llm_attn._plan``, workspace from
torch's caching allocator, no synchronisation), so ``flash_attn_func``, the custom op, CUDA graphs and
torch.compile run on it unchanged.

The cache (``$LLM_ATTN_CACHE/nvrtc`` or ``~/.cache/llm_attn/nvrtc``) holds one cubin per instantiation and arch,
keyed by a hash of the kernel headers, the generated source, the NVRTC version, the arch and the options. Cubin
(SASS) rather than PTX: PTX from a newer NVRTC cannot be loaded by an older driver.

On a compute capability 9.0 GPU it also runs the Hopper kernel where the extension does (``llm_attn._plan``):
compiled for sm_90a, with its four TMA descriptors built on the host through the driver API and passed inside the
by-value Sm90Params (``llm_attn._nvrtc_sm90``). The portable kernels compile for the device's own arch (sm_90).

The low-precision forwards are here too, as the extension has them: ``mha_fwd_fp8`` (compute capability 9.0: the
quantising pre-pass and the FP8 kernel for sm_90a, the kernel's three e4m3 tensor maps in Fp8Sm90Params, or with
P V in the input dtype (pv "input") those of e4m3 Q and K and the caller's V) and
``mha_fwd_int8`` (sm_80-90: the pre-pass and the INT8 kernel for the device's arch, P V in e4m3 on sm_89), with
binding.cpp's workspaces (torch's allocator), launches (``llm_attn._plan``: fp8_launches, int8_launches) and checks.

And the backward, as the extension has it: ``mha_bwd`` (binding.cpp's checks and workspaces, flash_bwd_set_splits'
choices and run_flash_bwd's launches through ``llm_attn._plan.bwd_plan``: the preprocessing, the portable dK/dV kernel
for the device's arch or, on compute capability 9.0, the Hopper one for sm_90a with its five tensor maps in
Sm90BwdParams, then the dQ and dK/dV conversions), ``set_bwd_splits`` / ``set_bwd_tile`` / ``bwd_splits``
(``llm_attn.backward.force_bwd_splits`` / ``force_bwd_tile``; LLM_ATTN_BWD_SPLITS / LLM_ATTN_BWD_TILE as the
extension reads them).

And the decode over the FP8 KV cache, as the extension has it: ``mha_decode_fp8kv`` (binding.cpp's checks and
messages, flash_decode_fp8kv_num_splits' split count with ``set_decode_splits`` forcing it, mha_fwd's split workspace
and decode counter pool, run_flash_decode_fp8kv's one launch through ``llm_attn._plan.decode_fp8kv_plan``; the kernel
for the device's arch, sm_80 and up: it needs no FP8 hardware; above ``decode_fp8kv_max_rows`` packed rows the
prefill kernel over the cache, never split, v2 where its blocks fill over half the SMs, else v1),
``decode_fp8kv_max_rows`` and ``fp8kv_prefill``.

And the FP8 KV cache's own device steps, as the extension has them, each one launch with binding.cpp's checks and
messages: ``fp8_cache_append`` (the static cache's one-token append) and ``fp8_cache_dequant`` (the dequantised copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch

from llm_attn import _cuda_abi, _plan, kernel_contract
from llm_attn._cuda_abi import (FlashBwdParams, FlashDecodeFp8KvParams, FlashFwdFp8Params, FlashFwdInt8Params,
                                FlashFwdParams, Fp8CacheAppendParams, Fp8CacheDequantParams)
from llm_attn.kernel_contract import _shape
from llm_attn._cuda_abi import driver as _driver
from llm_attn._cuda_abi import drv_check as _drv_check

CACHE_FORMAT = 1
# NVRTC has no C++ standard library: flash.h and ptx.cuh include <cstdint>, which this in-memory header provides
# (LP64: int64_t is long, as in glibc, so the struct layout matches the host's).
# flash_int8.h includes <cstddef> (size_t), the INT8 kernel <type_traits> (std::integral_constant): the same.
_SHIM_HEADERS = {
    "cstdint": "#pragma once\n"
               "typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long int64_t;\n"
               "typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;\n"
               "typedef unsigned long uint64_t; typedef unsigned long uintptr_t; typedef long intptr_t;\n",
    "cstddef": "#pragma once\ntypedef unsigned long size_t; typedef long ptrdiff_t;\n",
    "type_traits": "#pragma once\nnamespace std {\n"
                   "template <class T, T v> struct integral_constant {\n"
                   "    static constexpr T value = v;\n    using value_type = T;\n    using type = integral_constant;\n"
                   "    constexpr operator T() const noexcept { return v; }\n"
                   "    constexpr T operator()() const noexcept { return v; }\n};\n"
                   "using true_type = integral_constant<bool, true>;\n"
                   "using false_type = integral_constant<bool, false>;\n"
                   "}  // namespace std\n",
}
# What nvcc gets from setup.py, in NVRTC's words. -default-device: flash.h declares host functions, which NVRTC
# would otherwise reject; INFINITY comes from <cmath> under nvcc.
BASE_OPTIONS = ("-std=c++17", "--use_fast_math", "-lineinfo", "-default-device",
                "-DINFINITY=__int_as_float(0x7f800000)", "--ptxas-options=-v")


class NvrtcUnavailableError(RuntimeError):
    """cuda-python, NVRTC, the CUDA headers or a GPU is missing."""


def _kernels_dir() -> Path:
    """kernels/ of a source checkout (editable install), else the copy a wheel carries in llm_attn/_kernels."""
    pkg = Path(__file__).resolve().parent
    for d in (pkg.parent / "kernels", pkg / "_kernels"):
        if (d / "flash_fwd_kernel.cuh").is_file():
            return d
    raise NvrtcUnavailableError(f"the kernel headers were not found (looked in {pkg.parent / 'kernels'} and "
                                f"{pkg / '_kernels'})")


def _cuda_include_dir() -> Path:
    """A folder with cuda_fp16.h: the pip wheel nvidia-cuda-runtime (CUDA 13 or 12 layout), CUDA_HOME, /usr/local/cuda
    (JetPack)."""
    candidates = []
    try:
        from cuda import pathfinder  # noqa: PLC0415

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # noqa: BLE001  (an older cuda-pathfinder, or none: fall through to the usual places)
        pass
    for sp in sys.path:
        candidates += [Path(sp) / "nvidia" / "cu13" / "include", Path(sp) / "nvidia" / "cuda_runtime" / "include"]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates += [Path("/usr/local/cuda/include")]
    for c in candidates:
        if (c / "cuda_fp16.h").is_file():
            return c
    raise NvrtcUnavailableError("the CUDA headers (cuda_fp16.h) were not found: "
                                "python -m pip install nvidia-cuda-runtime "
                                "(CUDA 13; nvidia-cuda-runtime-cu12 for CUDA 12) or set CUDA_HOME")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc  # noqa: PLC0415
    except ImportError as e:
        raise NvrtcUnavailableError(f"cuda-python is not installed ({e}): "
                                    "python -m pip install 'llm-attn[nvrtc]' (CUDA 13) or "
                                    f"'llm-attn[nvrtc-cu12]' (CUDA 12)") from None
    return nvrtc


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"llm_attn (NVRTC backend): {what} failed: {err!r}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def _output(nvrtc, prog, what: str) -> bytes:
    """NVRTC's `what` output of `prog` ("ProgramLog", "CUBIN" or "PTX"). NVRTC writes into the buffer it is given,
    so that buffer is a fresh bytearray, never a bytes object: `b" " * size` with size 1 (an empty log, just its NUL)
    is the interpreter's one shared b" ", and writing the NUL there turned every b" " of the process into b"\\0"
    (pickling a tensor then failed with "storage has wrong byte size"; tests/test_nvrtc.py checks it)."""
    size = _check(getattr(nvrtc, f"nvrtcGet{what}Size")(prog), f"nvrtcGet{what}Size")
    buf = bytearray(size)
    _check(getattr(nvrtc, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
    return bytes(buf)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except Exception as e:  # noqa: BLE001  (libnvrtc not found: cuda-pathfinder raises its own types)
        raise NvrtcUnavailableError(f"libnvrtc could not be loaded ({type(e).__name__}: {e}): python -m pip install "
                                    f"nvidia-cuda-nvrtc (CUDA 13; nvidia-cuda-nvrtc-cu12 for CUDA 12)") from None
    return int(major), int(minor)


def params_struct_asserts(offsets: bool = False, structs=_cuda_abi.STRUCTS[:1]) -> str:
    """static_asserts that each C++ struct of `structs` ((name, ctypes mirror) pairs of _cuda_abi.STRUCTS) has its
    mirror's layout. NVRTC has no offsetof, so every program checks the sizes of the structs its kernels take;
    tests/test_nvrtc.py checks each offset with the host C++ compiler (offsets=True)."""
    lines = []
    for cpp, mirror in structs:
        short = cpp.rsplit("::", 1)[-1]
        lines.append(f"static_assert(sizeof({cpp}) == {ctypes.sizeof(mirror)}, "
                     f"\"{short} changed: update llm_attn/_cuda_abi.py\");")
        for name, *_ in mirror._fields_ if offsets else ():
            lines.append(f"static_assert(offsetof({cpp}, {name}) == {getattr(mirror, name).offset}, "
                         f"\"{short}.{name} moved: update llm_attn/_cuda_abi.py\");")
    return "\n".join(lines) + "\n"


# (what a kernel's name expression contains, the header that defines it, the parameter structs it takes: their
# _cuda_abi.STRUCTS index and the Hopper struct of _nvrtc_sm90.STRUCTS, if any). Each kernel's own header: they
# share the parts smem_tile.cuh, softmax.cuh, mask.cuh, mma_frag.cuh and combine.cuh, which _headers_digest hashes
# with every other kernels/*.h and *.cuh.
_KERNEL_HEADERS = (
    ("flash_fwd_kernel<", "flash_fwd_kernel.cuh", (0,), None),
    ("flash_combine_kernel<", "combine.cuh", (0,), None),
    ("flash_decode_kernel<", "flash_decode_kernel.cuh", (0,), None),
    ("flash_bwd_dkdv_2d_kernel<", "flash_bwd_2d_kernel.cuh", (3,), None),
    ("flash_bwd_", "flash_bwd_kernel.cuh", (3,), None),
    ("flash_bwd_sm90_kernel<", "flash_bwd_sm90_kernel.cuh", (3,), "Sm90BwdParams"),
    ("flash_fwd_sm90_kernel<", "flash_fwd_sm90_kernel.cuh", (0,), "Sm90Params"),
    ("llm_attn::fp8::", "quant_fp8.cuh", (0, 1), None),
    ("flash_fwd_fp8_sm90_kernel<", "flash_fwd_fp8_sm90_kernel.cuh", (0, 1), "Fp8Sm90Params"),
    ("llm_attn::int8fwd::int8_", "flash_fwd_int8_quant.cuh", (2,), None),
    ("flash_fwd_int8_kernel<", "flash_fwd_int8_kernel.cuh", (2,), None),
    ("flash_decode_fp8kv_kernel<", "flash_decode_fp8kv_kernel.cuh", (4,), None),
    ("flash_prefill_fp8kv_kernel<", "flash_prefill_fp8kv_kernel.cuh", (4,), None),
    ("fp8_cache_append_kernel<", "fp8_cache_append_kernel.cuh", (5,), None),
    ("fp8_cache_dequant_kernel<", "fp8_cache_dequant_kernel.cuh", (6,), None),
)


def program_source(kernels: list[str]) -> str:
    used = [row for row in _KERNEL_HEADERS if any(row[0] in k for k in kernels)] or [_KERNEL_HEADERS[0]]
    src = "".join(f'#include "{h}"\n' for _, h, _, _ in used)
    src += params_struct_asserts(structs=[_cuda_abi.STRUCTS[i] for i in sorted({i for row in used for i in row[2]})])
    hopper = [row[3] for row in used if row[3]]
    if hopper:
        from llm_attn import _nvrtc_sm90  # noqa: PLC0415

        src += "".join(_nvrtc_sm90.struct_asserts(h) for h in hopper)
    return src


def kernel_arch(device_arch: str, kernel: str) -> str:
    """The arch a kernel is compiled for on a device of `device_arch`: the Hopper kernels need sm_90a (wgmma,
    setmaxnreg), and the FP8 forward's pre-pass is built with them, as in the AOT build; every other kernel the
    device's own (the Hopper backward's preprocessing and conversions are the portable kernels: the device's)."""
    hopper = ("flash_fwd_sm90_kernel<", "flash_fwd_fp8_sm90_kernel<", "llm_attn::fp8::", "flash_bwd_sm90_kernel<")
    return "sm_90a" if any(h in kernel for h in hopper) else device_arch


def sm90_compilable() -> bool:
    """Whether this NVRTC can compile for sm_90a (arch-specific targets came with CUDA 12.0)."""
    try:
        return nvrtc_version() >= (12, 0)
    except NvrtcUnavailableError:
        return False


@functools.lru_cache(maxsize=1)
def _headers_digest() -> str:
    h = hashlib.sha256()
    d = _kernels_dir()
    for p in sorted(list(d.glob("*.h")) + list(d.glob("*.cuh"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for name, text in sorted(_SHIM_HEADERS.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def _options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS, f"-I{_kernels_dir()}", f"-I{_cuda_include_dir()}"]


def cache_dir() -> Path:
    root = os.environ.get("LLM_ATTN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llm_attn")
    return Path(root) / "nvrtc"


def cache_key(arch: str, kernels: list[str]) -> str:
    h = hashlib.sha256()
    opts = [o for o in _options(arch) if not o.startswith("-I")]  # include folders move; their content is hashed
    for part in (str(CACHE_FORMAT), _headers_digest(), program_source(kernels), arch, repr(nvrtc_version()),
                 repr(opts), repr(kernels)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def compile_cubin(arch: str, kernels: list[str]) -> tuple[bytes, dict[str, str], str]:
    """Compile `kernels` (C++ name expressions of __global__ instantiations) for `arch` (e.g. "sm_89"). Returns the
    cubin, {name expression: lowered (mangled) name} and NVRTC's log (ptxas -v lines included). Needs no GPU."""
    nvrtc = _nvrtc()
    src = program_source(kernels)
    names = [n.encode() for n in _SHIM_HEADERS]
    bodies = [t.encode() for t in _SHIM_HEADERS.values()]
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), b"llm_attn_nvrtc.cu", len(names), bodies, names),
                  "nvrtcCreateProgram")
    try:
        for k in kernels:
            _check(nvrtc.nvrtcAddNameExpression(prog, k.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in _options(arch)]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log = _output(nvrtc, prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")
        if int(err) != 0:
            raise RuntimeError(f"llm_attn (NVRTC backend): compiling {kernels} for {arch} failed ({err!r}):\n{log}")
        cubin = _output(nvrtc, prog, "CUBIN")
        lowered = {}
        for k in kernels:
            low = _check(nvrtc.nvrtcGetLoweredName(prog, k.encode()), "nvrtcGetLoweredName")
            lowered[k] = low.decode() if isinstance(low, bytes) else str(low)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered, log


_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers, used (\d+) barriers")
_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")


def _ptxas_report(log: str, pattern: re.Pattern) -> dict[str, tuple[int, ...]]:
    """{mangled kernel: the numbers of `pattern`'s line} from the ptxas -v lines of a compile log."""
    out, current = {}, None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = m.group(1) or m.group(2)
            continue
        m = pattern.search(line)
        if m and current:
            out[current] = tuple(int(x) for x in m.groups())
    return out


def local_memory_report(log: str) -> dict[str, tuple[int, int, int]]:
    """{mangled kernel: (stack frame, spill stores, spill loads) bytes} from the ptxas -v lines of a compile log."""
    return _ptxas_report(log, _PTXAS_PROPS)


def register_report(log: str) -> dict[str, tuple[int, int]]:
    """{mangled kernel: (registers, named barriers)} from the ptxas -v lines of a compile log."""
    return _ptxas_report(log, _PTXAS_REGS)


_compile_lock = threading.Lock()
# (arch, kernel) -> seconds it took in this process (0 when it came from the disk cache): llm_attn.ttft and
# experiments/nvrtc_bench.py report it.
compile_stats: dict[tuple[str, str], dict] = {}


def get_cubin(arch: str, kernel: str) -> tuple[bytes, str]:
    """The cubin and lowered name of one instantiation, from the disk cache or compiled (then cached)."""
    key = cache_key(arch, [kernel])
    d = cache_dir()
    cubin_path, meta_path = d / f"{key}.cubin", d / f"{key}.json"
    t0 = time.perf_counter()
    with _compile_lock:
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
            if meta.get("kernel") == kernel and len(cubin) == meta.get("size"):
                compile_stats[(arch, kernel)] = {"source": "cache", "seconds": time.perf_counter() - t0}
                return cubin, meta["lowered"]
        except (OSError, ValueError):
            pass
        cubin, lowered, _ = compile_cubin(arch, [kernel])
        compile_stats[(arch, kernel)] = {"source": "nvrtc", "seconds": time.perf_counter() - t0}
        try:  # atomic: another process may read the cache at the same time
            d.mkdir(parents=True, exist_ok=True)
            for path, data in ((cubin_path, cubin),
                               (meta_path, json.dumps({"kernel": kernel, "arch": arch, "lowered": lowered[kernel],
                                                       "nvrtc": nvrtc_version(), "size": len(cubin)}).encode())):
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
        except OSError as e:  # a read-only or full cache only costs the next process a compile
            print(f"llm_attn: could not write the NVRTC cache in {d}: {e}", file=sys.stderr)
    return cubin, lowered[kernel]


# -- availability ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when this backend can run here, else why not (cheap: imports and file look-ups, no compile)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        nvrtc_version()
        _kernels_dir()
        _cuda_include_dir()
        from cuda.bindings import driver  # noqa: F401, PLC0415
    except (NvrtcUnavailableError, ImportError) as e:
        return str(e)
    return None


# -- driver API: load and launch ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def device_info(index: int) -> tuple[str, _plan.Device]:
    """("sm_XY", the device facts the dispatch reads) of CUDA device `index`."""
    driver = _driver()
    _drv_check(driver.cuInit(0), "cuInit")
    dev = _drv_check(driver.cuDeviceGet(index), "cuDeviceGet")
    A = driver.CUdevice_attribute

    def attr(a):
        return int(_drv_check(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute"))

    major = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    facts = _plan.Device(num_sms=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                         smem_per_sm=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
                         smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                         cc_major=major, sm90=(major, minor) == (9, 0) and sm90_compilable())
    return f"sm_{major}{minor}", facts


_functions: dict[tuple[int, str], object] = {}
_handles: dict[tuple[int, str], ctypes.c_void_p] = {}  # the same CUfunctions as raw handles, for _cu_launch
_load_lock = threading.Lock()


def _libcuda_launch():
    """libcuda's own cuLaunchKernel through ctypes, or None where the library does not load: one foreign call a
    launch (the driver and primary context cuda-python uses), where cuda-python's wrapper converts its arguments in
    Python first (kernels/NOTES.md "The NVRTC build's eager training calls"). LLM_ATTN_NVRTC_LAUNCH=cuda-python keeps
    every launch on cuda-python (A/B runs). No argtypes: converting eleven arguments through them cost ~2 us a call;
    _launch passes what the C prototype takes as it is (the function and the stream as c_void_p, the grid, block
    and shared-memory sizes as Python ints, all below 2**31, the argument array, None for `extra`)."""
    if os.environ.get("LLM_ATTN_NVRTC_LAUNCH", "") == "cuda-python":
        return None
    for name in (("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")):
        try:
            fn = ctypes.CDLL(name).cuLaunchKernel
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


_cu_launch = _libcuda_launch()


def _function(index: int, kernel: str, smem: int):
    """The CUfunction of `kernel` in device `index`'s primary context (torch's), loaded once."""
    fn = _functions.get((index, kernel))
    if fn is not None:
        return fn
    with _load_lock:
        fn = _functions.get((index, kernel))
        if fn is not None:
            return fn
        driver = _driver()
        arch = kernel_arch(device_info(index)[0], kernel)
        cubin, lowered = get_cubin(arch, kernel)
        t0 = time.perf_counter()
        _bind_context(driver, index)
        try:
            module = _drv_check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        except RuntimeError as e:
            drv = _drv_check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
            raise RuntimeError(f"{e}: a cubin from NVRTC {'.'.join(map(str, nvrtc_version()))} for {arch} did not "
                               f"load on a driver for CUDA {drv // 1000}.{drv % 1000 // 10}; use an NVRTC no newer "
                               f"than the driver (python -m pip install 'nvidia-cuda-nvrtc-cu12' "
                               f"for CUDA 12)") from None
        fn = _drv_check(driver.cuModuleGetFunction(module, lowered.encode()), "cuModuleGetFunction")
        if smem > 48 * 1024:
            _drv_check(driver.cuFuncSetAttribute(
                fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
            carveout = _plan._tuning_env("LLM_ATTN_SMEM_CARVEOUT", -1)  # kernels/launch_smem.h, the same knob
            if 0 <= carveout <= 100:
                _drv_check(driver.cuFuncSetAttribute(
                    fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout),
                    "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)")
        stats = compile_stats.setdefault((arch, kernel), {})
        stats["load_seconds"] = time.perf_counter() - t0
        _handles[(index, kernel)] = ctypes.c_void_p(int(fn))
        _functions[(index, kernel)] = fn
        return fn


def _bind_context(driver, index: int) -> None:
    """On a thread torch has not used yet, bind the primary context torch uses."""
    ctx = _drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if not int(ctx):
        dev = _drv_check(driver.cuDeviceGet(index), "cuDeviceGet")
        _drv_check(driver.cuCtxSetCurrent(_drv_check(driver.cuDevicePrimaryCtxRetain(dev), "retain")), "set ctx")


@functools.lru_cache(maxsize=4096)
def _plan_for(index: int, *shape) -> _plan.Plan:
    """The plan per (device, shape, tile): the host-side choices cost nothing after the first call of a shape."""
    return _plan.plan(_plan.Shape(*shape), device_info(index)[1])


_ArgArray = ctypes.c_void_p * 1
_VoidP = ctypes.c_void_p
_cu_streams: dict = {}  # raw stream handle -> driver.CUstream (a wrapper of the handle, made once)


def _cu_stream(stream: int):
    cu_stream = _cu_streams.get(stream)
    if cu_stream is None:
        if len(_cu_streams) >= 64:
            _cu_streams.clear()
        cu_stream = _cu_streams[stream] = _driver().CUstream(stream)
    return cu_stream


def _launch(index: int, launch: _plan.Launch, params: ctypes.Structure, stream: int):
    """Queue `launch` on `stream` with `params` (the by-value struct its kernel takes; a FlashFwdParams becomes the
    Hopper kernel's Sm90Params here)."""
    key = (index, launch.kernel)
    handle = _handles.get(key)
    if handle is None:
        _function(index, launch.kernel, launch.smem)
        handle = _handles[key]
    if launch.sm90 is not None:  # the Hopper kernel takes Sm90Params: FlashFwdParams + its four tensor maps
        from llm_attn import _nvrtc_sm90  # noqa: PLC0415

        params = _nvrtc_sm90.params(params, launch)
    args = _ArgArray(ctypes.addressof(params))
    if _cu_launch is not None:
        gx, gy, gz = launch.grid
        result = _cu_launch(handle, gx, gy, gz, launch.threads, 1, 1, launch.smem, _VoidP(stream), args, None)
        if result:
            _drv_check(_driver().CUresult(result), f"launching {launch.kernel}{_capture_hint()}")
        return
    fn = _functions[key]
    result = _driver().cuLaunchKernel(fn, *launch.grid, launch.threads, 1, 1, launch.smem, _cu_stream(stream),
                                   ctypes.addressof(args), 0)
    if int(result[0] if isinstance(result, tuple) else result) != 0:
        _drv_check(result, f"launching {launch.kernel}{_capture_hint()}")


# -- the extension's interface ---------------------------------------------------------------------------------
_tile = _plan.TILE_AUTO


def set_tile(tile: int) -> int:
    """Force the prefill tile (0 auto, 1 large, 2 wide, 3 small, 4 hopper); returns the previous one, -1 for an
    unknown id."""
    global _tile
    if not _plan.TILE_AUTO <= int(tile) <= _plan.TILE_HOPPER:
        return -1
    prev, _tile = _tile, int(tile)
    return prev


_decode_splits = 0
_decode_config = 0


def set_decode_splits(splits: int) -> int:
    """Force the decode kernel's KV splits (0 = automatic; clamped to the 64-key tiles); returns the previous count,
    -1 (nothing changed) when out of range. As binding.cpp's set_decode_splits."""
    global _decode_splits
    if not 0 <= int(splits) <= 4096:
        return -1
    prev, _decode_splits = _decode_splits, int(splits)
    return prev


def set_decode_config(config: int) -> int:
    """Force the decode kernel's DecodeConfigId (0 = automatic; _plan.DECODE_CONFIG_IDS); returns the previous one,
    -1 (nothing changed) for an unknown id. As binding.cpp's set_decode_config."""
    global _decode_config
    if not 0 <= int(config) <= len(_plan.DECODE_CONFIG_IDS):
        return -1
    prev, _decode_config = _decode_config, int(config)
    return prev


def sm90_available() -> bool:
    """Whether the current device runs the Hopper prefill kernel here: compute capability 9.0 and an NVRTC that
    compiles sm_90a (the extension's flash_fwd_sm90_available, with NVRTC in place of the built-in code)."""
    if unavailable_reason() is not None:
        return False
    return device_info(torch.cuda.current_device())[1].sm90


def num_splits(batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
               num_sms: int) -> int:
    return _plan.num_splits(_plan.Shape(batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim,
                                        decode_splits=_decode_splits, decode_config=_decode_config), num_sms)


def _fail(*parts) -> None:
    raise RuntimeError("llm_attn.mha_fwd: " + "".join(str(p) for p in parts))


# Per call kind (the shapes, strides, dtypes, devices and alignment of every operand, scale, causal, tile): the
# launcher's verdict, its plan and a params struct holding everything but the pointers, so a repeated call of a kind
# checks nothing twice and copies a struct in place of filling some 30 fields. Only calls that passed are stored
# (bad input always meets launcher_problem and its message). Bounded.
_PREPARED: dict = {}
_PREPARED_MAX = 256


def _operand_key(t):
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _prepared_key(q, k, v, out, lse, seqused_k, scale, causal):
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T or type(out) is not T or type(lse) is not T:
        return None
    if not q.is_cuda:  # refused by the checks: nothing to keep
        return None
    if seqused_k is None:
        sk = None
    elif type(seqused_k) is T:
        sk = (seqused_k.shape, seqused_k.stride(), seqused_k.dtype, seqused_k.device)
    else:
        return None
    index = q.device.index
    return (_operand_key(q), _operand_key(k), _operand_key(v), _operand_key(out), lse.shape, lse.stride(),
            lse.dtype, lse.device, sk, type(scale), scale, type(causal), causal, _tile, _decode_splits, _decode_config,
            torch.cuda.current_device() if index is None else index)


def _prepare(q, k, v, out, lse, seqused_k, scale, causal):
    """(device index, plan, params template without pointers) for a call that passed the launcher's checks."""
    problem = kernel_contract.launcher_problem(q, k, v, out, lse, seqused_k, scale, causal)
    if problem:
        _fail(problem)
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]

    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    is_bf16 = q.dtype == torch.bfloat16
    try:
        plan = _plan_for(index, batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim, bool(causal), is_bf16,
                         _tile, _decode_splits, _decode_config)
    except ValueError as e:  # tile 'hopper' forced off a device that runs it: run_flash_fwd's error, as a RuntimeError
        _fail("kernel launch failed: ", e)

    p = FlashFwdParams()
    _set_shapes(p, q, k, v, out, scale, causal)
    p.tile, p.num_splits = _tile, plan.num_splits
    return index, plan, p


def _set_shapes(p, q, k, v, out, scale: float, causal: bool) -> None:
    """binding.cpp's set_shared_params without the pointers: strides, shapes, scale and mask into `p` (a
    FlashFwdParams or a FlashFwdInt8Params, which begins with the same fields)."""
    (p.q_batch_stride, p.q_head_stride, p.q_row_stride) = q.stride()[:3]
    (p.k_batch_stride, p.k_head_stride, p.k_row_stride) = k.stride()[:3]
    (p.v_batch_stride, p.v_head_stride, p.v_row_stride) = v.stride()[:3]
    (p.o_batch_stride, p.o_head_stride, p.o_row_stride) = out.stride()[:3]
    p.batch, p.num_heads, p.seqlen_q, p.head_dim = q.shape
    p.num_kv_heads, p.seqlen_k = k.shape[1], k.shape[2]
    p.scale = scale
    p.scale_log2 = scale * 1.4426950408889634  # M_LOG2E, rounded to float as binding.cpp does
    p.causal, p.is_bf16 = bool(causal), q.dtype == torch.bfloat16


def _set_pointers(p, q, k, v, out, lse, seqused_k) -> None:
    """set_shared_params' pointers (seqused_k may be None)."""
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse = lse.data_ptr()
    p.seqused_k = seqused_k.data_ptr() if seqused_k is not None else None


def mha_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            seqused_k: torch.Tensor | None, scale: float, causal: bool) -> None:
    """FlashAttention forward into preallocated out/lse: kernels/binding.cpp's mha_fwd, with the same checks
    (llm_attn.kernel_contract.launcher_problem states them once)."""
    try:
        key = _prepared_key(q, k, v, out, lse, seqused_k, scale, causal)
        prepared = _PREPARED.get(key) if key is not None else None
    except (TypeError, AttributeError):  # odd arguments: the full checks below say what is wrong
        key = prepared = None
    if prepared is None:
        prepared = _prepare(q, k, v, out, lse, seqused_k, scale, causal)
        if key is not None:
            if len(_PREPARED) >= _PREPARED_MAX:
                _PREPARED.clear()
            _PREPARED[key] = prepared
    index, plan, template = prepared

    # A copy per call (launches copy their parameters when queued, but another thread may launch concurrently).
    p = FlashFwdParams.from_buffer_copy(template)
    _set_pointers(p, q, k, v, out, lse, seqused_k)
    if index == torch.cuda.current_device():
        stream = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(q.device).cuda_stream
        workspace = _workspace(p, plan, q, k, index, stream)
        for launch in plan.launches:
            _launch(index, launch, p, stream)
    else:
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(index):
            workspace = _workspace(p, plan, q, k, index, stream)
            for launch in plan.launches:
                _launch(index, launch, p, stream)
    del workspace  # it lived until the launches were queued; torch's allocator orders its reuse by stream


def _workspace(p: FlashFwdParams, plan: _plan.Plan, q, k, index: int, stream: int, lse_rows: int = 0):
    """binding.cpp's split workspace: o_accum (splits, B, H, Sq, D) and lse_accum (splits, B, H, Sq) floats; the
    decode kernel's B * Hkv counters from the counter pool, or (where it cannot serve) after the floats in one
    allocation, zeroed here. The floats: this stream's eager buffer (_eager_workspace) where it serves, else that
    allocation from torch's caching allocator. `lse_rows` > 0: the caller does not keep lse, so its rows go in the
    eager buffer too where it serves (p.lse set; else left 0 for the caller to allocate). Returns the torch
    allocation (None: none was made)."""
    splits = plan.num_splits > 1
    if not splits and not lse_rows:
        return None
    batch, num_heads, seqlen_q, head_dim = q.shape
    rows = plan.num_splits * batch * num_heads * seqlen_q if splits else 0
    n_counters = batch * k.shape[1] if splits and plan.decode else 0
    pooled = _pooled_counters(index, stream, n_counters) if n_counters else None
    partial_bytes = (rows * (head_dim + 1) * 4 + 15) & ~15
    if pooled or not n_counters:
        base = _eager_workspace(index, stream, partial_bytes + lse_rows * 4)
        if base is not None:
            if splits:
                p.o_accum, p.lse_accum = base, base + rows * head_dim * 4
                if pooled:
                    p.split_counters = pooled
            if lse_rows:
                p.lse = base + partial_bytes
            return None
    if not splits:
        return None
    workspace = torch.empty(rows * (head_dim + 1) + (0 if pooled else n_counters), dtype=torch.float32,
                            device=q.device)
    base = workspace.data_ptr()
    p.o_accum, p.lse_accum = base, base + rows * head_dim * 4
    if pooled:
        p.split_counters = pooled
    elif plan.decode:
        p.split_counters = base + rows * (head_dim + 1) * 4
        workspace[rows * (head_dim + 1):].view(torch.int32).zero_()
    return workspace


# The decode counter pool: binding.cpp's (see there): counters zeroed when made, left zero by the kernel, one slice
# per eager stream and one per captured launch, in cuMemAlloc'd chunks (not tensors) that grow by 1 MiB up to 64 MiB
# per device, each allocated in relaxed capture mode and zeroed on the pool's own stream. None where it cannot serve:
# the caller zeroes counters of its own.
_COUNTER_CHUNK_INTS = 1 << 18
_COUNTER_POOL_MAX_INTS = 1 << 24
_COUNTER_SLICE_QUANTUM = 256
_pool_lock = threading.Lock()
_pools: dict[int, dict] = {}
_pool_enabled = True


def _pooled_counters(index: int, stream: int, n: int) -> int | None:
    """`n` zeroed counters for a decode launch on `stream`, torch's current stream on device `index` (the current
    device): this stream's eager slice, or a fresh slice for a launch being captured."""
    captured = _capturing(stream)
    if captured is None:
        return None
    if not captured:  # the common case: this stream's slice, read without the lock (dict reads are atomic)
        pool = _pools.get(index)
        slice_ = pool["eager"].get(stream) if pool is not None and _pool_enabled else None
        if slice_ is not None and slice_[1] >= n:
            return slice_[0]
    driver = _driver()
    with _pool_lock:
        if not _pool_enabled:
            return None
        pool = _pools.setdefault(index, {"chunks": [], "total": 0, "failed": False, "zero_stream": None,
                                         "eager": {}})
        if not captured:
            slice_ = pool["eager"].get(stream)
            if slice_ is not None and slice_[1] >= n:
                return slice_[0]
        if pool["failed"]:
            return None
        size = n if captured else -(-n // _COUNTER_SLICE_QUANTUM) * _COUNTER_SLICE_QUANTUM
        chunks = pool["chunks"]
        if not chunks or chunks[-1][2] + size > chunks[-1][1]:
            if not _grow_pool(driver, index, pool, size):
                pool["failed"] = True
                return None
        chunk = chunks[-1]  # [base, size, used]
        slice_ptr = chunk[0] + 4 * chunk[2]
        chunk[2] += size
        if not captured:
            pool["eager"][stream] = (slice_ptr, size)
        return slice_ptr


# The split partials of eager calls (o_accum, lse_accum) and the lse a caller drops (need_lse=False), read and
# written by the launches of one call only: one buffer per (device, stream), cuMemAlloc'd (not a tensor: cudagraph trees' warm-up counts the live tensors of its
# pool, kernels/NOTES.md "The NVRTC build's forward calls on the host"), reused call after call in the stream's own
# order, so an eager decode call makes no allocation for them. A call that needs more gets a larger buffer (the old one
# is kept, never freed under work in flight), up to _EAGER_WS_MAX_BYTES per device; past that, a launch being
# captured and a failed query or allocation take torch's allocator as before. set_eager_workspace(False) turns it off.
_EAGER_WS_STEP = 1 << 20
_EAGER_WS_MAX_BYTES = 32 << 20
_eager_ws: dict = {}  # (device, stream) -> (base, bytes)
_eager_ws_total: dict = {}  # device -> bytes allocated
_eager_ws_enabled = True


def _capturing(stream: int) -> bool | None:
    """Whether `stream` (torch's current stream) is being captured; None where the query failed."""
    if _is_capturing is not None:  # torch's query of the current stream (= `stream`): no cuda-python call
        return bool(_is_capturing())
    driver = _driver()
    status = driver.cuStreamIsCapturing(_cu_stream(stream))
    if _rc(status) != 0:
        return None
    return status[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _eager_workspace(index: int, stream: int, nbytes: int) -> int | None:
    """`nbytes` of device memory for an eager call's scratch (split partials, a dropped lse) on `stream` (torch's
    current stream on device `index`, the current device), or None (the caller allocates)."""
    ws = _eager_ws.get((index, stream))
    if ws is not None and ws[1] >= nbytes:  # the common case: read without the lock (dict reads are atomic)
        return ws[0] if _eager_ws_enabled and _capturing(stream) is False else None
    if not _eager_ws_enabled or _capturing(stream) is not False:
        return None
    size = -(-nbytes // _EAGER_WS_STEP) * _EAGER_WS_STEP
    with _pool_lock:
        ws = _eager_ws.get((index, stream))
        if ws is not None and ws[1] >= nbytes:
            return ws[0]
        total = _eager_ws_total.get(index, 0)
        if total + size > _EAGER_WS_MAX_BYTES:
            return None
        driver = _driver()
        _bind_context(driver, index)
        prev = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            err, dptr = driver.cuMemAlloc(size)
        finally:
            if _rc(prev[0]) == 0:
                driver.cuThreadExchangeStreamCaptureMode(prev[1])
        if _rc(err) != 0:
            return None
        _eager_ws_total[index] = total + size
        _eager_ws[(index, stream)] = (int(dptr), size)
        return int(dptr)


def set_eager_workspace(enabled: bool) -> bool:
    """Tests and A/B runs: whether eager split launches take their partials from the stream's buffer
    (_eager_workspace; True, the default) or from torch's allocator; returns the previous state."""
    global _eager_ws_enabled
    prev, _eager_ws_enabled = _eager_ws_enabled, bool(enabled)
    return prev


def _grow_pool(driver, index: int, pool: dict, ints: int) -> bool:
    """Appends a zeroed chunk of at least `ints` counters (cuMemAlloc in relaxed capture mode, zeroed on the pool's
    own stream and waited for); False if the pool is at its limit or a step failed. A failed driver call is kept in
    pool["error"] (its name and result), which a launch that then finds its capture invalidated reports
    (_capture_hint): the callers fall back without raising, so that error would otherwise go unseen."""
    size = max(_COUNTER_CHUNK_INTS, ints)
    if pool["total"] + size > _COUNTER_POOL_MAX_INTS:
        return False

    def failed(call: str, result) -> bool:
        err = result[0] if isinstance(result, tuple) else result
        pool["error"] = f"{call} returned {_cuda_abi.error_name(driver, err)}"
        return False

    _bind_context(driver, index)
    prev = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        if pool["zero_stream"] is None:
            err, zs = driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
            if _rc(err) != 0:
                return failed("cuStreamCreate", err)
            pool["zero_stream"] = zs
        err, dptr = driver.cuMemAlloc(size * 4)
        if _rc(err) != 0:
            return failed("cuMemAlloc", err)
        call, result = "cuMemsetD32Async", driver.cuMemsetD32Async(dptr, 0, size, pool["zero_stream"])
        if _rc(result) == 0:
            call, result = "cuStreamSynchronize", driver.cuStreamSynchronize(pool["zero_stream"])
        if _rc(result) != 0:
            driver.cuMemFree(dptr)
            return failed(call, result)
        pool["chunks"].append([int(dptr), size, 0])
        pool["total"] += size
        return True
    finally:
        if _rc(prev[0]) == 0:
            driver.cuThreadExchangeStreamCaptureMode(prev[1])


def _capture_hint() -> str:
    """For a launch's error: what the decode counter pool recorded when it could not grow (a failed driver call in
    relaxed capture mode invalidates the capture being made, and the launch after it is the first to say so)."""
    with _pool_lock:  # never held around a launch
        why = [f"device {i}: {pool['error']}" for i, pool in sorted(_pools.items()) if pool.get("error")]
    return f" (the decode counter pool could not grow earlier: {'; '.join(why)})" if why else ""


def _rc(result) -> int:
    """A driver call's CUresult as an int (cuda-python returns a tuple whose first item is it)."""
    return int(result[0] if isinstance(result, tuple) else result)


def set_decode_counter_pool(enabled: bool) -> bool:
    """Tests: use the decode counter pool (True) or zero counters per call (False); returns the previous state."""
    global _pool_enabled
    with _pool_lock:
        prev, _pool_enabled = _pool_enabled, bool(enabled)
    return prev


def decode_counter_pool_state() -> tuple[int, list[int]]:
    """Tests: (ints handed out, their values after a device sync) of the current device's pool."""
    index = torch.cuda.current_device()
    with _pool_lock:
        pool = _pools.get(index)
        if not pool:
            return 0, []
        torch.cuda.synchronize(index)
        values: list[int] = []
        for base, _size, used in pool["chunks"]:
            host = (ctypes.c_int32 * used)()
            if used:
                _drv_check(_driver().cuMemcpyDtoH(ctypes.addressof(host), base, used * 4), "cuMemcpyDtoH")
            values += list(host)
        return len(values), values


# The eager call's kinds (mha_fwd_alloc, mha_decode_fp8kv): a decode step calls the same kind once a layer, and on
# the host-bound eager path each call's Python is paid 32 times a token (kernels/NOTES.md "The NVRTC build's forward
# calls on the host"). Per kind (every input's shape, strides, dtype and device, whether their addresses are 16-byte
# aligned, scale, causal, the forced tile / splits / config, the current device) the first call that passed every
# check leaves what the next needs beyond its pointers: the device, the plan, a params template holding every other
# field, and the outputs' layout. A repeated kind then costs the key, the outputs' two allocations, the template's
# copy, the pointers and the launches. Only kinds whose inputs the kernels read in place and whose device is the
# current one are kept (anything else takes the full path every time), so bad input always meets the checks and
# their messages. Bounded.
_KINDS: dict = {}
_KINDS_MAX = 256
# torch's C queries of the current device and of whether its current stream is capturing (None where this torch
# has no CUDA: a CPU build keeps stand-ins that raise).
_get_device = getattr(torch._C, "_cuda_getDevice", None) if torch.version.cuda else None
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if torch.version.cuda else None
_Tensor = torch.Tensor
_empty_strided = torch.empty_strided
_empty = torch.empty
_float32 = torch.float32


def _meta(t):
    return t.shape, t.stride(), t.dtype, t.device


_NOT_PLAIN = object()


def _seqused_meta(seqused_k):
    """seqused_k's part of a kind: None, its metadata, or _NOT_PLAIN (a subclass or another type: the full path)."""
    if seqused_k is None:
        return None
    return _meta(seqused_k) if type(seqused_k) is _Tensor else _NOT_PLAIN


def _alloc_kind_key(q, k, v, seqused_k, scale, causal):
    """mha_fwd_alloc's kind, or None where the call must take the full path (not plain tensors, not a float scale
    and a bool causal)."""
    if (type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor or type(scale) is not float
            or type(causal) is not bool):
        return None
    sk = _seqused_meta(seqused_k)
    if sk is _NOT_PLAIN:
        return None
    return ("fwd", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape,
            v.stride(), v.dtype, v.device, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15, sk, scale, causal,
            _tile, _decode_splits, _decode_config, _get_device())


def mha_fwd_alloc(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor | None, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``mha_fwd`` with its outputs made here, as binding.cpp's ``mha_fwd_alloc``: out in (B, Sq, Hq, D) memory
    order viewed as (B, Hq, Sq, D), lse (B, Hq, Sq) float32. For inputs that ``flash_attn_func`` has checked, in
    any layout: one the kernels cannot read in place is copied (kernel_contract.readable). A kind seen before
    (_KINDS) skips the checks and the plan."""
    try:
        key = _alloc_kind_key(q, k, v, seqused_k, scale, causal) if _kinds_enabled else None
    except (TypeError, AttributeError, RuntimeError):  # odd arguments: the full path says what is wrong
        key = None
    return _alloc_of_kind(key, q, k, v, seqused_k, scale, causal)


def mha_fwd_alloc_keyed(checked: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seqused_k: torch.Tensor | None, scale: float, causal: bool,
                        need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mha_fwd_alloc`` for a call of ``flash_attn_func`` whose inputs ``kernel_contract.check_inputs`` passed under
    the key `checked` (plain tensors q, k, v with their shapes, strides, dtypes and devices, seqused_k's type, dtype,
    shape and device, causal, scale and path as given): its kind extends that key by what it lacks, not rebuilt from
    the tensors (kernels/NOTES.md "The NVRTC build's forward calls on the host"). `scale` a float, `causal` a bool.
    ``need_lse=False``: the caller drops lse, so a kind seen before may write it to the stream's eager buffer and
    return None for it (no allocation)."""
    try:
        key = ("fwd", checked, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,
               None if seqused_k is None else seqused_k.stride(), scale, causal, _tile, _decode_splits,
               _decode_config, _get_device()) if _kinds_enabled else None
    except (TypeError, AttributeError, RuntimeError):
        key = None
    return _alloc_of_kind(key, q, k, v, seqused_k, scale, causal, need_lse)


def _alloc_of_kind(key, q, k, v, seqused_k, scale, causal, need_lse=True):
    """mha_fwd_alloc's body: the kind `key` (None: the full path, and no kind kept) seen before, or the full path."""
    kind = _KINDS.get(key) if key is not None else None
    if kind is not None:
        index, plan, template, out_size, out_stride, lse_size = kind
        out = _empty_strided(out_size, out_stride, dtype=q.dtype, device=q.device)
        p = FlashFwdParams.from_buffer_copy(template)
        p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if seqused_k is not None:
            p.seqused_k = seqused_k.data_ptr()
        return out, _issue_kind(p, p, plan, q, k, index, lse_size, need_lse)
    qr, kr, vr = kernel_contract.readable(q), kernel_contract.readable(k), kernel_contract.readable(v)
    out, lse = _empty_outputs(qr)
    mha_fwd(qr, kr, vr, out, lse, seqused_k, scale, causal)
    if key is not None and qr is q and kr is k and vr is v:
        prepared = _PREPARED.get(_prepared_key(q, k, v, out, lse, seqused_k, scale, causal))
        if prepared is not None and prepared[0] == key[-1]:  # the current device's call, as _prepare made it
            _keep_kind(key, (*prepared, out.shape, out.stride(), lse.shape))
    return out, lse


def _issue_kind(params, p: FlashFwdParams, plan: _plan.Plan, q, k, index: int, lse_size, need_lse: bool):
    """A kind's call once its pointers but lse's are set (`p`: the FlashFwdParams inside `params`, the struct the
    kernels take): lse (allocated where the caller keeps it, else in the stream's eager buffer where that serves), the
    split workspace, the launches on the current stream. Returns lse, or None where it was dropped."""
    stream = _raw_stream(index)
    lse = None
    if need_lse:
        lse = _empty(lse_size, dtype=_float32, device=q.device)
        p.lse = lse.data_ptr()
    workspace = _workspace(p, plan, q, k, index, stream, 0 if need_lse else lse_size.numel())
    if not p.lse:  # not kept by the caller, and the eager buffer did not take it
        lse = _empty(lse_size, dtype=_float32, device=q.device)
        p.lse = lse.data_ptr()
    for launch in plan.launches:
        _launch(index, launch, params, stream)
    del workspace  # as mha_fwd: it lived until the launches were queued
    return lse


def _keep_kind(key, kind) -> None:
    if len(_KINDS) >= _KINDS_MAX:
        _KINDS.clear()
    _KINDS[key] = kind


def set_call_kinds(enabled: bool) -> bool:
    """Tests and A/B runs: whether repeated call kinds take the fast path (True, the default; LLM_ATTN_NVRTC_KINDS=0
    turns it off) or the full one every time; returns the previous state."""
    global _kinds_enabled
    prev, _kinds_enabled = _kinds_enabled, bool(enabled)
    _KINDS.clear()
    return prev


# -- the low-precision forwards: binding.cpp's mha_fwd_fp8 / mha_fwd_int8 -----------------------------------------
def fp8_available() -> bool:
    """flash_fwd_fp8_available: the current device is compute capability 9.0 and NVRTC compiles sm_90a, which the
    FP8 kernel and its pre-pass are built for (as the Hopper prefill kernel: sm90_available)."""
    return sm90_available()


def int8_available() -> bool:
    """binding.cpp's int8_available: the INT8 forward runs on compute capability 8.x and 9.x."""
    return unavailable_reason() is None and device_info(torch.cuda.current_device())[1].cc_major in (8, 9)


def int8_pv_fp8() -> bool:
    """flash_fwd_int8_fp8_pv_available: whether the current device multiplies P V in e4m3 (compute capability 8.9)."""
    return unavailable_reason() is None and _plan.int8_pv_fp8(device_info(torch.cuda.current_device())[0])


def fp8_qk(qk: str = "") -> str:
    """binding.cpp's fp8_qk: the Q K^T operands an FP8 call with this qk runs ('' = LLM_ATTN_FP8_QK if it is 'e4m3',
    else int8)."""
    return _plan.fp8_qk(qk)


def _fp8_pv_check(pv: str) -> None:
    """binding.cpp's fp8_pv_code: refuses a pv that is neither 'e4m3' nor 'input' ('' = e4m3)."""
    if pv not in ("", "e4m3", "input"):
        raise RuntimeError(f"llm_attn.mha_fwd_fp8: pv must be 'e4m3' or 'input' (the operands of P V), not '{pv}'")


def fp8_block_n(head_dim: int, block_n: int = 0, pv: str = "", qk: str = "") -> int:
    """binding.cpp's fp8_block_n: the FP8 key tile a call with this head_dim, block_n, pv and qk runs, 0 if not
    built."""
    _fp8_pv_check(pv)
    if qk not in ("", "int8", "e4m3"):
        raise RuntimeError(f"llm_attn.mha_fwd_fp8: qk must be 'int8' or 'e4m3' (the operands of Q K^T), not '{qk}'")
    return _plan.fp8_block_n(int(head_dim), int(block_n), pv, qk)


def _checked_outputs(q, k, v, seqused_k, scale, causal):
    """mha_fwd_alloc's outputs for inputs that pass binding.cpp's check_fwd (whose messages it raises)."""
    out, lse = _empty_outputs(q)
    problem = kernel_contract.launcher_problem(q, k, v, out, lse, seqused_k, scale, causal)
    if problem:
        _fail(problem)
    return out, lse


def _empty_outputs(q):
    b, h, s, d = q.shape
    return (torch.empty((b, s, h, d), dtype=q.dtype, device=q.device).transpose(1, 2),
            torch.empty((b, h, s), dtype=torch.float32, device=q.device))


@contextlib.contextmanager
def _device_of(q):
    """(device index, torch's current stream there) with q's device current, as binding.cpp's CUDAGuard."""
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        yield index, _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(q.device).cuda_stream
    else:
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(index):
            yield index, stream


def mha_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor | None, scale: float,
                causal: bool, block_n: int = 0, qk: str = "", pv: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """binding.cpp's mha_fwd_fp8: the same checks and messages, the same workspaces (e4m3 Q, K, V^T in one byte
    buffer, no V^T with pv "input"; the zeroed channel statistics, the scales and q . mean(K) in one float32 buffer,
    from torch's caching allocator), then launch_fp8_tile's launches: the three pre-pass kernels and the kernel with
    its tensor maps. block_n: the key tile (0 = LLM_ATTN_FP8_BLOCK_N if set, else the default); qk: Q K^T's
    operands, "int8" or "e4m3" ("" = LLM_ATTN_FP8_QK if set, else int8); pv: P V's operands, "e4m3" ("" too) or
    "input" (P in the input dtype times the caller's V: int8 Q K^T, whatever LLM_ATTN_FP8_QK says; the same tiles).
    Returns (out, lse)."""
    # binding.cpp's order: check_fwd, fp8_qk_code's, fp8_pv_code's, then pv input with e4m3 Q K^T.
    out, lse = _checked_outputs(q, k, v, seqused_k, scale, causal)
    if qk not in ("", "int8", "e4m3"):
        raise RuntimeError(f"llm_attn.mha_fwd_fp8: qk must be 'int8' or 'e4m3' (the operands of Q K^T), not '{qk}'")
    _fp8_pv_check(pv)
    pv_input = pv == "input"
    if pv_input and qk == "e4m3":
        raise RuntimeError("llm_attn.mha_fwd_fp8: pv='input' runs with int8 Q K^T only (qk 'int8' or ''), not "
                           "qk='e4m3'")
    with _device_of(q) as (index, stream):
        if not fp8_available():
            raise RuntimeError("llm_attn.mha_fwd_fp8: FP8 attention needs a compute capability 9.0 GPU (H100, H200) "
                               "and a build with sm_90a (NVRTC 12.0 or newer compiles it)")
        b, hq, sq, d = q.shape
        tile = _plan.fp8_block_n(d, int(block_n), pv, "int8" if pv_input else qk)
        if tile == 0:
            what = f"{block_n}-key tile" if block_n else "tile of the LLM_ATTN_FP8_BLOCK_N set"
            raise RuntimeError(f"llm_attn.mha_fwd_fp8: the FP8 kernel has no {what} for head_dim {d}"
                               f"{' with pv=' + repr(pv) + ' (128 or 192)' if pv == 'input' else ''} in this build "
                               f"(kernel_tiles.h Fp8Tiles)")
        shape = _plan.Shape(b, hq, k.shape[1], sq, k.shape[2], d, bool(causal), q.dtype == torch.bfloat16)
        ws = _plan.fp8_workspace(shape, pv_input)
        f = FlashFwdFp8Params()
        _set_shapes(f.p, q, k, v, out, scale, causal)
        _set_pointers(f.p, q, k, v, out, lse, seqused_k)
        f.p.num_splits = 1
        bytes_ = torch.empty(ws.bytes_, dtype=torch.uint8, device=q.device)
        floats = torch.empty(ws.floats, dtype=torch.float32, device=q.device)
        floats[:ws.stats].zero_()  # only the statistics are accumulated into
        f.q8 = bytes_.data_ptr()
        f.k8 = f.q8 + ws.q8
        f.vt8 = None if pv_input else f.k8 + ws.k8  # P V in the input dtype reads the caller's V
        at = floats.data_ptr()
        for name in ("stats", "q_scale", "k_scale", "v_scale", "q_dot_kmean"):
            setattr(f, name, at)
            at += 4 * getattr(ws, name)
        traits = _plan.fp8_traits(d, tile, pv_input or fp8_qk(qk) == "int8", pv_input)
        *prepass, main = _plan.fp8_launches(shape, traits)
        for launch in prepass:
            _launch(index, launch, f, stream)
        from llm_attn import _nvrtc_sm90  # noqa: PLC0415

        _launch(index, main, _nvrtc_sm90.fp8_params(f, traits), stream)
    del bytes_, floats  # they lived until the launches were queued; the allocator orders their reuse by stream
    return out, lse


def mha_fwd_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor | None, scale: float,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """binding.cpp's mha_fwd_int8: the same checks and messages, P V in e4m3 where the device has it (sm_89), the
    workspace in one byte buffer (flash_fwd_int8_workspace's layout, from torch's caching allocator), then
    run_flash_fwd_int8's launches: the two pre-pass kernels and the kernel. Returns (out, lse)."""
    out, lse = _checked_outputs(q, k, v, seqused_k, scale, causal)
    with _device_of(q) as (index, stream):
        arch, dev = device_info(index)
        if dev.cc_major not in (8, 9):
            raise RuntimeError(f"llm_attn.mha_fwd_int8: the INT8 forward has kernels for compute capability 8.x and "
                               f"9.0, this GPU is {arch[3:-1]}.{arch[-1]}")
        b, hq, sq, d = q.shape
        shape = _plan.Shape(b, hq, k.shape[1], sq, k.shape[2], d, bool(causal), q.dtype == torch.bfloat16)
        p = FlashFwdInt8Params()
        _set_shapes(p, q, k, v, out, scale, causal)
        _set_pointers(p, q, k, v, out, lse, seqused_k)
        p.fp8_pv = _plan.int8_pv_fp8(arch)
        offsets, size = _plan.int8_workspace(shape, p.fp8_pv)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
        for name, offset in offsets.items():
            if p.fp8_pv or name not in ("v_fp8", "v_scale"):
                setattr(p, name, workspace.data_ptr() + offset)
        for launch in _plan.int8_launches(shape, p.fp8_pv):
            _launch(index, launch, p, stream)
    del workspace
    return out, lse


# -- attention over the FP8 KV cache: binding.cpp's mha_decode_fp8kv, decode_fp8kv_max_rows, fp8kv_prefill --------
# c10's names of the dtypes, as binding.cpp's messages print a tensor's scalar_type().
_SCALAR_TYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
                      torch.float64: "Double", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short",
                      torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool",
                      torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2"}
_FP8KV_DATA_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # e4m3, or its bits
_FP8KV_SCALE_BLOCK = 64  # tokens per K/V scale: the kernel's key tile (DecodeFp8KvTraits::kBlockN)


def _scalar_type(t: torch.Tensor) -> str:
    return _SCALAR_TYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))


def _fp8kv_data_problem(t: torch.Tensor, name: str, q: torch.Tensor) -> str | None:
    """binding.cpp's check_fp8kv_data."""
    if not (t.is_cuda and t.device == q.device):
        return f"{name} must be a CUDA tensor on q's device"
    if t.dtype not in _FP8KV_DATA_DTYPES:
        return f"{name} must be float8_e4m3fn (or its uint8 bits), got {_scalar_type(t)}"
    if t.dim() != 4:
        return f"{name} must be 4-D (batch, kv_heads, tokens, head_dim), got {t.dim()}-D"
    st = t.stride()
    if st[3] != 1:
        return f"{name} must be contiguous in head_dim"
    if any(st[d] % 16 and t.shape[d] != 1 for d in range(3)):
        return f"{name} strides must be multiples of 16 bytes, got {_shape(st)}"
    if t.data_ptr() % 16:
        return f"{name} must be 16-byte aligned"
    return None


def decode_fp8kv_problem(q, k_data, v_data, k_scale, v_scale, seqused_k, scale: float) -> str | None:
    """What binding.cpp's mha_decode_fp8kv refuses, in its words and order (without its "llm_attn.mha_decode_fp8kv: "
    prefix), or None."""
    if q.dtype not in kernel_contract.KERNEL_DTYPES:
        return f"q must be float16 or bfloat16, got {_scalar_type(q)}"
    if not (q.is_cuda and q.dim() == 4):
        return "q must be a 4-D CUDA tensor (batch, heads, q_len, head_dim)"
    st = q.stride()
    if st[3] != 1:
        return "q must be contiguous in head_dim"
    if any(st[d] % 8 and q.shape[d] != 1 for d in range(3)):
        return f"q strides must be multiples of 8 elements, got {_shape(st)}"
    if q.data_ptr() % 16:
        return "q must be 16-byte aligned"
    for t, name in ((k_data, "k_data"), (v_data, "v_data")):
        problem = _fp8kv_data_problem(t, name, q)
        if problem:
            return problem
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k_data.shape[1], k_data.shape[2]
    if head_dim not in (64, 128):
        return f"head_dim must be 64 or 128, got {head_dim}"
    if k_data.shape != v_data.shape:
        return f"k_data {_shape(k_data.shape)} and v_data {_shape(v_data.shape)} must have the same shape"
    if k_data.shape[0] != batch or k_data.shape[3] != head_dim:
        return f"k_data/v_data {_shape(k_data.shape)} do not match q {_shape(q.shape)}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
    if min(batch, num_heads, seqlen_q, seqlen_k) <= 0:
        return f"empty input: q {_shape(q.shape)}, k_data {_shape(k_data.shape)}"
    rows = num_heads // num_kv_heads * seqlen_q
    if rows >= 1 << 30:
        return f"(query heads per kv head) x q_len must be below 2^30, got {rows}"
    if seqlen_k >= kernel_contract.KERNEL_MAX_SEQ_LEN:
        return "sequence too long"
    if num_kv_heads > 65535 or batch > 65535:  # the grid's y and z
        return "at most 65535 kv heads and batch 65535"
    for t, name, data in ((k_scale, "k_scale", k_data), (v_scale, "v_scale", v_data)):  # check_fp8kv_scale
        blocks = -(-data.shape[2] // _FP8KV_SCALE_BLOCK)
        if not (t.is_cuda and t.device == q.device and t.dtype == torch.float32 and t.dim() == 3
                and tuple(t.shape[:2]) == tuple(data.shape[:2]) and t.shape[2] >= blocks and t.stride(2) == 1):
            return (f"{name} must be float32 (batch, kv_heads, >= {blocks} blocks) on q's device with adjacent "
                    f"blocks, got {_scalar_type(t)} {_shape(t.shape)}")
    if not (math.isfinite(scale) and scale >= 0):  # binding.cpp formats the number with %g
        return f"scale must be finite and >= 0, got {scale:g}"
    if seqused_k is not None and not (seqused_k.is_cuda and seqused_k.device == q.device
                                      and seqused_k.dtype == torch.int32 and seqused_k.dim() == 1
                                      and seqused_k.shape[0] == batch and seqused_k.is_contiguous()):
        return "seqused_k must be a contiguous int32 tensor of shape (batch,) on q's device"
    return None


def decode_fp8kv_max_rows() -> int:
    """The largest (query heads per KV head) x q_len the FP8-cache decode kernel takes (kDecodeMaxRows)."""
    return _plan.DECODE_MAX_ROWS


def fp8kv_prefill() -> bool:
    """Whether mha_decode_fp8kv takes more rows than decode_fp8kv_max_rows: the prefill kernel over the FP8 cache
    (binding.cpp's fp8kv_prefill; always, in this build)."""
    return True


@functools.lru_cache(maxsize=4096)
def _decode_fp8kv_plan_for(index: int, shape: _plan.Shape, prefill_version: int = 0) -> _plan.Plan:
    """The FP8-cache decode's plan per (device, shape, forced split, forced prefill kernel version (0: the grid
    rule)): nothing to choose again on a later layer."""
    return _plan.decode_fp8kv_plan(shape, device_info(index)[1], prefill_version)


def mha_decode_fp8kv(q: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, seqused_k: torch.Tensor | None, scale: float,
                     causal: bool, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention over the FP8 (e4m3) KV cache, dequantised in registers: binding.cpp's mha_decode_fp8kv, with
    its checks and messages (decode_fp8kv_problem), its split count (flash_decode_fp8kv_num_splits: the decode rule,
    set_decode_splits forcing it), the split workspace of mha_fwd (float32 partials in the stream's eager buffer or
    from torch's caching allocator, the arrival counters from the decode counter pool, else zeroed in one allocation
    with the partials) and its one launch
    (_plan.decode_fp8kv_plan), on the current stream, without synchronisation. Returns (out (B, Hq, Sq, D) in
    (B, Sq, Hq, D) memory order, lse (B, Hq, Sq) float32, natural log, without K's smoothing shift). ``need_lse=False``
    (the caller drops lse): a kind seen before may write it to the stream's eager buffer and return None for it."""
    scale = float(scale)
    try:
        key = _decode_fp8kv_kind_key(q, k_data, v_data, k_scale, v_scale, seqused_k, scale, causal) \
            if _kinds_enabled else None
    except (TypeError, AttributeError, RuntimeError):  # odd arguments: the full path says what is wrong
        key = None
    return _decode_fp8kv_of_kind(key, q, k_data, v_data, k_scale, v_scale, seqused_k, scale, causal, need_lse)


def mha_decode_fp8kv_keyed(checked: tuple, q: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor,
                           k_scale: torch.Tensor, v_scale: torch.Tensor, seqused_k: torch.Tensor | None, scale: float,
                           causal: bool, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mha_decode_fp8kv`` for a call of ``ops.decode_fp8_kv`` whose inputs passed its checks under the key
    `checked` (q, the cache view's tensors with their shapes, strides, dtypes and devices, seqused_k's, the data
    pointers' alignment, the view's length, scale and causal): its kind extends that key by what it lacks, not
    rebuilt from the tensors. k_data/v_data: the view's valid tokens. `scale` a float, `causal` a bool."""
    key = ("fp8kv", checked, _decode_splits, _plan.prefill_fp8kv_forced(), _get_device()) if _kinds_enabled else None
    return _decode_fp8kv_of_kind(key, q, k_data, v_data, k_scale, v_scale, seqused_k, scale, causal, need_lse)


def _decode_fp8kv_of_kind(key, q, k_data, v_data, k_scale, v_scale, seqused_k, scale: float, causal: bool,
                          need_lse: bool):
    """mha_decode_fp8kv's body: the kind `key` (None: the full path, and no kind kept) seen before, or the full
    path."""
    kind = _KINDS.get(key) if key is not None else None
    if kind is not None:  # a kind seen before (_KINDS): its template holds every field but the pointers
        index, plan, template, out_size, out_stride, lse_size = kind
        out = _empty_strided(out_size, out_stride, dtype=q.dtype, device=q.device)
        fp = FlashDecodeFp8KvParams.from_buffer_copy(template)
        p = fp.base
        p.q, p.k, p.v, p.o = q.data_ptr(), k_data.data_ptr(), v_data.data_ptr(), out.data_ptr()
        if seqused_k is not None:
            p.seqused_k = seqused_k.data_ptr()
        fp.k_scale, fp.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        return out, _issue_kind(fp, p, plan, q, k_data, index, lse_size, need_lse)
    problem = decode_fp8kv_problem(q, k_data, v_data, k_scale, v_scale, seqused_k, scale)
    if problem:
        raise RuntimeError("llm_attn.mha_decode_fp8kv: " + problem)
    out, lse = _empty_outputs(q)
    with _device_of(q) as (index, stream):
        b, hq, sq, d = q.shape
        shape = _plan.Shape(b, hq, k_data.shape[1], sq, k_data.shape[2], d, bool(causal), q.dtype == torch.bfloat16,
                            decode_splits=_decode_splits)
        plan = _decode_fp8kv_plan_for(index, shape, _plan.prefill_fp8kv_forced())  # read per call, as the C++
        fp = FlashDecodeFp8KvParams()
        p = fp.base  # a view of fp's memory: what is set on it is fp's
        _set_shapes(p, q, k_data, v_data, out, scale, causal)  # the k/v strides: bytes = elements
        _set_pointers(p, q, k_data, v_data, out, lse, seqused_k)
        p.tile, p.num_splits = _plan.TILE_AUTO, plan.num_splits
        fp.k_scale, fp.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        fp.ks_batch_stride, fp.ks_head_stride = k_scale.stride()[:2]
        fp.vs_batch_stride, fp.vs_head_stride = v_scale.stride()[:2]
        if key is not None and index == key[-1]:  # the template: every field but the pointers (set per call)
            template = FlashDecodeFp8KvParams.from_buffer_copy(fp)
            tp = template.base
            tp.q = tp.k = tp.v = tp.o = tp.lse = tp.seqused_k = None
            template.k_scale = template.v_scale = None
            _keep_kind(key, (index, plan, template, out.shape, out.stride(), lse.shape))
        workspace = _workspace(p, plan, q, k_data, index, stream)
        for launch in plan.launches:
            _launch(index, launch, fp, stream)
    del workspace  # it lived until the launch was queued; the allocator orders its reuse by stream
    return out, lse


def _decode_fp8kv_kind_key(q, k_data, v_data, k_scale, v_scale, seqused_k, scale, causal):
    """mha_decode_fp8kv's kind (as _alloc_kind_key; the forced prefill kernel version too), or None."""
    T = _Tensor
    if (type(q) is not T or type(k_data) is not T or type(v_data) is not T or type(k_scale) is not T
            or type(v_scale) is not T or type(causal) is not bool):
        return None
    sk = _seqused_meta(seqused_k)
    if sk is _NOT_PLAIN:
        return None
    return ("fp8kv", q.shape, q.stride(), q.dtype, q.device, k_data.shape, k_data.stride(), k_data.dtype,
            k_data.device, v_data.shape, v_data.stride(), v_data.dtype, v_data.device, k_scale.shape, k_scale.stride(),
            k_scale.dtype, k_scale.device, v_scale.shape, v_scale.stride(), v_scale.dtype, v_scale.device,
            (q.data_ptr() | k_data.data_ptr() | v_data.data_ptr()) & 15, sk, scale, causal, _decode_splits,
            _plan.prefill_fp8kv_forced(), _get_device())


def fp8_cache_append_problem(k_new, v_new, k_open, v_open, k_shift, k_data, v_data, k_scale, v_scale, position, used,
                             max_cache_len: int) -> str | None:
    """What binding.cpp's fp8_cache_append refuses, in its words and order (without its "llm_attn.fp8_cache_append: "
    prefix), or None."""
    if not (k_data.is_cuda and k_data.dim() == 4):
        return "k_data must be a 4-D CUDA tensor (batch, kv_heads, capacity, head_dim)"
    b, h, c, d = k_data.shape
    if d not in (64, 128):
        return f"head_dim must be 64 or 128, got {d}"
    if not (c > 0 and c % 64 == 0):
        return f"the capacity must be a positive multiple of 64 tokens, got {c}"
    if not 0 < max_cache_len <= c:
        return f"max_cache_len must be in [1, {c}], got {max_cache_len}"
    e4m3 = torch.uint8 if k_data.dtype == torch.uint8 else torch.float8_e4m3fn
    for t, name, dtype, sizes in ((k_data, "k_data", e4m3, (b, h, c, d)), (v_data, "v_data", e4m3, (b, h, c, d)),
                                  (k_open, "k_open", torch.float32, (b, h, 64, d)),
                                  (v_open, "v_open", torch.float32, (b, h, 64, d)),
                                  (k_shift, "k_shift", torch.float32, (b, h, d)),
                                  (k_scale, "k_scale", torch.float32, (b, h, c // 64)),
                                  (v_scale, "v_scale", torch.float32, (b, h, c // 64))):
        problem = _same_as_data(t, name, dtype, sizes, k_data)
        if problem:
            return problem
    if not (position.device == k_data.device and position.dtype == torch.int64 and position.numel() == 1):
        return "position must be one int64 on k_data's device"
    problem = _same_as_data(used, "used", torch.int32, (b,), k_data)
    if problem:
        return problem
    for t, name in ((k_new, "k_new"), (v_new, "v_new")):
        if t.device != k_data.device:
            return f"{name} must be on k_data's device"
        if t.dtype not in kernel_contract.KERNEL_DTYPES:
            return f"{name} must be float16 or bfloat16, got {_scalar_type(t)}"
        if tuple(t.shape) != (b, h, 1, d) or t.stride(3) != 1:
            return f"{name} must be {_shape((b, h, 1, d))} contiguous in head_dim, got {_shape(t.shape)}"
    if v_new.dtype != k_new.dtype:
        return "k_new and v_new must have one dtype"
    return None


def _same_as_data(t: torch.Tensor, name: str, dtype: torch.dtype, sizes: tuple, k_data: torch.Tensor) -> str | None:
    """binding.cpp fp8_cache_append's `same`: device, dtype, shape, contiguity."""
    if t.device != k_data.device:
        return f"{name} must be on k_data's device"
    if t.dtype != dtype:
        return f"{name} must be {_SCALAR_TYPE_NAMES[dtype]}, got {_scalar_type(t)}"
    if tuple(t.shape) != tuple(sizes):
        return f"{name} must be {_shape(sizes)}, got {_shape(t.shape)}"
    if not t.is_contiguous():
        return f"{name} must be contiguous"
    return None


def fp8_cache_append(k_new: torch.Tensor, v_new: torch.Tensor, k_open: torch.Tensor, v_open: torch.Tensor,
                     k_shift: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, position: torch.Tensor, used: torch.Tensor, max_cache_len: int) -> None:
    """The FP8 static cache's one-token append in one launch: binding.cpp's fp8_cache_append (its checks and
    messages: fp8_cache_append_problem), the kernel of kernels/fp8_cache_append_kernel.cuh compiled by NVRTC, on the
    current stream, without synchronisation (CUDA-graph capturable: nothing is read on the host)."""
    max_cache_len = int(max_cache_len)
    problem = fp8_cache_append_problem(k_new, v_new, k_open, v_open, k_shift, k_data, v_data, k_scale, v_scale,
                                       position, used, max_cache_len)
    if problem:
        raise RuntimeError("llm_attn.fp8_cache_append: " + problem)
    b, h, c, d = k_data.shape
    p = Fp8CacheAppendParams()
    p.k_new, p.v_new = k_new.data_ptr(), v_new.data_ptr()
    p.kn_batch_stride, p.kn_head_stride = k_new.stride()[:2]
    p.vn_batch_stride, p.vn_head_stride = v_new.stride()[:2]
    p.k_open, p.v_open, p.k_shift = k_open.data_ptr(), v_open.data_ptr(), k_shift.data_ptr()
    p.k_data, p.v_data = k_data.data_ptr(), v_data.data_ptr()
    p.k_scale, p.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
    p.position, p.used = position.data_ptr(), used.data_ptr()
    p.batch, p.kv_heads, p.head_dim, p.capacity, p.max_cache_len = b, h, d, c, max_cache_len
    p.is_bf16 = k_new.dtype == torch.bfloat16
    with _device_of(k_data) as (index, stream):
        _launch(index, _plan.fp8_cache_append_launch(b, h, d, bool(p.is_bf16)), p, stream)


def fp8_cache_dequant_problem(k_data, v_data, k_scale, v_scale, k_shift, k_out, v_out) -> str | None:
    """What binding.cpp's fp8_cache_dequant refuses, in its words and order (without its
    "llm_attn.fp8_cache_dequant: " prefix), or None."""
    if not (k_data.is_cuda and k_data.dim() == 4):
        return "k_data must be a 4-D CUDA tensor (batch, kv_heads, capacity, head_dim)"
    b, h, c, d = k_data.shape
    if d not in (64, 128):
        return f"head_dim must be 64 or 128, got {d}"
    if not (b > 0 and h > 0 and b * h <= 65535):
        return f"batch x kv_heads must be in [1, 65535], got {b * h}"
    if k_out.dim() != 4:
        return "k_out must be 4-D (batch, kv_heads, n, head_dim)"
    n, nb = k_out.shape[2], k_scale.shape[2] if k_scale.dim() == 3 else -1
    if n > c:
        return f"k_out has {n} tokens, more than the cache's capacity {c}"
    if nb * 64 < n:
        return f"k_scale must be (batch, kv_heads, >= ceil(n / 64)) float32, got {_shape(k_scale.shape)}"
    operands = [(k_data, "k_data", (torch.float8_e4m3fn, torch.uint8), (b, h, c, d)),
                (v_data, "v_data", (k_data.dtype,), (b, h, c, d)),
                (k_scale, "k_scale", (torch.float32,), (b, h, nb)), (v_scale, "v_scale", (torch.float32,), (b, h, nb))]
    if k_shift is not None:
        operands.append((k_shift, "k_shift", (torch.float32,), (b, h, d)))
    operands += [(k_out, "k_out", kernel_contract.KERNEL_DTYPES, (b, h, n, d)),
                 (v_out, "v_out", (k_out.dtype,), (b, h, n, d))]
    for t, name, dtypes, sizes in operands:  # the binding's `same`
        if t.device != k_data.device:
            return f"{name} must be on k_data's device"
        if t.dtype not in dtypes:
            return f"{name} has dtype {_scalar_type(t)}, not one this kernel takes"
        if tuple(t.shape) != sizes:
            return f"{name} must be {_shape(sizes)}, got {_shape(t.shape)}"
        if not t.is_contiguous():
            return f"{name} must be contiguous"
        if t.data_ptr() % 16:
            return f"{name} must be 16-byte aligned"
    return None


def _fp8_cache_dequant_refused(p: Fp8CacheDequantParams) -> bool:
    """Whether run_fp8_cache_dequant returns cudaErrorInvalidValue for `p` (its checks, on the params as the binding
    narrows them to int: after fp8_cache_dequant_problem only a size past int's range meets one)."""
    if (p.head_dim not in (64, 128) or p.n < 0 or p.n > p.capacity or p.batch <= 0 or p.kv_heads <= 0
            or p.batch * p.kv_heads > 65535 or p.scale_blocks * 64 < p.n):
        return True
    if p.n == 0:
        return False
    return any((ptr or 0) % 16 for ptr in (p.k_data, p.v_data, p.k_out, p.v_out, p.k_shift))  # None: null


def fp8_cache_dequant(k_data: torch.Tensor, v_data: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                      k_shift: torch.Tensor | None, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """K and V of an FP8 cache layer's tokens [0, n) (n = k_out's length) dequantised into k_out and v_out in one
    launch: binding.cpp's fp8_cache_dequant (its checks and messages: fp8_cache_dequant_problem; then
    run_fp8_cache_dequant's own, as "kernel launch failed: invalid argument"), the kernel of
    kernels/fp8_cache_dequant_kernel.cuh compiled by NVRTC, on the current stream, without synchronisation. n == 0
    launches nothing."""
    problem = fp8_cache_dequant_problem(k_data, v_data, k_scale, v_scale, k_shift, k_out, v_out)
    if problem:
        raise RuntimeError("llm_attn.fp8_cache_dequant: " + problem)
    b, h, c, d = k_data.shape
    p = Fp8CacheDequantParams()  # ctypes narrows the sizes to int as the binding's static_casts do
    p.k_data, p.v_data = k_data.data_ptr(), v_data.data_ptr()
    p.k_scale, p.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
    p.k_shift = k_shift.data_ptr() if k_shift is not None else None
    p.k_out, p.v_out = k_out.data_ptr(), v_out.data_ptr()
    p.batch, p.kv_heads, p.head_dim, p.capacity = b, h, d, c
    p.scale_blocks, p.n = k_scale.shape[2], k_out.shape[2]
    p.is_bf16 = k_out.dtype == torch.bfloat16
    if _fp8_cache_dequant_refused(p):
        raise RuntimeError("llm_attn.fp8_cache_dequant: kernel launch failed: invalid argument")
    if p.n == 0:
        return
    with _device_of(k_data) as (index, stream):
        _launch(index, _plan.fp8_cache_dequant_launch(p.batch, p.kv_heads, p.head_dim, p.n, bool(p.is_bf16)), p,
                stream)


# The current stream's raw handle without building a torch.cuda.Stream (what torch's own generated code calls).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The call kinds' fast path (_KINDS) needs both of torch's fast queries (the current device, its raw stream).
_kinds_enabled = (os.environ.get("LLM_ATTN_NVRTC_KINDS", "1") != "0" and _raw_stream is not None
                  and _get_device is not None)


def sm90_probe_offsets(struct: str = "Sm90Params") -> dict[str, int]:
    """{field: offset} of a Hopper kernel's C++ parameter struct (``_nvrtc_sm90.STRUCTS``: Sm90Params,
    Fp8Sm90Params) as NVRTC lays it out: ``_nvrtc_sm90.layout_probe_source()`` (with its struct_asserts) compiled to
    PTX for sm_90a. Needs NVRTC only (no GPU, no driver); tests/test_nvrtc.py compares it with the ctypes mirror."""
    from llm_attn import _nvrtc_sm90  # noqa: PLC0415

    src = _nvrtc_sm90.layout_probe_source(struct) + _nvrtc_sm90.struct_asserts(struct)
    return _nvrtc_sm90.layout_probe(compile_ptx(_nvrtc_sm90.ARCH, src, "llm_attn_sm90_probe.cu"), struct)


def compile_ptx(arch: str, src: str, name: str = "llm_attn_probe.cu") -> str:
    """PTX of `src` (a program over the kernel headers) for `arch`: for probes that read what the C++ says (struct
    offsets, constants) without a GPU or a driver."""
    nvrtc = _nvrtc()
    names = [n.encode() for n in _SHIM_HEADERS]
    bodies = [t.encode() for t in _SHIM_HEADERS.values()]
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), len(names), bodies, names),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in _options(arch) if not o.startswith("--ptxas")]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            log = _output(nvrtc, prog, "ProgramLog")
            raise RuntimeError(f"{name} did not compile:\n{log.decode(errors='replace')}")
        return _output(nvrtc, prog, "PTX").rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# -- the backward: binding.cpp's mha_bwd, set_bwd_splits, set_bwd_tile, bwd_splits ---------------------------------
def _bwd_splits_from_env() -> int:
    """LLM_ATTN_BWD_SPLITS as binding.cpp reads it (std::atoi; 0 = automatic)."""
    v = _plan._tuning_env("LLM_ATTN_BWD_SPLITS", 0)
    return v if v > 0 else 0


def _bwd_tile_from_env() -> int:
    """LLM_ATTN_BWD_TILE as binding.cpp's bwd_tile_from_env reads it: a force_bwd_tile name, else auto (with a
    warning for anything else)."""
    v = os.environ.get("LLM_ATTN_BWD_TILE", "")
    if not v:
        return _plan.BWD_AUTO
    if v in _plan.BWD_TILE_IDS:
        return _plan.BWD_TILE_IDS[v]
    import warnings  # noqa: PLC0415

    warnings.warn(f"llm_attn: LLM_ATTN_BWD_TILE={v} is not {', '.join(list(_plan.BWD_TILE_IDS)[:-1])} or "
                  f"{list(_plan.BWD_TILE_IDS)[-1]}; ignored", stacklevel=2)
    return _plan.BWD_AUTO


_bwd_splits = _bwd_splits_from_env()
_bwd_tile = _bwd_tile_from_env()


def set_bwd_splits(splits: int) -> int:
    """Force the backward's key-block split (0 auto); returns the previous count, -1 (nothing changed) if negative."""
    global _bwd_splits
    if int(splits) < 0:
        return -1
    prev, _bwd_splits = _bwd_splits, int(splits)
    return prev


def set_bwd_tile(tile: int) -> int:
    """Force the backward's dK/dV kernel (a BwdTileId, 0 auto); returns the previous one, -1 (nothing changed) for
    an unknown id."""
    global _bwd_tile
    if int(tile) not in _plan.BWD_TILE_IDS.values():
        return -1
    prev, _bwd_tile = _bwd_tile, int(tile)
    return prev


def bwd_splits(batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
               causal: bool, num_sms: int) -> list[int]:
    """(num_splits, iters_per_split) of the backward for these shapes on a device with num_sms SMs and the current
    device's other facts, with the forced split and tile (binding.cpp's bwd_splits; tests)."""
    dev = device_info(torch.cuda.current_device())[1]
    shape = _plan.BwdShape(int(batch), int(num_heads), int(num_kv_heads), int(seqlen_q), int(seqlen_k), int(head_dim),
                           bool(causal), force_splits=_bwd_splits, force_tile=_bwd_tile)
    sp = _plan.bwd_set_splits(shape, _plan.Device(int(num_sms), dev.smem_per_sm, dev.smem_per_block_optin,
                                                  dev.cc_major, dev.sm90))
    return [sp.num_splits, sp.iters_per_split]


@functools.lru_cache(maxsize=4096)
def _bwd_plan_for(index: int, shape: _plan.BwdShape) -> _plan.BwdPlan:
    return _plan.bwd_plan(shape, device_info(index)[1])


# Per backward call kind (every operand's shape, strides, dtype, device and alignment, scale, causal, the forced
# splits and tile, deterministic): the launcher's verdict, its plan and a params struct holding everything but the
# pointers, as _PREPARED for the forward. Only calls that passed are stored. Bounded.
_PREPARED_BWD: dict = {}


def _prepared_bwd_key(dout, q, k, v, out, lse, dlse, dq, dk, dv, seqused_k, scale, causal, deterministic):
    T = torch.Tensor
    for t in (dout, q, k, v, out, lse, dq, dk, dv):
        if type(t) is not T:
            return None
    if not q.is_cuda:  # refused by the checks: nothing to keep
        return None
    extra = []
    for t in (dlse, seqused_k):
        if t is None:
            extra.append(None)
        elif type(t) is T:
            extra.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    index = q.device.index
    return (_operand_key(dout), _operand_key(q), _operand_key(k), _operand_key(v), _operand_key(out),
            _operand_key(dq), _operand_key(dk), _operand_key(dv), lse.shape, lse.stride(), lse.dtype, lse.device,
            *extra, type(scale), scale, type(causal), causal, bool(deterministic), _bwd_splits, _bwd_tile,
            torch.cuda.current_device() if index is None else index)


def _prepare_bwd(index, dout, q, k, v, out, lse, dlse, dq, dk, dv, seqused_k, scale, causal, deterministic):
    """(plan, params template without pointers) for a backward call on device `index` that passed
    kernel_contract.backward_launcher_problem: the device's checks, the plan and the fields but the pointers."""
    dev = device_info(index)[1]
    if _plan.BWD_HOPPER <= _bwd_tile <= _plan.BWD_HOPPER_SHARED_DQ and not dev.sm90:
        raise RuntimeError("llm_attn.mha_bwd: the Hopper backward was forced (force_bwd_tile('hopper')) but needs "
                           "a compute capability 9.0 GPU and a build with sm_90a (NVRTC 12.0 or newer compiles "
                           "it)")
    if deterministic and _plan.BWD_HOPPER <= _bwd_tile <= _plan.BWD_HOPPER_SHARED_DQ:
        raise RuntimeError("llm_attn.mha_bwd: deterministic=True, but the Hopper backward was forced "
                           "(force_bwd_tile('hopper...')): its dQ is summed in no fixed order; force 'auto', "
                           "'portable', 'narrow' or 'portable_separate_dq'")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    plan = _bwd_plan_for(index, _plan.BwdShape(b, hq, hkv, sq, sk, d, bool(causal), q.dtype == torch.bfloat16,
                                               _bwd_splits, _bwd_tile, bool(deterministic)))
    sp = plan.splits
    p = FlashBwdParams()
    _set_shapes(p, q, k, v, out, scale, causal)
    (p.do_batch_stride, p.do_head_stride, p.do_row_stride) = dout.stride()[:3]
    (p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride) = dq.stride()[:3]
    (p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride) = dk.stride()[:3]
    (p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride) = dv.stride()[:3]
    p.hopper, p.narrow, p.num_splits, p.iters_per_split = sp.hopper, sp.narrow, sp.num_splits, sp.iters_per_split
    p.dq_shared, p.dq_separate, p.deterministic = sp.dq_shared, sp.dq_separate, plan.deterministic
    p.layout2d = sp.layout2d
    return plan, p


def mha_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            seqused_k: torch.Tensor | None, scale: float, causal: bool, deterministic: bool = False) -> None:
    """Gradients of flash attention into preallocated dq (q's shape), dk, dv (k's shape): binding.cpp's mha_bwd,
    with the same checks and messages (kernel_contract.backward_launcher_problem), the same workspaces from torch's
    caching allocator (dsum, lse_log2; the zeroed float32 dQ accumulator unless the separate dQ kernel runs; the
    zeroed float32 dK/dV accumulators of a split launch) and run_flash_bwd's launches (_plan.bwd_plan), on the
    current stream, without synchronisation. A call of a kind seen before (_PREPARED_BWD) skips the checks and the
    plan."""
    args = (dout, q, k, v, out, lse, dlse, dq, dk, dv, seqused_k, scale, causal, deterministic)
    try:
        key = _prepared_bwd_key(*args)
        prepared = _PREPARED_BWD.get(key) if key is not None else None
    except (TypeError, AttributeError):  # odd arguments: the full checks say what is wrong
        key = prepared = None
    if prepared is None:  # bad input is refused before anything touches a device
        problem = kernel_contract.backward_launcher_problem(*args[:-1])
        if problem:
            raise RuntimeError("llm_attn.mha_bwd: " + problem)
    with _device_of(q) as (index, stream):
        if prepared is None:
            prepared = _prepare_bwd(index, *args)
            if key is not None:
                if len(_PREPARED_BWD) >= _PREPARED_MAX:
                    _PREPARED_BWD.clear()
                _PREPARED_BWD[key] = prepared
        plan, template = prepared
        sp = plan.splits
        p = FlashBwdParams.from_buffer_copy(template)  # a copy per call, as mha_fwd's
        _set_pointers(p, q, k, v, out, lse, seqused_k)
        p.dout, p.dq, p.dk, p.dv = dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        p.dlse = dlse.data_ptr() if dlse is not None else None
        # One float32 allocation: dsum and lse_log2 (B, Hq, Sq) each, then the accumulators that start at zero
        # (dQ (B, Hq, Sq, D) unless dq_separate; dK, dV (B, Hkv, Sk, D) each when split, one per split when
        # deterministic), zeroed in one fill. Each part starts on a 256-byte boundary (float4 atomics and TMA need
        # 16 bytes), as its own tensor would.
        b, hq, sq, d = q.shape
        rows, kv = b * hq * sq, b * k.shape[1] * k.shape[2] * d * max(plan.dkdv_slabs, 1)
        pad = -rows % 64
        zeroed = (0 if sp.dq_separate else rows * d) + (2 * kv if sp.num_splits > 1 else 0)
        ws = torch.empty(2 * (rows + pad) + zeroed, dtype=torch.float32, device=q.device)
        if zeroed:
            ws[2 * (rows + pad):].zero_()
        at = ws.data_ptr()
        p.dsum, p.lse_log2 = at, at + 4 * (rows + pad)
        at += 8 * (rows + pad)
        if not sp.dq_separate:
            p.dq_accum = at
            at += 4 * rows * d
        if sp.num_splits > 1:
            p.dk_accum, p.dv_accum = at, at + 4 * kv
        for launch in plan.launches:
            if launch is plan.dkdv and plan.sm90 is not None:
                from llm_attn import _nvrtc_sm90  # noqa: PLC0415

                _launch(index, launch, _nvrtc_sm90.bwd_params(p, plan.sm90), stream)
            else:
                _launch(index, launch, p, stream)
    del ws  # it lived until the launches were queued; the allocator orders its reuse by stream
