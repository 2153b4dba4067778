"""Prompts from a dataset (``--prompts PATH``): text loaded through ``datasets``, tokenized with the model's
tokenizer, cut or repeated to the asked length; or the dataset's own length distribution (``--seq dataset``).

Sources, never downloaded (``HF_DATASETS_OFFLINE=1`` is set for the load):

- a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file (``datasets``' json/parquet/csv builders);
- a folder written by ``Dataset.save_to_disk``;
- the name of a dataset already in the local Hugging Face cache (``name`` or ``name:split``).

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


def load_dataset_source(source: str, split: str | None = None):
    """The ``datasets.Dataset`` behind ``source`` (see the module docstring), or PromptsError."""
    try:
        import datasets  # noqa: PLC0415 (optional dependency: only --prompts needs it)
    except ImportError as e:
        raise PromptsError(f"--prompts needs the 'datasets' package (pip install datasets): {e}") from None
    path = Path(source).expanduser()
    with _offline():
        try:
            if path.is_file():
                builder = FORMATS.get(path.suffix.lower())
                if builder is None:
                    raise PromptsError(f"--prompts {source}: unsupported file type {path.suffix or '(none)'!r}; "
                                       f"use one of {', '.join(FORMATS)}")
                return datasets.load_dataset(builder, data_files=str(path), split=split or "train")
            if path.is_dir():
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[split or next(iter(ds))]
                return ds
            if os.sep in source or source.startswith(".") or Path(source).suffix.lower() in FORMATS:
                raise PromptsError(f"--prompts {source}: no such file or folder")
            name, _, name_split = source.partition(":")
            return datasets.load_dataset(name, split=name_split or split or "train")
        except PromptsError:
            raise
        except Exception as e:  # noqa: BLE001 (datasets raises many kinds; the user gets one line)
            raise PromptsError(f"--prompts {source}: cannot load it as a dataset offline ({_one_line(e)})") from None


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


# -- an offline tokenizer for the synthetic checkpoints ------------------------------------------------------------------
# Training text for the byte-level BPE: plain English about what the harness does. Any text tokenizes anyway (every
# byte is in the base alphabet); this only decides which merges exist.
_CORPUS = """
Time to first token is the time from the moment a prompt is handed to the model until the first generated token
is available on the host. It is dominated by the prefill: one forward pass over every token of the prompt, in
which each layer computes queries, keys and values, attends causally over the prompt, and writes the keys and
values into the cache that decoding will read. Attention is one part of that work; the matrix multiplications of
the projections and of the feed-forward network are another, and for a quantised model the unpacking of the
weights is a third. The host must enqueue every kernel of the forward pass; when the host is slower than the
device, the device waits, and the measured time says more about the host than about any kernel.
A trustworthy comparison runs the implementations side by side, in a shuffled order, many times, and reports the
ratio of the medians with an interval that says how sure the measurement is. Where the interval holds one, the
honest verdict is that the data cannot tell the implementations apart.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft
zebras jump. 0123456789 + - * / = < > ( ) [ ] { } , . ; : ! ? ' " # $ % & @ ^ _ ` | ~
def attention(query, key, value, causal=True): return softmax(query @ key.T / sqrt(d)) @ value
"""
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the synthetic presets' bos 1 and eos 2


def write_offline_tokenizer(path: str | os.PathLike, vocab_size: int, corpus: str | None = None) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` ids (the 256 byte symbols, the special tokens
    ``SPECIAL_TOKENS`` at ids 0-2, and merges learnt from ``corpus``) and save it into ``path`` as a
    ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json). Offline and seeded by its input: the same
    corpus and size give the same tokenizer. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < base:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {base}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus if corpus is not None else _CORPUS
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
