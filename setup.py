"""Builds the llm_attn package and, when a CUDA build of PyTorch and nvcc are present, its CUDA extension.

    python -m pip install --no-build-isolation -e .   # uses the torch already installed; never pulls a CUDA torch
    python -m pip install --no-build-isolation .      # the same, as a regular install

pyproject.toml names the setuptools backend (PEP 517/660); the metadata stays here so that setuptools 59 (JetPack)
builds it too.

Environment:
    LLM_ATTN_CUDA_ARCHS   semicolon list of compute capabilities (default: those of the GPUs visible at build time,
                          or "8.0;8.6;8.7;8.9;9.0" where none is visible), e.g. "8.9" for an
                          RTX 4060 Ti, "8.7" for Jetson Orin, "9.0" for H100. Fewer archs build faster. 9.0 (or 9.0a)
                          compiles sm_90a: the Hopper-only kernels need its wgmma/TMA/setmaxnreg instructions.
    LLM_ATTN_NO_CUDA=1    skip the extension even where it could be built (the kernel then runs through NVRTC).
    MAX_JOBS              parallel nvcc jobs (torch's ninja build).

Without a CUDA torch (or without nvcc) the install still succeeds, fast, without the extension: on a GPU the kernel
is then compiled at first use by NVRTC (llm_attn/_nvrtc.py, the `nvrtc` extra), on a CPU the package runs on the
PyTorch reference. Where a CUDA torch and nvcc are present and the build fails, the install fails with a banner that
says why and how to install without it.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.6;8.7;8.9;9.0"


def _gencode_flags(archs: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in archs.replace(",", ";").split(";"))):
        num = arch.replace(".", "")
        if num in ("90", "90a"):  # Hopper: the arch-specific target, so that wgmma/TMA code is compiled
            num = "90a"
        elif not num.isdigit():
            raise SystemExit(f"LLM_ATTN_CUDA_ARCHS: bad architecture {arch!r} (expected e.g. 8.9 or 9.0a)")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return flags


def _banner(lines: list[str]) -> str:
    bar = "#" * 100
    return "\n".join(["", bar, *(f"# {line}" for line in lines), bar, ""])


class BuildPy(build_py):
    """Also ships the kernel headers (kernels/*.h, *.cuh) as llm_attn/_kernels, for the NVRTC backend of a
    non-editable install (an editable one reads kernels/ in place)."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "llm_attn", "_kernels")
        os.makedirs(dest, exist_ok=True)
        for pattern in ("*.h", "*.cuh"):
            for path in glob.glob(os.path.join(ROOT, "kernels", pattern)):
                shutil.copy2(path, dest)


def _loud_build_ext(base):
    """The extension build, failing with a banner at the end of pip's output instead of a buried traceback."""

    class LoudBuildExt(base):
        def run(self):
            try:
                super().run()
            except BaseException as e:  # noqa: BLE001  (compile errors arrive as SystemExit/CompileError/...)
                print(_banner([
                    "llm_attn: building the CUDA extension (llm_attn._C) FAILED with a CUDA torch and nvcc present:",
                    f"  {type(e).__name__}: {str(e).strip()[:500]}",
                    "The compiler output above says why (nvcc older than torch's CUDA, missing host compiler, ...).",
                    "To install without it (the kernel then compiles at first use through NVRTC, no nvcc needed):",
                    "  LLM_ATTN_NO_CUDA=1 python -m pip install --no-build-isolation -e '.[nvrtc]'",
                ]), file=sys.stderr, flush=True)
                raise
    return LoudBuildExt


def _visible_archs(torch) -> str | None:
    """The compute capabilities of the GPUs this build can see ("9.0" on an H100): a build on a GPU machine then
    compiles for that GPU only, several times faster than for every default architecture. None without a GPU
    (a CI or wheel-building machine: the default list)."""
    try:
        if not torch.cuda.is_available():
            return None
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except Exception:  # noqa: BLE001 (a driver problem at build time: build for every default architecture)
        return None
    return ";".join(f"{major}.{minor}" for major, minor in caps) or None


def _extensions():
    if os.environ.get("LLM_ATTN_NO_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("llm_attn: torch is not importable at build time; installing without the CUDA extension "
              "(use `python -m pip install --no-build-isolation` to build it)", file=sys.stderr)
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        if torch.version.cuda is not None:  # a GPU machine without nvcc: fine, but say what happens instead
            print(_banner([f"llm_attn: torch {torch.__version__} is a CUDA build but nvcc was not found "
                           f"(CUDA_HOME={CUDA_HOME}):",
                           "installing without the compiled extension; the kernel will be compiled at first use "
                           "through NVRTC", "(install the `nvrtc` extra), or set CUDA_HOME and reinstall to build "
                           "it now."]), file=sys.stderr)
        else:
            print(f"llm_attn: torch {torch.__version__} has no CUDA; installing without the CUDA extension",
                  file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join("kernels", "*.cu"))) + ["kernels/binding.cpp"]
    archs = os.environ.get("LLM_ATTN_CUDA_ARCHS") or _visible_archs(torch) or DEFAULT_ARCHS
    print(f"llm_attn: building the CUDA extension for compute capabilities {archs} "
          "(LLM_ATTN_CUDA_ARCHS overrides)", file=sys.stderr)
    nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  ] + _gencode_flags(archs)
    ext = CUDAExtension(
        name="llm_attn._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "kernels")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": _loud_build_ext(BuildExtension.with_options(use_ninja=True))}


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPy

setup(
    name="llm-attn",
    version="0.1.0",
    description="A from-scratch FlashAttention CUDA kernel, a patch registry for Hugging Face LLMs, and a "
                "TTFT/decode harness",
    python_requires=">=3.10",
    # Every subpackage of llm_attn/ (impls, harness, models, reporting, ...: a hand-written list once left impls out
    # of regular installs). The patch registry lives in patches/ (design card) but installs as llm_attn.patches, never
    # as a top-level `patches` module; llm_attn/patches, a development symlink to it, is excluded here.
    packages=[*find_packages(include=["llm_attn", "llm_attn.*"], exclude=["llm_attn.patches", "llm_attn.patches.*"]),
              "llm_attn.patches"],
    package_dir={"llm_attn": "llm_attn", "llm_attn.patches": "patches"},
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "accelerate",
        "safetensors",
        "numpy",
        "tabulate",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "dev": ["pytest", "pytest-xdist>=3.5"],
        # The runtime-compiled backend (llm_attn/_nvrtc.py): cuda-python, NVRTC and the CUDA headers of the CUDA
        # major version of your torch. Ranges, not pins: a CUDA torch depends on some of these itself.
        "nvrtc": ["cuda-bindings>=13.0,<14", "cuda-pathfinder>=1.2", "nvidia-cuda-nvrtc>=13.0,<14",
                  "nvidia-cuda-runtime>=13.0,<14"],
        "nvrtc-cu12": ["cuda-bindings>=12.8,<13", "nvidia-cuda-nvrtc-cu12>=12.4,<13",
                       "nvidia-cuda-runtime-cu12>=12.4,<13"],
        # The `numba` attention entry (llm_attn/impls/numba_fa2.py) and the Thunder executor (llm_attn/thunder.py).
        "numba": ["numba-cuda>=0.30.4"],
        "thunder": ["lightning-thunder==0.2.6"],
        # examples/finetune_lora.py (LoRA through the patch) and tests/test_finetune_lora.py. optimum: peft refuses
        # every LoRA layer when gptqmodel (the AWQ backend) is installed without optimum >= 1.24.
        "finetune": ["peft>=0.13", "datasets>=2.20", "optimum>=1.24"],
        # --prompts (llm_attn/harness/prompts.py): prompts from a local json/jsonl/parquet/csv file or a cached
        # dataset; GPU clocks in every row (llm_attn/harness/hostenv.py) read through NVML when it is installed.
        "prompts": ["datasets>=2.14"],
        # NVML (import name pynvml): energy per measurement (llm_attn/harness/energy.py: the GPU's total-energy counter)
        # and the GPU clocks of every row (llm_attn/harness/hostenv.py); both degrade to empty fields without it.
        "nvml": ["nvidia-ml-py"],
    },
    # Installed packages register attention implementations here (llm_attn.registry reads the group), e.g.
    #   [project.entry-points."llm_attn.attention"] mine = "my_pkg.attention:register"
    entry_points={"llm_attn.attention": []},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
