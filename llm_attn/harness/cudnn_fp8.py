"""cuDNN's FP8 fused attention, the vendor's FP8 forward, as a reference beside our FP8 kernels (issue 34): timed in
the kernel benchmark (``--impls cudnn-fp8``) and measured against float64 in ``--mode accuracy``, on the same inputs
and in the same run as ours.

PyTorch does not expose cuDNN's FP8 attention; JAX does (``jax._src.cudnn.fused_attention_stablehlo``,
``dot_product_attention(..., use_fp8=True)``: cuDNN frontend's FP8 forward graph, inference). This module runs it on
torch tensors through DLPack, without copies. It needs JAX with its CUDA plugin in the same environment
(``python -m pip install "jax[cuda13]"``); where JAX, its GPU backend or cuDNN's FP8 graph is missing, the row is an
error that says so, and the other implementations go on.

What it computes is cuDNN's FP8 recipe (TransformerEngine's): Q, K and V in e4m3, one scale per tensor
(amax / 448); P in e4m3 scaled by 448; O written in e4m3, its scale from a first call's output (delayed
scaling). Ours differs: per-row Q and per-block K scales, K smoothed by its channel mean, int8 Q K^T by default, and
the output in the input dtype.

Timing: the inputs are quantised once, in PyTorch, and that is not counted (which favours cuDNN against our FP8
calls, whose quantising pre-pass is counted). One sample is a chain of n calls compiled into one XLA program, each
call's query the previous call's output (other values, the same work: no call can be merged, dropped or reordered),
timed by the wall clock around one dispatch and divided by n; n is chosen so that a chain takes ~``CHAIN_MS``, which
keeps the dispatch below ~1 % of a sample. ``single_ms`` keeps the wall time of single calls (dispatch included)
beside it.
"""

from __future__ import annotations

import math
import os
import time

import torch

E4M3_MAX = 448.0
CHAIN_MS = 25.0
MAX_CHAIN = 64
INSTALL = 'python -m pip install "jax[cuda13]"'


class CudnnFp8Unavailable(RuntimeError):
    """JAX, its GPU backend or cuDNN's FP8 attention is missing here (one line, with what to do)."""


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``x`` in e4m3 with one scale for the whole tensor: ``(x * s)`` rounded to e4m3, with s = 448 / amax(|x|) (1
    for an all-zero tensor); returns the e4m3 tensor and the descale 1 / s (x ~= e4m3.float() * descale)."""
    amax = float(x.abs().amax().float())
    if not math.isfinite(amax):
        raise ValueError("cuDNN FP8 attention: the input holds inf or NaN (a per-tensor scale needs a finite amax)")
    s = E4M3_MAX / amax if amax > 0 else 1.0
    return (x.float() * s).to(torch.float8_e4m3fn).contiguous(), 1.0 / s


def _jax():
    """(jax, jnp, the cuDNN attention module) or CudnnFp8Unavailable."""
    # JAX takes 75 % of the GPU's memory at its first use by default; beside PyTorch it must allocate as it goes.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415
    except ImportError as e:
        raise CudnnFp8Unavailable(f"cudnn-fp8 needs JAX with its CUDA plugin ({INSTALL}): {e}") from None
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        raise CudnnFp8Unavailable(f"cudnn-fp8: JAX has no GPU backend here ({INSTALL}): "
                                  f"{str(e).splitlines()[0]}") from None
    if not hasattr(fa, "fp8_params_keys"):
        raise CudnnFp8Unavailable(f"cudnn-fp8: this JAX ({jax.__version__}) has no FP8 cuDNN attention")
    return jax, jnp, fa


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


class CudnnFp8Attention:
    """cuDNN's FP8 attention forward on fixed (q, k, v): (B, H, S, D) torch tensors on a GPU, fp16 or bf16.

    ``attn()`` returns the output dequantised to float32, (B, Hq, Sq, D); ``attn.time_samples(warmup, repeats)`` ms
    per call (module docstring). ``note`` says what ran (e.g. K/V expanded where cuDNN refused GQA)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float | None = None):
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("cudnn-fp8 takes (batch, heads, seq, head_dim) tensors")
        if not q.is_cuda:
            raise CudnnFp8Unavailable("cudnn-fp8 needs a CUDA GPU (cuDNN's FP8 attention through JAX)")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cudnn-fp8 takes fp16 or bf16 inputs, got {q.dtype}")
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        if causal and sq != sk:
            raise ValueError(f"cudnn-fp8: cuDNN's FP8 causal mask is top-left, so causal needs q_len == kv_len "
                             f"(got {sq} and {sk})")
        if hq % hkv:
            raise ValueError(f"cudnn-fp8: query heads ({hq}) must be a multiple of KV heads ({hkv})")
        self.jax, self.jnp, self.fa = _jax()
        self.causal, self.shape = causal, (b, hq, sq, d)
        self.scale = d ** -0.5 if scale is None else float(scale)
        self.note = "cuDNN FP8 via JAX: e4m3 Q/K/V/P/O, per-tensor scales, inputs quantised once (untimed)"
        self._q8, dq = quantize_per_tensor(q)
        self._k8, dk = quantize_per_tensor(k)
        self._v8, dv = quantize_per_tensor(v)
        jnp = self.jnp
        one = lambda x: jnp.full((1, 1, 1, 1), x, jnp.float32)  # noqa: E731
        # Backward-only entries are placeholders: the forward reads the six below.
        self._params = {key: one(1.0) for key in self.fa.fp8_params_keys}
        self._params.update(descale_q=one(dq), descale_k=one(dk), descale_v=one(dv), descale_s=one(1.0 / E4M3_MAX),
                            scale_s=one(E4M3_MAX))
        self._programs = {}
        torch.cuda.synchronize(q.device)  # the quantised inputs are written before JAX reads them
        self._jq, self._jk, self._jv = (self._to_jax(t) for t in (self._q8, self._k8, self._v8))
        # O is at most max|V| (a convex combination of V's rows): a safe first scale; then the first output's amax.
        amax_v = float(v.abs().amax().float())
        self._set_out_scale(E4M3_MAX / amax_v if amax_v > 0 else 1.0)
        try:
            first = self._run(1)
        except Exception as e:  # noqa: BLE001 (cuDNN's graph refuses this shape, e.g. GQA on some versions)
            if hkv == hq:
                raise CudnnFp8Unavailable(f"cudnn-fp8 cannot run this shape: {_first_line(e)}") from None
            rep = hq // hkv
            self._k8, self._v8 = self._k8.repeat_interleave(rep, 1), self._v8.repeat_interleave(rep, 1)
            torch.cuda.synchronize(q.device)
            self._jk, self._jv = self._to_jax(self._k8), self._to_jax(self._v8)
            self._programs.clear()
            first = self._run(1)
            self.note += "; K/V expanded (cuDNN refused GQA)"
        amax_o = float(first.abs().amax())
        if amax_o > 0 and math.isfinite(amax_o):
            self._set_out_scale(E4M3_MAX / amax_o)

    # -- JAX plumbing ------------------------------------------------------------------------------------------------
    def _to_jax(self, t8: torch.Tensor):
        from jax import dlpack  # noqa: PLC0415

        return dlpack.from_dlpack(t8.view(torch.uint8))  # t8 is contiguous and kept alive by self

    def _set_out_scale(self, s: float) -> None:
        self._out_scale = s
        self._params["scale_o"] = self.jnp.full((1, 1, 1, 1), s, self.jnp.float32)

    def _program(self, n: int):
        """The jitted chain of ``n`` calls: uint8 views in, the last call's e4m3 output (as uint8) out."""
        if n not in self._programs:
            jax, jnp, fa = self.jax, self.jnp, self.fa
            mask = fa.MaskType.CAUSAL if self.causal else fa.MaskType.NO_MASK
            e4m3 = jnp.float8_e4m3fn

            def chain(q, k, v, params):
                q, k, v = (jax.lax.bitcast_convert_type(x, e4m3) for x in (q, k, v))
                for _ in range(n):
                    # The next call's query is this call's e4m3 output (same shape and layout): XLA can neither
                    # merge nor drop a call. An optimization barrier around the same query did not stop that: a
                    # chain of n then ran one call (kernels/NOTES.md "cuDNN's FP8 attention as a reference").
                    q, _, _ = fa.dot_product_attention(q, k, v, fp8_params=params, scale=self.scale,
                                                       mask_type=mask, qkv_layout="BNTH", use_fp8=True)
                return jax.lax.bitcast_convert_type(q, jnp.uint8)

            self._programs[n] = jax.jit(chain)
        return self._programs[n]

    def _dispatch(self, n: int):
        return self._program(n)(self._jq, self._jk, self._jv, self._params)

    def _run(self, n: int) -> torch.Tensor:
        out = self._dispatch(n)
        out.block_until_ready()
        o8 = torch.from_dlpack(out).view(torch.float8_e4m3fn)
        return o8.float().mul_(1.0 / self._out_scale)

    # -- what the harness calls --------------------------------------------------------------------------------------
    def __call__(self) -> torch.Tensor:
        return self._run(1)

    def time_samples(self, warmup: int, repeats: int) -> list[float]:
        """Milliseconds per call, one sample per repeat (module docstring: chains of n calls, wall clock)."""
        torch.cuda.synchronize()
        self._dispatch(1).block_until_ready()
        one = []
        for _ in range(3):
            t0 = time.perf_counter()
            self._dispatch(1).block_until_ready()
            one.append((time.perf_counter() - t0) * 1e3)
        n = max(1, min(MAX_CHAIN, math.ceil(CHAIN_MS / max(min(one), 1e-3))))
        self.chain, self.single_ms = n, one
        for _ in range(max(1, warmup)):  # the first dispatch of a chain compiles it
            self._dispatch(n).block_until_ready()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._dispatch(n).block_until_ready()
            samples.append((time.perf_counter() - t0) * 1e3 / n)
        return samples


def cudnn_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """One call of cuDNN's FP8 attention on (q, k, v), the output dequantised to float32 (the accuracy harness's
    ``fn(q, k, v, causal)``)."""
    return CudnnFp8Attention(q, k, v, causal)()
