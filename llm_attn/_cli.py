"""How every command line ends (``python -m llm_attn.<cli>``): standard library only, so that it is in place before
torch and transformers are imported.

Ctrl-C exits 130 with one line and no traceback, also in the first second, while the heavy imports run. Some of
those imports (transformers' lazy modules) turn a KeyboardInterrupt into another exception raised "during handling"
of it; an exception whose chain holds a KeyboardInterrupt counts as Ctrl-C too.

Quiet by default: third-party output that says nothing to a user of the harness (transformers' weight-loading bar,
gptqmodel's banner and log lines, datasets' split bars, warnings we know to be noise) is held back where it arises,
unless ``-v`` (``verbose()``: ``LLM_ATTN_VERBOSE=1``, which the processes a command starts inherit).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def _interrupted(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _exit_interrupted() -> None:
    # os._exit, not sys.exit: once a KeyboardInterrupt has passed through the interpreter's own evaluation of some
    # code (an import can do that), CPython ends the process by re-sending itself SIGINT at shutdown, whatever exit
    # status was asked for (status -2 instead of 130). Everything is flushed first; the results file is fsync'ed
    # row by row and closed by then.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 (a closed or broken pipe: nothing more to say)
            pass
    os._exit(130)


_sigint_seen = False


def verbose() -> bool:
    """Whether third-party progress bars, banners and warnings are shown (``-v``, or LLM_ATTN_VERBOSE=1)."""
    return os.environ.get("LLM_ATTN_VERBOSE", "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """``-v``: through the environment, so that the processes a command starts (torchrun ranks) are verbose too."""
    if on:
        os.environ["LLM_ATTN_VERBOSE"] = "1"
    else:
        os.environ.pop("LLM_ATTN_VERBOSE", None)


def _on_sigint(signum, frame):
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def _on_sigint_deferred(signum, frame):
    global _sigint_seen
    _sigint_seen = True


def _preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` with Ctrl-C deferred until they are in: a KeyboardInterrupt raised inside torch's C++
    import code (a pybind11 callback) aborts the process (``terminate called ...``, status -6) instead of
    unwinding. A Ctrl-C during them ends the command right after, with status 130."""
    import importlib  # noqa: PLC0415

    previous = signal.signal(signal.SIGINT, _on_sigint_deferred)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
    if _sigint_seen:
        print("\ninterrupted", file=sys.stderr, flush=True)
        _exit_interrupted()


_held = False


def hold_sigint(module_name: str) -> None:
    """The first line of a command-line module: when it runs as the command (``module_name == "__main__"``) and
    Ctrl-C has its default handler, a Ctrl-C from here on is only remembered until ``run_cli`` takes over (which then
    exits 130 with one line), so that the module's own imports, before ``run_cli`` is reached, never end in a
    traceback. Imported as a library, the module leaves the signal alone."""
    global _held
    if module_name == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint_deferred)
        _held = True


def run_cli(main: Callable[[], int | None], preload: tuple[str, ...] = ("torch",)) -> None:
    """``sys.exit(main())``, with Ctrl-C (at any point) as exit status 130 and the line ``interrupted``.

    A Ctrl-C raises KeyboardInterrupt as usual, and is remembered: some imports (transformers' lazy modules) turn
    the KeyboardInterrupt into another exception without keeping it in the chain, so any exception after a Ctrl-C
    counts as the interrupt. Once main() has finished, a Ctrl-C during the interpreter's shutdown (torch's teardown
    takes a moment) is ignored, so the exit status stays the one main() gave."""
    if _held or signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with it ignored
        if _sigint_seen:  # a Ctrl-C while the module was still importing (hold_sigint)
            print("\ninterrupted", file=sys.stderr, flush=True)
            _exit_interrupted()
        if not {"-h", "--help"} & set(sys.argv[1:]):  # --help stays fast
            _preload(preload)
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        status = main()
    except SystemExit:
        _quiet_shutdown()
        raise
    except BaseException as e:  # noqa: BLE001 (re-raised unless it is a Ctrl-C)
        if not (_sigint_seen or _interrupted(e)):
            _quiet_shutdown()
            raise
        try:
            print("\ninterrupted", file=sys.stderr, flush=True)
        finally:
            _exit_interrupted()
    if status == 130:  # main() caught the Ctrl-C itself (and said what was kept)
        _exit_interrupted()
    _quiet_shutdown()
    sys.exit(status)


def _quiet_shutdown() -> None:
    # Ignored, not handled: CPython puts SIGINT back to its default (kill) before the last of the teardown, but
    # leaves an ignored signal ignored.
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
