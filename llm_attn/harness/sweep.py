"""Runs a grid of (implementation, batch, prompt length) points through the measurements and writes one row per
measurement as it finishes; builds the llama-bench-like summary table from rows.

Shared by ``python -m llm_attn.ttft`` (one ad-hoc sweep) and ``python -m llm_attn.experiment`` (a TOML
definition, resumable). An out-of-memory or failing measurement becomes an ``error`` row and the sweep goes on.
"""

from __future__ import annotations

import gc
import shlex
import sys
import traceback
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone

import torch
from tabulate import tabulate
from tqdm.auto import tqdm

from llm_attn import registry
from llm_attn.harness import energy, flops, hostenv
from llm_attn.harness.agreement import (
    AGREEMENT_HEADERS,
    AGREEMENT_NOTE,
    MISS_FLIPS_NOTE,
    agreement_cells,
    agreement_misses,
    correctness_names,
    low_precision_note,
)
from llm_attn.harness.breakdown import measure_breakdown
from llm_attn.harness.devices import Device
from llm_attn.harness.impls import BASE_IMPL, impl_info, is_stock, use_impl
from llm_attn.harness.measure import (
    GraphCaptureUnsupported,
    graph_vs_eager_account,
    measure_correctness,
    measure_decode_generate,
    measure_decode_static,
    measure_ttft,
    measure_ttft_graph,
)
from llm_attn.harness.paired import kv_cache_reads, measure_decode_paired, measure_ttft_paired, paired_verdicts
from llm_attn.harness.stats import format_ratio, format_ratio_interval, ratio_header, speed_ratio
from llm_attn.harness.results import KV_CACHES, SCHEMA, ResultWriter, jsonable, point_key
from llm_attn.kv_cache_reference import FP8_READ_VIA_COPY

PER_POINT = ("ttft", "decode_generate", "decode_graph", "breakdown", "ttft_graph", "ttft_graph_static")
# TTFT and decode tok/s are measured paired: every implementation once per repeat, in a seeded shuffled order
# (harness.paired).
PAIRED = ("ttft", "decode_generate", "decode_graph")
ALL_MEASUREMENTS = PER_POINT + ("correctness",)
# What runs when nothing is asked for: the profiled breakdown is opt-in (``--measure breakdown``).
DEFAULT_MEASUREMENTS = ("ttft", "decode_generate", "decode_graph", "correctness")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The measurements whose prefill --prefill-chunk splits (and whose rows carry it); breakdown and correctness run the
# prompt in one forward.
PREFILL_CHUNKED = ("ttft", "decode_generate", "decode_graph", "ttft_graph", "ttft_graph_static")
# The measurements that run on the --kv-cache format (and whose rows carry it): the same ones, and correctness (the
# implementation on that cache against stock on transformers' own). breakdown runs on transformers' own cache.
KV_CACHED = PREFILL_CHUNKED + ("correctness",)
FP8_KV_NOTE = "FP8 KV cache (read via a dequantised copy)"
# Reference implementation of the correctness check: the stock path the patched implementations are built on.
CORRECTNESS_REFERENCE = BASE_IMPL
_OOM = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


def _int_at_least(name: str, val, low: int) -> None:
    if not isinstance(val, int) or isinstance(val, bool) or val < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {val!r}")


def _failure(e: Exception) -> tuple[str, str, str, str]:
    """(row status, type, message, traceback) of a failed measurement: out of memory, a path that cannot be
    measured that way (e.g. captured in a CUDA graph), or any other error. Called inside the except block."""
    status = "oom" if isinstance(e, _OOM) else "unsupported" if isinstance(e, GraphCaptureUnsupported) else "error"
    return status, type(e).__name__, str(e), "".join(traceback.format_exception(e))


@dataclass(kw_only=True)
class SweepParams:
    """What a sweep measures at every point, shared by ``SweepConfig`` (one model at one dtype, as
    ``python -m llm_attn.ttft`` runs it) and ``llm_attn.experiment.ExperimentDef`` (a TOML file sweeping models and
    dtypes too). Validated once, here."""

    seqs: list[int]
    batches: list[int] = field(default_factory=lambda: [1])
    new_tokens: int = 32
    warmup: int = 3
    repeats: int = 20
    decode_repeats: int = 5
    measurements: list[str] = field(default_factory=lambda: list(DEFAULT_MEASUREMENTS))
    seed: int = 0
    # decode_graph at this KV length after the prompt (measure_decode_static's context); None: the prompt's length.
    context: int | None = None
    # --prefill-chunk: the prompt in forwards of this many tokens against the growing cache (PREFILL_CHUNKED);
    # None: one forward.
    prefill_chunk: int | None = None
    # --kv-cache: the KV cache format of the KV_CACHED measurements (results.KV_CACHES).
    kv_cache: str = "fp16"
    allow_dequant_fallback: bool = False
    # --plugin specs (a .py path or module[:attr]) that register implementations named in impls.
    plugins: list[str] = field(default_factory=list)

    def __post_init__(self):
        for name in ("seqs", "batches"):
            vals = getattr(self, name)
            if not isinstance(vals, list) or not vals:
                raise ValueError(f"{name} must be a non-empty list, got {vals!r}")
            bad = [v for v in vals if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
            if bad:
                raise ValueError(f"{name} must hold positive integers, got {bad}")
        if not isinstance(self.measurements, list) or not self.measurements:
            raise ValueError(f"measurements must be a non-empty list, got {self.measurements!r}")
        bad = [m for m in self.measurements if m not in ALL_MEASUREMENTS]
        if bad:
            raise ValueError(f"measurements: unknown {bad}; choose from {', '.join(ALL_MEASUREMENTS)}")
        for key, low in (("new_tokens", 2), ("warmup", 0), ("repeats", 1), ("decode_repeats", 1), ("seed", 0)):
            _int_at_least(key, getattr(self, key), low)
        if self.context is not None:
            _int_at_least("context", self.context, 1)
            if self.context < max(self.seqs):
                raise ValueError(f"context ({self.context}) must be at least every prompt length (largest: "
                                 f"{max(self.seqs)})")
        if self.prefill_chunk is not None:
            _int_at_least("prefill_chunk", self.prefill_chunk, 1)
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {self.kv_cache!r}")
        if not isinstance(self.plugins, list) or not all(isinstance(p, str) and p for p in self.plugins):
            raise ValueError(f"plugins must be a list of plugin specs (file.py or module[:attr]), got "
                             f"{self.plugins!r}")

    def shared(self) -> dict:
        """The shared fields, to build one kind of sweep from the other."""
        return {f.name: getattr(self, f.name) for f in fields(SweepParams)}


@dataclass(kw_only=True)
class SweepConfig(SweepParams):
    """One sweep: a model at one dtype, measured over the product impls x batches x seqs."""

    model_spec: str
    dtype: str
    impls: list[str]
    experiment: str | None = None
    device: str = "cpu"

    def __post_init__(self):
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not self.impls:
            raise ValueError("impls must not be empty")

    def command(self, impls: list[str], batch: int, seq: int, measurements: list[str]) -> str:
        """The ``python -m llm_attn.ttft`` command that measures exactly this point again."""
        args = ["python", "-m", "llm_attn.ttft", "--model", self.model_spec, "--dtype", self.dtype]
        for spec in registry.plugin_specs_for(impls):
            args += ["--plugin", spec]
        args += ["--impl", *impls, "--batch", str(batch), "--seq", str(seq), "--new-tokens", str(self.new_tokens),
                 "--warmup", str(self.warmup), "--repeats", str(self.repeats),
                 "--decode-repeats", str(self.decode_repeats), "--measure", *measurements,
                 "--seed", str(self.seed), "--device", self.device]
        if self.context is not None:
            args += ["--context", str(self.context)]
        if self.prefill_chunk is not None:
            args += ["--prefill-chunk", str(self.prefill_chunk)]
        if self.kv_cache != "fp16":
            args += ["--kv-cache", self.kv_cache]
        if self.allow_dequant_fallback:
            args.append("--allow-dequant-fallback")
        return shlex.join(args)


def make_prompt(vocab_size: int, batch: int, seq: int, seed: int, device) -> torch.Tensor:
    """Seeded random token ids: every implementation sees the same prompt for a (batch, seq) point."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 100_003 + seq)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen).to(device)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _free_cuda_memory(device: torch.device) -> dict:
    gc.collect()
    if device.type != "cuda":
        return {}
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {"free_mem_bytes": free, "total_mem_bytes": total}


class Sweep:
    """Holds what every row shares (model, environment, run id) and writes rows for one SweepConfig."""

    def __init__(self, cfg: SweepConfig, model, info, env: dict, writer: ResultWriter, device_entry: Device | None,
                 done: set[tuple] | None = None, progress: bool = True, argv: list[str] | None = None,
                 log: Callable[[str], None] | None = None,
                 prompts: Callable[[int, int], torch.Tensor] | None = None, row_extra: dict | None = None):
        self.cfg, self.model, self.env, self.writer = cfg, model, env, writer
        self.device = torch.device(cfg.device)
        self.device_entry = device_entry
        self.done = set(done or ())
        self.progress = progress
        self.argv = argv if argv is not None else sys.argv
        self.log = log or (lambda msg: tqdm.write(msg, file=sys.stderr))
        self.run_id = uuid.uuid4().hex[:12]
        self.rows: list[dict] = []
        # (batch, seq) -> token ids on the CPU: e.g. harness.prompts.prompt_batch over a --prompts dataset. Default:
        # seeded random ids (make_prompt).
        self.prompts = prompts
        # Fields every row carries, e.g. {"prompts": {"source": ..., "field": ...}} for --prompts; its
        # "command_args" are appended to each row's reproducing command.
        self.row_extra = dict(row_extra or {})
        self.skipped = 0
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab = text_config.vocab_size
        info_json = jsonable(info)
        self.geometry = flops.geometry(info_json.get("config") or text_config.to_dict())
        self.weight_bytes = flops.weight_bytes_read_per_step(model)
        self.info = {**info_json, "model_bytes": flops.model_bytes(model)}

    def _prompt(self, batch: int, seq: int) -> torch.Tensor:
        if self.prompts is None:
            return make_prompt(self.vocab, batch, seq, self.cfg.seed, self.device)
        ids = self.prompts(batch, seq)
        if tuple(ids.shape) != (batch, seq):
            raise ValueError(f"the prompt source gave shape {tuple(ids.shape)}, expected {(batch, seq)}")
        return ids.to(self.device)

    # -- rows -----------------------------------------------------------------------------------------------------
    def _base(self, measurement: str, impl: str, batch: int, seq: int, command_impls: list[str]) -> dict:
        extra = {k: v for k, v in self.row_extra.items() if k != "command_args"}
        command = self.cfg.command(command_impls, batch, seq, [measurement])
        if self.row_extra.get("command_args"):
            command += " " + shlex.join(self.row_extra["command_args"])
        return {**extra,
            "schema": SCHEMA, "kind": measurement, "measurement": measurement, "status": "ok",
            "experiment": self.cfg.experiment, "run_id": self.run_id, "time": _now(),
            "device": self.env["device_slug"], "model_spec": self.cfg.model_spec, "model": self.info,
            "impl": impl, "impl_info": impl_info(impl), "dtype": self.cfg.dtype, "batch": batch, "seq": seq,
            "new_tokens": self.cfg.new_tokens,
            **self._context_field(measurement),
            **self._chunk_fields(measurement, seq),
            **self._kv_cache_field(measurement),
            "env": self.env, "command": command,
            "argv": shlex.join(self.argv),
        }

    def _key(self, measurement: str, impl: str, batch: int, seq: int) -> tuple:
        return point_key({"experiment": self.cfg.experiment, "model_spec": self.cfg.model_spec,
                          "dtype": self.cfg.dtype, "impl": impl, "batch": batch, "seq": seq,
                          "new_tokens": self.cfg.new_tokens, "measurement": measurement,
                          **self._context_field(measurement), **self._chunk_fields(measurement, seq),
                          **self._kv_cache_field(measurement)})

    def _context_field(self, measurement: str) -> dict:
        """--context belongs to decode_graph's rows (and resume keys) only."""
        return {"context": self.cfg.context} if measurement == "decode_graph" and self.cfg.context else {}

    def _chunk_fields(self, measurement: str, seq: int) -> dict:
        """--prefill-chunk belongs to the rows (and resume keys) of the measurements it splits: the chunk asked for
        and the forwards the prompt took (1 when the chunk is at least the prompt)."""
        chunk = self.cfg.prefill_chunk
        if chunk is None or measurement not in PREFILL_CHUNKED:
            return {}
        return {"prefill_chunk": chunk, "prefill_chunks": -(-seq // chunk)}

    def _kv_cache_field(self, measurement: str) -> dict:
        """--kv-cache belongs to the rows (and resume keys) of the measurements that run on it."""
        return {"kv_cache": self.cfg.kv_cache} if measurement in KV_CACHED else {}

    def _emit(self, row: dict) -> None:
        self.writer.write(row)
        self.rows.append(row)
        self.done.add(point_key(row))
        if row["status"] != "ok":
            err = row["error"]
            self.log(f"[{row['status']}] {row['measurement']} impl={row['impl']} batch={row['batch']} "
                     f"seq={row['seq']}: {err['type']}: {err['message'][:300]}")

    def _guarded(self, base: dict, fn: Callable[[], dict]) -> None:
        """Run one measurement; an OOM or any other failure becomes an error row and the sweep continues."""
        failure = None
        env_start = hostenv.snapshot(self.device)
        try:
            fields = fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 (recorded with its traceback, then the next point runs)
            failure = _failure(e)
        env = hostenv.span(env_start, hostenv.snapshot(self.device))
        if failure is None:
            self._emit({**base, **fields, "host_env": env})
        else:
            # Only strings were kept: the exception's frames (holding the failed point's tensors) are gone by now,
            # so the memory they held can be given back before the next point.
            self._emit_error({**base, "host_env": env}, *failure)

    def _emit_error(self, base: dict, status: str, etype: str, message: str, tb: str) -> None:
        mem = _free_cuda_memory(self.device)
        self._emit({**base, "kind": "error", "status": status,
                    "error": {"type": etype, "message": message, "traceback": tb}, **mem})

    # -- measurements -----------------------------------------------------------------------------------------------
    def _decode_extras(self, fields: dict, batch: int, seq: int) -> dict:
        dtype_bytes = torch.empty((), dtype=DTYPES[self.cfg.dtype]).element_size()
        element = flops.kv_element_bytes(self.cfg.kv_cache, dtype_bytes, self.geometry["head_dim"])
        kv = flops.kv_bytes_per_token(self.geometry, batch, fields.get("kv_len", seq) + self.cfg.new_tokens / 2,
                                      element)
        per_step = {"weights": self.weight_bytes, "kv_cache": kv, "total": self.weight_bytes + kv}
        # one step per token of each sequence: the cache's bytes read per second while decoding
        extras = {"bytes_per_token": per_step, "tok_s_all_sequences": fields["tok_s"] * batch,
                  "kv_read_gb_s": kv * fields["tok_s"] / 1e9}
        if self.device_entry is not None:
            limit = self.device_entry.bandwidth_bytes_s / per_step["total"]
            extras.update({"bw_limit_tok_s": limit, "bw_fraction": fields["tok_s"] / limit,
                           "kv_read_fraction": kv * fields["tok_s"] / self.device_entry.bandwidth_bytes_s,
                           "device_table_entry": self.device_entry.slug})
        return extras

    def _decode_once(self, measurement: str, prompt: torch.Tensor) -> dict:
        """One run of a decode measurement on the model as it is switched now (a repeat of a paired decode point)."""
        cfg = self.cfg
        if measurement == "decode_generate":
            return measure_decode_generate(self.model, prompt, cfg.new_tokens, 1, warmup_runs=0, meter=self.meter,
                                           prefill_chunk=cfg.prefill_chunk, kv_cache=cfg.kv_cache)
        return measure_decode_static(self.model, prompt, cfg.new_tokens, 1, use_graph=self.device.type == "cuda",
                                     context=cfg.context, meter=self.meter, prefill_chunk=cfg.prefill_chunk,
                                     kv_cache=cfg.kv_cache)

    def _measure(self, measurement: str, prompt: torch.Tensor, inner: tqdm) -> dict:
        cfg = self.cfg
        batch, seq = prompt.shape
        if measurement == "ttft":
            inner.reset(total=cfg.repeats)
            fields = measure_ttft(self.model, prompt, cfg.warmup, cfg.repeats, on_repeat=inner.update,
                                  prefill_chunk=cfg.prefill_chunk, kv_cache=cfg.kv_cache)
            fields.update(self._ttft_extras(fields, batch, seq))
            return fields
        if measurement in ("ttft_graph", "ttft_graph_static"):
            inner.reset(total=cfg.repeats)
            return measure_ttft_graph(self.model, prompt, cfg.warmup, cfg.repeats,
                                      cache="static" if measurement == "ttft_graph_static" else "dynamic",
                                      on_repeat=inner.update, prefill_chunk=cfg.prefill_chunk,
                                      kv_cache=cfg.kv_cache)
        if measurement == "breakdown":
            inner.reset(total=1)
            entry = registry.get(self._impl_now)
            fields = measure_breakdown(self.model, prompt, entry.name, entry.hf_name, warmup=max(1, cfg.warmup))
            inner.update()
            return fields
        inner.reset(total=cfg.decode_repeats)
        if measurement == "decode_generate":
            fields = measure_decode_generate(self.model, prompt, cfg.new_tokens, cfg.decode_repeats,
                                             warmup_runs=1 if cfg.warmup > 0 else 0, on_run=inner.update,
                                             prefill_chunk=cfg.prefill_chunk, kv_cache=cfg.kv_cache)
        elif measurement == "decode_graph":
            fields = measure_decode_static(self.model, prompt, cfg.new_tokens, cfg.decode_repeats,
                                           use_graph=self.device.type == "cuda", on_run=inner.update,
                                           context=cfg.context, prefill_chunk=cfg.prefill_chunk,
                                           kv_cache=cfg.kv_cache)
        else:
            raise ValueError(f"unknown measurement {measurement!r}")
        return {**fields, **self._decode_extras(fields, batch, seq)}

    def run(self) -> list[dict]:
        """Measure every point not done yet, with the run's energy meter open (``harness.energy``: NVML, Jetson
        rails, or none and why) for the paired TTFT and decode points."""
        self.meter = energy.open_meter(self.device)
        try:
            return self._run_points()
        finally:
            self.meter.close()

    def _run_points(self) -> list[dict]:
        cfg = self.cfg
        per_point = [m for m in PER_POINT if m in cfg.measurements]
        blocked = [m for m in per_point if m not in PAIRED]
        todo = [(impl, b, s, m) for impl in cfg.impls for b in cfg.batches for s in cfg.seqs for m in blocked
                if self._key(m, impl, b, s) not in self.done]
        # Paired points: the implementations still to measure at each (measurement, batch, seq), measured together.
        todo_paired = []
        for m in (m for m in per_point if m in PAIRED):
            for b in cfg.batches:
                for s in cfg.seqs:
                    left = [i for i in cfg.impls if self._key(m, i, b, s) not in self.done]
                    if left:
                        todo_paired.append((m, b, s, left))
        # Against stock sdpa: every other implementation, a second stock one included (HF's eager attention against
        # sdpa is the rounding noise floor the patched ones are read against); on the FP8 cache sdpa too (stock on
        # its copy against stock on the fp16 cache: the cache's own effect).
        checked = ([i for i in cfg.impls if cfg.kv_cache != "fp16" or i != CORRECTNESS_REFERENCE]
                   if "correctness" in cfg.measurements else [])
        todo_corr = [(i, b, s) for i in checked for b in cfg.batches for s in cfg.seqs
                     if self._key("correctness", i, b, s) not in self.done]
        planned = len(cfg.impls) * len(cfg.batches) * len(cfg.seqs) * len(per_point)
        planned += len(checked) * len(cfg.batches) * len(cfg.seqs)
        n_paired = sum(len(left) for *_, left in todo_paired)
        self.skipped = planned - len(todo) - len(todo_corr) - n_paired
        total = len(todo) + len(todo_corr) + n_paired
        # disable=None: bars only on a terminal, so logs of CI and batch jobs stay readable.
        disable = None if self.progress else True
        with tqdm(total=total, desc="measurements", unit="pt", disable=disable, file=sys.stderr) as bar, \
                tqdm(total=0, desc="  repeats", leave=False, disable=disable, file=sys.stderr) as inner:
            for m, b, s, left in todo_paired:
                self._run_paired(m, left, b, s, bar, inner)
            for impl in cfg.impls:
                points = [(b, s, m) for i, b, s, m in todo if i == impl]
                if points:
                    self._run_impl(impl, points, bar, inner)
            for impl, b, s in todo_corr:
                bar.set_postfix_str(f"correctness {impl} vs {CORRECTNESS_REFERENCE} b={b} s={s}")
                prompt = self._prompt(b, s)
                base = self._base("correctness", impl, b, s, [CORRECTNESS_REFERENCE, impl])
                self._guarded(base, lambda p=prompt, i=impl: measure_correctness(
                    self.model, p, cfg.new_tokens, CORRECTNESS_REFERENCE, i, use_impl, kv_cache=cfg.kv_cache))
                bar.update()
        return self.rows

    def _ttft_extras(self, fields: dict, batch: int, seq: int) -> dict:
        f = flops.prefill_flops(self.geometry, batch, seq)
        extras = {"model_flops": f, "attention_flops": flops.attention_flops(self.geometry, batch, seq),
                  "tflops": f / (fields["stats"]["p50"] * 1e-3) / 1e12}
        if self.device_entry is not None:
            extras["pct_of_peak_fp16"] = 100 * extras["tflops"] / self.device_entry.fp16_tensor_tflops
        return extras

    def _run_paired(self, measurement: str, impls: list[str], batch: int, seq: int, bar: tqdm, inner: tqdm) -> None:
        """One paired TTFT point: every implementation once per repeat, shuffled (``harness.paired``); one row per
        implementation, each with the paired record and its verdict against every stock implementation paired
        with it. An implementation the model cannot be switched to gets an error row and is left out of the
        pairing; a failure of the paired run (OOM, ...) gives every implementation's row that status."""
        cfg = self.cfg
        ok = []
        for impl in impls:
            try:
                with use_impl(self.model, impl):
                    pass
                ok.append(impl)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001
                self._emit_error(self._base(measurement, impl, batch, seq, [impl]), "error", type(e).__name__,
                                 f"switching the model to {impl!r} failed: {e}", traceback.format_exc())
                bar.update()
        if not ok:
            return
        bar.set_postfix_str(f"paired {measurement} {'/'.join(ok)} b={batch} s={seq}")
        prompt = self._prompt(batch, seq)
        bases = {i: {**self._base(measurement, i, batch, seq, ok), **self._context_field(measurement)} for i in ok}
        decode = measurement != "ttft"
        inner.reset(total=cfg.decode_repeats if decode else cfg.repeats)
        failure = None
        env_start = hostenv.snapshot(self.device)
        try:
            if decode:
                got, failed = measure_decode_paired(self.model, ok, cfg.decode_repeats, switch=use_impl,
                                                    run_once=lambda p=prompt: self._decode_once(measurement, p),
                                                    seed=cfg.seed, on_repeat=inner.update, meter=self.meter)
            else:
                failed = {}
                got = measure_ttft_paired(self.model, prompt, ok, cfg.warmup, cfg.repeats, switch=use_impl,
                                          seed=cfg.seed, on_repeat=inner.update, meter=self.meter,
                                          prefill_chunk=cfg.prefill_chunk, kv_cache=cfg.kv_cache)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 (recorded with its traceback, then the next point runs)
            failure = _failure(e)
        env = hostenv.span(env_start, hostenv.snapshot(self.device))
        del prompt
        stocks = [i for i in ok if is_stock(i)]
        for impl in ok:
            if failure is not None:
                self._emit_error({**bases[impl], "host_env": env}, *failure)
            elif impl in failed:  # its warm-up failed (e.g. not capturable): the others were paired without it
                self._emit_error({**bases[impl], "host_env": env}, *_failure(failed[impl]))
            else:
                row = {**bases[impl], **got[impl], "host_env": env}
                row.update(self._decode_extras(row, batch, seq) if decode else self._ttft_extras(row, batch, seq))
                row["vs"] = paired_verdicts(row, stocks, seed=cfg.seed)
                row["vs_energy"] = energy.energy_verdicts(row, stocks, seed=cfg.seed)  # > 1: less energy
                self._emit(row)
            bar.update()

    def _run_impl(self, impl: str, points: list[tuple], bar: tqdm, inner: tqdm) -> None:
        self._impl_now = impl
        with ExitStack() as stack:
            try:
                report = stack.enter_context(use_impl(self.model, impl))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 (switching failed: every point of this impl gets the error row)
                failure = (type(e).__name__, f"switching the model to {impl!r} failed: {e}", traceback.format_exc())
                for b, s, m in points:
                    self._emit_error(self._base(m, impl, b, s, [impl]), "error", *failure)
                    bar.update()
                return
            for b, s, m in points:
                bar.set_postfix_str(f"{impl} b={b} s={s} {m}")
                prompt = self._prompt(b, s)

                def run_one(m=m, prompt=prompt):
                    if report is not None:
                        report.reset_counters()
                    fields = self._measure(m, prompt, inner)
                    if report is not None:
                        # Attention calls of this measurement (warm-up included) on the implementation vs the
                        # stock path. Calls replayed from a CUDA graph run no Python: counted once, at capture.
                        fields["patch"] = jsonable(report)
                        fields["attention_calls"] = {"impl": report.num_native_calls,
                                                     "stock_fallback": report.num_fallback_calls,
                                                     "fallback_reasons": dict(report.fallback_calls),
                                                     **kv_cache_reads(report)}
                    return fields

                self._guarded(self._base(m, impl, b, s, [impl]), run_one)
                del prompt
                bar.update()


# -- summary table --------------------------------------------------------------------------------------------------
def latest_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The last row per point key (a re-measured point supersedes the earlier one)."""
    out = {}
    for r in rows:
        out[point_key(r)] = r
    return out


def verdict_cell(row: dict | None, stock: str, ref_p50: float | None, mine_p50: float | None) -> str:
    """The 'vs <stock>' cell of a TTFT row: the paired ratio with its 95 % interval and, where the interval holds
    1.0, "no difference" (``stats.format_ratio_interval``); the plain ratio of p50s for rows without pairs."""
    iv = (row or {}).get("vs", {}).get(stock) if row and row.get("status") == "ok" else None
    if iv:
        return format_ratio_interval(iv)
    return format_ratio(speed_ratio(ref_p50, mine_p50))


def kv_cache_note(row: dict) -> str:
    """How a row's attention read the FP8 KV cache: stock (and any row without counts) through a dequantised copy;
    a patched implementation as its patch report counted (``attention_calls.kv_cache_reads``)."""
    reads = (row.get("attention_calls") or {}).get("kv_cache_reads") or {}
    direct = {how: n for how, n in reads.items() if how != FP8_READ_VIA_COPY}
    if not direct:
        return FP8_KV_NOTE
    total = sum(reads.values())
    said = "; ".join(f"{how.removeprefix('fp8 cache ')} in {n}/{total} calls" for how, n in sorted(direct.items()))
    return f"FP8 KV cache ({said}; the rest via a dequantised copy)" if sum(direct.values()) < total \
        else f"FP8 KV cache ({said})"


def row_notes(row: dict | None) -> list[str]:
    """What a reader must know before trusting a row's number: low precision (attention, the KV cache), a chunked
    prefill, host-bound, fallbacks to stock, moved clocks."""
    if not row or row.get("status") != "ok":
        return []
    notes = [n for n in (low_precision_note(row.get("impl_info")),) if n]  # e.g. fp8 attention: its accuracy
    if row.get("kv_cache") == "fp8":  # --kv-cache fp8: how attention read it
        notes.append(kv_cache_note(row))
    if row.get("prefill_chunk"):  # --prefill-chunk: how the prompt went in
        notes.append(f"prefill chunk {row['prefill_chunk']} >= prompt: one chunk" if row.get("prefill_chunks") == 1
                     else f"prefill in {row['prefill_chunks']} chunks of {row['prefill_chunk']}")
    hb = row.get("host_bound")
    if hb and hb.get("host_bound"):
        span = hb.get("gpu_span_share")
        notes.append(f"host-bound (enqueue {100 * hb['enqueue_share']:.0f}% of TTFT"
                     + (f"; GPU timeline spans {100 * span:.0f}% of wall)" if span is not None else ")"))
    calls = row.get("attention_calls")
    if calls and calls.get("stock_fallback"):
        n = calls["stock_fallback"] + (calls.get("impl") or 0)
        notes.append(f"FALLBACK {100 * calls['stock_fallback'] / n:.0f}% of attention calls to stock "
                     f"({calls['stock_fallback']}/{n})")
    if row.get("context_filled"):
        notes.append(f"decode_graph at KV {row['kv_len']} (cache filled after the prompt)")
    env = row.get("host_env") or {}
    if env.get("sm_clock_moved"):
        notes.append(f"SM clock moved {env['sm_clock_change_pct']:.0f}%")
    return notes


def drop_empty_columns(table: list[list], headers: list[str], keep: tuple[str, ...] = ()) -> tuple[list[list], list]:
    """``table`` and ``headers`` without the columns whose cells are all empty (``keep`` names ones that stay)."""
    cols = [i for i, h in enumerate(headers) if h in keep or any(str(row[i]).strip() for row in table)]
    return [[row[i] for i in cols] for row in table], [headers[i] for i in cols]


def summary_table(rows: list[dict], tablefmt: str = "github") -> str:
    """llama-bench-like table: one line per (model, impl, batch, seq), speedups vs each stock implementation (with
    their paired 95 % interval where TTFT was measured paired), and notes: host-bound, fallbacks, moved clocks."""
    latest = latest_rows(rows).values()
    by_point: dict[tuple, dict] = {}
    for r in latest:
        if r["measurement"] in ("breakdown", "ttft_dataset"):  # their own tables
            continue
        model = r["model"]
        k = (model.get("name"), model.get("quant"), r["dtype"], r["batch"], r["seq"], r["impl"])
        by_point.setdefault(k, {})[r["measurement"]] = r
    # Speedup columns in the order readers look for them: the default stock path first.
    stocks = [s for s in ("sdpa", "eager", "flash_attention_2") if any(k[5] == s for k in by_point)]

    def ttft_p50(k, impl):
        r = by_point.get(k[:5] + (impl,), {}).get("ttft")
        return r["stats"]["p50"] if r and r["status"] == "ok" else None

    def cell(r, fmt):
        if r is None:
            return ""
        return fmt(r) if r["status"] == "ok" else r["status"].upper()

    def kv_read_cell(r):
        if r.get("kv_read_gb_s") is None:
            return ""
        share = f" ({100 * r['kv_read_fraction']:.0f}%)" if r.get("kv_read_fraction") is not None else ""
        return f"{r['kv_read_gb_s']:.0f}{share}"

    table, modes = [], set()
    graph_cols = any(k2 in m for m in by_point.values() for k2 in ("ttft_graph", "ttft_graph_static"))
    order = {i: n for n, i in enumerate(registry.names())}
    for k in sorted(by_point, key=lambda k: (str(k[0]), str(k[1]), k[2], k[3], k[4], order.get(k[5], 99))):
        m = by_point[k]
        t, dg, dgr = m.get("ttft"), m.get("decode_generate"), m.get("decode_graph")
        tg, tgs = m.get("ttft_graph"), m.get("ttft_graph_static")
        if dgr is not None and dgr["status"] == "ok":
            modes.add(dgr["mode"])
        mine = ttft_p50(k, k[5])
        speed = [verdict_cell(t, s, ttft_p50(k, s), mine) for s in stocks]
        notes = []
        for x in (t, dg, dgr, tg, tgs):
            notes += [n for n in row_notes(x) if n not in notes]
        kernels = next((x.get("attention_kernels") for x in (tg, tgs) if x and x.get("status") == "ok"
                        and x.get("attention_kernels")), None)
        account = graph_vs_eager_account(tg, t) if tg and t else None
        if account and account["unexplained_pct"] > 2.0:
            top = account.get("other_changes") or []
            where = "; most: " + ", ".join(f"{c['name'][:40]} {c['delta_ms']:+.1f} ms ({c['launches'][0]}->"
                                           f"{c['launches'][1]} launches)" for c in top[:2]) if top else ""
            notes.append(f"graph vs eager: {account['unexplained_pct']:.1f}% of TTFT not from attention or host{where}")
        peak = next((x.get("peak_mem_bytes") for x in (t, dg, dgr) if x and x.get("peak_mem_bytes")), None)
        table.append([k[0], k[1], k[5], k[3], k[4],
                      cell(t, lambda r: f"{r['stats']['p50']:.2f}"),
                      cell(t, lambda r: f"{r['stats']['p90']:.2f}"),
                      cell(t, lambda r: f"{r['stats']['stdev_pct']:.1f}" if r["stats"]["stdev_pct"] is not None
                           else ""),
                      *speed,
                      cell(dg, lambda r: tok_s_cell(r, stocks)),
                      cell(dgr, lambda r: tok_s_cell(r, stocks)),
                      cell(dgr, lambda r: f"{100 * r['bw_fraction']:.0f}%" if r.get("bw_fraction") else ""),
                      cell(dgr, kv_read_cell),
                      f"{peak / 2**30:.2f}" if peak else "",
                      *([cell(tg, lambda r: f"{r['stats']['p50']:.2f}"), cell(tgs, lambda r: f"{r['stats']['p50']:.2f}"),
                         ", ".join(f"{k_['name'][:40]} ({k_['ms']:.1f} ms)" for k_ in kernels[:2]) if kernels else "",
                         account_cell(account)]
                        if graph_cols else []),
                      "; ".join(notes)])
    headers = ["model", "quant", "impl", "batch", "seq", "TTFT p50 ms", "p90 ms", "stdev %",
               *[ratio_header(s) for s in stocks], "decode tok/s (generate)", "decode tok/s (graph)",
               "graph % of BW bound", "graph KV read GB/s (% of BW)", "peak GiB",
               *(["TTFT graph ms (dynamic cache)", "TTFT graph ms (static cache)", "attention kernels (graph)",
                  "graph - eager ms"] if graph_cols else []), "notes"]
    table, headers = drop_empty_columns(table, headers, keep=("model", "impl", "seq"))  # e.g. peak GiB on CPU
    out = tabulate(table, headers=headers, tablefmt=tablefmt, disable_numparse=True)
    if any(r.get("vs") for r in latest if r.get("status") == "ok"):
        out += ("\n(vs columns: ratio of TTFT medians, stock / this row, with its 95 % paired-bootstrap interval "
                "over repeats in which every implementation ran once, in shuffled order; decode tok/s cells: this "
                "row's tok/s over the first stock's, paired the same way)")
    if "static_cache_loop_no_graph" in modes:
        out += "\n(graph column: static-cache loop without CUDA graph — no GPU here)"
    if graph_cols:
        out += ("\n(graph - eager: dynamic-cache graph TTFT minus eager TTFT = the attention kernels' change + the "
                "rest of the GPU work's change - the host time the graph removes, from one profiled replay and one "
                "profiled eager prefill; the % is the rest's share of eager TTFT)")
    return out


def tok_s_cell(row: dict, stocks: list[str]) -> str:
    """A decode tok/s cell: tok/s, and for a row paired with a stock implementation (the first of ``stocks`` it was
    paired with) its tok/s ratio to that one with the 95 % interval, e.g. ``85.4 (1.13x [1.12, 1.14] faster vs
    sdpa)``."""
    text = f"{row['tok_s']:.1f}"
    vs = row.get("vs") or {}
    stock = next((s for s in stocks if s in vs and s != row["impl"]), None)
    return f"{text} ({format_ratio_interval(vs[stock])} vs {stock})" if stock else text


def account_cell(account: dict | None) -> str:
    if not account:
        return ""
    return (f"{account['delta_ms']:+.1f} = attn {account['attention_ms']:+.1f}, host {-account['host_removed_ms']:+.1f}"
            f", rest {account['other_ms']:+.1f} ({account['unexplained_pct']:.1f}%)")


def correctness_table(rows: list[dict], tablefmt: str = "github") -> str:
    table = []
    for r in latest_rows(rows).values():
        if r["measurement"] != "correctness":
            continue
        if r["status"] != "ok":
            table.append([r["impl"], "", r["batch"], r["seq"], r["status"].upper(), "", "", ""])
            continue
        table.append([*correctness_names(r), r["batch"], r["seq"], f"{r['max_abs_logit_diff']:.3g}",
                      f"{100 * r['greedy_agreement']:.1f}%", *agreement_cells(r)])
    if not table:
        return ""
    return "\n".join([tabulate(sorted(table, key=lambda x: (x[2], x[3])),
                                headers=["impl", "vs", "batch", "seq", "max |Δlogit|", "greedy agreement",
                                         *AGREEMENT_HEADERS], tablefmt=tablefmt, disable_numparse=True),
                       AGREEMENT_NOTE + " " + MISS_FLIPS_NOTE, *agreement_misses(latest_rows(rows).values())])


def breakdown_table(rows: list[dict], tablefmt: str = "github") -> str:
    """Where each profiled prefill's time went (``--measure breakdown``), and TTFT if attention took 0 ms."""
    table = []
    for r in latest_rows(rows).values():
        if r["measurement"] != "breakdown" or r["status"] != "ok":
            continue
        ms = r["category_ms"]
        table.append([r["impl"], r["batch"], r["seq"], f"{r['span_ms']:.2f}",
                      *(f"{ms[c]:.2f} ({r['category_pct'][c]:.0f}%)" if r["category_pct"][c] is not None else ""
                        for c in ("attention", "gemm", "quant", "other", "idle")),
                      f"{r['ttft_if_attention_zero_ms']:.2f}"])
    if not table:
        return ""
    idle = "GPU idle" if any(r.get("device_type") == "cuda" for r in rows if r["measurement"] == "breakdown") \
        else "idle (host, no op)"
    return tabulate(sorted(table, key=lambda x: (x[1], x[2], x[0])),
                    headers=["impl", "batch", "seq", "profiled prefill ms", "attention", "GEMM", "quant. weights",
                             "other kernels", idle, "TTFT if attention took 0 ms"],
                    tablefmt=tablefmt, disable_numparse=True)
