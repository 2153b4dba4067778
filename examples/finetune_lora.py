"""LoRA fine-tuning through the llm_attn patch: stock sdpa and ours, same weights, same LoRA init, same batches.

    python examples/finetune_lora.py                                  # CPU: tiny Llama, reference path, 2 steps
    python examples/finetune_lora.py --model llama-3-8b --seq 2048    # GPU: Llama-3-8B-shaped model, bf16, 20 steps

What it does, end to end:

* reads a small local text file (examples/data/lora_notes.txt, a few KB, CC0) through the ``datasets`` library's
  ``text`` builder (nothing is downloaded) and tokenises it byte-level (UTF-8 bytes are the token ids, so no
  tokenizer has to be fetched); every step takes ``--batch`` windows of ``--seq`` tokens at seeded offsets;
* builds a Llama of a preset geometry from ``llm_attn.models.llama_config`` with random weights (seeded; the
  8B-shaped model is created directly on the GPU in ``--dtype``, 16 GB, no checkpoint on disk), attention dropout 0;
* wraps it with peft LoRA (q/k/v/o projections, rank ``--lora-r``, LoRA dropout 0, adapters in float32 as peft
  keeps them) and remembers the adapters' initial values;
* each entry of ``--impl`` (``sdpa`` = the stock attention, unpatched; any other name = ``patch_model(model,
  impl=name)``, e.g. ``llm_attn``, ours) starts from the same initial adapters with its own AdamW and runs the
  same batches: forward, ``loss.backward()`` (through ``llm_attn::flash_bwd`` for ours), optimizer step. The
  entries take turns step by step (each swaps its own adapters in and out around its step), so their step times
  are measured side by side and pair up by step;
* prints per step the step time and loss of each implementation and the relative loss difference to the first
  one, then the median step time (steps 2..N) with its ratio to the first one's (the first's median / this one's,
  so above 1 = faster, as every ratio of llm_attn) and its paired 95 % interval over those steps, the max relative
  loss difference over the run, the gradient
  agreement of the LoRA gradients at step 1 and at the last step (cosine similarity, and the worst tensor's
  max |g - g_ref| / max |g_ref|), and the patch report's call counters.

At step 1 peft's LoRA B matrices are zero, so every lora_A gradient is exactly zero for every implementation; the
step-1 agreement is that of the lora_B gradients (the zero ones are checked to be zero on both sides). The
last-step agreement covers all adapters, but also includes the drift of the weights over the earlier steps.

float16 runs use a ``torch.amp.GradScaler`` (the same for every implementation); bfloat16 and float32 need none.

Needs ``peft`` and ``datasets``:  python -m pip install -e ".[finetune]"
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "lora_notes.txt"
INSTALL_HINT = 'python -m pip install -e ".[finetune]"'
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROG = "finetune_lora.py"


class UsageError(Exception):
    """Bad input or a missing optional dependency: one line on stderr, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    ap.add_argument("--model", default=None,
                    help="llm_attn.models preset (tiny, llama-3-8b), optionally with the weight dtype as in "
                         "load_model specs (llama-3-8b:fp16); default llama-3-8b on cuda, tiny on cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weight dtype; default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--impl", nargs="+", default=["sdpa", "llm_attn"],
                    help="implementations to compare, the first is the reference; 'sdpa' = stock (unpatched), "
                         "others = patch_model(model, impl=NAME)")
    ap.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto",
                    help="patch_model backend for the patched implementations")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps; default 20 on cuda, 2 on cpu")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence; default 2048 on cuda, 128 on cpu")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each decoder layer in the backward (less activation memory)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="UTF-8 text file (datasets 'text' builder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="also write the results to this JSON file (the steps done so far every 10 steps, "
                         "\"complete\": false, until the run ends)")
    ap.add_argument("--fail-above", type=float, default=None, metavar="RTOL",
                    help="exit 1 when the max relative loss difference exceeds RTOL")
    return ap


def _import_optional():
    missing = []
    for name in ("peft", "datasets"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"{' and '.join(missing)} not installed; run: {INSTALL_HINT}")


def resolve_args(args):
    """Fill device-dependent defaults and check everything that can be checked before building the model."""
    import torch

    from llm_attn import registry
    from llm_attn.models import PRESETS

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda but CUDA is not available (torch {torch.__version__})")
    gpu = args.device == "cuda"
    args.model = args.model or ("llama-3-8b" if gpu else "tiny")
    if ":" in args.model:  # "llama-3-8b:fp16": the preset and its weight dtype
        args.model, _, suffix = args.model.partition(":")
        if suffix not in DTYPES:
            raise UsageError(f"--model {args.model}:{suffix}: the suffix must be one of {', '.join(sorted(DTYPES))} "
                             "(random weights of that dtype; quantised checkpoints are not trained here)")
        if args.dtype not in (None, suffix):
            raise UsageError(f"--model {args.model}:{suffix} contradicts --dtype {args.dtype}")
        args.dtype = suffix
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.steps = 20 if args.steps is None and gpu else 2 if args.steps is None else args.steps
    args.seq = args.seq if args.seq is not None else (2048 if gpu else 128)
    if args.model not in PRESETS:
        raise UsageError(f"--model {args.model!r}: unknown preset; known: {', '.join(sorted(PRESETS))}")
    for name, value, low in (("--steps", args.steps, 1), ("--seq", args.seq, 2), ("--batch", args.batch, 1),
                             ("--lora-r", args.lora_r, 1)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    limit = PRESETS[args.model].max_position_embeddings
    if args.seq > limit:
        raise UsageError(f"--seq {args.seq} exceeds the {args.model} preset's max_position_embeddings ({limit})")
    if len(set(args.impl)) != len(args.impl):
        raise UsageError(f"--impl lists an implementation twice: {' '.join(args.impl)}")
    known = registry.names()
    for name in args.impl:
        if name == "sdpa":
            continue
        if name not in known:
            others = ", ".join(n for n in known if n != "sdpa")
            raise UsageError(f"--impl {name!r}: unknown; known: sdpa (stock), {others}")
        why = registry.unavailable_reason(name, args.device)
        if why:
            raise UsageError(f"--impl {name!r} cannot run on {args.device}: {why}")
    if not args.data.is_file():
        raise UsageError(f"--data {args.data}: no such file")
    if args.fail_above is not None and not args.fail_above >= 0:
        raise UsageError(f"--fail-above must be >= 0, got {args.fail_above}")
    return args


# -- data -------------------------------------------------------------------------------------------------------------

def load_token_stream(path: Path):
    """The file through datasets' local 'text' builder (one row per paragraph), as UTF-8 byte ids."""
    import torch
    from datasets import load_dataset

    with tempfile.TemporaryDirectory(prefix="llm_attn_lora_ds_") as cache:
        ds = load_dataset("text", data_files={"train": str(path)}, sample_by="paragraph", split="train",
                          cache_dir=cache)
        paragraphs = [row["text"].strip() for row in ds]
    text = "\n\n".join(p for p in paragraphs if p)
    if not text:
        raise UsageError(f"--data {path}: no text")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long), len(paragraphs)


def make_batches(stream, steps: int, batch: int, seq: int, seed: int):
    """``steps`` tensors of (batch, seq) windows of the stream at seeded offsets (the stream repeats as needed)."""
    import torch

    reps = -(-(seq + 1) // stream.numel()) + 1
    stream = stream.repeat(reps)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq + 1, (steps, batch), generator=gen)
    return [torch.stack([stream[s:s + seq] for s in row.tolist()]) for row in starts]


# -- model ------------------------------------------------------------------------------------------------------------

def build_lora_model(args):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llm_attn.models import llama_config

    dtype = getattr(torch, DTYPES[args.dtype])
    cfg = llama_config(args.model, attention_dropout=0.0)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.requires_grad_(False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    torch.manual_seed(args.seed + 1)
    try:
        peft_model = get_peft_model(model, lora)
    except ImportError as e:  # e.g. peft with gptqmodel installed but not optimum
        raise UsageError(f"peft cannot build LoRA layers here: {str(e).splitlines()[0]} (run: {INSTALL_HINT})") from e
    peft_model.train()
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in trainable.items()}
    return peft_model, model, trainable, init


def _sync(device: str):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class ImplRun:
    """One implementation's training: its own copy of the adapters, its AdamW and GradScaler, its step times, losses
    and gradients. The implementations share one model and take turns step by step (``train_interleaved``), each
    restoring its adapters before its step and saving them after, so they train the same trajectory from the same
    init but their steps are timed side by side."""

    def __init__(self, impl: str, args, trainable: dict, init: dict):
        import torch

        self.impl, self.args, self.trainable = impl, args, trainable
        self.values = {n: t.clone() for n, t in init.items()}  # this implementation's adapters between its steps
        self.fp16 = args.dtype == "fp16"
        self.opt = torch.optim.AdamW(list(trainable.values()), lr=args.lr, weight_decay=0.0)
        self.scaler = torch.amp.GradScaler(args.device, init_scale=2.0**12, enabled=self.fp16)
        self.times, self.losses, self.skipped, self.grads = [], [], [], {}
        self.native, self.fallback, self.peak = {}, {}, 0.0

    def step(self, step: int, ids, base, peft_model, last: int):
        import torch

        from llm_attn.patches import patch_model, unpatch_model

        args = self.args
        with torch.no_grad():
            for n, p in self.trainable.items():
                p.copy_(self.values[n])
                p.grad = None
        report = None
        if self.impl != "sdpa":
            report = patch_model(base, impl=self.impl, on_unsupported="error", backend=args.backend)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # Python's cyclic garbage collector paused over the timed step, as timeit does: a collection landing inside
        # one implementation's step (tens of ms on a model's autograd graph) would be noise in the paired interval.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            ids = ids.to(args.device)
            _sync(args.device)
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = peft_model(input_ids=ids, labels=ids).loss
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            scale_before = self.scaler.get_scale() if self.fp16 else None
            self.scaler.step(self.opt)
            self.scaler.update()
            _sync(args.device)
            self.times.append(time.perf_counter() - t0)
            self.losses.append(loss.item())
            if self.fp16 and self.scaler.get_scale() < scale_before:
                self.skipped.append(step)  # inf/nan gradients: GradScaler skipped the update and lowered the scale
            if step in (1, last):
                self.grads[step] = {n: p.grad.detach().float().clone() for n, p in self.trainable.items()}
        finally:
            if gc_was_enabled:
                gc.enable()
            if report is not None:
                unpatch_model(base)
                for k, v in report.native_calls.items():
                    self.native[k] = self.native.get(k, 0) + v
                for k, v in report.fallback_calls.items():
                    self.fallback[str(k)] = self.fallback.get(str(k), 0) + v
        with torch.no_grad():
            for n, p in self.trainable.items():
                self.values[n].copy_(p)
        if args.device == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() / 2**30)

    def result(self) -> dict:
        out = {"impl": self.impl, "step_s": self.times, "loss": self.losses, "skipped_steps": self.skipped}
        if self.args.device == "cuda":
            out["peak_mem_gib"] = self.peak
        if self.impl != "sdpa":
            out["native_calls"] = dict(self.native)
            out["fallback_calls"] = dict(self.fallback)
        return out


# With --json, the steps done so far are written every this many steps ("complete": false until the end), so a
# run cut short (a time limit, Ctrl-C) keeps what it measured.
CHECKPOINT_EVERY = 10


def train_interleaved(args, peft_model, base, trainable, init, batches, header: dict | None = None) -> list[ImplRun]:
    """Every implementation takes step i before any takes step i + 1, in the listed order on odd steps and the
    reverse on even ones, so that drift (clocks, temperature, the allocator) hits them alike and the step times
    pair up by step for the paired interval. ``header``: the JSON's fields besides the runs, for the partial
    results written every ``CHECKPOINT_EVERY`` steps when ``args.json`` is set."""
    runs = [ImplRun(impl, args, trainable, init) for impl in args.impl]
    last = len(batches)
    for step, ids in enumerate(batches, 1):
        for run in (runs if step % 2 else runs[::-1]):
            try:
                run.step(step, ids, base, peft_model, last)
            except NotImplementedError as e:  # e.g. a backward this build does not have
                raise UsageError(f"--impl {run.impl}: {e}") from e
        if getattr(args, "json", None) and step % CHECKPOINT_EVERY == 0 and step < last:
            write_json(args.json, {**(header or {}), "complete": False, "steps_done": step,
                                   "runs": [r.result() for r in runs]})
    return runs


def write_json(path: Path, result: dict) -> None:
    """``result`` to ``path`` through a temporary file: a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def grad_agreement(got: dict, ref: dict) -> dict:
    """Cosine similarity over all LoRA gradients, and the worst tensor's max|g - g_ref| / max|g_ref|."""
    import torch

    dot = na = nb = 0.0
    worst, worst_name, zero_both = 0.0, None, 0
    for name, r in ref.items():
        g = got[name]
        dot += float((g.double() * r.double()).sum())
        na += float(g.double().square().sum())
        nb += float(r.double().square().sum())
        scale = float(r.abs().max())
        diff = float((g - r).abs().max())
        if scale == 0.0 and diff == 0.0:
            zero_both += 1
            continue
        rel = diff / scale if scale > 0 and math.isfinite(diff) else math.inf  # NaN/inf never looks close
        if worst_name is None or rel > worst:
            worst, worst_name = rel, name
    cos = dot / math.sqrt(na * nb) if na > 0 and nb > 0 else math.nan
    if any(not bool(torch.isfinite(g).all()) for g in got.values()):
        cos = math.nan
    return {"cosine": cos, "max_rel_diff": worst, "worst_tensor": worst_name, "tensors": len(ref),
            "zero_on_both": zero_both}


# -- main -------------------------------------------------------------------------------------------------------------

def train_and_compare(args) -> dict:
    import torch
    from tabulate import tabulate

    stream, n_par = load_token_stream(args.data)
    batches = make_batches(stream, args.steps, args.batch, args.seq, args.seed)
    peft_model, base, trainable, init = build_lora_model(args)
    n_lora = sum(p.numel() for p in trainable.values())
    n_all = sum(p.numel() for p in peft_model.parameters())
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"model {args.model} ({n_all / 1e6:.1f}M params, {args.dtype}, random weights) on {dev_name}; "
          f"LoRA r={args.lora_r} on {'/'.join(LORA_TARGETS)}: {n_lora / 1e6:.2f}M trainable; "
          f"data {args.data.name}: {n_par} paragraphs, {stream.numel()} byte tokens; "
          f"{args.steps} steps x batch {args.batch} x seq {args.seq}"
          f"{'; gradient checkpointing' if args.gradient_checkpointing else ''}", flush=True)

    header = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "device": dev_name, "torch": torch.__version__}
    trained = train_interleaved(args, peft_model, base, trainable, init, batches, header)
    runs, grads = [t.result() for t in trained], [t.grads for t in trained]

    ref = runs[0]
    rows = []
    for i in range(args.steps):
        row = [i + 1]
        for r in runs:
            row += [r["step_s"][i] * 1e3, r["loss"][i]]
        row += [abs(r["loss"][i] - ref["loss"][i]) / abs(ref["loss"][i]) for r in runs[1:]]
        rows.append(row)
    headers = ["step"] + [h for r in runs for h in (f"{r['impl']} ms", f"{r['impl']} loss")]
    headers += [f"rel diff {r['impl']}" for r in runs[1:]]
    print(tabulate(rows, headers=headers, floatfmt=("d",) + (".1f", ".6f") * len(runs) + (".2e",) * (len(runs) - 1)))

    last = args.steps
    for r, g in zip(runs, grads):
        rdiffs = [abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"])]
        r["max_rel_loss_diff"] = max(rdiffs)
        r["median_step_ms"] = _median_ms(r)
        r["grad_step1"] = grad_agreement(g[1], grads[0][1])
        r["grad_last"] = grad_agreement(g[last], grads[0][last])
    print()
    print(summary_table(runs, last))
    result = {**header, "complete": True, "steps_done": args.steps, "runs": runs}
    if args.json:
        write_json(args.json, result)
    return result


def summary_table(runs: list[dict], last: int) -> str:
    """The closing table: per implementation its median step time and the step-time ratio to the first one (its
    median / this one's, > 1 = this one is faster, ``llm_attn.harness.stats.speed_ratio``), stored in each run as
    ``speed_vs_reference``; the loss and gradient agreement; the attention calls."""
    from tabulate import tabulate

    from llm_attn.harness.stats import (format_ratio, format_ratio_interval, paired_ratio_interval, ratio_header,
                                        speed_ratio)

    ref = runs[0]
    summary = []
    for r in runs:
        r["speed_vs_reference"] = speed_ratio(ref["median_step_ms"], r["median_step_ms"])
        speed = format_ratio(r["speed_vs_reference"], 3, words=r is not ref)
        if r is not ref and len(r.get("step_s", ())) > 1:  # steps 2..N paired by step (the same batch, in turn)
            r["speed_interval"] = paired_ratio_interval(ref["step_s"][1:], r["step_s"][1:])
            speed = format_ratio_interval(r["speed_interval"])
        summary.append([
            r["impl"], f"{r['median_step_ms']:.1f}", speed,
            r["max_rel_loss_diff"], r["grad_step1"]["cosine"], r["grad_step1"]["max_rel_diff"],
            r["grad_last"]["cosine"], r["grad_last"]["max_rel_diff"],
            f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-",
            _calls(r), ",".join(map(str, r["skipped_steps"])) or "-"])
    table = tabulate(summary, floatfmt=("", "", "", ".2e", ".6f", ".2e", ".6f", ".2e"), headers=[
        "impl", "median step ms", f"step time {ratio_header(ref['impl'])}", "max rel loss diff", "grad cos step 1",
        "grad max rel step 1", f"grad cos step {last}", f"grad max rel step {last}", "peak GiB", "attention calls",
        "skipped steps"])
    return table + (f"\n(reference: {ref['impl']}; median over steps 2..{last} when there are 2 or more; the ratio is "
                    f"{ref['impl']}'s median step time / this one's, with its 95 % paired-bootstrap interval over "
                    f"those steps (the implementations took every step in turn, on the same batch); gradients are the "
                    f"LoRA gradients after unscaling; "
                    f"at step 1 lora_A gradients are 0 for every implementation because lora_B starts at 0)")


def _median_ms(r) -> float:
    t = r["step_s"][1:] if len(r["step_s"]) > 1 else r["step_s"]
    return statistics.median(t) * 1e3


def _calls(r) -> str:
    if "native_calls" not in r:
        return "stock"
    native = ", ".join(f"{k} {v}" for k, v in r["native_calls"].items()) or "none"
    fallback = sum(r["fallback_calls"].values())
    return f"{native}; fallback {fallback}"


def main(argv=None) -> dict:
    """Run the example; returns the results dict (raises SystemExit(2) on bad input or missing dependencies)."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local file only: never reach the Hub
    try:
        _import_optional()
        resolve_args(args)
        result = train_and_compare(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.fail_above is not None:
        worst = max(r["max_rel_loss_diff"] for r in result["runs"])
        if not worst <= args.fail_above:
            print(f"{PROG}: max relative loss difference {worst:.3e} exceeds --fail-above {args.fail_above}",
                  file=sys.stderr)
            raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
