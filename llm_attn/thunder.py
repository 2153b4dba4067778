"""llm_attn as a Lightning Thunder executor: ``thunder.jit`` traces ``scaled_dot_product_attention`` to our op.

    import thunder
    from llm_attn.thunder import executor

    jfn = thunder.jit(fn, executors=[executor(), *thunder.get_default_executors()])
    jfn(q, k, v)                          # the trace calls llm_attn_sdpa where the checker accepts the call
    print(thunder.last_traces(jfn)[-1])   # shows it

``executor()`` registers (once) an ``OperatorExecutor`` named "llm_attn" with one operator, ``llm_attn_sdpa``
(``llm_attn.flash_attn_func``: the CUDA kernel on CUDA tensors, the PyTorch reference elsewhere), and claims
``thunder.torch.scaled_dot_product_attention`` with a checker: no ``attn_mask``, no dropout, 4-D q/k/v of one dtype
and device that ``llm_attn`` takes (fp16/bf16 with head_dim 64/128 and the extension built on CUDA; fp16 to fp64
on CPU), and causal only when q_len == kv_len (SDPA aligns causality top-left, we align it bottom-right: they agree
only there). Other calls stay with Thunder's default executors.

Versions (see README, "Lightning Thunder"): lightning-thunder 0.2.6 lists five named-tensor methods of
``torch.Tensor`` (``align_as``, ``align_to``, ``has_names``, ``refine_names``, ``rename``) that torch 2.13 removed,
so ``import thunder`` fails there with AttributeError. Before importing thunder this module defines exactly those
that are missing, as functions that raise NotImplementedError (named tensors are gone; nothing can call them
successfully anyway), so that thunder imports and runs with torch 2.13. On older torch nothing is touched.
Whole-model ``thunder.jit`` of a transformers 5.17 ``LlamaForCausalLM`` does not work (transformers' output-capture
globals); a ``LlamaDecoderLayer`` does. Thunder's SDPA symbol has no ``enable_gqa``: GQA reaches it as K/V already
repeated (what transformers does when SDPA cannot take GQA), which our op also accepts.
"""

from __future__ import annotations

import functools
import math

import torch

_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")


def _named_tensors_removed(name: str):
    def removed(*args, **kwargs):
        raise NotImplementedError(f"torch.Tensor.{name}: named tensors were removed from this torch "
                                  f"({torch.__version__}); defined by llm_attn.thunder only so that thunder imports")

    removed.__name__ = name
    removed.__qualname__ = f"Tensor.{name}"
    return removed


def import_thunder():
    """``import thunder``, first defining the named-tensor methods torch >= 2.13 lacks (see the module docstring)."""
    for name in _NAMED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _named_tensors_removed(name))
    import thunder  # noqa: PLC0415

    return thunder


def _supported(q, k, v, attn_mask, dropout_p, is_causal) -> bool:
    from llm_attn.impls.flash_kernel import variant_problem  # noqa: PLC0415

    if attn_mask is not None or dropout_p:
        return False
    if any(len(t.shape) != 4 for t in (q, k, v)):
        return False
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return False
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        return False
    if is_causal and q.shape[2] != k.shape[2]:
        return False
    dtype = _torch_dtype(q.dtype)
    device = torch.device(str(q.device.device_str() if hasattr(q.device, "device_str") else q.device))
    backend, _ = variant_problem("auto", device, dtype, q.shape[3])
    return backend is not None


def _torch_dtype(dtype):
    from thunder.core import dtypes  # noqa: PLC0415

    return dtypes.to_torch_dtype(dtype)


@functools.cache
def executor():
    """The registered "llm_attn" OperatorExecutor (registered once per process)."""
    import_thunder()
    import thunder.torch as ltorch  # noqa: PLC0415
    from thunder.core.proxies import TensorProxy  # noqa: PLC0415
    from thunder.extend import OperatorExecutor, register_executor  # noqa: PLC0415

    from llm_attn._version import __version__  # noqa: PLC0415
    from llm_attn.ops import flash_attn_func  # noqa: PLC0415

    ex = OperatorExecutor("llm_attn", version=__version__)
    register_executor(ex)

    def meta(q, k, v, causal: bool, scale: float):
        return TensorProxy(like=q)

    def run(q, k, v, causal: bool, scale: float):
        return flash_attn_func(q, k, v, causal=causal, scale=scale)

    op = ex.register_operator("llm_attn_sdpa", meta=meta, fn=run)

    def checker(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, **kwargs):
        return not kwargs and _supported(query, key, value, attn_mask, dropout_p, is_causal)

    def transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, **kwargs):
        s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        return op(query, key, value, bool(is_causal) and query.shape[2] > 1, s)

    ex.register_implementation(ltorch.scaled_dot_product_attention, checker=checker, execution_transform=transform)
    return ex
