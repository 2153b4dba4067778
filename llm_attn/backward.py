"""Autograd for ``llm_attn::flash_fwd``: the backward custom op ``llm_attn::flash_bwd`` and its registration.

The forward op returns (out, lse). Its autograd saves only q, k, v, out and lse (plus the int32 ``seqused_k`` when
given) and calls ``llm_attn::flash_bwd``, which recomputes the attention probabilities from lse:

- CUDA with ``use_kernel``: the FlashAttention-2 backward kernels (kernels/flash_bwd_*.cu; on compute capability 9.0
  the Hopper one), dK/dV summed over each KV head's query heads in the kernel (K/V never expanded), dQ accumulated in
  float32, from whichever build runs the forward (the extension's ``mha_bwd``, or the NVRTC build's, which compiles
  the same sources at first use and launches them with the same plan: ``llm_attn._plan.bwd_plan``);
- anywhere else: ``llm_attn.reference.attention_backward`` (float32 math, float64 for float64 inputs), so the
  reference path stays differentiable on CPU.

Deterministic (``flash_attn_func(deterministic=True)``, or ``torch.use_deterministic_algorithms(True)`` when the
backward runs: what a patched model gets): the kernels' same bits on every run (FlashBwdParams::deterministic in
kernels/flash.h: dQ by the separate dQ kernel, a split launch's dK/dV partials in per-split slabs summed in order;
on compute capability 9.0 the portable kernel instead of the Hopper one). The reference path is deterministic
anyway.

Both ops have fake implementations, so ``torch.compile`` traces forward and backward without graph breaks.
``llm_attn.ops`` imports it and calls ``register_autograd`` on its forward op.

An eager call with gradients does not go through the op: ``llm_attn.ops.flash_attn_func`` records one node of its
own, the extension's C++ autograd function on the compiled extension (``mha_fwd_autograd``, kernels/binding.cpp
``FlashAttnFunction``: the same kernels, saved tensors and deterministic rule, no Python in the backward), and
``FlashAttnEager`` below on the NVRTC build (this module's forward and backward without the op's dispatch). The op's
autograd serves ``torch.compile``, modes, subclasses, the profiler and ``cpp_autograd(False)``.
"""

from __future__ import annotations

import contextlib
import os

import torch

from llm_attn import _plan, reference
from llm_attn._ext import get_ext, kernel_build
from llm_attn.kernel_contract import aligned16 as _aligned16


def direct_call_allowed(*tensors: torch.Tensor) -> bool:
    """Whether an eager call may skip the dispatcher of our custom ops (``llm_attn::flash_fwd``, its backward
    ``llm_attn::flash_bwd``) and run their CUDA implementation directly, saving the op's round trip through the
    dispatcher: ``eager_call_allowed`` and no gradient wanted. The caller has checked that nothing is being compiled."""
    if _grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return False
    return eager_call_allowed(*tensors)


def eager_call_allowed(*tensors: torch.Tensor) -> bool:
    """Whether nothing needs to see our custom ops: plain tensors (no fake, functional or other subclass), no
    torch-function or dispatch mode, no functorch transform (vmap, grad), no profiler (whose trace names the op), no
    torch.jit.trace. Gradients may be wanted (the extension's C++ autograd function then records the graph:
    ``llm_attn.ops``). The caller has checked that nothing is being compiled."""
    for t in tensors:
        if type(t) is not _Tensor:
            return False
    return not (_torch_function_mode_enabled() or _dispatch_stack_len() or _functorch_active()
                or _profiler_enabled() or _jit_tracing())


_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_torch_function_mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)
_profiler_enabled = torch.autograd._profiler_enabled
# torch.jit.trace records ops through the dispatcher. torch.jit.is_tracing's own test (is_scripting) is False here:
# this module is never scripted.
_jit_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)


def _kernel_ready(t: torch.Tensor) -> bool:
    """The layout the kernels read and write: contiguous head_dim, 16-byte aligned rows and base."""
    return t.stride(-1) == 1 and _aligned16(t)


def _reference_bwd(dout, q, k, v, out, lse, dlse, seqused_k, scale, causal):
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                              seqused_k=seqused_k, dlse=dlse)
    # Outputs laid out like the inputs (as the kernel path and the fake implementation do).
    return (torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv))


@torch.library.custom_op("llm_attn::flash_bwd", mutates_args=())
def _flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, dlse: torch.Tensor | None, seqused_k: torch.Tensor | None, scale: float,
               causal: bool, use_kernel: bool, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    # Default implementation (any device): the PyTorch reference backward.
    return _reference_bwd(dout, q, k, v, out, lse, dlse, seqused_k, scale, causal)


@_flash_bwd.register_kernel("cuda")
def _flash_bwd_cuda(dout, q, k, v, out, lse, dlse, seqused_k, scale, causal, use_kernel, deterministic=False):
    if not use_kernel:
        return _reference_bwd(dout, q, k, v, out, lse, dlse, seqused_k, scale, causal)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    # Inputs the kernel cannot read in place (e.g. an expanded gradient with stride 0) are copied once; so are
    # gradient buffers whose layout (that of an oddly strided input) it cannot write.
    dout, q, k, v, out = (t if _kernel_ready(t) else t.clone(memory_format=torch.contiguous_format)
                          for t in (dout, q, k, v, out))
    work = [t if _kernel_ready(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in grads]
    dlse = None if dlse is None else dlse.float().contiguous()
    ext = get_ext()
    if not hasattr(ext, "mha_bwd"):  # an extension built before the backward existed
        raise NotImplementedError(
            f"this {kernel_build()} build has no backward kernel: rebuild it (README, 'Building the kernel') or use "
            "path='reference'.")
    # deterministic only when asked: an extension built before it existed still runs the default backward.
    ext.mha_bwd(dout, q, k, v, out, lse.contiguous(), dlse, work[0], work[1], work[2], seqused_k, float(scale),
                bool(causal), *((True,) if deterministic else ()))
    for g, w in zip(grads, work):
        if g is not w:
            g.copy_(w)
    return grads


@_flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, dlse, seqused_k, scale, causal, use_kernel, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, seqused_k, scale, causal, use_kernel, *rest = inputs
    out, lse = output
    # An lse nobody differentiates stays None in the backward, not a tensor of zeros (one allocation, one fill kernel
    # and a pass over it in the kernel saved per call); an unused out gets its zeros in _backward.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, seqused_k)
    ctx.scale, ctx.causal, ctx.use_kernel = scale, causal, use_kernel
    ctx.deterministic = bool(rest[0]) if rest else False  # the forward op's deterministic argument


# LLM_ATTN_BWD_DETERMINISTIC=1: every backward deterministic, as if flash_attn_func(deterministic=True) (kernel A/B
# runs of one build compare the two: experiments/kernel_ab.py --phase bwd --variant det:LLM_ATTN_BWD_DETERMINISTIC=1).
_DETERMINISTIC_ENV = os.environ.get("LLM_ATTN_BWD_DETERMINISTIC", "") == "1"


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, seqused_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    deterministic = ctx.deterministic or _DETERMINISTIC_ENV or torch.are_deterministic_algorithms_enabled()
    args = (grad_out, q, k, v, out, lse, grad_lse, seqused_k, ctx.scale, ctx.causal, ctx.use_kernel, deterministic)
    if (ctx.use_kernel and q.is_cuda and not torch.compiler.is_compiling()
            and direct_call_allowed(grad_out, q, k, v, out, lse)
            and (grad_lse is None or type(grad_lse) is _Tensor)):
        dq, dk, dv = _flash_bwd_cuda(*args)  # eager: the op's CUDA implementation without the dispatcher
    else:
        dq, dk, dv = _flash_bwd(*args)
    return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)


class FlashAttnEager(torch.autograd.Function):
    """An eager call with gradients wanted on a build without the extension's C++ autograd function (the NVRTC
    build): the op's forward implementation and autograd (``_setup_context``, ``_backward``: the same kernels, saved
    tensors and deterministic rule) recorded as one Python node, without the custom op's Python dispatch on the way
    in (the dispatcher, ``autograd_impl``, the redispatch and ``backend_impl``'s checks: ~300 us of an NVRTC
    forward's ~415 us on an H200, kernels/NOTES.md "The NVRTC build's eager training calls"). ``llm_attn.ops``
    records it where the eager call would take the op; modes, subclasses and torch.compile keep the op."""

    @staticmethod
    def forward(ctx, q, k, v, seqused_k, scale, causal, deterministic, ext):
        out, lse = ext.mha_fwd_alloc(q, k, v, seqused_k, scale, causal)
        _setup_context(ctx, (q, k, v, seqused_k, scale, causal, True, deterministic), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        # As the C++ function: the kernels' gradients are not differentiable themselves; say so rather than return
        # gradients that a second backward would treat as constants.
        if torch.is_grad_enabled():
            raise RuntimeError("llm_attn: the attention backward ran with create_graph=True, but it is not "
                               "differentiable (no double backward); call backward without create_graph")
        return _backward(ctx, grad_out, grad_lse)


def register_autograd(flash_fwd) -> None:
    """Make the forward op ``flash_fwd`` (``llm_attn.ops._flash_fwd``) differentiable; ``llm_attn.ops`` calls this
    once it has defined the op (this module does not import ``llm_attn.ops``: imports go one way)."""
    torch.library.register_autograd(flash_fwd, _backward, setup_context=_setup_context)


@contextlib.contextmanager
def force_bwd_splits(splits: int):
    """Force how many thread blocks share each key block of the backward kernel inside the block (tests,
    benchmarks): 1 = one block per key block writing dK/dV directly, n > 1 = float32 atomics of n partials,
    0 = automatic (the default: split when the grid has under ~4 waves of key blocks). Process-wide."""
    if not isinstance(splits, int) or splits < 0:
        raise ValueError(f"splits must be an int >= 0, got {splits!r}")
    ext = get_ext()
    prev = ext.set_bwd_splits(splits)
    try:
        yield
    finally:
        ext.set_bwd_splits(prev)


# force_bwd_tile's names, by their BwdTileId (kernels/flash.h).
BWD_TILES = _plan.BWD_TILE_IDS


@contextlib.contextmanager
def force_bwd_tile(tile: str):
    """Force the backward's dK/dV kernel (tests, benchmarks), process-wide:

    - 'auto' (the default) chooses by the device: the Hopper kernel (wgmma/TMA) on compute capability 9.0; else at
      head_dim 128 the two-dimensional portable kernel where its 161 KB of shared memory fit a block (sm_80, sm_87),
      otherwise the portable one with the tile the device's shared memory allows (sm_86, sm_89, head_dim 64);
    - 'portable' the portable kernel (mma.sync) with that tile, also on a Hopper GPU, dQ by float32 atomics;
      'portable_separate_dq' with dQ by a separate kernel instead, without atomics;
    - 'portable_2d' the portable kernel with two-dimensional warp tiles (kernels/flash_bwd_2d_kernel.cuh), also at
      head_dim 64 and on a Hopper GPU; where its shared memory does not fit a block, the tile 'portable' would take;
    - 'narrow' the portable kernel's narrow tile (head_dim 128: 4 warps x 64 keys, as on sm_86/89) on any device;
    - 'hopper' the Hopper kernel (compute capability 9.0 and a build with sm_90a code only: the extension built
      for 9.0, or NVRTC 12.0 or newer; ValueError elsewhere),
      'hopper_own_dq' / 'hopper_shared_dq' with its dQ way forced (each warpgroup over its own keys, or one
      warpgroup a step over the block's; 'hopper' takes the shared way, measured the faster on the H100; at head_dim
      64, 128 query rows a step, each warpgroup computes the dQ of its half of the rows whichever is forced).
    """
    if tile not in BWD_TILES:
        raise ValueError(f"tile must be one of {', '.join(map(repr, BWD_TILES))}, got {tile!r}")
    ext = get_ext()
    if tile.startswith("hopper") and not ext.sm90_available():
        raise ValueError("tile 'hopper' needs a compute capability 9.0 GPU (H100, H200) and a build with sm_90a code "
                         "(the extension built with LLM_ATTN_CUDA_ARCHS containing 9.0, or NVRTC 12.0 or newer)")
    prev = ext.set_bwd_tile(BWD_TILES[tile])
    if prev < 0:  # an extension built before this tile existed
        raise ValueError(f"tile {tile!r} is not in this build: rebuild the extension")
    try:
        yield
    finally:
        ext.set_bwd_tile(prev)
