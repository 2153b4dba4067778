"""CPU tests of the FP8 path: the quantised reference against float64 and against its own definition, the
precision argument's errors, and the ``llm_attn_fp8`` registry entry (the GPU kernel: tests/test_fp8_gpu.py)."""

import pytest
import torch

from llm_attn import attention_naive, flash_attn_func
from llm_attn import quant_reference as qr


def test_e4m3_rounds_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, 447.0, 500.0, -1e6, 2.0 ** -10])
    y = qr.e4m3(x)
    assert y.tolist()[:3] == [0.0, 1.0, 1.0]          # 1.0625 is halfway between 1 and 1.125: to even
    assert y[3] == 1.25 and y[4] == 448.0 and y[5] == 448.0 and y[6] == -448.0
    assert y[7] == 0.0                                  # below half the smallest subnormal (2^-9)


def test_quantize_blocks_and_smoothing():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 130, 64)
    k = torch.randn(1, 1, 300, 64) + 50 * (torch.arange(64) == 5)  # one outlier channel
    v = torch.randn(1, 1, 300, 64)
    qd, kd, vd = qr.quantize_fp8(q, k, v)
    # Smoothing removes the channel mean: the outlier channel is centred, so K's error is that of unit data.
    assert kd[..., 5].mean().abs() < 0.5
    assert ((kd - (k - k.mean(2, keepdim=True))).abs().max()) < 0.25
    # Every block's largest magnitude maps to 448 exactly (its scale is amax / 448).
    blk = q[:, :, :64]
    assert torch.allclose(qd[:, :, :64].abs().amax(dim=(-1, -2)), blk.abs().amax(dim=(-1, -2)))
    assert torch.allclose(vd.abs().amax(dim=2), v.abs().amax(dim=2))


def test_seqused_k_garbage_never_reaches_the_result():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 50, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 200, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 200, 64, dtype=torch.bfloat16)
    used = torch.tensor([200, 77], dtype=torch.int32)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 77:] = float("nan")
    v2[1, :, 77:] = 1e4
    a = qr.attention_fp8(q, k, v, causal=True, seqused_k=used)
    b = qr.attention_fp8(q, k2, v2, causal=True, seqused_k=used)
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_error_is_fp8_sized(causal):
    """FP8 attention's error against float64 on LLM-shaped inputs (outlier K channels): measured, not assumed.
    The bounds are what e4m3 (3 mantissa bits) gives on Gaussian data; a wrong scale is orders of magnitude off."""
    torch.manual_seed(2)
    q = torch.randn(1, 8, 257, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 513, 128, dtype=torch.bfloat16)
    k[..., [3, 40]] += 25
    v = torch.randn(1, 2, 513, 128, dtype=torch.bfloat16)
    ref, _ = attention_naive(q, k, v, causal=causal)
    out = qr.attention_fp8(q, k, v, causal=causal).double()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    rel = ((out - ref).abs().sum() / ref.abs().sum()).item()
    assert cos > 0.997 and rel < 0.07, (cos, rel)
    # e4m3's error is relative to each element, so an outlier channel (25 +- 1) carries a large absolute error;
    # smoothing centres it first. Without it K's error is larger (the reason K is smoothed).
    kd_raw, _ = qr._blockwise(k.float(), qr.K_BLOCK)
    smoothed = qr.quantize_fp8(q, k, v)[1] - (k.float() - k.float().mean(2, keepdim=True))
    assert (kd_raw - k.float()).abs().mean() > 1.2 * smoothed.abs().mean()


def test_precision_argument_errors():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="precision must be one of"):
        flash_attn_func(q, q, q, precision="int4")
    q.requires_grad_()
    out = flash_attn_func(q, q.detach(), q.detach(), precision="fp8")
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


def test_fp8_problem_names_the_gpu(monkeypatch):
    from llm_attn import kernel_contract

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    msg = kernel_contract.quant_problem("fp8", torch.empty(1), use_kernel=True)
    assert "compute capability 9.0" in msg and "sm_89" in msg and "int8" in msg and "\n" not in msg
    assert kernel_contract.quant_problem("int8", torch.empty(1), use_kernel=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "sm_75" in kernel_contract.quant_problem("int8", torch.empty(1), use_kernel=True)


def test_registry_entry_on_cpu_runs_the_reference():
    from llm_attn import registry

    entry = registry.get("llm_attn_fp8")
    assert entry.choose(torch.device("cpu"), torch.bfloat16, 128) == ("reference-fp8", None)
    assert not entry.default
    q = torch.randn(1, 4, 40, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    out = entry.fn(q, k, k, causal=True, scale=0.125, variant="reference-fp8")
    assert torch.equal(out, qr.attention_fp8(q, k, k, causal=True, scale=0.125))


def test_e4m3_entry_is_its_own_name_and_computes_e4m3_qk():
    """llm_attn_fp8_e4m3 runs Q K^T in e4m3 (the reference of that algorithm, not the default's int8 one) and
    reports its own variant, so its rows never pass for llm_attn_fp8's."""
    from llm_attn import registry
    from llm_attn.harness.agreement import low_precision_note

    entry = registry.get("llm_attn_fp8_e4m3")
    assert entry.choose(torch.device("cpu"), torch.bfloat16, 128) == ("reference-fp8-e4m3qk", None)
    assert not entry.default and low_precision_note(entry.info())
    torch.manual_seed(5)
    q = torch.randn(1, 4, 70, 64, dtype=torch.bfloat16) * 3
    k = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    out = entry.fn(q, k, v, causal=True, scale=0.125, variant="reference-fp8-e4m3qk")
    assert torch.equal(out, qr.attention_fp8(q, k, v, causal=True, scale=0.125, qk="e4m3"))
    assert not torch.equal(out, qr.attention_fp8(q, k, v, causal=True, scale=0.125, qk="int8"))


def test_fp8_qk_argument():
    q = torch.randn(1, 2, 20, 64, dtype=torch.bfloat16)
    a = flash_attn_func(q, q, q, precision="fp8", fp8_qk="e4m3")
    assert torch.equal(a, qr.attention_fp8(q, q, q, qk="e4m3"))
    with pytest.raises(ValueError, match="qk must be one of int8, e4m3"):
        flash_attn_func(q, q, q, precision="fp8", fp8_qk="int4")


@pytest.mark.parametrize("causal", [False, True])
def test_lse_includes_the_smoothing_shift(causal):
    """Smoothing K shifts every score of a row by scale q . mean(K): the softmax is unchanged, the lse is not; the
    returned lse adds the shift back, so it is the lse of the unsmoothed scores."""
    torch.manual_seed(3)
    q = torch.randn(1, 4, 70, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 150, 64, dtype=torch.bfloat16) + 3.0
    v = torch.randn(1, 2, 150, 64, dtype=torch.bfloat16)
    _, ref_lse = attention_naive(q, k, v, causal=causal)
    _, lse = qr.attention_fp8(q, k, v, causal=causal, return_lse=True)
    assert (lse.double() - ref_lse.double()).abs().max() < 0.05


def test_k_scales_cover_64_keys():
    """One K scale per 64 keys (kernels/flash_fp8.h kFp8KBlock): a large key in keys 64..127 coarsens only its own
    group's e4m3 grid, not that of keys 0..63 (the kernel's 128- and 192-key tiles apply one scale per 64 columns)."""
    assert qr.K_BLOCK == 64
    torch.manual_seed(4)
    q = torch.randn(1, 1, 8, 64)
    k = torch.randn(1, 1, 200, 64)
    v = torch.randn(1, 1, 200, 64)
    k_big = k.clone()
    k_big[0, 0, 100] *= 1000  # mean(K) moves: compare the smoothed keys' errors, group by group
    for kk in (k, k_big):
        kd = qr.quantize_fp8(q, kk, v)[1]
        err = (kd - (kk - kk.mean(2, keepdim=True))).abs()
        if kk is k:
            base = err[..., :64, :].max()
        else:
            assert err[..., :64, :].max() < 4 * base     # group 0: its own scale, unchanged by key 100
            assert err[..., 64:128, :].max() > 20 * base  # group 1: the large key's scale
    _, scales = qr._blockwise(torch.randn(1, 2, 200, 64), qr.K_BLOCK)
    assert scales.shape == (1, 2, 4)  # ceil(200 / 64) scales per head, as the kernel's workspace holds


def test_fp8_tile_choice_is_checked_and_changes_nothing_on_the_reference():
    """force_fp8_tile takes the tiles the build has (kernels/generate_kernels.py FP8_BLOCK_N, the first the default),
    refuses others in one line and restores the previous choice; the tile is speed only, so the reference path
    (which ignores it) gives the same result under either."""
    from llm_attn import _kernel_table, ops
    from llm_attn.kernel_contract import fp8_tile_problem

    for d, tiles in _kernel_table.FP8_BLOCK_N.items():
        assert 128 in tiles and set(tiles) <= {128, 192}, (d, tiles)
        assert all(fp8_tile_problem(n, d) is None for n in (0, *tiles))
    msg = fp8_tile_problem(256, 128)
    assert "256-key tile" in msg and "128" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="no 256-key tile"):
        with ops.force_fp8_tile(256):
            pass
    assert ops._fp8_block_n == 0
    q = torch.randn(1, 4, 70, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 250, 64, dtype=torch.bfloat16)
    want = flash_attn_func(q, k, k, causal=True, precision="fp8")
    with ops.force_fp8_tile(192):
        assert ops._fp8_block_n == 192
        with ops.force_fp8_tile(128):
            assert ops._fp8_block_n == 128
        assert ops._fp8_block_n == 192
        assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8"), want)
    assert ops._fp8_block_n == 0


def test_fp8_tile_is_an_argument_of_the_op():
    """The tile reaches the custom op as an argument (so a CUDA graph or a compiled graph keeps the one it saw); its
    reference implementation ignores it."""
    from llm_attn import ops

    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 90, 64, dtype=torch.bfloat16)
    out, lse = ops._flash_fwd_quant(q, k, k, None, 0.125, True, False, "fp8", 192)
    ref, ref_lse = qr.attention_fp8(q, k, k, causal=True, scale=0.125, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert "block_n=0" in str(torch.ops.llm_attn.flash_fwd_quant.default._schema)


def test_int8_qk_is_the_default_and_the_more_accurate():
    """The FP8 path's Q K^T in int8 (the default; kernels/NOTES.md "FP8 forward v4") against e4m3, both against
    float64 on peaky queries and outlier K (the input where e4m3's 3 mantissa bits cost most): measured here on the
    reference, which the GPU tests hold the kernel to."""
    torch.manual_seed(3)
    q = 4 * torch.randn(1, 4, 200, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 700, 128, dtype=torch.bfloat16)
    k[..., [7, 70]] += 30
    v = torch.randn(1, 2, 700, 128, dtype=torch.bfloat16)
    ref, _ = attention_naive(q, k, v, causal=True)

    def err(out):
        o = out.double()
        return (torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item(),
                ((o - ref).abs().sum() / ref.abs().sum()).item())

    default = qr.attention_fp8(q, k, v, causal=True)
    assert torch.equal(default, qr.attention_fp8(q, k, v, causal=True, qk="int8"))
    cos8, rel8 = err(default)
    cos_e, rel_e = err(qr.attention_fp8(q, k, v, causal=True, qk="e4m3"))
    assert cos8 >= 0.999 and rel8 < 0.6 * rel_e, (cos8, rel8, cos_e, rel_e)
    # int8 levels: every Q element is an integer multiple of its block's scale amax / 127, the largest exactly 127.
    qd = qr.quantize_fp8(q, k, v)[0][:, :, :64]
    step = q[:, :, :64].float().abs().amax(dim=(-1, -2), keepdim=True) / 127
    levels = qd / step
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.abs().max().round() == 127


def test_fp8_qk_choice_is_checked_and_reaches_the_op():
    from llm_attn import ops

    with pytest.raises(ValueError, match="int8, e4m3"):
        with ops.force_fp8_qk("fp16"):
            pass
    with pytest.raises(ValueError, match="qk must be"):
        qr.attention_fp8(torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), qk="int4")
    assert ops.fp8_qk() == "int8" and ops.fp8_qk("e4m3") == "e4m3"
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    k = 3 * torch.randn(1, 2, 90, 64, dtype=torch.bfloat16)
    want_e = qr.attention_fp8(q, k, k, causal=True, qk="e4m3")
    with ops.force_fp8_qk("e4m3"):
        assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8"), want_e)
    assert ops._fp8_qk_forced == ""
    assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8"), qr.attention_fp8(q, k, k, causal=True))
    out, _ = ops._flash_fwd_quant(q, k, k, None, 0.125, True, False, "fp8", 0, "e4m3")
    assert torch.equal(out, qr.attention_fp8(q, k, k, causal=True, scale=0.125, qk="e4m3"))
    assert "str qk=\"\"" in str(torch.ops.llm_attn.flash_fwd_quant.default._schema)


def test_fp8_qk_environment_default(monkeypatch):
    from llm_attn import ops

    monkeypatch.setenv("LLM_ATTN_FP8_QK", "e4m3")
    assert ops.fp8_qk() == "e4m3" and ops.fp8_qk("int8") == "int8"
    monkeypatch.setenv("LLM_ATTN_FP8_QK", "anything else")
    assert ops.fp8_qk() == "int8"
