"""Shared fixtures and the test grids.

The GPU kernel grids (tests/test_kernel_gpu.py, tests/test_backward_gpu.py) are built with ``grid``: by default a
representative subset runs (every combination of tile, dtype, mask, head_dim and MHA/GQA/MQA at least once, with
rotating awkward lengths, every length at least once), so that ``python -m pytest -q tests`` stays under 10 minutes
on a GPU; the other cases carry the ``full`` marker and ``python -m pytest -q -m full tests`` runs them too (the
whole suite, every case: ``-m full`` is read as "include the full grid", not "only those"). ``LLM_ATTN_FULL=1`` does
the same. Only GPU tests may be marked ``full``: on a CPU machine the default runs every test that can run there.
"""

import importlib.util
import itertools
import os
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# The shape grid of the foundation issue: awkward lengths, q_len != kv_len, MHA / GQA 4:1 / MQA.
LENGTHS = [1, 17, 63, 127, 128, 129, 1000, 2049]
# (q_len, kv_len) pairs where q_len != kv_len: decode rows, a prompt chunk over a cache prefix, and q_len > kv_len
# (causal rows that see no key at all).
UNEQUAL = [(1, 1000), (1, 2049), (17, 1000), (63, 127), (128, 129), (129, 2049), (1000, 17), (127, 63)]
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}


FULL = "full"
_FULL_WORD = re.compile(r"\bfull\b")
_NOT_FULL = re.compile(r"\bnot\s+full\b")


def load_script(path: Path | str, name: str | None = None):
    """A script of experiments/ or examples/ (not packages) as a module; `path` relative to the repository root."""
    path = REPO / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import would: dataclasses and pickling look the module up there
    spec.loader.exec_module(mod)
    return mod


def _fmt(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def grid(axes: list[list], lengths: list, per_combo: int = 1) -> list:
    """``pytest.param``s for every combination of ``axes`` (categorical: tile, dtype, mask, head_dim, heads, ...)
    followed by every entry of ``lengths`` (a value or a tuple of values, e.g. (q_len, kv_len)). All but a spread
    subset carry the ``full`` marker: each combination of the axes keeps ``per_combo`` of the lengths, rotating from
    one combination to the next so that every length is kept by some combination too."""
    stride = max(1, len(lengths) // per_combo)
    params = []
    for c, combo in enumerate(itertools.product(*axes)):
        for j, length in enumerate(lengths):
            values = combo + (length if isinstance(length, tuple) else (length,))
            marks = () if (c + j) % stride == 0 else (pytest.mark.full,)
            params.append(pytest.param(*values, marks=marks, id="-".join(_fmt(v) for v in values)))
    return params


def full_grid_requested(config) -> bool:
    return bool(getattr(config, "_llm_attn_full", False))


def cpu_check_here(request, what: str) -> None:
    """Skip a slow CPU-side check on a GPU machine's default run (CI runs it on every submission; ``-m full`` runs
    it on a GPU machine too), so that the README's test command stays within its time budget there."""
    if torch.cuda.is_available() and not full_grid_requested(request.config):
        pytest.skip(f"{what}: a CPU check CI runs; on a GPU machine it runs with -m full")


WORKERS_ENV = "LLM_ATTN_TEST_WORKERS"
MAX_CPU_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """On a machine without a GPU, a run of whole folders (the README's ``python -m pytest -q tests``) is spread over
    the CPU cores by pytest-xdist (the ``dev`` extra), one test file per worker at a time (``--dist loadfile``: a
    file's module fixtures, such as one CLI run shared by its checks, run once). Half of the suite's time on a 2-core
    machine is single-threaded subprocess and compile work, so two workers nearly halve it. With a GPU the run stays in
    one process: the GPU tests share one device, and its grid is timed for one. ``-n N`` chooses yourself;
    ``LLM_ATTN_TEST_WORKERS=N`` sets the CPU workers (0: one process). Without pytest-xdist nothing changes."""
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    if hasattr(config, "workerinput"):  # a worker: it runs its share in its own process
        return
    if config.getoption("usepdb", False) or config.getoption("collectonly", False):
        return
    if not all(Path(a.split("::")[0]).is_dir() for a in config.args):  # a file or one test: not worth the workers
        return
    config.option.numprocesses = "auto"
    if getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadfile"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise pytest.UsageError(f"{WORKERS_ENV} must be a number of workers (0: one process), not {env!r}")
    if torch.cuda.is_available():
        return 0
    return min(MAX_CPU_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # One of several workers sharing the cores: one intra-op thread each (and in the CLIs they start), or their
        # thread pools oversubscribe the cores and spin against each other.
        threads = max(1, len(os.sched_getaffinity(0)) // int(config.workerinput.get("workercount", 1)))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and a kernel backend (compiled or NVRTC)")
    config.addinivalue_line("markers", f"{FULL}: a case of the full GPU kernel grid beyond the default subset; "
                                       f"`python -m pytest -m {FULL} tests` runs every test and every case")
    markexpr = config.option.markexpr or ""
    asked = _FULL_WORD.search(markexpr) is not None and _NOT_FULL.search(markexpr) is None
    config._llm_attn_full = asked or os.environ.get("LLM_ATTN_FULL", "").strip() not in ("", "0")
    if _FULL_WORD.search(markexpr):
        # "-m full" means: the whole suite including the full grid ("-m 'not full'": the default subset). The word
        # then selects every test, so that "-m 'gpu and full'" is every GPU test with its full grid.
        markexpr = _NOT_FULL.sub(FULL, markexpr)
        config.option.markexpr = _FULL_WORD.sub(f"({FULL} or not {FULL})", markexpr)


def pytest_report_header(config):
    if full_grid_requested(config):
        return "llm_attn: the full GPU kernel grid"
    return "llm_attn: the default subset of the GPU kernel grid (`-m full` runs every case)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker(FULL) and item.get_closest_marker("gpu") is None:
            raise pytest.UsageError(f"{item.nodeid} is marked {FULL!r} but is not a GPU test: the default run on a "
                                    f"CPU machine must keep every test that can run there")
    if full_grid_requested(config):
        return
    kept = [item for item in items if item.get_closest_marker(FULL) is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(FULL) is not None])
        items[:] = kept


KERNEL_BACKENDS = ("aot", "nvrtc")


@pytest.fixture(params=KERNEL_BACKENDS)
def cuda_ext(request):
    """Run the test on each kernel backend (the compiled extension, the NVRTC one) that is available, with that
    backend selected for flash_attn_func too; return its module. Skip without a GPU. A missing backend skips with
    the reason, unless it is named in LLM_ATTN_REQUIRE_BACKENDS (e.g. "aot,nvrtc": then it fails) or no backend
    at all is available (then it fails: a GPU machine must run the kernel). LLM_ATTN_BACKEND=aot|nvrtc runs one."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn import _ext

    name = request.param
    only = os.environ.get("LLM_ATTN_BACKEND", "").strip().lower()
    if only in KERNEL_BACKENDS and only != name:
        pytest.skip(f"LLM_ATTN_BACKEND={only} selects the other backend")
    status = _ext.backend_status()
    if status[name] != "available":
        required = {b.strip() for b in os.environ.get("LLM_ATTN_REQUIRE_BACKENDS", "").split(",") if b.strip()}
        if name in required or all(v != "available" for v in status.values()):
            pytest.fail(f"CUDA is available but the {name} kernel backend is not: {status[name]} "
                        f"(see README 'Building the kernel')")
        pytest.skip(f"{name} backend not available: {status[name]}")
    prev = _ext.set_backend(name)
    try:
        yield _ext.get_ext()
    finally:
        _ext.set_backend(prev)


def build_with(cuda_ext, request, available, what: str):
    """``cuda_ext`` where ``available(cuda_ext)`` says that build has ``what`` (a kernel added after some builds were
    made), else a skip that names the build: for fixtures of tests that need one such kernel."""
    if not available(cuda_ext):
        pytest.skip(f"the {request.node.callspec.params['cuda_ext']} build has no {what}: an extension built before it")
    return cuda_ext
