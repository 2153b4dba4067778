"""What one measurement session needs, whoever drives it (``python -m llm_attn.ttft``, ``python -m
llm_attn.experiment``, a notebook): defaults for the device, dtype and prompt lengths, checks made before anything
heavy happens, loading the model, running a sweep into a results file and summarising its rows.

The checks return a problem as a sentence (or raise ``ValueError``) rather than exiting: the command lines turn it
into one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from llm_attn.envinfo import capture_env, device_name
from llm_attn.harness.devices import find_device, load_devices
from llm_attn.harness.results import ResultWriter, finished_keys
from llm_attn.harness.sweep import DTYPES, Sweep, SweepConfig, breakdown_table, correctness_table, summary_table

DEFAULT_SEQS = {"cuda": [512, 1024, 2048], "cpu": [32, 64]}


def default_dtype(spec: str, device: str) -> str:
    """float16 on a GPU; float32 on CPU (fast and exact there), except for an AWQ preset, whose int4 kernels
    compute in float16."""
    return "float16" if device == "cuda" or spec.endswith(":awq") else "float32"


def resolve_device(choice: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'. Raises ValueError for 'cuda' without a GPU."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is visible to torch "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    return choice


def model_spec_problem(spec: str) -> str | None:
    """A model path that does not exist, said before anything heavy happens; None otherwise. Presets, hub ids
    and the rest are checked by ``llm_attn.models.load_model``, whose errors say what it accepts."""
    from llm_attn.models import PRESETS  # noqa: PLC0415 (heavy: keep --help fast)

    if spec == "auto" or spec.partition(":")[0] in PRESETS or Path(spec).expanduser().exists():
        return None
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or spec.endswith((".safetensors", ".json")):
        return "no such file or directory"
    return None


def resolve_model_spec(spec: str, device: str) -> tuple[str, str | None]:
    """'auto' -> the preset it means on ``device`` (``llm_attn.models.auto_spec``: on a GPU without an AWQ int4
    backend, the 8B model in fp16) and a line to print about that choice; any other spec as it is."""
    if spec != "auto":
        return spec, None
    from llm_attn.models import auto_spec  # noqa: PLC0415

    return auto_spec(device)


def resource_problem(spec: str, device: str, dtype: str, allow_dequant_fallback: bool = False) -> str | None:
    """Whether the model can run here: an AWQ backend for an AWQ preset, the device's free memory, the cache's free
    disk (``llm_attn.models.resource_problem``), checked before anything is generated or loaded."""
    from llm_attn.models import resource_problem as problem  # noqa: PLC0415

    return problem(spec, device, DTYPES[dtype], allow_dequant_fallback=allow_dequant_fallback)


def describe_model(info, device: str, spec: str = "auto") -> str:
    get = (lambda k: info.get(k)) if isinstance(info, dict) else (lambda k: getattr(info, k, None))
    parts = [str(get("quant"))]
    if get("awq_backend"):
        parts.append(f"AWQ backend {get('awq_backend')}")
    if get("dequant_fallback"):
        parts.append("DEQUANTISED FP16 FALLBACK: the int4 linear layers are NOT what runs")
    line = f"model: {get('name')} ({', '.join(parts)}; source {get('source')}) on {device_name(device)}"
    if device == "cpu":
        auto = " (no GPU here, so 'auto' is the tiny Llama-architecture model)" if spec == "auto" else ""
        line += (f"\non CPU{auto}: llm_attn runs through the PyTorch reference, not the CUDA kernel; "
                 "these timings check the harness and say nothing about the kernel")
    return line


def load(spec: str, device: str, dtype: str, allow_dequant_fallback: bool):
    from llm_attn.models import load_model  # noqa: PLC0415

    return load_model(spec, device=device, dtype=DTYPES[dtype], allow_dequant_fallback=allow_dequant_fallback,
                      attn_implementation="sdpa")


def default_seqs(model, device: str, new_tokens: int) -> list[int]:
    """The default lengths that fit the model with the decoded tokens (a small model may allow fewer positions)."""
    from llm_attn.models import max_seq_len  # noqa: PLC0415

    limit = max_seq_len(model) - new_tokens
    return [s for s in DEFAULT_SEQS[device] if s <= limit] or [max(1, limit)]


def length_problem(model, seqs: list[int], new_tokens: int, measurements: list[str],
                   names: tuple[str, str] = ("--seq", "--new-tokens")) -> str | None:
    """The first prompt length the model cannot take (with the decoded tokens when a decode is measured), as a
    sentence naming the option (``names``); None when every length fits."""
    from llm_attn.models import max_seq_len  # noqa: PLC0415

    limit = max_seq_len(model)
    decodes = any(m not in ("ttft", "breakdown") for m in measurements)
    for s in seqs:
        need = s + new_tokens if decodes else s
        if need > limit:
            return (f"{names[0]} {s}: longer than the model allows ({limit} positions)"
                    + (f"; decode needs seq + {names[1]} = {need} positions" if decodes and s <= limit else ""))
    return None


def _device_entry(env: dict, devices_path):
    try:
        return find_device(env["device_name"], load_devices(devices_path))
    except (OSError, ValueError) as e:
        print(f"warning: device table unusable ({e}); no %-of-peak or bandwidth bound", file=sys.stderr)
        return None


def run(cfg: SweepConfig, model, info, out: str | Path, resume: bool, devices_path: str | Path | None,
        progress: bool = True, argv: list[str] | None = None, prompts=None) -> tuple[list[dict], int]:
    """Measure ``cfg`` on a loaded model, appending rows to ``out``. Returns (rows written, number of measurements
    skipped because ``resume`` found them in ``out``). ``prompts``: a ``DatasetPrompts`` (--prompts) whose text
    replaces the seeded random prompts."""
    env = capture_env(cfg.device)
    entry = _device_entry(env, devices_path)
    done = finished_keys(out) if resume else set()
    with ResultWriter(out) as writer:
        # Progress bars draw only on a terminal; elsewhere (``cmd > log 2>&1``, CI) a plain line per finished
        # measurement keeps the log moving.
        logged = _LineLogger(writer) if not (progress and sys.stderr.isatty()) else writer
        sweep = Sweep(cfg, model, info, env, logged, entry, done=done, progress=progress, argv=argv,
                      prompts=prompts.batch if prompts is not None else None,
                      row_extra=prompts.row_extra() if prompts is not None else None)
        rows = sweep.run()
    return rows, sweep.skipped


# -- --prompts: text from a dataset (harness/prompts.py) -------------------------------------------------------------
class DatasetPrompts:
    """The texts of ``--prompts`` and the model's tokenizer: ``batch(b, s)`` gives (b, s) token ids (each text cut
    or repeated to s), ``each(max_seq)`` one prompt per text at its own length (``--seq dataset``)."""

    def __init__(self, source: str, texts: list[str], field: str | None, tokenizer, vocab_size: int | None):
        self.source, self.texts, self.field = source, texts, field
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def batch(self, batch: int, seq: int):
        from llm_attn.harness.prompts import prompt_batch  # noqa: PLC0415

        return prompt_batch(self.tokenizer, self.texts, batch, seq, self.vocab_size)

    def each(self, max_seq: int):
        from llm_attn.harness.prompts import PromptsError, dataset_prompts  # noqa: PLC0415

        out = dataset_prompts(self.tokenizer, self.texts, max_seq)
        if not out:
            raise PromptsError(f"--prompts {self.source}: every text tokenized to zero tokens")
        too_big = [int(p.max()) for p in out if self.vocab_size is not None and int(p.max()) >= self.vocab_size]
        if too_big:
            raise PromptsError(f"--prompts: the tokenizer produced id {too_big[0]}, beyond the model's vocabulary "
                               f"({self.vocab_size})")
        return out

    def row_extra(self, dataset: bool = False) -> dict:
        args = ["--prompts", self.source] + (["--prompt-field", self.field] if self.field else [])
        return {"prompts": {"source": self.source, "field": self.field, "texts": len(self.texts),
                            "tokenizer": getattr(self.tokenizer, "name_or_path", None),
                            "seq_mode": "dataset" if dataset else "cut_or_repeat"},
                "command_args": args}


def load_prompt_texts(source: str, field: str | None, limit: int | None) -> list[str]:
    """The texts of ``--prompts`` (before the model loads, so a bad source costs nothing); PromptsError."""
    from llm_attn.harness.prompts import load_texts  # noqa: PLC0415

    return load_texts(source, field, limit=limit)


def dataset_prompts_for(model, info, source: str | None, texts: list[str] | None,
                        field: str | None) -> DatasetPrompts | None:
    """``DatasetPrompts`` with the tokenizer saved beside the loaded checkpoint (``info.path``), or None without
    ``--prompts`` (``texts`` None). A source the tokenizer cannot serve is a SetupError (one line)."""
    from llm_attn.harness.prompts import PromptsError, load_tokenizer  # noqa: PLC0415

    if texts is None:
        return None
    get = (lambda k: info.get(k)) if isinstance(info, dict) else (lambda k: getattr(info, k, None))
    path = get("path") or getattr(model, "name_or_path", None)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        return DatasetPrompts(source, texts, field, load_tokenizer(path), getattr(cfg, "vocab_size", None))
    except PromptsError as e:
        raise SetupError(str(e)) from None


def run_dataset(cfg: SweepConfig, model, info, out: str | Path, prompts: DatasetPrompts, max_seq: int,
                devices_path: str | Path | None, progress: bool = True, argv: list[str] | None = None) -> list[dict]:
    """``--seq dataset``: TTFT over the dataset's own length distribution, every implementation paired prompt by
    prompt (``paired.measure_ttft_over_prompts``). One ``ttft_dataset`` row per implementation (``seq`` = the
    longest prompt; ``length_distribution`` and ``lengths`` say the rest; ``stats`` p50/p90 are over prompts)."""
    import traceback  # noqa: PLC0415

    from tqdm.auto import tqdm  # noqa: PLC0415

    from llm_attn.harness import hostenv  # noqa: PLC0415
    from llm_attn.harness.impls import is_stock, use_impl  # noqa: PLC0415
    from llm_attn.harness.paired import measure_ttft_over_prompts, paired_verdicts  # noqa: PLC0415
    from llm_attn.harness.prompts import length_distribution  # noqa: PLC0415

    device = torch.device(cfg.device)
    each = [p.to(device) for p in prompts.each(max_seq)]
    dist = length_distribution(each)
    env = capture_env(cfg.device)
    entry = _device_entry(env, devices_path)
    with ResultWriter(out) as writer:
        sweep = Sweep(cfg, model, info, env, writer, entry, progress=progress, argv=argv,
                      row_extra=prompts.row_extra(dataset=True))
        seq = dist["max"]
        bases = {i: sweep._base("ttft_dataset", i, 1, seq, cfg.impls) for i in cfg.impls}
        command = " ".join(["python -m llm_attn.ttft --seq dataset", *(f"--impl {' '.join(cfg.impls)}".split()),
                            "--model", cfg.model_spec, "--dtype", cfg.dtype, "--device", cfg.device,
                            "--warmup", str(cfg.warmup), "--repeats", str(cfg.repeats),
                            "--prompt-count", str(len(prompts.texts)), *prompts.row_extra()["command_args"]])
        start = hostenv.snapshot(device)
        failure = None
        with tqdm(total=len(each), desc="prompts", unit="prompt", disable=None if progress else True,
                  file=sys.stderr) as bar:
            try:
                got = measure_ttft_over_prompts(model, each, cfg.impls, cfg.warmup, cfg.repeats, switch=use_impl,
                                                seed=cfg.seed, on_prompt=bar.update)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 (recorded as the rows' error)
                failure = ("oom" if "OutOfMemory" in type(e).__name__ else "error", type(e).__name__, str(e),
                           traceback.format_exc())
        span = hostenv.span(start, hostenv.snapshot(device))
        stocks = [i for i in cfg.impls if is_stock(i)]
        for impl in cfg.impls:
            base = {**bases[impl], "command": command, "host_env": span, "length_distribution": dist}
            if failure is not None:
                sweep._emit_error(base, *failure)
                continue
            row = {**base, **got[impl]}
            row["vs"] = paired_verdicts(row, stocks, seed=cfg.seed)
            sweep._emit(row)
    return sweep.rows


def dataset_table(rows: list[dict], tablefmt: str = "github") -> str:
    """``--seq dataset`` rows: TTFT p50 / p90 over the dataset's prompts, with the paired verdict vs stock."""
    from tabulate import tabulate  # noqa: PLC0415

    from llm_attn.harness.stats import ratio_header  # noqa: PLC0415
    from llm_attn.harness.sweep import latest_rows, row_notes, verdict_cell  # noqa: PLC0415

    ds = [r for r in latest_rows(rows).values() if r.get("measurement") == "ttft_dataset"]
    if not ds:
        return ""
    stocks = [s for s in ("sdpa", "eager", "flash_attention_2") if any(r["impl"] == s for r in ds)]
    p50 = {(r["run_id"], r["impl"]): r["stats"]["p50"] for r in ds if r["status"] == "ok"}
    table = []
    for r in ds:
        d = r.get("length_distribution") or {}
        ok = r["status"] == "ok"
        table.append([r["model"].get("name"), r["impl"], (r.get("prompts") or {}).get("source", ""),
                      d.get("count", ""), f"{d['p50']:.0f} / {d['p90']:.0f}" if d else "",
                      f"{r['stats']['p50']:.2f}" if ok else r["status"].upper(),
                      f"{r['stats']['p90']:.2f}" if ok else "",
                      *[verdict_cell(r, s, p50.get((r["run_id"], s)), p50.get((r["run_id"], r["impl"])))
                        for s in stocks],
                      "; ".join(row_notes(r))])
    return "TTFT over the dataset's own prompt lengths (--seq dataset)\n" + tabulate(
        table, headers=["model", "impl", "prompts", "n", "tokens p50 / p90", "TTFT p50 ms", "TTFT p90 ms",
                        *[ratio_header(s) for s in stocks], "notes"], tablefmt=tablefmt, disable_numparse=True)


class _LineLogger:
    """A ResultWriter that also prints one line per row written to stderr: what was measured, its outcome, and
    the time since the session started."""

    def __init__(self, writer: ResultWriter):
        self.writer, self.t0 = writer, time.perf_counter()

    def write(self, row: dict) -> None:
        self.writer.write(row)
        stats = row.get("stats") if isinstance(row.get("stats"), dict) else {}
        what = f"p50 {stats['p50']:.2f} ms" if stats.get("p50") is not None else row.get("status")
        if row.get("status") not in ("ok", None):
            what = f"{row.get('status')}: {str((row.get('error') or {}).get('message', ''))[:100]}" \
                if isinstance(row.get("error"), dict) else row.get("status")
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {row.get('measurement')} {row.get('impl')} "
              f"b={row.get('batch')} s={row.get('seq')}: {what}", file=sys.stderr, flush=True)

    def __getattr__(self, name):  # rows_written, path, close, ...
        return getattr(self.writer, name)


def rows_tables(rows: list[dict], wide: bool = False) -> str:
    """The summary table (``harness.compact``'s 120 columns, or with ``wide`` every column), then the correctness and
    breakdown tables where the rows have them."""
    from llm_attn.harness.compact import compact_table  # noqa: PLC0415

    parts = []
    if any(r.get("measurement") != "ttft_dataset" for r in rows):
        parts.append(summary_table(rows) if wide else compact_table(rows) or summary_table(rows))
    parts += [t for t in (dataset_table(rows), correctness_table(rows), breakdown_table(rows)) if t]
    return "\n\n".join(parts)


def rows_summary(rows: list[dict], out: str | Path) -> tuple[str, int]:
    """The closing line of a session and its exit status (1 when some point failed for another reason than OOM or
    a stock path that cannot be measured that way, e.g. eager attention inside a CUDA graph)."""
    failed = [r for r in rows if r["status"] == "error"]
    ooms = [r for r in rows if r["status"] == "oom"]
    unsupported = [r for r in rows if r["status"] == "unsupported"]
    line = (f"{len(rows)} rows appended to {out}"
            + (f"; {len(ooms)} out of memory" if ooms else "")
            + (f"; {len(unsupported)} unsupported (see their rows)" if unsupported else "")
            + (f"; {len(failed)} FAILED (see the 'error' rows and the messages above)" if failed else ""))
    return line, (1 if failed else 0)


class SetupError(ValueError):
    """A model that cannot be loaded, or prompt lengths it cannot take: one line for the user."""


def load_checked(spec: str, device: str, dtype: str, allow_dequant_fallback: bool, seqs: list[int] | None,
                 new_tokens: int, measurements: list[str], names: tuple[str, str, str] = ("--model", "--seq",
                                                                                          "--new-tokens")):
    """Load ``spec`` and check the prompt lengths against it (``seqs`` None: the defaults that fit). Returns
    (model, info, seqs); raises SetupError, whose message starts with the option it is about (``names``: model,
    lengths, new tokens). KeyboardInterrupt goes through."""
    try:
        model, info = load(spec, device, dtype, allow_dequant_fallback)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 (the loader's message says what it accepts: pass it on)
        raise SetupError(f"{names[0]} {spec}: cannot load it: {type(e).__name__}: {e}") from e
    seqs = seqs or default_seqs(model, device, new_tokens)
    problem = length_problem(model, seqs, new_tokens, measurements, names=names[1:])
    if problem:
        raise SetupError(problem)
    return model, info, seqs
