"""One contract for what the kernel accepts (llm_attn/kernel_contract.py), the same message from every entry point.

The same invalid inputs go to: ``flash_attn_func`` on the reference path, ``flash_attn_func`` on the kernel path
with each build (the AOT extension, the NVRTC launcher: skipped with the reason where that build is not available,
e.g. on a machine without a GPU), the ``llm_attn`` registry entry, and the kernel backends' own ``mha_fwd``
(binding.cpp's TORCH_CHECKs for the extension, ``kernel_contract.launcher_problem`` for NVRTC). Each group must say
the same thing, word for word.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from llm_attn import _ext, kernel_contract
from llm_attn.impls.flash_kernel import variant_problem
from llm_attn.ops import flash_attn_func

ROOT = Path(__file__).resolve().parents[1]


def _qkv(b=1, hq=4, hkv=2, s=8, d=64, dtype=torch.float16, device="cpu"):
    return tuple(torch.randn(b, h, s, d, dtype=dtype, device=device) for h in (hq, hkv, hkv))


# (id, build inputs on a device, expected exception, message): rejected whichever path runs.
COMMON = [
    ("3-D q", lambda dev: (torch.randn(4, 8, 64, device=dev, dtype=torch.float16),) + _qkv(device=dev)[1:],
     ValueError, "q must have 4 dims (batch, heads, seq, head_dim), got shape (4, 8, 64)"),
    ("GQA ratio", lambda dev: _qkv(hq=4, hkv=3, device=dev), ValueError,
     "query heads (4) must be a multiple of key/value heads (3) for GQA/MQA"),
    ("head_dim mismatch", lambda dev: (_qkv(device=dev)[0],) + _qkv(d=128, device=dev)[1:], ValueError,
     "head_dim mismatch: q has 64, k/v have 128"),
    ("dtype mismatch", lambda dev: (_qkv(device=dev)[0],) + _qkv(dtype=torch.bfloat16, device=dev)[1:], TypeError,
     "q, k, v must share a dtype, got torch.float16, torch.bfloat16, torch.bfloat16"),
    ("empty", lambda dev: _qkv(s=0, device=dev), ValueError,
     "q is empty (shape (1, 4, 0, 64)): every dim must be > 0"),
]


def _builds():
    """(build, skip reason or None) for each kernel build."""
    status = _ext.backend_status()
    return [(name, None if status[name] == "available" else f"{name} build not available here: {status[name]}")
            for name in _ext.BACKENDS]


def _call(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


@pytest.mark.parametrize("case", COMMON, ids=[c[0] for c in COMMON])
def test_same_message_from_every_entry_point(case):
    _, make, err, msg = case
    results = {"reference path": _call(lambda: flash_attn_func(*make("cpu"), path="reference")),
               "auto path (CPU)": _call(lambda: flash_attn_func(*make("cpu")))}
    for build, skip in _builds():
        if skip is None and torch.cuda.is_available():
            prev = _ext.set_backend(build)
            try:
                results[f"kernel path, {build}"] = _call(lambda: flash_attn_func(*make("cuda"), path="kernel"))
            finally:
                _ext.set_backend(prev)
    for where, (typ, text) in results.items():
        assert (typ, text) == (err, msg), where


def test_kernel_only_rules_say_the_same_in_ops_and_the_registry_entry():
    """head_dim 96 and float32 are fine for the reference and refused for the kernel: flash_attn_func's kernel path
    and the registry entry's choice (on a CUDA device, kernel built) give the one message of the contract."""
    for dtype, d, msg in ((torch.float16, 96, "the CUDA kernel supports head_dim (64, 128), got 96"),
                          (torch.float32, 64, "the CUDA kernel takes float16 or bfloat16, got torch.float32")):
        assert kernel_contract.kernel_problem(dtype, d) == msg
        assert variant_problem("auto", torch.device("cuda"), dtype, d, kernel_ok=True) == (None, msg)
        q, k, v = _qkv(d=d, dtype=dtype)
        flash_attn_func(q, k, v, path="reference")  # the reference takes it
        if torch.cuda.is_available() and _ext.kernel_available():
            with pytest.raises((TypeError, ValueError), match=re.escape(msg)):
                flash_attn_func(*(t.cuda() for t in (q, k, v)), path="kernel")
    assert variant_problem("auto", torch.device("cuda"), torch.float16, 64, kernel_ok=True) == ("cuda", None)
    assert variant_problem("auto", torch.device("cpu"), torch.float16, 96) == ("reference", None)
    assert variant_problem("reference", torch.device("cpu"), torch.int32, 64)[1] == \
        kernel_contract.reference_problem(torch.int32)


def test_negative_scale_and_grid_limits_come_from_the_contract():
    assert "scale >= 0" in kernel_contract.kernel_problem(torch.float16, 64, scale=-1.0)
    assert "at most 65535 heads" in kernel_contract.kernel_problem(torch.float16, 64, heads=65536)
    assert "causal q_len must be <= 4194240" in kernel_contract.kernel_problem(
        torch.float16, 64, causal=True, q_len=kernel_contract.KERNEL_MAX_CAUSAL_Q_LEN + 1)
    assert kernel_contract.kernel_problem(torch.float16, 64, causal=False,
                                          q_len=kernel_contract.KERNEL_MAX_CAUSAL_Q_LEN + 1) is None


def _binding_messages() -> list[str]:
    """The literal text of binding.cpp's forward checks (CHECK_INPUT(cond, "text", ...)), first literal of each."""
    src = (ROOT / "kernels" / "binding.cpp").read_text()
    return re.findall(r'CHECK_INPUT\([^;]*?,\s*"([^"]+)"', src, flags=re.S)


def test_launcher_messages_are_binding_cpp_words():
    """The NVRTC launcher's checks (kernel_contract.launcher_problem) start with the text binding.cpp's TORCH_CHECKs
    use: every string literal that launcher_problem returns first appears in binding.cpp."""
    binding = _binding_messages()
    assert len(binding) >= 10, binding
    tree = ast.parse((ROOT / "llm_attn" / "kernel_contract.py").read_text())
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("launcher_problem",
                                                                                        "_operand_problem")]
    heads = []
    for fn in fns:
        for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
            v = ret.value
            if isinstance(v, ast.JoinedStr):
                first = next((x.value for x in v.values if isinstance(x, ast.Constant)), "")
            elif isinstance(v, ast.Constant) and isinstance(v.value, str):
                first = v.value
            else:
                continue
            heads.append(first.strip())
    heads = [h for h in heads if len(h) > 3]
    assert len(heads) >= 10, heads
    for h in heads:
        assert any(h in b or b.strip() in h for b in binding), f"{h!r} is not a binding.cpp message"


@pytest.mark.parametrize("build,skip", _builds(), ids=[b for b, _ in _builds()])
def test_kernel_backends_mha_fwd_say_the_same(build, skip):
    """The raw launchers (extension and NVRTC) refuse the same inputs with the same message."""
    if skip or not torch.cuda.is_available():
        pytest.skip(skip or "no CUDA GPU: the kernel backends' mha_fwd cannot be called")
    mod = _ext._load(build)[0]
    q, k, v = _qkv(d=96, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    expected = "llm_attn.mha_fwd: " + kernel_contract.launcher_problem(q, k, v, out, lse, None, 0.125, False)
    with pytest.raises(RuntimeError) as e:
        mod.mha_fwd(q, k, v, out, lse, None, 0.125, False)
    assert str(e.value).splitlines()[0].startswith(expected)
