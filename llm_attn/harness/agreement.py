"""End-to-end agreement with stock attention (issue 34, item 4): greedy-token agreement over the first
``AGREEMENT_TOKENS`` generated tokens and the KL divergence of the next-token distributions, the third column of
the ``correctness`` measurement (``measure.measure_correctness``), on the sweep's prompts (``--prompts`` text when
given, else seeded random ids).

- Agreement: each implementation generates greedily on its own (free-running, as a user would see it); the
  fraction of the first 64 positions where both chose the same token, over the batch, and where they first differ.
  Target: >= 99 % (``GREEDY_TARGET``), against stock.
- KL: both implementations are fed the same tokens, the prompt followed by stock's own greedy continuation
  (teacher-forced), and ``KL(p_stock || p_impl)`` (nats) of the next-token distributions is taken, in float64, at
  the last ``KL_PROMPT_POSITIONS`` prompt positions and every continuation position: the mean over those positions
  (and the batch), and the largest. Feeding the same tokens keeps one early divergence from making every later
  position incomparable.
- Top-1, teacher-forced: at those same positions, the fraction where both put the same token first, and the flips
  read against stock's own confidence there: the largest gap between stock's first and second log-probability at a
  flipped position, and the share of all positions where stock's gap is no larger. Free-running greedy agreement
  counts every token after the first flip as a miss; this says how often a flip happens, and at what margins, so a
  kernel that only flips stock's near-ties reads apart from one that flips confident tokens.

Long prompts: the model's positions bound the continuation (``continuation_tokens``); the logits kept are the last
``KL_PROMPT_POSITIONS + tokens`` positions only (``logits_to_keep``), so memory does not grow with the prompt.
"""

from __future__ import annotations

import inspect

import torch

AGREEMENT_TOKENS = 64
KL_PROMPT_POSITIONS = 64
GREEDY_TARGET = 0.99


def continuation_tokens(model, seq: int, tokens: int = AGREEMENT_TOKENS) -> int:
    """How many tokens can follow a ``seq``-token prompt within the model's positions (at most ``tokens``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return tokens
    return max(0, min(tokens, limit - seq))


def next_token_logprobs(model, ids: torch.Tensor, keep: int, cache_kwargs: dict | None = None) -> torch.Tensor:
    """log-softmax (float64, on the CPU: float32's rounding of log-probabilities near -ln(vocab) alone would put the
    KL of identical logits at ~1e-8) of the next-token logits at the last ``keep`` positions of ``ids``:
    (B, keep, vocab). One forward, without a cache, or into the fresh cache ``cache_kwargs`` names (e.g. the FP8 KV
    cache: then attention reads every key and value through it, as in a prefill)."""
    params = inspect.signature(type(model).forward).parameters
    name = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    out = model(input_ids=ids, use_cache=bool(cache_kwargs), **(cache_kwargs or {}), **({name: keep} if name else {}))
    return torch.log_softmax(out.logits[:, -keep:].cpu().to(torch.float64), dim=-1)


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` per position in nats (float64), over the last dimension (the vocabulary)."""
    r, p = ref_logprobs.to(torch.float64), logprobs.to(torch.float64)
    return (r.exp() * (r - p)).sum(dim=-1).clamp_min(0.0)  # >= 0 up to rounding


def token_agreement(ref_tokens: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int | None]:
    """(fraction of equal positions over (B, n) token ids, first position where any row differs or None)."""
    if ref_tokens.shape != tokens.shape:
        raise ValueError(f"token shapes differ: {tuple(ref_tokens.shape)} vs {tuple(tokens.shape)}")
    if ref_tokens.numel() == 0:
        return 1.0, None
    same = ref_tokens == tokens
    differ = (~same).any(dim=0).nonzero()
    return float(same.float().mean()), (int(differ[0, 0]) if differ.numel() else None)


def forced_top1(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> dict:
    """Top-1 agreement of two (B, positions, vocab) log-probability tensors fed the same tokens: ``agreement`` (the
    fraction of positions with the same most likely token), ``flips`` of ``positions``, ``flip_margin_max`` (the
    largest gap, nats, between stock's first and second log-probability at a flipped position; None without flips)
    and ``flip_margin_share`` (the fraction of all positions whose stock gap is at most that: how rare the margins
    that flipped are)."""
    if ref_logprobs.shape != logprobs.shape or ref_logprobs.dim() != 3 or ref_logprobs.shape[-1] < 2:
        raise ValueError(f"need two equal (batch, positions, vocab >= 2) tensors, got {tuple(ref_logprobs.shape)} "
                         f"and {tuple(logprobs.shape)}")
    top2 = ref_logprobs.to(torch.float64).topk(2, dim=-1)
    margin = top2.values[..., 0] - top2.values[..., 1]  # (B, positions), >= 0
    flipped = top2.indices[..., 0] != logprobs.argmax(dim=-1)
    n, flips = margin.numel(), int(flipped.sum())
    out = {"agreement": 1.0 - flips / n if n else 1.0, "flips": flips, "positions": int(n),
           "flip_margin_max": None, "flip_margin_share": None}
    if flips:
        worst = float(margin[flipped].max())
        out["flip_margin_max"] = worst
        out["flip_margin_share"] = float((margin <= worst).double().mean())
    return out


def agreement_fields(ref_tokens: torch.Tensor, tokens: torch.Tensor, ref_logprobs: torch.Tensor | None,
                     logprobs: torch.Tensor | None, prompt_positions: int) -> dict:
    """The row fields: ``greedy_agreement_64`` (with its target verdict), ``first_divergence_64``, ``logit_kl``,
    ``top1_forced``."""
    agree, first = token_agreement(ref_tokens, tokens)
    out = {"agreement_tokens": int(ref_tokens.shape[1]), "greedy_agreement_64": agree, "first_divergence_64": first,
           "greedy_target": {"threshold": GREEDY_TARGET, "met": agree >= GREEDY_TARGET}}
    if ref_logprobs is not None and logprobs is not None:
        kl = kl_divergence(ref_logprobs, logprobs)  # (B, positions)
        out["logit_kl"] = {"mean": float(kl.mean()), "max": float(kl.max()),
                           "continuation_mean": float(kl[:, prompt_positions:].mean())
                           if kl.shape[1] > prompt_positions else None,
                           "positions": int(kl.shape[1]), "prompt_positions": prompt_positions,
                           "direction": "KL(stock || impl), nats, teacher-forced on stock's continuation"}
        out["top1_forced"] = forced_top1(ref_logprobs, logprobs)
    return out


# The correctness table's third and fourth columns (kept narrow: the default table fits 120 columns) and the line
# under the table that says what they are.
AGREEMENT_HEADERS = ("greedy, first 64", "KL mean (max)")
AGREEMENT_NOTE = ("(greedy, first 64: identical greedy tokens over the first 64 generated, each implementation "
                  "free-running; target >= 99 %. KL: KL(stock || impl) in nats of the next-token distributions at the "
                  "last 64 prompt positions and along stock's continuation, both fed the same tokens)")
MISS_FLIPS_NOTE = "(a miss's line below also counts the top-1 flips at the KL's positions)"


def agreement_cells(row: dict) -> list[str]:
    """The two cells, e.g. ``100.0% met`` and ``2.1e-07 (3.4e-06)``; empty for rows measured before they existed.
    (The teacher-forced top-1 flips go to the miss lines: a third column would pass the table's 120 columns.)"""
    if row.get("greedy_agreement_64") is None:
        return ["", ""]
    n = row.get("agreement_tokens", AGREEMENT_TOKENS)
    greedy = f"{100 * row['greedy_agreement_64']:.1f}% {'met' if row['greedy_target']['met'] else 'MISSED'}"
    if n != AGREEMENT_TOKENS:
        greedy += f" ({n} tok.)"  # the model's positions end there
    kl = row.get("logit_kl")
    return [greedy, f"{kl['mean']:.2g} ({kl['max']:.2g})" if kl else ""]


# The report's extra column (report.md has no 120-column limit): the teacher-forced top-1 flips of a row.
FLIPS_HEADER = "top-1 flips (largest stock gap)"
FLIPS_NOTE = ("(top-1 flips: positions, both fed the same tokens, where the two put different tokens first; in "
              "brackets stock's largest gap, in nats, between its first and second log-probability at a flipped "
              "position: small gaps are stock's own near-ties)")


def flips_cell(row: dict) -> str:
    """``7 of 512 (<= 0.012)``, ``0 of 512``; empty for rows measured before the field existed."""
    top1 = row.get("top1_forced")
    if not top1:
        return ""
    if not top1["flips"]:
        return f"0 of {top1['positions']}"
    return f"{top1['flips']} of {top1['positions']} (<= {top1['flip_margin_max']:.2g})"


def correctness_names(row: dict) -> tuple[str, str]:
    """The implementation and reference cells of a correctness row: on the FP8 KV cache the implementation ran on
    the cache and stock on transformers' own, and both tables say so (``sdpa vs sdpa`` alone would read as noise)."""
    if row.get("kv_cache") == "fp8":
        return row["impl"] + " (FP8 KV cache)", row["reference_impl"] + " (unquantised cache)"
    return row["impl"], row["reference_impl"]


def agreement_misses(rows) -> list[str]:
    """One line per correctness row that missed the greedy-agreement target (never left to a table cell alone), with
    the teacher-forced flips that explain it when the row has them."""
    return [f"MISS greedy agreement over the first {r.get('agreement_tokens', AGREEMENT_TOKENS)} tokens: {r['impl']} "
            f"vs {r['reference_impl']} at batch {r['batch']}, seq {r['seq']}: {100 * r['greedy_agreement_64']:.1f}% "
            f"< {100 * GREEDY_TARGET:.0f}% (first difference at token {r['first_divergence_64']})"
            + _flips_clause(r.get("top1_forced"))
            for r in rows if r.get("measurement") == "correctness" and r.get("status") == "ok"
            and r.get("greedy_target") and not r["greedy_target"]["met"]]


def _flips_clause(top1: dict | None) -> str:
    if not top1:
        return ""
    if not top1["flips"]:
        return f"; teacher-forced, no top-1 flip in {top1['positions']} positions"
    flips = f"{top1['flips']} top-1 flip{'s' if top1['flips'] > 1 else ''}"
    return (f"; teacher-forced, {flips} in {top1['positions']} positions, where stock's top-2 gap "
            f"was <= {top1['flip_margin_max']:.2g} nats (as small at {100 * top1['flip_margin_share']:.1f}% of "
            f"positions)")


def low_precision_note(impl_info: dict | None) -> str | None:
    """The results table's note for an implementation that computes attention in lower precision than its inputs
    (e.g. ``fp8 attention (e4m3, per-block scales); accuracy: see correctness``), None for any other. Read from what
    the row recorded about its implementation: a ``precision`` other than native (the registry entry's own word),
    else a description that says "low precision"."""
    info = impl_info or {}
    precision = info.get("precision")
    if precision and precision != "native":
        return f"{precision} attention; accuracy: see correctness"
    description = info.get("description") or ""
    if "low precision" in description.lower():
        return f"low precision: {description.split(';')[0].split('(low precision')[0].strip()}; accuracy: see " \
               f"correctness"
    return None
