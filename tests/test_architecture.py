"""The package's imports flow one way (README, "How the code is laid out"):

    CLIs -> harness / reporting -> patches -> registry + impls -> ops -> kernel contract, reference, kernel builds

Walks every module of llm_attn/ and patches/ (installed as llm_attn.patches) with ``ast``, no import executed, and
collects every import statement: module-level imports AND the ones inside functions (lazy imports that keep
``import llm_attn`` light are imports all the same: they count). It then fails on

- any import of a command-line module (``llm_attn.ttft``, ``bench``, ``experiment``, ``report``,
  ``llm_attn.models.__main__``) from another module: the CLIs are shells over the library, never the library;
- any import cycle between modules (a strongly connected component of more than one module, or a module importing
  itself);
- any import back up the layers below (a lower layer importing a higher one), e.g. ``llm_attn.registry`` importing
  ``llm_attn.ops`` (the generic registry must not special-case one implementation), ``llm_attn.backward`` importing
  ``llm_attn.ops``.

``from llm_attn import x`` counts as an import of the submodule ``llm_attn.x`` when there is one, else of the
package ``llm_attn`` itself. Importing a submodule also runs its parent packages' ``__init__``; that implicit edge
is not counted (it would make every package a cycle with its children). Imports by string (the registry loading its
built-in entries with importlib) are not imports of the code and are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI_MODULES = {"llm_attn.ttft", "llm_attn.bench", "llm_attn.experiment", "llm_attn.report",
               "llm_attn.models.__main__"}
EXTENSIONS = {"llm_attn._C"}  # compiled (kernels/binding.cpp): imports nothing of ours

# Layers, lowest first. A module may import modules of its own layer or below, never above.
LAYERS = [
    ("kernel builds and contract", ["llm_attn._environ", "llm_attn._kernel_table", "llm_attn._cuda_abi", "llm_attn._plan", "llm_attn._nvrtc",
                                    "llm_attn._nvrtc_sm90", "llm_attn._ext", "llm_attn.kernel_contract",
                                    "llm_attn.reference", "llm_attn.quant_reference", "llm_attn.quant_reference_int8",
                                    "llm_attn.kv_cache_reference", "llm_attn.envinfo", "llm_attn.awq", "llm_attn._version",
                                    "llm_attn._cli"]),
    ("ops", ["llm_attn.ops", "llm_attn.backward"]),
    ("registry and implementations", ["llm_attn.registry", "llm_attn.impls"]),
    ("patches, models, executors", ["llm_attn.patches", "llm_attn.models", "llm_attn.thunder"]),
    ("harness and reporting", ["llm_attn.harness", "llm_attn.reporting"]),
    ("package facade and CLIs", ["llm_attn", *sorted(CLI_MODULES)]),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for base, pkg in ((ROOT / "llm_attn", "llm_attn"), (ROOT / "patches", "llm_attn.patches")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if rel.parts[0] == "patches" and base.name == "llm_attn":
                continue  # the development symlink llm_attn/patches -> ../patches: walked as patches/
            parts = [pkg, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import statement of module ``name``, at any depth."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = []
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub not in EXTENSIONS:
                    targets.append(sub if sub in MODULES else mod)
        else:
            continue
        for t in targets:
            while t and t not in MODULES and "." in t:  # `import llm_attn.x.y` of an attribute path: its module
                t = t.rpartition(".")[0]
            if t in MODULES and t != name and (t, node.lineno) not in out:
                out.append((t, node.lineno))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            # "llm_attn" (the facade) is the package's __init__ alone, not everything under it.
            if (name == p or (p != "llm_attn" and name.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    return rank


def test_every_module_is_walked_and_placed_in_a_layer():
    assert {"llm_attn.ops", "llm_attn.registry", "llm_attn.patches._common", "llm_attn.harness.session",
            "llm_attn.models.loading", "llm_attn.reporting.plots", "llm_attn.kernel_contract"} <= set(MODULES)
    unplaced = [m for m in MODULES if _layer(m) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    assert sum(len(v) for v in GRAPH.values()) > 50  # the walk sees the imports (not an empty graph)


def test_no_module_imports_a_cli():
    bad = [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line in edges if t in CLI_MODULES]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            strong(v)
    detail = ["  " + " <-> ".join(c) + ": " + "; ".join(f"{m}:{line} imports {t}" for m in c
                                                        for t, line in GRAPH[m] if t in c) for c in sccs]
    assert not sccs, "import cycles:\n" + "\n".join(detail)


def test_imports_flow_down_the_layers():
    bad = [f"{m}:{line} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
           for m, edges in GRAPH.items() for t, line in edges if _layer(t) > _layer(m)]
    assert not bad, "imports back up:\n" + "\n".join(bad)


@pytest.mark.parametrize("cli", sorted(CLI_MODULES))
def test_the_clis_exist(cli):
    assert cli in MODULES, f"{cli} was moved: update CLI_MODULES"
