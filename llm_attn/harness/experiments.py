"""Experiment definitions: a TOML file naming a sweep over models, dtypes, implementations, batch sizes and prompt
lengths (``ExperimentDef``), parsed by ``load_experiment``, and where its results go (``results_path``). The command
line is ``python -m llm_attn.experiment``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from llm_attn import registry
from llm_attn.envinfo import REPO_ROOT
from llm_attn.harness.impls import available_impls, unavailable_reason
from llm_attn.harness.session import default_dtype
from llm_attn.harness.sweep import DTYPES, SweepConfig, SweepParams

TOMLDecodeError = tomllib.TOMLDecodeError
DEFAULT_RESULTS = REPO_ROOT / "experiments" / "results"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(kw_only=True)
class ExperimentDef(SweepParams):
    """One experiment file: the sweep parameters of ``SweepParams`` (seqs, batches, new_tokens, warmup, repeats,
    decode_repeats, measurements, seed, allow_dequant_fallback, plugins) plus the models, dtypes and
    implementations to sweep them over. Every list is swept as a product; ``impls`` left out means the default
    implementations available on the machine that runs it. ``prompts`` / ``prompt_field``: prompt text from a
    dataset (a path relative to the TOML file), as ``python -m llm_attn.ttft --prompts``. ``plugins`` (.py paths relative to the TOML file, or
    module[:attr]) register implementations that ``impls`` may then name."""

    name: str
    models: list[str] = field(default_factory=lambda: ["auto"])
    dtypes: list[str] = field(default_factory=lambda: ["auto"])
    impls: list[str] | None = None
    description: str = ""
    # Prompt text from a dataset (as ttft's --prompts / --prompt-field; harness/prompts.py): a path relative to the
    # TOML file, or a dataset in the local cache. None: seeded random token ids.
    prompts: str | None = None
    prompt_field: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"name must be lower-case letters, digits, '-' or '_' (it names the results file), "
                             f"got {self.name!r}")
        for key in ("models", "dtypes"):
            val = getattr(self, key)
            if not isinstance(val, list) or not val:
                raise ValueError(f"{key} must be a non-empty list, got {val!r}")
        super().__post_init__()
        bad = [d for d in self.dtypes if d != "auto" and d not in DTYPES]
        if bad:
            raise ValueError(f"dtypes: unknown {bad}; choose from auto, {', '.join(DTYPES)}")
        for key in ("prompts", "prompt_field"):
            val = getattr(self, key)
            if val is not None and (not isinstance(val, str) or not val):
                raise ValueError(f"{key} must be a non-empty string, got {val!r}")
        if self.prompt_field is not None and self.prompts is None:
            raise ValueError("prompt_field needs prompts")
        registry.load_plugins(self.plugins)  # raises PluginError (a ValueError) with the spec and the cause
        if self.impls is not None:
            known = registry.names()
            bad = [i for i in self.impls if i not in known]
            if bad or not self.impls:
                raise ValueError(f"impls: unknown {bad}; choose from {', '.join(known)}")

    def configs(self, device: str) -> list[SweepConfig]:
        """One SweepConfig per (model, dtype), resolved for ``device``."""

        impls = self.impls or available_impls(device)
        for impl in impls:
            reason = unavailable_reason(impl, device)
            if reason:
                raise ValueError(f"impls: {impl}: {reason}")
        out = []
        for model in self.models:
            for dtype in self.dtypes:
                dt = dtype if dtype != "auto" else default_dtype(model, device)
                out.append(SweepConfig(**self.shared(), model_spec=model, dtype=dt, impls=list(impls),
                                       experiment=self.name, device=device))
        return out


def load_experiment(path: str | Path) -> ExperimentDef:
    """Parse a definition; unknown keys are errors (a typo must not silently fall back to a default)."""
    path = Path(path)
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    if "model" in data:  # single-value spellings, for short definitions
        data.setdefault("models", [data.pop("model")])
    if "dtype" in data:
        data.setdefault("dtypes", [data.pop("dtype")])
    known = {f.name for f in fields(ExperimentDef)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
    missing = [k for k in ("name", "seqs") if k not in data]
    if missing:
        raise ValueError(f"missing required keys {missing}")
    if isinstance(data.get("plugins"), list):  # plugin files are named relative to the definition
        data["plugins"] = [str(path.parent / p) if isinstance(p, str) and p.endswith(".py")
                           and not Path(p).is_absolute() and (path.parent / p).is_file() else p
                           for p in data["plugins"]]
    if isinstance(data.get("prompts"), str):  # a prompts file is named relative to the definition
        rel = path.parent / Path(data["prompts"]).expanduser()
        if not Path(data["prompts"]).expanduser().is_absolute() and rel.exists():
            data["prompts"] = str(rel)
    return ExperimentDef(**data)


def results_path(results_dir: str | Path, device_slug: str, name: str) -> Path:
    return Path(results_dir) / device_slug / f"{name}.jsonl"


def default_results_dir(device_slug: str) -> Path:
    """Where an experiment's rows go without ``--results-dir``: ``experiments/results`` of the checkout on a GPU
    (the recorded results, committed with the code that made them); a CPU run only checks the harness, so its rows go
    outside the checkout, to ``$LLM_ATTN_CACHE/results`` (default ``~/.cache/llm_attn/results``)."""
    from llm_attn.models.synthetic import _cache_root  # noqa: PLC0415

    return _cache_root(None) / "results" if device_slug == "cpu" else DEFAULT_RESULTS
