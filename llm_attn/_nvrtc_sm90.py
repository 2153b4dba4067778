"""The Hopper (sm_90a) prefill kernels on the NVRTC backend: what kernels/flash_fwd_sm90_launch.cuh and
flash_fwd_fp8_sm90_launch.cuh do on the host for the compiled extension, in Python.

- ``Sm90Params``: a ctypes mirror of ``llm_attn::sm90::Sm90Params`` (kernels/flash_fwd_sm90_kernel.cuh): the
  portable ``FlashFwdParams``, the ping-pong switch and four 128-byte, 128-byte-aligned tensor maps, passed by value
  as the kernel's ``__grid_constant__`` parameter. Every program NVRTC compiles with the Hopper kernel
  static_asserts its size and alignment (``struct_asserts``); tests/test_nvrtc.py checks every offset
  (``layout_probe`` of ``_nvrtc.sm90_probe_offsets``: NVRTC has no ``offsetof``, so a probe kernel's PTX gives them).
- ``tensor_map``: ``make_tensor_map`` through cuda-python's ``cuTensorMapEncodeTiled``, with the same parameters
  (4-D (head_dim, seq, heads, batch), byte strides, boxes of 64 columns x box rows, 128-byte swizzle, L2 256-byte
  promotion, no OOB fill).
- ``params``: ``sm90::launch_tile``'s Sm90Params for a launch of the plan (``llm_attn._plan``).
- The FP8 kernel the same way: ``Fp8Sm90Params`` (``FlashFwdFp8Params``, the ping-pong switch and the three e4m3
  tensor maps of the pre-pass's workspaces, ``fp8_tensor_map``: encode_fp8_map's uint8 maps with a 64- or 128-byte
  swizzle; then the map of the caller's V for P V in the input dtype, ``tensor_map`` as the bf16 kernel's), built
  by ``fp8_params`` as ``sm90::launch_fp8_tile`` builds it.
- The Hopper backward the same way: ``Sm90BwdParams`` (``FlashBwdParams`` and the maps of Q, K, V, dO and the
  float32 dQ accumulator), built by ``bwd_params`` as ``sm90::launch_bwd_dkdv`` (flash_bwd_sm90_launch.cuh) builds it.
"""

from __future__ import annotations

import ctypes
import functools
import re

from llm_attn import _plan
from llm_attn._cuda_abi import FlashBwdParams, FlashFwdFp8Params, FlashFwdParams
from llm_attn._cuda_abi import driver as _driver
from llm_attn._cuda_abi import drv_check as _drv_check

ARCH = "sm_90a"  # wgmma and setmaxnreg need the arch-specific target; the kernel's body is a trap elsewhere
KERNEL_HEADER = "flash_fwd_sm90_kernel.cuh"


class TmaDesc(ctypes.Structure):
    """sm90::TmaDesc (kernels/hopper.cuh): a CUtensorMap's 128 opaque bytes (alignas(128) in C++: Sm90Params pads)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_PAD = 256 - (ctypes.sizeof(FlashFwdParams) + ctypes.sizeof(ctypes.c_int))  # tma_q at the next 128-byte boundary


class Sm90Params(ctypes.Structure):
    """Mirror of llm_attn::sm90::Sm90Params; ctypes has no alignas, so the padding before tma_q is explicit."""

    _fields_ = [("p", FlashFwdParams), ("pingpong", ctypes.c_int), ("_pad", ctypes.c_char * _PAD),
                ("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("tma_o", TmaDesc)]


class Fp8Sm90Params(ctypes.Structure):
    """Mirror of llm_attn::sm90::Fp8Sm90Params (kernels/flash_fwd_fp8_sm90_kernel.cuh): FlashFwdFp8Params, the
    ping-pong switch, then (at the next 128-byte boundary) the tensor maps of e4m3 Q, K and V^T, and of the caller's
    V (P V in the input dtype; the one of V^T and V a kernel does not read is zeroed)."""

    _fields_ = [("f", FlashFwdFp8Params), ("pingpong", ctypes.c_int),
                ("_pad", ctypes.c_char * (-(ctypes.sizeof(FlashFwdFp8Params) + 4) % 128)),
                ("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_vt", TmaDesc), ("tma_v", TmaDesc)]


class Sm90BwdParams(ctypes.Structure):
    """Mirror of llm_attn::sm90::Sm90BwdParams (kernels/flash_bwd_sm90_kernel.cuh): FlashBwdParams, then (at the next
    128-byte boundary) the tensor maps of Q, K, V, dO and the float32 dQ accumulator."""

    _fields_ = [("p", FlashBwdParams), ("_pad", ctypes.c_char * (-ctypes.sizeof(FlashBwdParams) % 128)),
                ("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("tma_do", TmaDesc), ("tma_dq", TmaDesc)]


SIZEOF, ALIGNOF = 768, 128
assert ctypes.sizeof(Sm90Params) == SIZEOF and Sm90Params.tma_q.offset % ALIGNOF == 0
assert Fp8Sm90Params.tma_q.offset % ALIGNOF == 0 and ctypes.sizeof(Fp8Sm90Params) % ALIGNOF == 0
assert Sm90BwdParams.tma_q.offset % ALIGNOF == 0 and ctypes.sizeof(Sm90BwdParams) % ALIGNOF == 0
FIELDS = ("p", "pingpong", "tma_q", "tma_k", "tma_v", "tma_o")
# The by-value parameter structs of the Hopper kernels: (C++ name, mirror, its fields, the header that defines it).
STRUCTS = {
    "Sm90Params": ("llm_attn::sm90::Sm90Params", Sm90Params, FIELDS, KERNEL_HEADER),
    "Fp8Sm90Params": ("llm_attn::sm90::Fp8Sm90Params", Fp8Sm90Params, ("f", "pingpong", "tma_q", "tma_k", "tma_vt",
                                                                       "tma_v"), "flash_fwd_fp8_sm90_kernel.cuh"),
    "Sm90BwdParams": ("llm_attn::sm90::Sm90BwdParams", Sm90BwdParams, ("p", "tma_q", "tma_k", "tma_v", "tma_do",
                                                                       "tma_dq"), "flash_bwd_sm90_kernel.cuh"),
}


def struct_asserts(struct: str = "Sm90Params") -> str:
    """static_asserts for every program that holds a Hopper kernel: its parameter struct and TmaDesc have the
    mirror's size and alignment (a changed struct fails the compile, before anything launches)."""
    cpp, mirror = STRUCTS[struct][:2]
    return (f"static_assert(sizeof({cpp}) == {ctypes.sizeof(mirror)} && alignof({cpp}) == {ALIGNOF}, "
            f"\"{struct} changed: update llm_attn/_nvrtc_sm90.py\");\n"
            f"static_assert(sizeof(llm_attn::sm90::TmaDesc) == 128 && alignof(llm_attn::sm90::TmaDesc) == 128, "
            f"\"TmaDesc changed: update llm_attn/_nvrtc_sm90.py\");\n")


def layout_probe_source(struct: str = "Sm90Params") -> str:
    """A kernel that stores each field's offset of the Hopper parameter struct `struct`: its PTX holds them as
    constants (layout_probe)."""
    cpp, _, fields, header = STRUCTS[struct]
    lines = [f'#include "{header}"',
             f'extern "C" __global__ void llm_attn_sm90_layout_probe(const {cpp}* s, unsigned long long* out) {{',
             "    const char* base = reinterpret_cast<const char*>(s);"]
    lines += [f"    out[{i}] = reinterpret_cast<const char*>(&s->{f}) - base;" for i, f in enumerate(fields)]
    return "\n".join(lines + ["}"]) + "\n"


def layout_probe(ptx: str, struct: str = "Sm90Params") -> dict[str, int]:
    """{field: offset} from the PTX of layout_probe_source(struct)."""
    values = stored_values(ptx)
    return {f: values[i] for i, f in enumerate(STRUCTS[struct][2]) if i in values}


def stored_values(ptx: str) -> dict[int, int]:
    """{i: value} of a probe kernel that stores constants into `unsigned long long* out` (out[i] = ...): its PTX's
    `mov.u64 %rdN, VALUE;` then `st.global.u64 [%rdM+8*i], %rdN;` (a store without an immediate offset is out[0])."""
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"mov\.u64\s+(%rd\d+),\s*(-?\d+);", ptx)}
    out = {}
    for m in re.finditer(r"st\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|-?\d+);", ptx):
        val = m.group(2)
        out[int(m.group(1) or 0) // 8] = int(val) if val.lstrip("-").isdigit() else regs[val]
    return out


# -- tensor maps ---------------------------------------------------------------------------------------------------
def _encode(dtype: str, ptr: int, dims, byte_strides, box, swizzle_bytes: int) -> bytes:
    """cuTensorMapEncodeTiled of a 4-D map with the parameters every map of these kernels shares (element strides
    1, no interleave, L2 256-byte promotion, no OOB fill): the descriptor's 128 bytes."""
    driver = _driver()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = _drv_check(driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dtype}"), 4, ptr, [u64(x) for x in dims],
        [u64(x) for x in byte_strides], [u32(x) for x in box], [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle_bytes}B"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tmap.getPtr(), 128)


# tma_host.h's kTmaElem: the element type of a map, (driver name, bytes).
TMA_ELEMS = {0: ("BFLOAT16", 2), 1: ("FLOAT16", 2), 2: ("FLOAT32", 4)}


@functools.lru_cache(maxsize=1024)
def tensor_map(ptr: int, elem: int, head_dim: int, seqlen: int, heads: int, batch: int, batch_stride: int,
               head_stride: int, row_stride: int, box_rows: int) -> bytes:
    """make_tensor_map: the 128 bytes of a CUtensorMap for a (batch, heads, seq, head_dim) tensor of element type
    `elem` (TMA_ELEMS: 0 bf16, 1 fp16, 2 fp32) with element strides (batch, head, row), in boxes of one 128-byte
    swizzle row of columns x box_rows rows. A pure function of its arguments (the descriptor holds the address, not
    the tensor), so it is cached: a shape seen again (every decoder layer, every CUDA graph capture) costs no
    encode."""
    name, size = TMA_ELEMS[elem]

    def nbytes(stride: int, n: int) -> int:  # a dim of size 1 is never stepped over: any valid stride does
        return 16 if n == 1 else stride * size

    strides = [nbytes(row_stride, seqlen), nbytes(head_stride, heads), nbytes(batch_stride, batch)]
    return _encode(name, ptr, [head_dim, seqlen, heads, batch], strides, (128 // size, box_rows, 1, 1), 128)


@functools.lru_cache(maxsize=1024)
def fp8_tensor_map(ptr: int, inner: int, rows: int, heads: int, batch: int, box_inner: int, box_rows: int) -> bytes:
    """encode_fp8_map: a 4-D e4m3 (uint8) map (inner, rows, heads, batch) of a contiguous byte tensor, boxes of
    box_inner x box_rows, the swizzle as wide as box_inner (128 or 64 bytes). Cached as tensor_map (the workspaces
    are fresh allocations, but the caching allocator hands the same addresses back)."""
    return _encode("UINT8", ptr, [inner, rows, heads, batch], [inner, inner * rows, inner * rows * heads],
                   (box_inner, box_rows, 1, 1), 128 if box_inner == 128 else 64)


def params(p, launch: _plan.Launch) -> Sm90Params:
    """sm90::launch_tile's Sm90Params for FlashFwdParams `p` (a ctypes FlashFwdParams) and a Hopper launch."""
    t = launch.sm90
    sp = Sm90Params()
    sp.p = p
    sp.pingpong = _plan.sm90_tuning()[1]
    d = t.head_dim
    for field, ptr, seqlen, heads, strides, rows in (
            ("tma_q", p.q, p.seqlen_q, p.num_heads, (p.q_batch_stride, p.q_head_stride, p.q_row_stride), t.block_m),
            ("tma_k", p.k, p.seqlen_k, p.num_kv_heads, (p.k_batch_stride, p.k_head_stride, p.k_row_stride),
             t.block_n),
            ("tma_v", p.v, p.seqlen_k, p.num_kv_heads, (p.v_batch_stride, p.v_head_stride, p.v_row_stride),
             t.block_n),
            ("tma_o", p.o, p.seqlen_q, p.num_heads, (p.o_batch_stride, p.o_head_stride, p.o_row_stride), 64)):
        raw = tensor_map(int(ptr), 0 if p.is_bf16 else 1, d, int(seqlen), int(heads), int(p.batch),
                         *map(int, strides), rows)
        ctypes.memmove(ctypes.addressof(sp) + getattr(Sm90Params, field).offset, raw, 128)
    return sp


def fp8_params(f: FlashFwdFp8Params, traits: _plan.Fp8Traits) -> Fp8Sm90Params:
    """sm90::launch_fp8_tile's Fp8Sm90Params for FlashFwdFp8Params `f` (workspace pointers set) and the kernel's
    tile: the maps of Q8 (boxes of the block's rows), K8 (block_n keys) and V^T (vt_box_keys keys x head_dim rows
    of the padded V^T); with P V in the input dtype (traits.pv_input) the caller's V instead of V^T, make_tensor_map
    as the bf16 kernel's V (boxes of 64 columns x block_n keys), tma_vt left zeroed (f.vt8 is null)."""
    p, d = f.p, traits.head_dim
    sp = Fp8Sm90Params()
    sp.f = f
    sp.pingpong = _plan.sm90_tuning()[1]
    pad = _plan.fp8_seqlen_k_pad(p.seqlen_k)
    maps = [("tma_q", f.q8, d, p.seqlen_q, p.num_heads, d, traits.block_m),
            ("tma_k", f.k8, d, p.seqlen_k, p.num_kv_heads, d, traits.block_n)]
    if not traits.pv_input:
        maps.append(("tma_vt", f.vt8, pad, d, p.num_kv_heads, traits.vt_box_keys, d))
    for field, ptr, inner, rows, heads, box_inner, box_rows in maps:
        raw = fp8_tensor_map(int(ptr), inner, int(rows), int(heads), int(p.batch), box_inner, box_rows)
        ctypes.memmove(ctypes.addressof(sp) + getattr(Fp8Sm90Params, field).offset, raw, 128)
    if traits.pv_input:
        raw = tensor_map(int(p.v), 0 if p.is_bf16 else 1, d, int(p.seqlen_k), int(p.num_kv_heads), int(p.batch),
                         int(p.v_batch_stride), int(p.v_head_stride), int(p.v_row_stride), traits.block_n)
        ctypes.memmove(ctypes.addressof(sp) + Fp8Sm90Params.tma_v.offset, raw, 128)
    return sp


def bwd_params(p: FlashBwdParams, traits: _plan.Sm90BwdTraits) -> Sm90BwdParams:
    """sm90::launch_bwd_dkdv's Sm90BwdParams for FlashBwdParams `p` (pointers and dq_accum set): the maps of Q and dO
    (boxes of the step's block_m rows), K and V (the block's block_n keys) in the input dtype, and of the float32 dQ
    accumulator ((batch, heads, seqlen_q, head_dim) contiguous, boxes of dq_rows (64) rows x 32 columns)."""
    sp = Sm90BwdParams()
    sp.p = p
    d, elem = traits.head_dim, 0 if p.is_bf16 else 1
    sq, hq = int(p.seqlen_q), int(p.num_heads)
    for field, ptr, el, seqlen, heads, strides, rows in (
            ("tma_q", p.q, elem, sq, hq, (p.q_batch_stride, p.q_head_stride, p.q_row_stride), traits.block_m),
            ("tma_k", p.k, elem, p.seqlen_k, p.num_kv_heads, (p.k_batch_stride, p.k_head_stride, p.k_row_stride),
             traits.block_n),
            ("tma_v", p.v, elem, p.seqlen_k, p.num_kv_heads, (p.v_batch_stride, p.v_head_stride, p.v_row_stride),
             traits.block_n),
            ("tma_do", p.dout, elem, sq, hq, (p.do_batch_stride, p.do_head_stride, p.do_row_stride), traits.block_m),
            ("tma_dq", p.dq_accum, 2, sq, hq, (hq * sq * d, sq * d, d), traits.dq_rows)):
        raw = tensor_map(int(ptr), el, d, int(seqlen), int(heads), int(p.batch), *map(int, strides), rows)
        ctypes.memmove(ctypes.addressof(sp) + getattr(Sm90BwdParams, field).offset, raw, 128)
    return sp
