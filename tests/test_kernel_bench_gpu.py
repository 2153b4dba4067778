"""llm_attn.harness.kernel_bench on a GPU: the backward phase times in CUDA graphs as well as in plain calls, for
our kernel and SDPA alike (a retained forward on the legacy default stream made every backward capture fail).

    pytest tests/test_kernel_bench_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("phase", ["bwd", "fwd+bwd"])
def test_backward_phases_time_with_and_without_graphs(cuda_ext, graph, phase):
    from llm_attn.harness.kernel_bench import bench_point

    if not hasattr(cuda_ext, "mha_bwd"):
        pytest.skip("the NVRTC backend compiles the forward kernels only; the backward is in the compiled extension")
    rows = bench_point("backward", ["ours", "flash"], 1, 8, 2, 256, 256, 128, torch.bfloat16, True, 1, 2,
                       graph=graph, phase=phase)
    for impl, row in rows.items():
        if impl == "flash" and row["status"] == "error" and "No available kernel" in row.get("error", ""):
            continue  # this GPU has no SDPA flash backward
        assert row["status"] == "ok", row
        assert row["ms"] > 0 and row["max_abs_diff_vs_first"] < 0.05, row
