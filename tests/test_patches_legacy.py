"""CPU tests of the patch registry on the original project's stack: transformers 4.45 (no AttentionInterface) and
AutoAWQ 0.2.6. Skipped on transformers >= 4.48, so it is run in its own virtual environment:

    python3 -m venv /tmp/legacy-venv
    /tmp/legacy-venv/bin/pip install torch==2.13.0          # the CPU build; never let pip pick a CUDA torch
    /tmp/legacy-venv/bin/pip install -r tests/legacy-requirements.txt
    /tmp/legacy-venv/bin/pip install --no-deps autoawq==0.2.6
    LLM_ATTN_NO_CUDA=1 /tmp/legacy-venv/bin/pip install --no-build-isolation --no-deps -e .
    /tmp/legacy-venv/bin/python -m pytest tests/test_patches_legacy.py -q

What runs here: tiny random Llama/Mistral/Qwen2 models (GQA 8:2, head_dim 64) through the ``hf_legacy`` target
(per-instance forward swap of LlamaSdpaAttention / LlamaAttention), against the stock 4.45 classes; and an AWQ
checkpoint (GEMM format: qweight/qzeros/scales, group 128) that this file packs itself, loaded by AutoAWQ's real
``from_quantized``, unfused (the transformers model inside, patched through ``hf_legacy``) and fused (its
``QuantAttentionFused`` modules). AutoAWQ's fused decoder blocks also need its CUDA kernels for their RMSNorm, so on
CPU the fused attention modules are compared module by module (same inputs, same cache, stock vs patched); the
whole fused model is compared only where ``awq_ext`` imports (a GPU with AutoAWQ's kernels).
"""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch
import transformers
from packaging import version

if version.parse(transformers.__version__) >= version.parse("4.48"):
    pytest.skip("legacy (transformers 4.4x) tests: run in the transformers 4.45.2 venv (see this file's header)",
                allow_module_level=True)

from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llm_attn.patches import (  # noqa: E402
    STATE_ATTR,
    UnsupportedModelError,
    is_patched,
    patch_model,
    patched,
    unpatch_model,
)

LAYERS = 2
VOCAB = 512
TOL = dict(atol=2e-4, rtol=1e-4)


def make_model(kind="llama", attn="sdpa", seed=0, **over):
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(over)
    torch.manual_seed(seed)
    if kind == "llama":
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = MistralConfig(**{"sliding_window": None, **kw}), MistralForCausalLM
    else:
        cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    cfg._attn_implementation = attn
    return cls(cfg).eval()


def prompt(batch=1, length=33, seed=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def greedy(model, ids, n=24, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def step_logits(model, ids, steps=8, tokens=None):
    cache = DynamicCache()
    out = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        out.append(logits)
        for t in range(steps):
            nxt = tokens[:, t:t + 1] if tokens is not None else logits[:, -1:].argmax(-1)
            logits = model(nxt, past_key_values=cache, use_cache=True).logits
            out.append(logits)
    return out, torch.cat([o[:, -1:].argmax(-1) for o in out[:-1]], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# transformers 4.45 models


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"),
                                       ("qwen2", "sdpa")])
def test_legacy_prefill_decode_and_greedy_match(kind, attn):
    model = make_model(kind, attn)
    ids = prompt()
    ref, tokens = step_logits(model, ids)
    stock = greedy(model, ids)
    assert len(set(stock[0, ids.shape[1]:].tolist())) > 5
    with patched(model) as report:
        assert report.target.startswith("transformers 4.4x") and report.num_patched == LAYERS
        got, _ = step_logits(model, ids, tokens=tokens)
        ours = greedy(model, ids)
        assert report.num_fallback_calls == 0, str(report)
        assert report.native_calls == {"reference": LAYERS * (len(ref) + 24)}
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, **TOL)
    assert torch.equal(ours, stock)


def test_legacy_static_cache_runs_natively():
    model = make_model()
    ids = prompt(length=21)
    stock = greedy(model, ids, cache_implementation="static")
    with patched(model) as report:
        ours = greedy(model, ids, cache_implementation="static")
        # 4.45 always builds a 4D float mask for a static cache: it must be recognised as a causal prefix.
        assert report.num_fallback_calls == 0 and report.num_native_calls == LAYERS * 24, str(report)
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("impl", ["naive", "mine"])
def test_legacy_registry_entries_and_plugins(impl):
    """Any registry implementation goes through the 4.4x target: a built-in peer and the example plugin."""
    from pathlib import Path

    from llm_attn import registry

    registry.load_plugin(str(Path(__file__).resolve().parents[1] / "examples" / "my_attention.py"))
    model = make_model()
    ids = prompt()
    ref, tokens = step_logits(model, ids)
    stock = greedy(model, ids, cache_implementation="static")
    with patched(model, impl=impl) as report:
        got, _ = step_logits(model, ids, tokens=tokens)
        assert report.num_fallback_calls == 0 and report.native_calls == {"cpu": LAYERS * len(ref)}, str(report)
        assert torch.equal(greedy(model, ids, cache_implementation="static"), stock)  # seqused_k: both support it
        assert report.num_fallback_calls == 0, str(report)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, **TOL)


def test_legacy_entry_without_seqused_falls_back_on_a_static_cache():
    model = make_model()
    ids = prompt(length=21)
    stock = greedy(model, ids, cache_implementation="static")
    with patched(model, impl="flex") as report:
        ours = greedy(model, ids, cache_implementation="static")
        assert report.num_native_calls == 0 and report.num_fallback_calls == LAYERS * 24, str(report)
        assert all("does not support seqused_k" in r for r in report.fallback_calls)
    assert torch.equal(ours, stock)


def test_legacy_left_padding_falls_back_and_matches():
    model = make_model()
    ids = prompt(batch=2, length=14)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    stock = greedy(model, ids, n=20, attention_mask=mask, pad_token_id=0)
    with patched(model) as report:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
        assert report.num_fallback_calls == LAYERS and report.num_native_calls == 0, str(report)
        ours = greedy(model, ids, n=20, attention_mask=mask, pad_token_id=0)
        assert report.num_fallback_calls == LAYERS * 21, str(report)
    assert torch.equal(got, ref)
    assert torch.equal(ours, stock)


def test_legacy_output_attentions_takes_stock_path():
    model = make_model(attn="eager")
    ids = prompt(length=9)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        with patched(model) as report:
            got = model(ids, output_attentions=True)
            assert report.num_fallback_calls == LAYERS, str(report)
    assert torch.equal(got.logits, ref.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.attentions, ref.attentions, strict=True))


def test_legacy_unpatch_bit_identical_and_patch_twice():
    ids = prompt()
    never = make_model(seed=4)
    with torch.no_grad():
        ref = never(ids).logits
    model = make_model(seed=4)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    r1 = patch_model(model)
    assert patch_model(model) is r1
    with torch.no_grad():
        model(ids)
    assert r1.num_native_calls == LAYERS
    unpatch_model(model)
    assert not is_patched(model)
    assert {n: set(vars(m)) for n, m in model.named_modules()} == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def _torch_roundtrip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch.save": _torch_roundtrip}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_legacy_copy_of_a_patched_model_is_patched_on_its_own(how):
    """deepcopy / pickle / torch.save of a patched 4.4x model: the copy's swapped forwards serve the copy's modules
    and count into the copy's report; unpatching the copy restores its stock forwards and leaves the original
    patched."""
    model = make_model(seed=6)
    ids = prompt(length=21)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    with torch.no_grad():
        stock = model(ids).logits
    report = patch_model(model)
    with torch.no_grad():
        ours = model(ids).logits
    assert report.native_calls == {"reference": LAYERS}
    clone = COPIES[how](model)
    clone_report = clone.__dict__[STATE_ATTR].report
    assert is_patched(clone) and clone_report is not report
    for layer in clone.model.layers:
        swapped = layer.self_attn.__dict__["forward"]
        assert swapped.module is layer.self_attn and swapped.runtime.report is clone_report
    report.reset_counters()
    clone_report.reset_counters()
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, ours)
    assert clone_report.native_calls == {"reference": LAYERS} and report.num_native_calls == 0
    unpatch_model(clone)
    assert {n: set(vars(m)) for n, m in clone.named_modules()} == before
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, stock)
        assert torch.equal(model(ids).logits, ours)
    assert is_patched(model) and report.native_calls == {"reference": LAYERS}


def test_legacy_unsupported_settings():
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        patch_model(make_model("mistral", sliding_window=8))
    model = make_model(attention_dropout=0.3).train()
    with pytest.raises(UnsupportedModelError, match="dropout"):
        patch_model(model)
    report = patch_model(model, on_unsupported="fallback")
    torch.manual_seed(0)
    got = model(prompt(length=8)).logits
    unpatch_model(model)
    torch.manual_seed(0)
    ref = model(prompt(length=8)).logits
    assert report.num_fallback_calls == LAYERS and torch.equal(got, ref)
    with pytest.raises(UnsupportedModelError, match="CUDA"):
        patch_model(make_model(), backend="cuda")


# ---------------------------------------------------------------------------------------------------------------
# AutoAWQ 0.2.6


def _pack_gemm(ints: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM packing: 8 int4 per int32 along the output dim, nibble i holding column 8c + [0,2,4,6,1,3,5,7][i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    packed = torch.zeros(ints.shape[0], ints.shape[1] // 8, dtype=torch.int32)
    for i, col in enumerate(order):
        packed |= ints[:, col::8].to(torch.int32) << (4 * i)
    return packed


def _quantize_awq(weight: torch.Tensor, group: int = 128):
    """(out, in) float weight -> AWQ GEMM tensors: qweight (in, out/8), qzeros (in/group, out/8), scales fp16."""
    out_f, in_f = weight.shape
    w = weight.t().float().reshape(in_f // group, group, out_f)
    lo, hi = w.amin(1), w.amax(1)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(w / scales[:, None] + zeros[:, None]).clamp(0, 15).reshape(in_f, out_f)
    return _pack_gemm(q), _pack_gemm(zeros), scales.half()


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    """A tiny Llama written as an AWQ checkpoint (4-bit, group 128, zero point, GEMM layout) plus config.json."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("awq")
    model = make_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       initializer_range=0.05)  # head_dim 64: a kernel size
    tensors = {}
    for name, t in model.state_dict().items():
        if ".layers." in name and name.endswith("_proj.weight"):
            qweight, qzeros, scales = _quantize_awq(t)
            stem = name[: -len("weight")]
            tensors[stem + "qweight"], tensors[stem + "qzeros"], tensors[stem + "scales"] = qweight, qzeros, scales
        else:
            tensors[name] = t.half().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def load_awq(path, fuse, monkeypatch):
    awq_base = pytest.importorskip("awq.models.base", reason="autoawq is not installed")
    from awq import AutoAWQForCausalLM

    if not torch.cuda.is_available():
        # AutoAWQ 0.2.6 sends every load on a CUDA-less machine to Intel's QBits backend (intel-extension-for-
        # transformers, not installable here). Its GEMM modules run on CPU through their own dequantize+matmul
        # fallback, so we let its device probe answer "cuda" and place the weights on the CPU ourselves.
        monkeypatch.setattr(awq_base, "get_best_device", lambda: "cuda:0")
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return AutoAWQForCausalLM.from_quantized(str(path), fuse_layers=fuse, max_seq_len=128,
                                             device_map={"": device}), device


def test_autoawq_unfused_patched_matches_stock(awq_checkpoint, monkeypatch):
    model, device = load_awq(awq_checkpoint, False, monkeypatch)
    from awq.modules.linear.gemm import WQLinear_GEMM

    assert isinstance(model.model.model.layers[0].self_attn.q_proj, WQLinear_GEMM)
    ids = prompt(length=30, vocab=model.config.vocab_size).to(device)
    with torch.no_grad():
        ref = model.model(ids).logits
    stock = greedy(model, ids, n=20)
    with patched(model) as report:
        assert report.target.startswith("AutoAWQ (unfused)") and report.num_patched == LAYERS, str(report)
        with torch.no_grad():
            got = model.model(ids).logits
        ours = greedy(model, ids, n=20)
        assert report.num_fallback_calls == 0 and report.num_native_calls == LAYERS * 21, str(report)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(ours, stock)
    with torch.no_grad():
        assert torch.equal(model.model(ids).logits, ref)


def test_autoawq_unfused_copies_are_patched_on_their_own(awq_checkpoint, monkeypatch):
    model, device = load_awq(awq_checkpoint, False, monkeypatch)
    ids = prompt(length=30, vocab=model.config.vocab_size).to(device)
    report = patch_model(model)
    with torch.no_grad():
        ours = model.model(ids).logits
    for how in ("deepcopy", "pickle"):
        clone = COPIES[how](model)
        clone_report = clone.__dict__[STATE_ATTR].report
        assert clone_report is not report and clone_report.target.startswith("AutoAWQ (unfused)")
        report.reset_counters()
        clone_report.reset_counters()
        with torch.no_grad():
            assert torch.equal(clone.model(ids).logits, ours)
        assert clone_report.num_native_calls == LAYERS and report.num_native_calls == 0, str(clone_report)
        unpatch_model(clone)
        assert not is_patched(clone) and is_patched(model)
        assert all("forward" not in m.__dict__ for m in clone.modules() if type(m).__name__.endswith("Attention"))
    unpatch_model(model)


def _run_fused_attention(attn, inputs):
    """Drive one QuantAttentionFused module as LlamaLikeModel does: a prefill chunk, then single-token steps."""
    from awq.utils.fused_utils import prepare_attention_mask

    attn.start_pos = 0
    attn.cache.v.zero_()
    attn.cache.k.zero_()
    outs = []
    with torch.no_grad():
        for x in inputs:
            mask = prepare_attention_mask(seqlen=x.shape[1], start_pos=attn.start_pos, device=x.device, type_as=x)
            out, _, _ = attn(x, past_key_value=None, attention_mask=mask)
            outs.append(out.float())
    return outs, attn.cache.k.clone(), attn.cache.v.clone(), attn.start_pos


def test_autoawq_fused_attention_modules_match_stock(awq_checkpoint, monkeypatch):
    model, device = load_awq(awq_checkpoint, True, monkeypatch)
    from awq.modules.fused.attn import QuantAttentionFused

    fused = [m for m in model.modules() if isinstance(m, QuantAttentionFused)]
    assert len(fused) == LAYERS
    g = torch.Generator().manual_seed(3)
    hidden = model.config.hidden_size
    inputs = [torch.randn(1, 25, hidden, generator=g)] + [torch.randn(1, 1, hidden, generator=g) for _ in range(6)]
    inputs = [x.half().to(device) for x in inputs]
    stock = [_run_fused_attention(m, inputs) for m in fused]
    with patched(model) as report:
        assert report.target == "AutoAWQ (fused QuantAttentionFused)" and report.num_patched == LAYERS
        ours = [_run_fused_attention(m, inputs) for m in fused]
        assert report.num_fallback_calls == 0 and report.num_native_calls == LAYERS * len(inputs), str(report)
    for (s_out, s_k, s_v, s_pos), (o_out, o_k, o_v, o_pos) in zip(stock, ours, strict=True):
        for a, b in zip(s_out, o_out, strict=True):
            torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)
        assert torch.equal(s_k, o_k) and torch.equal(s_v, o_v) and s_pos == o_pos == 25 + 6
    again = [_run_fused_attention(m, inputs) for m in fused]  # unpatched: the stock forward, bit for bit
    for (s_out, *_), (a_out, *_) in zip(stock, again, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(s_out, a_out, strict=True))


def test_autoawq_fused_deepcopy_is_patched_on_its_own(awq_checkpoint, monkeypatch):
    """copy.deepcopy of a patched fused AutoAWQ model (pickle is out of reach: AutoAWQ's fused modules hold lambdas
    in ``attention_shapes``, stock or patched): each copied fused module runs its own swapped forward."""
    model, device = load_awq(awq_checkpoint, True, monkeypatch)
    from awq.modules.fused.attn import QuantAttentionFused

    g = torch.Generator().manual_seed(5)
    hidden = model.config.hidden_size
    inputs = [torch.randn(1, 17, hidden, generator=g)] + [torch.randn(1, 1, hidden, generator=g) for _ in range(3)]
    inputs = [x.half().to(device) for x in inputs]
    report = patch_model(model)
    fused = [m for m in model.modules() if isinstance(m, QuantAttentionFused)]
    ours = [_run_fused_attention(m, inputs) for m in fused]
    clone = copy.deepcopy(model)
    clone_report = clone.__dict__[STATE_ATTR].report
    clone_fused = [m for m in clone.modules() if isinstance(m, QuantAttentionFused)]
    assert all(m.__dict__["forward"].module is m for m in clone_fused)
    report.reset_counters()
    clone_report.reset_counters()
    got = [_run_fused_attention(m, inputs) for m in clone_fused]
    assert clone_report.num_native_calls == LAYERS * len(inputs) and report.num_native_calls == 0
    for (a_out, a_k, a_v, _), (b_out, b_k, b_v, _) in zip(ours, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_out, b_out, strict=True))
        assert torch.equal(a_k, b_k) and torch.equal(a_v, b_v)
    unpatch_model(clone)
    assert all("forward" not in m.__dict__ for m in clone_fused) and is_patched(model)
    unpatch_model(model)


def test_autoawq_fused_attention_with_another_entry(awq_checkpoint, monkeypatch):
    """The fused AutoAWQ target with a registry entry other than ours (naive, fp16 on this device)."""
    model, device = load_awq(awq_checkpoint, True, monkeypatch)
    from awq.modules.fused.attn import QuantAttentionFused

    fused = [m for m in model.modules() if isinstance(m, QuantAttentionFused)]
    g = torch.Generator().manual_seed(4)
    hidden = model.config.hidden_size
    inputs = [torch.randn(1, 19, hidden, generator=g)] + [torch.randn(1, 1, hidden, generator=g) for _ in range(4)]
    inputs = [x.half().to(device) for x in inputs]
    stock = [_run_fused_attention(m, inputs) for m in fused]
    with patched(model, impl="naive") as report:
        got = [_run_fused_attention(m, inputs) for m in fused]
        assert report.impl == "naive" and report.num_fallback_calls == 0, str(report)
        assert report.native_calls == {torch.device(device).type: LAYERS * len(inputs)}, str(report)
    for (s_out, *_), (o_out, *_) in zip(stock, got, strict=True):
        for a, b in zip(s_out, o_out, strict=True):
            torch.testing.assert_close(b, a, atol=4e-3, rtol=4e-3)


def test_autoawq_fused_prefill_with_foreign_mask_falls_back(awq_checkpoint, monkeypatch):
    model, device = load_awq(awq_checkpoint, True, monkeypatch)
    from awq.modules.fused.attn import QuantAttentionFused

    attn = next(m for m in model.modules() if isinstance(m, QuantAttentionFused))
    x = torch.randn(1, 10, model.config.hidden_size).half().to(device)
    odd = torch.zeros(1, 1, 10, 10).half().to(device)  # a non-causal additive mask: not ours to reinterpret
    with torch.no_grad():
        attn.start_pos = 0
        ref = attn(x, past_key_value=None, attention_mask=odd)[0]
        with patched(model) as report:
            attn.start_pos = 0
            got = attn(x, past_key_value=None, attention_mask=odd)[0]
            assert report.num_fallback_calls == 1 and report.num_native_calls == 0, str(report)
    assert torch.equal(got, ref)


def test_autoawq_fused_whole_model_on_gpu(awq_checkpoint, monkeypatch):
    pytest.importorskip("awq_ext", reason="AutoAWQ's CUDA kernels (autoawq-kernels) are needed for fused blocks")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, device = load_awq(awq_checkpoint, True, monkeypatch)
    ids = prompt(length=40, vocab=model.config.vocab_size).to(device)
    stock = greedy(model, ids, n=20)
    with patched(model) as report:
        ours = greedy(model, ids, n=20)
        assert report.num_fallback_calls == 0 and report.native_calls.get("cuda", 0) > 0, str(report)
    assert torch.equal(ours, stock)
