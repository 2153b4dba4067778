"""argparse pieces shared by the command lines (ttft, bench, experiment): number types and the --plugin option.

A library module, not a CLI: the command lines import it, and it imports nothing of theirs.
"""

from __future__ import annotations

import argparse
import sys

from llm_attn import registry


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("must be >= 2: decode is timed over the tokens after the first")
    return value


def add_verbose_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show third-party progress bars, banners and warnings that are held back by default "
                        "(transformers' weight loading, gptqmodel, datasets)")


def apply_verbose(args: argparse.Namespace) -> None:
    from llm_attn._cli import set_verbose  # noqa: PLC0415

    if getattr(args, "verbose", False):
        set_verbose(True)


def fail(parser: argparse.ArgumentParser, message: str):
    """Exit 2 with one line, ``<prog>: error: <message>``: for problems that are not about the command line's syntax
    (the environment, a file's content, the machine's resources), where argparse's usage block would only bury it."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def add_plugin_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE[:ATTR]",
                   help="load an attention plugin that registers implementations with "
                        "llm_attn.register_attention (repeatable); installed packages' 'llm_attn.attention' entry "
                        "points load by themselves")


def load_plugins(argv: list[str] | None, prog: str) -> list[str]:
    """Load every --plugin of ``argv`` before the real parser is built, so that --impl knows their names."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False)
    add_plugin_argument(pre)
    known, _ = pre.parse_known_args(argv)
    try:
        registry.load_plugins(known.plugin)
    except registry.PluginError as e:
        pre.error(str(e))
    return known.plugin


def run_session(parser: argparse.ArgumentParser, cfg, model, info, out, *, resume: bool, devices_path,
                progress: bool, argv: list[str], again: str, out_option: str,
                resumed: str, prompts=None) -> tuple[list[dict], int | None]:
    """``session.run`` as a command line runs it: Ctrl-C and an unwritable output become one message and an exit
    status. Returns (rows written, None) or ([], exit status). ``prompts``: ``session.DatasetPrompts`` (--prompts). ``again`` says how to continue after Ctrl-C,
    ``out_option`` prefixes a write error, ``resumed`` the count of points skipped because they were done."""
    from llm_attn.harness.results import OutputWriteError  # noqa: PLC0415
    from llm_attn.harness.session import run  # noqa: PLC0415 (loads torch: keep --help of the CLIs fast)

    try:
        written, skipped = run(cfg, model, info, out, resume, devices_path, progress=progress, argv=argv,
                                 prompts=prompts)
    except KeyboardInterrupt:
        print(f"\ninterrupted: every finished measurement is in {out}; {again}", file=sys.stderr)
        return [], 130
    except OutputWriteError as e:
        print(f"{parser.prog}: error: {out_option}{e}", file=sys.stderr)
        return [], 2
    if skipped:
        print(f"{resumed}: {skipped} measurements already in {out} were skipped")
    return written, None
