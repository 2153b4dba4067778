"""The FP8-cache decode kernel's fragment bookkeeping, simulated on the CPU (kernels/flash_decode_fp8kv_kernel.cuh):
its byte tiles are read without ldmatrix, through permutations of the k-positions (Q K^T), of the keys (P V) and of
O's channels, and a swizzle of its own. This places every byte where the loader's swizzle put it, builds each lane's
mma.m16n8k16 operands as the kernel loads them (PTX ISA fragment layouts: A a0 = (g, 2t..2t+1), a1 = (g+8, ..),
a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g); C (g, 2t..2t+1), (g+8, ..)),
and checks that S = Q K^T and O = P V come out at the keys and channels the kernel writes them to, and that the
shared-memory loads take the fewest wavefronts NOTES.md claims. The kernel's own lines for each index are checked
to be in its source, so a change there fails here until this simulation follows it.

    pytest tests/test_fp8kv_fragments.py
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "flash_decode_fp8kv_kernel.cuh"
# The kernel's expressions this simulation mirrors (whitespace-normalised).
SOURCE_LINES = (
    "return row * kHeadDim + ((chunk ^ ((2 * (row >> 2)) & (kChunks - 1))) << 4);",
    "const int k_row0 = wq * 16 + 4 * (g >> 1) + (g & 1);",  # wq: the warp in its group of 4
    "const int v_row0 = wq * 16 + 4 * t;",
    "const int col = (((2 * p + (t >> 1)) ^ ((2 * (k_row0 >> 2)) & (Traits::kChunks - 1))) << 4) + 8 * (t & 1);",
    "const int vcol = kHeadDim == 128 ? (g ^ ((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4 : (((g >> 1) ^ "
    "((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4) + 8 * (g & 1);",
    "const uint32_t b0 = v_pair(vw[0][j / 4], vw[1][j / 4], j % 4);",
    "const uint32_t b1 = v_pair(vw[2][j / 4], vw[3][j / 4], j % 4);",
    # v_pair: byte b of x (low half) and of y (high half), by the bit trick or (sm_89+) the hardware's conversion
    "return e4m3x2_to_half2_scaled(__byte_perm(x, y, ((4 + b) << 12) | (b << 4)));",
    "return e4m3x2_to_half2_hw<0>(__byte_perm(x, y, ((4 + b) << 4) | b));",
    "a[0][0] = lo.x, a[0][1] = hi.x, a[0][2] = lo.y, a[0][3] = hi.y;",
    "a[1][0] = lo.z, a[1][1] = hi.z, a[1][2] = lo.w, a[1][3] = hi.w;",
    "static constexpr int kMergeStride = kHeadDim + 8;",
    "auto merge_pos = [](int c) { return c + 2 * (c / (2 * kDT)); };",
    "*reinterpret_cast<float2*>(dst + merge_pos((2 * t + e) * kDT + j)) = "
    "make_float2(st.acc_o[m][j][2 * r + e] * f, st.acc_o[m][j + 1][2 * r + e] * f);",
    "const float2 v = *reinterpret_cast<const float2*>(s_o + (w * kRows + row) * kMS + merge_pos(d));",
    "if (key0 + 4 * t + 2 * n + e > limit) acc_s[m][n][2 * r + e] = -INFINITY;",
)


def test_the_simulated_lines_are_the_kernels():
    text = " ".join(KERNEL.read_text().split())
    for line in SOURCE_LINES:
        assert " ".join(line.split()) in text, line


def _swz8(row, chunk, d):
    return row * d + ((chunk ^ ((2 * (row >> 2)) & (d // 16 - 1))) << 4)


def _swz(row, chunk, d):  # smem_tile.cuh's swz: fp16 elements
    return row * d + ((chunk ^ (row & 7)) << 3)


def _k_col(p, t, k_row0, d):
    return (((2 * p + (t >> 1)) ^ ((2 * (k_row0 >> 2)) & (d // 16 - 1))) << 4) + 8 * (t & 1)


def _v_col(g, v_row0, d):
    kc = d // 16
    if d == 128:
        return (g ^ ((2 * (v_row0 >> 2)) & (kc - 1))) << 4
    return (((g >> 1) ^ ((2 * (v_row0 >> 2)) & (kc - 1))) << 4) + 8 * (g & 1)


def _key(warp, n, j):
    """The key of S's n-tile n, C column j, in the tile: this lane's B column g = j loaded row k_row0 (+ 2)."""
    return warp * 16 + 4 * (j // 2) + (j % 2) + 2 * n


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_s_and_o_land_on_the_keys_and_channels_the_kernel_uses(d, m_tiles):
    rng = np.random.default_rng(d + m_tiles)
    rows, kc, kdt = 16 * m_tiles, d // 16, d // 8
    k, v, q = rng.standard_normal((64, d)), rng.standard_normal((64, d)), rng.standard_normal((rows, d))
    s_k, s_v, s_q = np.full(64 * d, np.nan), np.full(64 * d, np.nan), np.full(rows * d, np.nan)
    step = 128 // kc  # load_kv: thread tid copies chunk tid % kChunks of rows tid / kChunks + it * kRowStep
    for tid in range(128):
        for it in range(64 // step):
            row, c = tid // kc + it * step, tid % kc
            s_k[_swz8(row, c, d):][:16] = k[row, 16 * c:16 * c + 16]
            s_v[_swz8(row, c, d):][:16] = v[row, 16 * c:16 * c + 16]
    for r in range(rows):
        for c in range(d // 8):
            s_q[_swz(r, c, d):][:8] = q[r, 8 * c:8 * c + 8]
    assert not np.isnan(s_k).any() and not np.isnan(s_v).any() and not np.isnan(s_q).any()
    for warp in range(4):
        a = np.full((m_tiles, d // 16, 16, 16), np.nan)
        b = np.full((d // 16, 2, 16, 8), np.nan)
        for lane in range(32):
            g, t = divmod(lane, 4)
            k_row0 = warp * 16 + 4 * (g >> 1) + (g & 1)
            for p in range(d // 32):
                col = _k_col(p, t, k_row0, d)
                for n, row in enumerate((k_row0, k_row0 + 2)):
                    kb = s_k[row * d + col:][:8]
                    for h in range(2):  # k-step 2p: bytes 0-3, 2p + 1: bytes 4-7; b0 = bytes 0,1, b1 = 2,3
                        b[2 * p + h, n, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], g] = kb[4 * h:4 * h + 4]
                for m in range(m_tiles):
                    lo = s_q[_swz(m * 16 + g, 4 * p + t, d):][:8]
                    hi = s_q[_swz(m * 16 + g + 8, 4 * p + t, d):][:8]
                    for h in range(2):
                        a[m, 2 * p + h, g, 2 * t:2 * t + 2] = lo[4 * h:4 * h + 2]
                        a[m, 2 * p + h, g + 8, 2 * t:2 * t + 2] = hi[4 * h:4 * h + 2]
                        a[m, 2 * p + h, g, 2 * t + 8:2 * t + 10] = lo[4 * h + 2:4 * h + 4]
                        a[m, 2 * p + h, g + 8, 2 * t + 8:2 * t + 10] = hi[4 * h + 2:4 * h + 4]
        assert not np.isnan(a).any() and not np.isnan(b).any(), "a fragment element no lane loaded"
        s = np.einsum("mkrc,knco->mnro", a, b)  # (m, n-tile, 16 rows, 8 columns)
        want = q @ k.T
        p_key = np.zeros((m_tiles, 16, 64))
        for m in range(m_tiles):
            for n in range(2):
                for j in range(8):
                    np.testing.assert_allclose(s[m, n, :, j], want[16 * m:16 * m + 16, _key(warp, n, j)])
                    p_key[m, :, _key(warp, n, j)] = s[m, n, :, j]  # any P: the scores themselves
        a_pv = np.concatenate([s[:, 0], s[:, 1]], axis=2)  # p_fragment: k 0-7 = n-tile 0, 8-15 = n-tile 1
        b_pv = np.full((kdt, 16, 8), np.nan)
        for lane in range(32):
            g, t = divmod(lane, 4)
            v_row0 = warp * 16 + 4 * t
            vw = [s_v[(v_row0 + r) * d + _v_col(g, v_row0, d):][:kdt] for r in range(4)]
            for j in range(kdt):  # b0: byte j of rows 0 and 1 (keys 4t, 4t+1), b1: rows 2 and 3
                b_pv[j, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], g] = [vw[0][j], vw[1][j], vw[2][j], vw[3][j]]
        assert not np.isnan(b_pv).any()
        for m in range(m_tiles):
            o_want = p_key[m] @ v
            for j in range(kdt):
                o = a_pv[m] @ b_pv[j]  # C column c of n-tile j is channel c * kDT + j
                np.testing.assert_allclose(o, o_want[:, np.arange(8) * kdt + j])


def _wavefronts(addrs, width):
    words = defaultdict(set)
    for addr in addrs:
        for w in range(addr // 4, (addr + width - 1) // 4 + 1):
            words[w % 32].add(w)
    return max(len(s) for s in words.values())


@pytest.mark.parametrize("d", [64, 128])
def test_shared_memory_loads_take_the_fewest_wavefronts(d):
    """K: 8 rows x 32 bytes per load, the minimum (2); V: 4 whole rows, the minimum at hd128 (4), two-way at hd64."""
    for warp in range(4):
        for p in range(d // 32):
            for extra in (0, 2):
                addrs = []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    k_row0 = warp * 16 + 4 * (g >> 1) + (g & 1)
                    addrs.append((k_row0 + extra) * d + _k_col(p, t, k_row0, d))
                assert _wavefronts(addrs, 8) == 2
        for r in range(4):
            addrs = [(warp * 16 + 4 * t + r) * d + _v_col(g, warp * 16 + 4 * t, d) for g, t in
                     (divmod(lane, 4) for lane in range(32))]
            assert _wavefronts(addrs, d // 8) == 4  # hd128: the minimum; hd64: twice it (its rows share 16 banks)


def _merge_pos(c, d):
    return c + 2 * (c // (2 * (d // 8)))


@pytest.mark.parametrize("d", [64, 128])
def test_the_warp_merge_puts_each_channel_where_the_sum_reads_it_without_bank_conflicts(d):
    """The merge buffer: each lane stores O's n-tiles j, j + 1 (adjacent channels) of its rows as one float2 at
    merge_pos, in rows d + 8 floats apart; the warps' sum reads channels (c, c + 1) back as one float2."""
    kdt, stride = d // 8, d + 8
    cell = {}
    for row in range(16):
        g, r = row % 8, row // 8
        for j in range(0, kdt, 2):
            for e in range(2):
                for t in range(4):
                    c = (2 * t + e) * kdt + j
                    pos = row * stride + _merge_pos(c, d)
                    assert pos % 2 == 0 and (pos, pos + 1) not in cell
                    cell[pos], cell[pos + 1] = (row, c), (row, c + 1)  # acc_o[j], acc_o[j + 1]: channels c, c + 1
    assert len(cell) == 16 * d and max(p % stride for p in cell) < stride
    for row in range(16):
        for c in range(0, d, 2):
            pos = row * stride + _merge_pos(c, d)
            assert (cell[pos], cell[pos + 1]) == ((row, c), (row, c + 1))
    # Stores: per (m, r, j, e) a warp writes 32 float2, the minimum 2 wavefronts (natural order at stride d: 32).
    for r in range(2):
        for j in range(0, kdt, 2):
            for e in range(2):
                addrs = [4 * ((g + 8 * r) * stride + _merge_pos((2 * t + e) * kdt + j, d))
                         for g, t in (divmod(lane, 4) for lane in range(32))]
                assert _wavefronts(addrs, 8) == 2
    # The sum's loads: a warp reads 64 adjacent channels of a row: the minimum at hd128, one wavefront more at hd64.
    for base in range(0, 16 * d, 64):
        addrs = [4 * ((c // d) * stride + _merge_pos(c % d, d)) for c in range(base, base + 64, 2)]
        assert _wavefronts(addrs, 8) == (2 if d == 128 else 3)
