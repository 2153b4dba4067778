"""Train a small Llama offline, on text every machine has (the Python sources of the standard library and of the
installed packages), and save it as a
Hugging Face checkpoint with its tokenizer: a trained model for the harness's end-to-end agreement (issue 34 item
4: greedy agreement over the first 64 tokens and the logit KL against stock) where no released checkpoint can be
downloaded. The synthetic 8B's random weights leave near-ties in every next-token distribution, which any 8-bit
attention flips; a trained model's distributions are peaked where its text is predictable, as a released model's
are. It is a small code model (default 22M parameters, head_dim 128, 4 query heads over 1 KV head), not Llama 3:
on an H100 its held-out loss is 1.69 nats/token (1.47 on its training text; experiments/results/h100-80gb-hbm3/
tinylm_training.json).

    python experiments/train_tiny_lm.py --out /tmp/tinylm            # ~2.5 min on an H100; writes heldout.jsonl too
    python -m llm_attn.ttft --model /tmp/tinylm --prompts /tmp/tinylm/heldout.jsonl --measure correctness \\
        --impl sdpa llm_attn llm_attn_fp8 llm_attn_fp8_e4m3 llm_attn_int8qk llm_attn_int8 --seq 1024 2048 --batch 16 \\
        --new-tokens 64

The corpus is split by file (a hash of each path, so the split does not depend on the machine's file order): the
held-out files never reach the training batches, and those of at least ``--prompt-min-chars`` characters become the
prompts (``heldout.jsonl``, one ``{"text": ...}`` per file, in hash order). The tokenizer is the harness's offline byte-level BPE (``llm_attn.models.tokenizer``)
trained on the training files. Training: random windows of ``--seq`` tokens, AdamW, cosine schedule, bf16 autocast on
a GPU; the script prints the training and held-out loss (nats per token) so the model's quality is on record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}


def corpus_files(root: Path, max_bytes: int) -> list[Path]:
    """The *.py files under ``root`` (sorted, outside SKIP_DIRS below it), up to ``max_bytes`` of them in total."""
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(f.relative_to(root).parts[:-1]) or not f.is_file():
            continue
        size = f.stat().st_size
        if size == 0:
            continue
        if total + size > max_bytes:
            break
        files.append(f)
        total += size
    return files


def _hash01(rel: str) -> float:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little") / 2 ** 64


def held_out(rel: str, fraction: float) -> bool:
    """Whether a file (its path relative to the corpus root) is held out: a hash, not the machine's file order."""
    return _hash01(rel) < fraction


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to write (config, weights, tokenizer)")
    p.add_argument("--corpus", nargs="+", default=[sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]],
                   help="folders of *.py text (default: the standard library's and the installed packages')")
    p.add_argument("--max-corpus-mb", type=float, default=80.0, help="at most this much text from each folder")
    p.add_argument("--prompt-min-chars", type=int, default=16384, help="held-out files this long become prompts")
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--prompts-out", default=None, help="held-out texts as JSONL (default: OUT/heldout.jsonl)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-positions", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--seq", type=int, default=2048, help="tokens per training window")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "steps", "seq", "batch"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if not 0 < args.heldout_fraction < 1:
        p.error("--heldout-fraction must lie in (0, 1)")
    if args.seq >= args.max_positions:
        p.error(f"--seq {args.seq} must be below --max-positions {args.max_positions}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from llm_attn.models.tokenizer import write_offline_tokenizer  # noqa: PLC0415

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    out = Path(args.out)
    texts = {}
    for root in dict.fromkeys(Path(c).resolve() for c in args.corpus):  # a folder inside another is read once
        for f in corpus_files(root, int(args.max_corpus_mb * 2 ** 20)):
            texts.setdefault(f"{root.name}/{f.relative_to(root)}", f.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        sys.exit(f"train_tiny_lm: no *.py text under {', '.join(args.corpus)}")
    train = [t for rel, t in texts.items() if not held_out(rel, args.heldout_fraction)]
    heldout = [texts[rel] for rel in sorted((r for r in texts if held_out(r, args.heldout_fraction)), key=_hash01)]
    if not train or not heldout:
        sys.exit(f"train_tiny_lm: {len(files)} files split into {len(train)} training and {len(heldout)} held-out; "
                 "need both (more corpus or another --heldout-fraction)")

    t0 = time.perf_counter()
    write_offline_tokenizer(out, args.vocab, corpus="\n".join(train))
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    eos = tok.eos_token_id

    def ids_of(docs):  # the documents' ids end to end, each followed by eos
        import numpy as np  # noqa: PLC0415

        parts = [np.asarray(ids + [eos], dtype=np.int64) for ids in tok(docs, add_special_tokens=False)["input_ids"]]
        return torch.from_numpy(np.concatenate(parts)).to(device)

    train_ids, heldout_ids = ids_of(train), ids_of(heldout)
    for name, ids in (("training", train_ids), ("held-out", heldout_ids)):
        if ids.numel() <= args.seq + 1:
            sys.exit(f"train_tiny_lm: the {name} text is {ids.numel()} tokens, not more than --seq {args.seq}")
    tok_s = time.perf_counter() - t0

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=args.max_positions, rope_theta=500000.0, bos_token_id=tok.bos_token_id,
                      eos_token_id=eos, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device)
    model.config._attn_implementation = "sdpa"
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(100, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else
        0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup))))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                  enabled=False)

    def batch_of(ids):
        start = torch.randint(0, ids.numel() - args.seq - 1, (args.batch,), device=device, generator=gen)
        win = torch.stack([ids[s:s + args.seq + 1] for s in start.tolist()])
        return win[:, :-1], win[:, 1:]

    def loss_of(x, y):
        with amp:
            logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    model.train()
    t1, losses = time.perf_counter(), []
    for step in range(args.steps):
        x, y = batch_of(train_ids)
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            losses.append((step, round(float(loss.detach()), 4)))
            print(f"step {step}: training loss {losses[-1][1]:.3f}", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t1
    model.eval()
    with torch.no_grad():
        heldout_loss = sum(float(loss_of(*batch_of(heldout_ids))) for _ in range(8)) / 8
        final_train = sum(float(loss_of(*batch_of(train_ids))) for _ in range(8)) / 8

    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).save_pretrained(str(out))
    prompts = Path(args.prompts_out) if args.prompts_out else out / "heldout.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompt_texts = [t for t in heldout if len(t) >= args.prompt_min_chars]
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompt_texts))
    summary = {"out": str(out), "prompts": str(prompts), "parameters": params, "corpus": args.corpus,
               "files": {"training": len(train), "held_out": len(heldout), "prompts": len(prompt_texts)},
               "tokens": {"training": int(train_ids.numel()), "held_out": int(heldout_ids.numel())},
               "tokens_seen": args.steps * args.batch * args.seq, "steps": args.steps,
               "loss_nats_per_token": {"training": round(final_train, 4), "held_out": round(heldout_loss, 4)},
               "loss_curve": losses, "tokenizer_s": round(tok_s, 1), "train_s": round(train_s, 1),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "args": vars(args)}
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("loss_curve", "args")}))
    return summary


if __name__ == "__main__":
    main()
