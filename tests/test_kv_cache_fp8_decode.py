"""The decode over the FP8 KV cache on CPU: the kernel's arithmetic (kernels/flash_decode_fp8kv_kernel.cuh) checked
where a CPU can check it, and ``--kv-cache`` end to end.

- the e4m3 -> fp16 bit trick the kernel uses (integer ops only, so sm_80-87 need no FP8 hardware), over all 256 bytes;
- ``kv_cache_reference.decode_attention(rounding="kernel")`` (the kernel's exact semantics, the prefill kernel's too)
  against a plain restatement of them, with ``seqused_k``, causal q_len > 1 and prefill-sized q_len, GQA/MQA;
- which path a prefill-sized call takes (the prefill kernel where the build has it) and the reader's label;
- ``llm_attn.ops.decode_fp8_kv``: its checks (one line each) and the reference path;
- ``python -m llm_attn.ttft --kv-cache fp8``: rows carry the cache dtype and how attention read it.

    pytest tests/test_kv_cache_fp8_decode.py        # the GPU side: tests/test_kv_cache_fp8_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from llm_attn import kv_cache_reference as ref
from llm_attn import ops
from llm_attn.models.kv_cache import Fp8DynamicLayer


def _cache(b, h, n, d, seed=0, outliers=False, capacity=None):
    """An Fp8KV of n tokens (the layer's own quantisation), K with a few biased channels when ``outliers``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=gen)
    if outliers:
        k[..., :4] = k[..., :4] * 10 + torch.tensor([30.0, -50.0, 20.0, 40.0])
    v = torch.randn(b, h, n, d, generator=gen)
    layer = Fp8DynamicLayer()
    layer.update(k, v)
    kv = layer.fp8()
    if capacity:  # unused slots past the length, holding junk (a static cache after a rewind)
        pad = capacity - n
        junk = torch.full((b, h, pad, d), 300.0).to(ref.STORAGE_DTYPE)
        kv = ref.Fp8KV(torch.cat([kv.k_data, junk], 2), torch.cat([kv.k_scale, torch.ones(b, h, 4)], 2), kv.k_shift,
                       torch.cat([kv.v_data, junk], 2), torch.cat([kv.v_scale, torch.ones(b, h, 4)], 2), n)
    return k, v, kv


# -- the kernel's conversion ------------------------------------------------------------------------------------------
def _kernel_bits(byte: int) -> int:
    """e4m3x2_to_half2_scaled on one byte placed at byte 1 of a word (what __byte_perm puts there): the fp16 bits."""
    w = byte << 8
    return ((w >> 1) & 0x3F80) | (w & 0x8000)


def test_the_bit_trick_is_the_e4m3_value_times_2_to_the_minus_8():
    """Every finite e4m3 byte, subnormals and -0 included, becomes exactly its value / 256 in fp16; the two NaN
    bytes become finite numbers (the cache never stores NaN: quantize saturates at +-448)."""
    bits = torch.tensor([_kernel_bits(b) for b in range(256)], dtype=torch.int32).to(torch.int16)  # wraps
    got = bits.view(torch.float16).to(torch.float64)
    want = torch.arange(256, dtype=torch.uint8).view(ref.STORAGE_DTYPE).to(torch.float64) / 256
    finite = ~torch.isnan(want)
    assert int((~finite).sum()) == 2 and torch.isfinite(got).all()
    assert torch.equal(got[finite], want[finite])
    assert _kernel_bits(0x80) == 0x8000  # -0 stays -0


# -- the kernel's semantics (the reference with rounding="kernel") ---------------------------------------------------
def _kernel_semantics(q, kv, causal, scale, used):
    """The decode kernel's arithmetic restated without blocks' online softmax: fp16 Q, scores over the e4m3 values
    times each block's K scale, softmax in float64, P times each block's V scale rounded to fp16. The online
    softmax's running max is the final max here, so P's fp16 rounding falls on other values where a row's max
    moves: the tolerance is fp16's (2^-11), far below the float32 reference's distance would be if a scale or a
    rounding were misplaced (a 2^-8 or a block's scale off: O(1) errors)."""
    b, hq, sq, d = q.shape
    hkv, n = kv.k_data.shape[1], kv.length
    g = hq // hkv
    blocks = torch.arange(n) // 64
    k = kv.k_data[:, :, :n].double() * kv.k_scale[:, :, blocks, None].double()
    vs = kv.v_scale[:, :, blocks].double()
    qf = q.to(torch.float16).double().reshape(b, hkv, g * sq, d)
    s = qf @ k.transpose(-1, -2) * scale
    key = torch.arange(n).view(1, 1, -1)
    row = torch.arange(sq).repeat(g).view(1, -1, 1) + (used - sq).view(-1, 1, 1)
    hidden = (key >= used.view(-1, 1, 1)) | ((key > row) if causal else torch.zeros_like(key, dtype=torch.bool))
    s = s.masked_fill(hidden.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    p16 = (p * vs.unsqueeze(2) * 256).to(torch.float16).double()
    o = p16 @ (kv.v_data[:, :, :n].double() / 256)
    o = torch.where(l > 0, o / l, torch.zeros_like(o))
    return o.reshape(b, hq, sq, d)


@pytest.mark.parametrize("heads,kv_heads,sq,n,causal", [(8, 2, 1, 200, False), (8, 8, 1, 65, False),
                                                       (8, 1, 3, 130, True), (32, 8, 4, 257, True),
                                                       # the prefill kernel's calls: > 32 packed rows
                                                       (8, 2, 45, 200, True), (4, 4, 130, 130, True),
                                                       (8, 1, 77, 300, False)])
def test_reference_with_kernel_rounding_is_the_kernel_semantics(heads, kv_heads, sq, n, causal):
    q = torch.randn(2, heads, sq, 64, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    _, _, kv = _cache(2, kv_heads, n, 64, seed=n, outliers=True, capacity=n + 70)
    used = torch.tensor([n, n - 37], dtype=torch.int32)
    out = ref.decode_attention(q, kv, causal=causal, scale=0.125, seqused_k=used, rounding="kernel")
    want = _kernel_semantics(q, kv, causal, 0.125, used.long())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert (out.double() - want).abs().max() <= 1e-2 * want.abs().max()  # bf16 output rounding
    f32 = ref.decode_attention(q.float(), kv, causal=causal, scale=0.125, seqused_k=used, rounding="kernel")
    assert (f32.double() - want).abs().max() <= 2.0 ** -11 * want.abs().max()


def test_seqused_k_clamps_and_a_row_that_sees_nothing_outputs_zero():
    q = torch.randn(3, 4, 1, 64)
    _, _, kv = _cache(3, 2, 100, 64)
    out, lse = ref.decode_attention(q, kv, causal=False, seqused_k=torch.tensor([0, 150, -5], dtype=torch.int32),
                                    return_lse=True)
    full = ref.decode_attention(q[1:2], ref.Fp8KV(*(t[1:2] for t in (kv.k_data, kv.k_scale, kv.k_shift, kv.v_data,
                                                                      kv.v_scale)), kv.length), causal=False)
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.isinf(lse[0]).all() and torch.isinf(lse[2]).all()
    assert torch.allclose(out[1:2], full, atol=1e-6)


# -- the op -----------------------------------------------------------------------------------------------------------
def test_decode_fp8_kv_reference_path_and_its_lse():
    q = torch.randn(2, 8, 1, 128, dtype=torch.float16)
    k, v, kv = _cache(2, 2, 300, 128, outliers=True)
    out, lse = ops.decode_fp8_kv(q, kv, return_lse=True, path="reference")
    want = ref.decode_attention(q, kv, return_lse=True, rounding="kernel")
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    dk, dv = kv.dequantized(torch.float64)  # the lse is the dequantised scores' (k_shift included)
    s = (q.double().view(2, 2, 4, 128) @ dk.transpose(-1, -2)) / math.sqrt(128)
    assert (lse.double().view(2, 2, 4) - s.logsumexp(-1)).abs().max() < 2e-2


@pytest.mark.parametrize("bad,match", [
    (lambda q, kv: (q[0], kv), "4-D"),
    (lambda q, kv: (q, ref.Fp8KV(kv.k_data.float(), kv.k_scale, kv.k_shift, kv.v_data, kv.v_scale, kv.length)),
     "float8_e4m3fn"),
    (lambda q, kv: (q[:, :3], kv), "multiple of the cache's KV heads"),
    (lambda q, kv: (q[..., :32], kv), "does not match"),
    (lambda q, kv: (q, ref.Fp8KV(kv.k_data, kv.k_scale[:, :, :1], kv.k_shift, kv.v_data, kv.v_scale, kv.length)),
     "k_scale must be float32"),
    (lambda q, kv: (q, ref.Fp8KV(kv.k_data, kv.k_scale, kv.k_shift, kv.v_data, kv.v_scale, 0)), "nothing to attend"),
    (lambda q, kv: (q, "not a cache"), "Fp8KV"),
])
def test_bad_input_is_one_line(bad, match):
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    _, _, kv = _cache(1, 2, 100, 64)
    with pytest.raises(ValueError, match=match) as e:
        ops.decode_fp8_kv(*bad(q, kv), path="reference")
    assert "\n" not in str(e.value)


def test_the_kernel_path_refuses_what_it_cannot_take_in_one_line():
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    _, _, kv = _cache(1, 2, 100, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.decode_fp8_kv(q, kv, path="kernel")
    assert ops.fp8_kv_rows(torch.randn(1, 4, 16, 64), kv) == 32  # 2 query heads per KV head x 16: the most it holds
    with pytest.raises(ValueError, match="path must be"):
        ops.decode_fp8_kv(q, kv, path="cuda")


def test_the_verdict_key_stands_for_what_the_checks_read():
    """decode_fp8_kv keeps its checks' verdict per key for views the cache made (``Fp8KV.trusted``) only: the key
    changes with every property the checks read (the view's length, q's dtype and shape, seqused_k, scale as given,
    causal), and a view built by hand, a subclass or an odd argument type gets none (every check runs). A call on CPU
    with path='kernel' still raises and keeps no verdict."""
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    _, _, kv = _cache(1, 2, 100, 64)
    _, _, longer = _cache(1, 2, 101, 64)
    assert kv.trusted
    key = ops._fp8_kv_verdict_key(q, kv, True, None, None)
    assert key is not None and key == ops._fp8_kv_verdict_key(torch.randn_like(q), kv, True, None, None)
    used = torch.tensor([50], dtype=torch.int32)
    others = [ops._fp8_kv_verdict_key(*a) for a in (
        (q, longer, True, None, None), (q.bfloat16(), kv, True, None, None), (q[:, :2], kv, True, None, None),
        (q, kv, True, 0.125, None), (q, kv, True, 1, None), (q, kv, False, None, None), (q, kv, True, None, used),
        (q, kv, True, None, used.long()), (torch.randn(1, 4, 1, 128, dtype=torch.float16)[..., :64], kv, True, None, None))]
    assert None not in others and len({key, *others}) == 1 + len(others)
    hand = ref.Fp8KV(kv.k_data, kv.k_scale, kv.k_shift, kv.v_data, kv.v_scale, kv.length)
    assert not hand.trusted
    for args in ((q, hand, True, None, None), (q, kv, 1, None, None), (q, kv, True, torch.tensor(0.1), None),
                 (q, kv, True, True, None), (torch.nn.Parameter(q), kv, True, None, None), (q, kv, True, None, [50])):
        assert ops._fp8_kv_verdict_key(*args) is None
    ops._FP8_KV_VERDICTS.clear()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.decode_fp8_kv(q, kv, path="kernel")
    assert not ops._FP8_KV_VERDICTS


class _CudaLikeQuery:
    """What fp8_kv_decode_problem reads of a CUDA query (shape, dtype, device), without a GPU."""

    def __init__(self, shape, dtype=torch.float16):
        self.shape, self.dtype, self.device, self.is_cuda = tuple(shape), dtype, torch.device("cpu"), True

    def dim(self):
        return len(self.shape)


def test_a_prefill_sized_call_needs_a_build_with_the_prefill_kernel():
    """Up to 32 packed rows the decode kernel takes any build's call; above, the prefill kernel's build only (an
    extension built before it: one line saying so, and the caller reads the copy)."""
    _, _, kv = _cache(1, 2, 100, 64)
    decode, prefill = _CudaLikeQuery((1, 4, 16, 64)), _CudaLikeQuery((1, 4, 40, 64))  # 32 and 80 rows
    for has_prefill in (False, True):
        assert ops.fp8_kv_decode_problem(decode, kv, True, prefill=has_prefill) is None
    assert ops.fp8_kv_decode_problem(prefill, kv, True, prefill=True) is None
    why = ops.fp8_kv_decode_problem(prefill, kv, True, prefill=False)
    assert "= 80 > 32" in why and "no FP8-cache prefill kernel" in why and "\n" not in why
    assert ops.fp8_kv_decode_problem(_CudaLikeQuery((1, 4, 101, 64)), kv, True, prefill=True).startswith("101 query")
    assert not ops.fp8_kv_prefill_available(object()) and ops.fp8_kv_prefill_available(
        type("Ext", (), {"mha_decode_fp8kv": None, "fp8kv_prefill": None})())


@pytest.mark.parametrize("has_prefill", [True, False])
def test_the_reader_takes_the_prefill_kernel_for_a_prefill_sized_call(monkeypatch, has_prefill):
    """impls.flash_kernel.fp8_kv_reader on 'cuda': the decode kernel's label up to 32 rows, the prefill kernel's
    above where the build has it (else None: the copy); on 'reference' the blockwise reference for any q_len."""
    from llm_attn.impls import flash_kernel

    calls = []
    monkeypatch.setattr(flash_kernel, "fp8_kv_kernel_available", lambda: True)
    monkeypatch.setattr(flash_kernel, "fp8_kv_prefill_available", lambda: has_prefill)
    monkeypatch.setattr(flash_kernel, "decode_fp8_kv", lambda q, kv, **kw: calls.append((q.shape[2], kw["path"])) or q)
    monkeypatch.setattr(flash_kernel, "fp8_kv_copy_preferred", lambda: False)  # 'auto' on sm_80-89: the kernel
    _, _, kv = _cache(1, 2, 100, 64)
    read = flash_kernel.fp8_kv_reader("llm_attn", "cuda")
    q1, q40 = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 40, 64)
    assert read(q1, kv, True, None, None) == (q1, ref.FP8_READ_KERNEL)
    got = read(q40, kv, True, None, None)
    assert got == ((q40, ref.FP8_READ_PREFILL_KERNEL) if has_prefill else None)
    assert calls == [(1, "kernel")] + ([(40, "kernel")] if has_prefill else [])
    assert flash_kernel.fp8_kv_reader("sdpa", "cuda") is None
    monkeypatch.setenv("LLM_ATTN_FP8KV_PREFILL", "copy")  # the prefill calls read the copy; decode calls do not
    read = flash_kernel.fp8_kv_reader("llm_attn", "cuda")
    assert read(q40, kv, True, None, None) is None and read(q1, kv, True, None, None)[1] == ref.FP8_READ_KERNEL
    monkeypatch.setenv("LLM_ATTN_FP8KV_PREFILL", "40")  # the prefill kernel up to 40 queries, the copy above
    read = flash_kernel.fp8_kv_reader("llm_attn", "cuda")
    got = read(q40, kv, True, None, None)
    assert got == ((q40, ref.FP8_READ_PREFILL_KERNEL) if has_prefill else None)
    assert read(torch.randn(1, 4, 41, 64), kv, True, None, None) is None
    monkeypatch.setattr(flash_kernel, "fp8_kv_copy_preferred", lambda: True)  # 'auto' where the copy is faster
    for choice, prefill_reads in (("auto", None), ("", None), ("kernel", ref.FP8_READ_PREFILL_KERNEL)):
        monkeypatch.setenv("LLM_ATTN_FP8KV_PREFILL", choice)
        read = flash_kernel.fp8_kv_reader("llm_attn", "cuda")
        got = read(q40, kv, True, None, None)
        assert got == ((q40, prefill_reads) if prefill_reads and has_prefill else None), choice
        assert read(q1, kv, True, None, None)[1] == ref.FP8_READ_KERNEL  # decode calls: always the decode kernel
    for bad in ("sometimes", "0", "-3"):
        monkeypatch.setenv("LLM_ATTN_FP8KV_PREFILL", bad)
        with pytest.raises(ValueError, match="'auto', 'kernel', 'copy' or a positive number"):
            flash_kernel.fp8_kv_reader("llm_attn", "cuda")
    monkeypatch.undo()
    out, how = flash_kernel.fp8_kv_reader("llm_attn", "reference")(q40, kv, True, None, None)
    assert how == ref.FP8_READ_REFERENCE and torch.equal(out, ref.decode_attention(q40, kv, causal=True))


# -- --kv-cache end to end on the tiny model ---------------------------------------------------------------------------
def test_kv_cache_flag_rows_carry_the_cache_and_how_it_was_read(tmp_path, capsys):
    from llm_attn import ttft
    from llm_attn.harness.results import iter_rows, point_key, validate_row
    from llm_attn.harness.sweep import row_notes

    out = tmp_path / "rows.jsonl"
    common = ["--device", "cpu", "--model", "tiny", "--impl", "sdpa", "llm_attn", "--seq", "40", "--repeats", "1",
              "--warmup", "0", "--new-tokens", "4", "--decode-repeats", "1", "--no-progress", "--out", str(out),
              "--measure", "ttft", "decode_generate", "decode_graph"]
    assert ttft.main([*common, "--kv-cache", "fp8"]) == 0
    assert ttft.main(common) == 0
    capsys.readouterr()
    rows = list(iter_rows(out, strict=True))
    for r in rows:
        validate_row(r)
    fp8 = [r for r in rows if r.get("kv_cache") == "fp8"]
    assert len(fp8) == 6 and all(r["status"] == "ok" for r in fp8)
    assert all(r["kv_cache"] == "fp16" for r in rows if r not in fp8)
    assert len({point_key(r) for r in rows}) == 12
    notes = {r["impl"] + " " + r["measurement"]: row_notes(r) for r in fp8}
    for m in ("ttft", "decode_generate", "decode_graph"):
        assert "FP8 KV cache (read via a dequantised copy)" in notes[f"sdpa {m}"], notes
    ours = {m: next(r for r in fp8 if r["impl"] == "llm_attn" and r["measurement"] == m) for m in
            ("ttft", "decode_generate", "decode_graph")}
    assert ours["ttft"]["attention_calls"]["kv_cache_reads"] == {ref.FP8_READ_REFERENCE: ours["ttft"][
        "attention_calls"]["impl"]}  # a 40-token prefill: the prefill kernel's call, its reference on CPU
    fp16_graph = next(r for r in rows if r not in fp8 and r["impl"] == "llm_attn" and r["measurement"] == "decode_graph")
    from llm_attn.harness.flops import kv_element_bytes  # the cache's bytes per step: e4m3 + block scales
    want = kv_element_bytes("fp8", 4, 64) / 4  # the tiny model on CPU runs in float32
    got = ours["decode_graph"]["bytes_per_token"]["kv_cache"] / fp16_graph["bytes_per_token"]["kv_cache"]
    assert abs(got - want) < 1e-9 and ours["decode_graph"]["kv_read_gb_s"] > 0, (got, want)
    for m in ("decode_generate", "decode_graph"):
        reads = ours[m]["attention_calls"]["kv_cache_reads"]
        assert reads[ref.FP8_READ_REFERENCE] > 0 and ref.FP8_READ_VIA_COPY not in reads, reads  # prompt too
        assert any("read directly by the blockwise reference" in n for n in notes[f"llm_attn {m}"]), notes


def test_kv_cache_flag_with_tp_is_one_line_and_with_context_runs(tmp_path, capsys):
    """--kv-cache fp8 --context: decode_graph over a cache filled to the context by repeating the prompt's tokens
    (re-quantised); --tp with it is refused in one line."""
    import subprocess
    import sys

    from llm_attn import ttft
    from llm_attn.harness.results import iter_rows

    r = subprocess.run([sys.executable, "-m", "llm_attn.ttft", "--device", "cpu", "--model", "tiny", "--kv-cache",
                        "fp8", "--tp", "2", "--out", str(tmp_path / "x.jsonl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--kv-cache fp8 is not supported with --tp" in r.stderr, r.stderr
    out = tmp_path / "ctx.jsonl"
    assert ttft.main(["--device", "cpu", "--model", "tiny", "--impl", "llm_attn", "--seq", "40", "--context", "300",
                      "--new-tokens", "4", "--decode-repeats", "1", "--warmup", "0", "--no-progress", "--kv-cache",
                      "fp8", "--measure", "decode_graph", "--out", str(out)]) == 0
    capsys.readouterr()
    (row,) = list(iter_rows(out, strict=True))
    assert row["status"] == "ok" and row["kv_cache"] == "fp8" and row["kv_len"] == 300, row
    r = subprocess.run([sys.executable, "-m", "llm_attn.ttft", "--kv-cache", "int4"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr
