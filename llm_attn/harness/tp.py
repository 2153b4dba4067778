"""Tensor-parallel TTFT: ``python -m llm_attn.ttft --tp N`` on torch.distributed and transformers' TP plans.

Launch, either way (the same code runs):

    python -m llm_attn.ttft --tp 2 --model llama-3-8b:fp16 --seq 2048 8192 --measure ttft ttft_graph   # starts torchrun
    torchrun --nproc-per-node 2 -m llm_attn.ttft --tp 2 --model llama-3-8b:fp16 --seq 2048 8192

The pieces, one module each (imports flow down this list, never up):

    tp.py            this file: the launcher's checks (``main``), the body of every rank (``run_ranks``), the rows
    tp_table.py      the tables: TTFT with what explains it, the kernels of one layer on each rank
    tp_measure.py    paired TTFT and paired graph TTFT at one point, on one rank
    tp_profile.py    one profiled prefill per rank: rank time, collectives, the wait inside them, one layer's kernels
    tp_world.py      the process group (``World``) and the sharded model (``load_sharded``, ``local_heads``)
    tp_launch.py     starting torchrun, its failure report kept out of the way
    tp_preflight.py  every check made before anything loads (``TPError``: one line, exit 2)
    tp_topology.py   each rank's identity and the interconnect, from ``nvidia-smi topo -m``

Outside torchrun (no ``WORLD_SIZE``/``RANK``), ``--tp N`` checks its arguments in this process (``preflight``: one line
and exit 2 for KV heads not divisible by N, an implementation that cannot run on a head shard, an AWQ int4
checkpoint at N > 1, fewer GPUs than N, a model that is neither a preset nor a local folder), writes a preset's
synthetic checkpoint if it is not cached (in a child process; free disk checked first; an interrupted write resumes)
and then starts torchrun (``tp_launch.launch``), whose status it returns. Under torchrun every rank checks the same
things again (plus WORLD_SIZE == N) before anything is loaded. Under a torchrun started by hand, a rank that finds
bad input prints the one line first and exits 2: torchrun then adds its own report of the failed rank, which no rank
can prevent (a user error must not exit 0, which scripts read as success); ``python -m llm_attn.ttft --tp N`` starts
torchrun itself and leaves that report out.

Every rank then joins the process group (NCCL, one GPU per rank = LOCAL_RANK; gloo on CPU), loads the model sharded
by transformers' plan (each rank holds Hq/N query and Hkv/N KV heads, and its attention function sees exactly
those), and per (batch, seq), shortest prompts first (so a length that runs out of memory stops the run after the
shorter ones are recorded):

- ``ttft``: paired TTFT (``tp_measure.measure_point``): every repeat runs each implementation once in a seeded
  shuffled order, all ranks starting together; the sample is rank 0's time until the first token; every rank keeps
  its own device, enqueue and wall times and its host-bound flag; one profiled prefill per implementation and rank
  gives the rank's time, its collectives and the share of its time spent *waiting* in them (``tp_profile``);
- ``ttft_graph`` (when asked for): the same prefill captured in a CUDA graph on every rank and replayed, paired
  (``tp_measure.measure_graph_point``); CUDA only: on CPU its rows are ``unsupported`` with the reason.

Rank 0 writes one row per (measurement, implementation, batch, seq): the TP degree, world size, backend,
interconnect, per rank its environment, samples, host-bound summary and profile; the paired record and ``vs``
(``paired.paired_verdicts``: median(base) / median(this), > 1 = this is faster, as on one GPU) against the base
implementation (sdpa); the first token. It prints one line per finished point and the table
(``tp_table.summary_table``) last. A rank that runs out of memory writes its point's ``oom`` row, says so in one line
and exits 1; torchrun then ends the others.

Models under ``--tp``: a preset (a bare name or ``:fp16`` is the fp16 checkpoint; ``:awq`` at TP=1 only; ``:init``
is a config-only skeleton whose weights transformers initialises at load on each rank's shard, for models whose
checkpoint does not fit the disk, e.g. ``llama-3-70b:init``: its weights differ between TP degrees, so compare first
tokens only within one degree) or a local checkpoint folder. AWQ int4 checkpoints are refused under TP > 1:
gptqmodel's QuantLinear keeps qweight/qzeros/scales as buffers, transformers' ``apply_tensor_parallelism`` shards
parameters only, so every rank keeps the whole int4 weight and the row-wise layers fail ("mixed torch.Tensor and
DTensor").
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback
import uuid
from datetime import datetime, timezone

from llm_attn.harness.impls import BASE_IMPL
from llm_attn.harness.paired import paired_verdicts
from llm_attn.harness.stats import format_ratio_interval, summarize
from llm_attn.harness.tp_launch import launch
from llm_attn.harness.tp_preflight import TPError, prepare_checkpoint, preflight
from llm_attn.harness.tp_topology import interconnect, rank_env, under_torchrun

# What --tp measures; the other measurements are skipped with a line saying so.
TP_MEASUREMENTS = ("ttft", "ttft_graph")
EXIT_STOPPED = 1  # a point ran out of memory on some rank: its row is written and the run stops


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _device(choice: str, parser, resolve) -> str:
    try:
        return resolve(choice)
    except ValueError as e:
        parser.error(f"--device {choice}: {e}")


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "remote process exited",
              "NCCL communicator was aborted", "Broken pipe")


def _peer_lost(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST)


def _one_line(ranks: list[dict], impl: str, row: dict) -> str:
    """The line printed when a row is written: TTFT, the verdict vs the base, host-bound ranks, comm wait."""
    vs = next(iter((row.get("vs") or {}).values()), None)
    text = f"{impl} {row['stats']['p50']:.2f} ms" + (f" ({format_ratio_interval(vs)} vs sdpa)" if vs else "")
    if row["measurement"] == "ttft":
        hb = [str(k["rank"]) for k in ranks if (k.get("host_bound") or {}).get("host_bound")]
        waits = [k["profile"].get("comm_wait_share") for k in ranks]
        text += f"; host-bound ranks: {','.join(hb) or 'none'}"
        if any(w is not None for w in waits):
            text += "; comm wait " + "/".join("-" if w is None else f"{100 * w:.0f}%" for w in waits)
    return text


def run_ranks(args, parser, plugins: list[str], argv: list[str] | None) -> int:
    """The body every torchrun rank runs for ``--tp N``."""
    import torch  # noqa: PLC0415

    from llm_attn.envinfo import capture_env  # noqa: PLC0415
    from llm_attn.harness.impls import available_impls, impl_info  # noqa: PLC0415
    from llm_attn.harness.measure import GraphCaptureUnsupported  # noqa: PLC0415
    from llm_attn.harness.results import SCHEMA, ResultWriter, jsonable, output_file_problem  # noqa: PLC0415
    from llm_attn.harness.session import default_dtype, resolve_device  # noqa: PLC0415
    from llm_attn.harness.sweep import DTYPES, make_prompt  # noqa: PLC0415
    from llm_attn.harness.tp_measure import OOM_ERRORS, measure_graph_point, measure_point  # noqa: PLC0415
    from llm_attn.harness.tp_profile import attach_comm_wait  # noqa: PLC0415
    from llm_attn.harness.tp_table import summary_table  # noqa: PLC0415
    from llm_attn.harness.tp_world import World, load_sharded, local_heads  # noqa: PLC0415

    rank = int(os.environ["RANK"])

    def fail(msg: str) -> int:
        if rank == 0:
            print(f"{parser.prog}: error: {msg}", file=sys.stderr, flush=True)
        # Started by hand, torchrun adds its own report of the failed rank after this line (module docstring).
        return 2

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    device_type = _device(args.device, parser, resolve_device)
    impls = args.impl or available_impls(device_type)
    if BASE_IMPL in impls:  # the base first: the paired ratios are against it
        impls = [BASE_IMPL] + [i for i in impls if i != BASE_IMPL]
    dtype_name = args.dtype if args.dtype != "auto" else default_dtype(args.model, device_type)
    dtype = DTYPES[dtype_name]
    try:
        preflight(args.tp, args.model, impls, device_type, dtype, world_size=int(os.environ["WORLD_SIZE"]),
                  seqs=args.seq)
    except TPError as e:
        return fail(str(e))
    if output_file_problem(args.out):  # every rank: a rank that went on alone would wait for the others
        return fail(f"--out {args.out}: {output_file_problem(args.out)}")
    measures = [m for m in args.measure if m in TP_MEASUREMENTS] or ["ttft"]
    skipped = [m for m in args.measure if m not in TP_MEASUREMENTS]
    if skipped:
        log(f"--tp: measures {' and '.join(TP_MEASUREMENTS)} (paired, with each rank's host-bound flag and comm "
            f"wait); not measured: {' '.join(skipped)}")

    world = World(device_type)
    try:
        try:
            model, info = load_sharded(args.model, world, dtype)
        except TPError as e:  # raised on every rank alike (checkpoint_path agrees first): a clean close
            world.close()
            return fail(str(e))
        heads = local_heads(model)
        geo = info["config"]
        if geo["num_key_value_heads"] % world.world:
            world.close()
            return fail(f"--tp {args.tp}: {geo['num_key_value_heads']} KV heads not divisible by {args.tp}")
        seqs = sorted(args.seq or [s for s in (512, 1024, 2048) if s <= geo["max_position_embeddings"]])
        ranks_env = world.gather(rank_env(world.device, world.backend))
        link = world.from_rank0(interconnect(device_type, world.world) if rank == 0 else None)
        env = capture_env(str(world.device) if device_type == "cuda" else "cpu")
        log(f"model: {info['name']} ({info['quant']}, {info['source']}) sharded over {world.world} ranks "
            f"({world.backend}, {link['kind']}); per rank {heads['q_heads']} query / {heads['kv_heads']} KV heads")
        run_id = world.from_rank0(uuid.uuid4().hex[:12])
        experiment = args.experiment or f"tp{args.tp}"
        command = shlex.join(["torchrun", f"--nproc-per-node={args.tp}", "-m", "llm_attn.ttft",
                              *(sys.argv[1:] if argv is None else argv)])
        tp_common = {"degree": args.tp, "world_size": world.world, "backend": world.backend, "interconnect": link,
                     "local_heads": heads}

        def common(measurement: str, impl: str | None, batch: int, seq: int) -> dict:
            return {"schema": SCHEMA, "measurement": measurement, "experiment": experiment, "run_id": run_id,
                    "time": _now(), "device": env["device_slug"], "model_spec": args.model, "model": info,
                    "impl": impl, "impl_info": impl_info(impl) if impl else None, "dtype": dtype_name, "batch": batch,
                    "seq": seq, "new_tokens": args.new_tokens, "env": env, "command": command}

        rows = []
        writer = ResultWriter(args.out) if rank == 0 else None
        try:
            for batch in args.batch:
                for seq in seqs:
                    log(f"TP={args.tp} batch={batch} seq={seq}: {' '.join(impls)} ({' '.join(measures)})")
                    prompt = make_prompt(geo["vocab_size"], batch, seq, args.seed, world.device)
                    point, where = None, {"impl": impls[0]}
                    try:
                        res = gres = None
                        gfailed = {}
                        if "ttft" in measures:
                            point = "ttft"
                            res = measure_point(model, world, impls, prompt, args.warmup, args.repeats, args.seed,
                                                log, where)
                        if "ttft_graph" in measures:
                            point = "ttft_graph"
                            try:
                                gres, gfailed = measure_graph_point(model, world, impls, prompt, args.warmup,
                                                                    args.repeats, args.seed, log, where)
                            except GraphCaptureUnsupported as e:
                                gres, gfailed = {}, dict.fromkeys(impls, str(e))
                    except OOM_ERRORS as e:
                        # The other ranks are inside a collective this rank will never reach: write this point's
                        # row, say so, and leave; torchrun ends the others.
                        row = {**common(point, where["impl"], batch, seq), "kind": "error", "status": "oom",
                               "error": f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                               "tp": tp_common}
                        with ResultWriter(args.out) as w:
                            w.write(jsonable(row))
                        print(f"{parser.prog}: error: --tp {args.tp}: rank {rank} ran out of memory at batch {batch} "
                              f"seq {seq} ({point}, {where['impl']}); its row is in {args.out} and the run stops "
                              f"there (shorter prompts are recorded)", file=sys.stderr, flush=True)
                        sys.stdout.flush()
                        os._exit(EXIT_STOPPED)
                    mine = {}
                    if res is not None:
                        mine["ttft"] = {i: {k: v for k, v in r.items() if k != "logits"} for i, r in res.items()}
                    if gres is not None:
                        mine["ttft_graph"] = gres
                    per_rank = world.gather(mine)
                    if res is not None:
                        for impl in impls:
                            profiles = attach_comm_wait([p["ttft"][impl]["profile"] for p in per_rank])
                            for p, prof in zip(per_rank, profiles):
                                p["ttft"][impl]["profile"] = prof
                    if rank != 0:
                        continue
                    new = []
                    if res is not None:
                        new += ttft_rows(res, per_rank, impls, common("ttft", None, batch, seq), tp_common,
                                         ranks_env, args, device_type)
                    if gres is not None:
                        new += graph_rows(per_rank, impls, gfailed, common("ttft_graph", None, batch, seq), tp_common,
                                          ranks_env, args)
                    for row in new:
                        row = jsonable(row)
                        writer.write(row)
                        rows.append(row)
                        if row["status"] == "ok":
                            log(f"  {row['measurement']}: "
                                + _one_line(row["tp"]["ranks"], row["impl"], row))
                        else:
                            log(f"  {row['measurement']} {row['impl']}: {row['status']}: {row['error']}")
        finally:
            if writer is not None:
                writer.close()
        world.barrier()
        if rank == 0:
            print(summary_table(rows))
            print(f"\n{len(rows)} rows appended to {args.out}")
    except BaseException as e:
        # Another rank may be inside a collective this one will never reach: closing the group (or anything else
        # collective) would wait for it for good. Say what happened and leave; torchrun ends the other ranks.
        if _peer_lost(e):  # the consequence of another rank's failure, whose own output says what it was
            print(f"rank {rank}: stopped: a peer rank left ({str(e).splitlines()[0][:160]})", file=sys.stderr)
        elif not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)
    world.close()
    return 0


def ttft_rows(res: dict, per_rank: list[dict], impls: list[str], common: dict, tp_common: dict, ranks_env: list[dict],
              args, device_type: str) -> list[dict]:
    """Rank 0's ``ttft`` rows of one point: ``res`` is rank 0's ``measure_point`` result, ``per_rank`` every rank's
    (gathered, profiles with ``attach_comm_wait``), ``common`` the fields every row of the point shares (``impl``
    and ``impl_info`` are filled in here). ``vs`` comes from ``paired.paired_verdicts``, as on one GPU."""
    from llm_attn.harness.impls import impl_info  # noqa: PLC0415

    base_impl = BASE_IMPL
    order = res[impls[0]]["order"]
    record = {"impls": impls, "seed": args.seed, "order": order,
              "samples_ms": {i: res[i]["samples_ms"] for i in impls},
              "enqueue_ms": {i: res[i]["enqueue_ms"] for i in impls},
              "wall_ms": {i: res[i]["wall_samples_ms"] for i in impls}, "python_gc": "off while timing",
              "timed_on": "rank 0 (every rank's own samples are in tp.ranks)"}
    rows = []
    for impl in impls:
        mine = res[impl]
        ranks = [{**ranks_env[k], "samples_ms": p["ttft"][impl]["samples_ms"],
                  "enqueue_samples_ms": p["ttft"][impl]["enqueue_ms"],
                  "wall_samples_ms": p["ttft"][impl]["wall_samples_ms"],
                  "stats": summarize(p["ttft"][impl]["samples_ms"]), "host_bound": p["ttft"][impl]["host_bound"],
                  "profile": p["ttft"][impl]["profile"], "attention_calls": p["ttft"][impl]["calls"],
                  "first_token": p["ttft"][impl]["token"], "peak_mem_bytes": p["ttft"][impl]["peak_mem_bytes"]}
                 for k, p in enumerate(per_rank)]
        worst = max(range(len(ranks)), key=lambda k: ranks[k]["host_bound"].get("enqueue_share") or 0.0)
        row = {**common, "impl": impl, "impl_info": impl_info(impl), "kind": "ttft", "status": "ok",
               "samples_ms": mine["samples_ms"], "stats": summarize(mine["samples_ms"]),
               "wall_samples_ms": mine["wall_samples_ms"], "enqueue_samples_ms": mine["enqueue_ms"],
               "timer": "cuda_event" if device_type == "cuda" else "perf_counter", "warmup": args.warmup,
               "repeats": args.repeats, "peak_mem_bytes": mine["peak_mem_bytes"], "model_flops": None,
               "first_token": mine["token"], "attention_calls": mine["calls"],
               # The row's flag, as on one GPU (the table's notes read it): the rank whose host took the largest
               # share of its TTFT; host_bound is set when any rank is host-bound.
               "host_bound": {**ranks[worst]["host_bound"], "rank": worst,
                              "host_bound": any(k["host_bound"]["host_bound"] for k in ranks),
                              "ranks": [k["host_bound"]["host_bound"] for k in ranks]},
               "paired": {**record, "positions": mine["positions"]},
               "tp": {**tp_common, "ranks": ranks}}
        if impl != base_impl and base_impl in res:
            row["vs"] = paired_verdicts(row, [base_impl], seed=args.seed)
            row["max_abs_logit_diff_vs_base"] = float((mine["logits"] - res[base_impl]["logits"]).abs().max())
        rows.append(row)
    return rows


def graph_rows(per_rank: list[dict], impls: list[str], failed: dict, common: dict, tp_common: dict,
               ranks_env: list[dict], args) -> list[dict]:
    """Rank 0's ``ttft_graph`` rows of one point (``tp_measure.measure_graph_point`` on every rank): measured, or
    ``unsupported`` with the reason."""
    from llm_attn.harness.impls import impl_info  # noqa: PLC0415

    base_impl = BASE_IMPL
    graphs = per_rank[0]["ttft_graph"]
    captured = [i for i in impls if i in graphs]
    rows = []
    for impl in impls:
        if impl not in graphs:
            rows.append({**common, "impl": impl, "impl_info": impl_info(impl), "kind": "error", "status": "unsupported",
                         "error": failed.get(impl, "not captured"), "tp": tp_common})
            continue
        mine = graphs[impl]
        record = {"impls": captured, "seed": args.seed, "order": mine["order"],
                  "samples_ms": {i: graphs[i]["samples_ms"] for i in captured},
                  "python_gc": "off while timing", "timed_on": "rank 0"}
        ranks = [{**ranks_env[k], "samples_ms": p["ttft_graph"][impl]["samples_ms"],
                  "stats": summarize(p["ttft_graph"][impl]["samples_ms"]),
                  "first_token": p["ttft_graph"][impl]["token"],
                  "attention_kernels": p["ttft_graph"][impl]["attention_kernels"],
                  "peak_mem_bytes": p["ttft_graph"][impl]["peak_mem_bytes"]} for k, p in enumerate(per_rank)]
        row = {**common, "impl": impl, "impl_info": impl_info(impl), "kind": "ttft_graph", "status": "ok",
               "samples_ms": mine["samples_ms"], "stats": summarize(mine["samples_ms"]), "timer": "cuda_event",
               "mode": "cuda_graph_dynamic_cache", "cache": "dynamic", "warmup": args.warmup, "repeats": args.repeats,
               "attention_kernels": mine["attention_kernels"], "peak_mem_bytes": mine["peak_mem_bytes"],
               "first_token": mine["token"], "first_tokens": mine["token"],
               "paired": {**record, "positions": mine["positions"]}, "tp": {**tp_common, "ranks": ranks}}
        if impl != base_impl and base_impl in graphs:
            row["vs"] = paired_verdicts(row, [base_impl], seed=args.seed)
        rows.append(row)
    return rows


def main(args, parser, plugins: list[str], argv: list[str] | None) -> int:
    """``--tp N`` of ``python -m llm_attn.ttft``: start torchrun (outside it) or run this rank (inside it)."""
    from llm_attn.harness.impls import available_impls  # noqa: PLC0415
    from llm_attn.harness.results import output_file_problem  # noqa: PLC0415
    from llm_attn.harness.session import default_dtype, resolve_device  # noqa: PLC0415
    from llm_attn.harness.sweep import DTYPES  # noqa: PLC0415

    if under_torchrun():
        return run_ranks(args, parser, plugins, argv)
    device_type = _device(args.device, parser, resolve_device)
    impls = args.impl or available_impls(device_type)
    dtype = DTYPES[args.dtype if args.dtype != "auto" else default_dtype(args.model, device_type)]
    if args.resume:
        parser.error("--resume: not supported with --tp (each --tp run measures every point it is given)")
    if output_file_problem(args.out):
        parser.error(f"--out {args.out}: {output_file_problem(args.out)}")
    if "ttft_graph_static" in args.measure:
        parser.error("--measure ttft_graph_static: not supported with --tp (a StaticCache is sized for the whole "
                     "model's KV heads, not a rank's shard); use ttft_graph")
    try:
        preflight(args.tp, args.model, impls, device_type, dtype, seqs=args.seq)
        prepare_checkpoint(args.model)
    except TPError as e:
        parser.error(str(e))
    return launch(args.tp, list(sys.argv[1:] if argv is None else argv), prog=parser.prog)
