"""``flex``: PyTorch's ``flex_attention`` compiled with ``torch.compile`` — the peer a PyTorch user tries first.

Causality (bottom-right) is a block mask, built once per (q_len, kv_len, device) and cached; GQA through
``enable_gqa``. Prefill calls get one statically compiled function per shape (torch 2.11's flex template failed to
lower with dynamic shapes on the H100: ``NoValidChoicesError``), each with its own code object so that dynamo's
recompile limit never silently drops a shape back to uncompiled flex; decode calls (q_len 1, no mask, a new kv_len
every token) share one function compiled with automatic dynamic shapes; only they use inductor's flex-decoding
template (see ``_call``). On CPU the uncompiled flex_attention runs
(correctness only; it says nothing about speed).
``seqused_k`` would need a data-dependent block mask per call: such calls take the stock path.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from llm_attn.registry import register_attention


def _missing() -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
    except ImportError as e:
        return f"flex needs torch.nn.attention.flex_attention (torch >= 2.5): {e}"
    return None


def _call(q, k, v, block_mask, scale, enable_gqa, short_query_kernel):
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    # Inductor lowers queries shorter than 128 rows to its flex-decoding template, which finds no valid config for
    # prefill-sized GQA queries (torch 2.11 on the H100, q_len 63 over 1000 keys: NoValidChoicesError). Only decode
    # (q_len 1) keeps that template; every other query runs the main flex_attention template.
    options = None if short_query_kernel else {"FORCE_USE_FLEX_ATTENTION": True}
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=options)


@functools.lru_cache(maxsize=256)
def _compiled(key):
    """A compiled flex call for one shape key (None: the shared dynamic one), with a code object of its own."""
    code = _call.__code__.replace(co_name=f"_flex_{len(_compiled_names)}")
    _compiled_names.append(key)
    fn = types.FunctionType(code, _call.__globals__, code.co_name)
    return torch.compile(fn, dynamic=None if key is None else False)


_compiled_names: list = []


@functools.lru_cache(maxsize=64)
def _causal_block_mask(sq: int, sk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    offset = sk - sq

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)


def flex(q, k, v, *, causal, scale, seqused_k=None):
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    if seqused_k is not None:
        raise ValueError("flex does not take seqused_k (registered with supports_seqused_k=False)")
    sq, sk = q.shape[2], k.shape[2]
    causal = causal and sq > 1
    mask = _causal_block_mask(sq, sk, str(q.device)) if causal else None
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        key = None if sq == 1 else (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), causal, float(scale))
        out = _compiled(key)(q, k, v, mask, scale, gqa, sq == 1)
    else:
        with warnings.catch_warnings():  # "called without torch.compile": on CPU that is the point
            warnings.simplefilter("ignore", UserWarning)
            out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if causal and sq > sk:
        out[:, :, : sq - sk] = 0  # rows that see no key: 0 under the contract
    return out


register_attention("flex", flex, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                   head_dims=(16, 32, 64, 128, 256), devices=("cuda", "cpu"), supports_seqused_k=False,
                   description="torch.compile(flex_attention) with a causal block mask (uncompiled on CPU)",
                   requires=_missing)
