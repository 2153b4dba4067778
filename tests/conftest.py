import pytest
import torch

# The shape grid of the foundation issue: awkward lengths, q_len != kv_len, MHA / GQA 4:1 / MQA.
LENGTHS = [1, 17, 63, 127, 128, 129, 1000, 2049]
# (q_len, kv_len) pairs where q_len != kv_len: decode rows, a prompt chunk over a cache prefix, and q_len > kv_len
# (causal rows that see no key at all).
UNEQUAL = [(1, 1000), (1, 2049), (17, 1000), (63, 127), (128, 129), (129, 2049), (1000, 17), (127, 63)]
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled extension")


@pytest.fixture
def cuda_ext():
    """Skip unless a GPU and the compiled extension are present; return the extension module."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn._ext import get_ext, kernel_available

    if not kernel_available():
        pytest.fail("CUDA is available but llm_attn._C is not built (see README 'Building the kernel')")
    return get_ext()
