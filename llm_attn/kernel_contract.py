"""What this project's CUDA kernel accepts: the one Python statement of it.

Every Python entry point asks this module: ``llm_attn.ops.flash_attn_func`` (``check_inputs``), the registry entry
``llm_attn`` (``llm_attn/impls/flash_kernel.py``, through ``kernel_problem``) and the NVRTC launcher
(``llm_attn/_nvrtc.py``, through ``launcher_problem``, whose messages are those of ``kernels/binding.cpp``'s
``TORCH_CHECK``s word for word). The compiled extension keeps its ``TORCH_CHECK``s as the last line of defence, as
flash-attention's ``flash_api.cpp`` does; tests/test_kernel_contract.py feeds the same invalid inputs to every entry
point and checks that they say the same thing. The tile dispatch mirror is ``llm_attn/_plan.py``.

Imports torch only: the ops, the registry entry and the kernel backends all sit above it.
"""

from __future__ import annotations

import math

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128)
# The grid: batch and heads on y/z (at most 65535 each); a causal launch holds one 64-row block per y index.
KERNEL_MAX_GRID_YZ = 65535
KERNEL_MAX_CAUSAL_Q_LEN = KERNEL_MAX_GRID_YZ * 64
KERNEL_MAX_SEQ_LEN = 1 << 30  # exclusive: lengths are int32 and offsets must not overflow
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PATHS = ("auto", "kernel", "reference")
# flash_attn_func(precision=...): 'native' computes in the inputs' dtype; 'fp8' quantises Q, K, V to e4m3 in the call
# (kernels/flash_fp8.h; llm_attn/quant_reference.py), on compute capability 9.0 only for the kernel (either build).
PRECISIONS = ("native", "fp8", "int8")
FP8_KERNEL_CC = (9, 0)
INT8_KERNEL_CCS = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))


# ------------------------------------------------------------------------------ what the user-facing op checks

def reference_problem(dtype: torch.dtype) -> str | None:
    """Why the PyTorch reference cannot take ``dtype``, or None."""
    if dtype not in REFERENCE_DTYPES:
        return f"the reference takes {REFERENCE_DTYPES}, got {dtype}"
    return None


def kernel_problem(dtype: torch.dtype, head_dim: int, *, scale: float | None = None, heads: int = 1,
                   batch: int = 1, q_len: int = 1, causal: bool = False) -> str | None:
    """Why the CUDA kernel cannot take inputs like these (device and build aside), or None. One sentence that
    names the fix."""
    if dtype not in KERNEL_DTYPES:
        return f"the CUDA kernel takes float16 or bfloat16, got {dtype}"
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"the CUDA kernel supports head_dim {KERNEL_HEAD_DIMS}, got {head_dim}"
    if scale is not None and scale < 0:
        return (f"the CUDA kernel takes a scale >= 0 (its online softmax takes each row's max before scaling), got "
                f"{scale}; use path='reference' for a negative scale")
    if heads > KERNEL_MAX_GRID_YZ or batch > KERNEL_MAX_GRID_YZ:
        return (f"the CUDA kernel takes at most {KERNEL_MAX_GRID_YZ} heads and batch {KERNEL_MAX_GRID_YZ}, got "
                f"{heads} and {batch}")
    if causal and q_len > KERNEL_MAX_CAUSAL_Q_LEN:
        return (f"causal q_len must be <= {KERNEL_MAX_CAUSAL_Q_LEN} for the CUDA kernel (its grid holds one 64-row "
                f"block per y index), got {q_len}; split the queries into chunks")
    return None


# Verdicts of check_inputs for inputs that passed, keyed by everything the full check reads (types, shapes,
# strides, dtypes, devices, causal, scale, seqused_k's metadata, path): a repeated call costs one key and one dict
# lookup. Only passes are stored, so bad input always takes the full check and raises its own error. Bounded.
_VERDICTS: dict = {}
_VERDICTS_MAX = 512
_Tensor = torch.Tensor


def _verdict_key(q, k, v, causal, scale, seqused_k, path):
    """The cache key, or None where the inputs are not plain tensors (subclasses, fakes: the full check runs)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if seqused_k is None:
        sk = None
    elif type(seqused_k) is _Tensor:
        sk = (seqused_k.dtype, seqused_k.shape, seqused_k.device)
    else:
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, type(causal), causal, type(scale), scale, sk, path)


def check_inputs(q, k, v, causal, scale, seqused_k, path: str) -> bool:
    """Validate the arguments of ``flash_attn_func``; return True when the CUDA kernel will run (``path`` 'kernel',
    or 'auto' with CUDA tensors). Raises TypeError/ValueError whose message names the argument and the fix.

    Eager calls with inputs like a previous good call's cost one dict lookup (``_VERDICTS``); traced calls and
    anything unusual run the full check (``check_inputs_full``)."""
    return check_inputs_keyed(q, k, v, causal, scale, seqused_k, path)[0]


def check_inputs_keyed(q, k, v, causal, scale, seqused_k, path: str) -> tuple[bool, tuple | None]:
    """``check_inputs``, and the key its verdict is kept under (None where it keeps none: traced calls, subclasses,
    unhashable arguments). Callers may build on the key: it stands for every property of the inputs the checks
    read (the NVRTC build's call kinds, ``_nvrtc.mha_fwd_alloc_keyed``)."""
    if torch.compiler.is_compiling():
        return check_inputs_full(q, k, v, causal, scale, seqused_k, path), None
    try:
        key = _verdict_key(q, k, v, causal, scale, seqused_k, path)
        verdict = _VERDICTS.get(key) if key is not None else None
    except TypeError:  # an unhashable argument (e.g. path=[...]): the full check says what is wrong
        key = verdict = None
    if verdict is not None:
        return verdict, key
    verdict = check_inputs_full(q, k, v, causal, scale, seqused_k, path)
    if key is not None:
        if len(_VERDICTS) >= _VERDICTS_MAX:
            _VERDICTS.clear()
        _VERDICTS[key] = verdict
    return verdict, key


def check_inputs_full(q, k, v, causal, scale, seqused_k, path: str) -> bool:
    """``check_inputs`` without its cache: every check, every call."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): every dim must be > 0")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}; "
                             f"call .contiguous() first")
    if path not in PATHS:
        raise ValueError(f"path must be 'auto', 'kernel' or 'reference', got {path!r}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"batch mismatch: q has {b}, k/v have {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k/v have {k.shape[3]}")
    hkv = k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if seqused_k is not None:
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 or seqused_k.shape != (b,):
            raise ValueError(f"seqused_k must be an int32 tensor of shape ({b},), got "
                             f"{getattr(seqused_k, 'dtype', type(seqused_k))} {tuple(getattr(seqused_k, 'shape', ()))}")
        if seqused_k.device != q.device:
            raise ValueError(f"seqused_k must be on {q.device}, got {seqused_k.device}")

    use_kernel = path == "kernel" or (path == "auto" and q.is_cuda)
    if use_kernel:
        if not q.is_cuda:
            raise ValueError(f"path='kernel' needs CUDA tensors, got {q.device}; use path='reference' on CPU")
        problem = kernel_problem(q.dtype, d, scale=scale, heads=hq, batch=b, q_len=sq, causal=causal)
        if problem:
            raise (TypeError if q.dtype not in KERNEL_DTYPES else ValueError)(problem)
    elif reference_problem(q.dtype):
        raise TypeError(f"unsupported dtype {q.dtype}; use one of {REFERENCE_DTYPES}")
    return use_kernel


def quant_problem(precision, q: torch.Tensor, use_kernel: bool, available: bool = True) -> str | None:
    """Why ``precision`` cannot serve ``q`` (already checked by ``check_inputs``) on this path, or None. One line that
    names what is supported."""
    if precision not in PRECISIONS:
        return f"precision must be one of {PRECISIONS}, got {precision!r}"
    if precision == "native" or not use_kernel:
        return None
    cc = tuple(torch.cuda.get_device_capability(q.device))
    if precision == "fp8" and cc != FP8_KERNEL_CC:
        return (f"precision='fp8' needs an FP8 tensor-core kernel, which this project has for compute capability 9.0 "
                f"(H100, H200) only; this GPU is sm_{cc[0]}{cc[1]}: use precision='int8' (sm_80-90), 'native', or "
                f"path='reference' (the same algorithm in PyTorch)")
    if precision == "int8" and cc not in INT8_KERNEL_CCS:
        return (f"precision='int8' has kernels for sm_80/86/87/89/90; this GPU is sm_{cc[0]}{cc[1]}: use "
                f"precision='native', or path='reference'")
    if not available:
        return (f"precision={precision!r} needs a kernel build for this GPU: the AOT extension compiled for it "
                f"(LLM_ATTN_CUDA_ARCHS; python -m pip install --no-build-isolation -e .) or NVRTC (12.0 or newer for "
                f"FP8's sm_90a); this build has no {precision.upper()} kernel for it")
    return None


def fp8_tile_problem(block_n: int, head_dim: int | None = None, pv: str = "") -> str | None:
    """Why the FP8 kernel cannot run with key tile ``block_n`` (keys per S tile; 0 = the build's default) for
    ``head_dim`` (None: for some head_dim) and P V operands ``pv``, or None. The tiles built are
    kernels/generate_kernels.py's ``FP8_BLOCK_N`` (``kernel_tiles.h`` ``Fp8Tiles<D>``), those up to 192 keys with P V
    in the input dtype (``pv='input'``); the choice changes speed, not the result's semantics."""
    from llm_attn._kernel_table import FP8_BLOCK_N  # noqa: PLC0415 (plain data, generated)
    from llm_attn._plan import FP8_PV_INPUT_MAX_BLOCK_N  # noqa: PLC0415

    if block_n == 0 and type(block_n) is int:
        return None
    if pv == "input" and type(block_n) is int and block_n > FP8_PV_INPUT_MAX_BLOCK_N:
        return (f"the FP8 kernel with P V in the input dtype (fp8_pv='input') has no {block_n}-key tile: its P of "
                f"{block_n} keys would not fit the registers; the tiles up to {FP8_PV_INPUT_MAX_BLOCK_N} keys run it")
    if head_dim is None:
        tiles = sorted({n for t in FP8_BLOCK_N.values() for n in t})
    else:
        tiles = FP8_BLOCK_N.get(head_dim, ())
    if type(block_n) is int and block_n in tiles:
        return None
    where = f" for head_dim {head_dim} (default {tiles[0]})" if head_dim is not None and tiles else ""
    return (f"the FP8 kernel has no {block_n!r}-key tile{where}: block_n must be 0 (the default) or one of "
            f"{', '.join(map(str, tiles))}")


def aligned16(t: torch.Tensor) -> bool:
    """The layout cp.async reads in place: 16-byte aligned base, strides of batch/heads/seq multiples of 8 elements
    (a dim of size 1 has any stride). Other layouts are copied once by the op, never rejected."""
    if t.data_ptr() % 16:
        return False
    if t.shape[-1] % 8 == 0 and t.is_contiguous():  # the common case, without the per-dim loop (a decode call's host
        return True                                  # time counts every microsecond)
    return all(st % 8 == 0 or n == 1 for st, n in zip(t.stride()[:3], t.shape[:3]))


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where the kernels can read it in place, else a contiguous copy. cp.async and TMA move 16-byte
    chunks: strides must be multiples of 8 elements and bases 16-byte aligned. Any layout transformers or a KV cache
    produces is; anything else is copied once rather than rejected. (The compiled extension's ``mha_fwd_alloc`` and
    ``mha_fwd_autograd`` do the same in C++: binding.cpp ``readable``.)"""
    # clone, not contiguous(): a contiguous tensor at a misaligned address (a view one element into its buffer) would
    # come back as itself.
    return t if aligned16(t) else t.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------- what the launcher checks (kernels/binding.cpp's TORCH_CHECKs)

def _shape(t) -> str:
    return "[" + ", ".join(str(x) for x in t) + "]"


def _operand_problem(t: torch.Tensor, name: str, q: torch.Tensor) -> str | None:
    if not t.is_cuda:
        return f"{name} must be a CUDA tensor"
    if t.device != q.device:
        return f"{name} is on {t.device} but q is on {q.device}"
    if t.dtype != q.dtype:
        return f"{name} dtype {t.dtype} != q dtype {q.dtype}"
    if t.dim() != 4:
        return f"{name} must be 4-D (batch, heads, seq, head_dim), got {t.dim()}-D"
    st = t.stride()
    if st[3] != 1:
        return f"{name} must be contiguous in head_dim"
    for d in range(3):
        if st[d] % 8 and t.shape[d] != 1:
            return f"{name} strides must be multiples of 8 elements (16 bytes), got {_shape(st)}"
    if t.data_ptr() % 16:
        return f"{name} must be 16-byte aligned"
    return None


def launcher_problem(q, k, v, out, lse, seqused_k, scale: float, causal: bool) -> str | None:
    """What ``mha_fwd`` of a kernel backend refuses, in the words of kernels/binding.cpp (without its
    "llm_attn.mha_fwd: " prefix), or None. The NVRTC launcher raises it; the extension checks the same in C++."""
    if q.dtype not in KERNEL_DTYPES:
        return f"only float16 and bfloat16 are supported, got {q.dtype}"
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")):
        problem = _operand_problem(t, name, q)
        if problem:
            return problem
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim must be {' or '.join(map(str, KERNEL_HEAD_DIMS))}, got {head_dim}"
    if k.shape != v.shape:
        return f"k {_shape(k.shape)} and v {_shape(v.shape)} must have the same shape"
    if k.shape[0] != batch or k.shape[3] != head_dim:
        return f"k/v {_shape(k.shape)} do not match q {_shape(q.shape)}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
    if min(batch, num_heads, seqlen_q, seqlen_k) <= 0:
        return f"empty input: q {_shape(q.shape)}, k {_shape(k.shape)}"
    if seqlen_q >= KERNEL_MAX_SEQ_LEN or seqlen_k >= KERNEL_MAX_SEQ_LEN:
        return "sequence too long"
    if num_heads > KERNEL_MAX_GRID_YZ or batch > KERNEL_MAX_GRID_YZ:
        return f"at most {KERNEL_MAX_GRID_YZ} heads and batch {KERNEL_MAX_GRID_YZ}, got {num_heads} and {batch}"
    if causal and seqlen_q > KERNEL_MAX_CAUSAL_Q_LEN:
        return f"causal q_len must be <= {KERNEL_MAX_CAUSAL_Q_LEN}, got {seqlen_q}"
    if out.shape != q.shape:
        return f"out {_shape(out.shape)} must match q {_shape(q.shape)}"
    if not (lse.is_cuda and lse.device == q.device and lse.dtype == torch.float32 and lse.is_contiguous()
            and tuple(lse.shape) == (batch, num_heads, seqlen_q)):
        return "lse must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device"
    if not math.isfinite(scale):
        return "scale must be finite"
    if scale < 0:  # binding.cpp formats the number with %g
        return ("scale must be >= 0 (the kernels' online softmax takes each row's max before scaling), got "
                f"{scale:g}")
    if seqused_k is not None and not (seqused_k.is_cuda and seqused_k.device == q.device):
        return "seqused_k must be on q's device"
    if seqused_k is not None and not (seqused_k.dtype == torch.int32 and seqused_k.dim() == 1
                                      and seqused_k.shape[0] == batch and seqused_k.is_contiguous()):
        return "seqused_k must be a contiguous int32 tensor of shape (batch,)"
    return None


def backward_launcher_problem(dout, q, k, v, out, lse, dlse, dq, dk, dv, seqused_k, scale: float,
                              causal: bool) -> str | None:
    """What ``mha_bwd`` of a kernel build refuses, in the words and order of kernels/binding.cpp's ``mha_bwd``
    (without its "llm_attn.mha_bwd: " prefix), or None. The NVRTC launcher raises it; the extension checks the same
    in C++."""
    if q.dtype not in KERNEL_DTYPES:
        return f"only float16 and bfloat16 are supported, got {q.dtype}"
    if not (q.is_cuda and q.dim() == 4):
        return "q must be a 4-D CUDA tensor (batch, heads, seq, head_dim)"
    if k.dim() != 4 or v.dim() != 4:
        return "k and v must be 4-D (batch, kv_heads, seq, head_dim)"
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim must be {' or '.join(map(str, KERNEL_HEAD_DIMS))}, got {head_dim}"
    if k.shape[0] != batch or k.shape[3] != head_dim:
        return f"k/v {_shape(k.shape)} do not match q {_shape(q.shape)}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
    if min(batch, num_heads, seqlen_q, seqlen_k) <= 0:
        return f"empty input: q {_shape(q.shape)}, k {_shape(k.shape)}"
    if seqlen_q >= KERNEL_MAX_SEQ_LEN or seqlen_k >= KERNEL_MAX_SEQ_LEN:
        return "sequence too long"
    if num_heads > KERNEL_MAX_GRID_YZ or batch > KERNEL_MAX_GRID_YZ:
        return f"at most {KERNEL_MAX_GRID_YZ} heads and batch {KERNEL_MAX_GRID_YZ}, got {num_heads} and {batch}"
    if causal and seqlen_k > KERNEL_MAX_CAUSAL_Q_LEN:  # causal key blocks in gridDim.y
        return f"causal kv_len must be <= {KERNEL_MAX_CAUSAL_Q_LEN}, got {seqlen_k}"
    for t, name, sizes in ((q, "q", q.shape), (k, "k", k.shape), (v, "v", k.shape), (out, "out", q.shape),
                           (dout, "dout", q.shape), (dq, "dq", q.shape), (dk, "dk", k.shape), (dv, "dv", k.shape)):
        if not t.is_cuda:
            return f"{name} must be a CUDA tensor"
        if t.device != q.device:
            return f"{name} is on {t.device} but q is on {q.device}"
        if t.dtype != q.dtype:
            return f"{name} dtype {t.dtype} != q dtype {q.dtype}"
        if t.shape != sizes:
            return f"{name} {_shape(t.shape)} must have shape {_shape(sizes)}"
        st = t.stride()
        if st[3] != 1:
            return f"{name} must be contiguous in head_dim"
        if any(st[d] % 8 and t.shape[d] != 1 for d in range(3)):
            return f"{name} strides must be multiples of 8 elements (16 bytes), got {_shape(st)}"
        if t.data_ptr() % 16:
            return f"{name} must be 16-byte aligned"
    for t, name in ((lse, "lse"), (dlse, "dlse")):
        if t is not None and not (t.is_cuda and t.device == q.device and t.dtype == torch.float32
                                  and t.is_contiguous() and tuple(t.shape) == (batch, num_heads, seqlen_q)):
            return f"{name} must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device"
    if not math.isfinite(scale):
        return "scale must be finite"
    if seqused_k is not None and not (seqused_k.is_cuda and seqused_k.device == q.device):
        return "seqused_k must be on q's device"
    if seqused_k is not None and not (seqused_k.dtype == torch.int32 and seqused_k.dim() == 1
                                      and seqused_k.shape[0] == batch and seqused_k.is_contiguous()):
        return "seqused_k must be a contiguous int32 tensor of shape (batch,)"
    return None
