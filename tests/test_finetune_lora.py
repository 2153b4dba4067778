"""examples/finetune_lora.py: peft LoRA through the patch against stock sdpa (issue 21, "a real fine-tuning run").

- CPU: the tiny Llama, 2 optimizer steps through the example's CLI entry (``main(argv)``): real peft, real datasets
  (the shipped text file through the "text" builder), real transformers model, llm_attn's reference forward and
  backward (``llm_attn::flash_bwd``); the loss of every step matches stock sdpa (rtol 1e-4, float32), the LoRA
  gradients agree, and the patch served every attention call.
- bad arguments and a missing optional dependency: one line on stderr, exit code 2.
- GPU (skips without CUDA or without the compiled extension, which holds the backward kernel): the tiny Llama in
  float16, seq 256, 3 steps on the kernel; losses within 1e-2 (relative) of stock sdpa.

Skips with the reason when peft or datasets is missing (``python -m pip install -e ".[finetune]"``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from conftest import load_script
import torch

pytest.importorskip("peft", reason='needs peft: python -m pip install -e ".[finetune]"')
pytest.importorskip("datasets", reason='needs datasets: python -m pip install -e ".[finetune]"')
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_lora.py"


def _peft_can_build_lora() -> str | None:
    """peft refuses every LoRA layer when gptqmodel is installed without optimum >= 1.24: skip with that reason."""
    from peft.import_utils import is_gptqmodel_available

    try:
        is_gptqmodel_available()
    except ImportError as e:
        return f"peft cannot build LoRA layers in this environment: {str(e).splitlines()[0]}"
    return None


@pytest.fixture(scope="module")
def example():
    why = _peft_can_build_lora()
    if why:
        pytest.skip(why)
    return load_script(EXAMPLE, "finetune_lora_example")


def _check_agreement(result, rtol, native_key, calls_per_step, grad_rtol, last_rtol, cos_tol):
    """Losses within rtol every step; LoRA gradients: cosine > 1 - cos_tol at step 1 and the last step, worst
    tensor's max|g - g_ref| / max|g_ref| <= grad_rtol at step 1 and <= last_rtol at the last step (the weights have
    drifted apart by then, and AdamW's first steps amplify tiny differences of near-zero gradients)."""
    ref, ours = result["runs"]
    assert ref["impl"] == "sdpa" and ours["impl"] == "llm_attn"
    steps = result["args"]["steps"]
    assert len(ref["loss"]) == len(ours["loss"]) == steps
    for a, b in zip(ours["loss"], ref["loss"]):
        assert math.isfinite(a) and math.isfinite(b)
        assert abs(a - b) <= rtol * abs(b), (ours["loss"], ref["loss"])
    assert ours["max_rel_loss_diff"] <= rtol
    # The patch really ran ours on every attention call (not a silent fallback to the stock attention).
    assert ours["native_calls"] == {native_key: calls_per_step * steps}, ours
    assert sum(ours["fallback_calls"].values()) == 0, ours
    assert ours["skipped_steps"] == ref["skipped_steps"]
    n_layers_x4 = ours["grad_step1"]["tensors"] // 2
    # Step 1: lora_B starts at 0, so the lora_A gradients are exactly 0 on both sides and the lora_B ones are not.
    assert ours["grad_step1"]["zero_on_both"] == n_layers_x4 > 0
    assert ours["grad_last"]["zero_on_both"] == 0
    for key, tol in (("grad_step1", grad_rtol), ("grad_last", last_rtol)):
        assert ours[key]["cosine"] > 1 - cos_tol, ours[key]
        assert ours[key]["max_rel_diff"] <= tol, ours[key]


def test_cpu_tiny_two_steps_match_sdpa(example, capsys):
    result = example.main(["--device", "cpu", "--model", "tiny", "--steps", "2", "--seq", "128"])
    out = capsys.readouterr().out
    assert "rel diff llm_attn" in out and "max rel loss diff" in out
    assert result["args"]["dtype"] == "fp32"
    # 2 decoder layers -> 2 attention calls per step, on the PyTorch reference (CPU).
    _check_agreement(result, rtol=1e-4, native_key="reference", calls_per_step=2, grad_rtol=1e-4,
                     last_rtol=1e-3, cos_tol=1e-6)
    # The adapters learn: the two steps see different batches, but the losses are not a constant.
    assert result["runs"][0]["loss"][0] != result["runs"][0]["loss"][1]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seq", "1"], "--seq must be >= 2"),
    (["--model", "nope"], "unknown preset"),
    (["--impl", "sdpa", "nope"], "'nope': unknown"),
    (["--impl", "sdpa", "sdpa"], "twice"),
    (["--data", "/nonexistent/lora.txt"], "no such file"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--model", "tiny:awq"], "the suffix must be one of"),
    (["--model", "tiny:fp16", "--dtype", "bf16"], "contradicts --dtype bf16"),
    (["--device", "cpu", "--model", "tiny", "--seq", "100000"], "max_position_embeddings"),
])
def test_bad_arguments_exit_2_with_one_line(example, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        example.main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_missing_optional_dependency_names_the_extra(example, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(SystemExit) as exc:
        example.main(["--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    expected = f'{example.PROG}: error: datasets not installed; run: python -m pip install -e ".[finetune]"'
    assert err.splitlines() == [expected], err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tiny_fp16_kernel_matches_sdpa(example, capsys):
    from llm_attn import _ext

    status = _ext.backend_status()
    if _ext.kernel_build() is None:  # either build has the backward
        required = {b.strip() for b in os.environ.get("LLM_ATTN_REQUIRE_BACKENDS", "").split(",") if b.strip()}
        if required:
            pytest.fail(f"a kernel build is required but none is available: {status}")
        pytest.skip(f"no kernel build is available: {status}")
    result = example.main(["--device", "cuda", "--model", "tiny", "--dtype", "fp16", "--seq", "256",
                           "--steps", "3", "--backend", "cuda"])
    print(capsys.readouterr().out)
    _check_agreement(result, rtol=1e-2, native_key="cuda", calls_per_step=2, grad_rtol=2e-2,
                     last_rtol=1e-1, cos_tol=1e-3)


def test_implementations_take_turns_step_by_step(example, monkeypatch):
    """Every implementation takes step i before any takes step i + 1, the order reversed on every other step, so
    that the step times pair up by step (the paired interval) and drift hits all alike."""
    order = []
    monkeypatch.setattr(example.ImplRun, "step", lambda self, step, ids, *a: order.append((step, self.impl)))
    args = example.resolve_args(example.build_parser().parse_args(["--device", "cpu", "--impl", "sdpa", "llm_attn",
                                                                   "--steps", "3"]))
    w = torch.nn.Parameter(torch.zeros(2))
    runs = example.train_interleaved(args, None, None, {"w": w}, {"w": w.detach().clone()}, [None] * 3)
    assert [r.impl for r in runs] == ["sdpa", "llm_attn"]
    assert order == [(1, "sdpa"), (1, "llm_attn"), (2, "llm_attn"), (2, "sdpa"), (3, "sdpa"), (3, "llm_attn")]


def test_a_run_cut_short_keeps_its_steps_in_the_json(example, monkeypatch, tmp_path):
    """--json holds the steps done so far (every CHECKPOINT_EVERY steps, "complete": false), so a run that a time
    limit kills keeps what it measured; the finished run replaces it ("complete": true)."""
    out = tmp_path / "lora.json"
    real_step = example.ImplRun.step

    def step(self, n, *a):
        if n == 4:
            raise KeyboardInterrupt  # the time limit, after 3 steps of each implementation
        return real_step(self, n, *a)

    monkeypatch.setattr(example, "CHECKPOINT_EVERY", 1)
    monkeypatch.setattr(example.ImplRun, "step", step)
    argv = ["--device", "cpu", "--model", "tiny", "--steps", "6", "--seq", "64", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        example.main(argv)
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and partial["steps_done"] == 3
    assert [r["impl"] for r in partial["runs"]] == ["sdpa", "llm_attn"]
    assert all(len(r["step_s"]) == len(r["loss"]) == 3 for r in partial["runs"])
    assert partial["args"]["steps"] == 6 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(example.ImplRun, "step", real_step)
    result = example.main(argv)
    done = json.loads(out.read_text())
    assert done["complete"] is True and done["steps_done"] == 6 and len(done["runs"][0]["loss"]) == 6
    assert result["complete"] is True
