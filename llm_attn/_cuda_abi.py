"""What the NVRTC launchers pass to the kernels, and the CUDA driver API they go through: the ctypes mirrors of
``llm_attn::FlashFwdParams`` (kernels/flash.h), ``FlashFwdFp8Params`` (kernels/flash_fp8.h), ``FlashFwdInt8Params``
(kernels/flash_int8.h), the backward's ``FlashBwdParams`` (kernels/flash.h), the FP8-cache decode's
``FlashDecodeFp8KvParams`` (kernels/flash_decode_fp8kv.h), the FP8 cache append's ``Fp8CacheAppendParams``
(kernels/fp8_cache_append.h) and the FP8 cache copy's ``Fp8CacheDequantParams`` (kernels/fp8_cache_dequant.h) (every
program NVRTC compiles static_asserts their sizes; tests/test_nvrtc.py checks every offset with the host C++
compiler) and cuda-python's driver module with one error check. Shared by ``llm_attn._nvrtc`` (the launchers) and
``llm_attn._nvrtc_sm90`` (the Hopper kernels' parameters and tensor maps), below both.
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


# FlashFwdParams' fields up to is_bf16: FlashFwdInt8Params begins with them.
_COMMON = FlashFwdParams._fields_[:[name for name, _ in FlashFwdParams._fields_].index("tile")]


class FlashFwdFp8Params(ctypes.Structure):
    """Mirror of llm_attn::FlashFwdFp8Params (kernels/flash_fp8.h): FlashFwdParams and the pre-pass workspaces."""

    _fields_ = [("p", FlashFwdParams),
                ("q8", ctypes.c_void_p), ("q_scale", ctypes.c_void_p), ("k8", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("vt8", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
                ("stats", ctypes.c_void_p), ("q_dot_kmean", ctypes.c_void_p)]


class FlashFwdInt8Params(ctypes.Structure):
    """Mirror of llm_attn::FlashFwdInt8Params (kernels/flash_int8.h): FlashFwdParams' fields up to is_bf16, then
    fp8_pv and the workspace."""

    _fields_ = _COMMON + [
        ("fp8_pv", ctypes.c_bool),
        ("k_int8", ctypes.c_void_p), ("k_scale", ctypes.c_void_p), ("k_mean", ctypes.c_void_p),
        ("v_fp8", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("stats", ctypes.c_void_p),
    ]


class FlashBwdParams(ctypes.Structure):
    """Mirror of llm_attn::FlashBwdParams (kernels/flash.h): what every backward kernel takes (the Hopper one inside
    Sm90BwdParams, llm_attn/_nvrtc_sm90.py)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse", "dlse",
                                               "seqused_k", "dq_accum", "dsum", "lse_log2")),
        *((f"{t}_{s}_stride", ctypes.c_int64) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
          for s in ("batch", "head", "row")),
        ("batch", ctypes.c_int), ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int), ("head_dim", ctypes.c_int),
        ("scale", ctypes.c_float), ("scale_log2", ctypes.c_float),
        ("causal", ctypes.c_bool), ("is_bf16", ctypes.c_bool), ("layout2d", ctypes.c_bool),
        ("num_splits", ctypes.c_int), ("iters_per_split", ctypes.c_int),
        ("hopper", ctypes.c_bool), ("narrow", ctypes.c_bool), ("dq_shared", ctypes.c_bool),
        ("dq_separate", ctypes.c_bool),
        ("dk_accum", ctypes.c_void_p), ("dv_accum", ctypes.c_void_p),
        ("deterministic", ctypes.c_bool),
    ]


class FlashDecodeFp8KvParams(ctypes.Structure):
    """Mirror of llm_attn::FlashDecodeFp8KvParams (kernels/flash_decode_fp8kv.h): FlashFwdParams (K/V strides in
    bytes), then the per-64-token-block scales of K and V and their batch and head strides (in floats)."""

    _fields_ = [("base", FlashFwdParams), ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
                ("ks_batch_stride", ctypes.c_int64), ("ks_head_stride", ctypes.c_int64),
                ("vs_batch_stride", ctypes.c_int64), ("vs_head_stride", ctypes.c_int64)]


class Fp8CacheAppendParams(ctypes.Structure):
    """Mirror of llm_attn::Fp8CacheAppendParams (kernels/fp8_cache_append.h): the FP8 static cache's one-token
    append, its tensors' pointers, the new token's strides (in elements), the shapes and the dtype of the token."""

    _fields_ = [("k_new", ctypes.c_void_p), ("v_new", ctypes.c_void_p),
                ("kn_batch_stride", ctypes.c_int64), ("kn_head_stride", ctypes.c_int64),
                ("vn_batch_stride", ctypes.c_int64), ("vn_head_stride", ctypes.c_int64),
                ("k_open", ctypes.c_void_p), ("v_open", ctypes.c_void_p), ("k_shift", ctypes.c_void_p),
                ("k_data", ctypes.c_void_p), ("v_data", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
                ("position", ctypes.c_void_p), ("used", ctypes.c_void_p),
                ("batch", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("capacity", ctypes.c_int), ("max_cache_len", ctypes.c_int), ("is_bf16", ctypes.c_bool)]


class Fp8CacheDequantParams(ctypes.Structure):
    """Mirror of llm_attn::Fp8CacheDequantParams (kernels/fp8_cache_dequant.h): the FP8 cache's dequantised copy,
    its tensors' pointers (k_shift null: none), the shapes, the token count and the dtype of the copy."""

    _fields_ = [("k_data", ctypes.c_void_p), ("v_data", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("k_shift", ctypes.c_void_p),
                ("k_out", ctypes.c_void_p), ("v_out", ctypes.c_void_p),
                ("batch", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("capacity", ctypes.c_int), ("scale_blocks", ctypes.c_int), ("n", ctypes.c_int),
                ("is_bf16", ctypes.c_bool)]


# (C++ name, mirror) of every by-value parameter struct of kernels/ (flash.h, flash_fp8.h, flash_int8.h,
# flash_decode_fp8kv.h, fp8_cache_append.h, fp8_cache_dequant.h); _nvrtc._KERNEL_HEADERS names them by their index
# here.
STRUCTS = (("llm_attn::FlashFwdParams", FlashFwdParams), ("llm_attn::FlashFwdFp8Params", FlashFwdFp8Params),
           ("llm_attn::FlashFwdInt8Params", FlashFwdInt8Params), ("llm_attn::FlashBwdParams", FlashBwdParams),
           ("llm_attn::FlashDecodeFp8KvParams", FlashDecodeFp8KvParams),
           ("llm_attn::Fp8CacheAppendParams", Fp8CacheAppendParams),
           ("llm_attn::Fp8CacheDequantParams", Fp8CacheDequantParams))


@functools.lru_cache(maxsize=1)
def driver():
    from cuda.bindings import driver  # noqa: PLC0415

    return driver


def error_name(drv, err) -> str:
    """A CUresult by name (CUDA_ERROR_...) from `drv` (cuda-python's driver module, or a stand-in), else its repr."""
    name = drv.cuGetErrorName(err)[1]
    return name.decode() if name else repr(err)


def drv_check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"llm_attn (NVRTC backend): {what} failed: {error_name(driver(), err)}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None
