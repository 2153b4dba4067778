"""``numba``: a FlashAttention-2 forward written in numba-cuda — the seeds' Numba kernel as a registry entry.

One thread block per (64 query rows, query head, batch), one thread per query row. K/V tiles of 32 keys are
staged in shared memory (float32) by the whole block; each thread keeps its query row and output accumulator in
float32 and runs the online softmax (running max and sum, rescaled per tile). Causal masks are aligned
bottom-right and tiles past the block's last visible key are skipped; GQA reads KV head ``h // (Hq // Hkv)``;
``seqused_k`` limits batch ``b`` to its first keys. numba-cuda has no tensor-core (mma) intrinsics, so every
multiply is a scalar FMA: this kernel is correct, and slow — its numbers are recorded next to the others as they
are. head_dim <= 128; fp16 and bf16 (bf16 is read and written as raw bits, converted in registers).

Torch tensors go to Numba through ``__cuda_array_interface__`` (no copy, any strides) and the kernel is launched on
torch's current stream, without host synchronisation. With ``NUMBA_ENABLE_CUDASIM=1`` the same kernel runs in
Numba's CUDA simulator on CPU tensors (tests; tiny shapes only — every thread is a Python thread).

Needs ``python -m pip install numba-cuda`` (the ``numba`` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from llm_attn.registry import register_attention

cuda = float32 = int32 = None  # numba's, bound on first use (importing numba costs a second)

BLOCK_M = 64   # query rows per block = threads per block
BLOCK_N = 32   # keys per shared-memory tile: 2 x 32 x 128 x 4 B = 32 KB of shared memory
D_MAX = 128


def simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _missing() -> str | None:
    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba.cuda") is None:
        return "numba needs numba-cuda (python -m pip install numba-cuda), which is not installed"
    return None


@functools.cache
def _kernel(bf16: bool):
    """The kernel, specialised for fp16 (float16 arrays) or bf16 (int16 arrays of raw bits)."""
    global cuda, float32, int32  # module globals: the simulator swaps a kernel's global `cuda` for its own
    import numpy as np  # noqa: PLC0415

    if not hasattr(np, "row_stack"):
        # numba-cuda 0.30 registers an overload for np.row_stack when it compiles its first kernel; numpy >= 2.5
        # removed that alias of np.vstack, so compiling fails with AttributeError. Put the alias back.
        np.row_stack = np.vstack
    from numba import cuda, float32, int32  # noqa: PLC0415

    if bf16:
        if simulator():
            import numpy as np  # noqa: PLC0415

            def load(x):
                return np.array([(int(x) & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0]

            def store(x):
                bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
                return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.int16)[0]
        else:
            from numba.cuda import libdevice  # noqa: PLC0415

            @cuda.jit(device=True, inline=True)
            def load(x):
                return libdevice.int_as_float(int32((int32(x) & 0xFFFF) << 16))  # bits of the float32

            @cuda.jit(device=True, inline=True)
            def store(x):
                bits = libdevice.float_as_int(x)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
                return bits  # stored into an int16 array: the low 16 bits
    else:
        if simulator():
            def load(x):
                return float32(x)

            def store(x):
                return x
        else:
            @cuda.jit(device=True, inline=True)
            def load(x):
                return float32(x)

            @cuda.jit(device=True, inline=True)
            def store(x):
                return x

    @cuda.jit
    def fa2_fwd(q, k, v, out, seqused, has_seqused, scale, causal, group):
        tx = cuda.threadIdx.x
        m0 = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // group
        sq = q.shape[2]
        d_n = q.shape[3]
        sk = k.shape[2]
        if has_seqused:
            sk = min(sk, seqused[b])
        row = m0 + tx
        valid = row < sq

        ks = cuda.shared.array((BLOCK_N, D_MAX), float32)
        vs = cuda.shared.array((BLOCK_N, D_MAX), float32)
        qr = cuda.local.array(D_MAX, float32)
        acc = cuda.local.array(D_MAX, float32)
        sc = cuda.local.array(BLOCK_N, float32)
        for d in range(d_n):
            qr[d] = load(q[b, h, row, d]) * scale if valid else float32(0.0)
            acc[d] = 0.0
        m_i = float32(-math.inf)
        l_i = float32(0.0)

        # Keys this block may need: all of them, or (causal, bottom-right) up to its last row's last visible key.
        n_end = sk
        if causal:
            n_end = min(sk, max(0, m0 + BLOCK_M + sk - sq))
        limit = sk  # exclusive bound of this row's visible keys
        if causal:
            limit = min(sk, row + sk - sq + 1)

        for n0 in range(0, n_end, BLOCK_N):
            for idx in range(tx, BLOCK_N * d_n, BLOCK_M):  # the block stages the K/V tile cooperatively
                j = idx // d_n
                d = idx - j * d_n
                if n0 + j < sk:
                    ks[j, d] = load(k[b, hk, n0 + j, d])
                    vs[j, d] = load(v[b, hk, n0 + j, d])
                else:
                    ks[j, d] = 0.0
                    vs[j, d] = 0.0
            cuda.syncthreads()
            if valid and n0 < limit:
                m_new = m_i
                for j in range(BLOCK_N):
                    s = float32(-math.inf)
                    if n0 + j < limit:
                        s = float32(0.0)
                        for d in range(d_n):
                            s += qr[d] * ks[j, d]
                    sc[j] = s
                    m_new = max(m_new, s)
                alpha = math.exp(m_i - m_new) if m_i > -math.inf else float32(0.0)
                l_i *= alpha
                for d in range(d_n):
                    acc[d] *= alpha
                for j in range(BLOCK_N):
                    if sc[j] > -math.inf:
                        p = math.exp(sc[j] - m_new)
                        l_i += p
                        for d in range(d_n):
                            acc[d] += p * vs[j, d]
                m_i = m_new
            cuda.syncthreads()

        if valid:
            inv = float32(1.0) / l_i if l_i > 0 else float32(0.0)  # a row that sees no key: 0
            for d in range(d_n):
                out[b, h, row, d] = store(acc[d] * inv)

    return fa2_fwd


def _as_numba(t: torch.Tensor):
    """A zero-copy Numba view of a tensor (bf16 as its int16 bits): a device array, or numpy in the simulator."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if simulator():
        return t.detach().numpy()
    from numba import cuda  # noqa: PLC0415

    return cuda.as_cuda_array(t.detach(), sync=False)


def numba_attention(q, k, v, *, causal, scale, seqused_k=None):
    b, hq, sq, d = q.shape
    if d > D_MAX:
        raise ValueError(f"the numba kernel supports head_dim <= {D_MAX}, got {d}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the numba kernel takes float16/bfloat16, got {q.dtype}")
    if q.device.type == "cpu" and not simulator():
        raise ValueError("the numba kernel needs CUDA tensors (or NUMBA_ENABLE_CUDASIM=1 for the CPU simulator)")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    has_seq = seqused_k is not None
    seq = seqused_k if has_seq else torch.zeros(1, dtype=torch.int32, device=q.device)
    grid = (math.ceil(sq / BLOCK_M), hq, b)
    args = (_as_numba(q), _as_numba(k), _as_numba(v), _as_numba(out), _as_numba(seq), has_seq, float(scale),
            bool(causal), hq // k.shape[1])
    kernel = _kernel(q.dtype == torch.bfloat16)
    if simulator():
        kernel[grid, BLOCK_M](*args)
    else:
        from numba import cuda  # noqa: PLC0415

        stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
        kernel[grid, BLOCK_M, stream](*args)
    return out


register_attention("numba", numba_attention, dtypes=(torch.float16, torch.bfloat16),
                   head_dims=tuple(range(1, D_MAX + 1)), devices=("cuda", "cpu") if simulator() else ("cuda",),
                   supports_seqused_k=True,
                   description="FlashAttention-2 forward in numba-cuda (shared-memory tiles, scalar FMA, no MMA)",
                   requires=_missing)
