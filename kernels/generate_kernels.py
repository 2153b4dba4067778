#!/usr/bin/env python3
"""One table for every kernel instantiation: writes, from the spec below,

  kernels/flash_fwd_hdim{D}_{dtype}_{causal}.cu        portable prefill (mma.sync), run_flash_fwd_
  kernels/flash_fwd_sm90_hdim{D}_{dtype}_{causal}.cu   Hopper prefill (wgmma/TMA), run_flash_fwd_sm90_
  kernels/flash_decode_hdim{D}_{dtype}.cu              split-KV decode, run_flash_decode_
  kernels/flash_decode_fp8kv_hdim{D}_{dtype}.cu        split-KV decode over the FP8 KV cache, run_flash_decode_fp8kv_
  kernels/flash_prefill_fp8kv_hdim{D}_{dtype}.cu       prefill over the FP8 KV cache, run_flash_prefill_fp8kv_
  kernels/flash_bwd_hdim{D}_{dtype}_{causal}.cu        backward, run_flash_bwd_
  kernels/flash_bwd_sm90_hdim{D}_{dtype}_{causal}.cu   Hopper backward (wgmma/TMA), run_flash_bwd_sm90_
  kernels/flash_fwd_int8_hdim{D}_{dtype}_{causal}.cu   portable INT8 forward (mma.sync s8/e4m3), run_flash_fwd_int8_
  kernels/flash_fwd_fp8_sm90_hdim{D}_{dtype}_{causal}.cu  Hopper FP8 forward (wgmma e4m3), run_flash_fwd_fp8_
  kernels/kernel_tiles.h       the tile tables the launch templates read: FwdConfig<D>, DecodeConfig<D>, BwdTile<D>,
                               Fp8Tiles<D>, DecodeFp8KvConfig<D>, PrefillFp8KvConfig<D> (v1, v2)
  llm_attn/_kernel_table.py    the same tables for llm_attn/_plan.py (the NVRTC backend's mirror of the dispatch)

so that the nvcc build (setup.py compiles kernels/*.cu), NVRTC (llm_attn/_nvrtc.py compiles _plan.all_kernels())
and the Python mirror read one source. Edit the spec here, then run

  python kernels/generate_kernels.py            # rewrites the files above
  python kernels/generate_kernels.py --check    # exit 1 if a committed file differs (tests/test_generated_kernels.py)

FlashAttention-3's hopper/generate_kernels.py does the same for its instantiation files. The dispatch logic (which
config a shape gets) stays hand-written in flash_fwd_launch.cuh / flash_decode_launch.cuh and _plan.py; only the
tables are generated. Pure Python, standard library only.
"""

from __future__ import annotations

import argparse
import sys
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---- the spec -------------------------------------------------------------------------------------------------------
HEAD_DIMS = (128, 64)
DTYPES = (("fp16", "half"), ("bf16", "__nv_bfloat16"))  # (file tag, C++ element type)


class Fwd(namedtuple("Fwd", "head_dim block_m block_n n_warps m_tiles pipeline min_arch")):
    """FwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kMTiles, kPipeline, kMinArch> (flash_fwd_kernel.cuh); the
    same fields as llm_attn._plan.FwdTraits, which reads them back as plain tuples from _kernel_table.py."""

    __slots__ = ()

    def cpp(self) -> str:
        return (f"FwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, {self.n_warps}, {self.m_tiles}, "
                f"{str(self.pipeline).lower()}, {self.min_arch}>")


# The portable prefill's tiles per head_dim (why each is what it is: kernels/flash_fwd_config.h). wide64 None: no
# 64-key wide tile (FwdConfig<D>::kHasWide64 false). block_n: the key-tile size flash_fwd_num_splits counts with.
FWD_CONFIGS = {
    128: dict(large=Fwd(128, 128, 64, 8, 1, True, 0), small=Fwd(128, 64, 64, 4, 1, True, 0),
              wide=Fwd(128, 128, 32, 4, 2, False, 0), wide64=Fwd(128, 128, 64, 4, 2, False, 900),
              wide_causal_min_blocks_per_sm=3),
    64: dict(large=Fwd(64, 128, 128, 8, 1, False, 0), small=Fwd(64, 64, 64, 4, 1, True, 0),
             wide=Fwd(64, 128, 64, 4, 2, False, 0), wide64=None,
             wide_causal_min_blocks_per_sm=0),
}
# The decode kernel packs (query heads per KV head) x q_len rows into at most this many rows (two m16 tiles).
DECODE_MAX_ROWS = 32
# DecodeTraits<D, kMTiles, kStages> the decode launch chooses from (flash_decode_launch.cuh), in this order. Their
# position + 1 is their number in DecodeConfigId (kernel_tiles.h), which llm_attn.ops.force_decode forces (tuning;
# 0 = automatic). Deep4 (4 stages: 132 KB for head_dim 128, one block per SM) is never chosen automatically: it is
# there to be measured against Deep (experiments/decode_splits.py).
DECODE_TRAITS = (("TwoTiles", 2, 2), ("Deep", 1, 3), ("Shallow", 1, 2), ("Deep4", 1, 4))
# The decode kernel over the FP8 (e4m3) KV cache: DecodeFp8KvTraits<D, kMTiles, kStages, kWGroups>
# (flash_decode_fp8kv_kernel.cuh) per row count, and one m16 row tile in blocks of two warp groups where the grid is
# at most one block an SM and the device has its shared memory (DecodeFp8KvConfig<D>; flash_decode_fp8kv_launch.cuh
# says why). OneTile's 3 stages: on the H200 at B=1 32k keys 3.3 % faster than 4, 2 and 5-6 slower (kernels/NOTES.md
# "The FP8-cache decode's stage count"); 5 and 7 stages at one block an SM no faster than 3 ("Two warp groups a
# block").
DECODE_FP8KV_TRAITS = (("OneTile", 1, 3, 1), ("TwoTiles", 2, 3, 1), ("OneTileWG2", 1, 3, 2))
# The prefill over the FP8 KV cache (more rows than DECODE_MAX_ROWS): PrefillFp8KvTraits<D, kNWarps, kStages>
# (flash_prefill_fp8kv_kernel.cuh), one tile on every device (PrefillFp8KvConfig<D>::Tile; flash_prefill_fp8kv_launch.cuh
# says why): 4 warps x 16 packed rows, 3 stages of e4m3 K/V.
PREFILL_FP8KV_TRAITS = (4, 3)
# Its v2 (issue 38; the default, LLM_ATTN_FP8KV_PREFILL_V=1 selects v1): PrefillFp8KvV2Traits<D, kNWarps, kStages>
# (flash_prefill_fp8kv_v2.cuh), PrefillFp8KvConfig<D>::V2: 8 warps x 16 packed rows (each tile converted to fp16
# once per 128 rows), 2 stages of e4m3 bytes + 2 fp16 tiles (96.1 KB at head_dim 128: the 99 KB of sm_86/89).
PREFILL_FP8KV_V2_TRAITS = (8, 2)
# The backward: BwdTraits<D, kBlockM, kBlockN, kNWarps, kSplitDp> (flash_bwd_launch.cuh). Per head_dim the tile
# (BwdTile<D>) and the narrow one (BwdTileNarrow<D>) that a device takes when its shared memory per block is below
# the tile's (flash_bwd.cu): head_dim 128's 8-warp tile needs 104.5 KB, sm_86/89 give a block 99 KB.
BWD_TILES = {128: dict(block_m=32, block_n=128, n_warps=8, split_dp=1),
             64: dict(block_m=64, block_n=128, n_warps=8, split_dp=1)}
BWD_NARROW = {128: dict(block_m=32, block_n=64, n_warps=4, split_dp=1),
              64: BWD_TILES[64]}

# The FP8 forward's key tiles per head_dim: the kBlockN of Fp8Traits<D, kStages, kBlockN>
# (flash_fwd_fp8_sm90_kernel.cuh) each (head_dim, dtype, causal) file builds, the first the default (block_n 0 and
# LLM_ATTN_FP8_BLOCK_N unset).
# 192 keys amortise each tile's waits, barriers and row reductions over 1.5x the GEMM work (kernels/NOTES.md "FP8
# ... v3"): at head_dim 128 it is the default, measured 1.03-1.11x the 128-key tile on an H100 (bf16, S 8k-32k,
# causal and not); head_dim 64 keeps 128 until measured. 256 keys (H14, head_dim 128, e4m3 P V only: cuDNN's FP8
# tile) issues each tile's P V before its S, so that P and S never share the registers. The launch knows 128, 192
# and 256.
FP8_BLOCK_N = {128: (192, 128, 256), 64: (128, 192)}
# The default tile of int8 Q K^T with e4m3 P V (the default FP8 entry's kernel) where it is not FP8_BLOCK_N's first:
# 256 keys at head_dim 128, measured 1.04-1.08x the 192-key tile at 16k-64k on an H100 where e4m3 Q K^T loses
# causal rows on it (kernels/NOTES.md "H14").
FP8_INT8_DEFAULT = {128: 256}

# The instantiation files: kind -> (launch header, C++ function template, one file per causal/noncausal?).
KINDS = {
    "fwd": ("flash_fwd_launch.cuh", "run_flash_fwd_", True),
    "fwd_sm90": ("flash_fwd_sm90_launch.cuh", "run_flash_fwd_sm90_", True),
    "decode": ("flash_decode_launch.cuh", "run_flash_decode_", False),
    "decode_fp8kv": ("flash_decode_fp8kv_launch.cuh", "run_flash_decode_fp8kv_", False),
    "prefill_fp8kv": ("flash_prefill_fp8kv_launch.cuh", "run_flash_prefill_fp8kv_", False),
    "bwd": ("flash_bwd_launch.cuh", "run_flash_bwd_", True),
    "bwd_sm90": ("flash_bwd_sm90_launch.cuh", "run_flash_bwd_sm90_", True),
    "fwd_int8": ("flash_fwd_int8_launch.cuh", "run_flash_fwd_int8_", True),
    "fwd_fp8_sm90": ("flash_fwd_fp8_sm90_launch.cuh", "run_flash_fwd_fp8_", True),
}
GENERATED = "// Generated by kernels/generate_kernels.py from its spec: edit the spec there, not this file.\n"


# ---- writers --------------------------------------------------------------------------------------------------------
def instantiations() -> list[tuple[str, int, str, bool | None]]:
    """(kind, head_dim, dtype tag, causal or None) for every instantiation file, in file-name order."""
    out = []
    for kind, (_, _, causal_variants) in KINDS.items():
        for d in HEAD_DIMS:
            for tag, _ in DTYPES:
                for causal in ((False, True) if causal_variants else (None,)):
                    out.append((kind, d, tag, causal))
    return out


def file_name(kind: str, d: int, tag: str, causal: bool | None) -> str:
    stem = {"fwd": "flash_fwd", "fwd_sm90": "flash_fwd_sm90", "decode": "flash_decode", "bwd": "flash_bwd",
            "bwd_sm90": "flash_bwd_sm90", "fwd_int8": "flash_fwd_int8", "fwd_fp8_sm90": "flash_fwd_fp8_sm90",
            "decode_fp8kv": "flash_decode_fp8kv", "prefill_fp8kv": "flash_prefill_fp8kv"}[kind]
    tail = "" if causal is None else ("_causal" if causal else "_noncausal")
    return f"{stem}_hdim{d}_{tag}{tail}.cu"


def instantiation_source(kind: str, d: int, tag: str, causal: bool | None) -> str:
    header, fn, _ = KINDS[kind]
    cpp = dict(DTYPES)[tag]
    cz = "" if causal is None else ("causal" if causal else "noncausal")
    what = {
        "fwd": f"head_dim {d}, {tag}, {cz}. One file per combination keeps nvcc builds parallel.",
        "fwd_sm90": f"Hopper (sm_90a) forward, head_dim {d}, {tag}, {cz}.",
        "decode": f"split-KV decode kernel, head_dim {d}, {tag}.",
        "decode_fp8kv": f"split-KV decode kernel over the FP8 KV cache, head_dim {d}, {tag} q and o.",
        "prefill_fp8kv": f"prefill kernel over the FP8 KV cache, head_dim {d}, {tag} q and o.",
        "bwd": f"backward, head_dim {d}, {tag}, {cz}. One file per combination keeps nvcc builds parallel.",
        "bwd_sm90": f"Hopper (sm_90a) backward, head_dim {d}, {tag}, {cz}.",
        "fwd_int8": f"INT8 forward (mma.sync), head_dim {d}, {tag}, {cz}.",
        "fwd_fp8_sm90": f"Hopper (sm_90a) FP8 forward, head_dim {d}, {tag} inputs, {cz}.",
    }[kind]
    params = {"bwd": "FlashBwdParams", "bwd_sm90": "FlashBwdParams", "fwd_int8": "FlashFwdInt8Params",
              "fwd_fp8_sm90": "FlashFwdFp8Params", "decode_fp8kv": "FlashDecodeFp8KvParams",
              "prefill_fp8kv": "FlashDecodeFp8KvParams"}.get(kind, "FlashFwdParams")
    targs = f"{cpp}, {d}" + ("" if causal is None else f", {str(causal).lower()}")
    # the key tile (Fp8Tiles<D>), the S operands (Fp8Qk) and the P V operands (Fp8Pv)
    extra = ", int block_n, int qk, int pv" if kind == "fwd_fp8_sm90" else ""
    lines = [f"// Instantiation: {what}", GENERATED.rstrip("\n"), f'#include "{header}"', "", "namespace llm_attn {",
             f"template cudaError_t {fn}<{targs}>({params}& params, cudaStream_t stream{extra});"]
    if kind == "fwd_sm90":
        lines.append(f"template bool flash_fwd_sm90_built_<{targs}>();")
    if kind == "fwd_fp8_sm90" and causal:  # one availability probe per (dtype, head_dim)
        lines.append(f"template bool flash_fwd_fp8_built_<{cpp}, {d}>();")
    lines += ["}  // namespace llm_attn", ""]
    return "\n".join(lines)


def tiles_header() -> str:
    out = ["// The tile tables of the launch templates (the why of each entry: flash_fwd_config.h, flash_decode_launch.cuh,",
           "// flash_bwd_launch.cuh). llm_attn/_kernel_table.py holds the same numbers for the NVRTC backend's mirror.",
           GENERATED.rstrip("\n"), "#pragma once", "", "namespace llm_attn {", "",
           "template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMTiles_, bool kPipeline_, int kMinArch_>",
           "struct FwdTraits;", "template <int kHeadDim_, int kMTiles_, int kStages_>", "struct DecodeTraits;", "",
           "template <int kHeadDim>", "struct FwdConfig;"]
    for d, c in FWD_CONFIGS.items():
        w64 = c["wide64"]
        out += ["", "template <>", f"struct FwdConfig<{d}> {{",
                f"    using Large = {c['large'].cpp()};", f"    using Small = {c['small'].cpp()};",
                f"    using Wide = {c['wide'].cpp()};",
                f"    using Wide64 = {w64.cpp() if w64 else 'Wide'};",
                f"    static constexpr bool kHasWide64 = {'true' if w64 else 'false'};",
                f"    static constexpr int kWideCausalMinBlocksPerSm = {c['wide_causal_min_blocks_per_sm']};",
                f"    static constexpr int kBlockMLarge = {c['large'].block_m}, kBlockMSmall = {c['small'].block_m}, "
                f"kBlockN = {c['large'].block_n};",
                "};"]
    out += ["", f"constexpr int kDecodeMaxRows = {DECODE_MAX_ROWS};", "",
            "template <int kHeadDim>", "struct DecodeConfig {"]
    out += [f"    using {name} = DecodeTraits<kHeadDim, {mt}, {st}>;" for name, mt, st in DECODE_TRAITS]
    out += ["};", "", "// DecodeConfig<D>'s entries by number: what llm_attn.ops.force_decode forces (0 = automatic).",
            "enum DecodeConfigId : int { kDecodeAuto = 0, "
            + ", ".join(f"kDecode{name} = {i + 1}" for i, (name, _, _) in enumerate(DECODE_TRAITS)) + " };",
            f"constexpr int kDecodeConfigCount = {len(DECODE_TRAITS) + 1};  // with kDecodeAuto", "", "template <int kHeadDim>", "struct BwdTile;", "template <int kHeadDim>", "struct BwdTileNarrow;"]
    for name, table in (("BwdTile", BWD_TILES), ("BwdTileNarrow", BWD_NARROW)):
        for d, b in table.items():
            out += ["template <>", f"struct {name}<{d}> {{",
                    f"    static constexpr int kBlockM = {b['block_m']}, kBlockN = {b['block_n']}, "
                    f"kNWarps = {b['n_warps']}, kSplitDp = {b['split_dp']};", "};"]
    out += ["", "// The FP8 forward's key tiles per head_dim (flash_fwd_fp8_sm90_launch.cuh): the default, those built.",
            "template <int kHeadDim>", "struct Fp8Tiles;"]
    for d, tiles in FP8_BLOCK_N.items():
        out += ["template <>", f"struct Fp8Tiles<{d}> {{", f"    static constexpr int kDefaultBlockN = {tiles[0]};",
                "    // int8 Q K^T with e4m3 P V",
                f"    static constexpr int kDefaultBlockNInt8 = {FP8_INT8_DEFAULT.get(d, tiles[0])};",
                "    static constexpr bool has(int block_n) { return "
                + " || ".join(f"block_n == {n}" for n in tiles) + "; }", "};"]
    out += ["", "// The decode kernel over the FP8 KV cache (flash_decode_fp8kv_launch.cuh): one row tile, two, "
            "one in two warp groups.",
            "template <int kHeadDim_, int kMTiles_, int kStages_, int kWGroups_>", "struct DecodeFp8KvTraits;",
            "template <int kHeadDim>", "struct DecodeFp8KvConfig {"]
    out += [f"    using {name} = DecodeFp8KvTraits<kHeadDim, {mt}, {st}, {wg}>;"
            for name, mt, st, wg in DECODE_FP8KV_TRAITS]
    out += ["};"]
    out += ["", "// The prefill kernel over the FP8 KV cache (flash_prefill_fp8kv_launch.cuh): v1's tile, v2's (the default).",
            "template <int kHeadDim_, int kNWarps_, int kStages_>", "struct PrefillFp8KvTraits;",
            "template <int kHeadDim_, int kNWarps_, int kStages_>", "struct PrefillFp8KvV2Traits;",
            "template <int kHeadDim>", "struct PrefillFp8KvConfig {",
            f"    using Tile = PrefillFp8KvTraits<kHeadDim, {PREFILL_FP8KV_TRAITS[0]}, {PREFILL_FP8KV_TRAITS[1]}>;",
            f"    using V2 = PrefillFp8KvV2Traits<kHeadDim, {PREFILL_FP8KV_V2_TRAITS[0]}, {PREFILL_FP8KV_V2_TRAITS[1]}>;",
            "};"]
    out += ["", "}  // namespace llm_attn", ""]
    return "\n".join(out)


def python_table() -> str:
    def fwd(c):
        return {k: (tuple(v) if isinstance(v, Fwd) else v) for k, v in c.items()}
    lines = [
        '"""The kernel tables of kernels/generate_kernels.py, for llm_attn/_plan.py. Generated: edit the spec in',
        'kernels/generate_kernels.py and run it, not this file. Plain data, importable without CUDA."""',
        "",
        f"HEAD_DIMS = {HEAD_DIMS!r}",
        f"DTYPES = {dict(DTYPES)!r}  # file tag -> C++ element type",
        "# per head_dim: FwdTraits tuples (head_dim, block_m, block_n, n_warps, m_tiles, pipeline, min_arch), or None",
        "FWD_CONFIGS = {",
    ]
    for d, c in FWD_CONFIGS.items():
        lines.append(f"    {d}: {{")
        lines += [f"        {k!r}: {v!r}," for k, v in fwd(c).items()]
        lines.append("    },")
    lines += ["}",
              f"DECODE_MAX_ROWS = {DECODE_MAX_ROWS}",
              "# (name, m_tiles, stages) of DecodeConfig<D>, in the launch's order",
              f"DECODE_TRAITS = {DECODE_TRAITS!r}",
              "# per head_dim: BwdTile<D> (query rows per step, keys per block, warps, dP slices)",
              f"BWD_TILES = {{\n" + "".join(f"    {d}: {b!r},\n" for d, b in BWD_TILES.items()) + "}",
              "# per head_dim: BwdTileNarrow<D>, for devices whose shared memory per block is below BwdTile<D>'s",
              f"BWD_NARROW = {{\n" + "".join(f"    {d}: {b!r},\n" for d, b in BWD_NARROW.items()) + "}",
              "# (name, m_tiles, stages, warp groups) of DecodeFp8KvConfig<D>: the decode kernel over the FP8 KV cache",
              f"DECODE_FP8KV_TRAITS = {DECODE_FP8KV_TRAITS!r}",
              "# (n_warps, stages) of PrefillFp8KvConfig<D>::Tile: the prefill kernel over the FP8 KV cache",
              f"PREFILL_FP8KV_TRAITS = {PREFILL_FP8KV_TRAITS!r}",
              "# (n_warps, stages) of PrefillFp8KvConfig<D>::V2: v2 (over half a wave of blocks; LLM_ATTN_FP8KV_PREFILL_V forces)",
              f"PREFILL_FP8KV_V2_TRAITS = {PREFILL_FP8KV_V2_TRAITS!r}",
              "# per head_dim: the FP8 forward's key tiles (Fp8Tiles<D>), the first the default",
              f"FP8_BLOCK_N = {FP8_BLOCK_N!r}",
              "# per head_dim: the default tile of int8 Q K^T with e4m3 P V (Fp8Tiles<D>::kDefaultBlockNInt8)",
              f"FP8_INT8_DEFAULT = {dict((d, FP8_INT8_DEFAULT.get(d, t[0])) for d, t in FP8_BLOCK_N.items())!r}",
              "# (kind, head_dim, dtype tag, causal or None, file in kernels/) of every instantiation file",
              "INSTANTIATIONS = ("]
    lines += [f"    {(k, d, t, c, file_name(k, d, t, c))!r}," for k, d, t, c in instantiations()]
    lines += [")", ""]
    return "\n".join(lines)


def outputs() -> dict[str, str]:
    """Path relative to the repository root -> content."""
    files = {f"kernels/{file_name(*i)}": instantiation_source(*i) for i in instantiations()}
    files["kernels/kernel_tiles.h"] = tiles_header()
    files["llm_attn/_kernel_table.py"] = python_table()
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT, help="repository root to write into (default: this checkout)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a file under --out differs from the spec, or a stale "
                         "instantiation file is there")
    args = ap.parse_args(argv)
    assert all(n in FP8_BLOCK_N[d] for d, n in FP8_INT8_DEFAULT.items()), "the int8 default is a tile built"
    assert all(set(t) <= ({128, 192, 256} if d == 128 else {128, 192}) and d in HEAD_DIMS
               for d, t in FP8_BLOCK_N.items()), "FP8 tiles: 128, 192 (and 256 at head_dim 128)"
    files = outputs()
    if args.check:
        bad = [p for p, text in files.items()
               if not (args.out / p).is_file() or (args.out / p).read_text() != text]
        known = {Path(p).name for p in files}
        stale = [f"kernels/{p.name}" for p in sorted((args.out / "kernels").glob("flash_*_hdim*.cu"))
                 if p.name not in known]
        for p in bad:
            print(f"out of date: {p}")
        for p in stale:
            print(f"not in the spec: {p}")
        if bad or stale:
            print("run python kernels/generate_kernels.py")
            return 1
        print(f"{len(files)} generated files match the spec")
        return 0
    for p, text in files.items():
        dest = args.out / p
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.is_file() or dest.read_text() != text:
            dest.write_text(text)
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
