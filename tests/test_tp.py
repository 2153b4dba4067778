"""CPU tests of tensor-parallel TTFT (llm_attn/harness/tp*.py): 2 ranks with gloo under torchrun, on the tiny-tp
preset (2 layers, 8 query / 4 KV heads: 4/2 per rank).

- sharded patching: every rank's attention calls are served by ours (the reference path) on the rank's head shard;
- the same first token and logits (float32 tolerance) as one process, for stock sdpa and for ours;
- ``python -m llm_attn.ttft --tp 2`` end to end (it starts torchrun itself): rows with the TP fields, each rank's
  host-bound flag, comm wait and one layer's ops; ``ttft_graph`` rows ``unsupported`` on gloo;
- the bad-input errors: one line, exit 2, before anything is loaded; under a torchrun started by hand, one line;
- the synthetic writer's free-disk check, and a killed writer resuming where it stopped.
(The ``nvidia-smi topo -m`` parser: tests/test_tp_topology.py; the rows' ratios and tables: tests/test_tp_report.py.)

    pytest tests/test_tp.py          (about five minutes on two CPU cores: a dozen torchrun starts)
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cpu_check_here
from llm_attn import models
from llm_attn.harness import tp_preflight as tp

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("torch.distributed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _cpu_check(request):
    # About two minutes of gloo processes on a GPU machine: CI runs them on every submission, -m full on a GPU.
    cpu_check_here(request, "tensor parallelism on CPU (gloo ranks under torchrun)")


def _env(tmp: Path) -> dict:
    # CUDA hidden: transformers builds its TP mesh on the machine's accelerator, and these tests are the CPU ones.
    # The caller's PYTHONPATH stays after the repository (an install of gptqmodel made with --target, say).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "LLM_ATTN_CACHE": str(tmp / "cache")}


def _run(cmd: list[str], tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def checkpoint(work) -> Path:
    return models.write_synthetic_checkpoint(work / "tiny-tp-fp16", "tiny-tp", "fp16", seed=2, device="cpu")


@pytest.fixture(scope="module")
def sharded(work, checkpoint) -> dict:
    """Two gloo ranks of tests/tp_worker.py on the checkpoint, float32."""
    out = work / "tp2.json"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 str(REPO / "tests" / "tp_worker.py"), str(checkpoint), str(out), "cpu", "float32"], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(checkpoint, sharded) -> dict:
    """The same prompt through the same checkpoint in this one process (no process group)."""
    from transformers import AutoModelForCausalLM

    from llm_attn.harness.measure import prefill_first_token
    from llm_attn.patches import patch_model, unpatch_model

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompt = torch.tensor(sharded["prompt"])
    out = {}
    with torch.inference_mode():
        tok, logits = prefill_first_token(model, prompt)
        out["sdpa"] = (tok.tolist(), logits.float())
        report = patch_model(model, impl="llm_attn", backend="reference")
        tok, logits = prefill_first_token(model, prompt)
        out["llm_attn"] = (tok.tolist(), logits.float())
        out["native"] = dict(report.native_calls)
        unpatch_model(model)
    return out


def test_each_rank_holds_its_head_shard(sharded):
    assert sharded["world"] == 2 and len(sharded["ranks"]) == 2
    for r in sharded["ranks"]:
        assert r["local_heads"] == {"q_heads": 4, "kv_heads": 2, "head_dim": 64}


def test_sharded_patching_serves_every_call_on_the_shard(sharded):
    cfg = models.PRESETS["tiny-tp"]
    for r in sharded["ranks"]:
        ours = r["llm_attn"]
        assert ours["patched"] == cfg.num_hidden_layers
        # One prefill: one call per layer, every one served natively by the reference, none on the stock path.
        assert ours["native"] == {"reference": cfg.num_hidden_layers}, ours
        assert ours["fallback"] == 0
        # ... and the op saw the rank's shard: 4 query heads over 2 KV heads, not the model's 8/4.
        assert r["num_seen"] == cfg.num_hidden_layers
        assert r["seen_heads"] == [[4, 2]]


@pytest.mark.parametrize("impl", ["sdpa", "llm_attn"])
def test_first_token_and_logits_equal_one_process(sharded, single, impl):
    ref_tok, ref_logits = single[impl]
    assert single["native"] == {"reference": models.PRESETS["tiny-tp"].num_hidden_layers}
    for r in sharded["ranks"]:
        got = torch.tensor(r[impl]["logits"])
        assert torch.isfinite(got).all()
        assert r[impl]["token"] == ref_tok, f"rank {r['rank']} {impl}: first token differs from one process"
        diff = (got - ref_logits).abs().max().item()
        # float32: the row-wise all-reduce sums two partial products, a different order than one matmul.
        assert diff <= 1e-4 * max(1.0, ref_logits.abs().max().item()), f"rank {r['rank']} {impl}: {diff}"
    # The two ranks hold the same replicated logits after the gathered lm_head.
    a, b = (torch.tensor(r[impl]["logits"]) for r in sharded["ranks"])
    assert torch.equal(a, b)


def test_cli_tp2_rows(work, checkpoint, single):
    out = work / "cli.jsonl"
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", "2", "--model", str(checkpoint), "--impl", "sdpa",
                 "llm_attn", "--seq", "32", "--repeats", "3", "--warmup", "1", "--out", str(out)], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "torch.distributed.run" in proc.stderr  # it started torchrun itself
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["impl"] for r in rows) == ["llm_attn", "sdpa"]
    from llm_attn.harness.results import validate_row

    for r in rows:
        validate_row(r)
        t = r["tp"]
        assert (t["degree"], t["world_size"], t["backend"]) == (2, 2, "gloo")
        assert t["interconnect"]["kind"].startswith("gloo")
        assert t["local_heads"] == {"q_heads": 4, "kv_heads": 2, "head_dim": 64}
        assert [k["rank"] for k in t["ranks"]] == [0, 1]
        assert len({k["pid"] for k in t["ranks"]}) == 2
        for k in t["ranks"]:
            assert k["env"]["WORLD_SIZE"] == "2" and k["env"]["RANK"] == str(k["rank"])
            assert len(k["samples_ms"]) == 3 and all(s > 0 for s in k["samples_ms"])
            p = k["profile"]
            assert p["busy_ms"] > 0 and 0 < p["comm_share"] < 1  # gloo all-reduces of the row-wise layers
            assert k["first_token"] == r["first_token"]
        assert r["samples_ms"] == t["ranks"][0]["samples_ms"]  # TTFT is rank 0's
    ours = next(r for r in rows if r["impl"] == "llm_attn")
    # Paired as on one GPU: the record holds both implementations' samples by repeat, vs is stats' interval of
    # median(sdpa) / median(ours) (> 1 = ours is faster).
    from llm_attn.harness.stats import paired_ratio_interval

    rec = ours["paired"]
    assert rec["impls"] == ["sdpa", "llm_attn"] and len(rec["order"]) == 3 and len(rec["positions"]) == 3
    assert ours["vs"]["sdpa"] == paired_ratio_interval(rec["samples_ms"]["sdpa"], rec["samples_ms"]["llm_attn"])
    assert ours["max_abs_logit_diff_vs_base"] < 1e-4
    for r in rows:
        assert r["host_bound"]["ranks"] == [True, True]  # CPU: the host does all the work
        assert r["enqueue_samples_ms"] == r["tp"]["ranks"][0]["enqueue_samples_ms"]
        for k in r["tp"]["ranks"]:
            p = k["profile"]
            assert p["collective_kinds"] == {"gloo:all_reduce": 4, "gloo:all_gather": 1}  # 2 per layer, lm_head
            assert p["comm_wait_ms"] >= 0 and 0 <= p["comm_wait_share"] < 1 and p["comm_transfer_ms"] > 0
            assert p["layer"]["index"] == 1 and any(x["kind"] == "comm" for x in p["layer"]["kernels"])
        # The rank that arrived last at a collective did not wait: with two ranks, their waits add up to the
        # differences of their durations, collective by collective.
        p0, p1 = (k["profile"] for k in r["tp"]["ranks"])
        diff = sum(abs(a - b) for a, b in zip(p0["collectives_ms"], p1["collectives_ms"]))
        assert p0["comm_wait_ms"] + p1["comm_wait_ms"] == pytest.approx(diff)
    assert "ttft: llm_attn" in proc.stderr and "vs sdpa" in proc.stderr
    for k in ours["tp"]["ranks"]:
        assert k["attention_calls"]["native"] == {"reference": 2} and k["attention_calls"]["stock_fallback"] == 0
    # The CLI's prompt is its own (seed 0, batch 1): compare the two implementations with each other across ranks.
    assert ours["first_token"] == next(r for r in rows if r["impl"] == "sdpa")["first_token"]
    assert "| TP " in proc.stdout and "vs sdpa (paired; >1 = faster)" in proc.stdout


def test_graph_ttft_on_gloo_is_unsupported_with_the_reason(work, checkpoint):
    out = work / "graph.jsonl"
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", "2", "--model", str(checkpoint), "--impl", "sdpa",
                 "--seq", "16", "--repeats", "2", "--warmup", "1", "--measure", "ttft", "ttft_graph", "--out",
                 str(out)], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["measurement"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["ttft"]["status"] == "ok"
    g = rows["ttft_graph"]
    assert (g["status"], g["kind"]) == ("unsupported", "error") and "CUDA graphs need CUDA devices" in g["error"]


# -- bad input: one line, exit 2, nothing loaded, no torchrun started -----------------------------------------------

def _bad(work, *args) -> str:
    proc = _run([sys.executable, "-m", "llm_attn.ttft", *args, "--out", str(work / "bad.jsonl")], work, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    # argparse's usage, then the error in one line.
    assert lines[-1].startswith("python -m llm_attn.ttft: error: "), proc.stderr
    assert not any("error" in ln for ln in lines[:-1]), proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed.run" not in proc.stderr
    lines = lines[-1:]
    assert not (work / "cache").exists() or not any((work / "cache").glob("tiny-tp*")), "a checkpoint was written"
    return lines[0]


def test_kv_heads_not_divisible(work):
    line = _bad(work, "--tp", "3", "--model", "tiny-tp:fp16", "--impl", "sdpa")
    assert "4 KV heads, not divisible by 3" in line


def test_awq_cannot_be_sharded(work):
    line = _bad(work, "--tp", "2", "--model", "tiny-tp:awq", "--impl", "sdpa")
    assert "AWQ int4" in line and "tiny-tp:fp16" in line


@pytest.mark.parametrize("declared,dtype,expect", [
    ("dtypes=(torch.float16,)", "float32", "takes float16, got float32"),
    ("dtypes=(torch.float32,), head_dims=(128,)", "float32", "supports head_dim (128,), got 64"),
])
def test_impl_that_cannot_run_on_a_shard(work, declared, dtype, expect):
    plugin = work / f"plug_{abs(hash(declared))}.py"
    plugin.write_text("import torch\nimport llm_attn\n"
                      "def fn(q, k, v, *, causal, scale, seqused_k=None):\n"
                      "    return llm_attn.flash_attn_func(q, k, v, causal=causal, scale=scale, backend='reference')\n"
                      f"llm_attn.register_attention('narrow', fn, devices=('cpu',), {declared})\n")
    line = _bad(work, "--tp", "2", "--model", "tiny-tp:fp16", "--dtype", dtype, "--plugin", str(plugin),
                "--impl", "sdpa", "narrow")
    assert "--impl narrow: cannot run on a TP shard" in line and "4 query / 2 KV heads per rank" in line
    assert expect in line


@pytest.mark.parametrize("args,expect", [
    (["--tp", "4", "--model", "tiny-tp:fp16"], "--tp 4: torchrun started 2 processes (WORLD_SIZE=2)"),
    (["--tp", "2", "--model", "tiny-tp:awq"], "is an AWQ int4 checkpoint"),
])
def test_bad_input_under_a_torchrun_started_by_hand_is_one_line(work, args, expect):
    """Under a torchrun started by hand a rank that finds bad input prints the one line first and exits 2 (torchrun's
    own report of the failed rank follows it; ``python -m llm_attn.ttft --tp N`` leaves that out)."""
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                 "llm_attn.ttft", *args, "--impl", "sdpa", "--out", str(work / "bad.jsonl")], work, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0, proc.stderr
    ours = [ln for ln in lines if ln.startswith("python -m llm_attn.ttft: error: ")]
    assert len(ours) == 1 and expect in ours[0] and lines.index(ours[0]) == 0, proc.stderr
    assert not (work / "bad.jsonl").exists()


def test_fewer_gpus_than_requested():
    n = torch.cuda.device_count()
    with pytest.raises(tp.TPError, match=rf"--tp {n + 1}: needs {n + 1} GPUs, {n} visible"):
        tp.preflight(n + 1, "tiny-tp:fp16", ["sdpa"], "cuda", torch.float16)


def test_world_size_must_match():
    with pytest.raises(tp.TPError, match="torchrun started 4 processes"):
        tp.preflight(2, "tiny-tp:fp16", ["sdpa"], "cpu", torch.float32, world_size=4)


def test_good_preflight_returns_geometry():
    geo = tp.preflight(8, "llama-3-70b:fp16", ["sdpa", "llm_attn"], "cpu", torch.float32)
    assert (geo["q_heads"], geo["kv_heads"], geo["head_dim"]) == (64, 8, 128)
    with pytest.raises(tp.TPError, match="8 KV heads, not divisible by 16"):
        tp.preflight(16, "llama-3-70b:fp16", ["sdpa"], "cpu", torch.float32)


# -- presets and the free-disk check --------------------------------------------------------------------------------

def test_llama_3_70b_geometry():
    cfg = models.llama_config("llama-3-70b")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size,
            cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (80, 64, 8, 8192, 28672, 128256, 128)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert 70.0e9 < models._param_count(cfg) < 71.0e9
    assert 139e9 < models.estimated_checkpoint_bytes("llama-3-70b", "fp16") < 143e9
    assert 38e9 < models.estimated_checkpoint_bytes("llama-3-70b", "awq") < 42e9


def test_writer_checks_free_disk_first(tmp_path, monkeypatch):
    free = 20 * 10**9
    usage = collections.namedtuple("usage", "total used free")
    # The shutil module itself (not a module's reference to it): wherever the writer's check lives, it sees this.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * free, 9 * free, free))
    target = tmp_path / "big"
    with pytest.raises(models.NotEnoughDiskError) as e:
        models.write_synthetic_checkpoint(target, "llama-3-70b", "awq")
    msg = str(e.value)
    assert "\n" not in msg and "needs 40.6 GB, 20.0 GB free" in msg
    assert "llama-3-8b:awq, llama-3-8b:fp16" in msg and "llama-3-70b" not in msg.split("fit there:")[1]
    assert not target.exists()  # refused before anything was written
    # The same check passes for what fits, and the writer then writes it.
    assert models.check_free_disk(tmp_path / "small", "tiny", "fp16") < free
    models.write_synthetic_checkpoint(tmp_path / "small", "tiny", "fp16", device="cpu")
    assert (tmp_path / "small" / "config.json").is_file()


KILLED_WRITER = """
import os, sys
import safetensors.torch as st
from llm_attn.models import synthetic
synthetic.SHARD_BYTES = int(sys.argv[2])
real, calls = st.save_file, []
def killed_in_the_third_shard(tensors, filename, metadata=None):
    calls.append(filename)
    if len(calls) == 3:
        with open(filename, "wb") as fh:
            fh.write(b"\\0" * 100)  # what a kill in the middle of the write leaves
        os._exit(9)
    return real(tensors, filename, metadata=metadata)
st.save_file = killed_in_the_third_shard
synthetic.cached_checkpoint("tiny", "fp16", cache_dir=sys.argv[1])
"""


def test_killed_writer_resumes_where_it_stopped(tmp_path, monkeypatch):
    """gen70b writes 20 shards of 2 GiB; a writer killed half-way (a device call's 10 minutes, a lost machine)
    resumes from the shards it finished instead of starting over, and the result is byte-identical to an
    uninterrupted write. Here: the tiny preset in ~400 kB shards, killed while writing its third."""
    from llm_attn.models import synthetic

    shard = 400_000
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WRITER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), str(shard)], cwd=REPO,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    (path,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert not (path / synthetic.MARKER_FILE).exists()
    progress = json.loads((path / synthetic.PROGRESS_FILE).read_text())
    assert len(progress["shards"]) == 2 and len(list(path.glob("*.partial"))) == 1
    kept = {f: (path / f).stat() for f in progress["shards"]}

    monkeypatch.setattr(synthetic, "SHARD_BYTES", shard)
    assert synthetic.cached_checkpoint("tiny", "fp16", cache_dir=tmp_path / "cache", seed=0) == path
    assert (path / synthetic.MARKER_FILE).is_file() and not (path / synthetic.PROGRESS_FILE).exists()
    assert not list(path.glob("*.partial"))
    for f, st in kept.items():  # the finished shards were not written again
        now = (path / f).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    fresh = synthetic.write_synthetic_checkpoint(tmp_path / "fresh", "tiny", "fp16", device="cpu", shard_bytes=shard)
    shards = sorted(p.name for p in fresh.glob("*.safetensors"))
    assert len(shards) > 5 and shards == sorted(p.name for p in path.glob("*.safetensors"))
    for name in shards + ["model.safetensors.index.json"]:
        assert (path / name).read_bytes() == (fresh / name).read_bytes(), name
    # A progress file of another checkpoint is not resumed.
    with pytest.raises(ValueError, match="cannot resume"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / synthetic.PROGRESS_FILE).write_text(json.dumps({**progress, "shards": {}}))
        synthetic.write_synthetic_checkpoint(tmp_path / "other", "tiny", "fp16", seed=1, device="cpu",
                                             shard_bytes=shard, resume=True)


def test_cli_reports_disk_error_in_one_line(work):
    """--tp with the 70B fp16 preset where the disk cannot hold it (141 GB): the writer's one line, exit 2."""
    if shutil.disk_usage(work).free > models.estimated_checkpoint_bytes("llama-3-70b", "fp16") * 1.1:
        pytest.skip("this disk has room for the 70B fp16 checkpoint; test_writer_checks_free_disk_first covers it")
    line = _bad(work, "--tp", "2", "--model", "llama-3-70b:fp16", "--impl", "sdpa")
    assert "NotEnoughDiskError: not enough free disk for the synthetic llama-3-70b fp16 checkpoint" in line
    assert "GB free; presets that fit there: " in line


def test_hub_id_is_refused_under_tp(work):
    line = _bad(work, "--tp", "2", "--model", "meta-llama/Meta-Llama-3-70B", "--impl", "sdpa")
    assert "under --tp give a preset" in line


# -- why AWQ is refused under TP ------------------------------------------------------------------------------------

AWQ_PROBE = """
import json, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, AwqConfig
from transformers.distributed import DistributedConfig
from llm_attn import models
dist.init_process_group("gloo")
models._import_gptqmodel()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16,
    quantization_config=AwqConfig(bits=4, group_size=128, zero_point=True, version="gemm", backend="torch_awq"),
    distributed_config=DistributedConfig(tp_size=2, tp_plan="auto"))
q = m.model.layers[0].self_attn.q_proj
res = {"cls": type(q).__name__, "qweight": list(q.qweight.shape)}
try:
    with torch.inference_mode():
        m(torch.zeros(1, 8, dtype=torch.long))
    res["forward"] = "ok"
except Exception as e:
    res["forward"] = f"{type(e).__name__}: {e}"
out = [None, None]
dist.all_gather_object(out, res)
if dist.get_rank() == 0:
    open(sys.argv[2], "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def test_awq_int4_is_not_sharded_by_transformers_tp_plan(work):
    """The fact the AWQ refusal rests on (gptqmodel 7.5.0, transformers 5.17): under tp_plan the int4 buffers stay
    whole on every rank and the forward fails. If this test fails, the libraries shard AWQ now: lift the refusal in
    llm_attn.harness.tp.preflight."""
    from llm_attn.models import detect_awq_backends

    if not detect_awq_backends().get("gptqmodel"):
        pytest.skip("gptqmodel is not installed")
    ckpt = models.write_synthetic_checkpoint(work / "tiny-tp-awq", "tiny-tp", "awq", seed=2, device="cpu")
    script, out = work / "awq_probe.py", work / "awq_probe.json"
    script.write_text(AWQ_PROBE)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                 str(ckpt), str(out)], work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    h = models.PRESETS["tiny-tp"].hidden_size
    for r in json.loads(out.read_text()):
        assert r["qweight"] == [h, h // 8], r  # the whole (in, out/8) int4 weight, not a column shard
        assert r["forward"] != "ok" and "DTensor" in r["forward"], r


def test_tp1_baseline_loads_awq_with_the_project_loader(work):
    """--tp 1 (the baseline the TP rows are compared against) runs one rank through models.load_model, AWQ int4
    included."""
    from llm_attn.models import detect_awq_backends

    if not detect_awq_backends().get("gptqmodel"):
        pytest.skip("gptqmodel is not installed")
    out = work / "tp1.jsonl"
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", "1", "--model", "tiny-tp:awq", "--impl", "sdpa",
                 "llm_attn", "--seq", "32", "--repeats", "2", "--warmup", "1", "--out", str(out)], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["tp"]["degree"] == 1 and r["tp"]["world_size"] == 1
        assert r["model"]["quant"] == "awq-int4" and "gptqmodel" in r["model"]["awq_backend"]
        assert r["dtype"] == "float16"
    ours = next(r for r in rows if r["impl"] == "llm_attn")
    assert ours["attention_calls"]["native"] == {"reference": 2}


def test_unavailable_duplicate_and_too_long_are_one_line():
    with pytest.raises(tp.TPError, match="twice"):
        tp.preflight(2, "tiny-tp:fp16", ["sdpa", "sdpa"], "cpu", torch.float32)
    with pytest.raises(tp.TPError, match=r"--impl flash_attention_2: .*CUDA GPU"):
        tp.preflight(2, "tiny-tp:fp16", ["flash_attention_2"], "cpu", torch.float32)
    with pytest.raises(tp.TPError, match=r"--seq 5000: longer than tiny-tp allows \(4096 positions\)"):
        tp.preflight(2, "tiny-tp:fp16", ["sdpa"], "cpu", torch.float32, seqs=[64, 5000])


def test_init_preset_runs_without_weights_on_disk(work):
    """':init': a config-only skeleton (a few KB) whose weights transformers initialises on each rank's shard at
    load: how Llama 3 70B runs at TP=2 where its 141 GB fp16 checkpoint does not fit the disk."""
    out = work / "init.jsonl"
    proc = _run([sys.executable, "-m", "llm_attn.ttft", "--tp", "2", "--model", "tiny-tp:init", "--impl", "sdpa",
                 "llm_attn", "--seq", "32", "--repeats", "2", "--warmup", "1", "--out", str(out)], work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    skeleton = Path(rows[0]["model"]["path"])
    assert sum(f.stat().st_size for f in skeleton.iterdir()) < 100_000
    for r in rows:
        assert r["model"]["source"] == "initialised-at-load" and r["tp"]["local_heads"]["q_heads"] == 4
        assert len({tuple(k["first_token"]) for k in r["tp"]["ranks"]}) == 1
        assert all(0 < k["profile"]["comm_share"] < 1 and k["profile"]["comm_wait_ms"] is not None
                   for k in r["tp"]["ranks"])
    assert rows[0]["first_token"] == rows[1]["first_token"]  # sdpa and ours agree on the initialised model
