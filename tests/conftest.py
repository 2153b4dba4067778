import os

import pytest
import torch

# The shape grid of the foundation issue: awkward lengths, q_len != kv_len, MHA / GQA 4:1 / MQA.
LENGTHS = [1, 17, 63, 127, 128, 129, 1000, 2049]
# (q_len, kv_len) pairs where q_len != kv_len: decode rows, a prompt chunk over a cache prefix, and q_len > kv_len
# (causal rows that see no key at all).
UNEQUAL = [(1, 1000), (1, 2049), (17, 1000), (63, 127), (128, 129), (129, 2049), (1000, 17), (127, 63)]
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and a kernel backend (compiled or NVRTC)")


KERNEL_BACKENDS = ("aot", "nvrtc")


@pytest.fixture(params=KERNEL_BACKENDS)
def cuda_ext(request):
    """Run the test on each kernel backend (the compiled extension, the NVRTC one) that is available, with that
    backend selected for flash_attn_func too; return its module. Skip without a GPU. A missing backend skips with
    the reason, unless it is named in LLM_ATTN_REQUIRE_BACKENDS (e.g. "aot,nvrtc": then it fails) or no backend
    at all is available (then it fails: a GPU machine must run the kernel). LLM_ATTN_BACKEND=aot|nvrtc runs one."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn import _ext

    name = request.param
    only = os.environ.get("LLM_ATTN_BACKEND", "").strip().lower()
    if only in KERNEL_BACKENDS and only != name:
        pytest.skip(f"LLM_ATTN_BACKEND={only} selects the other backend")
    status = _ext.backend_status()
    if status[name] != "available":
        required = {b.strip() for b in os.environ.get("LLM_ATTN_REQUIRE_BACKENDS", "").split(",") if b.strip()}
        if name in required or all(v != "available" for v in status.values()):
            pytest.fail(f"CUDA is available but the {name} kernel backend is not: {status[name]} "
                        f"(see README 'Building the kernel')")
        pytest.skip(f"{name} backend not available: {status[name]}")
    prev = _ext.set_backend(name)
    try:
        yield _ext.get_ext()
    finally:
        _ext.set_backend(prev)
