"""Kernel benchmark: our FlashAttention kernel against PyTorch SDPA's backends, measured in the same run.

    python -m llm_attn.bench                                   # Llama 3 8B prefill shape, S = 512 .. 16384
    python -m llm_attn.bench --seqs 2048 4096 --dtypes bf16 --causal 1 --out bench.jsonl
    python -m llm_attn.bench --mode decode --kv 512 2048 8192 32768 --batch 1 4 16
    python -m llm_attn.bench --mode decode --kv 8192 32768 131072 --impls ours ours-fp8kv flash sdpa-fp8kv-copy
    python -m llm_attn.bench --q-len 8192 --seqs 32768 131072 --impls ours ours-fp8kv ours-fp8kv-copy --causal 1
    python -m llm_attn.bench --mode backward --seqs 1024 4096 16384     # training: forward+backward, backward alone
    python -m llm_attn.bench --impls ours flash cudnn naive flex numba --seqs 2048 8192   # registry entries too
    python -m llm_attn.bench --plugin examples/my_attention.py --impls ours mine
    python -m llm_attn.bench --mode host                        # host µs per call: ours, the patch, SDPA
    python -m llm_attn.bench --mode accuracy --seqs 8192 131072  # error vs float64: SDPA bf16, ours, fp8, int8
    python -m llm_attn.bench --impls llm_attn_fp8 cudnn cudnn-fp8 --seqs 16384 65536   # cuDNN's FP8 (needs JAX)
    python -m llm_attn.bench --mode accuracy --capture MODEL --prompts FILE --seqs 2048   # on the model's own Q, K, V

Prefill: B x 32 query heads over 8 KV heads, head_dim 128 (Llama 3 8B), q_len = kv_len = S. FLOPs = 4*B*Hq*S*S*D,
halved when causal; TFLOP/s from the median of CUDA-event timings after warm-up, inputs rotated among several
sets so that short shapes are not timed out of L2.
--q-len N: a chunk of a chunked prefill, q_len = min(N, S) over kv_len = S, causal bottom-right (row i sees
S - N + i + 1 keys; FLOPs counted exactly), where ours-fp8kv times the prefill kernel over the FP8 cache against
ours-fp8kv-copy (its dequantised copy per call, then our kernel) and ours on the unquantised cache (SDPA's is_causal
is top-left, so the SDPA backends run without a mask at q_len < S: a different problem).
Prefill timings are replays of a captured CUDA graph of back-to-back calls over rotating inputs (up to 20,
~2 ms per replay), divided by their number
(kernel time: Python, launch and submission overhead removed for every implementation alike); `--graph 0` times
plain calls.
Decode: q_len = 1 against a KV cache of length S; GB/s counts K and V read once (2*B*Hkv*S*D*bytes), both as plain
launches and replayed inside a CUDA graph.
Backward: q_len = kv_len = S; two phases per point, "fwd+bwd" (forward, then autograd.grad of dq, dk, dv) and "bwd"
(autograd.grad alone on a retained forward graph); FLOPs 3.5x and 2.5x the forward's (the backward's five matmuls
against the forward's two). Plain calls by default (--graph 1 captures them in a CUDA graph).

Host (issue 18): host microseconds to issue one attention call (300 back-to-back calls, no sync inside;
harness/hostcost.py) at the prefill (--seqs, default 2048) and decode (--kv, default 4096) shapes, for our op
(flash_attn_func), ours through the transformers patch wrapper, transformers' sdpa and torch SDPA. Runs on CPU too
(there every call also computes: not a host cost).

Accuracy (issue 34): each implementation's output against float64 on the same inputs (Gaussian, K outlier channels,
peaky queries, both; --kinds), compared on a seeded sample of --rows query rows of every length (harness/accuracy.py
says how the reference stays bounded at 128k): cosine, relative L1, max error, the error as a multiple of SDPA's,
and pass/FAIL per target (cosine >= 0.999, rel L1 <= 0.03 on the outlier inputs). Exit status 1 when a target is
missed. Runs on CPU too (small sizes by default; our paths run their PyTorch references there). --capture MODEL
measures on a model's own attention inputs instead (harness/captured.py: one stock prefill of --seqs tokens, the
first, middle and last layers or --layers; the targets apply there too).

Each row of the JSONL output carries the environment and the command that reproduces it.
"""

from __future__ import annotations

from llm_attn._cli import hold_sigint

hold_sigint(__name__)  # before any other import: a Ctrl-C from here on exits 130 without a traceback

import argparse
import contextlib
import json
import sys
from contextlib import nullcontext

# Only the standard library at import (torch and the harness are imported in main(): fast --help, and a Ctrl-C during
# those imports exits 130 without a traceback). bench_point & co. are re-exported lazily below.
_REEXPORTED = ("BENCH_IMPLS", "DTYPES", "_table_row", "bench_point")


def __getattr__(name):
    if name in _REEXPORTED:
        from llm_attn.harness import kernel_bench  # noqa: PLC0415

        return getattr(kernel_bench, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv=None):
    from llm_attn import registry  # noqa: PLC0415
    from llm_attn._ext import forced_build_problem  # noqa: PLC0415
    from llm_attn.harness.cli_args import (  # noqa: PLC0415
        add_plugin_argument,
        add_verbose_argument,
        apply_verbose,
        fail,
        load_plugins,
        non_negative_int,
        positive_int,
    )
    from llm_attn.harness.accuracy import ACCURACY_IMPLS, DEFAULT_ROWS as ACCURACY_ROWS  # noqa: PLC0415
    from llm_attn.harness.accuracy import DEFAULT_IMPLS as ACCURACY_DEFAULT_IMPLS  # noqa: PLC0415
    from llm_attn.harness.accuracy import KINDS as ACCURACY_KINDS  # noqa: PLC0415
    from llm_attn.harness.kernel_bench import (  # noqa: PLC0415
        BENCH_IMPLS,
        DTYPES,
        _table_row,
        bench_point,
    )

    load_plugins(argv, "python -m llm_attn.bench")
    p = argparse.ArgumentParser(prog="python -m llm_attn.bench", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plugin_argument(p)
    add_verbose_argument(p)
    p.add_argument("--mode", choices=["prefill", "decode", "backward", "host", "accuracy"], default="prefill")
    p.add_argument("--seqs", type=positive_int, nargs="+", default=None,
                   help="prefill: q_len = kv_len = S (default 512 .. 16384; host mode: 2048; accuracy: 1024 .. "
                        "131072 on a GPU, 64 256 on CPU)")
    p.add_argument("--q-len", type=positive_int, default=None,
                   help="prefill: queries per call (a chunk of a chunked prefill: q_len = min(N, S) over S keys; "
                        "default S)")
    p.add_argument("--kv", type=positive_int, nargs="+", default=None,
                   help="decode: KV cache lengths (default 512 2048 8192 32768; host mode: 4096)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1])
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None,
                   help="default: bf16 fp16 (accuracy: bf16)")
    p.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    entries = [n for n in registry.names() if n != "llm_attn"]  # llm_attn is 'ours' here
    p.add_argument("--impls", nargs="+", default=None,
                   choices=BENCH_IMPLS + [i for i in ACCURACY_IMPLS if i not in BENCH_IMPLS] + entries,
                   help="ours-<tile>: our kernel with that prefill tile forced (tuning; 'ours' picks automatically); "
                        "ours-fp8-128, ours-fp8-192, ours-fp8-256: our FP8 kernel with that key tile forced "
                        "(llm_attn_fp8: the default tile); ours-fp8-e4m3qk, ours-fp8-e4m3qk-256, ours-int8qk: with "
                        "e4m3 Q K^T (the default tile, 256 keys), with P V in the input dtype; cudnn-fp8: cuDNN's FP8 "
                        "attention through JAX; "
                        "decode: ours-fp8kv, our decode kernel on the FP8 (e4m3) KV cache, and "
                        "sdpa-fp8kv-copy, SDPA on its dequantised copy made per call (their GB/s: FP8 bytes); "
                        "prefill with --q-len: ours-fp8kv, the prefill kernel over the FP8 cache, and "
                        "ours-fp8kv-copy, our kernel on its dequantised copy made per call; "
                        "flash/cudnn/efficient/math: SDPA backends; any other name: that attention-registry entry's "
                        f"function ({', '.join(entries)}; --plugin adds more). Default: ours flash cudnn efficient; "
                        f"accuracy: {' '.join(ACCURACY_DEFAULT_IMPLS)} (sdpa: the default SDPA backend; ours-fp8, "
                        f"ours-int8: precision='fp8', 'int8'; ours-int8qk: precision='fp8' with P V in the input "
                        f"dtype, as llm_attn_int8qk; fp8-reference: the quantised PyTorch reference)")
    p.add_argument("--warmup", type=non_negative_int, default=5)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--graph", type=int, nargs="+", choices=[0, 1], default=None,
                   help="1: time replays of a captured CUDA graph (kernel time without Python/launch overhead); "
                        "0: plain calls (default: prefill 1, decode 0 and 1)")
    p.add_argument("--calls", dest="repeats_host", type=positive_int, default=300,
                   help="host mode: back-to-back calls timed per path and shape (default 300)")
    p.add_argument("--rounds", dest="host_rounds", type=positive_int, default=15,
                   help="host mode: interleaved rounds, every path once per round in a shuffled order (default 15)")
    p.add_argument("--user-timing", action="store_true",
                   help="host mode: also time each path as a user's script does, in a fresh process: --calls calls "
                        "with no warm-up and wall time to a final sync (cold), then again (warm)")
    p.add_argument("--user-processes", type=positive_int, default=5,
                   help="host mode with --user-timing: fresh processes per path and shape, interleaved in shuffled "
                        "rounds (default 5); the table gives their median [min, max]")
    p.add_argument("--kinds", nargs="+", choices=list(ACCURACY_KINDS), default=list(ACCURACY_KINDS),
                   help="accuracy: input kinds (default: all)")
    p.add_argument("--rows", type=positive_int, default=ACCURACY_ROWS,
                   help=f"accuracy: query rows compared with float64 per point (default {ACCURACY_ROWS}; all when S "
                        "is smaller)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="accuracy: seed of the inputs and sampled rows")
    p.add_argument("--capture", metavar="MODEL",
                   help="accuracy: instead of the synthetic --kinds, a model's own attention inputs (Q, K, V after "
                        "RoPE, captured in one stock prefill of --seqs tokens x --batch; harness/captured.py): a "
                        "preset, a checkpoint folder or a cached hub id, as ttft's --model; heads and head_dim are "
                        "the model's")
    p.add_argument("--layers", nargs="+", type=non_negative_int,
                   help="accuracy with --capture: the attention layers compared (default: first, middle, last)")
    p.add_argument("--prompts", metavar="SOURCE",
                   help="accuracy with --capture: the prefill's text (a .jsonl/.txt/.parquet file or dataset folder, "
                        "as ttft's --prompts; tokenized by the model's tokenizer); default: seeded random token ids")
    p.add_argument("--prompt-field", help="accuracy with --capture --prompts: the text column")
    p.add_argument("--out", help="append JSONL rows here")
    args = p.parse_args(argv)
    apply_verbose(args)
    accuracy = args.mode == "accuracy"
    if not accuracy and args.capture:
        p.error("--capture is for --mode accuracy")
    for flag, val in (("--layers", args.layers), ("--prompts", args.prompts), ("--prompt-field", args.prompt_field)):
        if val is not None and not args.capture:
            p.error(f"{flag} needs --capture MODEL")
    if args.dtypes is None:
        args.dtypes = ["bf16"] if accuracy else ["bf16", "fp16"]
    if args.impls is None:
        args.impls = list(ACCURACY_DEFAULT_IMPLS) if accuracy else ["ours", "flash", "cudnn", "efficient"]
    host = args.mode == "host"
    if args.seqs is None and accuracy:
        import torch  # noqa: PLC0415

        args.seqs = [1024, 8192, 32768, 65536, 131072] if torch.cuda.is_available() else [64, 256]
    if args.seqs is None:
        args.seqs = [2048] if host else [512, 1024, 2048, 4096, 8192, 16384]
    if args.kv is None:
        args.kv = [4096] if host else [512, 2048, 8192, 32768]
    if args.q_len and args.mode != "prefill":
        p.error("--q-len is for --mode prefill (a chunk of a chunked prefill over S keys)")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    problem = forced_build_problem()  # LLM_ATTN_BUILD / LLM_ATTN_BACKEND: misspelt, or forcing a missing build
    if problem:
        fail(p, problem)
    from llm_attn.harness.results import output_file_problem  # noqa: PLC0415

    if args.out and output_file_problem(args.out):
        p.error(f"--out {args.out}: {output_file_problem(args.out)}")
    import torch  # noqa: PLC0415

    if not host and not accuracy and not torch.cuda.is_available():
        p.error("the kernel benchmark needs a CUDA GPU")
    # --out is opened last, after every check: a rejected command leaves no file behind, and a bad path is an
    # argument error before anything is measured.
    try:
        out = open(args.out, "a") if args.out else nullcontext()  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror or e}")
    if host:  # -- --mode host: runs on CPU too (where it says the numbers include compute) --
        with out as f:
            return _host_mode(p, args, f, argv)
    if accuracy:  # -- --mode accuracy: runs on CPU too (small sizes) --
        with out as f:
            return _accuracy_mode(p, args, f, argv)
    graphs = args.graph if args.graph is not None else {"decode": [0, 1], "prefill": [1], "backward": [0]}[args.mode]
    phases = ["fwd+bwd", "bwd"] if args.mode == "backward" else [None]

    from tabulate import tabulate  # noqa: PLC0415

    from llm_attn.envinfo import environment  # noqa: PLC0415

    env = environment()
    command = "python -m llm_attn.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    table = []
    with out as f:
        for dt in args.dtypes:
            for causal in args.causal:
                for b in args.batch:
                    lengths = args.kv if args.mode == "decode" else args.seqs
                    for s, graph, phase in ((s, g, ph) for s in lengths for g in graphs for ph in phases):
                        sq = 1 if args.mode == "decode" else min(args.q_len or s, s)
                        rows = bench_point(args.mode, args.impls, b, args.heads, args.kv_heads, sq, s,
                                           args.head_dim, DTYPES[dt], bool(causal), args.warmup, args.repeats,
                                           graph=bool(graph), phase=phase)
                        for row in rows.values():
                            row.update(env=env, command=command)
                            _write_row(p, args, f, row)
                        t = _table_row(args.mode, rows, dt, causal, b, s, graph, phase)
                        table.append({"q_len": sq, **t} if args.q_len else t)
                        print(_fmt_last(table), flush=True)
    headers = list(table[0].keys())
    print()
    print(tabulate([list(r.values()) for r in table], headers=headers, floatfmt=".2f"))


def _host_mode(p, args, f, argv) -> int:
    """--mode host: µs per call of ours / ours through the patch / transformers' sdpa / torch SDPA
    (harness/hostcost.py), per shape and dtype; rows to --out."""
    import torch  # noqa: PLC0415

    from llm_attn.envinfo import environment  # noqa: PLC0415
    from llm_attn.harness.hostcost import (  # noqa: PLC0415
        HostShape,
        fp8_step_lines,
        host_cost_table,
        measure_host_cost,
        user_timing_table,
    )
    from llm_attn.harness.kernel_bench import DTYPES  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no GPU: on CPU every call also computes, so these are not host costs (they check the benchmark)",
              file=sys.stderr)
    shapes = []
    for b in args.batch:
        shapes += [HostShape(f"prefill {s}" + (f" b{b}" if b > 1 else ""), b, args.heads, args.kv_heads, s, s,
                             args.head_dim) for s in args.seqs]
        shapes += [HostShape(f"decode kv {s}" + (f" b{b}" if b > 1 else ""), b, args.heads, args.kv_heads, 1, s,
                             args.head_dim) for s in args.kv]
    env = environment()
    command = "python -m llm_attn.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    written = 0
    for dt in args.dtypes:
        rows = measure_host_cost(device, DTYPES[dt], shapes=tuple(shapes), calls=args.repeats_host,
                                 warmup=args.warmup, rounds=args.host_rounds, user_timing=args.user_timing,
                                 user_processes=args.user_processes)
        for row in rows:
            row.update(mode="host", env=env, command=command)
            if f:
                _write_row(p, args, f, row)
                written += 1
        build = env.get("kernel_build") or "no"  # the NVRTC build's calls cost the host more (kernels/NOTES.md)
        print(f"\n{dt} on {device}, {build} kernel build: host µs per call, median of {args.host_rounds} interleaved "
              f"rounds of {args.repeats_host} back-to-back calls (no sync inside); in brackets: torch SDPA's µs / this "
              f"path's (>1 = this path costs the host less) [95 % paired interval]")
        print(host_cost_table(rows))
        for line in fp8_step_lines(rows):
            print(line)
        if args.user_timing:
            print(f"\n{dt} on {device}, as a user's script times it ({args.user_processes} fresh processes per "
                  f"path and shape, interleaved; in each, {args.repeats_host} calls under inference_mode, wall time "
                  f"to a final sync; cold: the process's first calls, warm: the next {args.repeats_host}); median "
                  f"[min, max] over the processes, and torch SDPA's warm µs / this path's [95 % paired interval]")
            print(user_timing_table(rows))
    print(f"\n{written} rows appended to {args.out}" if f else
          "\nrows not saved: add --out FILE.jsonl to keep them (one JSON line per path and shape)")
    return 0


def _accuracy_mode(p, args, f, argv) -> int:
    """--mode accuracy: every implementation against float64 per (dtype, causal, batch, kind, S)
    (harness/accuracy.py); rows to --out, the table and the target verdicts printed. 1 when a target was missed."""
    import torch  # noqa: PLC0415

    from llm_attn.envinfo import environment  # noqa: PLC0415
    from llm_attn.harness.accuracy import (  # noqa: PLC0415
        accuracy_line,
        accuracy_point,
        accuracy_table,
        target_summary,
    )
    from llm_attn.harness.kernel_bench import DTYPES  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no GPU: our paths run their PyTorch references (ours-fp8, ours-int8: the quantised references); "
              "SDPA runs PyTorch's CPU kernels", file=sys.stderr)
    env = environment()
    command = "python -m llm_attn.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []

    def emit(got):
        for row in got:
            row.update(env=env, command=command)
            _write_row(p, args, f, row)
        for row in got:
            print(accuracy_line(row), flush=True)
        rows.extend(got)

    if args.capture:
        _accuracy_captured_mode(p, args, device, emit)
    for dt in ([] if args.capture else args.dtypes):
        for causal in args.causal:
            for b in args.batch:
                for kind in args.kinds:
                    for s in args.seqs:
                        emit(accuracy_point(args.impls, kind, batch=b, heads=args.heads, kv_heads=args.kv_heads,
                                            seq=s, head_dim=args.head_dim, dtype=DTYPES[dt], causal=bool(causal),
                                            device=device, rows=args.rows, seed=args.seed))
    shape = (f"{args.capture}'s own heads and head_dim" if args.capture else
             f"{args.heads}/{args.kv_heads} heads, hd{args.head_dim}")
    print(f"\nerror against float64 on {device} (B={args.batch}, {shape}; up to {args.rows} sampled query rows per "
          f"point; rel L1 / sdpa's: this row's relative L1 error over SDPA's at the same point, > 1 = larger error "
          f"than SDPA's)")
    print(accuracy_table(rows))
    text, misses = target_summary(rows)
    print("\n" + text)
    return 1 if misses else 0


def _accuracy_captured_mode(p, args, device: str, emit) -> None:
    """--mode accuracy --capture MODEL: per dtype, batch and length one stock prefill of the model, each captured
    layer's inputs through every implementation against float64 (``accuracy_captured``). A model or prompt source
    that cannot be used is one line and exit status 2, before anything is measured."""
    import torch  # noqa: PLC0415

    from llm_attn.harness.accuracy import accuracy_captured  # noqa: PLC0415
    from llm_attn.harness.captured import capture_qkv, default_layers  # noqa: PLC0415
    from llm_attn.harness.kernel_bench import DTYPES  # noqa: PLC0415
    from llm_attn.harness.prompts import PromptsError  # noqa: PLC0415
    from llm_attn.harness.session import dataset_prompts_for, load_prompt_texts  # noqa: PLC0415
    from llm_attn.models import load_model  # noqa: PLC0415

    try:
        texts = load_prompt_texts(args.prompts, args.prompt_field, None) if args.prompts else None
    except PromptsError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    for dt in args.dtypes:
        try:
            model, info = load_model(args.capture, device=device, dtype=DTYPES[dt])
            prompts = dataset_prompts_for(model, info, args.prompts, texts, args.prompt_field)
        except Exception as e:  # noqa: BLE001 (a model that does not load: one line, as ttft says it)
            p.exit(2, f"{p.prog}: error: --capture {args.capture}: {str(e).splitlines()[0] if str(e) else ''} "
                      f"({type(e).__name__})\n")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n_layers = getattr(cfg, "num_hidden_layers", None)
        layers = args.layers if args.layers is not None else default_layers(n_layers) if n_layers else None
        if n_layers and layers and max(layers) >= n_layers:
            p.exit(2, f"{p.prog}: error: --layers {max(layers)}: {args.capture} has {n_layers} layers "
                      f"(0..{n_layers - 1})\n")
        limit = getattr(cfg, "max_position_embeddings", None)
        for b in args.batch:
            for s in args.seqs:
                if limit and s > limit:
                    print(f"skipping S={s}: {args.capture} has {limit} positions", file=sys.stderr)
                    continue
                if prompts is not None:
                    ids = prompts.batch(b, s)
                    source = f"{args.capture} on {args.prompts}"
                else:
                    gen = torch.Generator().manual_seed(args.seed)
                    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
                    source = f"{args.capture} on random token ids (seed {args.seed})"
                for layer in capture_qkv(model, ids.to(model.device), layers):
                    st = layer.stats()
                    print(f"{source}, S={s}, layer {layer.layer}: |q| <= {st['q_absmax']:.3g}, |k| <= "
                          f"{st['k_absmax']:.3g}, strongest K channel bias {st['k_bias_over_spread']:.3g}x K's "
                          f"spread, score std {st['score_std']:.3g}", flush=True)
                    emit(accuracy_captured(args.impls, layer, source=source, rows=args.rows, seed=args.seed))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def _write_row(p, args, f, row: dict) -> None:
    """One JSONL row to --out (nothing without it); a write that fails (e.g. a full disk) is one line, exit 2."""
    if not f:
        return
    try:
        f.write(json.dumps(row) + "\n")
        f.flush()
    except OSError as e:
        with contextlib.suppress(OSError):
            f.close()  # closes even when the buffered line cannot be flushed
        p.exit(2, f"{p.prog}: error: --out {args.out}: cannot write: {e.strerror or e}\n")


def _fmt_last(table):
    r = table[-1]
    return "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C, also during main()'s imports: exit 130 and one line, no traceback
