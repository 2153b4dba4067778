"""The host-side choices of the CUDA kernels, in Python, for the NVRTC backend: which instantiation runs, with how
many KV splits, on what grid and with how much shared memory.

The tile tables (``FwdConfig``, ``DecodeConfig``, ``kDecodeMaxRows``) are not kept here: they come from
llm_attn/_kernel_table.py, which kernels/generate_kernels.py writes from the same spec as kernels/kernel_tiles.h and
the instantiation files (tests/test_generated_kernels.py checks that they are current). The logic is a mirror of C++
code and must stay one: ``flash_fwd_num_splits`` / ``decode_num_splits`` (kernels/flash_fwd.cu),
``use_small_tiles`` / ``use_decode_kernel`` (kernels/flash_fwd_config.h), ``run_flash_fwd_`` / ``launch_fwd``
(kernels/flash_fwd_launch.cuh), ``run_flash_decode_`` / ``launch_decode`` (kernels/flash_decode_launch.cuh), the
smem formulas of ``FwdTraits`` / ``DecodeTraits``, and the Hopper kernel's choice and launch: ``use_sm90``
(kernels/flash_fwd.cu), ``sm90::launch`` / ``launch_tile`` and ``Sm90Traits`` (kernels/flash_fwd_sm90_launch.cuh,
flash_fwd_sm90_kernel.cuh), and the FP8-cache decode's (``decode_fp8kv_plan``: kernels/flash_decode_fp8kv.cu,
flash_decode_fp8kv_launch.cuh, flash_prefill_fp8kv_launch.cuh; ``prefill_fp8kv_version``: the prefill kernel's
version, by the grid or LLM_ATTN_FP8KV_PREFILL_V). tests/test_kernel_gpu.py checks ``num_splits`` against the extension's on the GPU;
tests/test_nvrtc.py compiles every instantiation listed here and checks the Hopper choice against the C++ lines it
mirrors. Pure Python: importable without CUDA.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from llm_attn import _environ
from llm_attn import _kernel_table as _table

TILE_AUTO, TILE_LARGE, TILE_WIDE, TILE_SMALL, TILE_HOPPER = 0, 1, 2, 3, 4  # FwdTile (kernels/flash.h)
DECODE_MAX_ROWS = _table.DECODE_MAX_ROWS  # kDecodeMaxRows
DTYPE_NAMES = {False: _table.DTYPES["fp16"], True: _table.DTYPES["bf16"]}  # is_bf16 -> the C++ element type


@dataclass(frozen=True)
class FwdTraits:
    """FwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kMTiles, kPipeline, kMinArch>."""

    head_dim: int
    block_m: int
    block_n: int
    n_warps: int
    m_tiles: int
    pipeline: bool
    min_arch: int

    @property
    def threads(self) -> int:
        return self.n_warps * 32

    @property
    def smem_bytes(self) -> int:  # Q tile + two stages of (K, V), 2-byte elements
        return (self.block_m * self.head_dim + 4 * self.block_n * self.head_dim) * 2

    def cpp(self) -> str:
        return (f"llm_attn::FwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, {self.n_warps}, "
                f"{self.m_tiles}, {str(self.pipeline).lower()}, {self.min_arch}>")


@dataclass(frozen=True)
class DecodeTraits:
    """DecodeTraits<kHeadDim, kMTiles, kStages>."""

    head_dim: int
    m_tiles: int
    stages: int
    threads: int = 128
    block_n: int = 64

    @property
    def smem_bytes(self) -> int:
        return (16 * self.m_tiles * self.head_dim + 2 * self.stages * self.block_n * self.head_dim) * 2

    def cpp(self) -> str:
        return f"llm_attn::DecodeTraits<{self.head_dim}, {self.m_tiles}, {self.stages}>"


@dataclass(frozen=True)
class Sm90Traits:
    """sm90::Sm90Traits<kHeadDim, kBlockN, kStages, kConsumers> (kernels/flash_fwd_sm90_kernel.cuh): the Hopper
    kernel's tile, 64 query rows per consumer warpgroup x block_n keys, a producer warpgroup and the consumers."""

    head_dim: int
    block_n: int = 128
    stages: int = 2
    consumers: int = 2

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: Q + stages x (K + V) + mbarriers + 1 KB for the 1024-byte alignment
        slabs = self.head_dim // 64
        return slabs * self.block_m * 128 + 2 * self.stages * slabs * self.block_n * 128 + (1 + 4 * self.stages) * 8 \
            + 1024

    def cpp(self) -> str:
        return f"llm_attn::sm90::Sm90Traits<{self.head_dim}, {self.block_n}, {self.stages}, {self.consumers}>"


@dataclass(frozen=True)
class FwdConfig:
    large: FwdTraits
    small: FwdTraits
    wide: FwdTraits
    wide64: FwdTraits | None  # None where kHasWide64 is false
    wide_causal_min_blocks_per_sm: int
    block_n: int  # FwdConfig<D>::kBlockN (Large's key tile), what flash_fwd_num_splits counts key tiles with


def _fwd_config(c: dict) -> FwdConfig:
    large = FwdTraits(*c["large"])
    return FwdConfig(large=large, small=FwdTraits(*c["small"]), wide=FwdTraits(*c["wide"]),
                     wide64=FwdTraits(*c["wide64"]) if c["wide64"] is not None else None,
                     wide_causal_min_blocks_per_sm=c["wide_causal_min_blocks_per_sm"], block_n=large.block_n)


CONFIGS = {d: _fwd_config(c) for d, c in _table.FWD_CONFIGS.items()}
# DecodeConfig<D>: name -> (m_tiles, stages), in the order the launch tries them.
DECODE_CONFIGS = {name: (mt, st) for name, mt, st in _table.DECODE_TRAITS}
# DecodeConfigId (kernel_tiles.h): name -> the number llm_attn.ops.force_decode forces (0 = automatic).
DECODE_CONFIG_IDS = {name: i + 1 for i, (name, _, _) in enumerate(_table.DECODE_TRAITS)}


@dataclass(frozen=True)
class Device:
    """The device facts the C++ dispatch reads (flash_fwd.cu's device_attribute)."""

    num_sms: int
    smem_per_sm: int         # cudaDevAttrMaxSharedMemoryPerMultiprocessor
    smem_per_block_optin: int  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    cc_major: int
    # flash_fwd_sm90_available(): compute capability 9.0 exactly and sm_90a code for the Hopper kernel at hand (the
    # extension: built in; NVRTC: can compile for sm_90a).
    sm90: bool = False


@dataclass(frozen=True)
class Shape:
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    is_bf16: bool = False
    tile: int = TILE_AUTO
    # The decode tuning overrides (flash_decode_force_splits / _config, kernels/flash.h): 0 = automatic.
    decode_splits: int = 0
    decode_config: int = 0


@dataclass(frozen=True)
class Launch:
    kernel: str          # the C++ name expression of the __global__ instantiation
    grid: tuple[int, int, int]
    threads: int
    smem: int
    sm90: Sm90Traits | None = None  # the Hopper kernel: takes Sm90Params (FlashFwdParams + 4 TMA descriptors)


@dataclass(frozen=True)
class Plan:
    num_splits: int
    decode: bool         # the split-KV decode kernel (needs zeroed split counters when it splits)
    launches: tuple[Launch, ...]  # in order: the kernel, then the combine kernel for a split prefill


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def use_decode_kernel(s: Shape) -> bool:
    return s.num_heads // s.num_kv_heads * s.seqlen_q <= DECODE_MAX_ROWS


def use_small_tiles(s: Shape, num_sms: int) -> bool:
    if s.tile != TILE_AUTO:
        return s.tile == TILE_SMALL
    return _cdiv(s.seqlen_q, 128) * s.num_heads * s.batch < num_sms


def decode_num_splits(s: Shape, num_sms: int) -> int:
    if s.decode_splits > 0:  # forced: clamped to the 64-key tiles
        return min(s.decode_splits, _cdiv(s.seqlen_k, 64))
    blocks = s.batch * s.num_kv_heads
    splits = min(num_sms // blocks, _cdiv(s.seqlen_k, 64), 128)
    if splits == 2 and s.seqlen_k < 1024:  # a 2-way split repays its combine only from 1024 keys
        return 1
    return max(splits, 1)


def num_splits(s: Shape, num_sms: int) -> int:
    """flash_fwd_num_splits."""
    if use_decode_kernel(s):
        return decode_num_splits(s, num_sms)
    if s.tile in (TILE_WIDE, TILE_HOPPER):
        return 1
    block_m = 64 if use_small_tiles(s, num_sms) else 128
    blocks = _cdiv(s.seqlen_q, block_m) * s.num_heads * s.batch
    n_blocks = _cdiv(s.seqlen_k, CONFIGS[s.head_dim].block_n)
    if blocks * 10 >= num_sms * 8 or n_blocks < 4:
        return 1
    splits = min(_cdiv(2 * num_sms, blocks), n_blocks // 2, 64)
    return splits if splits > 1 else 1


def fwd_kernel_name(is_bf16: bool, traits: FwdTraits, causal: bool, split: bool) -> str:
    return (f"llm_attn::flash_fwd_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}, "
            f"{str(split).lower()}>")


def combine_kernel_name(is_bf16: bool, head_dim: int) -> str:
    return f"llm_attn::flash_combine_kernel<{DTYPE_NAMES[is_bf16]}, {head_dim}>"


def decode_kernel_name(is_bf16: bool, traits: DecodeTraits) -> str:
    return f"llm_attn::flash_decode_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}>"


def sm90_kernel_name(is_bf16: bool, traits: Sm90Traits, causal: bool) -> str:
    return f"llm_attn::sm90::flash_fwd_sm90_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}>"


@functools.lru_cache(maxsize=1)
def sm90_tuning() -> tuple[int, int, int]:
    """(LLM_ATTN_SM90_BLOCKN, LLM_ATTN_SM90_PINGPONG, LLM_ATTN_SM90_CONSUMERS), read once as sm90::tuning_env does
    (empty = unset)."""
    def env(name: str, fallback: int) -> int:
        v = os.environ.get(name, "")
        try:
            return int(v) if v else fallback
        except ValueError:  # std::atoi reads a non-number as 0
            return 0
    return env("LLM_ATTN_SM90_BLOCKN", 128), env("LLM_ATTN_SM90_PINGPONG", 1), env("LLM_ATTN_SM90_CONSUMERS", 0)


def sm90_traits(head_dim: int, causal: bool, seqlen_q: int) -> Sm90Traits:
    """sm90::launch: Config<kHeadDim>; Config<128, 176> for head_dim 128 non-causal with LLM_ATTN_SM90_BLOCKN=176;
    for head_dim 64 three consumer warpgroups, Config<64, 128, 2, 3>, unless causal with seqlen_q <= 1024
    (LLM_ATTN_SM90_CONSUMERS=2|3 forces either)."""
    if head_dim == 128 and not causal and sm90_tuning()[0] == 176:
        return Sm90Traits(128, 176)
    consumers = sm90_tuning()[2]
    if head_dim == 64 and (consumers == 3 or (consumers != 2 and not (causal and seqlen_q <= 1024))):
        return Sm90Traits(64, consumers=3)
    return Sm90Traits(head_dim)


def use_sm90(s: Shape, splits: int, dev: Device) -> bool:
    """flash_fwd.cu's use_sm90: forced, or automatic where the portable kernel would not split."""
    return s.tile == TILE_HOPPER or (s.tile == TILE_AUTO and splits == 1 and dev.sm90)


def _sm90_launch(s: Shape) -> Launch:
    """sm90::launch_tile: causal (heads, m_blocks, batch), else (m_blocks, heads, batch)."""
    t = sm90_traits(s.head_dim, s.causal, s.seqlen_q)
    m_blocks = _cdiv(s.seqlen_q, t.block_m)
    grid = (s.num_heads, m_blocks, s.batch) if s.causal else (m_blocks, s.num_heads, s.batch)
    return Launch(sm90_kernel_name(s.is_bf16, t, s.causal), grid, t.threads, t.smem_bytes, t)


def _fwd_launches(s: Shape, traits: FwdTraits, split: bool, splits: int) -> tuple[Launch, ...]:
    """launch_fwd."""
    m_blocks = _cdiv(s.seqlen_q, traits.block_m)
    heads_first = s.causal and not split
    grid = ((s.num_heads, m_blocks) if heads_first else (m_blocks, s.num_heads)) + (s.batch * (splits if split else 1),)
    main = Launch(fwd_kernel_name(s.is_bf16, traits, s.causal, split), grid, traits.threads, traits.smem_bytes)
    if not split:
        return (main,)
    rows = s.batch * s.num_heads * s.seqlen_q
    return main, Launch(combine_kernel_name(s.is_bf16, s.head_dim), (_cdiv(rows, 4), 1, 1), 128, 0)


def decode_traits(s: Shape, smem_per_block_optin: int) -> DecodeTraits:
    """run_flash_decode_: a forced DecodeConfigId whose row tiles hold the rows, else the automatic choice."""
    rows = s.num_heads // s.num_kv_heads * s.seqlen_q
    forced = {i: name for name, i in DECODE_CONFIG_IDS.items()}.get(s.decode_config)
    if forced is not None and (forced == "TwoTiles" or rows <= 16):
        return DecodeTraits(s.head_dim, *DECODE_CONFIGS[forced])
    if rows > 16:
        return DecodeTraits(s.head_dim, *DECODE_CONFIGS["TwoTiles"])
    deep = DecodeTraits(s.head_dim, *DECODE_CONFIGS["Deep"])
    return deep if smem_per_block_optin >= deep.smem_bytes else DecodeTraits(s.head_dim, *DECODE_CONFIGS["Shallow"])


def plan(s: Shape, dev: Device) -> Plan:
    """run_flash_fwd with the split count the binding computes (flash_fwd_num_splits with the current tile)."""
    if s.head_dim not in CONFIGS:
        raise ValueError(f"head_dim must be 64 or 128, got {s.head_dim}")
    splits = num_splits(s, dev.num_sms)
    if use_decode_kernel(s):
        t = decode_traits(s, dev.smem_per_block_optin)
        return Plan(splits, True, (Launch(decode_kernel_name(s.is_bf16, t), (splits, s.num_kv_heads, s.batch),
                                          t.threads, t.smem_bytes),))
    if use_sm90(s, splits, dev):
        if not dev.sm90:  # run_flash_fwd: cudaErrorInvalidDeviceFunction (llm_attn.ops.force_tile checks it first)
            raise ValueError("the Hopper kernel (tile 'hopper') needs a compute capability 9.0 GPU and sm_90a code")
        return Plan(splits, False, (_sm90_launch(s),))
    cfg = CONFIGS[s.head_dim]
    if use_small_tiles(s, dev.num_sms):
        return Plan(splits, False, _fwd_launches(s, cfg.small, splits > 1, splits))
    if (not s.causal and cfg.wide64 is not None and s.tile != TILE_LARGE and splits == 1 and dev.cc_major >= 9
            and dev.smem_per_sm >= 2 * cfg.wide64.smem_bytes):
        return Plan(splits, False, _fwd_launches(s, cfg.wide64, False, 1))
    if s.tile == TILE_WIDE:
        return Plan(splits, False, _fwd_launches(s, cfg.wide, False, 1))
    if splits > 1:
        return Plan(splits, False, _fwd_launches(s, cfg.large, True, splits))
    blocks = _cdiv(s.seqlen_q, cfg.wide.block_m) * s.num_heads * s.batch
    if (s.tile == TILE_AUTO and dev.smem_per_sm >= 2 * cfg.wide.smem_bytes
            and (not s.causal or blocks >= cfg.wide_causal_min_blocks_per_sm * dev.num_sms)):
        return Plan(splits, False, _fwd_launches(s, cfg.wide, False, 1))
    return Plan(splits, False, _fwd_launches(s, cfg.large, False, 1))


def all_kernels() -> list[str]:
    """Every __global__ instantiation the AOT build compiles (the .cu files' run_flash_fwd_/run_flash_decode_ reach
    exactly these): per (head_dim, dtype, causal) Small and Large with and without split, Wide, Wide64 (non-causal); the combine
    kernel per (head_dim, dtype); the decode kernel's three traits per (head_dim, dtype)."""
    names = []
    for d, cfg in CONFIGS.items():
        for bf16 in (False, True):
            for causal in (False, True):
                for traits, split in ((cfg.small, False), (cfg.small, True), (cfg.large, False), (cfg.large, True),
                                      (cfg.wide, False)):
                    names.append(fwd_kernel_name(bf16, traits, causal, split))
                if cfg.wide64 is not None and not causal:  # run_flash_fwd_: `if constexpr (!kCausal && ...)`
                    names.append(fwd_kernel_name(bf16, cfg.wide64, causal, False))
            names.append(combine_kernel_name(bf16, d))
            for mt, st in DECODE_CONFIGS.values():
                names.append(decode_kernel_name(bf16, DecodeTraits(d, mt, st)))
    return names


def sm90_kernels() -> list[str]:
    """Every Hopper kernel instantiation the AOT build compiles for sm_90a (the flash_fwd_sm90_*.cu files reach
    exactly these through sm90::launch): Config<D> per (head_dim, dtype, causal), Config<128, 176> for head_dim
    128 non-causal (LLM_ATTN_SM90_BLOCKN=176) and Config<64, 128, 2, 3> (head_dim 64's three consumers)."""
    names = []
    for d in CONFIGS:
        for bf16 in (False, True):
            for causal in (False, True):
                names.append(sm90_kernel_name(bf16, Sm90Traits(d), causal))
                if d == 128 and not causal:
                    names.append(sm90_kernel_name(bf16, Sm90Traits(128, 176), causal))
                if d == 64:
                    names.append(sm90_kernel_name(bf16, Sm90Traits(64, consumers=3), causal))
    return names


# -- the decode over the FP8 KV cache -------------------------------------------------------------------------------
# binding.cpp's mha_decode_fp8kv: the split count is flash_decode_fp8kv_num_splits (kernels/flash_decode_fp8kv.cu:
# the fp16 decode kernel's rule, a forced count included; the decode config override does not apply), the launch
# run_flash_decode_fp8kv_ / launch_decode_fp8kv (flash_decode_fp8kv_launch.cuh): one config per row count, or two
# warp groups a block where the grid is at most one block an SM (DecodeFp8KvConfig<D>, the generated table), grid
# (splits, KV heads, batch). tests/test_nvrtc.py runs the C++ split rule and two-group choice itself against
# decode_fp8kv_num_splits / decode_fp8kv_two_groups and reads the traits' constants back from the C++.
# name -> (m_tiles, stages, warp groups)
DECODE_FP8KV_CONFIGS = {name: (mt, st, wg) for name, mt, st, wg in _table.DECODE_FP8KV_TRAITS}


@dataclass(frozen=True)
class DecodeFp8KvTraits:
    """DecodeFp8KvTraits<kHeadDim, kMTiles, kStages, kWGroups> (kernels/flash_decode_fp8kv_kernel.cuh): per warp
    group, 4 warps x 16 keys of each 64-key tile (the cache's scale block) through its own stages e4m3 K/V tiles;
    16 m_tiles rows."""

    head_dim: int
    m_tiles: int
    stages: int
    wgroups: int = 1

    block_n = 64

    @property
    def threads(self) -> int:
        return 128 * self.wgroups

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: fp16 Q + the scales (128 a group) + max(K/V stages, merge buffer)
        rows, d, wg = 16 * self.m_tiles, self.head_dim, self.wgroups
        return rows * d * 2 + 128 * wg + max(2 * wg * self.stages * self.block_n * d, 4 * wg * rows * (d + 8) * 4)

    def cpp(self) -> str:
        return f"llm_attn::DecodeFp8KvTraits<{self.head_dim}, {self.m_tiles}, {self.stages}, {self.wgroups}>"


def decode_fp8kv_kernel_name(is_bf16: bool, traits: DecodeFp8KvTraits) -> str:
    return f"llm_attn::flash_decode_fp8kv_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}>"


DECODE_COMBINE_BATCH = 16  # kDecodeCombineBatch (flash.h): the split combine's loads in flight


def decode_fp8kv_two_groups(s: Shape, splits: int, num_sms: int, smem_per_block_optin: int) -> bool:
    """flash_decode_fp8kv_two_groups: blocks of two warp groups (OneTileWG2) where one m16 row tile holds the rows,
    the grid is at most one block an SM and the config's shared memory fits the device's."""
    rows = s.num_heads // s.num_kv_heads * s.seqlen_q
    smem = DecodeFp8KvTraits(s.head_dim, *DECODE_FP8KV_CONFIGS["OneTileWG2"]).smem_bytes
    return rows <= 16 and smem <= smem_per_block_optin and splits * s.batch * s.num_kv_heads <= num_sms


def decode_fp8kv_num_splits(s: Shape, num_sms: int, smem_per_block_optin: int) -> int:
    """flash_decode_fp8kv_num_splits: where the decode kernel takes the rows, flash_fwd_num_splits (the decode rule,
    ``decode_splits`` forcing it) raised to about two blocks per SM where each split keeps >= 8 64-key tiles (and a
    first split >= 4096 keys), cut to the splits that get a tile (the kernel gives each ceil(tiles / splits)); then
    halved (and cut again) where that is more than one combine batch of splits of at most 16 tiles and the half runs
    in two-group blocks; else 1."""
    if not use_decode_kernel(s):
        return 1
    splits = num_splits(s, num_sms)
    if s.decode_splits > 0:
        return splits
    n_tiles = _cdiv(s.seqlen_k, 64)
    two = min(2 * num_sms // (s.batch * s.num_kv_heads), n_tiles // 8, 128)
    if two == 2 and s.seqlen_k < 4096:
        two = 1
    count = max(splits, two)
    if count <= 1 or n_tiles < 1:
        return count
    cut = _cdiv(n_tiles, _cdiv(n_tiles, count))
    if cut > DECODE_COMBINE_BATCH and _cdiv(n_tiles, cut) <= 16:
        half = _cdiv(n_tiles, _cdiv(n_tiles, _cdiv(cut, 2)))
        if decode_fp8kv_two_groups(s, half, num_sms, smem_per_block_optin):
            return half
    return cut


def decode_fp8kv_traits(s: Shape, splits: int, dev: Device) -> DecodeFp8KvTraits:
    """run_flash_decode_fp8kv_: blocks of two warp groups (OneTileWG2) where decode_fp8kv_two_groups says so, else
    two m16 row tiles (TwoTiles) for 17-32 rows and one (OneTile) up to 16."""
    rows = s.num_heads // s.num_kv_heads * s.seqlen_q
    if decode_fp8kv_two_groups(s, splits, dev.num_sms, dev.smem_per_block_optin):
        name = "OneTileWG2"
    else:
        name = "TwoTiles" if rows > 16 else "OneTile"
    return DecodeFp8KvTraits(s.head_dim, *DECODE_FP8KV_CONFIGS[name])


def decode_fp8kv_plan(s: Shape, dev: Device, prefill_version: int | None = None) -> Plan:
    """run_flash_decode_fp8kv with the split count binding.cpp computes: one launch of the decode kernel, the fused
    combine in it (its split counters must be zero when it splits), or, above DECODE_MAX_ROWS packed rows, one launch
    of the prefill kernel (never split): version ``prefill_version`` if 1 or 2, else prefill_fp8kv_version's choice
    (0: the grid rule; None: LLM_ATTN_FP8KV_PREFILL_V, then the grid rule)."""
    if s.head_dim not in CONFIGS:  # run_flash_decode_fp8kv: cudaErrorInvalidValue
        raise ValueError(f"the FP8-cache kernels take head_dim 64 or 128, got head_dim {s.head_dim}")
    if not use_decode_kernel(s):
        t = prefill_fp8kv_traits(s.head_dim, prefill_fp8kv_version(s, dev, prefill_version))
        rows = s.num_heads // s.num_kv_heads * s.seqlen_q
        return Plan(1, False, (Launch(prefill_fp8kv_kernel_name(s.is_bf16, t),
                                      (_cdiv(rows, t.rows), s.num_kv_heads, s.batch), t.threads, t.smem_bytes),))
    splits = decode_fp8kv_num_splits(s, dev.num_sms, dev.smem_per_block_optin)
    t = decode_fp8kv_traits(s, splits, dev)
    return Plan(splits, True, (Launch(decode_fp8kv_kernel_name(s.is_bf16, t), (splits, s.num_kv_heads, s.batch),
                                      t.threads, t.smem_bytes),))


def decode_fp8kv_kernels() -> list[str]:
    """Every FP8-cache decode instantiation the AOT build compiles (flash_decode_fp8kv_hdim{D}_{dtype}.cu through
    run_flash_decode_fp8kv_): per (head_dim, dtype) each config of DecodeFp8KvConfig<D>."""
    return [decode_fp8kv_kernel_name(tag == "bf16", DecodeFp8KvTraits(d, *cfg))
            for kind, d, tag, _, _ in _table.INSTANTIATIONS if kind == "decode_fp8kv"
            for cfg in DECODE_FP8KV_CONFIGS.values()]


# The prefill over the FP8 KV cache: run_flash_prefill_fp8kv_ / launch_prefill_fp8kv (flash_prefill_fp8kv_launch.cuh),
# PrefillFp8KvConfig<D>::Tile (the generated table) on every device, grid (row blocks, KV heads, batch), no split.
PREFILL_FP8KV_CONFIG = _table.PREFILL_FP8KV_TRAITS  # (n_warps, stages)


@dataclass(frozen=True)
class PrefillFp8KvTraits:
    """PrefillFp8KvTraits<kHeadDim, kNWarps, kStages> (kernels/flash_prefill_fp8kv_kernel.cuh): n_warps x 16 packed
    query rows, every 64-key tile (the cache's scale block) seen by every warp, stages e4m3 K/V tiles (fp16 Q staged
    in the last one)."""

    head_dim: int
    n_warps: int
    stages: int

    block_n = 64
    name = "PrefillFp8KvTraits"

    @property
    def threads(self) -> int:
        return 32 * self.n_warps

    @property
    def rows(self) -> int:
        return 16 * self.n_warps

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: the scales (128) + stages x (K + V) bytes
        return 128 + self.stages * 2 * self.block_n * self.head_dim

    def cpp(self) -> str:
        return f"llm_attn::{self.name}<{self.head_dim}, {self.n_warps}, {self.stages}>"


# v2: PrefillFp8KvConfig<D>::V2, each K/V tile converted to fp16 once per block in shared memory (on grids of more
# than half a wave: prefill_fp8kv_version).
PREFILL_FP8KV_V2_CONFIG = _table.PREFILL_FP8KV_V2_TRAITS  # (n_warps, stages)


@dataclass(frozen=True)
class PrefillFp8KvV2Traits(PrefillFp8KvTraits):
    """PrefillFp8KvV2Traits<kHeadDim, kNWarps, kStages> (kernels/flash_prefill_fp8kv_v2.cuh): v1's rows and key tile,
    stages e4m3 byte stages and two fp16 tiles (fp16 Q staged in the second)."""

    name = "PrefillFp8KvV2Traits"

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: the scales (128) + stages x (K + V) bytes + 2 x (K + V) fp16
        return super().smem_bytes + 2 * 2 * self.block_n * self.head_dim * 2


def prefill_fp8kv_forced() -> int:
    """LLM_ATTN_FP8KV_PREFILL_V as flash_prefill_fp8kv_version reads it per call: "1" or "2" forces that version of
    the FP8-cache prefill kernel; 0 (unset, anything else): the grid rule chooses."""
    v = _environ.get("LLM_ATTN_FP8KV_PREFILL_V")  # per call: the read that does not raise when unset
    return 1 if v == "1" else 2 if v == "2" else 0


def prefill_fp8kv_version(s: Shape, dev: Device, forced: int | None = None) -> int:
    """flash_prefill_fp8kv_version (kernels/flash_decode_fp8kv.cu): ``forced`` (None: prefill_fp8kv_forced()) if 1 or
    2, else v2 where its 128-row blocks x KV heads x batch are more than half the device's SMs, v1 otherwise (v1's
    twice as many 64-row blocks then still get an SM each)."""
    forced = prefill_fp8kv_forced() if forced is None else forced
    if forced in (1, 2):
        return forced
    rows = s.num_heads // s.num_kv_heads * s.seqlen_q
    blocks = _cdiv(rows, prefill_fp8kv_traits(s.head_dim, 2).rows) * s.num_kv_heads * s.batch
    return 2 if 2 * blocks > dev.num_sms else 1


def prefill_fp8kv_traits(head_dim: int, version: int) -> PrefillFp8KvTraits | PrefillFp8KvV2Traits:
    """run_flash_prefill_fp8kv_: PrefillFp8KvConfig<D>::Tile for version 1, ::V2 otherwise."""
    if version == 1:
        return PrefillFp8KvTraits(head_dim, *PREFILL_FP8KV_CONFIG)
    return PrefillFp8KvV2Traits(head_dim, *PREFILL_FP8KV_V2_CONFIG)


def prefill_fp8kv_kernel_name(is_bf16: bool, traits: PrefillFp8KvTraits | PrefillFp8KvV2Traits) -> str:
    return f"llm_attn::flash_prefill_fp8kv_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}>"


def prefill_fp8kv_kernels() -> list[str]:
    """Every FP8-cache prefill instantiation the AOT build compiles (flash_prefill_fp8kv_hdim{D}_{dtype}.cu through
    run_flash_prefill_fp8kv_): per (head_dim, dtype) PrefillFp8KvConfig<D>::Tile (v1) and ::V2."""
    return [prefill_fp8kv_kernel_name(tag == "bf16", prefill_fp8kv_traits(d, version))
            for kind, d, tag, _, _ in _table.INSTANTIATIONS if kind == "prefill_fp8kv" for version in (1, 2)]


# -- the FP8 static cache's one-token append ----------------------------------------------------------------------
# binding.cpp's fp8_cache_append: run_fp8_cache_append (kernels/fp8_cache_append.cu), one launch of
# fp8_cache_append_kernel.cuh's kernel per (head_dim, dtype), grid (KV heads, batch), no dynamic shared memory.
FP8_CACHE_APPEND_THREADS = 1024  # fp8cache::kAppendThreads (tests/test_nvrtc.py reads it back from the C++)


def fp8_cache_append_kernel_name(is_bf16: bool, head_dim: int) -> str:
    return f"llm_attn::fp8cache::fp8_cache_append_kernel<{DTYPE_NAMES[is_bf16]}, {head_dim}>"


def fp8_cache_append_launch(batch: int, kv_heads: int, head_dim: int, is_bf16: bool) -> Launch:
    return Launch(fp8_cache_append_kernel_name(is_bf16, head_dim), (kv_heads, batch, 1), FP8_CACHE_APPEND_THREADS, 0)


def fp8_cache_append_kernels() -> list[str]:
    """Every instantiation run_fp8_cache_append reaches: head_dim 64 and 128, fp16 and bf16 tokens."""
    return [fp8_cache_append_kernel_name(bf16, d) for d in (64, 128) for bf16 in (False, True)]


# -- the FP8 cache's dequantised copy --------------------------------------------------------------------------------
# binding.cpp's fp8_cache_dequant: run_fp8_cache_dequant (kernels/fp8_cache_dequant.cu), one launch of
# fp8_cache_dequant_kernel.cuh's kernel per (head_dim, dtype of the copy): a thread per 16 e4m3 bytes of one token,
# grid x over one (batch, KV head)'s n x head_dim / 16 chunks, y over batch x KV heads, z K and V; no shared memory.
FP8_CACHE_DEQUANT_THREADS = 256  # fp8dequant::kDequantThreads (tests/test_nvrtc.py reads it back from the C++)


def fp8_cache_dequant_kernel_name(is_bf16: bool, head_dim: int) -> str:
    return f"llm_attn::fp8dequant::fp8_cache_dequant_kernel<{DTYPE_NAMES[is_bf16]}, {head_dim}>"


def fp8_cache_dequant_launch(batch: int, kv_heads: int, head_dim: int, n: int, is_bf16: bool) -> Launch:
    """The launch of a copy of n >= 1 tokens (n == 0 launches nothing)."""
    chunks = n * (head_dim // 16)
    return Launch(fp8_cache_dequant_kernel_name(is_bf16, head_dim),
                  (-(-chunks // FP8_CACHE_DEQUANT_THREADS), batch * kv_heads, 2), FP8_CACHE_DEQUANT_THREADS, 0)


def fp8_cache_dequant_kernels() -> list[str]:
    """Every instantiation run_fp8_cache_dequant reaches: head_dim 64 and 128, an fp16 and a bf16 copy."""
    return [fp8_cache_dequant_kernel_name(bf16, d) for d in (64, 128) for bf16 in (False, True)]


# -- the low-precision forwards ------------------------------------------------------------------------------------
# Each call runs a quantising pre-pass, then the attention kernel, all on the caller's stream: FP8 on Hopper
# (kernels/flash_fp8.h; the launch is flash_fwd_fp8_sm90_launch.cuh's launch_fp8_tile, the workspace binding.cpp's
# mha_fwd_fp8) and INT8 on sm_80-90 (kernels/flash_int8.h; run_flash_fwd_int8_quant_ in flash_fwd_int8.cu,
# launch_fwd_int8 in flash_fwd_int8_launch.cuh, the workspace flash_fwd_int8_workspace). The constants below are
# those headers' (tests/test_nvrtc.py reads the C++ values back through NVRTC and compares).
QUANT_THREADS = 256       # fp8::kThreads, int8fwd::kQuantThreads: the block of every pre-pass kernel
FP8_Q_BLOCK = 64          # kFp8QBlock: query rows per block of the Q pre-pass (one scale per row)
FP8_K_BLOCK = 64          # kFp8KBlock: keys per K scale
FP8_K_BLOCK_PV_INPUT = 32  # kFp8KBlockPvInput: the same with P V in the input dtype
FP8_KV_CHUNK = 128        # kFp8KvChunk: keys per block of the K/V quantisation, and V^T's row padding
FP8_STATS_KEYS = 512      # fp8_kv_stats_kernel's kRows: keys per block of the channel statistics
FP8_PV_INPUT_MAX_BLOCK_N = 192  # kFp8PvInputMaxBlockN: the widest key tile with P V in the input dtype
INT8_BLOCK_N = 128        # kInt8BlockN: keys per key tile
INT8_K_BLOCK = 32         # kInt8KBlock: keys per K scale
INT8_MAX_STAT_CHUNKS = 32  # kInt8MaxStatChunks


@dataclass(frozen=True)
class Fp8Traits:
    """sm90::Fp8Traits<kHeadDim, kStages, kBlockN, kQkInt8, kPvInput> (kernels/flash_fwd_fp8_sm90_kernel.cuh): a
    producer and two consumer warpgroups (128 query rows) x block_n keys per S tile, with stages K/V^T buffers (K/V
    with pv_input: V in the input dtype, in 64-column slabs as the bf16 kernel's)."""

    head_dim: int
    stages: int = 2
    block_n: int = 128
    qk_int8: bool = False  # kQkInt8: S = Q K^T in int8 (wgmma s8) rather than e4m3
    pv_input: bool = False  # kPvInput: P V in the input dtype (the caller's V); int8 Q K^T only

    block_m = 128
    threads = 384

    @property
    def vt_box_keys(self) -> int:  # kVtBoxKeys: keys per V^T box (the swizzle width in bytes)
        return 128 if self.block_n % 128 == 0 else 64

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: Q + stages x (K + V^T) e4m3 tiles + mbarriers + 1 KB for alignment
        v = self.block_n * self.head_dim * 2 if self.pv_input else self.head_dim * self.block_n  # 2-byte V, or V^T
        return self.block_m * self.head_dim + self.stages * (self.block_n * self.head_dim + v) \
            + (1 + 4 * self.stages) * 8 + 1024

    def cpp(self) -> str:  # the name the AOT build's launch instantiates (defaults left out where it leaves them)
        tail = (f", {self.block_n}, true, true" if self.pv_input else f", {self.block_n}, true" if self.qk_int8
                else f", {self.block_n}" if self.block_n != 128 else "")
        return f"llm_attn::sm90::Fp8Traits<{self.head_dim}, {self.stages}{tail}>"


@dataclass(frozen=True)
class Int8Traits:
    """int8fwd::Int8FwdTraits<kHeadDim, kFp8PV> (kernels/flash_fwd_int8_kernel.cuh): 8 warps x 16 query rows, 128-key
    tiles double-buffered; P V in e4m3 (fp8_pv, sm_89 only) or in the input dtype."""

    head_dim: int
    fp8_pv: bool

    block_m = 128
    threads = 256

    @property
    def smem_bytes(self) -> int:  # 2 stages of (K int8 + V) + the int8 Q fragments (fp8_pv)
        k = INT8_BLOCK_N * self.head_dim
        v = self.head_dim * INT8_BLOCK_N if self.fp8_pv else INT8_BLOCK_N * self.head_dim * 2
        return 2 * (k + v) + (self.block_m * self.head_dim if self.fp8_pv else 0)

    def cpp(self) -> str:
        return f"llm_attn::int8fwd::Int8FwdTraits<{self.head_dim}, {str(self.fp8_pv).lower()}>"


def fp8_kernel_name(is_bf16: bool, traits: Fp8Traits, causal: bool) -> str:
    return f"llm_attn::sm90::flash_fwd_fp8_sm90_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}>"


def fp8_prepass_names(is_bf16: bool, head_dim: int, qk_int8: bool = False,
                      pv_input: bool = False) -> tuple[str, str, str]:
    """The FP8 pre-pass kernels in launch order: K/V channel statistics, Q, K and V^T (kernels/quant_fp8.cuh); Q and
    K in int8 with ``qk_int8``; with ``pv_input`` (int8 Q K^T) K's statistics and K only (kStatsV, kWriteV false: V
    is read as it is). Spelled as launch_fp8_tile instantiates them (defaults left out where it leaves them)."""
    t = f"{DTYPE_NAMES[is_bf16]}, {head_dim}"
    qk = f"{t}, {str(qk_int8).lower()}"
    if pv_input:
        return (f"llm_attn::fp8::fp8_kv_stats_kernel<{t}, false>", f"llm_attn::fp8::fp8_quant_q_kernel<{t}, true>",
                f"llm_attn::fp8::fp8_quant_kv_kernel<{t}, true, false>")
    return (f"llm_attn::fp8::fp8_kv_stats_kernel<{t}>", f"llm_attn::fp8::fp8_quant_q_kernel<{qk}>",
            f"llm_attn::fp8::fp8_quant_kv_kernel<{qk}>")


def int8_kernel_name(is_bf16: bool, traits: Int8Traits, causal: bool) -> str:
    return f"llm_attn::int8fwd::flash_fwd_int8_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}>"


def int8_prepass_names(is_bf16: bool, head_dim: int, fp8_pv: bool) -> tuple[str, str]:
    """The INT8 pre-pass kernels in launch order: K/V statistics, K (and V^T) quantisation
    (flash_fwd_int8_quant.cuh)."""
    return tuple(f"llm_attn::int8fwd::{k}<{DTYPE_NAMES[is_bf16]}, {head_dim}, {str(fp8_pv).lower()}>"
                 for k in ("int8_kv_stats_kernel", "int8_quant_kv_kernel"))


def fp8_seqlen_k_pad(seqlen_k: int) -> int:
    """fp8_seqlen_k_pad: V^T's keys per row, whole 128-key chunks plus one of zeros."""
    return (_cdiv(seqlen_k, FP8_KV_CHUNK) + 1) * FP8_KV_CHUNK


def int8_seqlen_k_pad(seqlen_k: int) -> int:
    return _cdiv(seqlen_k, INT8_BLOCK_N) * INT8_BLOCK_N


def int8_stat_chunks(seqlen_k: int) -> int:
    """int8_stat_chunks: chunks of int8_stat_chunk_keys keys (at least 256, at most INT8_MAX_STAT_CHUNKS chunks)."""
    chunk = max(256, _cdiv(_cdiv(seqlen_k, INT8_MAX_STAT_CHUNKS), 256) * 256)
    return _cdiv(seqlen_k, chunk)


def _tuning_env(name: str, fallback: int) -> int:
    """sm90::tuning_env: the variable as std::atoi reads it (a non-number is 0), the fallback when unset or empty."""
    v = os.environ.get(name, "")
    try:
        return int(v) if v else fallback
    except ValueError:
        return 0


@functools.lru_cache(maxsize=1)
def fp8_tuning() -> tuple[int, int]:
    """(LLM_ATTN_FP8_BLOCK_N, LLM_ATTN_FP8_STAGES), read once as flash_fp8.cu and launch_fp8 do (0 / 2 when unset)."""
    return _tuning_env("LLM_ATTN_FP8_BLOCK_N", 0), _tuning_env("LLM_ATTN_FP8_STAGES", 2)


def fp8_qk(qk: str = "") -> str:
    """flash_fwd_fp8_qk: the Q K^T operands of a call that asks for `qk` ("" = LLM_ATTN_FP8_QK if it is 'e4m3', else
    int8)."""
    if qk:
        return qk
    return "e4m3" if _environ.get("LLM_ATTN_FP8_QK") == "e4m3" else "int8"


def fp8_block_n(head_dim: int, requested: int = 0, pv: str = "", qk: str = "") -> int:
    """flash_fwd_fp8_block_n: the key tile a call runs, `requested` or else LLM_ATTN_FP8_BLOCK_N or else the build's
    default for its operands: with int8 Q K^T (`qk`, "" as fp8_qk resolves it) and e4m3 P V Fp8Tiles<D>'s
    kDefaultBlockNInt8 (_kernel_table.FP8_INT8_DEFAULT), otherwise its kDefaultBlockN (_kernel_table.FP8_BLOCK_N, the
    first); 0 when no such tile is built. P V in the input dtype (pv "input") has the tiles up to
    FP8_PV_INPUT_MAX_BLOCK_N (a wider request gets 0, a wider LLM_ATTN_FP8_BLOCK_N the default); 0 for a pv that is
    neither ("" = e4m3)."""
    if pv not in ("", "e4m3", "input"):
        return 0
    tiles = _table.FP8_BLOCK_N.get(head_dim, ())
    env = fp8_tuning()[0]
    if pv == "input":
        if requested > FP8_PV_INPUT_MAX_BLOCK_N:
            return 0
        env = 0 if env > FP8_PV_INPUT_MAX_BLOCK_N else env
    default = (_table.FP8_INT8_DEFAULT.get(head_dim, 0) if pv != "input" and fp8_qk(qk) == "int8"
               else tiles[0] if tiles else 0)
    n = requested or env or default
    return n if n in tiles else 0


def fp8_traits(head_dim: int, block_n: int, qk_int8: bool = False, pv_input: bool = False) -> Fp8Traits:
    """launch_fp8: the 192- and 256-key tiles with two stages; the 128-key one with three where
    LLM_ATTN_FP8_STAGES=3; P V in the input dtype: Fp8Traits<D, 2, block_n, true, true>, two stages whatever
    LLM_ATTN_FP8_STAGES says."""
    if pv_input:
        return Fp8Traits(head_dim, 2, block_n, True, True)
    if block_n == 128 and fp8_tuning()[1] == 3:
        return Fp8Traits(head_dim, 3, 128, qk_int8)
    return Fp8Traits(head_dim, 2, block_n, qk_int8)


def fp8_launches(s: Shape, traits: Fp8Traits) -> tuple[Launch, ...]:
    """launch_fp8_tile: the three pre-pass kernels, then the kernel (its parameters: Fp8Sm90Params with the tensor
    maps; the pre-pass takes FlashFwdFp8Params). Causal: heads in x, so that blocks launch longest first."""
    stats, quant_q, quant_kv = fp8_prepass_names(s.is_bf16, s.head_dim, traits.qk_int8, traits.pv_input)
    m_blocks = _cdiv(s.seqlen_q, traits.block_m)
    grid = (s.num_heads, m_blocks, s.batch) if s.causal else (m_blocks, s.num_heads, s.batch)
    return (Launch(stats, (_cdiv(s.seqlen_k, FP8_STATS_KEYS), s.num_kv_heads, s.batch), QUANT_THREADS, 0),
            Launch(quant_q, (_cdiv(s.seqlen_q, FP8_Q_BLOCK), s.num_heads, s.batch), QUANT_THREADS, 0),
            Launch(quant_kv, (fp8_seqlen_k_pad(s.seqlen_k) // FP8_KV_CHUNK, s.num_kv_heads, s.batch), QUANT_THREADS, 0),
            Launch(fp8_kernel_name(s.is_bf16, traits, s.causal), grid, traits.threads, traits.smem_bytes))


def int8_launches(s: Shape, fp8_pv: bool) -> tuple[Launch, ...]:
    """run_flash_fwd_int8: the two pre-pass kernels (none without keys), then launch_fwd_int8's kernel."""
    traits = Int8Traits(s.head_dim, fp8_pv)
    heads = s.batch * s.num_kv_heads
    stats, quant = int8_prepass_names(s.is_bf16, s.head_dim, fp8_pv)
    pre = (Launch(stats, (int8_stat_chunks(s.seqlen_k), heads, 1), QUANT_THREADS, 0),
           Launch(quant, (int8_seqlen_k_pad(s.seqlen_k) // INT8_BLOCK_N, heads, 1), QUANT_THREADS, 0))
    m_blocks = _cdiv(s.seqlen_q, traits.block_m)
    grid = (s.num_heads, m_blocks, s.batch) if s.causal else (m_blocks, s.num_heads, s.batch)
    main = Launch(int8_kernel_name(s.is_bf16, traits, s.causal), grid, traits.threads, traits.smem_bytes)
    return (pre if s.seqlen_k > 0 else ()) + (main,)


@dataclass(frozen=True)
class Fp8Workspace:
    """binding.cpp's mha_fwd_fp8 workspaces: e4m3 Q, K, V^T in one byte buffer (`bytes_` elements, in that order);
    the channel statistics (zeroed), Q, K, V scales and q . mean(K) in one float32 buffer (`floats`, in that order)."""

    q8: int
    k8: int
    vt8: int
    stats: int
    q_scale: int
    k_scale: int
    v_scale: int
    q_dot_kmean: int

    @property
    def bytes_(self) -> int:
        return self.q8 + self.k8 + self.vt8

    @property
    def floats(self) -> int:
        return self.stats + self.q_scale + self.k_scale + self.v_scale + self.q_dot_kmean


def fp8_workspace(s: Shape, pv_input: bool = False) -> Fp8Workspace:
    """The workspace sizes of a call; no V^T with P V in the input dtype (vt8 0 bytes: f.vt8 is null)."""
    b, hq, hkv, sq, sk, d = s.batch, s.num_heads, s.num_kv_heads, s.seqlen_q, s.seqlen_k, s.head_dim
    vt8 = 0 if pv_input else b * hkv * d * fp8_seqlen_k_pad(sk)
    return Fp8Workspace(q8=b * hq * sq * d, k8=b * hkv * sk * d, vt8=vt8,
                        stats=2 * b * hkv * d, q_scale=b * hq * sq,
                        k_scale=b * hkv * _cdiv(sk, FP8_K_BLOCK_PV_INPUT if pv_input else FP8_K_BLOCK),
                        v_scale=b * hkv * d, q_dot_kmean=b * hq * sq)


INT8_WORKSPACE_FIELDS = ("k_int8", "k_scale", "k_mean", "v_fp8", "v_scale", "stats")


def int8_workspace(s: Shape, fp8_pv: bool) -> tuple[dict[str, int], int]:
    """flash_fwd_int8_workspace (kernels/flash_int8.h): ({buffer: byte offset}, total bytes) of the one allocation,
    each buffer 256-byte aligned; v_fp8 and v_scale take no room without fp8_pv (their pointers are then null)."""
    heads, pad, d = s.batch * s.num_kv_heads, int8_seqlen_k_pad(s.seqlen_k), s.head_dim
    sizes = (heads * pad * d, heads * (pad // INT8_K_BLOCK) * 4, heads * d * 4,
             heads * d * pad if fp8_pv else 0, heads * d * 4 if fp8_pv else 0,
             heads * int8_stat_chunks(s.seqlen_k) * 2 * d * 4)
    offsets, at = {}, 0
    for name, size in zip(INT8_WORKSPACE_FIELDS, sizes):
        offsets[name] = at
        at += _cdiv(size, 256) * 256
    return offsets, at


def _quant_instantiations(kind: str) -> list[tuple[int, bool, bool]]:
    """(head_dim, is_bf16, causal) of every instantiation file of `kind` (kernels/generate_kernels.py's spec)."""
    return [(d, tag == "bf16", causal) for k, d, tag, causal, _ in _table.INSTANTIATIONS if k == kind]


def fp8_kernels() -> list[str]:
    """Every FP8 instantiation the AOT build compiles for sm_90a (flash_fwd_fp8_sm90_*.cu through launch_fp8): per
    (head_dim, dtype, causal) the kernel with each key tile of Fp8Tiles<D> (the 128-key one with 2 and 3 stages)
    and each Q K^T type, and those with P V in the input dtype (Fp8Traits<D, 2, 128 or 192, true, true>); per (head_dim,
    dtype) the pre-pass kernels (Q and K's for each type; the statistics and K's without V for P V in the input
    dtype)."""
    names = []
    for d, bf16, causal in _quant_instantiations("fwd_fp8_sm90"):
        for qk_int8 in (False, True):  # Q K^T in e4m3, and in int8
            for block_n in _table.FP8_BLOCK_N[d]:
                for stages in ((2, 3) if block_n == 128 else (2,)):
                    names.append(fp8_kernel_name(bf16, Fp8Traits(d, stages, block_n, qk_int8), causal))
            if causal:
                names += [n for n in fp8_prepass_names(bf16, d, qk_int8) if n not in names]
        for block_n in (128, 192):  # P V in the input dtype: its tile, and the tuning switch's
            names.append(fp8_kernel_name(bf16, Fp8Traits(d, 2, block_n, True, True), causal))
        if causal:
            names += [n for n in fp8_prepass_names(bf16, d, True, True) if n not in names]
    return names


def int8_pv_fp8(arch: str) -> bool:
    """flash_fwd_int8_fp8_pv_available: P V in e4m3 on compute capability 8.9 only."""
    return arch == "sm_89"


def int8_kernels(arch: str) -> list[str]:
    """Every INT8 instantiation that runs on `arch` ("sm_80" ..): per (head_dim, dtype, causal) of the instantiation
    files the kernel with the P V this arch takes (the AOT build also compiles the other, whose body is a trap
    there), and per (head_dim, dtype) the two pre-pass kernels."""
    pv = int8_pv_fp8(arch)
    names = []
    for d, bf16, causal in _quant_instantiations("fwd_int8"):
        names.append(int8_kernel_name(bf16, Int8Traits(d, pv), causal))
        if causal:
            names += int8_prepass_names(bf16, d, pv)
    return names


# -- the backward ------------------------------------------------------------------------------------------------
# kernels/flash_bwd.cu's flash_bwd_set_splits (which dK/dV kernel, how many blocks share a key block, the dQ way) and
# the launches of run_flash_bwd_common / run_flash_bwd_ / run_flash_bwd_sm90_ (flash_bwd_launch.cuh,
# flash_bwd_sm90_launch.cuh): the preprocessing, the dK/dV kernel (portable or Hopper), the separate dQ kernel or the
# dQ conversion, and the dK/dV conversion of a split launch. The tiles are the generated tables' (BwdTile<D>,
# BwdTileNarrow<D>); tests/test_nvrtc.py runs flash_bwd_set_splits itself (host code, nvcc) against bwd_splits and
# reads every constant below back from the C++.
BWD_TILE_IDS = {"auto": 0, "portable": 1, "narrow": 2, "hopper": 3, "hopper_own_dq": 4, "hopper_shared_dq": 5,
                "portable_separate_dq": 6, "portable_2d": 7}  # BwdTileId (kernels/flash.h), by force_bwd_tile's names
(BWD_AUTO, BWD_PORTABLE, BWD_NARROW, BWD_HOPPER, BWD_HOPPER_OWN_DQ, BWD_HOPPER_SHARED_DQ, BWD_PORTABLE_SEPARATE_DQ,
 BWD_PORTABLE_2D) = range(len(BWD_TILE_IDS))
BWD_PRE_THREADS = 128   # run_flash_bwd_common's kPreThreads: the preprocessing's block
BWD_CONV_THREADS = 256  # kConvThreads: the conversions' block


def bwd_2d_smem_bytes(head_dim: int) -> int:
    """kernels/flash.h bwd_2d_smem_bytes: the two-dimensional dK/dV kernel's shared memory (64 x 128 tiles)."""
    return (4 * 64 * head_dim + 2 * 128 * head_dim + 2 * 128 * 64) * 2 + 4 * 64 * 4


@dataclass(frozen=True)
class BwdTraits:
    """BwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kSplitDp> (kernels/flash_bwd_kernel.cuh): the portable dK/dV
    kernel's tile, 16 keys per warp, block_m query rows a step."""

    head_dim: int
    block_m: int
    block_n: int
    n_warps: int
    split_dp: int

    @property
    def threads(self) -> int:
        return self.n_warps * 32

    @property
    def smem_bytes(self) -> int:  # bwd_smem_bytes: K, V, two stages of (Q, dO), dS^T; two stages of (lse, dsum)
        d, m, n = self.head_dim, self.block_m, self.block_n
        return (4 * m * d + 2 * n * d + n * m) * 2 + 4 * m * 4

    def cpp(self) -> str:
        return (f"llm_attn::BwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, {self.n_warps}, "
                f"{self.split_dp}>")


# head_dim -> (BwdTile<D>, BwdTileNarrow<D>): BwdConfigOf<D, Tile> of flash_bwd_launch.cuh.
BWD_CONFIGS = {d: (BwdTraits(d, **_table.BWD_TILES[d]), BwdTraits(d, **_table.BWD_NARROW[d]))
               for d in _table.BWD_TILES}


@dataclass(frozen=True)
class Sm90BwdTraits:
    """sm90::Sm90BwdTraits<kHeadDim, kStages> (kernels/flash_bwd_sm90_kernel.cuh; flash_bwd_sm90_launch.cuh's
    BwdConfig<D> has 2 stages): 128 keys (64 per consumer warpgroup) x 64 query rows a step (128 at head_dim 64), a
    producer warpgroup and two consumers; a consumer's float32 dQ tile is 64 rows (dq_rows)."""

    head_dim: int
    stages: int = 2

    block_n = 128
    dq_rows = 64
    n_warps = 8  # the consumers' warps: what flash_bwd_set_splits counts a block's register share by
    threads = 384

    @property
    def block_m(self) -> int:
        return 128 if self.head_dim == 64 else 64

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: K, V; stages x (Q, dO); 2 dS^T; 2 float32 dQ tiles; lse/dsum; bars
        slabs = self.head_dim // 64
        q, kv, ds, dq = slabs * self.block_m * 128, slabs * self.block_n * 128, self.block_n * self.block_m * 2, \
            self.dq_rows * self.head_dim * 4
        return 2 * kv + 2 * self.stages * q + 2 * ds + 2 * dq + self.stages * 2 * self.block_m * 4 \
            + (1 + 2 * self.stages) * 8 + 1024

    def cpp(self) -> str:
        return f"llm_attn::sm90::Sm90BwdTraits<{self.head_dim}, {self.stages}>"


@dataclass(frozen=True)
class BwdDqTraits:
    """BwdDqTraits<kHeadDim>: the separate dQ kernel, 4 warps x 16 query rows, 64-key steps, Q, dO and two stages
    of (K, V) in shared memory."""

    head_dim: int

    block_m = 64
    threads = 128

    @property
    def smem_bytes(self) -> int:
        return 6 * 64 * self.head_dim * 2

    def cpp(self) -> str:
        return f"llm_attn::BwdDqTraits<{self.head_dim}>"


@dataclass(frozen=True)
class BwdShape:
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    is_bf16: bool = False
    force_splits: int = 0       # llm_attn.backward.force_bwd_splits (0 = automatic)
    force_tile: int = BWD_AUTO  # a BwdTileId (llm_attn.backward.force_bwd_tile)
    deterministic: bool = False  # FlashBwdParams::deterministic: the same bits on every run


@dataclass(frozen=True)
class BwdSplits:
    """The fields flash_bwd_set_splits sets in FlashBwdParams."""

    hopper: bool
    narrow: bool
    num_splits: int
    iters_per_split: int
    dq_shared: bool
    dq_separate: bool
    layout2d: bool = False  # the two-dimensional portable kernel (flash_bwd_2d_kernel.cuh)


def bwd_set_splits(s: BwdShape, dev: Device) -> BwdSplits:
    """flash_bwd_set_splits, line for line (see its comments for why each rule)."""
    wide, narrow_tile = BWD_CONFIGS[s.head_dim]
    hopper = not s.deterministic and (BWD_HOPPER <= s.force_tile <= BWD_HOPPER_SHARED_DQ
                                      or (s.force_tile == BWD_AUTO and dev.sm90))
    narrow = not hopper and (s.force_tile == BWD_NARROW or dev.smem_per_block_optin < wide.smem_bytes)
    layout2d = not hopper and dev.smem_per_block_optin >= bwd_2d_smem_bytes(s.head_dim) and (
        s.force_tile == BWD_PORTABLE_2D or (s.force_tile == BWD_AUTO and s.head_dim == 128))
    narrow = narrow and not layout2d
    tile = Sm90BwdTraits(s.head_dim) if hopper else narrow_tile if narrow else wide
    block_m, block_n = (64, 128) if layout2d else (tile.block_m, tile.block_n)
    group = s.num_heads // s.num_kv_heads
    num_m = _cdiv(s.seqlen_q, block_m)
    n_blocks = _cdiv(s.seqlen_k, block_n)
    max_iters = group * num_m
    total = 0
    for n in range(n_blocks):
        m_min = max(n * block_n - (s.seqlen_k - s.seqlen_q), 0) // block_m if s.causal else 0
        total += group * max(num_m - m_min, 0)
    total *= s.num_kv_heads * s.batch
    blocks = n_blocks * s.num_kv_heads * s.batch
    slots = (8 // tile.n_warps) * dev.num_sms
    splits = 1
    if s.force_splits > 0:
        splits = s.force_splits
    elif s.causal and blocks < 2 * slots:
        per = max(_cdiv(5 * total, 4 * slots) if hopper else _cdiv(total, 4 * slots), 8)
        splits = _cdiv(max_iters, per)
    elif not s.causal and blocks * 5 < slots * 4:
        splits = slots // blocks
    splits = max(1, min(splits, max_iters, 65535 // s.batch))
    iters = _cdiv(max_iters, splits)
    num_splits = _cdiv(max_iters, iters)
    dq_shared = s.force_tile != BWD_HOPPER_OWN_DQ
    return BwdSplits(hopper, narrow, num_splits, iters, dq_shared,
                     not hopper and (s.force_tile == BWD_PORTABLE_SEPARATE_DQ or s.deterministic), layout2d)


def bwd_kernel_names(is_bf16: bool, head_dim: int) -> tuple[str, str, str]:
    """The preprocessing, the dQ conversion and the dK/dV conversion of (dtype, head_dim)."""
    return tuple(f"llm_attn::flash_bwd_{k}_kernel<{DTYPE_NAMES[is_bf16]}, {head_dim}>"
                 for k in ("preprocess", "convert_dq", "convert_dkdv"))


def bwd_dkdv_kernel_name(is_bf16: bool, traits: BwdTraits, causal: bool) -> str:
    return f"llm_attn::flash_bwd_dkdv_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}>"


def bwd_2d_kernel_name(is_bf16: bool, head_dim: int, causal: bool) -> str:
    return (f"llm_attn::flash_bwd_dkdv_2d_kernel<{DTYPE_NAMES[is_bf16]}, llm_attn::Bwd2dTraits<{head_dim}>, "
            f"{str(causal).lower()}>")


def bwd_sm90_kernel_name(is_bf16: bool, traits: Sm90BwdTraits, causal: bool) -> str:
    return f"llm_attn::sm90::flash_bwd_sm90_kernel<{DTYPE_NAMES[is_bf16]}, {traits.cpp()}, {str(causal).lower()}>"


def bwd_dq_kernel_name(is_bf16: bool, head_dim: int, causal: bool) -> str:
    traits = BwdDqTraits(head_dim).cpp()
    return f"llm_attn::flash_bwd_dq_kernel<{DTYPE_NAMES[is_bf16]}, {traits}, {str(causal).lower()}>"


@dataclass(frozen=True)
class BwdPlan:
    """A backward call: the choices of flash_bwd_set_splits and its launches in order (``launches``). The Hopper
    dK/dV kernel (``sm90`` set) takes Sm90BwdParams (FlashBwdParams + five tensor maps), every other FlashBwdParams.
    Workspaces (binding.cpp's mha_bwd): dsum and lse_log2 always, the zeroed float32 dQ accumulator unless
    dq_separate, the zeroed float32 dK/dV accumulators when num_splits > 1 (``dkdv_slabs`` of them each: one per
    split when deterministic)."""

    splits: BwdSplits
    preprocess: Launch
    dkdv: Launch
    dq: Launch | None            # the separate dQ kernel (dq_separate)
    convert_dq: Launch | None    # not with dq_separate
    convert_dkdv: Launch | None  # a split launch only
    sm90: Sm90BwdTraits | None = None

    deterministic: bool = False

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(x for x in (self.preprocess, self.dkdv, self.dq, self.convert_dq, self.convert_dkdv) if x)

    @property
    def dkdv_slabs(self) -> int:
        return 0 if self.splits.num_splits == 1 else self.splits.num_splits if self.deterministic else 1


def bwd_plan(s: BwdShape, dev: Device) -> BwdPlan:
    """run_flash_bwd with the FlashBwdParams that mha_bwd fills (flash_bwd_set_splits on this device)."""
    if s.head_dim not in BWD_CONFIGS:
        raise ValueError(f"head_dim must be 64 or 128, got {s.head_dim}")
    if s.deterministic and BWD_HOPPER <= s.force_tile <= BWD_HOPPER_SHARED_DQ:  # binding.cpp refuses it
        raise ValueError("deterministic=True, but the Hopper backward was forced: its dQ is summed in no fixed order")
    sp = bwd_set_splits(s, dev)
    if sp.hopper and not dev.sm90:  # run_flash_bwd: cudaErrorInvalidDeviceFunction (the launcher checks it first)
        raise ValueError("the Hopper backward needs a compute capability 9.0 GPU and sm_90a code")
    d, chunks = s.head_dim, s.head_dim // 8
    pre, conv_dq, conv_dkdv = bwd_kernel_names(s.is_bf16, d)
    rows = s.batch * s.num_heads * s.seqlen_q
    sm90 = Sm90BwdTraits(d) if sp.hopper else None
    if sm90 is not None:
        block_n, threads, smem = sm90.block_n, sm90.threads, sm90.smem_bytes
        name = bwd_sm90_kernel_name(s.is_bf16, sm90, s.causal)
    elif sp.layout2d:  # launch_flash_bwd_dkdv_2d: Bwd2dTraits<D>, 128 keys, 8 warps
        block_n, threads, smem = 128, 256, bwd_2d_smem_bytes(d)
        name = bwd_2d_kernel_name(s.is_bf16, d, s.causal)
    else:
        tile = BWD_CONFIGS[d][1 if sp.narrow else 0]
        block_n, threads, smem = tile.block_n, tile.threads, tile.smem_bytes
        name = bwd_dkdv_kernel_name(s.is_bf16, tile, s.causal)
    n_blocks = _cdiv(s.seqlen_k, block_n)
    z = s.batch * sp.num_splits
    grid = (s.num_kv_heads, n_blocks, z) if s.causal else (n_blocks, s.num_kv_heads, z)
    dq = None
    if sp.dq_separate:
        t = BwdDqTraits(d)
        m_blocks = _cdiv(s.seqlen_q, t.block_m)
        dq_grid = (s.num_heads, m_blocks, s.batch) if s.causal else (m_blocks, s.num_heads, s.batch)
        dq = Launch(bwd_dq_kernel_name(s.is_bf16, d, s.causal), dq_grid, t.threads, t.smem_bytes)
    kv_rows = s.batch * s.num_kv_heads * s.seqlen_k
    return BwdPlan(
        splits=sp,
        preprocess=Launch(pre, (_cdiv(rows * chunks, BWD_PRE_THREADS), 1, 1), BWD_PRE_THREADS, 0),
        dkdv=Launch(name, grid, threads, smem),
        dq=dq,
        convert_dq=None if sp.dq_separate else Launch(conv_dq, (_cdiv(rows * chunks, BWD_CONV_THREADS), 1, 1),
                                                      BWD_CONV_THREADS, 0),
        convert_dkdv=Launch(conv_dkdv, (_cdiv(kv_rows * chunks, BWD_CONV_THREADS), 1, 1), BWD_CONV_THREADS, 0)
        if sp.num_splits > 1 else None,
        sm90=sm90, deterministic=s.deterministic)


def bwd_kernels() -> list[str]:
    """Every portable backward instantiation the AOT build compiles (the flash_bwd_*.cu files through
    run_flash_bwd_): per (head_dim, dtype, causal) the dK/dV kernel with BwdTile<D> and BwdTileNarrow<D> (one
    where they are the same), the two-dimensional dK/dV kernel and the separate dQ kernel; per (head_dim, dtype)
    the preprocessing and the two conversions."""
    names = []
    for d, bf16, causal in _quant_instantiations("bwd"):
        for traits in dict.fromkeys(BWD_CONFIGS[d]):
            names.append(bwd_dkdv_kernel_name(bf16, traits, causal))
        names.append(bwd_2d_kernel_name(bf16, d, causal))
        names.append(bwd_dq_kernel_name(bf16, d, causal))
        if causal:
            names += bwd_kernel_names(bf16, d)
    return names


def bwd_sm90_kernels() -> list[str]:
    """Every Hopper backward instantiation the AOT build compiles for sm_90a (flash_bwd_sm90_*.cu through
    run_flash_bwd_sm90_): BwdConfig<D> per (head_dim, dtype, causal). Its preprocessing and conversions are the
    portable ones (bwd_kernels), compiled for the device's arch."""
    return [bwd_sm90_kernel_name(bf16, Sm90BwdTraits(d), causal)
            for d, bf16, causal in _quant_instantiations("bwd_sm90")]
