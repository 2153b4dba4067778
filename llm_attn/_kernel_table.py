"""The kernel tables of kernels/generate_kernels.py, for llm_attn/_plan.py. Generated: edit the spec in
kernels/generate_kernels.py and run it, not this file. Plain data, importable without CUDA."""

HEAD_DIMS = (128, 64)
DTYPES = {'fp16': 'half', 'bf16': '__nv_bfloat16'}  # file tag -> C++ element type
# per head_dim: FwdTraits tuples (head_dim, block_m, block_n, n_warps, m_tiles, pipeline, min_arch), or None
FWD_CONFIGS = {
    128: {
        'large': (128, 128, 64, 8, 1, True, 0),
        'small': (128, 64, 64, 4, 1, True, 0),
        'wide': (128, 128, 32, 4, 2, False, 0),
        'wide64': (128, 128, 64, 4, 2, False, 900),
        'wide_causal_min_blocks_per_sm': 3,
    },
    64: {
        'large': (64, 128, 128, 8, 1, False, 0),
        'small': (64, 64, 64, 4, 1, True, 0),
        'wide': (64, 128, 64, 4, 2, False, 0),
        'wide64': None,
        'wide_causal_min_blocks_per_sm': 0,
    },
}
DECODE_MAX_ROWS = 32
# (name, m_tiles, stages) of DecodeConfig<D>, in the launch's order
DECODE_TRAITS = (('TwoTiles', 2, 2), ('Deep', 1, 3), ('Shallow', 1, 2), ('Deep4', 1, 4))
# per head_dim: BwdTile<D> (query rows per step, keys per block, warps, dP slices)
BWD_TILES = {
    128: {'block_m': 32, 'block_n': 128, 'n_warps': 8, 'split_dp': 1},
    64: {'block_m': 64, 'block_n': 128, 'n_warps': 8, 'split_dp': 1},
}
# per head_dim: BwdTileNarrow<D>, for devices whose shared memory per block is below BwdTile<D>'s
BWD_NARROW = {
    128: {'block_m': 32, 'block_n': 64, 'n_warps': 4, 'split_dp': 1},
    64: {'block_m': 64, 'block_n': 128, 'n_warps': 8, 'split_dp': 1},
}
# (name, m_tiles, stages, warp groups) of DecodeFp8KvConfig<D>: the decode kernel over the FP8 KV cache
DECODE_FP8KV_TRAITS = (('OneTile', 1, 3, 1), ('TwoTiles', 2, 3, 1), ('OneTileWG2', 1, 3, 2))
# (n_warps, stages) of PrefillFp8KvConfig<D>::Tile: the prefill kernel over the FP8 KV cache
PREFILL_FP8KV_TRAITS = (4, 3)
# (n_warps, stages) of PrefillFp8KvConfig<D>::V2: v2 (over half a wave of blocks; LLM_ATTN_FP8KV_PREFILL_V forces)
PREFILL_FP8KV_V2_TRAITS = (8, 2)
# per head_dim: the FP8 forward's key tiles (Fp8Tiles<D>), the first the default
FP8_BLOCK_N = {128: (192, 128, 256), 64: (128, 192)}
# per head_dim: the default tile of int8 Q K^T with e4m3 P V (Fp8Tiles<D>::kDefaultBlockNInt8)
FP8_INT8_DEFAULT = {128: 256, 64: 128}
# (kind, head_dim, dtype tag, causal or None, file in kernels/) of every instantiation file
INSTANTIATIONS = (
    ('fwd', 128, 'fp16', False, 'flash_fwd_hdim128_fp16_noncausal.cu'),
    ('fwd', 128, 'fp16', True, 'flash_fwd_hdim128_fp16_causal.cu'),
    ('fwd', 128, 'bf16', False, 'flash_fwd_hdim128_bf16_noncausal.cu'),
    ('fwd', 128, 'bf16', True, 'flash_fwd_hdim128_bf16_causal.cu'),
    ('fwd', 64, 'fp16', False, 'flash_fwd_hdim64_fp16_noncausal.cu'),
    ('fwd', 64, 'fp16', True, 'flash_fwd_hdim64_fp16_causal.cu'),
    ('fwd', 64, 'bf16', False, 'flash_fwd_hdim64_bf16_noncausal.cu'),
    ('fwd', 64, 'bf16', True, 'flash_fwd_hdim64_bf16_causal.cu'),
    ('fwd_sm90', 128, 'fp16', False, 'flash_fwd_sm90_hdim128_fp16_noncausal.cu'),
    ('fwd_sm90', 128, 'fp16', True, 'flash_fwd_sm90_hdim128_fp16_causal.cu'),
    ('fwd_sm90', 128, 'bf16', False, 'flash_fwd_sm90_hdim128_bf16_noncausal.cu'),
    ('fwd_sm90', 128, 'bf16', True, 'flash_fwd_sm90_hdim128_bf16_causal.cu'),
    ('fwd_sm90', 64, 'fp16', False, 'flash_fwd_sm90_hdim64_fp16_noncausal.cu'),
    ('fwd_sm90', 64, 'fp16', True, 'flash_fwd_sm90_hdim64_fp16_causal.cu'),
    ('fwd_sm90', 64, 'bf16', False, 'flash_fwd_sm90_hdim64_bf16_noncausal.cu'),
    ('fwd_sm90', 64, 'bf16', True, 'flash_fwd_sm90_hdim64_bf16_causal.cu'),
    ('decode', 128, 'fp16', None, 'flash_decode_hdim128_fp16.cu'),
    ('decode', 128, 'bf16', None, 'flash_decode_hdim128_bf16.cu'),
    ('decode', 64, 'fp16', None, 'flash_decode_hdim64_fp16.cu'),
    ('decode', 64, 'bf16', None, 'flash_decode_hdim64_bf16.cu'),
    ('decode_fp8kv', 128, 'fp16', None, 'flash_decode_fp8kv_hdim128_fp16.cu'),
    ('decode_fp8kv', 128, 'bf16', None, 'flash_decode_fp8kv_hdim128_bf16.cu'),
    ('decode_fp8kv', 64, 'fp16', None, 'flash_decode_fp8kv_hdim64_fp16.cu'),
    ('decode_fp8kv', 64, 'bf16', None, 'flash_decode_fp8kv_hdim64_bf16.cu'),
    ('prefill_fp8kv', 128, 'fp16', None, 'flash_prefill_fp8kv_hdim128_fp16.cu'),
    ('prefill_fp8kv', 128, 'bf16', None, 'flash_prefill_fp8kv_hdim128_bf16.cu'),
    ('prefill_fp8kv', 64, 'fp16', None, 'flash_prefill_fp8kv_hdim64_fp16.cu'),
    ('prefill_fp8kv', 64, 'bf16', None, 'flash_prefill_fp8kv_hdim64_bf16.cu'),
    ('bwd', 128, 'fp16', False, 'flash_bwd_hdim128_fp16_noncausal.cu'),
    ('bwd', 128, 'fp16', True, 'flash_bwd_hdim128_fp16_causal.cu'),
    ('bwd', 128, 'bf16', False, 'flash_bwd_hdim128_bf16_noncausal.cu'),
    ('bwd', 128, 'bf16', True, 'flash_bwd_hdim128_bf16_causal.cu'),
    ('bwd', 64, 'fp16', False, 'flash_bwd_hdim64_fp16_noncausal.cu'),
    ('bwd', 64, 'fp16', True, 'flash_bwd_hdim64_fp16_causal.cu'),
    ('bwd', 64, 'bf16', False, 'flash_bwd_hdim64_bf16_noncausal.cu'),
    ('bwd', 64, 'bf16', True, 'flash_bwd_hdim64_bf16_causal.cu'),
    ('bwd_sm90', 128, 'fp16', False, 'flash_bwd_sm90_hdim128_fp16_noncausal.cu'),
    ('bwd_sm90', 128, 'fp16', True, 'flash_bwd_sm90_hdim128_fp16_causal.cu'),
    ('bwd_sm90', 128, 'bf16', False, 'flash_bwd_sm90_hdim128_bf16_noncausal.cu'),
    ('bwd_sm90', 128, 'bf16', True, 'flash_bwd_sm90_hdim128_bf16_causal.cu'),
    ('bwd_sm90', 64, 'fp16', False, 'flash_bwd_sm90_hdim64_fp16_noncausal.cu'),
    ('bwd_sm90', 64, 'fp16', True, 'flash_bwd_sm90_hdim64_fp16_causal.cu'),
    ('bwd_sm90', 64, 'bf16', False, 'flash_bwd_sm90_hdim64_bf16_noncausal.cu'),
    ('bwd_sm90', 64, 'bf16', True, 'flash_bwd_sm90_hdim64_bf16_causal.cu'),
    ('fwd_int8', 128, 'fp16', False, 'flash_fwd_int8_hdim128_fp16_noncausal.cu'),
    ('fwd_int8', 128, 'fp16', True, 'flash_fwd_int8_hdim128_fp16_causal.cu'),
    ('fwd_int8', 128, 'bf16', False, 'flash_fwd_int8_hdim128_bf16_noncausal.cu'),
    ('fwd_int8', 128, 'bf16', True, 'flash_fwd_int8_hdim128_bf16_causal.cu'),
    ('fwd_int8', 64, 'fp16', False, 'flash_fwd_int8_hdim64_fp16_noncausal.cu'),
    ('fwd_int8', 64, 'fp16', True, 'flash_fwd_int8_hdim64_fp16_causal.cu'),
    ('fwd_int8', 64, 'bf16', False, 'flash_fwd_int8_hdim64_bf16_noncausal.cu'),
    ('fwd_int8', 64, 'bf16', True, 'flash_fwd_int8_hdim64_bf16_causal.cu'),
    ('fwd_fp8_sm90', 128, 'fp16', False, 'flash_fwd_fp8_sm90_hdim128_fp16_noncausal.cu'),
    ('fwd_fp8_sm90', 128, 'fp16', True, 'flash_fwd_fp8_sm90_hdim128_fp16_causal.cu'),
    ('fwd_fp8_sm90', 128, 'bf16', False, 'flash_fwd_fp8_sm90_hdim128_bf16_noncausal.cu'),
    ('fwd_fp8_sm90', 128, 'bf16', True, 'flash_fwd_fp8_sm90_hdim128_bf16_causal.cu'),
    ('fwd_fp8_sm90', 64, 'fp16', False, 'flash_fwd_fp8_sm90_hdim64_fp16_noncausal.cu'),
    ('fwd_fp8_sm90', 64, 'fp16', True, 'flash_fwd_fp8_sm90_hdim64_fp16_causal.cu'),
    ('fwd_fp8_sm90', 64, 'bf16', False, 'flash_fwd_fp8_sm90_hdim64_bf16_noncausal.cu'),
    ('fwd_fp8_sm90', 64, 'bf16', True, 'flash_fwd_fp8_sm90_hdim64_bf16_causal.cu'),
)
