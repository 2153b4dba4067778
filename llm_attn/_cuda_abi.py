"""What the NVRTC launchers pass to the kernels, and the CUDA driver API they go through: the ctypes mirror of
``llm_attn::FlashFwdParams`` (kernels/flash.h; every program NVRTC compiles static_asserts its layout) and
cuda-python's driver module with one error check. Shared by ``llm_attn._nvrtc`` (portable kernels) and
``llm_attn._nvrtc_sm90`` (the Hopper kernel's parameters and tensor maps), below both.
"""

from __future__ import annotations

import ctypes
import functools


class FlashFwdParams(ctypes.Structure):
    """Mirror of llm_attn::FlashFwdParams (kernels/flash.h); every compiled program static_asserts this layout."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("seqused_k", ctypes.c_void_p),
        ("q_batch_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64), ("q_row_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64), ("k_head_stride", ctypes.c_int64), ("k_row_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64), ("v_head_stride", ctypes.c_int64), ("v_row_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64), ("o_head_stride", ctypes.c_int64), ("o_row_stride", ctypes.c_int64),
        ("batch", ctypes.c_int), ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int), ("head_dim", ctypes.c_int),
        ("scale", ctypes.c_float), ("scale_log2", ctypes.c_float),
        ("causal", ctypes.c_bool), ("is_bf16", ctypes.c_bool),
        ("tile", ctypes.c_int),
        ("num_splits", ctypes.c_int),
        ("o_accum", ctypes.c_void_p), ("lse_accum", ctypes.c_void_p), ("split_counters", ctypes.c_void_p),
    ]


@functools.lru_cache(maxsize=1)
def driver():
    from cuda.bindings import driver  # noqa: PLC0415

    return driver


def drv_check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        drv = driver()
        name = drv.cuGetErrorName(err)[1]
        raise RuntimeError(f"llm_attn (NVRTC backend): {what} failed: {name.decode() if name else err!r}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None
