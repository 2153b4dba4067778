"""Model presets, synthetic Llama checkpoints (fp16 or AWQ int4) and one loader for presets, local dirs and hub ids.

No weights are downloaded: `write_synthetic_checkpoint` writes a real Hugging Face checkpoint directory
(config.json, sharded safetensors, generation_config.json) with seeded random weights in the exact Llama geometry
of a preset, either in fp16 or in the standard AWQ GEMM int4 format (see llm_attn/awq.py). `load_model` then loads
it through the real loaders: transformers' AutoModelForCausalLM, and for AWQ transformers' AWQ quantizer, which
replaces the linears with gptqmodel's int4 QuantLinear classes. Which class actually runs is read back from the
loaded modules and reported in ModelInfo.awq_backend.

    python -m llm_attn.models generate llama-3-8b awq        # generate (or reuse) the cached checkpoint, print time
    python -m llm_attn.models load tiny:awq --device cpu      # load a spec, print its ModelInfo as JSON
    python -m llm_attn.models backends                        # installed AWQ packages
    python -m llm_attn.models fit --device rtx-4060-ti        # the longest prompt that fits (harness/fit.py)

Specs accepted by load_model: "auto" (CUDA: synthetic llama-3-8b AWQ; CPU: synthetic tiny fp16), a preset name
with an optional ":awq" / ":fp16" suffix, a local checkpoint directory (AWQ or not), or a hub id that is already in
the local Hugging Face cache (nothing is fetched: this project runs offline).

Laid out as presets.py (geometries), synthetic.py (the checkpoint writer and its cache), loading.py (load_model,
ModelInfo, AWQ backend detection), kv_cache.py (the FP8 KV cache, imported from there: it needs transformers) and
__main__.py (the command line). The names below are the public API.
"""

# The private names are re-exported for the tests that reach into the loader.
from llm_attn.models.loading import (  # noqa: F401
    AWQ_INSTALL_HINT,
    AwqBackendMissingError,
    ModelInfo,
    _default_awq_backend,
    _import_gptqmodel,
    _load_awq_dequantized,
    _read_config,
    auto_spec,
    detect_awq_backends,
    load_model,
    resource_problem,
    max_seq_len,
)
from llm_attn.models.presets import (  # noqa: F401
    PRESETS,
    ModelPreset,
    _param_count,
    get_preset,
    llama_config,
)
from llm_attn.models.synthetic import (
    AWQ_LINEARS,
    DISK_HEADROOM,
    MARKER_FILE,
    PROVENANCE_FILE,
    SYNTHETIC_FORMAT_VERSION,
    NotEnoughDiskError,
    cached_checkpoint,
    check_free_disk,
    estimated_checkpoint_bytes,
    synthetic_awq_linear,
    write_synthetic_checkpoint,
)

__all__ = [
    "AWQ_INSTALL_HINT", "AWQ_LINEARS", "DISK_HEADROOM", "MARKER_FILE", "NotEnoughDiskError", "PRESETS", "PROVENANCE_FILE", "SYNTHETIC_FORMAT_VERSION",
    "AwqBackendMissingError", "ModelInfo", "auto_spec", "resource_problem", "ModelPreset", "cached_checkpoint", "check_free_disk", "detect_awq_backends", "estimated_checkpoint_bytes", "get_preset",
    "llama_config", "load_model", "max_seq_len", "synthetic_awq_linear", "write_synthetic_checkpoint",
]
