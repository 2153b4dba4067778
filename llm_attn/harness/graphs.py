"""Python's cyclic garbage collector kept out of timed regions and out of CUDA-graph captures.

- ``no_gc``: timing with the collector off (as timeit and pyperf do), one full collection first.
- ``graph_capture``: ``torch.cuda.graph`` under ``no_gc``. torch 2.9 and later no longer collect before a capture
  (pytorch/pytorch#161037). A CUDA graph left in a reference cycle (a test's frame kept by a traceback,
  torch.compile's CUDA-graph trees after a reset) can then be destroyed by a collection that happens to run inside
  another capture, and destroying it there is a call the capture forbids: the capture is invalidated
  (cudaErrorStreamCaptureInvalidated at its end), and torch's CUDA generator stays registered to it, so every later
  random draw in the process fails. A capture that runs many Python launches (the NVRTC build's) allocates enough
  objects to make such a collection likely. Collecting first and capturing with the collector off removes it.
"""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def no_gc():
    """Python's cyclic garbage collector off inside the block, one full collection first.

    A forward of a transformers model allocates thousands of Python objects; the collections they trigger pause
    the host for milliseconds at random points. Where the prefill is host-bound (the 8B model at 2048 tokens on an
    H100), such a pause lands in one implementation's sample and reads as a kernel difference. Reference cycles made
    inside the block are collected when it ends. Nests: an inner block leaves the collector as the outer one set it."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kwargs):
    """``with torch.cuda.graph(graph, **kwargs)`` with no cyclic collection before its end (module docstring)."""
    with no_gc(), torch.cuda.graph(graph, **kwargs):
        yield
