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
