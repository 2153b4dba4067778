"""Run an experiment definition (a TOML sweep) and write its results under experiments/results/<device>/.

    python -m llm_attn.experiment experiments/default.toml            # the default sweep, 512 .. 8192
    python -m llm_attn.experiment experiments/smoke.toml --dry-run    # list the points, measure nothing
    python -m llm_attn.experiment experiments/default.toml --results-dir /tmp/results

A definition names a sweep over models, dtypes, implementations, batch sizes and prompt lengths (the keys are
those of ``ExperimentDef`` in llm_attn/harness/experiments.py and of the ``SweepParams`` it shares with
``llm_attn.ttft``; see experiments/default.toml). ``plugins = ["my_kernel.py"]`` (or ``--plugin``) brings
implementations from outside the repository; ``measurements = [..., "breakdown"]`` adds the profiled prefill split. Results go to
``<results-dir>/<device-slug>/<name>.jsonl``, where the device slug comes from the GPU name ("h100-80gb-hbm3",
"rtx-4060-ti", "cpu"; the default results-dir is experiments/results on a GPU and ~/.cache/llm_attn/results, or
$LLM_ATTN_CACHE/results, on CPU, where a run only checks the harness), one row per measurement in the format of ``python -m llm_attn.ttft``. Running the same
command again resumes: points that already have a row (measured, or out of memory) are skipped, so an
interrupted sweep continues where it stopped. ``python -m llm_attn.report`` turns the results into tables and
plots.
"""

from __future__ import annotations

from llm_attn._cli import hold_sigint

hold_sigint(__name__)  # before any other import: a Ctrl-C from here on exits 130 without a traceback

import argparse
import sys

# Only the standard library at import (torch and the harness are imported in main(): fast --help, and a Ctrl-C during
# those imports exits 130 without a traceback). ExperimentDef and load_experiment are re-exported lazily below.
_REEXPORTED = ("DEFAULT_RESULTS", "ExperimentDef", "TOMLDecodeError", "load_experiment", "results_path")


def __getattr__(name):
    if name in _REEXPORTED:
        from llm_attn.harness import experiments  # noqa: PLC0415

        return getattr(experiments, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    from llm_attn.harness.cli_args import add_plugin_argument, add_verbose_argument  # noqa: PLC0415
    from llm_attn.harness.experiments import DEFAULT_RESULTS  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m llm_attn.experiment", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("definition", help="experiment TOML file, e.g. experiments/default.toml")
    p.add_argument("--results-dir", default=None,
                   help=f"results root; rows go to <results-dir>/<device-slug>/<name>.jsonl (default: {DEFAULT_RESULTS} "
                        "on a GPU; on CPU, where a run only checks the harness, $LLM_ATTN_CACHE/results, outside the "
                        "checkout)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--no-resume", action="store_true",
                   help="measure every point again even when its row exists (the newest row wins in reports)")
    p.add_argument("--dry-run", action="store_true", help="print the points and the output file, measure nothing")
    p.add_argument("--devices", default=None, help="device datasheet table (default experiments/devices.toml)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--wide", action="store_true",
                   help="print every column of the summary table (by default at most 120 characters wide)")
    add_plugin_argument(p)
    add_verbose_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from llm_attn._ext import forced_build_problem  # noqa: PLC0415
    from llm_attn.envinfo import capture_env  # noqa: PLC0415
    from llm_attn.harness import session  # noqa: PLC0415
    from llm_attn.harness.cli_args import apply_verbose, fail, load_plugins, run_session  # noqa: PLC0415
    from llm_attn.harness.experiments import (  # noqa: PLC0415
        TOMLDecodeError,
        default_results_dir,
        load_experiment,
        results_path,
    )
    from llm_attn.harness.results import (  # noqa: PLC0415
        iter_rows,
        output_file_problem,
        repair_cut_rows,
        results_file_problem,
    )

    load_plugins(argv, "python -m llm_attn.experiment")
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_verbose(args)
    problem = forced_build_problem()  # LLM_ATTN_BUILD / LLM_ATTN_BACKEND: misspelt, or forcing a missing build
    if problem:
        fail(parser, problem)
    try:
        exp = load_experiment(args.definition)
    except FileNotFoundError:
        fail(parser, f"no such experiment file: {args.definition}")
    except IsADirectoryError:
        fail(parser, f"{args.definition} is a directory; give an experiment TOML file, e.g. experiments/default.toml")
    except OSError as e:
        fail(parser, f"{args.definition}: cannot read it: {e.strerror or e}")
    except UnicodeDecodeError:
        fail(parser, f"{args.definition}: not a text (TOML) file")
    except (ValueError, TypeError, TOMLDecodeError) as e:
        parser.error(f"{args.definition}: {e}")
    try:
        device = session.resolve_device(args.device)
    except ValueError as e:
        parser.error(f"--device {args.device}: {e}")
    try:
        configs = exp.configs(device)
    except ValueError as e:
        parser.error(f"{args.definition}: {e}")
    for cfg in configs:
        if session.model_spec_problem(cfg.model_spec):
            parser.error(f"--model {cfg.model_spec}: {session.model_spec_problem(cfg.model_spec)}")
    slug = capture_env(device)["device_slug"]
    results_dir = args.results_dir or str(default_results_dir(slug))
    out = results_path(results_dir, slug, exp.name)
    cmd = [sys.executable, "-m", "llm_attn.experiment", *(sys.argv[1:] if argv is None else argv)]
    if output_file_problem(out):
        parser.error(f"--results-dir {results_dir}: {out}: {output_file_problem(out)}")
    if results_file_problem(out):  # before any model loads: never append after (or resume from) garbage
        fail(parser, results_file_problem(out))

    if args.dry_run:
        n = sum(len(c.impls) * len(c.batches) * len(c.seqs) for c in configs)
        print(f"experiment {exp.name}: {len(configs)} model/dtype combination(s), {n} points, results -> {out}")
        for c in configs:
            print(f"  model={c.model_spec} dtype={c.dtype} impls={c.impls} batches={c.batches} seqs={c.seqs} "
                  f"measure={c.measurements}")
            print(f"    e.g. {c.command(c.impls, c.batches[0], c.seqs[0], c.measurements)}")
        return 0

    texts = None
    if exp.prompts is not None:  # -- prompts from a dataset: checked before any model loads --
        from llm_attn.harness.prompts import PromptsError  # noqa: PLC0415

        try:
            texts = session.load_prompt_texts(exp.prompts, exp.prompt_field, max(c_ for c in configs
                                                                                 for c_ in c.batches))
        except PromptsError as e:  # the dataset, not the command line: one line
            fail(parser, f"{args.definition}: {e}")
    for cfg in configs:
        problem = session.resource_problem(cfg.model_spec, device, cfg.dtype, cfg.allow_dequant_fallback)
        if problem:
            fail(parser, f"model {cfg.model_spec}: {problem}")
    note = repair_cut_rows(out)  # every check has passed: a row cut by a killed run moves to <out>.corrupt
    if note:
        print(note, file=sys.stderr, flush=True)

    print(f"experiment {exp.name}: rows go to {out}", file=sys.stderr, flush=True)
    status = 0
    for cfg in configs:
        note = session.resolve_model_spec(cfg.model_spec, device)[1]  # 'auto' on a GPU without gptqmodel: fp16
        if note:
            print(note, file=sys.stderr, flush=True)
        print(f"loading model {cfg.model_spec!r} on {device} ({cfg.dtype}) ...", file=sys.stderr, flush=True)
        try:
            model, info, _ = session.load_checked(cfg.model_spec, device, cfg.dtype, cfg.allow_dequant_fallback,
                                                  cfg.seqs, cfg.new_tokens, cfg.measurements,
                                                  names=("model", f"{args.definition}: seqs", "new_tokens"))
        except KeyboardInterrupt:
            return 130
        except session.SetupError as e:
            parser.error(str(e))
        print(session.describe_model(info, device, cfg.model_spec), flush=True)
        try:
            prompts = session.dataset_prompts_for(model, info, exp.prompts, texts, exp.prompt_field)
        except session.SetupError as e:
            parser.error(f"{args.definition}: {e}")
        written, code = run_session(parser, cfg, model, info, out, resume=not args.no_resume,
                                    devices_path=args.devices, progress=not args.no_progress, argv=cmd,
                                    again="run the same command again to continue", out_option="", resumed="resumed",
                                    prompts=prompts)
        if code is not None:
            return code
        if any(r["status"] == "error" for r in written):
            status = 1
        del model
    rows = [r for r in iter_rows(out) if r.get("experiment") == exp.name]
    print(session.rows_tables(rows, wide=args.wide))
    print(f"\nresults: {out} ({len(rows)} rows for experiment {exp.name})")
    return status


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C, also during main()'s imports: exit 130 and one line, no traceback
