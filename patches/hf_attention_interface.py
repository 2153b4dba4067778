"""Patch target: transformers' attention-function registry (``AttentionInterface`` + ``AttentionMaskInterface``).

This is how transformers (>= 4.48, and all of 5.x) expects a custom attention to be plugged in: we register an
attention function and a mask function under the name ``"llm_attn"`` and switch the model to it with
``model.set_attn_implementation("llm_attn")``. That one name serves every implementation of ``llm_attn.registry``:
each patched module carries a runtime naming the implementation it calls. Nothing in the model is replaced;
``unpatch`` puts the previous implementation name back on every config we touched and removes the small per-module
runtime pointer.

How each call is served (stock sdpa semantics, reproduced exactly):

* Mask ``None`` (no padding, and the mask could be skipped): stock sdpa then uses ``is_causal = q_len > 1``; with a
  key cache longer than the query (only a prefill into an empty ``StaticCache``) stock crops the keys to ``q_len``,
  i.e. top-left causal. We do the same with the kernel: causal prefill, non-causal decode over every cached key.
* A mask that our mask function proved to be "causal over the first ``seqused`` keys" (a chunk over a cache, decode
  over a ``StaticCache`` with unused slots, no padding): the kernel with ``seqused_k`` (int32 per batch, computed on
  the device from the cache position, no host sync) and bottom-right causal alignment.
* A 4D mask the caller built that is exactly such a causal prefix (``caller_mask_prefix``: checked once per tensor
  on the device, the verdict kept while the tensor is not written): the same, with ``seqused_k`` read off the mask.
* Any other mask (left padding, packed sequences, other custom 4D masks): stock ``sdpa_attention_forward`` with the
  very mask stock would have built, counted in the report as a fallback.
* K/V from the FP8 KV cache (``llm_attn.models.kv_cache``; ``kv_cache_reference.fp8_kv_of``): a call with no mask or
  a tagged causal prefix on llm_attn's own entry reads the FP8 bytes directly (``llm_attn.ops.decode_fp8_kv``: the
  decode kernel up to 32 rows ((query heads per KV head) x q_len), the prefill kernel above, a prompt or a chunk of
  a chunked prefill; their blockwise reference on CPU); every other call (padding, another implementation, the stock
  path, a prefill on a build without the prefill kernel) reads the dequantised copy, made here when the cache
  returned placeholders. The report counts each way (``PatchReport.kv_cache_reads``).

Our mask function delegates to transformers' ``sdpa_mask`` (so the mask is bit-for-bit what stock sdpa gets) and only
adds the analysis; when it cannot be sure it adds nothing and the call falls back. While ``torch.compile`` traces it
tags only what is causal by construction (no 2D ``attention_mask``): checking a padding mask needs its values, which
would break the graph. Everything on the call path traces without a graph break (``tests/test_compile.py``).
"""

from __future__ import annotations

import torch

from llm_attn.kv_cache_reference import fp8_kv_of

from ._common import (
    SUPPORTED_MODEL_TYPES,
    AttentionRuntime,
    PatchOptions,
    PatchReport,
    UnsupportedModelError,
    _is_compiling,
    model_head_dim,
    module_device_dtype,
    start_patch,
)

NAME = "llm_attn"
TARGET_NAME = "transformers.AttentionInterface"
RUNTIME_ATTR = "_llm_attn_runtime"   # set on each patched attention module, removed by unpatch
SEQUSED_ATTR = "_llm_attn_seqused_k"  # set by our mask function on masks it proved to be causal-prefix masks
NOT_PREFIX_ATTR = "_llm_attn_not_a_prefix"  # set by our mask function on masks it proved not to be one

# Calls with one of these kwargs set change the attention maths in ways llm_attn does not implement.
_UNSUPPORTED_KWARGS = {
    "sliding_window": "sliding-window attention",
    "softcap": "attention logit softcapping",
    "s_aux": "attention sinks",
    "position_bias": "an additive position bias",
}


def _interfaces():
    """The two registries, or None on transformers without them (< 4.48 for attention, < 4.53 for masks)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return None
    return AttentionInterface, AttentionMaskInterface


def _stock_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


# -- the mask function ----------------------------------------------------------------------------------------------

def llm_attn_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                  local_size=None, allow_is_causal_skip=True, device="cpu", **kwargs):
    """Registered in ``AttentionMaskInterface`` as "llm_attn": builds exactly the mask stock sdpa would get, and tags
    it with ``seqused_k`` when it is "query i (at position q_offset + i) sees keys 0 .. q_offset + i" for every batch
    row, i.e. what the kernel computes natively with ``seqused_k = q_offset + q_length`` and bottom-right causality.
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, device=device, **kwargs)
    if mask is None or not isinstance(mask, torch.Tensor):
        return mask
    # Only the plain causal pattern over an un-offset key range can be a prefix; anything composed with other mask
    # functions (packing, block overlays, windows) stays a dense mask and goes to the stock path.
    if mask_function is not causal_mask_function or kv_offset != 0 or local_size is not None:
        return _not_a_prefix(mask)
    if torch.jit.is_tracing():
        return mask  # a Python attribute does not survive into a TorchScript trace
    total = q_offset + q_length  # keys 0 .. total-1 are the cache content after this step (int, or device tensor)
    if isinstance(total, int) and total > kv_length:
        return _not_a_prefix(mask)
    if attention_mask is not None:
        if _is_compiling():
            # The padding check is data-dependent: under dynamo it would break the graph (or fail fullgraph=True).
            # Without a 2D mask (the case above) the mask is causal by construction and is tagged in the trace.
            return mask
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, :kv_length].to(torch.bool)
        key_idx = torch.arange(kv_length, device=padding.device)
        # Keys at or past `total` are hidden by causality anyway; every key before it must be a real token.
        no_padding = (padding | (key_idx >= total)).all()
        if not bool(no_padding):  # one host sync per forward pass (stock sdpa_mask syncs here too)
            return _not_a_prefix(mask)
    if isinstance(total, torch.Tensor):
        seqused = total.to(device=mask.device, dtype=torch.int32).reshape(1).expand(batch_size).contiguous()
    else:
        # torch.full fills on the device; as_tensor(int, device=cuda) would be a pageable host->device copy, which
        # synchronises the stream and stalls the CPU's run-ahead on every forward pass.
        seqused = torch.full((batch_size,), total, dtype=torch.int32, device=mask.device)
    # Tag a contiguous tensor: sdpa_mask returns the batch rows expanded (stride 0), and transformers >= 5.2x's
    # generate() calls ``.contiguous()`` on the mask it prepares for a static cache, which would copy it into a new,
    # untagged tensor and send every decode step to the stock path. On a contiguous mask that call returns the
    # mask itself. (A decode mask is B x 1 x 1 x kv bools; where the tag is set the kernel never reads it.)
    mask = mask.contiguous()
    setattr(mask, SEQUSED_ATTR, seqused)
    return mask


def _not_a_prefix(mask: torch.Tensor) -> torch.Tensor:
    """A mask our mask function analysed and rejected: the attention function need not look at it again (contiguous
    for the reason the tagged ones are: generate()'s ``.contiguous()`` must not drop the mark)."""
    mask = mask.contiguous()
    setattr(mask, NOT_PREFIX_ATTR, True)
    return mask


# -- 4D masks the caller built ----------------------------------------------------------------------------------------
# A caller that builds its own 4D mask (a static-cache decode loop, code written for torch.export) passes it to every
# layer as is: it carries no tag. Such a mask is checked once, on the device, with one host sync, and the verdict is
# kept per tensor object while its version counter is unchanged (any in-place write bumps it), so the other layers of
# the forward pass, and later passes that reuse the tensor, decide without a sync. What cannot be checked that way
# takes the stock path: inference tensors (no version counter: an in-place write would go unseen), tensor
# subclasses, masks that need grad, per-head masks, and any mask while dynamo traces (the check is data-dependent).
_MASK_VERDICTS = torch.utils.weak.WeakIdKeyDictionary()  # mask -> (its _version when checked, verdict)
_NOT_PREFIX = (False, None)


def caller_mask_prefix(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """Whether a 4D mask the caller built is exactly "query ``i`` sees keys ``0 .. i + used[b] - q_len``" for every
    batch row ``b`` with ``q_len <= used[b] <= kv_len`` (bottom-right causal over the first ``used[b]`` keys: what
    the kernel computes with ``seqused_k = used``): (True, None) when ``used`` is ``kv_len`` for every row (plain
    causal), (True, seqused_k int32 (batch,) on the mask's device), or (False, None).

    Boolean masks (True = visible) and additive float masks (0 = visible; hidden entries must be ``-inf`` or the
    dtype's lowest value, transformers' convention; any other value, e.g. a bias or -1e4, is not accepted). Every
    row must see at least one key (a fully hidden row means something else to stock sdpa than to the kernel). Eager
    only: the caller checks that neither dynamo nor torch.jit is tracing (the verdict would be baked into the
    trace)."""
    if (type(mask) is not torch.Tensor or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch)
            or mask.shape[2] != q_len or mask.shape[3] != kv_len or q_len > kv_len or mask.requires_grad
            or mask.is_inference() or not (mask.dtype == torch.bool or mask.is_floating_point())):
        return _NOT_PREFIX
    version = mask._version
    known = _MASK_VERDICTS.get(mask)
    if known is not None and known[0] == version:
        return known[1]
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return _NOT_PREFIX  # the check's host sync is not allowed while a CUDA graph is captured
    verdict = _check_causal_prefix(mask, batch, q_len, kv_len)
    _MASK_VERDICTS[mask] = (version, verdict)
    return verdict


def _check_causal_prefix(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """``caller_mask_prefix``'s check: a few elementwise passes over the mask and one host sync."""
    m = mask[:, 0]  # (B', Sq, Sk)
    visible = m if m.dtype == torch.bool else m == 0
    used = visible[:, -1].sum(-1)  # (B',): the keys the last query sees; a causal prefix is then fixed
    key = torch.arange(kv_len, device=m.device).view(1, 1, -1)
    last_key = torch.arange(q_len, device=m.device).view(1, -1, 1) + (used - q_len).view(-1, 1, 1)
    ok = (visible == (key <= last_key)).all() & (used >= q_len).all()
    if m.dtype != torch.bool:
        ok &= (visible | (m <= torch.finfo(m.dtype).min)).all()  # hidden = -inf or the lowest value; NaN fails
    ok, full = torch.stack((ok, (used == kv_len).all())).tolist()  # the one host sync
    if not ok:
        return _NOT_PREFIX
    if full:
        return True, None
    return True, used.to(torch.int32).expand(batch).contiguous()


# -- the attention function -----------------------------------------------------------------------------------------

_DEFAULT_RUNTIME = None


def _default_runtime() -> AttentionRuntime:
    """For models switched to "llm_attn" by hand (``attn_implementation="llm_attn"``) rather than by patch_model."""
    global _DEFAULT_RUNTIME
    if _DEFAULT_RUNTIME is None:
        opts = PatchOptions(on_unsupported="fallback")
        _DEFAULT_RUNTIME = AttentionRuntime(opts, PatchReport(target=TARGET_NAME, impl=opts.impl,
                                                              backend=opts.backend, on_unsupported="fallback"))
    return _DEFAULT_RUNTIME


def default_report() -> PatchReport:
    """Counters of calls made by models that use "llm_attn" without having been patched by patch_model."""
    return _default_runtime().report


def _stock_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    return _stock_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)


def llm_attn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):
    """Registered in ``AttentionInterface`` as "llm_attn" — one entry for every registry implementation: the module's
    runtime (set by patch_model) says which implementation serves it. Same contract as transformers'
    sdpa_attention_forward: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) un-repeated, returns ((B, Sq, Hq, D),
    None)."""
    runtime = getattr(module, RUNTIME_ATTR, None) or _default_runtime()
    # The FP8 KV cache: read directly where the call is a decode on llm_attn, else via the copy. Not while dynamo
    # traces (an attribute lookup on a traced tensor breaks the graph; the cache returns real copies then).
    fp8 = None if _is_compiling() else fp8_kv_of(key)
    if fp8 is not None:
        out = _fp8_kv_direct(runtime, module, query, key, fp8, attention_mask, dropout, is_causal, scaling, kwargs)
        if out is not None:
            return out, None
        key, value = runtime.fp8_kv_copy(key, value, fp8)

    # 1. Settings llm_attn does not implement: error or counted fallback, per on_unsupported.
    problem = runtime.forced[0] if runtime.forced else None
    if problem is None and kwargs:
        # Four dict lookups (no dict-view set operation: dynamo cannot trace ``dict_keys.isdisjoint``).
        for name, what in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                problem = f"{what} ({name}={kwargs[name]!r}) is not implemented by {runtime.impl.name}"
                break
    if problem is None and dropout and dropout > 0 and module.training:
        problem = f"attention dropout in training mode (p={dropout}) is not implemented by {runtime.impl.name}"
    if problem is None and query.shape[-1] != value.shape[-1]:
        problem = f"query head_dim {query.shape[-1]} != value head_dim {value.shape[-1]}"
    variant = None
    if problem is None:
        variant, problem = runtime.choose_variant(query)
    if problem is not None:
        runtime.setting_unsupported(problem)
        return _stock_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

    # 2. The mask: what stock sdpa would compute, expressed natively where that is exact.
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
        if causal and kv_len < q_len:
            # Stock sdpa would apply a top-left causal mask here; the kernel aligns bottom-right. Rare; stay exact.
            runtime.count_fallback("no mask, causal, more queries than keys")
            return _stock_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        if causal and kv_len > q_len:
            # Prefill into an empty static cache: stock crops keys to q_len (top-left causal), so do we.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = runtime.run(variant, query, key, value, causal=causal, scale=scaling)
        runtime.count_native(variant)
        return out, None

    seqused = getattr(attention_mask, SEQUSED_ATTR, None) if isinstance(attention_mask, torch.Tensor) else None
    prefix = (seqused is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] == kv_len
              and attention_mask.shape[-2] == q_len and seqused.shape == (query.shape[0],)
              and seqused.device == query.device)
    if (not prefix and isinstance(attention_mask, torch.Tensor) and attention_mask.device == query.device
            and not _is_compiling() and not torch.jit.is_tracing()
            and not getattr(attention_mask, NOT_PREFIX_ATTR, False)):
        # A mask our mask function did not tag: built by the caller (or rebuilt from ours, e.g. by .contiguous()).
        prefix, seqused = caller_mask_prefix(attention_mask, query.shape[0], q_len, kv_len)
    if prefix:
        if seqused is not None:
            why = runtime.seqused_problem(variant)
            if why is not None:
                runtime.count_fallback(why)
                return _stock_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        out = runtime.run(variant, query, key, value, causal=True, scale=scaling, seqused_k=seqused)
        runtime.count_native(variant)
        return out, None

    runtime.count_fallback("attention mask is not a causal prefix (padding or custom mask): stock sdpa")
    return _stock_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)


def _fp8_kv_direct(runtime, module, query, key, fp8, attention_mask, dropout, is_causal, scaling, kwargs):
    """The call's output, (B, Sq, Hq, D), read from the FP8 cache's bytes (``runtime.fp8_kv_reader``), or None when
    the call is not one the direct path computes exactly (then the caller reads the dequantised copy): a setting
    llm_attn does not implement, another implementation, a mask that is not a tagged causal prefix, no-mask causal
    queries over a longer cache (stock's top-left crop), or a call the reader does not take (more rows than the
    decode kernel holds on a build without the prefill kernel)."""
    if runtime.forced or _is_compiling() or (dropout and dropout > 0 and module.training):
        return None
    if kwargs:
        for name in _UNSUPPORTED_KWARGS:  # a loop, not any(generator): this runs on every decode call
            if kwargs.get(name) is not None:
                return None
    q_len, kv_len = query.shape[2], key.shape[2]
    if query.shape[-1] != key.shape[-1] or kv_len != fp8.length:
        return None
    variant, problem = runtime.choose_variant(query)
    reader = runtime.fp8_kv_reader(variant) if problem is None else None
    if reader is None:
        return None
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
        if causal and kv_len != q_len:
            return None
        seqused = None
    else:
        seqused = getattr(attention_mask, SEQUSED_ATTR, None) if isinstance(attention_mask, torch.Tensor) else None
        if not (seqused is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] == kv_len
                and attention_mask.shape[-2] == q_len and seqused.shape == (query.shape[0],)
                and seqused.device == query.device):
            return None
        causal = True
    read = reader(query, fp8, causal, scaling, seqused)
    if read is None:
        return None
    out, how = read
    report = runtime.report  # counted directly: not compiling (checked above), and K is the cache's (fp8)
    report.native_calls[variant] += 1
    report.kv_cache_reads[how] += 1
    return out.transpose(1, 2).contiguous()


def register() -> None:
    """Register "llm_attn" in both transformers registries (idempotent). Refuses to overwrite someone else's."""
    ifaces = _interfaces()
    if ifaces is None:
        raise UnsupportedModelError("this transformers has no AttentionInterface/AttentionMaskInterface")
    attn_iface, mask_iface = ifaces
    for iface, fn in ((attn_iface, llm_attn_attention_forward), (mask_iface, llm_attn_mask)):
        current = iface._global_mapping.get(NAME)
        if current is not None and current is not fn:
            raise RuntimeError(f"{iface.__name__} already has a different function registered as {NAME!r}: "
                               f"{current!r}")
        iface.register(NAME, fn)


# -- the target -----------------------------------------------------------------------------------------------------

def _attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules that call ``ALL_ATTENTION_FUNCTIONS.get_interface`` for a supported model type."""
    out = []
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if (type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")
                and getattr(cfg, "model_type", None) in SUPPORTED_MODEL_TYPES):
            out.append((name, m))
    return out


def can_patch(model) -> tuple[bool, str]:
    ifaces = _interfaces()
    if ifaces is None:
        import transformers

        return False, (f"transformers {transformers.__version__} has no AttentionInterface/AttentionMaskInterface "
                       "(needs >= 4.53)")
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False, f"{type(model).__name__} is not a transformers PreTrainedModel"
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {model_type!r} is not one of the verified types {SUPPORTED_MODEL_TYPES}"
    if not type(model)._can_set_attn_implementation():
        return False, f"{type(model).__name__} does not dispatch attention through AttentionInterface"
    if not _attention_modules(model):
        return False, f"no attention modules of a supported type found in {type(model).__name__}"
    return True, "ok"


def patch(model, options: PatchOptions) -> tuple[PatchReport, dict]:
    modules = _attention_modules(model)
    report, forced = start_patch(model, options, TARGET_NAME, modules)
    register()

    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = (cfg, cfg._attn_implementation_internal)
    runtime = AttentionRuntime(options, report, forced)
    runtime.prepare(*module_device_dtype(modules[0][1]), model_head_dim(model.config))
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        _restore_configs(configs)
        raise UnsupportedModelError(f"{type(model).__name__} refused attn_implementation={NAME!r} "
                                    f"(it stays {model.config._attn_implementation!r})")
    for name, m in modules:
        if getattr(m.config, "_attn_implementation", None) != NAME:
            continue  # a sub-model that kept its own implementation
        m.__dict__[RUNTIME_ATTR] = runtime
        report.patched_modules.append(name)
    return report, {"configs": configs, "modules": [m for _, m in modules]}


def _restore_configs(configs: dict) -> None:
    for cfg, prev in configs.values():
        cfg._attn_implementation_internal = prev


def unpatch(model, undo: dict) -> None:
    configs = undo["configs"]
    prev = model.config._attn_implementation_internal
    for cfg, old in configs.values():
        if cfg is model.config:
            prev = old
    # The official setter first (it also walks sub-models), then force every config to its exact previous value.
    if prev is not None and model.config._attn_implementation != prev:
        model.set_attn_implementation(prev)
    _restore_configs(configs)
    for m in undo["modules"]:
        m.__dict__.pop(RUNTIME_ATTR, None)


def on_load(undo: dict) -> None:
    """A patched model was unpickled (or deep-copied): its configs name "llm_attn", which this process may not have
    registered yet (torch.load in a new process)."""
    register()
