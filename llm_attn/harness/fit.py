"""What fits: the longest prompt, and prompt plus decode, that each device's memory takes for a model preset, per KV
cache format and prefill chunk, from a memory model of exactly what the harness runs (a prefill with
``logits_to_keep=1`` into a fresh ``DynamicCache``, ``--prefill-chunk``, then decode).

    python -m llm_attn.models fit --model llama-3-8b --device rtx-4060-ti
    python -m llm_attn.models fit --model llama-3-8b --device all --decode 1024 --chunks none 8192 2048
    python -m llm_attn.models fit --model llama-3-8b --check experiments/results/h100-80gb-hbm3/*.jsonl

The model, in bytes (B batch, S prompt, C chunk (S when unchunked), L layers, H hidden, I FFN, Hq / Hkv heads of
D, V vocabulary, a = 2: fp16 activations):

    weights     the checkpoint as loaded (AWQ int4, group 128: packed weights, fp16 scales, packed zeros; embeddings,
                norms and lm_head in fp16; or all fp16) + the rotary buffers (D float32)
    workspace   cuBLAS's, through torch's allocator: 32 MiB on sm_90, 8 MiB + 128 KiB before (torch's default
                CUBLAS_WORKSPACE_CONFIG)
    kv(T)       fp16: 2 L Hkv D T a B. fp8 (llm_attn.kv_cache_reference): 2 L Hkv D T B + scales 2 L Hkv ceil(T/64)
                4 B + K's shift L Hkv D 4 B + the float32 tails (at most 64 tokens) 2 L Hkv 64 D 4 B
    per token   of a chunk, alive at the two peaks of a decoder layer (the harness's model is transformers' Llama):
                MLP:        the chunk's embeddings, the layer's input (held by the model's loop), the residual and
                            the normed input, 4 H; act(gate), up and their product, 3 I
                attention:  embeddings, input, normed input, 3 H; q, its rotary temporaries, k, v: 4 Hq D + 2 Hkv D
                both:       rotary cos/sin 2 D, in a; input and position ids 16 bytes
    prefill     for the last chunk (c tokens after P = S - c cached; and the chunk before it, which may be longer),
                weights + workspace + max(MLP phase, attention phase):
                MLP phase         kv(P + c) + B c per-token(MLP)
                attention phase   kv(P + c) + B c per-token(attention)
                                  + the cache's growth: fp16 concatenates, so one layer's old K (P Hkv D a B) is alive
                                    beside the new one; fp8 the same in 1 byte, plus the quantiser's five float32
                                    copies of the chunk's K/V (20 Hkv D c B)
                                  + the mask transformers builds for a chunk that does not start at 0 (bool,
                                    B c (P + c)), for stock sdpa and for llm_attn's patch alike
                                  + fp8-copy: the dequantised K and V of one layer (4 Hkv D (P + c) B: the
                                    one-launch copy, AOT or NVRTC build)
    decode      weights + workspace + kv(S + N) + one layer's old K (the concatenation) + fp8-copy's dequantised
                layer + one token's activations and float32 logits
    fits        when the peak <= memory_gib - reserved_gib of the device (experiments/devices.toml)

Cache formats: ``fp16`` (DynamicCache), ``fp8-copy`` (``Fp8DynamicCache`` where every layer's attention reads a
dequantised fp16 copy: stock attention, a build without the prefill kernel over the cache, or llm_attn's prefill
calls on sm_90, where the one-launch copy and the Hopper kernel are faster: ``LLM_ATTN_FP8KV_PREFILL=auto``),
``fp8`` (the same cache read in place by llm_attn's decode and prefill kernels, issue 38: no copy).

Checked against the H100's measured peaks (``--check``; README): the 8B AWQ prefill at 8k-128k tokens is predicted
to within a kilobyte of ``torch.cuda.max_memory_allocated``; at 2k the measured peak is 59 MB (1 %) higher, a
transient inside the AWQ GEMMs the model leaves out. At 128k in chunks of 8192: -0.9 % (fp16 cache), -1.0 % (FP8
read in place), +0.04 % (FP8 through the PyTorch ops' copy) and +2.3 % (through the one-launch copy, 15.281 GiB
measured: its copy is allocated after the cache's update has freed its temporaries). ``check_rows`` models each
row's cache as it ran (``row_cache``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llm_attn.harness.devices import Device
from llm_attn.models.presets import ModelPreset, get_preset
from llm_attn.models.synthetic import estimated_checkpoint_bytes

GIB = 1 << 30
ACT_BYTES = 2                      # fp16 activations, as the harness runs the 8B (AWQ computes in fp16)
CACHES = ("fp16", "fp8-copy", "fp8")
WEIGHTS = ("awq", "fp16")
FP8_BLOCK = 64                     # tokens per FP8 scale (llm_attn.kv_cache_reference.BLOCK)
MODEL_LIMIT_NOTE = "the model's positions"


def cublas_workspace_bytes(arch: str | None) -> int:
    """torch's default cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG ':4096:8' on sm_90, ':4096:2:16:8' before)."""
    return 8 * 4096 * 1024 if arch and arch.startswith("sm_9") else 2 * 4096 * 1024 + 8 * 16 * 1024


@dataclass(frozen=True)
class MemoryModel:
    """The peak bytes of torch's allocator for one model, weight format, KV cache format and GPU architecture."""

    preset: ModelPreset
    weights: str = "awq"
    cache: str = "fp16"
    arch: str | None = None
    batch: int = 1

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")

    # -- the pieces ---------------------------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return estimated_checkpoint_bytes(self.preset, self.weights) + 4 * self.preset.head_dim  # + rotary buffers

    def workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.arch)

    @property
    def _row(self) -> int:
        """Elements of one token's K (or V) in one layer."""
        return self.preset.num_key_value_heads * self.preset.head_dim

    def kv_bytes(self, tokens: int) -> int:
        p, b, row = self.preset, self.batch, self._row
        if self.cache == "fp16":
            return 2 * p.num_hidden_layers * row * tokens * ACT_BYTES * b
        scales = 2 * p.num_hidden_layers * p.num_key_value_heads * math.ceil(tokens / FP8_BLOCK) * 4
        fixed = p.num_hidden_layers * row * 4 + 2 * p.num_hidden_layers * FP8_BLOCK * row * 4  # shift, tails
        return (2 * p.num_hidden_layers * row * tokens + scales + fixed) * b

    def per_token(self, phase: str) -> int:
        """Activation bytes per token of a chunk at the MLP or the attention peak of a decoder layer."""
        p = self.preset
        common = 2 * p.head_dim * ACT_BYTES + 16  # rotary cos/sin, input and position ids
        if phase == "mlp":
            return (4 * p.hidden_size + 3 * p.intermediate_size) * ACT_BYTES + common
        q, kv = p.num_attention_heads * p.head_dim, self._row
        return (3 * p.hidden_size + 4 * q + 2 * kv) * ACT_BYTES + common

    def cache_growth_bytes(self, past: int, chunk: int) -> int:
        """The cache's transient while one layer takes ``chunk`` tokens after ``past``: the old K beside the new
        (concatenation), and FP8's quantiser temporaries."""
        b, row = self.batch, self._row
        if self.cache == "fp16":
            return past * row * ACT_BYTES * b
        return past * row * b + 20 * row * chunk * b

    def dequant_copy_bytes(self, tokens: int) -> int:
        """fp8-copy: one layer's K and V dequantised to fp16 (the one-launch copy, kernels/fp8_cache_dequant.h; the
        PyTorch ops of a build without it hold a float32 temporary too: 8 bytes per element, not 4)."""
        return 4 * self._row * tokens * self.batch if self.cache == "fp8-copy" else 0

    # -- the peaks ----------------------------------------------------------------------------------------------------
    def _chunk_peak(self, past: int, chunk: int) -> dict:
        total = past + chunk
        kv = self.kv_bytes(total)
        mlp = self.batch * chunk * self.per_token("mlp")
        mask = self.batch * chunk * total if past else 0
        attention = (self.batch * chunk * self.per_token("attention") + self.cache_growth_bytes(past, chunk)
                     + mask + self.dequant_copy_bytes(total))
        phase, act = ("mlp", mlp) if mlp >= attention else ("attention", attention)
        return {"phase": phase, "kv": kv, "activations": act, "past": past, "chunk": chunk}

    def prefill_peak(self, seq: int, chunk: int | None = None) -> dict:
        """The prefill's peak and its pieces: {total, weights, workspace, kv, activations, phase, past, chunk}."""
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        c = seq if chunk is None or chunk >= seq else chunk
        last = seq - (math.ceil(seq / c) - 1) * c
        candidates = [self._chunk_peak(seq - last, last)]
        if seq - last >= c:  # the chunk before the last: longer than a short last chunk, one chunk less cached
            candidates.append(self._chunk_peak(seq - last - c, c))
        best = max(candidates, key=lambda d: d["kv"] + d["activations"])
        fixed = {"weights": self.weight_bytes(), "workspace": self.workspace_bytes()}
        return {**fixed, **best, "total": sum(fixed.values()) + best["kv"] + best["activations"]}

    def decode_peak(self, seq: int, new_tokens: int) -> dict:
        """The peak of decoding ``new_tokens`` after a ``seq``-token prompt (the prefill's own peak apart)."""
        total = seq + new_tokens
        act = (self.cache_growth_bytes(total - 1, 1) + self.dequant_copy_bytes(total)
               + self.batch * (self.per_token("mlp") + 4 * self.preset.vocab_size))
        fixed = {"weights": self.weight_bytes(), "workspace": self.workspace_bytes()}
        kv = self.kv_bytes(total)
        return {**fixed, "kv": kv, "activations": act, "phase": "decode", "total": sum(fixed.values()) + kv + act}

    def peak(self, seq: int, chunk: int | None = None, new_tokens: int = 0) -> int:
        """Bytes at the peak of a prefill of ``seq`` tokens (in chunks of ``chunk``) and ``new_tokens`` decoded."""
        p = self.prefill_peak(seq, chunk)["total"]
        return max(p, self.decode_peak(seq, new_tokens)["total"]) if new_tokens else p


def longest(model: MemoryModel, budget: int, chunk: int | None = None, new_tokens: int = 0,
            upper: int = 1 << 24) -> int:
    """The longest prompt whose peak (prefill in chunks of ``chunk``, then ``new_tokens`` decoded) fits ``budget``
    bytes (0 when none does). The peak grows with the prompt, so a bisection finds it."""
    if model.peak(1, chunk, new_tokens) > budget:
        return 0
    lo, hi = 1, upper
    if model.peak(hi, chunk, new_tokens) <= budget:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if model.peak(mid, chunk, new_tokens) <= budget else (lo, mid)
    return lo


def usable_bytes(device: Device) -> int:
    if device.memory_gib is None:
        raise ValueError(f"device {device.slug!r} has no memory_gib in the device table")
    return int((device.memory_gib - (device.reserved_gib or 0.0)) * GIB)


@dataclass(frozen=True)
class FitRow:
    device: str
    usable_gib: float
    cache: str
    chunk: int | None
    longest_prompt: int         # by memory alone
    longest_with_decode: int    # prompt such that prompt + new_tokens decode fits (memory alone)
    new_tokens: int
    model_positions: int

    @property
    def prompt(self) -> int:
        return min(self.longest_prompt, self.model_positions)

    @property
    def with_decode(self) -> int:
        return min(self.longest_with_decode, self.model_positions - self.new_tokens)


def fit_rows(preset: str | ModelPreset, weights: str, devices: list[Device], caches=CACHES,
             chunks: tuple = (None, 8192, 2048), new_tokens: int = 1024, batch: int = 1) -> list[FitRow]:
    """One row per device x cache format x chunk: the longest prompt, and prompt + ``new_tokens`` decoded."""
    p = get_preset(preset)
    rows = []
    for dev in devices:
        budget = usable_bytes(dev)
        for cache in caches:
            model = MemoryModel(p, weights=weights, cache=cache, arch=dev.arch, batch=batch)
            for chunk in chunks:
                rows.append(FitRow(dev.slug, budget / GIB, cache, chunk, longest(model, budget, chunk),
                                   longest(model, budget, chunk, new_tokens), new_tokens,
                                   p.max_position_embeddings))
    return rows


def _tokens(n: int, limit: int) -> str:
    """A token count, and where the model's positions (not memory) are the limit, both."""
    if n >= limit:
        return f"{limit} (model max; memory: {n})"
    return f"{n} ({n / 1024:.0f}k)" if n >= 1024 else str(n)


def fit_table(rows: list[FitRow], tablefmt: str = "github") -> str:
    from tabulate import tabulate  # noqa: PLC0415

    table = [[r.device, f"{r.usable_gib:.1f}", r.cache,
              "none" if r.chunk is None else r.chunk, _tokens(r.longest_prompt, r.model_positions),
              _tokens(r.longest_with_decode, r.model_positions - r.new_tokens)] for r in rows]
    n = rows[0].new_tokens if rows else 0
    return tabulate(table, headers=["device", "usable GiB", "KV cache", "prefill chunk", "longest prompt",
                                    f"prompt + {n} decoded"], tablefmt=tablefmt, disable_numparse=True)


# -- against measured peaks --------------------------------------------------------------------------------------------
def _arch(env: dict) -> str | None:
    cc = (env or {}).get("compute_capability")
    return f"sm_{cc.replace('.', '')}" if cc else None


# Attention that materialises the score matrix (Hq S^2 elements) is outside the model.
MATERIALISING = ("eager", "naive")


def row_cache(row: dict) -> str:
    """The cache format of a ``ttft`` row as ``MemoryModel`` names it: ``fp16``; ``fp8`` where every attention
    call read the FP8 cache's bytes (the decode and prefill kernels, or their CPU reference), ``fp8-copy`` where any
    read a dequantised copy (stock attention, a build without the prefill kernel, ``LLM_ATTN_FP8KV_PREFILL=copy``)."""
    if row.get("kv_cache", "fp16") != "fp8":
        return "fp16"
    reads = (row.get("attention_calls") or {}).get("kv_cache_reads") or {}
    return "fp8" if reads and all("directly" in how for how in reads) else "fp8-copy"


def check_rows(rows, preset: str | ModelPreset) -> list[dict]:
    """Predicted vs measured peak of every successful ``ttft`` row of ``preset`` (fp16 activations, a peak recorded,
    an implementation that does not materialise the scores): the prefill the model describes (decode rows add the
    static-cache or generate paths, graph rows CUDA-graph pools). Rows whose peaks differ by less than 4 KiB at one
    point share a line, with every implementation and source that measured it (``source``: the row's ``_source``,
    set by the caller, e.g. its file)."""
    p = get_preset(preset)
    out: list[dict] = []
    for r in rows:
        model = r.get("model") or {}
        if (r.get("measurement") != "ttft" or r.get("status") != "ok" or not r.get("peak_mem_bytes")
                or model.get("name") != p.name or r.get("dtype") != "float16" or r.get("impl") in MATERIALISING):
            continue
        weights = "fp16" if model.get("dequant_fallback") or not str(model.get("quant", "")).startswith("awq") \
            else "awq"
        chunk, measured, cache = r.get("prefill_chunk"), r["peak_mem_bytes"], row_cache(r)
        same = next((c for c in out if (c["weights"], c["batch"], c["seq"], c["chunk"], c["cache"]) == (
                     weights, r["batch"], r["seq"], chunk, cache) and abs(c["measured"] - measured) < 4096), None)
        if same is not None:
            for key, val in (("impls", r.get("impl")), ("sources", r.get("_source"))):
                if val is not None and val not in same[key]:
                    same[key].append(val)
            continue
        mm = MemoryModel(p, weights=weights, cache=cache, arch=_arch(r.get("env")), batch=r["batch"])
        pred = mm.prefill_peak(r["seq"], chunk)
        out.append({"impls": [r.get("impl")], "sources": [r["_source"]] if r.get("_source") else [],
                    "weights": weights, "batch": r["batch"], "seq": r["seq"], "chunk": chunk, "cache": cache,
                    "measured": measured,
                    "predicted": pred["total"], "error_pct": 100.0 * (pred["total"] - measured) / measured})
    return sorted(out, key=lambda c: (c["weights"], c["batch"], c["seq"], c["chunk"] or 0, c["measured"]))


def check_table(checks: list[dict], tablefmt: str = "github") -> str:
    from tabulate import tabulate  # noqa: PLC0415

    table = [[c["weights"], c["batch"], c["seq"], c["chunk"] or "none", c.get("cache", "fp16"), "/".join(c["impls"]),
              f"{c['measured'] / GIB:.3f}", f"{c['predicted'] / GIB:.3f}",
              f"{(c['predicted'] - c['measured']) / 2**20:+.1f}", f"{c['error_pct']:+.2f}%",
              ", ".join(c["sources"])] for c in checks]
    return tabulate(table, headers=["weights", "batch", "prompt", "chunk", "KV cache", "impls", "measured GiB",
                                    "predicted GiB",
                                    "predicted - measured MiB", "error", "measured in"], tablefmt=tablefmt,
                    disable_numparse=True)
