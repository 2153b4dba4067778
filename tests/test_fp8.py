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


@pytest.mark.parametrize("name,variant", [("llm_attn_fp8", "reference-fp8"),
                                          ("llm_attn_fp8_e4m3", "reference-fp8-e4m3qk"),
                                          ("llm_attn_int8qk", "reference-int8qk"), ("llm_attn_int8", "reference-int8")])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_backend_reference_is_the_entrys_own_quantised_reference(name, variant, device):
    """backend='reference' asked of a low-precision entry is its own algorithm in PyTorch (own_reference), on any
    device: not llm_attn's plain reference, which would report 'reference' and compute in full precision."""
    from llm_attn import registry

    entry = registry.get(name)
    assert entry.own_reference
    assert entry.choose(torch.device(device), torch.bfloat16, 128, "reference") == (variant, None)


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
        assert 128 in tiles and set(tiles) <= {128, 192, 256}, (d, tiles)
        assert all(fp8_tile_problem(n, d) is None for n in (0, *tiles))
    msg = fp8_tile_problem(320, 128)
    assert "320-key tile" in msg and "128" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="no 320-key tile"):
        with ops.force_fp8_tile(320):
            pass
    # P V in the input dtype has no 256-key tile (a bf16 P of 256 keys does not fit the registers)
    assert fp8_tile_problem(256, 128) is None
    msg = fp8_tile_problem(256, 128, pv="input")
    assert "fp8_pv='input'" in msg and "256-key tile" in msg and "\n" not in msg
    assert fp8_tile_problem(192, 128, pv="input") is None
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
    # int8 levels: every Q element is an integer multiple of its row's scale amax / 127, each row's largest exactly
    # 127 (one scale per row: kernels/quant_fp8.cuh fp8_quant_q_kernel).
    qd = qr.quantize_fp8(q, k, v)[0]
    step = q.float().abs().amax(dim=-1, keepdim=True) / 127
    levels = qd / step
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert torch.equal(levels.abs().amax(dim=-1).round(), torch.full(q.shape[:3], 127.0))


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


# -- P V in the input dtype (fp8_pv='input', the llm_attn_int8qk entry) ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_pv_input_is_the_accurate_one(dtype, causal, monkeypatch):
    """With P in the input dtype and V unquantised, e4m3's rounding of P and V (the larger part of the FP8 error) is
    gone: what is left is the int8 Q K^T's (~1.3 % relative L1 on Gaussian inputs with outlier K, against ~3.8 % with
    e4m3 P V). Quantising V or P to e4m3 again puts it back above both bounds."""
    torch.manual_seed(2)
    q = torch.randn(1, 8, 257, 128, dtype=dtype)
    k = torch.randn(1, 2, 513, 128, dtype=dtype)
    k[..., [3, 40]] += 25
    v = torch.randn(1, 2, 513, 128, dtype=dtype)
    ref, ref_lse = attention_naive(q, k, v, causal=causal)

    def err(out):
        o = out.double()
        return (torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item(),
                ((o - ref).abs().sum() / ref.abs().sum()).item())

    out, lse = qr.attention_fp8(q, k, v, causal=causal, return_lse=True, pv="input")
    cos, rel = err(out)
    _, rel_e = err(qr.attention_fp8(q, k, v, causal=causal))
    assert cos > 0.9998 and rel < 0.02 and rel < 0.5 * rel_e, (cos, rel, rel_e)
    # The lse does not depend on P V's operands, only on Q K^T's: with K's blocks the same (pv="input" takes 32-key
    # K scales), the e4m3 P V's lse is the same.
    assert not torch.equal(lse, qr.attention_fp8(q, k, v, causal=causal, return_lse=True)[1])
    monkeypatch.setattr(qr, "K_BLOCK", qr.K_BLOCK_PV_INPUT)
    assert torch.equal(lse, qr.attention_fp8(q, k, v, causal=causal, return_lse=True)[1])


def _predict_pv_input(q, k, v, scale, round_to):
    """float64 attention over the operands quantize_fp8 returns, P' = 256 P rounded to ``round_to`` (None: not)."""
    qd, kd, vd = qr.quantize_fp8(q, k, v, pv="input")
    s = (qd.double() @ kd.double().transpose(-1, -2)) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p256 = p * qr.P_SCALE if round_to is None else (p * qr.P_SCALE).to(round_to).double()
    return (p256 @ vd.double()) / (qr.P_SCALE * p.sum(-1, keepdim=True))


def test_pv_input_rounds_p_to_the_input_dtype():
    """P' = 256 P is rounded to q's dtype (the operand of the kernel's bf16/fp16 wgmma), and not at all for float32
    inputs: the output is that prediction rounded to the dtype, element for element but for float64-vs-float32 ties,
    and the predictions with P rounded otherwise miss a quarter of the elements or more."""
    torch.manual_seed(6)
    q32 = torch.randn(1, 1, 64, 64) * 3
    k32 = torch.randn(1, 1, 256, 64)
    v32 = torch.randn(1, 1, 256, 64)
    for dtype, other in ((torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        out = qr.attention_fp8(q, k, v, scale=0.125, pv="input")

        def agree(round_to):
            return (out == _predict_pv_input(q, k, v, 0.125, round_to).to(dtype)).float().mean().item()

        assert agree(dtype) > 0.98 and agree(None) < 0.9 and agree(other) < 0.9, (dtype, agree(dtype), agree(None))
    q, k, v = (t.to(torch.bfloat16).float() for t in (q32, k32, v32))  # float32: P' unrounded
    out = qr.attention_fp8(q, k, v, scale=0.125, pv="input").double()
    assert (out - _predict_pv_input(q, k, v, 0.125, None)).abs().max() < 2e-5
    assert (out - _predict_pv_input(q, k, v, 0.125, torch.float16)).abs().max() > 1e-4


def test_pv_input_keeps_v_unquantised_and_garbage_out():
    """V is the caller's (no e4m3, no scale), keys past seqused_k zeroed: NaN there reaches no output (0 * NaN is NaN,
    so the reference must zero V, not only P, as the kernel zeroes those rows of its V tile)."""
    torch.manual_seed(7)
    q = torch.randn(2, 4, 50, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 200, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 200, 64, dtype=torch.bfloat16)
    used = torch.tensor([200, 77], dtype=torch.int32)
    vd = qr.quantize_fp8(q, k, v, seqused_k=used, pv="input")[2]
    assert torch.equal(vd[0], v[0].float()) and torch.equal(vd[1, :, :77], v[1, :, :77].float())
    assert not vd[1, :, 77:].any()
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 77:] = float("nan")
    v2[1, :, 77:] = float("nan")
    for causal in (False, True):
        a = qr.attention_fp8(q, k, v, causal=causal, seqused_k=used, pv="input")
        b = qr.attention_fp8(q, k2, v2, causal=causal, seqused_k=used, pv="input")
        assert not b.isnan().any() and torch.equal(a, b)


def test_pv_argument_errors():
    """The choices are checked before anything runs, in one line each; other precisions ignore fp8_pv (as fp8_qk)."""
    from llm_attn import ops

    q = torch.randn(1, 2, 20, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pv must be one of e4m3, input"):
        qr.attention_fp8(q, q, q, pv="bf16")
    with pytest.raises(ValueError, match="pv must be one of e4m3, input"):
        flash_attn_func(q, q, q, precision="fp8", fp8_pv="bf16")
    with pytest.raises(ValueError, match=r"int8 Q K\^T only.*not fp8_qk='e4m3'"):
        flash_attn_func(q, q, q, precision="fp8", fp8_qk="e4m3", fp8_pv="input")
    for block_n in (192, 128):  # both tiles run P V in the input dtype (the kernel has both): neither is refused
        with ops.force_fp8_tile(block_n):
            assert flash_attn_func(q, q, q, precision="fp8", fp8_pv="input").isfinite().all()
    assert torch.equal(flash_attn_func(q, q, q, precision="fp8", fp8_pv="e4m3"),
                       flash_attn_func(q, q, q, precision="fp8"))
    assert torch.equal(flash_attn_func(q, q, q, precision="int8", fp8_pv="bf16"),
                       flash_attn_func(q, q, q, precision="int8"))
    assert ops.fp8_pv() == "e4m3" and ops.fp8_pv("input") == "input"


def test_pv_input_runs_int8_qk_whatever_is_forced(monkeypatch):
    """fp8_pv='input' with fp8_qk '' is int8 Q K^T, not what force_fp8_qk or LLM_ATTN_FP8_QK choose for e4m3 P V
    (the kernel has no e4m3 Q K^T with it); the op carries pv as an argument like qk and the tile."""
    from llm_attn import ops

    torch.manual_seed(8)
    q = 3 * torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 90, 64, dtype=torch.bfloat16)
    want = qr.attention_fp8(q, k, k, causal=True, qk="int8", pv="input")
    assert not torch.equal(want, qr.attention_fp8(q, k, k, causal=True, qk="e4m3", pv="input"))
    assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_pv="input"), want)
    with ops.force_fp8_qk("e4m3"):
        assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_pv="input"), want)
    monkeypatch.setenv("LLM_ATTN_FP8_QK", "e4m3")
    assert torch.equal(flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_pv="input"), want)
    out, _ = ops._flash_fwd_quant(q, k, k, None, 0.125, True, False, "fp8", 0, "", "input")
    assert torch.equal(out, qr.attention_fp8(q, k, k, causal=True, scale=0.125, qk="int8", pv="input"))
    assert "str pv=\"\"" in str(torch.ops.llm_attn.flash_fwd_quant.default._schema)


class _Ext:
    """A kernel build's FP8 entry point as far as ops sees it: records what it was called with."""

    def __init__(self, with_pv):
        self.calls = []
        if with_pv:
            def mha_fwd_fp8(q, k, v, seqused_k, scale, causal, block_n=0, qk="", pv=""):
                self.calls.append({"block_n": block_n, "qk": qk, "pv": pv})
                return q, q
        else:
            def mha_fwd_fp8(q, k, v, seqused_k, scale, causal, block_n=0, qk=""):
                self.calls.append({"block_n": block_n, "qk": qk})
                return q, q
        self.mha_fwd_fp8 = mha_fwd_fp8


class _Pybind:
    """A pybind11 function as inspect sees it: no signature it can read (inspect.signature raises), the signature in
    its docstring."""

    __signature__ = "unreadable"

    def __init__(self, doc):
        self.__doc__ = doc

    def __call__(self, *args, **kwargs):
        raise AssertionError("not called")


def test_pv_reaches_the_kernel_only_when_set():
    """The binding gets pv only for P V in the input dtype, so a build from before it still runs e4m3 P V; asked for
    'input', such a build is refused by name rather than with a TypeError. The extension's signature is found in
    its docstring (pybind11), the NVRTC build's in the function."""
    import types

    from llm_attn import ops
    from llm_attn._ext import KernelNotBuiltError

    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    new, old = _Ext(True), _Ext(False)
    for ext in (new, old):
        ops._quant_kernel_impl(q, q, q, None, 0.125, True, "fp8", ext)
        ops._quant_kernel_impl(q, q, q, None, 0.125, True, "fp8", ext, 192, "e4m3")
    assert new.calls == [{"block_n": 0, "qk": "", "pv": ""}, {"block_n": 192, "qk": "e4m3", "pv": ""}]
    assert old.calls == [{"block_n": 0, "qk": ""}, {"block_n": 192, "qk": "e4m3"}]
    ops._quant_kernel_impl(q, q, q, None, 0.125, True, "fp8", new, 0, "int8", "input")
    assert new.calls[-1] == {"block_n": 0, "qk": "int8", "pv": "input"}
    with pytest.raises(KernelNotBuiltError, match="no pv argument"):
        ops._quant_kernel_impl(q, q, q, None, 0.125, True, "fp8", old, 0, "int8", "input")
    assert ops.fp8_pv_available(new) and not ops.fp8_pv_available(old) and not ops.fp8_pv_available(object())
    aot = "mha_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Optional[torch.Tensor], " \
          "scale: float, causal: bool, block_n: int = 0, qk: str = ''{}) -> tuple[torch.Tensor, torch.Tensor]\n"
    assert ops.fp8_pv_available(types.SimpleNamespace(mha_fwd_fp8=_Pybind(aot.format(", pv: str = ''"))))
    assert not ops.fp8_pv_available(types.SimpleNamespace(mha_fwd_fp8=_Pybind(aot.format(""))))
    assert not ops.fp8_pv_available(types.SimpleNamespace(mha_fwd_fp8=torch._C._jit_pass_dce))  # a real one


def test_int8qk_entry_is_its_own_name_and_computes_pv_input():
    """llm_attn_int8qk runs int8 Q K^T with P V in the input dtype (that reference, not llm_attn_fp8's) and reports
    its own variant, so its rows never pass for the e4m3 entries'."""
    from llm_attn import registry
    from llm_attn.harness.agreement import low_precision_note

    entry = registry.get("llm_attn_int8qk")
    assert entry.choose(torch.device("cpu"), torch.bfloat16, 128) == ("reference-int8qk", None)
    assert not entry.default and low_precision_note(entry.info())
    assert "int8 Q K^T" in entry.description and "input dtype" in entry.description
    torch.manual_seed(9)
    q = torch.randn(1, 4, 70, 64, dtype=torch.bfloat16) * 3
    k = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    out = entry.fn(q, k, v, causal=True, scale=0.125, variant="reference-int8qk")
    assert torch.equal(out, qr.attention_fp8(q, k, v, causal=True, scale=0.125, qk="int8", pv="input"))
    assert not torch.equal(out, qr.attention_fp8(q, k, v, causal=True, scale=0.125))
