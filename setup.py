"""Builds the llm_attn package and, when a CUDA build of PyTorch and nvcc are present, its CUDA extension.

    pip install --no-build-isolation -e .        # uses the torch already installed; never pulls a CUDA torch

Environment:
    LLM_ATTN_CUDA_ARCHS   semicolon list of compute capabilities (default "8.0;8.6;8.7;8.9;9.0"), e.g. "8.9" for an
                          RTX 4060 Ti, "8.7" for Jetson Orin, "9.0" for H100. Fewer archs build faster.
    LLM_ATTN_NO_CUDA=1    skip the extension even where it could be built.
    MAX_JOBS              parallel nvcc jobs (torch's ninja build).

Without a CUDA torch (or without nvcc) the install still succeeds, fast, and the package runs on the PyTorch
reference; asking for the kernel then raises an error that says how to build it.
"""

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.6;8.7;8.9;9.0"


def _gencode_flags(archs: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in archs.replace(",", ";").split(";"))):
        num = arch.replace(".", "").removesuffix("a")
        if not num.isdigit():
            raise SystemExit(f"LLM_ATTN_CUDA_ARCHS: bad architecture {arch!r} (expected e.g. 8.9)")
        # Hopper builds the arch-specific sm_90a target: the wgmma/TMA kernel exists only there, and the portable
        # kernels run the same from it on every compute capability 9.0 GPU.
        num = "90a" if num == "90" else num
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return flags


def _extensions():
    if os.environ.get("LLM_ATTN_NO_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("llm_attn: torch is not importable at build time; installing without the CUDA extension "
              "(use `pip install --no-build-isolation` to build it)", file=sys.stderr)
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print(f"llm_attn: torch {torch.__version__} has no CUDA or nvcc was not found (CUDA_HOME={CUDA_HOME}); "
              "installing without the CUDA extension", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join("kernels", "*.cu"))) + ["kernels/binding.cpp"]
    archs = os.environ.get("LLM_ATTN_CUDA_ARCHS", DEFAULT_ARCHS)
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
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="llm-attn",
    version="0.1.0",
    description="A from-scratch FlashAttention CUDA kernel, a patch registry for Hugging Face LLMs, and a "
                "TTFT/decode harness",
    python_requires=">=3.10",
    packages=["llm_attn", "llm_attn.harness", "llm_attn.patches"],
    # The patch registry lives in patches/ (design card) but installs as llm_attn.patches, never as a top-level
    # `patches` module.
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
    extras_require={"dev": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
