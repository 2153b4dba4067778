"""The host-cost fast paths of llm_attn.flash_attn_func and the patches' runtime (issue 18, item 5) keep every
behaviour: the validation cache never lets bad input through, the dispatcher is skipped only where nothing needs it
(torch.compile, modes and fakes still see the ``llm_attn::flash_fwd`` op; so does autograd, except an eager CUDA call
on the compiled extension, which records its C++ autograd node: tests/test_backward_gpu.py checks both ways), and
the runtime's cached runners survive copying. Host time itself is measured by benchmarks, not here."""

from __future__ import annotations

import copy
import os
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from llm_attn import kernel_contract, ops, registry
from llm_attn.harness.graphs import graph_capture
from llm_attn.ops import flash_attn_func


def _good(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 64, generator=g, dtype=dtype)
    k = torch.randn(2, 2, 7, 64, generator=g, dtype=dtype)
    v = torch.randn(2, 2, 7, 64, generator=g, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = None
    if causal:  # bottom-right aligned
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask).to(q.dtype)


def _bad_variants():
    """(name, args for check_inputs): each one a small change of the good call that the full check rejects."""
    q, k, v = _good()
    good = dict(q=q, k=k, v=v, causal=True, scale=0.125, seqused_k=None, path="auto")
    variants = {
        "causal int": dict(causal=1),
        "scale nan": dict(scale=float("nan")),
        "scale inf": dict(scale=math.inf),
        "scale str": dict(scale="0.125"),
        "path bogus": dict(path="bogus"),
        "path unhashable": dict(path=["auto"]),
        "path kernel on cpu": dict(path="kernel"),
        "seqused int64": dict(seqused_k=torch.full((2,), 7, dtype=torch.int64)),
        "seqused shape": dict(seqused_k=torch.full((3,), 7, dtype=torch.int32)),
        "seqused list": dict(seqused_k=[7, 7]),
        "k heads": dict(k=torch.randn(2, 3, 7, 64), v=torch.randn(2, 3, 7, 64)),
        "v len": dict(v=torch.randn(2, 2, 6, 64)),
        "head_dim": dict(k=torch.randn(2, 2, 7, 32), v=torch.randn(2, 2, 7, 32)),
        "dtype mix": dict(k=k.double()),
        "int dtype": dict(q=q.to(torch.int32), k=k.to(torch.int32), v=v.to(torch.int32)),
        "last dim strided": dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)),
        "3 dims": dict(q=q[0]),
        "empty": dict(q=q[:, :, :0]),
        "not a tensor": dict(q=q.numpy()),
    }
    return good, {name: {**good, **change} for name, change in variants.items()}


def _args(d):
    return d["q"], d["k"], d["v"], d["causal"], d["scale"], d["seqused_k"], d["path"]


def _error_of(fn, *args):
    try:
        fn(*args)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("name", sorted(_bad_variants()[1]))
def test_validation_cache_still_rejects_bad_input_after_a_good_call(name):
    good, bad = _bad_variants()
    kernel_contract._VERDICTS.clear()
    assert kernel_contract.check_inputs(*_args(good)) is False  # CPU: the reference
    assert kernel_contract.check_inputs(*_args(good)) is False  # now from the cache
    assert len(kernel_contract._VERDICTS) == 1
    expected = _error_of(kernel_contract.check_inputs_full, *_args(bad[name]))
    assert expected is not None, f"{name}: the full check accepts it; the test is wrong"
    assert _error_of(kernel_contract.check_inputs, *_args(bad[name])) == expected
    # ... twice: a rejected call is never stored
    assert _error_of(kernel_contract.check_inputs, *_args(bad[name])) == expected
    # and through the public op, the same error
    b = bad[name]
    assert _error_of(lambda: flash_attn_func(b["q"], b["k"], b["v"], causal=b["causal"], scale=b["scale"],
                                             seqused_k=b["seqused_k"], path=b["path"])) == expected


def test_validation_cache_is_bounded_and_keeps_verdicts_right():
    kernel_contract._VERDICTS.clear()
    for n in range(1, kernel_contract._VERDICTS_MAX + 40):
        q = torch.randn(1, 2, n, 64)
        assert kernel_contract.check_inputs(q, q, q, False, None, None, "reference") is False
    assert 0 < len(kernel_contract._VERDICTS) <= kernel_contract._VERDICTS_MAX
    q = torch.randn(1, 2, 3, 64)
    # True vs 1 hash alike: the cache tells them apart by type
    assert kernel_contract.check_inputs(q, q, q, True, None, None, "auto") is False
    with pytest.raises(TypeError, match="causal must be a bool"):
        kernel_contract.check_inputs(q, q, q, 1, None, None, "auto")


class _CountOp:
    """Counts calls of the llm_attn::flash_fwd op made by flash_attn_func (it looks the op up per call)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = ops._flash_fwd

        def spy(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(ops, "_flash_fwd", spy)


@pytest.mark.parametrize("causal", [False, True])
def test_no_grad_eager_call_skips_the_dispatcher_and_matches_the_op(monkeypatch, causal):
    q, k, v = (t.double() for t in _good())
    via_op, lse_op = torch.ops.llm_attn.flash_fwd(q, k, v, None, 0.125, causal, False)
    spy = _CountOp(monkeypatch)
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v, causal=causal, scale=0.125, return_lse=True)
    out2 = flash_attn_func(q, k, v, causal=causal, scale=0.125)  # grad enabled, nothing requires grad
    assert spy.calls == 0
    assert torch.equal(out, via_op) and torch.equal(lse, lse_op) and torch.equal(out2, via_op)
    assert out.transpose(1, 2).is_contiguous()  # the op's layout


def test_inputs_that_require_grad_take_the_op_and_get_gradients(monkeypatch):
    q, k, v = (t.double().requires_grad_() for t in _good())
    spy = _CountOp(monkeypatch)
    out = flash_attn_func(q, k, v, causal=True)
    assert spy.calls == 1 and out.grad_fn is not None
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(_sdpa(qr, kr, vr, True).sum(), (qr, kr, vr))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
    with torch.no_grad():  # no_grad: nothing to record, the direct path
        flash_attn_func(q, k, v, causal=True)
    assert spy.calls == 1


def test_modes_and_fakes_see_the_op(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _good()
    spy = _CountOp(monkeypatch)
    with torch.no_grad():
        with Dispatch():
            flash_attn_func(q, k, v)
        assert any("llm_attn.flash_fwd" in s for s in seen), seen
        class Passthrough(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Passthrough():
            flash_attn_func(q, k, v)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            out = flash_attn_func(fq, fk, fv)
        assert type(out) is not torch.Tensor  # a FakeTensor, made by the op's fake
        assert spy.calls == 3
        assert torch.vmap(lambda a: flash_attn_func(a, k, v))(q.unsqueeze(0)).shape == (1, *q.shape)
        assert spy.calls == 4


def test_compile_fullgraph_traces_the_op():
    q, k, v = _good()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c, causal=True), fullgraph=True,
                                 backend=backend)
        torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, causal=True))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("llm_attn.flash_fwd" in t for t in targets), targets


def test_registry_runner_decides_the_entry_once_and_keeps_errors():
    entry = registry.get("llm_attn")
    q, k, v = _good(torch.float64)
    call = entry.runner("reference")
    torch.testing.assert_close(call(q, k, v, True, 0.125, None),
                               entry.run("reference", q, k, v, causal=True, scale=0.125))
    bad = registry.register_attention("host_test_bad_shape", lambda q, k, v, *, causal, scale, seqused_k=None: q[0],
                                      dtypes=(torch.float64,), devices=("cpu",))
    try:
        with pytest.raises(RuntimeError, match="returned .* expected a tensor of q's shape"):
            bad.run("cpu", q, k, v, causal=False, scale=0.125)
        # 'reference' asked of another entry runs llm_attn's reference
        torch.testing.assert_close(bad.runner("reference")(q, k, v, True, 0.125),
                                   _sdpa(q, k, v, True), rtol=1e-10, atol=1e-10)
    finally:
        registry.unregister_attention("host_test_bad_shape")


def test_runtime_runners_are_cached_and_dropped_when_copied():
    from llm_attn.patches._common import AttentionRuntime, PatchOptions, PatchReport

    rt = AttentionRuntime(PatchOptions(on_unsupported="fallback"), PatchReport(None, "llm_attn", "auto", "fallback"))
    q, k, v = _good(torch.float64)
    out = rt.run("reference", q, k, v, causal=True, scale=None)
    torch.testing.assert_close(out, _sdpa(q, k, v, True).transpose(1, 2), rtol=1e-10, atol=1e-10)
    assert out.is_contiguous() and list(rt._runners) == ["reference"]
    first = rt._runners["reference"]
    rt.run("reference", q, k, v, causal=False, scale=0.125)
    assert rt._runners["reference"] is first
    for clone in (copy.deepcopy(rt), pickle.loads(pickle.dumps(rt))):
        assert clone._runners == {}
        torch.testing.assert_close(clone.run("reference", q, k, v, causal=True, scale=None), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the NVRTC launcher's cache needs one")
def test_nvrtc_launcher_cache_keeps_results_and_errors():
    from llm_attn import _nvrtc

    if _nvrtc.unavailable_reason():
        pytest.skip(_nvrtc.unavailable_reason())
    _nvrtc._PREPARED.clear()
    for _ in range(3):  # same kind, fresh data: the cached plan and params, new pointers
        q = torch.randn(2, 8, 33, 64, device="cuda", dtype=torch.float16)
        k = torch.randn(2, 2, 70, 64, device="cuda", dtype=torch.float16)
        v = torch.randn(2, 2, 70, 64, device="cuda", dtype=torch.float16)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 8, 33), float("nan"), device="cuda")
        _nvrtc.mha_fwd(q, k, v, out, lse, None, 0.125, True)
        ref = _sdpa(q.cpu().double(), k.cpu().double(), v.cpu().double(), True)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-3, atol=2e-3)
    assert len(_nvrtc._PREPARED) == 1
    with pytest.raises(RuntimeError, match="scale must be >= 0"):
        _nvrtc.mha_fwd(q, k, v, out, lse, None, -0.125, True)
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        _nvrtc.mha_fwd(q, k, v, out, lse[:, :, :32], None, 0.125, True)


def _nan_pool(nbytes: int) -> None:
    """Leave NaN bytes where the caching allocator hands out the next blocks of about this size: fresh outputs then
    start poisoned, so a row the kernel skips fails the NaN checks."""
    torch.full((max(nbytes // 4, 1) * 4,), float("nan"), device="cuda")  # freed at once, its bytes stay


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the NVRTC call kinds need one")
@pytest.mark.parametrize("sq,sk,used", [(1, 4100, None), (1, 4100, (4100, 777)), (33, 70, None)])
def test_nvrtc_call_kinds_keep_results_and_errors(sq, sk, used):
    """_nvrtc.mha_fwd_alloc's fast path for a kind seen before (_KINDS): fresh data of the same kind (decode with its
    split workspace and pooled counters, ragged seqused_k, a prefill) gets the float64 answer on poisoned outputs
    every time; another kind (scale, causal, a forced split count, a misaligned view that must be copied) is not
    served by it; bad input still meets the checks and their messages."""
    from llm_attn import _nvrtc

    if _nvrtc.unavailable_reason():
        pytest.skip(_nvrtc.unavailable_reason())
    if not _nvrtc._kinds_enabled:
        pytest.skip("this torch lacks the queries the call kinds need (_cuda_getDevice, _cuda_getCurrentRawStream)")
    b, hq, hkv, d = 2, 8, 2, 64
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")

    def check(q, k, v, causal=True, scale=0.125, seqused_k=seqused):
        _nan_pool(q.numel() * 2)
        out, lse = _nvrtc.mha_fwd_alloc(q, k, v, seqused_k, scale, causal)
        torch.cuda.synchronize()
        assert not out.isnan().any() and not lse.isnan().any()
        for i in range(b):
            n = sk if seqused_k is None else int(seqused_k[i])
            ref = _sdpa(q[i:i + 1].cpu().double() * (scale * math.sqrt(d)), k[i:i + 1, :, :n].cpu().double(),
                        v[i:i + 1, :, :n].cpu().double(), causal)
            torch.testing.assert_close(out[i:i + 1].cpu().double(), ref, rtol=3e-3, atol=3e-3)
        return out

    def data(seed, dtype=torch.float16):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=g),
                *(torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2)))

    _nvrtc._KINDS.clear()
    for seed in range(3):  # the first call is the full path and keeps the kind; the next two take the fast path
        check(*data(seed))
    assert len(_nvrtc._KINDS) == 1
    q, k, v = data(3)
    check(q, k, v, scale=0.1)  # another scale: another kind
    check(q, k, v, causal=False)
    prev = _nvrtc.set_decode_splits(3)
    try:
        check(q, k, v)  # a forced split count: another kind, and the decode runs it
    finally:
        _nvrtc.set_decode_splits(prev)
    assert len(_nvrtc._KINDS) == 4
    # A view one element into its buffer: not 16-byte aligned, copied by the full path, never kept.
    buf = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)
    check(buf[1:].view(q.shape), k, v)
    check(buf[1:].view(q.shape), k, v)
    assert len(_nvrtc._KINDS) == 4
    with pytest.raises(RuntimeError, match="scale must be >= 0"):
        _nvrtc.mha_fwd_alloc(q, k, v, seqused, -0.125, True)
    with pytest.raises(RuntimeError, match="dtype"):  # k of another dtype than q: the launcher's check, not a kind
        _nvrtc.mha_fwd_alloc(q, k.to(torch.bfloat16), v, seqused, 0.125, True)
    prev = _nvrtc.set_call_kinds(False)  # the full path alone gives the same bits
    try:
        full = _nvrtc.mha_fwd_alloc(q, k, v, seqused, 0.125, True)[0]
    finally:
        _nvrtc.set_call_kinds(prev)
    fast = _nvrtc.mha_fwd_alloc(q, k, v, seqused, 0.125, True)[0]
    fast = _nvrtc.mha_fwd_alloc(q, k, v, seqused, 0.125, True)[0]
    assert torch.equal(full, fast)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the NVRTC build's eager buffer needs one")
def test_nvrtc_keyed_kinds_and_the_eager_split_buffer(monkeypatch):
    """flash_attn_func on the NVRTC build: the call kinds built on check_inputs' key (_nvrtc.mha_fwd_alloc_keyed) and
    the split partials in the stream's eager buffer (_nvrtc._eager_workspace) give the float64 answer on poisoned
    outputs for fresh data every call, with a forced split count, and on a second stream (its own buffer); a call being
    captured in a CUDA graph gets no buffer (torch's allocator serves it) and its replays on new data are right; the
    buffer turned off gives the same bits."""
    from llm_attn import _ext, _nvrtc

    if _nvrtc.unavailable_reason():
        pytest.skip(_nvrtc.unavailable_reason())
    if not _nvrtc._kinds_enabled:
        pytest.skip("this torch lacks the queries the call kinds need (_cuda_getDevice, _cuda_getCurrentRawStream)")
    b, hq, hkv, d, sk = 2, 8, 2, 64, 4100
    served = []
    real = _nvrtc._eager_workspace
    monkeypatch.setattr(_nvrtc, "_eager_workspace", lambda *a: served.append(real(*a)) or served[-1])

    def data(seed, dtype=torch.float16):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(b, hq, 1, d, device="cuda", dtype=dtype, generator=g),
                *(torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2)))

    def check(out, q, k, v):
        torch.cuda.synchronize()
        assert not out.isnan().any()
        ref = _sdpa(q.cpu().double() * (0.125 * math.sqrt(d)), k.cpu().double(), v.cpu().double(), False)
        torch.testing.assert_close(out.cpu().double(), ref.double(), rtol=3e-3, atol=3e-3)

    def call(q, k, v):
        _nan_pool(q.numel() * 2)
        return flash_attn_func(q, k, v, causal=True, scale=0.125)

    prev_build = _ext.set_backend("nvrtc")
    try:
        _nvrtc._KINDS.clear()
        for seed in range(3):  # the first call keeps the kind, the next two take it
            q, k, v = data(seed)
            check(call(q, k, v), q, k, v)
        assert [type(key[1]) for key in _nvrtc._KINDS] == [tuple]  # one kind, built on check_inputs' key
        q, k, v = data(9)  # the same kind asked for its lse (the calls above dropped theirs)
        _nan_pool(q.numel() * 2)
        out, lse = flash_attn_func(q, k, v, causal=True, scale=0.125, return_lse=True)
        check(out, q, k, v)
        kk = k.cpu().double().repeat_interleave(hq // hkv, 1)
        ref_lse = torch.logsumexp(q.cpu().double() @ kk.transpose(-1, -2) * 0.125, dim=-1)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-4, atol=1e-4)
        assert served and all(served), "the eager decode calls took the stream's buffer"
        stream = torch.cuda.current_stream().cuda_stream
        small = _nvrtc._eager_ws[(torch.cuda.current_device(), stream)][1]
        prev = _nvrtc.set_decode_splits(128)  # another kind, four times the partials, the same buffer or a larger one
        try:
            q, k, v = data(3)
            check(call(q, k, v), q, k, v)
        finally:
            _nvrtc.set_decode_splits(prev)
        assert _nvrtc._eager_ws[(torch.cuda.current_device(), stream)][1] >= small
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            q, k, v = data(4)
            out = call(q, k, v)
        torch.cuda.current_stream().wait_stream(side)
        check(out, q, k, v)
        assert (torch.cuda.current_device(), side.cuda_stream) in _nvrtc._eager_ws
        # captured: no buffer; replays read the static inputs' new values
        sq_, sk_, sv_ = data(5)
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
            flash_attn_func(sq_, sk_, sv_, causal=True, scale=0.125)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        served.clear()
        with graph_capture(graph):
            gout = flash_attn_func(sq_, sk_, sv_, causal=True, scale=0.125)
        assert served == [None]
        for seed in (6, 7):
            for dst, src in zip((sq_, sk_, sv_), data(seed), strict=True):
                dst.copy_(src)
            gout.fill_(float("nan"))
            graph.replay()
            check(gout, sq_, sk_, sv_)
        q, k, v = data(8)
        fast = call(q, k, v)
        prev = _nvrtc.set_eager_workspace(False)
        try:
            full = call(q, k, v)
        finally:
            _nvrtc.set_eager_workspace(prev)
        torch.cuda.synchronize()
        assert torch.equal(fast, full)
    finally:
        _ext.set_backend(prev_build)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the NVRTC launcher's cache needs one")
def test_nvrtc_backward_cache_keeps_results_and_errors():
    """_nvrtc.mha_bwd's cache of call kinds (_PREPARED_BWD): a kind seen again with fresh data gets the float64
    gradients on NaN-poisoned outputs; bad input is refused with binding.cpp's words whether or not its kind (the
    same shapes) is cached; a forced tile is a new kind."""
    from llm_attn import _nvrtc, _plan

    if _nvrtc.unavailable_reason():
        pytest.skip(_nvrtc.unavailable_reason())
    _nvrtc._PREPARED_BWD.clear()
    b, hq, hkv, sq, sk, d = 2, 8, 2, 33, 70, 64

    def run(tile="auto", seed=0):
        torch.manual_seed(seed)
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16) for _ in range(2))
        dout = torch.randn_like(q)
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, sq, device="cuda")
        _nvrtc.mha_fwd(q, k, v, out, lse, None, 0.125, True)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        prev = _nvrtc.set_bwd_tile(_plan.BWD_TILE_IDS[tile])  # this build's (force_bwd_tile sets get_ext()'s)
        try:
            _nvrtc.mha_bwd(dout, q, k, v, out, lse, None, *grads, None, 0.125, True)
        finally:
            _nvrtc.set_bwd_tile(prev)
        leaves = [t.cpu().double().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(_sdpa(*leaves, True), leaves, dout.cpu().double())
        for g, r in zip(grads, ref, strict=True):
            assert not g.isnan().any()
            torch.testing.assert_close(g.cpu().double(), r, rtol=2e-2, atol=2e-2)
        return dout, q, k, v, out, lse, grads

    for seed in range(3):  # same kind, fresh data: the cached plan and params, new pointers
        dout, q, k, v, out, lse, grads = run(seed=seed)
    assert len(_nvrtc._PREPARED_BWD) == 1
    run("portable", seed=3)
    assert len(_nvrtc._PREPARED_BWD) == 2
    with pytest.raises(RuntimeError, match="^llm_attn.mha_bwd: scale must be finite"):
        _nvrtc.mha_bwd(dout, q, k, v, out, lse, None, *grads, None, float("nan"), True)
    with pytest.raises(RuntimeError, match="^llm_attn.mha_bwd: lse must be a contiguous float32"):
        _nvrtc.mha_bwd(dout, q, k, v, out, lse[:, :, :32], None, *grads, None, 0.125, True)
    with pytest.raises(RuntimeError, match=r"^llm_attn.mha_bwd: dq \[2, 8, 33, 32\] must have shape"):
        _nvrtc.mha_bwd(dout, q, k, v, out, lse, None, grads[0][..., :32], *grads[1:], None, 0.125, True)


def test_profiler_and_jit_trace_see_the_op(monkeypatch):
    q, k, v = _good()
    spy = _CountOp(monkeypatch)
    with torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            flash_attn_func(q, k, v)
        assert spy.calls == 1
        assert any("llm_attn::flash_fwd" in e.name for e in prof.events())
        traced = torch.jit.trace(lambda a, b, c: flash_attn_func(a, b, c), (q, k, v), check_trace=False)
        assert spy.calls == 2
        assert "llm_attn::flash_fwd" in str(traced.graph)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: graph capture of the direct path needs one")
@pytest.mark.parametrize("q_len", [1, 77])  # decode (split-KV workspace, zeroed counters) and prefill
def test_cuda_graph_capture_of_the_direct_path(monkeypatch, q_len):
    from llm_attn._ext import kernel_available

    if not kernel_available():
        pytest.skip("no kernel backend here")
    dev, dt = "cuda", torch.float16
    q = torch.randn(2, 8, q_len, 128, device=dev, dtype=dt)
    k = torch.randn(2, 2, 700, 128, device=dev, dtype=dt)
    v = torch.randn(2, 2, 700, 128, device=dev, dtype=dt)
    spy = _CountOp(monkeypatch)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            flash_attn_func(q, k, v, causal=True)  # warm-up (kernel load) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with graph_capture(g):
            out = flash_attn_func(q, k, v, causal=True)
        assert spy.calls == 0  # the direct path was captured
        for _ in range(2):  # fresh inputs, replayed
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ref = _sdpa(q.cpu().double(), k.cpu().double(), v.cpu().double(), True)
            assert not out.isnan().any()
            torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-3, atol=2e-3)


def test_environ_get_reads_what_os_environ_holds(monkeypatch):
    """llm_attn._environ.get (the per-call reads of LLM_ATTN_BUILD and friends) answers as os.environ.get does, for a
    variable unset, set, set empty and removed again after import."""
    from llm_attn import _environ

    name = "LLM_ATTN_TEST_ENVIRON_GET"
    monkeypatch.delenv(name, raising=False)
    assert _environ.get(name) is None and _environ.get(name, "x") == "x"
    monkeypatch.setenv(name, "nvrtc")
    assert _environ.get(name) == "nvrtc" == os.environ.get(name)
    monkeypatch.setenv(name, "")
    assert _environ.get(name, "x") == ""
    monkeypatch.delenv(name)
    assert _environ.get(name, "y") == "y"
