"""Prompts from a dataset (``--prompts PATH``): text loaded through ``datasets``, tokenized with the model's
tokenizer, cut or repeated to the asked length; or the dataset's own length distribution (``--seq dataset``).

Sources, never downloaded (``HF_DATASETS_OFFLINE=1`` is set for the load):

- a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file (``datasets``' json/parquet/csv builders);
- a folder written by ``Dataset.save_to_disk``;
- the name of a dataset already in the local Hugging Face cache (``name``, ``org/name``, optionally ``:split``); one
  that is not cached is a one-line error saying how to bring it here as a folder.

The text column is ``text_field`` when given, else the first of ``text``, ``content``, ``prompt``, ``document``,
``question`` that exists, else the first string column. Any problem (no such file, a format ``datasets`` cannot
read, no text column, a dataset not in the cache, no tokenizer) raises ``PromptsError`` with one line, which the
CLIs print and exit with status 2.

The synthetic checkpoints ship no tokenizer: ``write_offline_tokenizer`` trains a small byte-level BPE (the
``tokenizers`` library, on text in this module: no download) and saves it into a checkpoint folder so that
``AutoTokenizer.from_pretrained`` loads it. Byte-level means any text tokenizes, whatever its language.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
TEXT_FIELDS = ("text", "content", "prompt", "document", "question")


class PromptsError(ValueError):
    """A --prompts source that cannot be used; the message is one line, for the user."""


@contextmanager
def _offline():
    """Offline for the block: the environment variables (for code that reads them late) and the module constants
    that ``datasets`` and ``huggingface_hub`` read from them at import time."""
    import datasets.config  # noqa: PLC0415
    import huggingface_hub.constants  # noqa: PLC0415

    keys = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    consts = [(datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
              (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    old_consts = [(m, a, getattr(m, a)) for m, a in consts if hasattr(m, a)]
    os.environ.update(dict.fromkeys(keys, "1"))
    for m, a, _ in old_consts:
        setattr(m, a, True)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for m, a, v in old_consts:
            setattr(m, a, v)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0][:300] if text else ''}"
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e:
        inner = str(cause).strip().splitlines()
        line += f" <- {type(cause).__name__}: {inner[0][:200] if inner else ''}"
    return line


# A hub dataset name as ``datasets.load_dataset`` takes it: ``name`` or ``org/name``, optionally ``:split``.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?(:[A-Za-z0-9_.\[\]%:-]+)?$")


def _is_blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (read until the first other byte)."""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _import_datasets(source: str, hub: bool):
    try:
        import datasets  # noqa: PLC0415 (optional dependency: only --prompts needs it)
    except ImportError as e:
        if hub:
            raise PromptsError(f"--prompts {source}: not a local file or folder, so a hub dataset id, and loading one "
                               "needs the optional 'datasets' package (python -m pip install -e \".[prompts]\") and the "
                               "dataset already in the local Hugging Face cache (nothing is downloaded)") from None
        raise PromptsError("--prompts needs the optional 'datasets' package: "
                           'python -m pip install -e ".[prompts]"' f" ({e})") from None
    return datasets


@contextmanager
def _no_progress_bars(datasets):
    """datasets draws a bar per split it generates (also into log files): held back unless -v."""
    from llm_attn._cli import verbose  # noqa: PLC0415

    on = datasets.is_progress_bar_enabled()
    if not verbose():
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if on:
            datasets.enable_progress_bars()


def load_dataset_source(source: str, split: str | None = None):
    """The ``datasets.Dataset`` behind ``source`` (see the module docstring), or PromptsError. What can be said
    without ``datasets`` (no such file, an unsupported type, an empty file) is said before it is imported."""
    path = Path(source).expanduser()
    hub = False
    if path.is_file():
        builder = FORMATS.get(path.suffix.lower())
        if builder is None:
            raise PromptsError(f"--prompts {source}: unsupported file type {path.suffix or '(none)'!r}; "
                               f"use one of {', '.join(FORMATS)}")
        if _is_blank(path):
            raise PromptsError(f"--prompts {source}: the file is empty (no prompt text in it)")
    elif not path.is_dir():
        if (source.startswith((".", "/", "~")) or Path(source).suffix.lower() in FORMATS
                or not _HUB_NAME.match(source)):
            raise PromptsError(f"--prompts {source}: no such file or folder")
        hub = True
    datasets = _import_datasets(source, hub)
    with _offline(), _no_progress_bars(datasets):
        try:
            if path.is_file():
                return datasets.load_dataset(FORMATS[path.suffix.lower()], data_files=str(path),
                                             split=split or "train")
            if path.is_dir():
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[split or next(iter(ds))]
                return ds
            name, _, name_split = source.partition(":")
            return datasets.load_dataset(name, split=name_split or split or "train")
        except PromptsError:
            raise
        except Exception as e:  # noqa: BLE001 (datasets raises many kinds; the user gets one line)
            why = _one_line(e)
            if hub and any(s in why for s in ("not cached", "OfflineModeIsEnabled", "Couldn't reach")):
                name = source.partition(":")[0]
                raise PromptsError(
                    f"--prompts {source}: not a local file or folder, and the hub dataset {name!r} is not in the "
                    "local Hugging Face cache; nothing is downloaded here: where there is network, save it with "
                    f"datasets.load_dataset({name!r}, split='train').save_to_disk(DIR) and pass --prompts DIR, or "
                    f"pass a local {'/'.join(FORMATS)} file") from None
            raise PromptsError(f"--prompts {source}: cannot load it as a dataset offline ({why})") from None


def text_column(ds, text_field: str | None = None) -> str:
    cols = list(ds.column_names)
    if text_field is not None:
        if text_field not in cols:
            raise PromptsError(f"--prompts: no column {text_field!r}; columns are {cols}")
        return text_field
    for name in TEXT_FIELDS:
        if name in cols:
            return name
    for name in cols:
        if getattr(ds.features[name], "dtype", None) in ("string", "large_string"):
            return name
    raise PromptsError(f"--prompts: no text column (looked for {', '.join(TEXT_FIELDS)} or any string column); "
                       f"columns are {cols}")


def load_texts(source: str, text_field: str | None = None, split: str | None = None,
               limit: int | None = None) -> list[str]:
    """The non-empty texts of ``source`` (at most ``limit``), in dataset order."""
    ds = load_dataset_source(source, split)
    col = text_column(ds, text_field)
    texts = []
    for t in ds[col]:
        if isinstance(t, str) and t.strip():
            texts.append(t)
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise PromptsError(f"--prompts {source}: column {col!r} holds no non-empty text")
    return texts


def load_tokenizer(model_path: str | os.PathLike):
    """The tokenizer saved with a checkpoint (``AutoTokenizer``, local files only), or PromptsError."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415

        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise PromptsError(f"--prompts needs the model's tokenizer, and {model_path} has none that loads "
                           f"({_one_line(e)})") from None


def token_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's token ids, without special tokens (TTFT is about the prompt's length, not a chat template)."""
    out = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [ids for ids in out if ids]


def prompt_batch(tokenizer, texts: Sequence[str], batch: int, seq: int, vocab_size: int | None = None,
                 device="cpu") -> torch.Tensor:
    """(batch, seq) token ids: row ``b`` is text ``b % len(texts)`` cut to ``seq`` tokens, or repeated end to end
    until it fills ``seq``. Ids at or above ``vocab_size`` (a tokenizer larger than the model) raise PromptsError."""
    ids = token_ids(tokenizer, texts[:batch] if len(texts) >= batch else texts)
    if not ids:
        raise PromptsError("--prompts: every text tokenized to zero tokens")
    rows = []
    for b in range(batch):
        t = ids[b % len(ids)]
        reps = -(-seq // len(t))
        rows.append((t * reps)[:seq])
    out = torch.tensor(rows, dtype=torch.long)
    if vocab_size is not None and int(out.max()) >= vocab_size:
        raise PromptsError(f"--prompts: the tokenizer produced id {int(out.max())}, beyond the model's vocabulary "
                           f"({vocab_size})")
    return out.to(device)


def dataset_prompts(tokenizer, texts: Sequence[str], max_seq: int, device="cpu") -> list[torch.Tensor]:
    """``--seq dataset``: one (1, n) prompt per text at its own token length n (capped at ``max_seq``)."""
    return [torch.tensor([t[:max_seq]], dtype=torch.long, device=device) for t in token_ids(tokenizer, texts)]


def length_distribution(prompts: Sequence[torch.Tensor]) -> dict:
    import numpy as np  # noqa: PLC0415

    n = np.array([p.shape[1] for p in prompts], dtype=np.float64)
    return {"count": int(n.size), "min": int(n.min()), "p50": float(np.percentile(n, 50)),
            "p90": float(np.percentile(n, 90)), "max": int(n.max()), "mean": float(n.mean())}


# The offline tokenizer of the synthetic checkpoints lives with them (llm_attn/models/tokenizer.py: models may not
# import the harness); re-exported here, where --prompts uses it.
from llm_attn.models.tokenizer import (  # noqa: E402,F401
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    ensure_offline_tokenizer,
    write_offline_tokenizer,
)
