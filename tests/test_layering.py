"""Imports run downward: nothing under hfl_components imports nvflare_jobs, NVFlare is imported only under
hfl_components/flare/, the method adapters do not import the site runtime, chest_xray imports no model/FL code, and the
hfl_components modules import each other without a cycle (lazy imports inside functions included)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth (relative imports resolved)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def _files(pkg: str) -> list[Path]:
    return sorted((REPO / pkg).rglob("*.py"))


def test_nothing_under_hfl_components_imports_nvflare_jobs_and_nvflare_only_in_flare():
    bad = []
    for f in _files("hfl_components"):
        rel = f.relative_to(REPO)
        for line, name in _imports(f):
            if name == "nvflare_jobs" or name.startswith("nvflare_jobs."):
                bad.append(f"{rel}:{line} imports {name}")
            if (name == "nvflare" or name.startswith("nvflare.")) and rel.parts[1] != "flare":
                bad.append(f"{rel}:{line} imports NVFlare outside hfl_components/flare/")
    for f in _files("chest_xray"):
        for line, name in _imports(f):
            if name.split(".")[0] in ("hfl_components", "nvflare_jobs", "nvflare"):
                bad.append(f"{f.relative_to(REPO)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_adapters_do_not_import_the_site_runtime():
    """A method's adapter module holds its controller and its site handlers; the handlers get the site runtime as an
    argument, so no adapter imports the runtime (data loading, the site's model state)."""
    bad = [f"{f.relative_to(REPO)}:{line} imports {name}"
           for f in _files("hfl_components/flare/controllers") for line, name in _imports(f)
           if name.startswith("hfl_components.flare.site_tasks")]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_hfl_components():
    mods = {_module(f): f for f in _files("hfl_components")}

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {t for _, n in _imports(f) if (t := target(n)) and t != m} for m, f in mods.items()}
    # a package's __init__ re-exporting its own submodules is not a cycle of the code
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
