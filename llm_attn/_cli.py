"""How every command line ends (``python -m llm_attn.<cli>``): standard library only, so that it is in place before
torch and transformers are imported.

Ctrl-C exits 130 with one line and no traceback, also in the first second, while the heavy imports run. Some of
those imports (transformers' lazy modules) turn a KeyboardInterrupt into another exception raised "during handling"
of it; an exception whose chain holds a KeyboardInterrupt counts as Ctrl-C too.
"""

from __future__ import annotations

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


def run_cli(main: Callable[[], int | None]) -> None:
    """``sys.exit(main())``, with Ctrl-C (at any point) as exit status 130 and the line ``interrupted``."""
    try:
        status = main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 (re-raised unless it is a Ctrl-C)
        if not _interrupted(e):
            raise
        try:
            print("\ninterrupted", file=sys.stderr, flush=True)
        finally:
            sys.exit(130)
    sys.exit(status)
