"""The measurements: TTFT, decode as users run it, decode kernel-limited, and ours-vs-stock correctness.

All of them take a loaded model and a prompt (``input_ids``, batch x seq, already on the model's device), run
under ``torch.inference_mode``, and return the fields of one result row (raw samples plus derived numbers).

- TTFT: prefill forward over exactly ``seq`` tokens with a fresh cache and ``logits_to_keep=1``, then greedy
  sampling of the first token, timed with CUDA events (on CPU, ``perf_counter``) after warm-up at the same shape.
  With ``prefill_chunk`` (``--prefill-chunk N``) the prompt runs as forwards of N tokens against the growing cache
  (``prefill_first_token``); TTFT, both decodes' prefills and the graph TTFT take it. With ``kv_cache="fp8"``
  (``--kv-cache fp8``) TTFT and decode "generate" run on ``Fp8DynamicCache`` and decode "graph" on
  ``Fp8StaticCache`` (``llm_attn.models.kv_cache``): stock attention reads its dequantised copy, llm_attn's decode
  steps its bytes (the patch report, and so the row's ``attention_calls.kv_cache_reads``, counts which).
  The graph decode captures the steps on the FP8 static cache (``device_position``: the step runs on the device
  alone): llm_attn's read the bytes; stock attention's read a copy of the whole capacity under transformers' causal
  mask (the honest baseline: stock attention cannot read FP8). The graph TTFT on it is 'unsupported' (a prefill's
  copy is sized on the host).
- Decode, "generate": ``model.generate`` with the default cache, exactly as users call it; a streamer timestamps
  every token as it reaches the host, so the first token (the prefill) is excluded and each later token is timed.
- Decode, "graph": a static KV cache and one decode step captured in a CUDA graph, replayed per token: the time
  the kernels need without Python and launch overhead. On CPU the same static-cache loop runs without a graph and
  says so in ``mode``.
- TTFT, "graph" (``measure_ttft_graph``): the whole prefill and the first-token argmax captured in one CUDA graph
  and replayed (a fresh DynamicCache created inside the capture, or a StaticCache reset before each replay); the
  attention kernels of one profiled replay are named in the row. Off CUDA, or where capture fails: 'unsupported'.
- Correctness: max |logit difference| at the prompt's last position and greedy-token agreement, a patched
  implementation vs stock; and the first 64 tokens' greedy agreement and the logit KL (``harness.agreement``).
"""

from __future__ import annotations

import functools
import inspect
import re
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, StaticCache
from transformers.generation.streamers import BaseStreamer

from llm_attn.harness.agreement import (
    KL_PROMPT_POSITIONS,
    agreement_fields,
    continuation_tokens,
    next_token_logprobs,
)
from llm_attn.harness.graphs import graph_capture, no_gc
from llm_attn.harness.results import KV_CACHES, jsonable
from llm_attn.harness.stats import summarize
from llm_attn.models.kv_cache import Fp8DynamicCache, Fp8StaticCache

# Steps run before capturing the decode graph: the first call of an op may allocate workspaces or pick algorithms,
# which a capture must not see.
GRAPH_WARMUP_STEPS = 2
_OOM_ERRORS = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


class GraphCaptureUnsupported(RuntimeError):
    """The model's attention path cannot be captured in a CUDA graph (a limitation of that path, not a failure of
    the measurement). Stock transformers' eager attention is one: its mask builder copies a host tensor to the GPU
    on every call, which CUDA-graph capture refuses."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _logits_kwargs(model) -> dict:
    """Ask for the last position's logits only, under whichever name this model's forward knows."""
    return dict(_logits_kwarg_for(type(model)))


@functools.cache
def _logits_kwarg_for(cls) -> tuple:
    # Cached per class: inspecting a signature inside the timed region would be measured as TTFT.
    params = inspect.signature(cls.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return ((name, 1),)
    return ()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _pad_token_id(model) -> int:
    gc = getattr(model, "generation_config", None)
    for cand in (getattr(gc, "pad_token_id", None), getattr(gc, "eos_token_id", None)):
        if isinstance(cand, list):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def _generate_kwargs(model, input_ids: torch.Tensor, new_tokens: int, prefill_chunk: int | None = None) -> dict:
    """Greedy, exactly ``new_tokens`` new tokens whatever the model's EOS. Given as total lengths (prompt + new)
    rather than max/min_new_tokens: checkpoints' generation configs often set max_length, and transformers warns
    on every call when both are set. ``prefill_chunk``: generate's own chunked prefill (``prefill_chunk_size``)."""
    total = input_ids.shape[1] + new_tokens
    chunked = {"prefill_chunk_size": prefill_chunk} if prefill_chunk and prefill_chunk < input_ids.shape[1] else {}
    return dict(attention_mask=torch.ones_like(input_ids), max_length=total, min_length=total, do_sample=False,
                num_beams=1, pad_token_id=_pad_token_id(model), **chunked)


def _check_kv_cache(kv_cache: str) -> None:
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")


def new_cache(model, kv_cache: str = "fp16"):
    """A fresh dynamic cache: transformers' ``DynamicCache`` (K/V in the model's dtype) or ``Fp8DynamicCache``."""
    _check_kv_cache(kv_cache)
    return Fp8DynamicCache(config=model.config) if kv_cache == "fp8" else DynamicCache(config=model.config)


def _fp8_not_capturable(what: str) -> GraphCaptureUnsupported:
    return GraphCaptureUnsupported(f"{what} with the FP8 KV cache cannot be captured in a CUDA graph: only a one-token "
                                   f"decode step runs on the device alone (Fp8StaticCache device_position); a "
                                   f"prefill's copy of the cache is sized on the host")


def cache_kwarg(model, cache) -> dict:
    """The KV cache as the keyword the model's forward takes: ``cache`` from transformers 5.24 on, where
    ``past_key_values`` still works but warns on every run that it is deprecated; ``past_key_values`` before."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters  # through the deprecation wrapper (functools.wraps)
    except (TypeError, ValueError):
        params = {}
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def prefill_first_token(model, input_ids: torch.Tensor, cache=None, chunk: int | None = None,
                        kv_cache: str = "fp16") -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill (a fresh ``new_cache(model, kv_cache)`` unless a cache is given) and greedy sampling: (token ids (B,), logits of the last
    position (B, vocab)). ``chunk``: the prompt goes in forwards of ``chunk`` tokens against the growing cache, each
    chunk causal bottom-right over everything cached (transformers builds that mask from the cache's length, as
    ``generate(prefill_chunk_size=)`` does), so activations scale with the chunk, not the prompt; a chunk at least as
    long as the prompt is one forward."""
    cache = new_cache(model, kv_cache) if cache is None else cache
    kwargs = {**cache_kwarg(model, cache), "use_cache": True, **_logits_kwargs(model)}
    for part in input_ids.split(chunk, dim=1) if chunk else (input_ids,):
        out = model(input_ids=part, **kwargs)
    logits = out.logits[:, -1, :]
    return logits.argmax(dim=-1), logits


def measure_ttft(model, input_ids: torch.Tensor, warmup: int, repeats: int,
                 on_repeat: Callable[[], None] | None = None, prefill_chunk: int | None = None,
                 kv_cache: str = "fp16") -> dict:
    """TTFT samples in ms: prompt in, first token out. ``samples_ms`` are device times (CUDA events: start before
    the forward, end after the argmax); ``wall_samples_ms`` add the copy of the token to the host."""
    device = input_ids.device
    cuda = device.type == "cuda"
    samples, wall = [], []
    with torch.inference_mode(), no_gc():
        for _ in range(warmup):
            prefill_first_token(model, input_ids, chunk=prefill_chunk, kv_cache=kv_cache)
        _sync(device)
        _reset_peak(device)
        for _ in range(repeats):
            _sync(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                tok, _ = prefill_first_token(model, input_ids, chunk=prefill_chunk, kv_cache=kv_cache)
                end.record()
                tok.cpu()
                t1 = time.perf_counter()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                tok, _ = prefill_first_token(model, input_ids, chunk=prefill_chunk, kv_cache=kv_cache)
                tok.cpu()
                t1 = time.perf_counter()
                samples.append((t1 - t0) * 1e3)
            wall.append((t1 - t0) * 1e3)
            del tok
            if on_repeat:
                on_repeat()
    return {
        "timer": "cuda_event" if cuda else "perf_counter",
        "samples_ms": samples,
        "wall_samples_ms": wall,
        "stats": summarize(samples),
        "warmup": warmup,
        "repeats": repeats,
        "peak_mem_bytes": _peak(device),
    }


class _TokenClock(BaseStreamer):
    """Timestamps each ``put``: generate() puts the prompt first, then every new token as a host tensor, so each
    timestamp is taken after that token is on the host (on CUDA the ``.cpu()`` copy in generate synchronises)."""

    def __init__(self, meter=None):
        self.times: list[float] = []
        self.meter, self.window = meter, None

    def put(self, value):
        self.times.append(time.perf_counter())
        if self.meter is not None and len(self.times) == 2:
            # The first new token (the prefill's) is on the host: the decode's energy window starts here.
            self.window = self.meter.begin()

    def end(self):
        pass


def _decode_fields(run_steps_ms: list[list[float]], run_total_ms: list[float], new_tokens: int) -> dict:
    """Per-token samples of every run, each run's time per output token, and tok/s from the median run."""
    tpot = [t / (new_tokens - 1) for t in run_total_ms]
    samples = [s for run in run_steps_ms for s in run]
    med_tpot = summarize(tpot)["p50"]
    return {
        "samples_ms": samples,
        "stats": summarize(samples),
        "run_tpot_ms": tpot,
        "tpot_ms": med_tpot,
        "tok_s": 1e3 / med_tpot,
    }


def measure_decode_generate(model, input_ids: torch.Tensor, new_tokens: int, runs: int,
                            warmup_runs: int = 1, on_run: Callable[[], None] | None = None, meter=None,
                            prefill_chunk: int | None = None, kv_cache: str = "fp16") -> dict:
    """Decode through ``model.generate`` (default dynamic cache, or a fresh ``Fp8DynamicCache`` per call with
    ``kv_cache="fp8"``; greedy), tokens 2..N timed by their arrival.
    ``meter`` (``harness.energy``): each run's energy from the first new token's arrival to the end of generate
    (``energy_windows``)."""
    if new_tokens < 2:
        raise ValueError(f"decode needs new_tokens >= 2 (the first token is TTFT), got {new_tokens}")
    device = input_ids.device
    _check_kv_cache(kv_cache)
    kwargs = _generate_kwargs(model, input_ids, new_tokens, prefill_chunk)

    def cache():  # a fresh cache per generate (made before its clock starts); None: generate's default
        return {"past_key_values": new_cache(model, "fp8")} if kv_cache == "fp8" else {}

    steps, totals, first_token_ms, tokens, windows = [], [], [], None, []
    with torch.inference_mode(), no_gc():
        # Warm-up runs cover the decode shapes too: the first generate after a shape change is much slower.
        for _ in range(warmup_runs):
            model.generate(input_ids, **kwargs, **cache())
        _sync(device)
        _reset_peak(device)
        for _ in range(runs):
            clock, fresh = _TokenClock(meter), cache()
            _sync(device)
            out = model.generate(input_ids, streamer=clock, **kwargs, **fresh)
            if meter is not None:
                windows.append(meter.end(clock.window, tokens=(new_tokens - 1) * input_ids.shape[0]))
            t = clock.times
            if len(t) != new_tokens + 1 or out.shape[1] != input_ids.shape[1] + new_tokens:
                raise RuntimeError(f"generate produced {out.shape[1] - input_ids.shape[1]} tokens and {len(t) - 1} "
                                   f"timestamps, expected {new_tokens}")
            steps.append([(b - a) * 1e3 for a, b in zip(t[1:-1], t[2:])])
            totals.append((t[-1] - t[1]) * 1e3)
            first_token_ms.append((t[1] - t[0]) * 1e3)
            if tokens is None:
                tokens = out[:, input_ids.shape[1]:].tolist()
            if on_run:
                on_run()
    return {
        **_decode_fields(steps, totals, new_tokens),
        "timer": "perf_counter",
        "mode": "generate",
        "generate_first_token_ms": first_token_ms,
        "warmup_runs": warmup_runs,
        "runs": runs,
        "tokens": tokens,
        "peak_mem_bytes": _peak(device),
        **({"energy_windows": windows} if meter is not None else {}),
    }


def _extend_static_cache(cache, seq: int, context: int) -> None:
    """Fill positions seq..context of every StaticCache layer with its first ``seq`` keys/values, repeated, and
    move the layer's position counter to ``context`` (measure_decode_static's ``context``). FP8 layers re-quantise
    the repeated tokens (``Fp8StaticLayer.extend_by_repeating``)."""
    for layer in cache.layers:
        if hasattr(layer, "extend_by_repeating"):
            layer.extend_by_repeating(context)
            continue
        for buf in (layer.keys, layer.values):
            filled = buf[:, :, :seq]
            reps = -(-(context - seq) // seq)
            buf[:, :, seq:context] = filled.repeat(1, 1, reps, 1)[:, :, :context - seq]
        layer.cumulative_length.fill_(context)


def measure_decode_static(model, input_ids: torch.Tensor, new_tokens: int, runs: int, use_graph: bool,
                          on_run: Callable[[], None] | None = None, context: int | None = None,
                          meter=None, prefill_chunk: int | None = None, kv_cache: str = "fp16") -> dict:
    """Kernel-limited decode: StaticCache (``Fp8StaticCache`` with ``kv_cache="fp8"``), one greedy decode step per token, replayed from a CUDA graph when
    ``use_graph`` (CUDA only). Each step reads the previous token from a static buffer and writes the next one
    into it, so the replayed graph feeds itself. The cache's position counters are tensors that the step advances
    in place; they are reset to the prompt length before every run, so all runs decode the same tokens.

    ``context``: decode as if the cache held ``context`` tokens (longer than the prompt). After the prompt's
    prefill, cache positions ``seq..context`` are filled with the prompt's own keys and values, repeated, and the
    position counters set to ``context``: each step then attends over ``context`` + step keys, as at the end of a
    long conversation, without the cost of a long prefill. The tokens are then not the model's continuation of any
    real text (the repeated keys carry their first positions' rotary phases); what is measured is the step time.

    ``meter`` (``harness.energy``): each run's energy over its timed steps (``energy_windows``).

    The FP8 cache is an ``Fp8StaticCache(device_position=True)``: each decode step runs on the device alone and is
    captured, reading the bytes with llm_attn's attention (a patched model) and, with stock attention, a copy of
    the whole capacity under transformers' causal mask (eager steps, the warm-up's included, read a copy of the used
    tokens). With ``context`` the FP8 fill re-quantises the repeated tokens (``Fp8StaticLayer.extend_by_repeating``)."""
    _check_kv_cache(kv_cache)
    fp8 = kv_cache == "fp8"
    if new_tokens < 2:
        raise ValueError(f"decode needs new_tokens >= 2 (the first token is TTFT), got {new_tokens}")
    device = input_ids.device
    cuda = device.type == "cuda"
    if use_graph and not cuda:
        raise ValueError("CUDA-graph decode needs a CUDA device")
    batch, seq = input_ids.shape
    if context is not None and context < seq:
        raise ValueError(f"context ({context}) must be at least the prompt length ({seq})")
    kv_len = seq if context is None else context
    n_steps = new_tokens - 1
    max_len = kv_len + max(new_tokens, GRAPH_WARMUP_STEPS + 1)
    cache = (Fp8StaticCache(config=model.config, max_cache_len=max_len, device_position=True) if fp8
             else StaticCache(config=model.config, max_cache_len=max_len))
    with torch.inference_mode():
        _reset_peak(device)
        first, _ = prefill_first_token(model, input_ids, cache=cache, chunk=prefill_chunk)
        first = first.view(batch, 1).clone()
        cur = first.clone()
        for layer in cache.layers:
            if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                raise RuntimeError(f"cache layer {type(layer).__name__} keeps no position tensor; the static decode "
                                   f"loop supports full-attention StaticCache layers only")
        if kv_len > seq:
            _extend_static_cache(cache, seq, kv_len)
        saved = [layer.cumulative_length.clone() for layer in cache.layers]
        # The FP8 layer also keeps its length on the host and the open block's float32 originals, from which the
        # next write re-quantises that block: rewinding restores them too.
        saved_fp8 = [layer.position_state() for layer in cache.layers] if fp8 else None

        def step():
            out = model(input_ids=cur, **cache_kwarg(model, cache), use_cache=True)
            cur.copy_(out.logits[:, -1, :].argmax(dim=-1, keepdim=True))

        def rewind():
            for layer, pos in zip(cache.layers, saved):
                layer.cumulative_length.copy_(pos)
            for layer, state in zip(cache.layers, saved_fp8 or ()):
                layer.restore_position(state)
            cur.copy_(first)

        graph = None
        if use_graph:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP_STEPS):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with graph_capture(graph):
                    step()
            except RuntimeError as e:
                if "during CUDA graph capture" not in str(e):
                    raise
                raise GraphCaptureUnsupported(f"this attention path cannot be captured in a CUDA graph: {e}") from e
            run_step = graph.replay
        else:
            for _ in range(GRAPH_WARMUP_STEPS):
                step()
            run_step = step

        steps, totals, tokens, windows = [], [], None, []
        history = torch.empty((batch, new_tokens), dtype=torch.long, device=device)
        for _ in range(runs):
            rewind()
            history[:, 0] = first[:, 0]
            _sync(device)
            win = meter.begin() if meter is not None else None
            if cuda:
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n_steps)]
                for i, (s, e) in enumerate(ev):
                    s.record()
                    run_step()
                    e.record()
                    history[:, i + 1] = cur[:, 0]
                torch.cuda.synchronize(device)
                steps.append([s.elapsed_time(e) for s, e in ev])
                totals.append(ev[0][0].elapsed_time(ev[-1][1]))
            else:
                stamps = [time.perf_counter()]
                for i in range(n_steps):
                    run_step()
                    history[:, i + 1] = cur[:, 0]
                    stamps.append(time.perf_counter())
                steps.append([(b - a) * 1e3 for a, b in zip(stamps[:-1], stamps[1:])])
                totals.append((stamps[-1] - stamps[0]) * 1e3)
            if meter is not None:
                windows.append(meter.end(win, tokens=n_steps * batch))
            if tokens is None:
                tokens = history.tolist()
            if on_run:
                on_run()
        peak = _peak(device)
        del graph
    return {
        **_decode_fields(steps, totals, new_tokens),
        "timer": "cuda_event" if cuda else "perf_counter",
        "mode": "cuda_graph" if use_graph else "static_cache_loop_no_graph",
        "runs": runs,
        "kv_len": kv_len,  # the cache length the first decode step attends over
        "context_filled": kv_len > seq,
        "tokens": tokens,
        "peak_mem_bytes": peak,
        **({"energy_windows": windows} if meter is not None else {}),
    }


def greedy_tokens(model, input_ids: torch.Tensor, new_tokens: int, kv_cache: str = "fp16") -> torch.Tensor:
    """``new_tokens`` greedy tokens after the prompt, on transformers' own cache or (``kv_cache="fp8"``) a fresh FP8
    KV cache."""
    cache = {"past_key_values": new_cache(model, kv_cache)} if kv_cache != "fp16" else {}
    out = model.generate(input_ids, **_generate_kwargs(model, input_ids, new_tokens), **cache)
    return out[:, input_ids.shape[1]:]


def measure_correctness(model, input_ids: torch.Tensor, new_tokens: int, reference_impl: str, impl: str,
                        switch: Callable, kv_cache: str = "fp16") -> dict:
    """Ours against a stock implementation on the same prompt: max |logit difference| at the last prompt position
    (float32) and the fraction of identical greedy tokens over ``new_tokens``; then the first 64 tokens' greedy
    agreement and the KL of the next-token distributions, teacher-forced on stock's continuation
    (``harness.agreement``). ``switch(model, name)`` is the context manager that puts the model on an
    implementation (``impls.use_impl``). ``kv_cache="fp8"``: the implementation runs on the FP8 KV cache (prefill,
    decode and the teacher-forced forward all read K/V through it) and the reference on transformers' own cache, so
    ``impl == reference_impl`` measures the cache alone (issue 38: against the fp16 cache)."""
    _check_kv_cache(kv_cache)
    got, report, calls = {}, None, None
    n64 = continuation_tokens(model, input_ids.shape[1])
    prompt_kl = min(KL_PROMPT_POSITIONS, input_ids.shape[1])
    cont, logprobs = {}, {}
    with torch.inference_mode():
        # The reference first: its continuation is what both are fed for KL.
        for role, name, cache in (("ref", reference_impl, "fp16"), ("impl", impl, kv_cache)):
            with switch(model, name) as rep:
                _, logits = prefill_first_token(model, input_ids, kv_cache=cache)
                tokens = greedy_tokens(model, input_ids, max(new_tokens, n64), kv_cache=cache).cpu()
                got[role] = (logits.float().cpu(), tokens[:, :new_tokens])
                cont[role] = tokens[:, :n64]
                forced = torch.cat([input_ids, cont["ref"].to(input_ids.device)], dim=1)
                fresh = cache_kwarg(model, new_cache(model, cache)) if cache != "fp16" else None
                logprobs[role] = next_token_logprobs(model, forced, prompt_kl + n64, fresh)
                if role == "impl" and rep is not None:
                    report = jsonable(rep)
                    calls = {"impl": rep.num_native_calls, "stock_fallback": rep.num_fallback_calls,
                             "fallback_reasons": dict(rep.fallback_calls),
                             **({"kv_cache_reads": dict(rep.kv_cache_reads)} if rep.kv_cache_reads else {})}
    (ref_logits, ref_tok), (our_logits, our_tok) = got["ref"], got["impl"]
    same = ref_tok == our_tok
    mismatch_cols = (~same).any(dim=0).nonzero()
    return {
        "reference_impl": reference_impl,
        "max_abs_logit_diff": float((ref_logits - our_logits).abs().max()),
        "reference_logit_absmax": float(ref_logits.abs().max()),
        "greedy_agreement": float(same.float().mean()),
        "first_divergence": int(mismatch_cols[0, 0]) if mismatch_cols.numel() else None,
        "tokens_reference": ref_tok.tolist(),
        "tokens_impl": our_tok.tolist(),
        **({"reference_kv_cache": "fp16"} if kv_cache != "fp16" else {}),
        **agreement_fields(cont["ref"], cont["impl"], logprobs["ref"], logprobs["impl"], prompt_kl),
        # The patch counters (cumulative since patching): proof that the implementation really ran, and on which
        # variant, and how many of its calls took the stock path.
        "patch": report,
        "attention_calls": calls,
    }


# -- TTFT replayed from a CUDA graph ------------------------------------------------------------------------------------
GRAPH_CACHES = ("dynamic", "static")
# Kernel names of attention implementations (ours: flash_fwd/flash_decode/flash_combine; PyTorch's SDPA backends:
# pytorch_flash::flash_fwd*, fmha_cutlass* (memory-efficient), cuDNN's *sdpa*/*fmha*; flash-attn 2: flash_fwd*).
# A graph replay runs no Python, so no profiler range can attribute kernels: names are all there is.
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa|mha_|_mha|softmax", re.IGNORECASE)


def _device_activity(events):
    """The device-side events of a profile (kernels, copies, memsets), without the profiler's annotations."""
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            continue
        # record_function ranges (the registry's, e.g. 'llm_attn.attention:llm_attn') also appear on the GPU timeline as
        # annotations spanning their kernels: counted, they doubled our eager attention time on the H100. torch 2.13
        # says so in activity_type; 2.11 has no such attribute but flags is_user_annotation.
        if "annotation" in str(getattr(e, "activity_type", "") or "") or getattr(e, "is_user_annotation", False):
            continue
        yield e


def device_kernels_of(events, match: Callable[[str], bool] = lambda name: True) -> list[dict]:
    """The device events of a profile (``prof.events()``) whose name ``match``es: name, launches and total ms, by
    total time."""
    agg: dict[str, list] = {}
    for e in _device_activity(events):
        if not match(e.name):
            continue
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += (e.time_range.end - e.time_range.start) / 1e3
    return [{"name": n, "launches": c, "ms": ms} for n, (c, ms) in sorted(agg.items(), key=lambda x: -x[1][1])]


def attention_kernels_of(events) -> list[dict]:
    """The attention kernels in a profile (``prof.events()``): name, launches and total ms, by total time."""
    return device_kernels_of(events, lambda name: bool(ATTENTION_KERNEL.search(name)))


def device_busy_ms(events) -> float:
    """Summed duration of every device-side event (one stream: the time the GPU was busy)."""
    return sum((e.time_range.end - e.time_range.start) / 1e3 for e in _device_activity(events))


OTHER_KERNELS_KEPT = 60  # an 8B Llama prefill runs ~20 distinct kernel names; the rest of a long tail is dropped


def profile_device(run: Callable[[], None], device: torch.device) -> dict:
    """Run ``run`` once under torch.profiler (CUDA activity): ``attention_kernels`` (``attention_kernels_of``),
    ``attention_ms`` (their sum) and ``busy_ms`` (every device event: kernels, copies, memsets)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    events = prof.events()
    kernels = attention_kernels_of(events)
    rest = device_kernels_of(events, lambda name: not ATTENTION_KERNEL.search(name))
    return {"attention_kernels": kernels, "attention_ms": sum(k["ms"] for k in kernels),
            "busy_ms": device_busy_ms(events),
            # Everything else by name (names cut to 160 characters), for graph_vs_eager_account's itemised rest.
            "other_kernels": [{**k, "name": k["name"][:160]} for k in rest[:OTHER_KERNELS_KEPT]]}


def profile_kernels(run: Callable[[], None], device: torch.device) -> list[dict]:
    """Run ``run`` once under torch.profiler (CUDA activity) and return the attention kernels that ran
    (``attention_kernels_of``)."""
    return profile_device(run, device)["attention_kernels"]


def graph_vs_eager_account(graph_row: dict, eager_row: dict) -> dict | None:
    """Where graph TTFT differs from eager TTFT (same implementation and point), split the difference into its
    causes from the profiles the graph row carries (one profiled replay, one profiled eager prefill):

        graph - eager = attention kernels' change + other device work's change - host time removed

    ``host_removed_ms`` = the GPU's idle time in eager TTFT (eager p50 minus its busy time) minus the idle time left
    in the replay; ``other_ms`` = the change of everything but attention. The account is an identity; what it
    tells is *where* the difference sits: ``unexplained_pct`` is ``other_ms`` as a share of eager TTFT (the issue's
    bound: 2 %), the part neither the host nor attention accounts for. None without both profiles."""
    g, e = graph_row.get("profile"), graph_row.get("eager_profile")
    if not g or not e or eager_row.get("status") != "ok" or graph_row.get("status") != "ok":
        return None
    eager_ms, graph_ms = eager_row["stats"]["p50"], graph_row["stats"]["p50"]
    attention = g["attention_ms"] - e["attention_ms"]
    other = (g["busy_ms"] - g["attention_ms"]) - (e["busy_ms"] - e["attention_ms"])
    host = (eager_ms - e["busy_ms"]) - (graph_ms - g["busy_ms"])
    return {"delta_ms": graph_ms - eager_ms, "attention_ms": attention, "other_ms": other, "host_removed_ms": host,
            "unexplained_pct": 100.0 * abs(other) / eager_ms,
            "other_changes": _kernel_changes(e.get("other_kernels") or [], g.get("other_kernels") or [])}


def _kernel_changes(before: list[dict], after: list[dict], keep: int = 3, min_ms: float = 0.05) -> list[dict]:
    """The non-attention kernels whose total time changed most between two profiles (by name): where the 'rest' of
    graph_vs_eager_account sits, e.g. the mask a capture makes transformers build for SDPA."""
    b = {k["name"]: k for k in before}
    a = {k["name"]: k for k in after}
    out = []
    for name in set(a) | set(b):
        ka, kb = a.get(name, {}), b.get(name, {})
        d = ka.get("ms", 0.0) - kb.get("ms", 0.0)
        if abs(d) >= min_ms:
            out.append({"name": name, "delta_ms": d,
                        "launches": (kb.get("launches", 0), ka.get("launches", 0))})
    return sorted(out, key=lambda x: -abs(x["delta_ms"]))[:keep]


def measure_ttft_graph(model, input_ids: torch.Tensor, warmup: int, repeats: int, cache: str = "dynamic",
                       profile: bool = True, on_repeat: Callable[[], None] | None = None,
                       prefill_chunk: int | None = None, kv_cache: str = "fp16") -> dict:
    """Kernel-limited TTFT: the whole prefill (exact prompt, ``logits_to_keep=1``, greedy argmax of the first token)
    captured in one CUDA graph and replayed; each sample is one replay timed with CUDA events. Host noise cannot
    reach it: it is what an engine with graph capture (or ``torch.compile(mode="reduce-overhead")``) sees.

    ``cache="dynamic"``: a fresh DynamicCache is created inside the capture, as eager TTFT does (the replay rewrites
    the graph's own copy of it). ``cache="static"``: a StaticCache of exactly the prompt's length, reset before
    every replay (outside the timed region): what ``cache_implementation="static"`` and compiled generation use.

    Raises GraphCaptureUnsupported (a row with status 'unsupported' and the reason) off CUDA and for any capture
    failure. With ``profile`` one more replay runs under torch.profiler and ``attention_kernels`` names the
    attention kernels it ran. ``kv_cache="fp8"``: GraphCaptureUnsupported (the FP8 cache is not capturable yet)."""
    if cache not in GRAPH_CACHES:
        raise ValueError(f"cache must be one of {GRAPH_CACHES}, got {cache!r}")
    device = input_ids.device
    if device.type != "cuda":
        raise GraphCaptureUnsupported(f"CUDA graphs need a CUDA device; this run is on {device.type}")
    _check_kv_cache(kv_cache)
    if kv_cache == "fp8":
        raise _fp8_not_capturable("the prefill")
    batch, seq = input_ids.shape
    static = StaticCache(config=model.config, max_cache_len=seq) if cache == "static" else None

    def prefill():
        if static is not None:
            tok, _ = prefill_first_token(model, input_ids, cache=static, chunk=prefill_chunk)
        else:
            tok, _ = prefill_first_token(model, input_ids, chunk=prefill_chunk)
        return tok

    def reset():
        if static is not None:
            static.reset()

    with torch.inference_mode():
        # Warm-up on a side stream, as capture requires (a failure here is the model's, not the capture's: raised).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                reset()
                prefill()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        reset()
        graph = torch.cuda.CUDAGraph()
        try:
            with graph_capture(graph):
                token = prefill()
        except _OOM_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 (any capture failure is a property of this path: recorded, not fatal)
            del graph
            try:
                torch.cuda.synchronize(device)
            except RuntimeError:
                pass  # the capture's own error is the one to report
            raise GraphCaptureUnsupported(f"the prefill with a {cache} cache cannot be captured in a CUDA graph: "
                                          f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
        _reset_peak(device)
        samples = []
        for _ in range(repeats):
            reset()
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
            if on_repeat:
                on_repeat()
        first_tokens = token.tolist()
        kernels = prof = eager_prof = None
        if profile:
            reset()
            torch.cuda.synchronize(device)
            prof = profile_device(graph.replay, device)
            kernels = prof["attention_kernels"]
        peak = _peak(device)
        del graph
        if profile:
            # The same prefill, eager (a fresh dynamic cache, as the eager TTFT measurement runs it): which attention
            # kernels that path runs and how long the GPU is busy, for graph_vs_eager_account.
            prefill_first_token(model, input_ids, chunk=prefill_chunk)
            torch.cuda.synchronize(device)
            eager_prof = profile_device(lambda: prefill_first_token(model, input_ids, chunk=prefill_chunk), device)
    return {
        "timer": "cuda_event",
        "mode": f"cuda_graph_{cache}_cache",
        "cache": cache,
        "samples_ms": samples,
        "stats": summarize(samples),
        "warmup": warmup,
        "repeats": repeats,
        "first_tokens": first_tokens,
        "attention_kernels": kernels,
        "profile": prof,
        "eager_profile": eager_prof,
        "peak_mem_bytes": peak,
    }
