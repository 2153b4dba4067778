"""Model presets: the exact geometries of the models the harness measures (Llama 3 8B, a tiny Llama for CPU tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    """A named Llama-architecture geometry."""
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    bos_token_id: int = 1
    eos_token_id: int = 2


PRESETS: dict[str, ModelPreset] = {
    # Llama 3 8B geometry with Llama 3.1's rope scaling. max_position_embeddings is 131072 as Llama 3.1 ships it:
    # transformers warns when original_max_position_embeddings (8192) is not below max_position_embeddings.
    # Callers that size caches must cap lengths themselves (max_seq_len() is a model limit, not a memory budget).
    "llama-3-8b": ModelPreset(
        name="llama-3-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    # Small enough for CPU tests, but with the features that matter to the attention patch: GQA (8 q heads over
    # 2 kv heads), head_dim 64 (a size the CUDA kernel supports), and linears that are multiples of 128 so AWQ
    # group_size 128 applies to every one of them.
    "tiny": ModelPreset(
        name="tiny", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-5),
    # Llama 3 70B geometry (80 layers, 64 q / 8 kv heads, hidden 8192), with the 8B preset's Llama 3.1 rope scaling.
    # fp16 is ~141 GB on disk, AWQ int4 ~40 GB: check_free_disk refuses a write that does not fit.
    "llama-3-70b": ModelPreset(
        name="llama-3-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    # The tensor-parallel test model (llm_attn.harness.tp): 8 q / 4 kv heads split 4/2 per rank at TP=2 (and 2/1 at
    # TP=4), every linear a multiple of 128 (AWQ groups) and of 2 and 4 (row/column shards); runs on CPU with gloo.
    "tiny-tp": ModelPreset(
        name="tiny-tp", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024,
        max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-5),
}


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    if isinstance(preset, ModelPreset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[preset]


def llama_config(preset: str | ModelPreset, **overrides):
    """transformers.LlamaConfig for a preset; keyword overrides replace preset fields or add config fields."""
    from transformers import LlamaConfig

    p = get_preset(preset)
    fields = {f.name for f in dataclasses.fields(ModelPreset)} - {"name"}
    preset_overrides = {k: overrides.pop(k) for k in list(overrides) if k in fields}
    if preset_overrides:
        p = dataclasses.replace(p, **preset_overrides)
    # transformers 5 keeps rope_theta and the scaling recipe together in rope_parameters.
    rope = {"rope_type": "default"} if p.rope_scaling is None else dict(p.rope_scaling)
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(p.rope_theta)
    kwargs = dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=p.rms_norm_eps, rope_parameters=rope,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id, architectures=["LlamaForCausalLM"],
    )
    kwargs.update(overrides)
    if kwargs["num_attention_heads"] % kwargs["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return LlamaConfig(**kwargs)


def _param_count(cfg) -> int:
    h, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = h * hd * (nq + 2 * nkv) + nq * hd * h + 3 * h * f + 2 * h
    return v * h * (1 if cfg.tie_word_embeddings else 2) + layers * per_layer + h
