"""The Hopper (sm_90a) prefill kernel on the NVRTC backend: what kernels/flash_fwd_sm90_launch.cuh does on the host
for the compiled extension, in Python.

- ``Sm90Params``: a ctypes mirror of ``llm_attn::sm90::Sm90Params`` (kernels/flash_fwd_sm90_kernel.cuh): the
  portable ``FlashFwdParams``, the ping-pong switch and four 128-byte, 128-byte-aligned tensor maps, passed by value
  as the kernel's ``__grid_constant__`` parameter. Every program NVRTC compiles with the Hopper kernel
  static_asserts its size and alignment (``struct_asserts``); tests/test_nvrtc.py checks every offset
  (``layout_probe`` of ``_nvrtc.sm90_probe_offsets``: NVRTC has no ``offsetof``, so a probe kernel's PTX gives them).
- ``tensor_map``: ``make_tensor_map`` through cuda-python's ``cuTensorMapEncodeTiled``, with the same parameters
  (4-D (head_dim, seq, heads, batch), byte strides, boxes of 64 columns x box rows, 128-byte swizzle, L2 256-byte
  promotion, no OOB fill).
- ``params``: ``sm90::launch_tile``'s Sm90Params for a launch of the plan (``llm_attn._plan``).
"""

from __future__ import annotations

import ctypes
import functools
import re

from llm_attn import _plan
from llm_attn._cuda_abi import FlashFwdParams
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


SIZEOF, ALIGNOF = 768, 128
assert ctypes.sizeof(Sm90Params) == SIZEOF and Sm90Params.tma_q.offset % ALIGNOF == 0
FIELDS = ("p", "pingpong", "tma_q", "tma_k", "tma_v", "tma_o")


def struct_asserts() -> str:
    """static_asserts for every program that holds the Hopper kernel: Sm90Params and TmaDesc have the mirror's size
    and alignment (a changed struct fails the compile, before anything launches)."""
    s = "llm_attn::sm90::Sm90Params"
    return (f"static_assert(sizeof({s}) == {SIZEOF} && alignof({s}) == {ALIGNOF}, "
            f"\"Sm90Params changed: update llm_attn/_nvrtc_sm90.py\");\n"
            f"static_assert(sizeof(llm_attn::sm90::TmaDesc) == 128 && alignof(llm_attn::sm90::TmaDesc) == 128, "
            f"\"TmaDesc changed: update llm_attn/_nvrtc_sm90.py\");\n")


def layout_probe_source() -> str:
    """A kernel that stores each Sm90Params field's offset: its PTX holds them as constants (layout_probe)."""
    lines = [f'#include "{KERNEL_HEADER}"',
             'extern "C" __global__ void llm_attn_sm90_layout_probe(const llm_attn::sm90::Sm90Params* s, '
             'unsigned long long* out) {',
             "    const char* base = reinterpret_cast<const char*>(s);"]
    lines += [f"    out[{i}] = reinterpret_cast<const char*>(&s->{f}) - base;" for i, f in enumerate(FIELDS)]
    return "\n".join(lines + ["}"]) + "\n"


def layout_probe(ptx: str) -> dict[str, int]:
    """{field: offset} from the PTX of layout_probe_source(): `mov.u64 %rdN, OFFSET;` then
    `st.global.u64 [%rdM+8*i], %rdN;` (a store without an immediate offset is out[0])."""
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"mov\.u64\s+(%rd\d+),\s*(\d+);", ptx)}
    out = {}
    for m in re.finditer(r"st\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", ptx):
        slot = int(m.group(1) or 0) // 8
        val = m.group(2)
        out[FIELDS[slot]] = int(val) if val.isdigit() else regs[val]
    return out


# -- tensor maps ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def tensor_map(ptr: int, is_bf16: bool, head_dim: int, seqlen: int, heads: int, batch: int, batch_stride: int,
               head_stride: int, row_stride: int, box_rows: int) -> bytes:
    """make_tensor_map: the 128 bytes of a CUtensorMap for a (batch, heads, seq, head_dim) tensor with element
    strides (batch, head, row). A pure function of its arguments (the descriptor holds the address, not the
    tensor), so it is cached: a shape seen again (every decoder layer, every CUDA graph capture) costs no encode."""
    driver = _driver()
    dims = [head_dim, seqlen, heads, batch]

    def nbytes(stride: int, size: int) -> int:  # a dim of size 1 is never stepped over: any valid stride does
        return 16 if size == 1 else stride * 2

    strides = [nbytes(row_stride, seqlen), nbytes(head_stride, heads), nbytes(batch_stride, batch)]
    dtype = (driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if is_bf16
             else driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = _drv_check(driver.cuTensorMapEncodeTiled(
        dtype, 4, ptr, [u64(x) for x in dims], [u64(x) for x in strides], [u32(x) for x in (64, box_rows, 1, 1)],
        [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tmap.getPtr(), 128)


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
        raw = tensor_map(int(ptr), bool(p.is_bf16), d, int(seqlen), int(heads), int(p.batch), *map(int, strides),
                         rows)
        ctypes.memmove(ctypes.addressof(sp) + getattr(Sm90Params, field).offset, raw, 128)
    return sp
