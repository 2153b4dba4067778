"""Time-to-first-token and decode speed of an LLM, stock attention implementations against ours.

    python -m llm_attn.ttft                       # defaults: every implementation available here
    python -m llm_attn.ttft --seq 2048            # on a GPU: synthetic Llama 3 8B AWQ int4, fp16
    python -m llm_attn.ttft --seq 512 2048 8192 --impl sdpa llm_attn --repeats 20 --out runs/h100.jsonl
    python -m llm_attn.ttft --model /models/Meta-Llama-3-8B-Instruct-AWQ --seq 1024 --batch 1 4
    python -m llm_attn.ttft --plugin examples/my_attention.py --impl mine sdpa llm_attn --seq 2048
    python -m llm_attn.ttft --impl sdpa llm_attn --seq 2048 8192 --measure ttft breakdown
    python -m llm_attn.ttft --seq 2048 --prompts prompts.jsonl    # dataset text, cut or repeated to 2048 tokens
    python -m llm_attn.ttft --seq dataset --prompts prompts.jsonl # its own lengths: TTFT p50 / p90 over prompts
    python -m llm_attn.ttft --seq 131072 --prefill-chunk 8192 --measure ttft   # the prompt in 16 chunks of 8192
    python -m llm_attn.ttft --seq 8192 --kv-cache fp8 --measure ttft decode_generate  # on the FP8 KV cache

Without ``--model`` (``auto``) a GPU gets the synthetic Llama 3 8B AWQ checkpoint (exact geometry, seeded int4
weights, loaded through a real AWQ loader; generated once and cached) and a machine without a GPU gets a tiny
Llama-architecture model on CPU, where our attention runs through the PyTorch reference.

Per implementation and prompt length it measures (``--measure`` picks):
  ttft             prefill of exactly --seq tokens + greedy first token; CUDA events; p50/p90/min/stdev%
  decode_generate  tokens 2..N of model.generate (default cache), each timed as it reaches the host
  decode_graph     the same decode kernel-limited: StaticCache + one step replayed from a CUDA graph
  correctness      every non-stock implementation vs stock sdpa: max |logit diff| at the last prompt
                   position, greedy-token agreement
  breakdown        (only when asked for) one prefill under torch.profiler: attention / GEMM / quantised
                   weights / other kernels / GPU idle, and TTFT if attention took 0 ms
and prints a llama-bench-like table with speedups. Every measurement is appended to --out as one JSON line
(raw samples, statistics, environment, model, and the command that reproduces it) the moment it finishes; an
out-of-memory or failing point is recorded as such and the sweep goes on. ``--resume`` skips points already in
--out. Exit status: 0 when every point was measured or ran out of memory, 1 when a point failed otherwise,
2 for bad arguments or a model that cannot be loaded, 130 on Ctrl-C.
"""

from __future__ import annotations

from llm_attn._cli import hold_sigint

hold_sigint(__name__)  # before any other import: a Ctrl-C from here on exits 130 without a traceback

import argparse
import dataclasses
import sys
import time

# Only the standard library at import: torch, transformers and the harness are imported in build_parser() and
# main(), so that --help is fast and a Ctrl-C during those imports exits 130 without a traceback (see the end).

DEFAULT_OUT = "ttft-results.jsonl"


def seq_length(text: str) -> int | str:
    """A --seq value: a positive token count, or 'dataset' (the --prompts dataset's own lengths)."""
    from llm_attn.harness.cli_args import positive_int  # noqa: PLC0415

    return "dataset" if text == "dataset" else positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    from llm_attn import registry  # noqa: PLC0415
    from llm_attn.harness.cli_args import (  # noqa: PLC0415
        add_plugin_argument,
        add_verbose_argument,
        at_least_two,
        non_negative_int,
        positive_int,
    )
    from llm_attn.harness.devices import DEFAULT_TABLE  # noqa: PLC0415
    from llm_attn.harness.results import KV_CACHES  # noqa: PLC0415
    from llm_attn.harness.sweep import ALL_MEASUREMENTS, DEFAULT_MEASUREMENTS, DTYPES  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m llm_attn.ttft", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    names = registry.names()
    p.add_argument("--model", default="auto",
                   help="'auto' (synthetic Llama 3 8B AWQ on a GPU, tiny fp16 model on CPU), a preset "
                        "(llama-3-8b, tiny; ':awq' or ':fp16' picks the format), a local checkpoint folder, or a "
                        "Hugging Face hub id already in the local cache (nothing is downloaded)")
    p.add_argument("--seq", type=seq_length, nargs="+", default=None, metavar="N",
                   help="prompt length(s) in tokens (default: 512 1024 2048 on a GPU, 32 64 on CPU); 'dataset' "
                        "(with --prompts): the dataset's own lengths, reported as TTFT p50 and p90 over its prompts")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1], metavar="B", help="batch size(s)")
    p.add_argument("--impl", nargs="+", choices=names, default=None, metavar="IMPL",
                   help=f"attention implementations, from {{{', '.join(names)}}} (the registry, with --plugin's; "
                        "default: the stock ones available here, then llm_attn)")
    add_plugin_argument(p)
    # -- prompts from a dataset (harness/prompts.py) --
    p.add_argument("--prompts", default=None, metavar="PATH",
                   help="prompt text from a dataset instead of random ids: a local .json/.jsonl/.parquet/.csv file, "
                        "a save_to_disk folder, or a dataset in the local Hugging Face cache (nothing is downloaded; "
                        "needs the 'prompts' extra). Tokenized with the model's tokenizer, cut or repeated to --seq")
    p.add_argument("--prompt-field", default=None, metavar="NAME",
                   help="the text column of --prompts (default: text, content, prompt, document, question, or the "
                        "first string column)")
    p.add_argument("--prompt-count", type=positive_int, default=100, metavar="N",
                   help="at most this many texts of --prompts are used (default 100)")
    # -- end prompts --
    p.add_argument("--new-tokens", type=at_least_two, default=32, metavar="N",
                   help="tokens generated in the decode and correctness measurements (default 32)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="activation dtype (default: float16 on a GPU, float32 on CPU except for ':awq' presets)")
    p.add_argument("--warmup", type=non_negative_int, default=3,
                   help="untimed TTFT runs at the exact shape before timing (default 3); decode gets one "
                        "untimed generate when > 0")
    p.add_argument("--repeats", type=positive_int, default=20,
                   help="timed TTFT runs per implementation, paired (default 20)")
    p.add_argument("--decode-repeats", type=positive_int, default=5,
                   help="timed decode runs per implementation, paired like TTFT (default 5)")
    p.add_argument("--context", type=positive_int, nargs="+", default=None, metavar="N",
                   help="decode_graph decodes with N tokens in the KV cache (the prompt's keys and values repeated "
                        "after its prefill): decode at 8k or 32k context without a long prefill; several N: one "
                        "decode_graph point per N, the other measurements once (default: the prompt's length)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="run every prompt in chunks of N tokens against the growing KV cache (each chunk causal "
                        "over everything cached; activations scale with N, not the prompt) in ttft, both decodes' "
                        "prefills and ttft_graph; rows carry the chunk (default: the whole prompt in one forward)")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="fp16",
                   help="the KV cache of ttft, both decodes, ttft_graph and correctness: fp16, transformers' own in "
                        "the model's dtype, or fp8, the FP8 (e4m3) cache of llm_attn.models.kv_cache: stock attention "
                        "reads it through a dequantised copy (the honest baseline), llm_attn reads its bytes (the "
                        "FP8-cache decode kernel for decode steps; the prompt or its chunks through the prefill "
                        "kernel, or on sm_90 the one-launch copy: LLM_ATTN_FP8KV_PREFILL); correctness compares each "
                        "implementation on it, stock included, with stock on the unquantised cache; decode_graph "
                        "captures stock's steps on it too (a copy of the whole capacity under transformers' causal "
                        "mask), ttft_graph cannot capture it ('unsupported' on a GPU); rows carry kv_cache and how "
                        "attention read it (default: fp16)")
    p.add_argument("--measure", nargs="+", choices=ALL_MEASUREMENTS, default=list(DEFAULT_MEASUREMENTS), metavar="M",
                   help=f"which measurements to run, from {{{', '.join(ALL_MEASUREMENTS)}}} (default: "
                        f"{' '.join(DEFAULT_MEASUREMENTS)})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSONL file rows are appended to (default {DEFAULT_OUT})")
    p.add_argument("--resume", action="store_true", help="skip points that already have a row in --out")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--allow-dequant-fallback", action="store_true",
                   help="when no AWQ int4 backend is installed, run the AWQ checkpoint with dequantised fp16 "
                        "weights (marked as such in every output) instead of stopping")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random prompts")
    p.add_argument("--devices", default=str(DEFAULT_TABLE), help="device datasheet table (TOML)")
    p.add_argument("--experiment", default=None, help=argparse.SUPPRESS)  # set by llm_attn.experiment
    p.add_argument("--tp", type=positive_int, default=None, metavar="N",
                   help="tensor parallelism over N ranks (transformers' TP plan on torch.distributed; starts "
                        "torchrun itself unless already under it); paired TTFT, and graph TTFT with --measure "
                        "ttft_graph. See llm_attn/harness/tp.py")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are also off when stderr is not a terminal)")
    p.add_argument("--wide", action="store_true",
                   help="print every column of the summary table (p90, stdev, decode tok/s, peak memory, ...); by "
                        "default it is at most 120 characters wide: TTFT p50, its verdict vs stock, notes")
    add_verbose_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from llm_attn._ext import forced_build_problem  # noqa: PLC0415
    from llm_attn.harness import session  # noqa: PLC0415
    from llm_attn.harness.cli_args import apply_verbose, fail, load_plugins, run_session  # noqa: PLC0415
    from llm_attn.harness.impls import available_impls, unavailable_reason  # noqa: PLC0415
    from llm_attn.harness.results import (  # noqa: PLC0415
        output_file_problem,
        repair_cut_rows,
        results_file_problem,
    )
    from llm_attn.harness.sweep import DEFAULT_MEASUREMENTS, SweepConfig  # noqa: PLC0415

    plugins = load_plugins(argv, "python -m llm_attn.ttft")
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_verbose(args)
    problem = forced_build_problem()  # LLM_ATTN_BUILD / LLM_ATTN_BACKEND: misspelt, or forcing a missing build
    if problem:
        fail(parser, problem)
    if args.tp is not None and (args.prompts or (args.seq and "dataset" in args.seq)):  # -- prompts --
        parser.error("--prompts and --seq dataset are not supported with --tp yet")
    if args.context is not None:  # -- decode context: checked before anything loads --
        if args.tp is not None or (args.seq and "dataset" in args.seq):
            parser.error("--context is not supported with --tp or --seq dataset")
        if "decode_graph" not in args.measure:
            parser.error("--context sets decode_graph's KV length: add decode_graph to --measure")
        longest = max((s for s in (args.seq or []) if isinstance(s, int)), default=0)
        if min(args.context) < longest:
            parser.error(f"--context {min(args.context)} is shorter than the longest prompt (--seq {longest})")
    if args.prefill_chunk is not None:  # -- chunked prefill: checked before anything loads --
        if args.prefill_chunk <= 0:
            fail(parser, f"--prefill-chunk {args.prefill_chunk}: must be a positive number of tokens")
        if args.tp is not None or (args.seq and "dataset" in args.seq):
            parser.error("--prefill-chunk is not supported with --tp or --seq dataset yet")
    if args.kv_cache != "fp16" and (args.tp is not None or (args.seq and "dataset" in args.seq)):
        parser.error(f"--kv-cache {args.kv_cache} is not supported with --tp or --seq dataset yet")
    if args.tp is not None:  # tensor parallel: its own launcher and measurement (llm_attn.harness.tp)
        from llm_attn.harness import tp  # noqa: PLC0415

        return tp.main(args, parser, plugins, argv)
    try:
        device = session.resolve_device(args.device)
    except ValueError as e:
        parser.error(f"--device {args.device}: {e}")
    impls = args.impl or available_impls(device)
    for impl in impls:
        reason = unavailable_reason(impl, device)
        if reason:
            parser.error(f"--impl {impl}: {reason}")
    if len(set(impls)) != len(impls):
        parser.error(f"--impl lists an implementation twice: {impls}")
    if session.model_spec_problem(args.model):
        parser.error(f"--model {args.model}: {session.model_spec_problem(args.model)}")
    try:
        spec, fallback_note = session.resolve_model_spec(args.model, device)
    except session.SetupError as e:
        parser.error(str(e))
    if fallback_note:
        print(fallback_note, file=sys.stderr, flush=True)
    dtype = args.dtype if args.dtype != "auto" else session.default_dtype(spec, device)
    if output_file_problem(args.out):
        parser.error(f"--out {args.out}: {output_file_problem(args.out)}")
    if results_file_problem(args.out):  # before the model loads: never append after (or resume from) garbage
        fail(parser, f"--out: {results_file_problem(args.out)}")
    problem = session.resource_problem(spec, device, dtype, args.allow_dequant_fallback)
    if problem:
        fail(parser, f"--model {args.model}: {problem}")

    # -- prompts from a dataset: checked before the model loads --
    dataset_seq = args.seq is not None and "dataset" in args.seq
    texts = None
    if dataset_seq and len(args.seq) > 1:
        parser.error("--seq dataset cannot be combined with other lengths")
    if dataset_seq and args.measure != list(DEFAULT_MEASUREMENTS) and args.measure != ["ttft"]:
        parser.error("--seq dataset measures TTFT only (leave out --measure, or give --measure ttft)")
    if dataset_seq and args.resume:
        parser.error("--resume is not supported with --seq dataset (it is one measurement over all prompts)")
    if dataset_seq and not args.prompts:
        parser.error("--seq dataset needs --prompts PATH (the dataset whose lengths are measured)")
    if args.prompt_field and not args.prompts:
        parser.error("--prompt-field needs --prompts")
    if args.prompts:
        from llm_attn.harness.prompts import PromptsError  # noqa: PLC0415

        try:
            texts = session.load_prompt_texts(args.prompts, args.prompt_field,
                                              args.prompt_count if dataset_seq else max(args.batch))
        except PromptsError as e:  # the file's content or the machine, not the command line: one line
            fail(parser, str(e))
    # -- end prompts --
    # Every check has passed: the first write.
    note = repair_cut_rows(args.out)  # a row cut by a killed run or a full disk: moved to <out>.corrupt
    if note:
        print(note, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    print(f"loading model {spec!r} on {device} ({dtype}) ...", file=sys.stderr, flush=True)
    try:
        model, info, seqs = session.load_checked(spec, device, dtype, args.allow_dequant_fallback,
                                                 None if dataset_seq else args.seq, args.new_tokens, args.measure)
    except KeyboardInterrupt:
        print("\ninterrupted while loading the model", file=sys.stderr)
        return 130
    except session.SetupError as e:
        parser.error(str(e))
    print(f"model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    if args.context is not None:  # the default lengths and the model's positions are known now
        problem = session.length_problem(model, [max(args.context)], args.new_tokens, ["decode_graph"],
                                         names=("--context", "--new-tokens"))
        if min(args.context) < max(seqs):
            problem = f"--context {min(args.context)} is shorter than the longest prompt ({max(seqs)} tokens)"
        if problem:
            parser.error(problem)
    print(session.describe_model(info, device, args.model), flush=True)
    try:  # -- prompts from a dataset (None without --prompts) --
        prompts = session.dataset_prompts_for(model, info, args.prompts, texts, args.prompt_field)
    except session.SetupError as e:
        parser.error(str(e))
    if prompts is not None:
        print(f"prompts: {len(texts)} texts of {args.prompts}", flush=True)

    cfg = SweepConfig(model_spec=args.model, dtype=dtype, impls=impls, seqs=seqs, batches=args.batch,
                      new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats,
                      decode_repeats=args.decode_repeats, measurements=args.measure, seed=args.seed,
                      context=args.context[0] if args.context else None, prefill_chunk=args.prefill_chunk,
                      kv_cache=args.kv_cache,
                      allow_dequant_fallback=args.allow_dequant_fallback,
                      experiment=args.experiment, device=device,
                      plugins=plugins)
    if dataset_seq:  # -- --seq dataset --
        return _run_dataset(parser, args, cfg, model, info, prompts, argv)
    t0 = time.perf_counter()
    print(f"measuring {len(impls)} implementation(s) x {len(args.batch)} batch size(s) x {len(seqs)} length(s) "
          f"({', '.join(args.measure)}), rows appended to {args.out} ...", file=sys.stderr, flush=True)
    # Several --context values: the first runs every measurement, each later one decode_graph alone (nothing else
    # depends on the context); one table per context.
    all_written = []
    for i, context in enumerate(args.context or [None]):
        if i:
            cfg = dataclasses.replace(cfg, context=context, measurements=["decode_graph"])
        written, status = run_session(parser, cfg, model, info, args.out, resume=args.resume,
                                      devices_path=args.devices, progress=not args.no_progress,
                                      argv=[sys.executable, "-m", "llm_attn.ttft",
                                            *(sys.argv[1:] if argv is None else argv)],
                                      again="run again with --resume to continue", out_option="--out: ",
                                      resumed="--resume", prompts=prompts)
        if status is not None:
            return status
        if written:
            print(("" if context is None else f"\n--context {context}:\n") + session.rows_tables(written,
                                                                                             wide=args.wide))
        all_written += written
    print(f"measured in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    line, status = session.rows_summary(all_written, args.out)
    print("\n" + line)
    return status


def _run_dataset(parser, args, cfg, model, info, prompts, argv) -> int:
    """--seq dataset: TTFT p50/p90 over the --prompts dataset's own lengths (session.run_dataset)."""
    from llm_attn.harness import session  # noqa: PLC0415
    from llm_attn.harness.prompts import PromptsError  # noqa: PLC0415
    from llm_attn.harness.results import OutputWriteError  # noqa: PLC0415
    from llm_attn.models import max_seq_len  # noqa: PLC0415

    try:
        rows = session.run_dataset(cfg, model, info, args.out, prompts, max_seq_len(model), args.devices,
                                   progress=not args.no_progress,
                                   argv=[sys.executable, "-m", "llm_attn.ttft", *(sys.argv[1:] if argv is None
                                                                                  else argv)])
    except PromptsError as e:
        parser.error(str(e))
    except OutputWriteError as e:
        parser.error(f"--out: {e}")
    except KeyboardInterrupt:
        print(f"\ninterrupted: every finished measurement is in {args.out}", file=sys.stderr)
        return 130
    if rows:
        print(session.rows_tables(rows, wide=args.wide))
    line, status = session.rows_summary(rows, args.out)
    print("\n" + line)
    return status


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C, also during main()'s imports: exit 130 and one line, no traceback
