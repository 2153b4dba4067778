"""Statistics derived from raw latency samples. The raw samples are always stored next to these numbers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def summarize(samples_ms: Sequence[float]) -> dict:
    """p50/p90/p99 (linear interpolation between order statistics), min, max, mean, sample stdev and stdev as a
    percentage of the mean, for a non-empty list of finite latencies in milliseconds."""
    if len(samples_ms) == 0:
        raise ValueError("summarize() needs at least one sample")
    x = np.asarray(samples_ms, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"samples must be finite, got {samples_ms!r}")
    if np.any(x < 0):
        raise ValueError(f"latencies cannot be negative, got {samples_ms!r}")
    mean = float(x.mean())
    # Sample (n-1) standard deviation: the repeats are a sample of the latency distribution, not all of it.
    stdev = float(x.std(ddof=1)) if x.size > 1 else 0.0
    return {
        "n": int(x.size),
        "p50": float(np.percentile(x, 50)),
        "p90": float(np.percentile(x, 90)),
        "p99": float(np.percentile(x, 99)),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": mean,
        "stdev": stdev,
        "stdev_pct": 100.0 * stdev / mean if mean > 0 else None,
    }


# -- the one ratio convention ------------------------------------------------------------------------------------------
# Every ratio a user reads (TTFT, decode, LoRA step, kernel and host benchmarks) is reference time / this time, or for
# a throughput (tok/s, TFLOP/s, GB/s) this / reference: > 1 always means "this is faster", and every column header
# says so (``ratio_header``).
BETTER = ">1 = faster"


def ratio_header(reference: str, this: str | None = None) -> str:
    """The header of a ratio column: ``vs sdpa (>1 = faster)``, or ``ours vs flash (>1 = faster)``."""
    return f"{this + ' ' if this else ''}vs {reference} ({BETTER})"


def speed_ratio(reference: float | None, this: float | None, *, throughput: bool = False) -> float | None:
    """The plain ratio of two numbers of one unit, > 1 when ``this`` is faster: ``reference / this`` for times (ms
    per call, per step, medians), ``this / reference`` for throughputs (``throughput=True``). None where either is
    missing, not finite or not positive (no number rather than a wrong one)."""
    if reference is None or this is None:
        return None
    a, b = float(reference), float(this)
    if not (np.isfinite(a) and np.isfinite(b)) or a <= 0 or b <= 0:
        return None
    return b / a if throughput else a / b


def format_ratio(ratio: float | None, digits: int = 2, words: bool = False) -> str:
    """``1.06x`` (``words``: ``1.06x faster``, ``0.98x slower``; a ratio with no interval says nothing about noise,
    so the word is only the direction); ``""`` for None."""
    if ratio is None:
        return ""
    text = f"{ratio:.{digits}f}x"
    if not words:
        return text
    if round(ratio, digits) == 1:
        return text + " same"
    return text + (" faster" if ratio > 1 else " slower")


# -- paired verdicts ---------------------------------------------------------------------------------------------------
# 10k resamples: the 2.5/97.5 % quantiles of the bootstrap distribution move by < 0.1 % between seeds at n = 10..50.
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


def paired_ratio_interval(reference_ms: Sequence[float], mine_ms: Sequence[float], *,
                          resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                          seed: int = 0) -> dict:
    """Speedup ``median(reference) / median(mine)`` (> 1: mine is faster, as the table's 'vs sdpa' column reads)
    with a paired percentile-bootstrap interval: each resample draws repeat indices with replacement and keeps
    both implementations' samples of a drawn repeat together, so drift that hit both alike cancels.

    ``reference_ms[i]`` and ``mine_ms[i]`` must come from the same repeat ``i``. Seeded: the same samples give the
    same interval. ``contains_one`` means the data cannot tell the two apart at this confidence."""
    ref = np.asarray(reference_ms, dtype=np.float64)
    mine = np.asarray(mine_ms, dtype=np.float64)
    if ref.shape != mine.shape or ref.ndim != 1 or ref.size == 0:
        raise ValueError(f"paired samples must be two non-empty lists of equal length, got {ref.shape} and "
                         f"{mine.shape}")
    if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(mine))) or np.any(ref <= 0) or np.any(mine <= 0):
        raise ValueError("paired samples must be finite positive latencies")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ratio = float(np.median(ref) / np.median(mine))
    rng = np.random.default_rng(seed)
    n = ref.size
    # Resampled in chunks so 10k x n indices never need more than a few MB.
    ratios = np.empty(resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // n)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        ratios[start:stop] = np.median(ref[idx], axis=1) / np.median(mine[idx], axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = (float(v) for v in np.quantile(ratios, [alpha, 1 - alpha]))
    # The percentile interval of a median can exclude the point estimate for tiny n; widen to hold it.
    lo, hi = min(lo, ratio), max(hi, ratio)
    return {"ratio": ratio, "low": lo, "high": hi, "confidence": confidence, "n": int(n),
            "resamples": int(resamples), "method": "paired percentile bootstrap of the ratio of medians",
            "seed": seed, "contains_one": bool(lo <= 1.0 <= hi)}


def format_ratio_interval(iv: dict, words: bool = True) -> str:
    """``0.995x [0.989, 1.002] no difference`` / ``1.20x [1.15, 1.26] faster`` / ``0.80x [0.77, 0.83] slower``."""
    digits = 3 if max(abs(iv["high"] - 1), abs(iv["low"] - 1)) < 0.1 else 2
    text = f"{iv['ratio']:.{digits}f}x [{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"
    if not words:
        return text
    if iv["contains_one"]:
        return text + " no difference"
    return text + (" faster" if iv["low"] > 1.0 else " slower")
