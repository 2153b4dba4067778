"""Kernel accuracy against float64, on inputs shaped like real LLM activations (issue 34, item 4): the library behind
``python -m llm_attn.bench --mode accuracy``.

    python -m llm_attn.bench --mode accuracy                                # CPU: small sizes, seconds
    python -m llm_attn.bench --mode accuracy --seqs 8192 32768 131072     # GPU: up to 128k keys

What is compared: each implementation's output against a float64 reference computed from the *same* rounded
inputs (bf16/fp16 Q, K, V upcast), so the numbers are the implementation's own error, not the inputs' rounding.
Beside the low-precision paths (``ours-fp8``, ``ours-int8``: ``flash_attn_func(precision="fp8" | "int8")``;
``ours-int8qk``: ``precision="fp8", fp8_pv="input"``) every
point also measures PyTorch SDPA in the input dtype and our native path: the error a bf16 user already accepts.

Inputs (``KINDS``; B x Hq x S x D query, B x Hkv x S x D keys/values, N(0, 1) unless said otherwise):

- ``gaussian``: all N(0, 1).
- ``k_outliers``: per-channel K outliers: in each KV head a few channels carry a bias of 10-50x the typical
  magnitude (the bias columns LLM keys have; what per-block FP8 scales must survive: the outlier sets the block's
  scale, and its quantisation error varies key to key although the bias itself cancels in the softmax).
- ``peaky``: queries scaled so that scores have a standard deviation of 4 (instead of 1): a few keys take most of
  the attention, and score errors are amplified by exp.
- ``outliers+peaky``: both.

Long rows: the float64 reference would need B*Hq*S*S*8 bytes at once (137 TB at 128k); it is computed only for a
seeded random subset of ``rows`` query rows (always including the last, which sees every key), in chunks of
queries sized to ``REFERENCE_CHUNK_BYTES`` of scores, each against all its visible keys (K and V in float64: 2 GB at
128k x 8 heads x 128). The implementations run on all rows (the kernel computes them anyway); their outputs are
compared on the sampled rows. 512 rows x 32 heads x 128 dims = 2M compared values per point.

Metrics over the compared values (float64): ``cosine`` similarity of the flattened outputs, ``rel_l1`` =
sum|out - ref| / sum|ref|, ``max_abs`` = max|out - ref| (with ``ref_absmax`` for scale), and ``min_row_cosine``, the
worst single (head, row) output vector. ``TARGETS`` (cosine >= 0.999, rel L1 <= 0.03) apply to every
implementation on the outlier inputs at every length; each row records each target's verdict and
``target_summary`` lists every miss (an implementation that fails to run counts as missing its targets).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

SCHEMA = "llm_attn.accuracy/1"
DEFAULT_ROWS = 512
# Scores of one reference chunk (float64, plus exp's temporary): ~1 GiB on a GPU, 256 MiB on the CPU.
REFERENCE_CHUNK_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}


# -- inputs ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputKind:
    """How one kind of input departs from N(0, 1)."""

    name: str
    description: str
    k_outlier_channels: int = 0          # per KV head
    k_outlier_range: tuple = (10.0, 50.0)  # bias magnitude, in units of K's typical magnitude (std 1)
    q_scale: float = 1.0                 # score std = q_scale (scores are q.k / sqrt(d) of N(0, 1) vectors)

    @property
    def has_outliers(self) -> bool:
        return self.k_outlier_channels > 0


KINDS = {k.name: k for k in (
    InputKind("gaussian", "Q, K, V ~ N(0, 1)"),
    InputKind("k_outliers", "4 K channels per KV head biased by 10-50x", k_outlier_channels=4),
    InputKind("peaky", "queries x4: score std 4, a few keys dominate", q_scale=4.0),
    InputKind("outliers+peaky", "K outlier channels and peaky queries", k_outlier_channels=4, q_scale=4.0),
)}
# The kind of rows measured on a model's own attention inputs (``harness.captured``, ``bench --capture``).
CAPTURED = "captured"


def make_inputs(kind: str | InputKind, *, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                dtype: torch.dtype, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Seeded (q, k, v) in (B, H, S, D) and ``dtype``, and what was planted: ``outlier_channels`` (Hkv, n) and
    ``outlier_bias`` (Hkv, n) for kinds with K outliers. Drawn in float32 on ``device`` (a CPU generator for the
    outlier choice, so that it is the same on every device)."""
    spec = KINDS[kind] if isinstance(kind, str) else kind
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    gen = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_kv = (batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.float32)
    k = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32)
    v = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32)
    planted = {}
    if spec.q_scale != 1.0:
        q.mul_(spec.q_scale)
    if spec.has_outliers:
        n = min(spec.k_outlier_channels, head_dim)
        cpu = torch.Generator().manual_seed(seed + 1)
        channels = torch.stack([torch.randperm(head_dim, generator=cpu)[:n] for _ in range(kv_heads)])  # (Hkv, n)
        lo, hi = spec.k_outlier_range
        magnitude = lo + (hi - lo) * torch.rand(kv_heads, n, generator=cpu)
        sign = torch.where(torch.rand(kv_heads, n, generator=cpu) < 0.5, -1.0, 1.0)
        bias = torch.zeros(kv_heads, head_dim)
        bias.scatter_(1, channels, magnitude * sign)
        k.add_(bias.to(device).view(1, kv_heads, 1, head_dim))  # the same column bias for every token
        planted = {"outlier_channels": channels, "outlier_bias": magnitude * sign}
    return q.to(dtype), k.to(dtype), v.to(dtype), planted


# -- the float64 reference on sampled rows ---------------------------------------------------------------------------
def query_rows(seq: int, n: int, seed: int = 0) -> torch.Tensor:
    """Sorted indices of the query rows compared: all when ``seq <= n``, else a seeded random ``n`` that always
    includes the last row (in a causal prefill the one that sees all ``seq`` keys)."""
    if seq <= n:
        return torch.arange(seq)
    gen = torch.Generator().manual_seed(seed + 7)
    picked = torch.randperm(seq - 1, generator=gen)[:n - 1]
    return torch.sort(torch.cat([picked, torch.tensor([seq - 1])])).values


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, causal: bool,
                   scale: float | None = None, chunk_bytes: int | None = None) -> torch.Tensor:
    """float64 attention output of query rows ``rows`` only: (B, Hq, len(rows), D). Same conventions as
    ``llm_attn.reference.attention_naive`` (GQA by head groups; causal aligned bottom-right: row ``i`` sees key
    ``j <= i + Sk - Sq``), the score matrix built one chunk of rows at a time."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = rows.to(q.device)
    if chunk_bytes is None:
        chunk_bytes = REFERENCE_CHUNK_BYTES.get(q.device.type, 1 << 28)
    per_row = b * hq * sk * 8 * 2  # the scores and exp's temporary
    step = max(1, chunk_bytes // per_row)
    k64 = k.to(torch.float64)  # (B, Hkv, Sk, D)
    v64 = v.to(torch.float64)
    kpos = torch.arange(sk, device=q.device)
    out = []
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        c = idx.numel()
        # A KV head's G query heads as G*c rows of one matrix: K and V are multiplied in place, never expanded.
        qc = q[:, :, idx].to(torch.float64).reshape(b, hkv, g * c, d)
        s = torch.matmul(qc, k64.transpose(-1, -2)).mul_(scale).view(b, hkv, g, c, sk)
        if causal:
            visible = kpos.view(1, -1) <= idx.view(-1, 1) + (sk - sq)  # (c, Sk)
            s.masked_fill_(~visible, float("-inf"))
        s = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row that sees no key: output 0, as the kernel
        out.append(torch.matmul(s.view(b, hkv, g * c, sk), v64).view(b, hq, c, d))
        del s
    return torch.cat(out, dim=2)


# -- metrics and targets ---------------------------------------------------------------------------------------------
def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Error of ``out`` against ``ref`` (same shape, (..., D)), computed in float64."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
    diff = o - r
    of, rf = o.flatten(), r.flatten()
    denom = of.norm() * rf.norm()
    cosine = float(torch.dot(of, rf) / denom) if denom > 0 else (1.0 if torch.equal(of, rf) else 0.0)
    row_denom = o.norm(dim=-1) * r.norm(dim=-1)
    row_cos = torch.where(row_denom > 0, (o * r).sum(-1) / row_denom.clamp_min(1e-300),
                          (diff.abs().amax(-1) == 0).to(torch.float64))
    ref_l1 = float(r.abs().sum())
    return {
        "cosine": cosine,
        "rel_l1": float(diff.abs().sum()) / ref_l1 if ref_l1 > 0 else float(diff.abs().sum() > 0),
        "max_abs": float(diff.abs().max()),
        "ref_absmax": float(r.abs().max()),
        "min_row_cosine": float(row_cos.min()),
        "finite": bool(torch.isfinite(o).all()),
        "values": int(o.numel()),
    }


@dataclass(frozen=True)
class Target:
    """A bound one metric must meet on every input kind it applies to (``outliers_only``: kinds with K outliers)."""

    metric: str
    op: str  # ">=" or "<="
    threshold: float
    outliers_only: bool = True

    @property
    def name(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"

    def applies(self, kind: str) -> bool:
        spec = KINDS.get(kind)
        # A model's own activations (``CAPTURED``) are what the outlier kinds stand in for: every target applies.
        return not self.outliers_only or kind == CAPTURED or (spec is not None and spec.has_outliers)

    def met(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


# Issue 34: kernel cosine >= 0.999 and relative L1 <= 0.03 on the outlier inputs at every length up to 128k.
TARGETS = (Target("cosine", ">=", 0.999), Target("rel_l1", "<=", 0.03))


def check_targets(row: dict, targets: Sequence[Target] = TARGETS) -> list[dict]:
    """Each applicable target's verdict for one row; a row that did not run (error, OOM, non-finite output) misses
    them all."""
    out = []
    for t in targets:
        if not t.applies(row["kind"]):
            continue
        value = row.get(t.metric) if row.get("status") == "ok" and row.get("finite", True) else None
        out.append({"target": t.name, "metric": t.metric, "op": t.op, "threshold": t.threshold, "value": value,
                    "met": t.met(value)})
    return out


# -- implementations ---------------------------------------------------------------------------------------------------
# name -> what it runs; any attention-registry entry (built-in or plugin) is accepted too, called as patched.
ACCURACY_IMPLS = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention in the input dtype (default backend choice)",
    "ours": "llm_attn.flash_attn_func, precision='native' (the kernel on a GPU, the PyTorch reference on CPU)",
    "ours-fp8": "llm_attn.flash_attn_func, precision='fp8' (int8 Q K^T, e4m3 P V, per-block scales, fp32 softmax)",
    "ours-fp8-e4m3qk": "llm_attn.flash_attn_func, precision='fp8' with e4m3 Q K^T (llm_attn.ops.force_fp8_qk)",
    "ours-int8qk": "llm_attn.flash_attn_func, precision='fp8' with fp8_pv='input' (int8 Q K^T, P V in the input "
                   "dtype: llm_attn_int8qk's path)",
    "ours-int8": "llm_attn.flash_attn_func, precision='int8' (int8 Q K^T; P V in e4m3 on sm_89, the input dtype "
                 "elsewhere)",
    "fp8-reference": "llm_attn.quant_reference.attention_fp8 (the quantised PyTorch reference)",
    "cudnn-fp8": "cuDNN's FP8 attention through JAX (e4m3 Q, K, V, P and O, per-tensor scales: the vendor's FP8 "
                 "recipe; harness/cudnn_fp8.py)",
}
DEFAULT_IMPLS = ("sdpa", "ours", "ours-fp8", "ours-int8qk", "ours-int8")
BASELINE = "sdpa"  # what the table divides errors by: the error a user of stock attention already accepts

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def make_impl(name: str) -> AttentionFn:
    """``fn(q, k, v, causal) -> out (B, Hq, S, D)`` for a name of ``ACCURACY_IMPLS`` or the attention registry."""
    if name == "sdpa":
        def sdpa(q, k, v, causal):
            # q_len == kv_len here, so SDPA's top-left causal mask is ours.
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
        return sdpa
    if name in ("ours", "ours-fp8", "ours-int8"):
        from llm_attn.ops import flash_attn_func  # noqa: PLC0415

        if name == "ours":  # precision='native', the default
            return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)
        precision = name.removeprefix("ours-")
        return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal, precision=precision)
    if name == "ours-fp8-e4m3qk":
        from llm_attn.ops import flash_attn_func, force_fp8_qk  # noqa: PLC0415

        def fp8_e4m3qk(q, k, v, causal):
            with force_fp8_qk("e4m3"):
                return flash_attn_func(q, k, v, causal=causal, precision="fp8")
        return fp8_e4m3qk
    if name == "ours-int8qk":
        from llm_attn.ops import flash_attn_func  # noqa: PLC0415

        return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal, precision="fp8", fp8_qk="int8",
                                                       fp8_pv="input")
    if name == "fp8-reference":
        from llm_attn.quant_reference import attention_fp8  # noqa: PLC0415

        return lambda q, k, v, causal: attention_fp8(q, k, v, causal=causal)
    if name == "cudnn-fp8":
        from llm_attn.harness.cudnn_fp8 import cudnn_fp8  # noqa: PLC0415

        return cudnn_fp8
    from llm_attn import registry  # noqa: PLC0415

    entry = registry.get(name)

    def run_entry(q, k, v, causal):
        kwargs = {}
        if entry.select is not None:  # the variant it would serve these tensors with when patched in
            variant, why = entry.choose(q.device, q.dtype, q.shape[-1])
            if variant is None:
                raise RuntimeError(f"{name} cannot take these inputs: {why}")
            kwargs["variant"] = variant
        return entry.fn(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, **kwargs)
    return run_entry


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accuracy_point(impls: dict[str, AttentionFn] | Sequence[str], kind: str, *, batch: int = 1, heads: int = 32,
                   kv_heads: int = 8, seq: int, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                   causal: bool = True, device="cpu", rows: int = DEFAULT_ROWS, seed: int = 0,
                   targets: Sequence[Target] = TARGETS) -> list[dict]:
    """One input (kind, shape, seed), every implementation on it, each compared on the same sampled rows with the
    float64 reference: one row per implementation (status 'ok', 'oom' or 'error'; a failure does not stop the
    others). ``impls``: names (``make_impl``) or ``{label: fn(q, k, v, causal)}``."""
    device = torch.device(device)
    q, k, v, planted = make_inputs(kind, batch=batch, heads=heads, kv_heads=kv_heads, seq=seq, head_dim=head_dim,
                                   dtype=dtype, device=device, seed=seed)
    base = {"kind": kind, "input": asdict(KINDS[kind])}
    if planted:
        base["outlier_channels"] = planted["outlier_channels"].tolist()
    return _compare(impls, q, k, v, causal, base, rows=rows, seed=seed, targets=targets)


def accuracy_captured(impls: dict[str, AttentionFn] | Sequence[str], captured, *, source: str,
                      rows: int = DEFAULT_ROWS, seed: int = 0, targets: Sequence[Target] = TARGETS) -> list[dict]:
    """``accuracy_point`` on a model's own attention inputs (a ``harness.captured.CapturedLayer``): kind
    ``CAPTURED``, the layer, the model and prompt (``source``) and the inputs' statistics in each row. The
    implementations get the inputs as the layer did (its dtype, its causal flag)."""
    d = captured.q.shape[-1]
    if abs(captured.scale * d ** 0.5 - 1) > 1e-6:
        raise ValueError(f"layer {captured.layer} scales scores by {captured.scale:g}, not 1/sqrt({d}): the accuracy "
                         f"implementations and the reference use 1/sqrt(head_dim)")
    base = {"kind": CAPTURED, "layer": captured.layer, "source": source, "input_stats": captured.stats(),
            "input": {"name": CAPTURED, "description": f"{source}, attention layer {captured.layer}"}}
    return _compare(impls, captured.q, captured.k, captured.v, captured.causal, base, rows=rows, seed=seed,
                    targets=targets)


def _compare(impls, q, k, v, causal: bool, base: dict, *, rows: int, seed: int,
             targets: Sequence[Target]) -> list[dict]:
    device = q.device
    batch, heads, seq, head_dim = q.shape
    fns = {n: make_impl(n) for n in impls} if not isinstance(impls, dict) else dict(impls)
    idx = query_rows(seq, rows, seed)
    t0 = time.perf_counter()
    ref = reference_rows(q, k, v, idx, causal)
    _sync(device)
    ref_s = time.perf_counter() - t0
    base = {"schema": SCHEMA, "mode": "accuracy", **base, "batch": batch,
            "heads": heads, "kv_heads": k.shape[1], "q_len": seq, "kv_len": k.shape[2], "head_dim": head_dim,
            "dtype": str(q.dtype).removeprefix("torch."), "causal": bool(causal), "seed": seed,
            "device_type": device.type, "rows_compared": int(idx.numel()), "rows_total": seq,
            "reference": f"float64 on {int(idx.numel())} of {seq} query rows (seeded; the last included), "
                         f"computed in chunks of rows",
            "reference_s": ref_s}
    out_rows = []
    for name, fn in fns.items():
        row = {**base, "impl": name, "impl_description": ACCURACY_IMPLS.get(name, "attention registry entry")}
        try:
            t0 = time.perf_counter()
            out = fn(q, k, v, causal)
            _sync(device)
            row["impl_s"] = time.perf_counter() - t0
            if isinstance(out, tuple):
                out = out[0]
            if tuple(out.shape) != tuple(q.shape):
                raise ValueError(f"{name} returned shape {tuple(out.shape)}, expected {tuple(q.shape)}")
            row["out_dtype"] = str(out.dtype).removeprefix("torch.")
            picked = out[:, :, idx.to(out.device)]
            del out
            row.update(status="ok", **error_metrics(picked, ref))
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).splitlines()[0][:300])
        except Exception as e:  # noqa: BLE001 (an implementation that cannot take this input: recorded, not fatal)
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            row.update(status="error", error=f"{type(e).__name__}: {msg}")
        row["targets"] = check_targets(row, targets)
        row["targets_met"] = all(t["met"] for t in row["targets"]) if row["targets"] else None
        out_rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    baseline = next((r for r in out_rows if r["impl"] == BASELINE and r["status"] == "ok"), None)
    for r in out_rows:  # the error as a multiple of SDPA's own at this point (> 1: larger than SDPA's)
        if baseline is not None and r["status"] == "ok" and baseline["rel_l1"] > 0:
            r["rel_l1_vs_sdpa"] = r["rel_l1"] / baseline["rel_l1"]
    return out_rows


# -- printing ----------------------------------------------------------------------------------------------------------
def _verdict(row: dict) -> str:
    if not row.get("targets"):
        return "(no target)"
    missed = [t for t in row["targets"] if not t["met"]]
    if not missed:
        return "pass"
    return "FAIL: " + "; ".join(f"{t['metric']} {t['value']:.6g} not {t['op']} {t['threshold']:g}"
                                if t["value"] is not None else f"{t['metric']}: {row['status']}" for t in missed)


def input_label(row: dict) -> str:
    """The input column: the kind, or ``captured L5`` for a model's own layer 5."""
    return f"{CAPTURED} L{row['layer']}" if row["kind"] == CAPTURED else row["kind"]


def accuracy_line(row: dict) -> str:
    """One row as a progress line: the point, the metrics and the target verdict."""
    point = (f"{input_label(row)} S={row['kv_len']} causal={int(row['causal'])} {row['dtype']} {row['impl']}: ")
    if row["status"] != "ok":
        return point + row["status"].upper() + f" ({row.get('error', '')})" + (
            f" -> {_verdict(row)}" if row.get("targets") else "")
    return point + (f"cosine {row['cosine']:.6f}, rel L1 {row['rel_l1']:.2e}, max |err| {row['max_abs']:.2e} "
                    f"({row['impl_s']:.2f} s) -> {_verdict(row)}")


def accuracy_table(rows: Sequence[dict], tablefmt: str = "github") -> str:
    """One line per (kind, length, causal, dtype, impl): the metrics, the error as a multiple of SDPA's, and the
    target verdict (pass / FAIL with the missed values)."""
    from tabulate import tabulate  # noqa: PLC0415

    table = []
    for r in rows:
        ok = r["status"] == "ok"
        table.append([input_label(r), r["kv_len"], int(r["causal"]), r["dtype"], r["impl"],
                      f"{r['cosine']:.6f}" if ok else r["status"].upper(),
                      f"{r['rel_l1']:.2e}" if ok else "", f"{r['max_abs']:.2e}" if ok else "",
                      f"{r['min_row_cosine']:.5f}" if ok else "",
                      f"{r['rel_l1_vs_sdpa']:.2f}x" if ok and "rel_l1_vs_sdpa" in r else "",
                      _verdict(r) if ok else
                      " - ".join(x for x in ((_verdict(r) if r.get("targets") else ""), r.get("error", "")[:80]) if x)])
    return tabulate(table, headers=["input", "S", "causal", "dtype", "impl", "cosine", "rel L1", "max |err|",
                                    "worst row cos", "rel L1 / sdpa's", "targets"],
                    tablefmt=tablefmt, disable_numparse=True)


def target_summary(rows: Sequence[dict], targets: Sequence[Target] = TARGETS) -> tuple[str, int]:
    """The closing lines: each target, on how many (impl, point) pairs it was checked and met, and every miss by
    name. Returns (text, number of misses)."""
    lines, misses = [], 0
    for t in targets:
        checked = [(r, v) for r in rows for v in r.get("targets", []) if v["target"] == t.name]
        missed = [(r, v) for r, v in checked if not v["met"]]
        misses += len(missed)
        scope = "outlier inputs" if t.outliers_only else "all inputs"
        if t.outliers_only and any(r["kind"] == CAPTURED for r, _ in checked):
            scope = "outlier inputs and the model's own layers"
        lines.append(f"target {t.name} ({scope}, every length): "
                     + (f"met on all {len(checked)} checked" if not missed else
                        f"MISSED on {len(missed)} of {len(checked)}") if checked else
                     f"target {t.name}: not checked (no {scope} measured)")
        for r, v in missed:
            val = f"{v['value']:.6g}" if v["value"] is not None else r["status"]
            lines.append(f"  MISS {r['impl']} {input_label(r)} S={r['kv_len']} causal={int(r['causal'])} {r['dtype']}: "
                         f"{t.metric} = {val}")
    return "\n".join(lines), misses
