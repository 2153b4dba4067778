"""Result rows: one JSON object per line, one line per measurement.

Every row carries its raw samples, the statistics derived from them, the environment and the command that
reproduces it (see ``llm_attn.ttft`` for the CLI). Rows are appended, flushed and fsync'ed one at a time, so a
crash, an out-of-memory or Ctrl-C never loses a finished measurement, and a re-run resumes by skipping the points
whose rows are already on disk (``point_key``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

# 2: the environment's kernel_backend is called kernel_build (how the kernel was compiled: aot | nvrtc | None).
SCHEMA = "llm_attn.ttft/2"
# Older row formats this code still reads, after upgrade_row.
OLD_SCHEMAS = ("llm_attn.ttft/1",)
READABLE_SCHEMAS = (SCHEMA, *OLD_SCHEMAS)

MEASUREMENTS = ("ttft", "decode_generate", "decode_graph", "correctness", "breakdown", "ttft_graph",
                "ttft_graph_static", "ttft_dataset")  # ttft_dataset: --seq dataset (harness.session.run_dataset)
KINDS = MEASUREMENTS + ("error",)
# unsupported: the stock path cannot be measured that way (e.g. eager attention inside a CUDA graph).
STATUSES = ("ok", "oom", "unsupported", "error")

# The KV cache a row's prefill and decode ran on (its "kv_cache" field, --kv-cache): "fp16" is transformers' own
# cache in the model's dtype, "fp8" the FP8 (e4m3) cache of llm_attn.models.kv_cache (how each attention call read it:
# the row's attention_calls.kv_cache_reads, for patched implementations; stock reads it through a dequantised
# copy. Rows without the field ran on "fp16".
KV_CACHES = ("fp16", "fp8")

# Fields every row has, whatever its kind.
COMMON_FIELDS = ("schema", "kind", "measurement", "status", "experiment", "run_id", "time", "device", "model_spec",
                 "model", "impl", "dtype", "batch", "seq", "new_tokens", "env", "command")
# Fields a successful row of each kind adds.
KIND_FIELDS = {
    "ttft": ("samples_ms", "stats", "timer", "warmup", "repeats", "peak_mem_bytes", "model_flops"),
    "decode_generate": ("samples_ms", "stats", "run_tpot_ms", "tpot_ms", "tok_s", "timer", "peak_mem_bytes",
                        "bytes_per_token"),
    "decode_graph": ("samples_ms", "stats", "run_tpot_ms", "tpot_ms", "tok_s", "timer", "mode", "peak_mem_bytes",
                     "bytes_per_token"),
    "correctness": ("reference_impl", "max_abs_logit_diff", "greedy_agreement", "first_divergence",
                    "tokens_reference", "tokens_impl"),
    "ttft_graph": ("samples_ms", "stats", "timer", "mode", "cache", "attention_kernels", "peak_mem_bytes"),
    "ttft_graph_static": ("samples_ms", "stats", "timer", "mode", "cache", "attention_kernels", "peak_mem_bytes"),
    "breakdown": ("span_ms", "category_ms", "category_pct", "ttft_if_attention_zero_ms", "attention_attribution"),
    # --seq dataset: one sample per prompt (the median of its paired repeats), at the prompts' own lengths.
    "ttft_dataset": ("samples_ms", "stats", "timer", "warmup", "repeats", "lengths", "length_distribution",
                     "prompts", "paired"),
    "error": ("error",),
}


def jsonable(obj):
    """Plain JSON types for dataclasses, torch dtypes/devices, paths and numpy scalars; NaN/inf become None
    (strict JSON has no NaN, and a missing number must not read as a measured one)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / 0-d torch scalars
        return jsonable(obj.item())
    if hasattr(obj, "__dict__"):
        return {k: jsonable(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return str(obj)


def point_key(row: dict) -> tuple:
    """What identifies a measurement for resumption. Repeats/warm-up are not part of it: re-running an interrupted
    sweep with the same definition must find its finished points. TTFT and the prefill breakdown do not depend on
    ``new_tokens``."""
    measurement = row["measurement"]
    new_tokens = None if measurement in ("ttft", "breakdown", "ttft_graph", "ttft_graph_static", "ttft_dataset") \
        else row.get("new_tokens")
    # decode_graph with --context: the KV length is part of the point (absent, and so None, everywhere else); so is
    # --prefill-chunk where a row carries it (absent in rows without chunking), and the KV cache (absent: fp16, so
    # rows written before --kv-cache resume as fp16 points).
    return (row.get("experiment"), row.get("model_spec"), row.get("dtype"), row.get("impl"), row.get("batch"),
            row.get("seq"), new_tokens, measurement, row.get("context") if measurement == "decode_graph" else None,
            row.get("prefill_chunk"), row.get("kv_cache") or "fp16")


def is_finished(row: dict) -> bool:
    """A point counts as done when it was measured, ran out of memory or is unsupported (re-running would only
    give the same). Other errors are retried on resumption."""
    return row.get("status") in ("ok", "oom", "unsupported")


def upgrade_row(row: dict) -> dict:
    """A row of an older schema (OLD_SCHEMAS) in the current one's words; other rows are returned as they are."""
    if row.get("schema") == "llm_attn.ttft/1":
        row = dict(row, schema=SCHEMA)
        env = row.get("env")
        if isinstance(env, dict) and "kernel_backend" in env:
            env = dict(env)
            env.setdefault("kernel_build", env.pop("kernel_backend"))
            row["env"] = env
    return row


def validate_row(row: dict) -> None:
    """Raise ValueError naming the first problem; used by tests and by the report to reject foreign files."""
    if row.get("schema") != SCHEMA:
        raise ValueError(f"schema is {row.get('schema')!r}, expected {SCHEMA!r}")
    missing = [f for f in COMMON_FIELDS if f not in row]
    if missing:
        raise ValueError(f"row misses fields {missing}")
    if row["kind"] not in KINDS:
        raise ValueError(f"unknown kind {row['kind']!r}")
    if row["measurement"] not in MEASUREMENTS:
        raise ValueError(f"unknown measurement {row['measurement']!r}")
    if row["status"] not in STATUSES:
        raise ValueError(f"unknown status {row['status']!r}")
    if (row["kind"] == "error") != (row["status"] != "ok"):
        raise ValueError(f"kind {row['kind']!r} does not match status {row['status']!r}")
    if row["kind"] != "error" and row["kind"] != row["measurement"]:
        raise ValueError(f"kind {row['kind']!r} != measurement {row['measurement']!r}")
    missing = [f for f in KIND_FIELDS[row["kind"]] if f not in row]
    if missing:
        raise ValueError(f"{row['kind']} row misses fields {missing}")
    if row.get("kv_cache", "fp16") not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {row['kv_cache']!r}")
    if "samples_ms" in KIND_FIELDS[row["kind"]] and not row["samples_ms"]:
        raise ValueError(f"{row['kind']} row has no samples")


class OutputWriteError(RuntimeError):
    """The results file cannot be created or written (a directory, no permission, disk full): the CLIs turn it
    into a one-line message and exit status 2."""

    def __init__(self, path, err: OSError):
        super().__init__(f"cannot write results to {path}: {err.strerror or err}")


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot take a results file, checked before a long run starts; None when it looks writable.
    (A full disk shows only when writing: ResultWriter raises OutputWriteError then.)"""
    p = Path(path)
    if p.is_dir():
        return "is a directory; give a file name, e.g. --out runs/results.jsonl"
    if p.exists():
        return None if os.access(p, os.W_OK) else "is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot create files in {parent}"


class ResultWriter:
    """Appends rows to a JSONL file; each row is flushed and fsync'ed before ``write`` returns. Any OSError of the
    file (a directory, no permission, disk full) is raised as OutputWriteError."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A row cut by a kill or a full disk would glue itself to the next row written: move it aside first.
            # The command lines do this before the model loads and say so; here it is said if it was left to do.
            note = repair_cut_rows(self.path)
            if note:
                print(note, file=sys.stderr, flush=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        except OSError as e:
            raise OutputWriteError(self.path, e) from e
        self.rows_written = 0

    def write(self, row: dict) -> None:
        line = json.dumps(jsonable(row), allow_nan=False, separators=(",", ":"))
        try:
            self._fh.write(line + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as e:
            raise OutputWriteError(self.path, e) from e
        self.rows_written += 1

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as e:  # the buffered tail could not be written
            raise OutputWriteError(self.path, e) from e

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def iter_rows(path: str | os.PathLike, strict: bool = False) -> Iterator[dict]:
    """Rows of one JSONL file. A line that does not parse (a row cut by a crash) is skipped unless ``strict``."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if strict:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
                continue
            yield row


def numbered_lines(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) of every non-blank line of a JSONL file; the value is ``NOT_JSON`` for a line
    that does not parse. For readers that report which lines they skip."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError:
                yield lineno, NOT_JSON


NOT_JSON = object()


def result_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The .jsonl files named, or found recursively under the folders named, sorted for a stable order."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such results file or folder: {p}")
    return files


# Every row the writer writes starts with these bytes (``schema`` is the first key of a row).
ROW_START = b'{"schema":"llm_attn.ttft/'


def _cut_rows(data: bytes) -> list[tuple[int, int, int]]:
    """(line number, start offset, end offset) of the rows that a killed writer or a full disk left unfinished: lines
    that are not JSON and are either the file's last line without its newline (after at least one line, or starting
    like a row) or start like a row (a cut row that an older version terminated and appended after)."""
    cut, start, lineno = [], 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        lineno += 1
        raw = data[start:end].strip()
        if raw:
            try:
                json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                unterminated = end == len(data) and not data.endswith(b"\n")
                row_like = raw.startswith(ROW_START) or ROW_START.startswith(raw)
                if row_like or (unterminated and start > 0):
                    cut.append((lineno, start, end))
        start = end
    return cut


def repair_cut_rows(path: str | os.PathLike) -> str | None:
    """Move the rows cut by an interrupted write (``_cut_rows``: a killed writer, a full disk) from ``path`` to
    ``<path>.corrupt`` (appended there, one per line), so that the file holds whole rows only and a run can append
    to it and resume from it. Returns the one line that says what was moved, or None when nothing was cut."""
    p = Path(path)
    if not p.is_file():
        return None
    data = p.read_bytes()
    cut = _cut_rows(data)
    if not cut:
        return None
    corrupt = p.with_name(p.name + ".corrupt")
    with open(corrupt, "ab") as fh:
        for _, start, end in cut:
            fh.write(data[start:end].rstrip(b"\n") + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    if len(cut) == 1 and cut[0][2] == len(data):  # the common case, the last line: cut it off in place
        with open(p, "rb+") as fh:
            fh.truncate(cut[0][1])
    else:
        keep, pos = [], 0
        for _, start, end in cut:
            keep.append(data[pos:start])
            pos = end
        keep.append(data[pos:])
        tmp = p.with_name(p.name + ".repairing")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, p)
    what = "a row" if len(cut) == 1 else f"{len(cut)} rows"
    return (f"{p}: moved {what} cut by an interrupted write (a killed run or a full disk; line "
            f"{', '.join(str(n) for n, _, _ in cut)}) to {corrupt}; its point is measured again")


def results_file_problem(path: str | os.PathLike) -> str | None:
    """Why an existing file cannot be appended to or resumed from as a results file, naming the file and line;
    None when it does not exist, is empty, or every line is a row of a readable schema with the fields resume reads
    (``point_key``). Checked before the model loads: a run must not append after garbage, and --resume must not fail
    half-way on a row it cannot read. Rows cut by an interrupted write (``_cut_rows``) are allowed: ``repair_cut_rows``
    moves them aside before anything is appended, and only those points are measured again."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = p.read_bytes()
    except OSError as e:
        return f"{p}: cannot read it: {e.strerror or e}"
    cut = {lineno for lineno, _, _ in _cut_rows(data)}
    rows = 0
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip() or lineno in cut:
            continue
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if not rows:
                return f"{p}:{lineno}: not a results file (the line is not JSON); give another --out"
            return f"{p}:{lineno}: not a JSON row; remove or fix that line"
        if not isinstance(row, dict):
            return f"{p}:{lineno}: not a results row (a JSON {type(row).__name__}, not an object)"
        if row.get("schema") not in READABLE_SCHEMAS:
            return (f"{p}:{lineno}: not a {SCHEMA} row (schema {row.get('schema')!r}); give another --out for this "
                    "run's results")
        missing = [f for f in ("measurement", "status") if f not in row]
        if missing or row["measurement"] not in MEASUREMENTS:
            return f"{p}:{lineno}: a broken row (" + (f"no {', '.join(missing)}" if missing else
                                                        f"unknown measurement {row['measurement']!r}") + ")"
        rows += 1
    return None


def finished_keys(path: str | os.PathLike) -> set[tuple]:
    """Keys of the points already measured (or OOM) in ``path``; empty when the file does not exist yet."""
    if not Path(path).exists():
        return set()
    return {point_key(r) for r in iter_rows(path) if r.get("schema") in READABLE_SCHEMAS and is_finished(r)}
