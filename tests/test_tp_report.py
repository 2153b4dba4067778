"""What the tensor-parallel rows and tables say, without starting ranks (llm_attn/harness/tp.py, tp_table.py,
tp_profile.py, tp_launch.py): rows built from made-up per-rank results as the ranks gather them.

- the ratio reads as the main table's: reference (sdpa) / this, > 1 = faster, from ``stats`` (issue 36: the TP
  table printed this / sdpa, so 93.90 ms vs 93.35 ms read ``0.995x [0.984, 0.996] faster``);
- each rank's host-bound flag and the share of its time spent waiting in collectives;
- torchrun's failure report left out by the launcher, the rank's one line kept last;
- the report groups TP rows by degree.

    pytest tests/test_tp_report.py
"""

from __future__ import annotations

import types

import pytest
import torch

from llm_attn.harness import tp, tp_launch
from llm_attn.harness.paired import host_bound_summary
from llm_attn.harness.stats import format_ratio_interval, paired_ratio_interval
from llm_attn.harness.tp_profile import attach_comm_wait, comm_wait
from llm_attn.harness.tp_table import layer_table, summary_table

ARGS = types.SimpleNamespace(seed=0, warmup=2, repeats=10)
# Issue 36's point: sdpa 93.90 ms, ours 93.35 ms, ten paired repeats with a little drift both share.
SDPA = [93.90 + 0.05 * (i % 3) + 0.01 * i for i in range(10)]
OURS = [93.35 + 0.05 * (i % 3) + 0.01 * i for i in range(10)]


def _profile(span, collectives, layer=()):
    return {"timer": "cuda_kernels", "span_ms": span, "busy_ms": span * 0.9, "comm_ms": sum(collectives),
            "comm_share": sum(collectives) / span, "collectives_ms": list(collectives), "collective_kinds": {},
            "layer": {"index": 16, "kernels": list(layer), "ms": sum(k["ms"] for k in layer)}}


def _rank_result(samples, enqueue, wall, profile, token=(7,)):
    return {"samples_ms": samples, "enqueue_ms": enqueue, "wall_samples_ms": wall, "positions": [0] * len(samples),
            "host_bound": host_bound_summary(samples, enqueue, wall, device_timed=True), "profile": profile,
            "calls": None, "token": list(token), "peak_mem_bytes": 2**30, "order": [["sdpa", "llm_attn"]] * 10}


def _point(degree=2, seq=8192, sdpa=SDPA, ours=OURS, host_bound_rank=0):
    """(res, per_rank) of one point as run_ranks has them: rank 0's results with logits, every rank's gathered."""
    layer = [{"name": "ampere_fp16_s16816gemm_fp16_128x128", "ms": 0.41, "kind": "gemm"},
             {"name": "flash_fwd_kernel", "ms": 0.22, "kind": "attention"},
             {"name": "ncclDevKernel_AllReduce_Sum_f16_RING_LL", "ms": 1.9, "kind": "comm"}]
    per_rank = []
    for k in range(degree):
        ranks = {}
        for impl, samples in (("sdpa", sdpa), ("llm_attn", ours)):
            # The host-bound rank enqueues for almost all of its TTFT; the other rank's collectives wait for it.
            enqueue = [s * (0.97 if k == host_bound_rank else 0.40) for s in samples]
            collectives = [2.0, 2.2, 1.9] if k != host_bound_rank else [0.3, 0.35, 0.3]
            ranks[impl] = _rank_result(samples, enqueue, [s + 0.1 for s in samples],
                                       _profile(samples[0], collectives if degree > 1 else [], layer))
        per_rank.append({"ttft": ranks})
    for impl in ("sdpa", "llm_attn"):
        profiles = attach_comm_wait([p["ttft"][impl]["profile"] for p in per_rank])
        for p, prof in zip(per_rank, profiles):
            p["ttft"][impl]["profile"] = prof
    res = {impl: {**per_rank[0]["ttft"][impl], "logits": torch.zeros(1, 8)} for impl in ("sdpa", "llm_attn")}
    return res, per_rank


def _rows(degree=2, seq=8192, **kw):
    res, per_rank = _point(degree, seq, **kw)
    common = {"schema": "llm_attn.ttft/2", "measurement": "ttft", "experiment": f"tp{degree}", "run_id": f"r{degree}",
              "time": "2026-01-01T00:00:00+00:00", "device": "h100-80gb-hbm3", "model_spec": "llama-3-8b:fp16",
              "model": {"name": "llama-3-8b", "quant": "fp16", "config": None}, "impl": None, "impl_info": None,
              "dtype": "float16", "batch": 1, "seq": seq, "new_tokens": 32,
              "env": {"device_name": "NVIDIA H100 80GB HBM3"}, "command": "torchrun ..."}
    link = {"kind": "NVLink", "links": {"0-1": "NV18"}} if degree > 1 else {"kind": "none (one GPU)", "links": {}}
    tp_common = {"degree": degree, "world_size": degree, "backend": "nccl", "interconnect": link,
                 "local_heads": {"q_heads": 32 // degree, "kv_heads": 8 // degree, "head_dim": 128}}
    ranks_env = [{"rank": k, "device": f"cuda:{k}"} for k in range(degree)]
    return tp.ttft_rows(res, per_rank, ["sdpa", "llm_attn"], common, tp_common, ranks_env, ARGS, "cuda")


def test_ratio_is_reference_over_this_from_the_one_statistics_module():
    rows = _rows()
    ours = next(r for r in rows if r["impl"] == "llm_attn")
    expect = paired_ratio_interval(SDPA, OURS, seed=ARGS.seed)
    assert ours["vs"]["sdpa"] == expect
    assert expect["ratio"] == pytest.approx(93.9 / 93.35, rel=1e-3) and expect["ratio"] > 1  # ours is faster
    cell = format_ratio_interval(expect)
    assert cell.startswith("1.00") and cell.endswith("faster")  # never "0.995x ... faster"
    table = summary_table(rows)
    assert cell in table and "vs sdpa (paired; >1 = faster)" in table
    ours_line = table.splitlines()[3]  # the header, its rule, the base, then ours
    assert "llm_attn" in ours_line and cell in ours_line and "0.99" not in ours_line
    assert f"({cell} vs sdpa)" in tp._one_line(ours["tp"]["ranks"], "llm_attn", ours)


def test_the_main_tables_read_tp_rows_the_same_way():
    """The single-GPU table's cell function (sweep.verdict_cell, used by the report too) gives the same text."""
    from llm_attn.harness.sweep import verdict_cell

    ours = next(r for r in _rows() if r["impl"] == "llm_attn")
    assert verdict_cell(ours, "sdpa", 93.9, 93.35) == format_ratio_interval(ours["vs"]["sdpa"])


def test_slower_reads_below_one():
    rows = _rows(sdpa=OURS, ours=SDPA)
    ours = next(r for r in rows if r["impl"] == "llm_attn")
    assert ours["vs"]["sdpa"]["ratio"] < 1 and format_ratio_interval(ours["vs"]["sdpa"]).endswith("slower")


def test_vs_tp1_is_the_plain_ratio_of_medians():
    rows = _rows(degree=1, sdpa=[100.0] * 10, ours=[96.0] * 10) + _rows(degree=2, sdpa=[62.5] * 10,
                                                                       ours=[60.0] * 10)
    lines = summary_table(rows).splitlines()
    tp2_ours = next(ln for ln in lines if ln.startswith("| 2 ") and "llm_attn" in ln)
    assert "| 1.60x " in tp2_ours  # 96 / 60: TP=2 is 1.60x TP=1, as issue 36 read it at 8k


def test_each_rank_carries_its_host_bound_flag_and_comm_wait():
    rows = _rows(host_bound_rank=1)
    for r in rows:
        ranks = r["tp"]["ranks"]
        assert [k["host_bound"]["host_bound"] for k in ranks] == [False, True]
        assert r["host_bound"]["host_bound"] and r["host_bound"]["rank"] == 1 and r["host_bound"]["ranks"] == [
            False, True]
        # Rank 0 waits at every all-reduce for the host-bound rank 1: its collectives last 2 ms, rank 1's 0.3.
        waits = [k["profile"]["comm_wait_ms"] for k in ranks]
        assert waits[0] == pytest.approx((2.0 - 0.3) + (2.2 - 0.35) + (1.9 - 0.3)) and waits[1] == 0.0
        assert ranks[0]["profile"]["comm_transfer_ms"] == pytest.approx(0.95)
        assert 0 < ranks[0]["profile"]["comm_wait_share"] < 1
    line = summary_table(rows).splitlines()[2]
    assert "| 1 (40%/97%) " in line and "| 5%/0% " in line and "NVLink 0-1:NV18" in line
    from llm_attn.harness.sweep import row_notes

    assert any(n.startswith("host-bound (enqueue 97% of TTFT") for n in row_notes(rows[0]))


def test_comm_wait_is_the_excess_over_the_last_rank_to_arrive():
    got = comm_wait([[5.0, 0.5, 5.0], [0.5, 4.0, 0.5]])
    assert [g["comm_wait_ms"] for g in got] == [9.0, 3.5] and [g["comm_transfer_ms"] for g in got] == [1.5, 1.5]
    bad = comm_wait([[1.0, 1.0], [1.0]])
    assert bad[0]["comm_wait_ms"] is None and "different numbers of collectives (2/1)" in bad[0]["why"]
    assert comm_wait([[], []])[0]["comm_wait_ms"] == 0  # TP=1 or no collectives: no wait


def test_layer_table_puts_ranks_side_by_side():
    row = _rows()[0]
    text = layer_table(row)
    assert text.startswith("layer 16 of llama-3-8b:fp16 at TP=2, batch 1, seq 8192, sdpa")
    assert "| rank 0 ms   | rank 1 ms" in text and "ncclDevKernel_AllReduce_Sum_f16_RING_LL" in text


# torchrun's stderr when rank 0 exits 2 (torch 2.13; the paths shortened).
TORCHRUN_FAILURE = """\
python -m llm_attn.ttft: error: --tp 4: torchrun started 2 processes (WORLD_SIZE=2); start exactly 4 (--nproc-per-node 4)
W1125 22:22:12.571000 3353 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 3436 closing signal SIGTERM
E1125 22:22:12.583000 3353 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 3435) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/usr/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
llm_attn.ttft FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_22:22:12
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 3436)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3436
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_22:22:12
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 3435) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

RANK_TRACEBACK = """\
Traceback (most recent call last):
  File "/work/llm_attn/harness/tp.py", line 200, in run_ranks
    res = measure_point(model, world, impls, prompt, args.warmup, args.repeats, args.seed, log, where)
ValueError: boom in a plugin
"""


def _filtered(text: str) -> tuple[str, tp_launch.ReportFilter]:
    f = tp_launch.ReportFilter("python -m llm_attn.ttft")
    out = [o for line in text.splitlines(keepends=True) for o in f.feed(line)] + f.flush()
    return "".join(out), f


def test_launcher_leaves_torchruns_report_out():
    out, f = _filtered(TORCHRUN_FAILURE)
    assert out.splitlines() == [TORCHRUN_FAILURE.splitlines()[0]]  # the rank's one line, nothing after it
    assert f.rank_error.startswith("python -m llm_attn.ttft: error: --tp 4")
    assert f.root_cause() == (0, 2)
    assert tp_launch._status(-15, 1) == 143


def test_launcher_keeps_a_ranks_own_traceback():
    out, f = _filtered(RANK_TRACEBACK + TORCHRUN_FAILURE.split("\n", 1)[1])
    assert out == RANK_TRACEBACK and f.rank_error is None and f.root_cause() == (0, 2)


def test_report_groups_rows_by_tp_degree():
    """experiments/results/<device>-x2/: the report's series are labelled by TP degree (and interconnect), so the
    TP=1 and TP=2 rows of one point never merge, and '% fp16 peak' counts every GPU of the row."""
    from llm_attn.reporting.merge import _model_label

    rows = _rows(degree=1) + _rows(degree=2)
    labels = {_model_label(r) for r in rows}
    assert labels == {"llama-3-8b (fp16, float16) TP=1", "llama-3-8b (fp16, float16) TP=2 over NVLink"}
