"""GPU tests of tensor-parallel TTFT (llm_attn/harness/tp*.py): 2 ranks with NCCL, one GPU each, on tiny-tp in fp16.
Skipped with the reason where fewer than 2 GPUs are visible. Run by experiments/tp_suite.sh (test, quick) on a
2-GPU machine:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 pytest tests/test_tp_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_attn import models

REPO = Path(__file__).resolve().parents[1]
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NGPU < 2, reason=f"tensor parallelism needs 2 GPUs, {NGPU} visible")
LAYERS = models.PRESETS["tiny-tp"].num_hidden_layers


def _env(tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "LLM_ATTN_CACHE": str(tmp / "cache")}
    # Mandatory on the lent multi-GPU machines (NVLink multicast off).
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return env


def _run(cmd, tmp: Path, timeout: int = 600):
    return subprocess.run(cmd, cwd=REPO, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("tpgpu")


@pytest.fixture(scope="module")
def checkpoint(work):
    return models.write_synthetic_checkpoint(work / "tiny-tp-fp16", "tiny-tp", "fp16", seed=2)


@pytest.fixture(scope="module")
def sharded(work, checkpoint):
    out = work / "tp2.json"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 str(REPO / "tests" / "tp_worker.py"), str(checkpoint), str(out), "cuda", "float16"], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_nccl_shards_and_ours_runs_the_kernel_on_each_shard(sharded):
    for r in sharded["ranks"]:
        assert r["local_heads"] == {"q_heads": 4, "kv_heads": 2, "head_dim": 64}
        assert r["llm_attn"]["native"] == {"cuda": LAYERS} and r["llm_attn"]["fallback"] == 0
        assert r["seen_heads"] == [[4, 2]]


@pytest.mark.parametrize("impl", ["sdpa", "llm_attn"])
def test_first_token_and_logits_match_one_gpu(sharded, checkpoint, impl):
    from transformers import AutoModelForCausalLM

    from llm_attn.harness.measure import prefill_first_token
    from llm_attn.patches import patch_model

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16, device_map="cuda:0",
                                                 attn_implementation="sdpa").eval()
    prompt = torch.tensor(sharded["prompt"], device="cuda:0")
    with torch.inference_mode():
        if impl != "sdpa":
            patch_model(model, impl=impl, backend="cuda")
        tok, logits = prefill_first_token(model, prompt)
    ref = logits.float().cpu()
    tol = 3e-2 * max(1.0, ref.abs().max().item())
    for r in sharded["ranks"]:
        got = torch.tensor(r[impl]["logits"])
        assert torch.isfinite(got).all()
        # fp16: the row-wise all-reduce adds two fp16 partial sums, a different rounding than one matmul.
        assert (got - ref).abs().max().item() <= tol
        # The same greedy token, unless one GPU's top two logits are closer than that rounding.
        for b, (mine, theirs) in enumerate(zip(r[impl]["token"], tok.tolist())):
            assert mine == theirs or ref[b, theirs] - ref[b, mine] <= tol, (b, mine, theirs)


def test_cli_tp2_on_gpus(work, checkpoint):
    out = work / "cli.jsonl"
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", "2", "--model", str(checkpoint), "--dtype", "float16",
                 "--impl", "sdpa", "llm_attn", "--seq", "256", "--repeats", "5", "--warmup", "2", "--measure", "ttft",
                 "ttft_graph", "--out", str(out)], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    eager = [r for r in rows if r["measurement"] == "ttft"]
    assert sorted(r["impl"] for r in eager) == ["llm_attn", "sdpa"]
    for r in rows:
        t = r["tp"]
        assert (t["degree"], t["world_size"], t["backend"]) == (2, 2, "nccl")
        # Issue 36: an NVLink pair read as PCIe with {"0-1": "X"}.
        assert t["interconnect"]["kind"] in ("NVLink", "PCIe", "mixed"), t["interconnect"]
        assert t["interconnect"]["links"] and "X" not in t["interconnect"]["links"].values(), t["interconnect"]
    for r in eager:
        ranks = r["tp"]["ranks"]
        assert [k["device"] for k in ranks] == ["cuda:0", "cuda:1"]
        for k in ranks:
            p = k["profile"]
            assert p["timer"] == "cuda_kernels" and 0 < p["comm_share"] < 1
            assert p["comm_wait_ms"] is not None and 0 <= p["comm_wait_share"] < 1, p.get("comm_wait_why")
            assert p["collective_kinds"] and all("nccl" in n.lower() for n in p["collective_kinds"])
            kinds = {x["kind"] for x in p["layer"]["kernels"]}
            assert {"comm", "gemm", "attention"} <= kinds, p["layer"]
            hb = k["host_bound"]
            assert hb["gpu_span_share"] is not None and 0 < hb["enqueue_share"]
        assert r["host_bound"]["ranks"] == [k["host_bound"]["host_bound"] for k in ranks]
    ours = next(r for r in eager if r["impl"] == "llm_attn")
    for k in ours["tp"]["ranks"]:
        assert k["attention_calls"]["native"] == {"cuda": LAYERS}
    assert set(ours["vs"]) == {"sdpa"} and ours["vs"]["sdpa"]["n"] == 5
    # Graph TTFT at TP=2: the sharded prefill, NCCL all-reduces included, captured and replayed on both ranks.
    graph = {r["impl"]: r for r in rows if r["measurement"] == "ttft_graph"}
    assert set(graph) == {"sdpa", "llm_attn"}
    for impl, g in graph.items():
        assert g["status"] == "ok", g.get("error")
        assert len(g["samples_ms"]) == 5 and all(s > 0 for s in g["samples_ms"])
        assert [k["first_token"] for k in g["tp"]["ranks"]][0] == g["tp"]["ranks"][1]["first_token"]
    assert any("flash" in k["name"] for k in graph["llm_attn"]["attention_kernels"])
    assert graph["llm_attn"]["first_token"] == next(r for r in eager if r["impl"] == "llm_attn")["first_token"]


def test_more_ranks_than_gpus_is_one_line(work):
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", str(NGPU + 1), "--model", "tiny-tp:fp16",
                 "--impl", "sdpa", "--out", str(work / "bad.jsonl")], work, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert f"needs {NGPU + 1} GPUs, {NGPU} visible" in last and "Traceback" not in proc.stderr
