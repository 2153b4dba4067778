"""Model geometry, prefill FLOPs and bytes moved per decoded token, for %-of-peak figures and roofline bounds.

Prefill FLOPs of a decoder-only Llama-style model, batch B, prompt S, with only the last position's logits kept
(``logits_to_keep=1``, what TTFT measures):

    F = 2 * P_layers * B * S            matmuls of the decoder layers (q, k, v, o, gate, up, down)
      + 2 * vocab * hidden * B          the LM head, applied to one position per sequence
      + 2 * L * B * Hq * S^2 * D        attention: QK^T and PV, 2*S*S*D each, halved by the causal mask

where P_layers = L * (hidden * D * (2*Hq + 2*Hkv) + 3 * hidden * intermediate). Embedding lookups, norms, RoPE and
softmax are left out (they are not matmuls). For Llama 3 8B, P_layers = 6.98e9 and attention is S/53k of the total.

Bytes per decoded token (one step for the whole batch): every weight once (the embedding table only for its B
rows, so it is left out unless tied to the LM head), plus the K and V cache of every sequence read once.
"""

from __future__ import annotations

import torch

GEOMETRY_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def geometry(config: dict) -> dict:
    """The numbers the formulas need, from a transformers config as a dict (``ModelInfo.config``)."""
    missing = [k for k in GEOMETRY_KEYS if config.get(k) is None]
    if missing:
        raise ValueError(f"model config misses {missing}; cannot count FLOPs")
    hq = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return {
        "hidden": hidden,
        "layers": config["num_hidden_layers"],
        "heads": hq,
        "kv_heads": config.get("num_key_value_heads") or hq,
        "head_dim": config.get("head_dim") or hidden // hq,
        "intermediate": config["intermediate_size"],
        "vocab": config["vocab_size"],
        "tied": bool(config.get("tie_word_embeddings", False)),
    }


def layer_params(g: dict) -> int:
    per_layer = g["hidden"] * g["head_dim"] * (2 * g["heads"] + 2 * g["kv_heads"]) + 3 * g["hidden"] * g["intermediate"]
    return g["layers"] * per_layer


def attention_flops(g: dict, batch: int, seq: int) -> float:
    return 2.0 * g["layers"] * batch * g["heads"] * seq * seq * g["head_dim"]


def prefill_flops(g: dict, batch: int, seq: int) -> float:
    """Matmul FLOPs of one prefill forward with logits for the last position only (see the module docstring)."""
    return 2.0 * layer_params(g) * batch * seq + 2.0 * g["vocab"] * g["hidden"] * batch + attention_flops(g, batch, seq)


def kv_bytes_per_token(g: dict, batch: int, context: float, dtype_bytes: float) -> float:
    """K and V of ``context`` positions, every layer, every sequence: what one decode step reads from the cache."""
    return 2.0 * g["layers"] * g["kv_heads"] * g["head_dim"] * context * dtype_bytes * batch


def kv_element_bytes(kv_cache: str, dtype_bytes: int, head_dim: int) -> float:
    """Bytes a decode step reads per cached K or V element: the model's dtype for the fp16 cache; for the FP8 cache
    one e4m3 byte plus its share of the float32 scale of each 64-token block (``kv_cache_reference``)."""
    if kv_cache == "fp8":
        from llm_attn.kv_cache_reference import BLOCK  # noqa: PLC0415

        return 1.0 + 4.0 / (BLOCK * head_dim)
    return float(dtype_bytes)


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer a decode step reads: all of them except the input embedding table
    (only B of its rows are gathered), unless it is the same tensor as the LM head. Counts the storage as loaded,
    so an int4 AWQ checkpoint counts its packed weights, scales and zeros."""
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and out is not None and getattr(out, "weight", None) is embed
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t is embed and not tied:
            continue
        total += t.numel() * t.element_size()
    return total


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters and buffers as loaded (the model's footprint before activations and cache)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
