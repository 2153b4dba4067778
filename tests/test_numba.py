"""The ``numba`` entry (llm_attn/impls/numba_fa2.py): the FlashAttention-2 numba-cuda kernel, run on CPU in Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is imported, hence a subprocess) for small shapes,
against a float64 reference with the output poisoned first. The same kernel on a real GPU is tested in
tests/test_impls_gpu.py. Skips when numba-cuda is not installed (``pip install numba-cuda``, the ``numba`` extra).

    pytest tests/test_numba.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cpu_check_here

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None
                                or importlib.util.find_spec("numba.cuda") is None,
                                reason="numba-cuda is not installed (pip install numba-cuda)")

CODE = textwrap.dedent('''
    import json, torch
    from unittest import mock
    from llm_attn import registry
    from llm_attn.reference import attention_naive

    entry = registry.get("numba")
    assert entry.devices == ("cuda", "cpu"), entry.devices   # the simulator makes CPU tensors acceptable
    results = []
    # (b, hq, hkv, sq, sk, d, causal, seqused): MHA/GQA/MQA, odd lengths, several query blocks (> 64 rows),
    # several key tiles (> 32 keys), q_len > kv_len (rows that see no key), q_len < kv_len, seqused_k.
    shapes = [(1, 2, 2, 17, 17, 16, True, None), (1, 4, 2, 70, 70, 8, True, None), (1, 2, 1, 3, 45, 16, True, None),
              (1, 2, 2, 40, 9, 16, True, None), (2, 4, 1, 5, 37, 8, False, None), (2, 2, 1, 6, 50, 8, True, [50, 21])]
    real_empty = torch.empty_like
    poisoned = lambda t, **kw: real_empty(t, **kw).fill_(float("nan"))   # unwritten outputs stay NaN
    for dtype in (torch.float16, torch.bfloat16):
        for b, hq, hkv, sq, sk, d, causal, used in shapes:
            g = torch.Generator().manual_seed(sq * 31 + sk)
            q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
            k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
            v = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
            seq = torch.tensor(used, dtype=torch.int32) if used else None
            with mock.patch("torch.empty_like", poisoned):
                out = entry.run("cpu", q, k, v, causal=causal, scale=d ** -0.5, seqused_k=seq)
            ref, _ = attention_naive(q, k, v, causal=causal, seqused_k=seq)
            results.append({"shape": [b, hq, hkv, sq, sk, d, causal, used], "dtype": str(dtype),
                            "nan": bool(out.isnan().any()), "err": (out.double() - ref).abs().max().item(),
                            "ref_absmax": ref.abs().max().item()})
    print(json.dumps(results))
''')


def test_numba_kernel_in_the_cuda_simulator(request):
    cpu_check_here(request, "the numba kernel in Numba's CUDA simulator (the GPU runs it for real)")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 12
    for r in results:
        assert not r["nan"], r
        tol = 2e-3 if "float16" in r["dtype"] and "bfloat16" not in r["dtype"] else 1.6e-2
        assert r["err"] < tol, r


PTX = textwrap.dedent('''
    import numpy as np
    if hasattr(np, "row_stack"):
        del np.row_stack          # as numpy >= 2.5 (the H100's): llm_attn puts the alias back before compiling
    from numba import cuda, types
    from llm_attn.impls import numba_fa2
    out = {}
    for bf16 in (False, True):
        el = types.int16 if bf16 else types.float16
        arr = types.Array(el, 4, "A")
        sig = (arr, arr, arr, arr, types.Array(types.int32, 1, "A"), types.boolean, types.float64, types.boolean,
               types.int64)
        ptx, _ = cuda.compile_ptx(numba_fa2._kernel(bf16).py_func, sig, cc=(8, 0))
        out["bf16" if bf16 else "fp16"] = (".entry" in ptx, ".shared" in ptx)
    print(out)
''')


_WHY = r"not found|cannot|could not|no such file|unable to load|failure finding|DynamicLibNotFound"
MISSING_LIBRARY = re.compile(rf"(?i)(nvvm|nvrtc)[^\n]*({_WHY})|({_WHY})[^\n]*(nvvm|nvrtc)")


def test_numba_kernel_compiles_for_the_gpu():
    """The real compile path (typing, lowering, NVVM -> PTX for sm_80) without a GPU; needs libnvvm (a CUDA
    toolkit, as CI has for the ptxas check)."""
    toolkit = next((p for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/usr/local/cuda-13.0")
                    if p and Path(p, "bin").exists()), None)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    if toolkit:
        env.setdefault("CUDA_HOME", toolkit)
    proc = subprocess.run([sys.executable, "-c", PTX], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO)
    missing = MISSING_LIBRARY.search(proc.stderr) if proc.returncode != 0 else None
    if missing:
        # numba-cuda compiles through libnvvm, and its bf16 intrinsics through libnvrtc: optional CUDA toolkit
        # libraries (the nvrtc extra / a CUDA toolkit) that the numba extra alone does not install.
        pytest.skip(f"numba-cuda cannot compile for the GPU here, a CUDA library is missing: "
                    f"{proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "{'fp16': (True, True), 'bf16': (True, True)}"
