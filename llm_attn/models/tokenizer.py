"""An offline tokenizer for the synthetic checkpoints (they ship none): a small byte-level BPE trained with the
``tokenizers`` library on text in this module (no download), saved into the checkpoint folder so that
``AutoTokenizer.from_pretrained`` loads it. Byte-level means any text tokenizes, whatever its language.
``--prompts`` (llm_attn/harness/prompts.py) tokenizes dataset text with it.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def write_offline_tokenizer(path: str | os.PathLike, vocab_size: int, corpus: str | None = None,
                            bos_token_id: int = 1, eos_token_id: int = 2) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` ids (the 256 byte symbols, the special tokens
    ``SPECIAL_TOKENS`` at ids 0-2, and merges learnt from ``corpus``) and save it into ``path`` as a
    ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json). ``bos_token_id`` / ``eos_token_id`` place
    ``<s>`` / ``</s>`` at the model's ids (Llama 3: 128000 / 128001; they must lie beyond the learnt ids or be the
    defaults 1 / 2). Offline and seeded by its input: the same arguments give the same tokenizer. Returns ``path``."""
    import json  # noqa: PLC0415

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < base:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {base}, got {vocab_size}")
    for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if not 0 <= tid < vocab_size:
            raise ValueError(f"{name} {tid} is outside the vocabulary (0..{vocab_size - 1})")
    if bos_token_id == eos_token_id:
        raise ValueError(f"bos_token_id and eos_token_id are both {bos_token_id}")
    moved = (bos_token_id, eos_token_id) != (1, 2)
    # Learnt ids must stay below the relocated special ids.
    limit = min(vocab_size, min(bos_token_id, eos_token_id)) if moved else vocab_size
    if limit < base:
        raise ValueError(f"bos/eos ids {bos_token_id}/{eos_token_id} leave no room for the {base} base tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=limit, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus if corpus is not None else _CORPUS
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()], trainer=trainer)
    if moved:
        # Rebuild the BPE with <s> / </s> at the model's ids (ids 1 and 2 stay unused holes).
        spec = json.loads(tok.to_str())
        vocab = dict(spec["model"]["vocab"])
        vocab["<s>"], vocab["</s>"] = bos_token_id, eos_token_id
        spec["model"]["vocab"] = vocab
        for added in spec["added_tokens"]:
            if added["content"] in ("<s>", "</s>"):
                added["id"] = vocab[added["content"]]
        tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


TOKENIZER_FILE = "tokenizer.json"


def ensure_offline_tokenizer(path: str | os.PathLike, vocab_size: int, bos_token_id: int = 1,
                             eos_token_id: int = 2) -> bool:
    """Write the offline tokenizer into checkpoint folder ``path`` unless one is there (a checkpoint cached before
    tokenizers were written gets one on first use; its weights are left alone). True when it wrote one."""
    path = Path(path)
    if (path / TOKENIZER_FILE).is_file():
        return False
    write_offline_tokenizer(path, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return True
