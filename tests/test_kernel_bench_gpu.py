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


@pytest.mark.parametrize("graph", [False, True])
def test_chunk_over_the_fp8_cache_times_both_paths(cuda_ext, graph):
    """bench --q-len: a 200-query chunk over 1000 keys, ours on the unquantised K/V, the prefill kernel over the FP8
    cache and our kernel on its dequantised copy, all ok and within the cache's rounding of one another; the FLOPs
    are the bottom-right causal count."""
    from llm_attn import ops
    from llm_attn.harness.kernel_bench import bench_point

    if not ops.fp8_kv_prefill_available(cuda_ext):
        pytest.skip("this build has no FP8-cache prefill kernel (fp8kv_prefill)")
    rows = bench_point("prefill", ["ours", "ours-fp8kv", "ours-fp8kv-copy"], 1, 32, 8, 200, 1000, 128,
                       torch.bfloat16, True, 1, 2, graph=graph)
    flops = 4 * 32 * (200 * 800 + 200 * 201 // 2) * 128
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["max_abs_diff_vs_first"] < 0.1 and row["tflops"] == pytest.approx(flops / row["ms"] / 1e9), row
