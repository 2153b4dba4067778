"""The FP8-cache prefill kernel's schedule and epilogue, simulated on the CPU (kernels/flash_prefill_fp8kv_kernel.cuh):
which packed rows each (row block, warp) owns, how many 64-key tiles a causal block reads, which tiles it masks per
element and how, the online softmax over them, and where the epilogue's 16-byte stores put each lane's accumulators.
The fragment layouts themselves (K/V byte tiles, Q, P V's key and channel orders) are the decode kernel's, simulated by
tests/test_fp8kv_fragments.py; here a warp's S and O tiles are dense float64 matrices. Every output element must be
written exactly once and equal float64 attention with the kernel's causal convention (bottom-right, seqused_k), over
awkward shapes: q_len 33 .. 300, q_len == kv_len, kv_len not a multiple of 64, MHA/GQA/MQA. The kernel's own lines
for each index are checked to be in its source, so a change there fails here until this simulation follows it.

    pytest tests/test_fp8kv_prefill_schedule.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "flash_prefill_fp8kv_kernel.cuh"
ROWS, BLOCK_N, WARPS = 64, 64, 4  # PrefillFp8KvConfig<D>::Tile: 4 warps x 16 rows
SOURCE_LINES = (
    "const int row_block = gridDim.x - 1 - blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;",
    "const Fp8KvPrefillBlock blk(fp, row_block, kv_head, batch, kRows, kBlockN);",  # in the decode kernel's header:
    "row0 = row_block * rows_per_block;",
    "causal_offset = seqlen_k - p.seqlen_q;",
    "n_tiles = (seqlen_k + block_n - 1) / block_n;",
    "const int last_row = min(row0 + rows_per_block, num_rows) - 1;",
    "const int visible = max(last_row / group + causal_offset + 1, 0);",
    "n_tiles = min(n_tiles, (visible + block_n - 1) / block_n);",
    "const int wrow0 = row0 + warp * 16;",
    "const int warp_first_limit = params.causal ? wrow0 / group + causal_offset : seqlen_k - 1;",
    "if (key0 + kBlockN > seqlen_k || key0 + kBlockN - 1 > warp_first_limit) {",
    "const int limit = params.causal ? min((wrow0 + g + 8 * r) / group + causal_offset, seqlen_k - 1) : seqlen_k - 1;",
    "if (key0 + 16 * sl + 4 * t + 2 * n + e > limit) acc_s[0][2 * sl + n][2 * r + e] = -INFINITY;",
    "const int head = kv_head * group + row % group, qi = row / group;",
    "w[j] = pack2<T>(st.acc_o[0][2 * j][2 * r + e] * inv, st.acc_o[0][2 * j + 1][2 * r + e] * inv);",
    "uint4* dst = reinterpret_cast<uint4*>(o + (2 * t + e) * kDT);",
    "for (int c = 0; c < kDT / 8; ++c) dst[c] = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);",
    "const float lse = total > 0.f ? ((mx == -INFINITY ? 0.f : mx) + __log2f(total)) * kLn2 : -INFINITY;",
)


def test_the_simulated_lines_are_the_kernels():
    text = " ".join((KERNEL.read_text() + KERNEL.with_name("flash_decode_fp8kv_kernel.cuh").read_text()).split())
    for line in SOURCE_LINES:
        assert " ".join(line.split()) in text, line


def _simulate(q, k, v, seqlen_k, causal):
    """The kernel's output (Hq, Sq, D) and lse for one batch entry, from its schedule; NaN where never written."""
    hq, sq, d = q.shape
    hkv = k.shape[0]
    group, num_rows, kdt = hq // hkv, hq // hkv * sq, d // 8
    causal_offset = seqlen_k - sq
    out = np.full((hq, sq, d), np.nan)
    lse_out = np.full((hq, sq), np.nan)
    writes = np.zeros((hq, sq, d), dtype=int)
    for kv_head in range(hkv):
        for row_block in range(-(-num_rows // ROWS)):
            row0 = row_block * ROWS
            n_tiles = -(-seqlen_k // BLOCK_N)
            if causal:
                last_row = min(row0 + ROWS, num_rows) - 1
                visible = max(last_row // group + causal_offset + 1, 0)
                n_tiles = min(n_tiles, -(-visible // BLOCK_N))
            n_tiles = max(n_tiles, 0)
            for warp in range(WARPS):
                wrow0 = row0 + warp * 16
                rows = np.arange(wrow0, wrow0 + 16)
                qr = np.zeros((16, d))
                ok = rows < num_rows
                qr[ok] = q[kv_head * group + rows[ok] % group, rows[ok] // group]  # zero padding rows
                warp_first_limit = wrow0 // group + causal_offset if causal else seqlen_k - 1
                row_limit = (np.minimum(rows // group + causal_offset, seqlen_k - 1) if causal
                             else np.full(16, seqlen_k - 1))
                m = np.full(16, -np.inf)
                l, acc = np.zeros(16), np.zeros((16, d))
                for i in range(n_tiles):
                    key0 = i * BLOCK_N
                    keys = np.arange(key0, key0 + BLOCK_N)
                    kt = np.zeros((BLOCK_N, d))
                    vt = np.zeros((BLOCK_N, d))
                    valid = keys < seqlen_k  # load_kv zero-fills rows past the valid keys
                    kt[valid], vt[valid] = k[kv_head, keys[valid]], v[kv_head, keys[valid]]
                    s = qr @ kt.T / np.sqrt(d)
                    hidden = keys[None, :] > row_limit[:, None]
                    if key0 + BLOCK_N > seqlen_k or key0 + BLOCK_N - 1 > warp_first_limit:
                        s = np.where(hidden, -np.inf, s)
                    else:  # an unmasked tile must hold no key that some row of the warp may not see
                        assert not hidden[ok].any(), (wrow0, key0)
                    m_new = np.maximum(m, s.max(1))
                    mm = np.where(m_new == -np.inf, 0.0, m_new)
                    p = np.exp(s - mm[:, None])
                    alpha = np.exp(m - mm)
                    l = l * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p @ vt
                    m = m_new
                for r16 in range(16):  # the epilogue: lane (g, t) holds rows g, g + 8; C column 2t + e of n-tile j
                    row = wrow0 + r16
                    if row >= num_rows:
                        continue
                    inv = 1.0 / l[r16] if l[r16] > 0 else 0.0
                    head, qi = kv_head * group + row % group, row // group
                    for t in range(4):
                        for e in range(2):
                            acc_o = [acc[r16, (2 * t + e) * kdt + j] for j in range(kdt)]  # acc_o[j][2r + e]
                            w = [(acc_o[2 * j] * inv, acc_o[2 * j + 1] * inv) for j in range(kdt // 2)]
                            base = (2 * t + e) * kdt
                            for c in range(kdt // 8):
                                for x, pair in enumerate(w[4 * c:4 * c + 4]):
                                    for y in range(2):
                                        out[head, qi, base + 8 * c + 2 * x + y] = pair[y]
                                        writes[head, qi, base + 8 * c + 2 * x + y] += 1
                    lse_out[head, qi] = m[r16] + np.log(l[r16]) if l[r16] > 0 else -np.inf
    assert (writes == 1).all(), "every output element written exactly once"
    return out, lse_out


def _float64(q, k, v, seqlen_k, causal):
    hq, sq, d = q.shape
    if seqlen_k == 0:
        return np.zeros_like(q), np.full((hq, sq), -np.inf)
    group = hq // k.shape[0]
    kk, vv = np.repeat(k[:, :seqlen_k], group, 0), np.repeat(v[:, :seqlen_k], group, 0)
    s = q @ kk.transpose(0, 2, 1) / np.sqrt(d)
    if causal:
        s = np.where(np.arange(seqlen_k)[None, :] > np.arange(sq)[:, None] + seqlen_k - sq, -np.inf, s)
    mx = s.max(-1, keepdims=True)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - safe)
    tot = p.sum(-1, keepdims=True)
    out = np.where(tot > 0, (p @ vv) / np.where(tot > 0, tot, 1.0), 0.0)
    return out, np.where(tot[..., 0] > 0, safe[..., 0] + np.log(np.where(tot[..., 0] > 0, tot[..., 0], 1.0)),
                         -np.inf)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("sq,n,used", [(33, 33, 33), (37, 200, 200), (65, 130, 130), (129, 129, 129),
                                       (300, 777, 777), (45, 300, 100), (40, 300, 20), (70, 64, 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_and_epilogue_give_attention(heads, sq, n, used, causal):
    """seqused_k below q_len (rows that see no key: 0 and lse -inf), 0 keys, q_len == kv_len, odd lengths."""
    hq, hkv = heads
    d = 64
    rng = np.random.default_rng(hq * 1000 + sq + n + used)
    q = rng.standard_normal((hq, sq, d))
    k, v = rng.standard_normal((hkv, n, d)), rng.standard_normal((hkv, n, d))
    got, lse = _simulate(q, k, v, used, causal)
    want, want_lse = _float64(q, k, v, used, causal)
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert np.array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=1e-12)


Q_LINES = (
    "uint32_t* dst = sQ + (((r / 16) * kKP + c / 4) * 32 + (r % 8) * 4 + c % 4) * 8 + (r % 16) / 8;",
    "dst[0] = h.x, dst[2] = h.y, dst[4] = h.z, dst[6] = h.w;",
    "const uint4 a = *reinterpret_cast<const uint4*>(sQ + ((warp * kKP + p) * 32 + lane) * 8 + 4 * h);",
    "q_frag[p][h][0] = a.x, q_frag[p][h][1] = a.y, q_frag[p][h][2] = a.z, q_frag[p][h][3] = a.w;",
)


@pytest.mark.parametrize("d", [64, 128])
def test_q_staged_in_fragment_order_gives_the_decode_kernels_fragments(d):
    """Q is staged in fragment order, not the decode kernel's row-major swizzled tile: every lane's two A fragments of
    each k-step pair p must be the decode kernel's (its load_q: a[0] = lo.x, hi.x, lo.y, hi.y and a[1] = lo.z, hi.z,
    lo.w, hi.w, lo / hi the 4 words of channels 32 p + 8 t .. of rows g / g + 8), which test_fp8kv_fragments.py checks
    against the mma layouts; the 16 KB (hd 128) of the staged tile are written exactly once."""
    text = " ".join(KERNEL.read_text().split())
    for line in Q_LINES:
        assert " ".join(line.split()) in text, line
    kkp, qchunks = d // 32, d // 8
    words = {(r, c, j): (r, c, j) for r in range(ROWS) for c in range(qchunks) for j in range(4)}  # Q's words
    smem = [None] * (ROWS * d // 2)
    for (r, c, j) in words:
        pos = (((r // 16) * kkp + c // 4) * 32 + (r % 8) * 4 + c % 4) * 8 + (r % 16) // 8 + 2 * j
        assert smem[pos] is None
        smem[pos] = (r, c, j)
    assert None not in smem
    for warp in range(WARPS):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for p in range(kkp):
                lo = [(warp * 16 + g, 4 * p + t, j) for j in range(4)]
                hi = [(warp * 16 + g + 8, 4 * p + t, j) for j in range(4)]
                want = [[lo[0], hi[0], lo[1], hi[1]], [lo[2], hi[2], lo[3], hi[3]]]
                for h in range(2):
                    base = ((warp * kkp + p) * 32 + lane) * 8 + 4 * h
                    assert smem[base:base + 4] == want[h], (warp, lane, p, h)
