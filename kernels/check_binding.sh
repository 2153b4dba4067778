#!/usr/bin/env bash
# Compiles kernels/binding.cpp (the one file that includes torch) with `g++ -fsyntax-only` against the installed
# torch's headers, with the C++ flags setup.py gives it (-O3 -std=c++17, TORCH_EXTENSION_NAME=_C,
# TORCH_API_INCLUDE_EXTENSION_H), so that a C++ change there is checked on a CPU machine instead of first in a
# GPU session. Full semantic analysis (templates instantiated, overloads resolved), no object code. Exits non-zero
# on a compile error; warnings are printed but do not fail.
#   bash kernels/check_binding.sh               # ~30 s on 2 cores
#   PYTHON=/path/to/python CXX=g++ bash kernels/check_binding.sh
# Needs: a Python whose torch imports (CPU or CUDA build: the CPU wheel ships ATen/cuda and c10/cuda headers too),
# a host C++ compiler, and the CUDA headers (cuda_runtime_api.h): $CUDA_HOME/include, else the include dir of the
# toolkit that `nvcc` runs from, else /usr/local/cuda/include.
#
# Torch's ATen/cuda headers also include cusparse.h, cublas_v2.h, cublasLt.h, cusolverDn.h and cusolver_common.h,
# which a bare CUDA toolkit install (and the pip nvidia-cuda-runtime wheel) lack. Where all of them are found (the
# CUDA include dir, or site-packages/nvidia/*/include of the wheels a CUDA torch depends on) the real ones are used.
# Otherwise minimal stubs are generated in a temp dir: the few opaque handle and status typedefs (and
# cusparseGetErrorString) that torch's headers name. Why stubs and not the real headers from PyPI: the only wheels
# that carry them (nvidia-cublas, nvidia-cusparse, nvidia-cusolver) are ~900 MB of libraries together, for ~1 MB of
# headers; binding.cpp uses none of these libraries, so the stubs change nothing it could get wrong (checked: the
# same result with the real CUDA 13 headers). The CPU wheel also lacks torch's generated
# c10/cuda/impl/cuda_cmake_macros.h (it only defines C10_CUDA_BUILD_SHARED_LIBS, which matters on Windows alone):
# -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE skips it where it is missing.
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python}
cxx=${CXX:-g++}
start=$SECONDS

# torch's include dirs (as torch.utils.cpp_extension gives them to an extension), Python's, torch's C++ ABI.
probe=$("$py" - <<'PY'
import os, sys, sysconfig
import torch
from torch.utils.cpp_extension import include_paths
print(torch.__version__)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_path("include", scheme="posix_prefix"))
print(os.pathsep.join(include_paths("cpu")))
# Where CUDA wheels put their headers: nvidia/cu13/include (CUDA 13), nvidia/<lib>/include (CUDA 12).
dirs = []
for sp in sys.path:
    nv = os.path.join(sp, "nvidia")
    if os.path.isdir(nv):
        dirs += [os.path.join(nv, d, "include") for d in sorted(os.listdir(nv))
                 if os.path.isdir(os.path.join(nv, d, "include"))]
print(os.pathsep.join(dirs))
PY
) || { echo "check_binding: '$py' cannot import torch (set PYTHON to a Python with torch installed)"; exit 2; }
mapfile -t info <<<"$probe"
torch_version=${info[0]} abi=${info[1]} py_include=${info[2]}
IFS=: read -r -a torch_includes <<<"${info[3]}"
IFS=: read -r -a wheel_includes <<<"${info[4]:-}"

# The CUDA toolkit's include dir: CUDA_HOME, else where nvcc runs from (it may be a wrapper script, so ask nvcc for
# its TOP), else /usr/local/cuda.
cuda_include=""
if [ -n "${CUDA_HOME:-}" ]; then
  cuda_include=$CUDA_HOME/include
elif command -v nvcc >/dev/null; then
  top=$(nvcc -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  [ -z "$top" ] || cuda_include=$(cd "$top/include" 2>/dev/null && pwd -P) || cuda_include=""
fi
[ -n "$cuda_include" ] || cuda_include=/usr/local/cuda/include
if [ ! -f "$cuda_include/cuda_runtime_api.h" ]; then
  echo "check_binding: no CUDA headers in $cuda_include (set CUDA_HOME)"; exit 2
fi

flags=(-std=c++17 -O3 -fsyntax-only -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
       "-D_GLIBCXX_USE_CXX11_ABI=$abi" -I.)
[ -f "${torch_includes[0]}/c10/cuda/impl/cuda_cmake_macros.h" ] || flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)

# The math-library headers torch's ATen/cuda headers include: all real, or all stubs.
libs=(cusparse.h cublas_v2.h cublasLt.h cusolverDn.h cusolver_common.h)
lib_dirs=()
for h in "${libs[@]}"; do
  found=""
  for d in "$cuda_include" "${wheel_includes[@]}"; do
    if [ -n "$d" ] && [ -f "$d/$h" ]; then found=$d; break; fi
  done
  if [ -z "$found" ]; then lib_dirs=(); break; fi
  case " ${lib_dirs[*]:-} " in *" $found "*) ;; *) lib_dirs+=("$found") ;; esac
done
tmp=""
if [ ${#lib_dirs[@]} -gt 0 ]; then
  headers="real (${lib_dirs[*]})"
  for d in "${lib_dirs[@]}"; do flags+=(-isystem "$d"); done
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  headers="stubs ($(basename "$tmp"))"
  cat >"$tmp/cublas_v2.h" <<'H'
#pragma once
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
typedef struct cublasContext* cublasHandle_t;
H
  cat >"$tmp/cublasLt.h" <<'H'
#pragma once
typedef struct cublasLtContext* cublasLtHandle_t;
H
  cat >"$tmp/cusparse.h" <<'H'
#pragma once
typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;
typedef struct cusparseContext* cusparseHandle_t;
const char* cusparseGetErrorString(cusparseStatus_t status);
H
  cat >"$tmp/cusolver_common.h" <<'H'
#pragma once
typedef enum { CUSOLVER_STATUS_SUCCESS = 0, CUSOLVER_STATUS_INVALID_VALUE = 3 } cusolverStatus_t;
H
  cat >"$tmp/cusolverDn.h" <<'H'
#pragma once
#include "cusolver_common.h"
typedef struct cusolverDnContext* cusolverDnHandle_t;
H
  flags+=(-I "$tmp")  # -I: searched before the -isystem dirs below, so a partial set there is not mixed in
fi
for d in "${torch_includes[@]}"; do flags+=(-isystem "$d"); done
flags+=(-isystem "$py_include" -isystem "$cuda_include")

echo "check_binding: $cxx $($cxx -dumpversion), torch $torch_version, CUDA headers $cuda_include, math-library headers $headers"
if ! "$cxx" "${flags[@]}" binding.cpp; then
  echo "check_binding FAILED: kernels/binding.cpp does not compile ($((SECONDS - start)) s)"
  exit 1
fi
echo "check_binding passed: kernels/binding.cpp compiles (-O3 -std=c++17 -fsyntax-only, $((SECONDS - start)) s)"
