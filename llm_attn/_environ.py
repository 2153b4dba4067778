"""Environment reads on the per-call path.

``os.environ.get`` of a variable that is not set raises and catches a ``KeyError`` inside (``Mapping.get``): about
1-2 us a read, and the attention call reads the kernel build's variables every time (eager ``generate`` pays each
call 32 times a token). ``get`` reads the same mapping (``os.environ``'s own encoded store, which ``os.environ[...] =``,
``del`` and pytest's ``monkeypatch.setenv`` update) without the exception: a variable set or unset after import is
seen by the next call, as with ``os.environ.get``.
"""

import os

_store = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)
_fast = isinstance(_store, dict) and callable(_encode) and callable(_decode)
_keys: dict[str, object] = {}  # name -> its encoded key (bounded by the names the package reads)


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without the exception a missing variable costs there."""
    if not _fast:
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode(name)
    value = _store.get(key)
    return default if value is None else _decode(value)
