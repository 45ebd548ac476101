"""Seams of the product code (chest_xray, hfl_components, nvflare_jobs), judged on the syntax tree.

Layering between folders: nothing under hfl_components imports nvflare_jobs, NVFlare is imported only under
hfl_components/flare/, the method adapters do not import the site runtime, chest_xray imports no model/FL code.

Seam rules over every product module (they replace the old file / function-body line caps):

* **no import cycle** between modules, counting imports at any depth (function-local ones included) and string
  references to the project's own modules (``"hfl_components.upload_checks:check_model_upload"``);
* **no cross-module use of a ``_private`` name** (``from x import _y``, ``x._y`` on an imported project module), and a
  private module (``pkg/_part.py``) is imported only from inside its package;
* **re-exports only in ``__init__.py``**: a plain module that imports a name and lists it in ``__all__``, imports it
  without using it, or is the place another module imports that name from, is a shim;
* **at most 60 code lines per function** (from its first statement to its end; blank lines, comments and docstrings
  are not counted, nested functions count toward their parent);
* **the command line alone exits**: no product module outside ``nvflare_jobs/cli.py`` and ``nvflare_jobs/commands/``
  imports argparse, calls ``sys.exit`` / ``exit`` / ``quit`` or raises ``SystemExit``; the ``__main__`` blocks of the
  scripts in ``SCRIPTS`` (and the entry functions named there) are the exceptions.

Each seam rule is a ratchet: ``ALLOWED[rule]`` lists today's violations by key. A violation not in the list fails, and
so does a listed entry that no longer violates (remove it: the lists only shrink).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("chest_xray", "hfl_components", "nvflare_jobs")
CONSUMERS = ("tests", "benchmarks", "studies")  # not product, but importing a name from a shim marks the shim
MAX_CODE_LINES = 60
CLI = ("nvflare_jobs/cli.py", "nvflare_jobs/commands/")
# scripts run as ``python -m``: their ``if __name__ == "__main__":`` block and the entry functions named here may
# parse arguments and exit
SCRIPTS = {"chest_xray/splits.py": set(), "nvflare_jobs/spec.py": set(),
           "hfl_components/flare/site_script.py": set()}
_MODULE_REF = re.compile(r"(?:%s)(?:\.[A-Za-z_]\w*)*(?::[\w.]+)?" % "|".join(PRODUCT))


# ----------------------------------------------------------------------------------------------- the syntax tree
@dataclass
class Module:
    name: str  # dotted: hfl_components.fusion.cka (a package's __init__ is the package's name)
    rel: str  # path relative to the root: hfl_components/fusion/cka.py
    tree: ast.Module
    source: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)


@dataclass
class Import:
    line: int
    module: str  # the absolute module named by the statement (``from X import n``: X; ``import a.b``: a.b)
    name: str | None  # the imported name of ``from X import name``; None for ``import a.b``
    bound: str  # the local name it binds
    top: bool  # a statement of the module body (not inside a function or class)


def load(root: Path, packages=PRODUCT) -> dict[str, Module]:
    """Every ``*.py`` under ``root/<package>`` for each package, parsed, by dotted module name."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_pkg else parts)
            source = path.read_text()
            m = Module(name, path.relative_to(root).as_posix(), ast.parse(source, str(path)), source, is_pkg)
            m.imports = _imports(m)
            mods[name] = m
    return mods


def _imports(m: Module) -> list[Import]:
    pkg = m.name if m.is_package else m.name.rpartition(".")[0]
    top = {id(n) for n in _top_statements(m.tree)}
    out = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                out.append(Import(node.lineno, a.name, None, bound, id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                out.append(Import(node.lineno, src, a.name, a.asname or a.name, id(node) in top))
    return out


def _top_statements(tree: ast.Module):
    """The module body's statements, looking into top-level if / try blocks (not into functions or classes)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owner(mods, dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a module of ``mods``."""
    while dotted and dotted not in mods:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _in_product(dotted: str) -> bool:
    return dotted.split(".")[0] in PRODUCT


def _string_refs(m: Module) -> list[tuple[int, str]]:
    """(line, text) of every string that names a project module (``pkg.mod`` or ``pkg.mod:function``), with ``+`` of
    module-level string constants folded (``_CTL + "fens:fens_local"``)."""
    consts = {}
    for node in m.tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            consts.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})

    def fold(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return consts.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = fold(node.left), fold(node.right)
            return left + right if left is not None and right is not None else None
        return None

    out = []
    for node in ast.walk(m.tree):
        if isinstance(node, (ast.Constant, ast.BinOp)) and (s := fold(node)) is not None and _MODULE_REF.fullmatch(s):
            out.append((node.lineno, s))
    return out


# -------------------------------------------------------------------------------------------------- the rules
def import_graph(mods) -> dict[str, dict[str, list[int]]]:
    """module -> {module it imports or names in a string: [lines]} over ``mods`` (self references left out).
    ``from pkg import sub`` goes to the submodule ``pkg.sub``; any other ``from X import n`` to the module X."""
    graph = {}
    for name, m in mods.items():
        edges: dict[str, list[int]] = {}
        for imp in m.imports:
            full = f"{imp.module}.{imp.name}" if imp.name and imp.name != "*" else imp.module
            target = full if full in mods else _owner(mods, imp.module)
            if target and target != name:
                edges.setdefault(target, []).append(imp.line)
        for line, text in _string_refs(m):
            target = _owner(mods, text.split(":")[0])
            if target and target != name:
                edges.setdefault(target, []).append(line)
        graph[name] = edges
    return graph


def cycle_edges(mods) -> dict[str, str]:
    """Every import edge that lies on a cycle (both ends in one strongly connected component), keyed
    ``"rel.py -> module"``, with the cycle's members in the message."""
    graph = import_graph(mods)
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]

    def strong(v):  # Tarjan, recursive: the graph has a few hundred nodes
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = {}
    for comp in (c for c in comps if len(c) > 1):
        for v in sorted(comp):
            for w, lines in sorted(graph[v].items()):
                if w in comp:
                    out[f"{mods[v].rel} -> {w}"] = f"lines {lines}; cycle among {sorted(comp)}"
    return out


def _private_module_misuse(mods, importer: str, dotted: str) -> str | None:
    """The first private module on the module path ``dotted`` (``pkg._part``) whose package ``importer`` is outside."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        mod, parent = ".".join(parts[: i + 1]), ".".join(parts[:i])
        if mod not in mods:
            break
        if _is_private(parts[i]) and not (importer == parent or importer.startswith(parent + ".")):
            return mod
    return None


def private_uses(mods) -> dict[str, str]:
    """Every use of another module's ``_private`` name, keyed ``"rel.py:module._name"``: ``from X import _n``,
    ``alias._n`` on an imported project module, and a private module imported from outside its package."""
    out = {}
    for name, m in mods.items():
        def flag(target, line, how):
            out.setdefault(f"{m.rel}:{target}", f"line {line}: {how}")

        alias = {}  # local name -> project module it is bound to
        for imp in m.imports:
            if not _in_product(imp.module):
                continue
            full = f"{imp.module}.{imp.name}" if imp.name and imp.name != "*" else imp.module
            if full in mods:  # a module: ``import a.b``, ``from a import b``
                if (bad := _private_module_misuse(mods, name, full)):
                    flag(bad, imp.line, "private module imported from outside its package")
                plain = imp.name is None and imp.bound == imp.module.split(".")[0]  # ``import a.b`` binds ``a``
                alias[imp.bound] = imp.bound if plain else full
                continue
            if (bad := _private_module_misuse(mods, name, imp.module)):
                flag(bad, imp.line, "private module imported from outside its package")
            if imp.name and _is_private(imp.name) and _owner(mods, imp.module) != name:
                flag(full, imp.line, f"from {imp.module} import {imp.name}")
        for node in ast.walk(m.tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in alias):
                continue
            path = alias[base.id]
            for attr in chain:
                if f"{path}.{attr}" in mods:
                    path = f"{path}.{attr}"
                    if (bad := _private_module_misuse(mods, name, path)):
                        flag(bad, node.lineno, "private module used from outside its package")
                    continue
                if _is_private(attr) and path != name:
                    flag(f"{path}.{attr}", node.lineno, f"{base.id}...{attr}")
                break
        for line, text in _string_refs(m):
            target, _, attr = text.partition(":")
            owner = _owner(mods, target)
            if owner and (bad := _private_module_misuse(mods, name, owner)):
                flag(bad, line, f"string {text!r}")
            if owner and owner != name and any(_is_private(p) for p in (target[len(owner):] + "." + attr).split(".")):
                flag(text, line, f"string {text!r}")
    return out


def _defined_names(m: Module) -> set[str]:
    """Names a module binds itself at top level (def, class, assignment), not by import."""
    out = set()
    for node in _top_statements(m.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _all_names(m: Module) -> set[str]:
    for node in m.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return set()


def reexports(mods, consumers=()) -> dict[str, str]:
    """Names a plain module (not ``__init__.py``) passes on without owning them, keyed ``"rel.py:name"``: imported at
    top level and listed in ``__all__``, imported from a project module and never used, or imported from this module by
    another module (product or ``consumers``) though this module only imports it."""
    out = {}
    imported = {}  # module -> {bound name: import} of its top-level imports
    for name, m in mods.items():
        own = _defined_names(m)
        imported[name] = {i.bound: i for i in m.imports if i.top and i.bound not in own and i.name != "*"}
    for name, m in mods.items():
        if m.is_package:
            continue
        used = {n.id for n in ast.walk(m.tree) if isinstance(n, ast.Name)}
        for bound, imp in imported[name].items():
            if bound in _all_names(m):
                out[f"{m.rel}:{bound}"] = f"line {imp.line}: imported and listed in __all__"
            elif _in_product(imp.module) and bound not in used:
                out[f"{m.rel}:{bound}"] = f"line {imp.line}: imported from {imp.module} and not used here"
    for c in list(mods.values()) + list(consumers):
        for imp in c.imports:
            src = mods.get(imp.module)
            if src is None or src.is_package or not imp.name or imp.name not in imported[imp.module]:
                continue
            origin = imported[imp.module][imp.name]
            out.setdefault(f"{src.rel}:{imp.name}", f"{c.rel}:{imp.line} imports {imp.name} from here; it is "
                                                     f"{origin.module}'s")
    return out


def code_lines(source: str, tree: ast.Module | None = None) -> set[int]:
    """Line numbers (1-based) that hold code: a token other than a comment, and not part of a docstring (any string
    statement of its own)."""
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree or ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.difference_update(range(node.lineno, node.end_lineno + 1))
    return lines


def _functions(tree: ast.Module):
    """(qualified name, node) of every function, methods and nested functions included (``Class.method``,
    ``outer.inner``)."""
    todo = [(node, "") for node in tree.body]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield qual, node
            todo += [(child, qual + ".") for child in ast.iter_child_nodes(node)]
        else:
            todo += [(child, prefix) for child in ast.iter_child_nodes(node)]


def long_functions(mods, cap: int = MAX_CODE_LINES) -> dict[str, str]:
    """Functions with more than ``cap`` code lines, keyed ``"rel.py:qualname"``."""
    out = {}
    for m in mods.values():
        lines = code_lines(m.source, m.tree)
        for qual, node in _functions(m.tree):
            n = len([ln for ln in lines if node.body[0].lineno <= ln <= node.end_lineno])
            if n > cap:
                out[f"{m.rel}:{qual}"] = f"line {node.lineno}: {n} code lines"
    return out


def _main_block(node) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def exits(mods, scripts=SCRIPTS) -> dict[str, str]:
    """argparse imports, ``sys.exit`` / ``exit`` / ``quit`` calls and ``raise SystemExit`` outside the command line,
    keyed ``"rel.py:scope:what"`` (scope: the enclosing function, or ``<module>``)."""
    out = {}
    for m in mods.values():
        if m.rel == CLI[0] or m.rel.startswith(CLI[1]):
            continue
        exempt = scripts.get(m.rel)
        sys_names = {i.bound for i in m.imports if i.module == "sys" and i.name is None}
        exit_names = {i.bound for i in m.imports if i.module == "sys" and i.name == "exit"} | {"exit", "quit"}

        def walk(node, scope):
            if exempt is not None and (_main_block(node) and scope == "<module>" or scope.split(".")[0] in exempt):
                return
            what = None
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
                what = "argparse"
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "exit" and isinstance(f.value, ast.Name) \
                        and f.value.id in sys_names or isinstance(f, ast.Name) and f.id in exit_names:
                    what = "sys.exit"
            elif isinstance(node, ast.Raise) and node.exc is not None:
                e = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(e, ast.Name) and e.id == "SystemExit":
                    what = "SystemExit"
            if what:
                out.setdefault(f"{m.rel}:{scope}:{what}", f"line {node.lineno}")
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
                walk(child, inner)

        walk(m.tree, "<module>")
    return out


# ----------------------------------------------------------------------------------------------- the ratchet
def _ratchet(rule: str, found: dict[str, str]) -> None:
    allowed = ALLOWED[rule]
    new = sorted(set(found) - allowed)
    gone = sorted(allowed - set(found))
    msg = []
    if new:
        msg.append(f"{len(new)} new {rule} violation(s) (fix them; the allow-list only shrinks):")
        msg += [f"  {k}  ({found[k]})" for k in new]
    if gone:
        msg.append(f"{len(gone)} allow-listed {rule} entr(y/ies) no longer violate: remove them from "
                   f"ALLOWED[{rule!r}] in tests/test_layering.py:")
        msg += [f"  {k}" for k in gone]
    assert not msg, "\n".join(msg)


@pytest.fixture(scope="module")
def product():
    return load(REPO)


@pytest.fixture(scope="module")
def consumers():
    return list(load(REPO, CONSUMERS).values())


def test_no_import_cycle(product):
    _ratchet("cycle", cycle_edges(product))


def test_no_private_name_used_across_modules(product):
    _ratchet("private", private_uses(product))


def test_re_exports_only_in_package_inits(product, consumers):
    _ratchet("reexport", reexports(product, consumers))


def test_functions_have_at_most_60_code_lines(product):
    _ratchet("long_function", long_functions(product))


def test_only_the_command_line_parses_arguments_and_exits(product):
    _ratchet("exit", exits(product))


# --------------------------------------------------------------------------------------- layering between folders
def test_nothing_under_hfl_components_imports_nvflare_jobs_and_nvflare_only_in_flare(product):
    bad = []
    for m in product.values():
        top = m.name.split(".")
        for imp in m.imports:
            root = imp.module.split(".")[0]
            if top[0] == "hfl_components" and root == "nvflare_jobs":
                bad.append(f"{m.rel}:{imp.line} imports {imp.module}")
            if top[0] == "hfl_components" and root == "nvflare" and top[1:2] != ["flare"]:
                bad.append(f"{m.rel}:{imp.line} imports NVFlare outside hfl_components/flare/")
            if top[0] == "chest_xray" and root in ("hfl_components", "nvflare_jobs", "nvflare"):
                bad.append(f"{m.rel}:{imp.line} imports {imp.module}")
    assert not bad, "\n".join(bad)


def test_adapters_do_not_import_the_site_runtime(product):
    """A method's adapter module holds its controller and its site handlers; the handlers get the site runtime as an
    argument, so no adapter imports the runtime (data loading, the site's model state)."""
    bad = [f"{m.rel}:{imp.line} imports {imp.module}" for m in product.values()
           if m.name.startswith("hfl_components.flare.controllers") for imp in m.imports
           if f"{imp.module}.{imp.name}".startswith("hfl_components.flare.site_tasks")]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------ the rules on hand-made packages
def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return load(tmp_path, ("hfl_components",))


def test_a_function_local_import_or_a_module_string_closes_a_cycle(tmp_path):
    mods = _tree(tmp_path, {"hfl_components/__init__.py": "", "hfl_components/a.py": "from hfl_components import b\n",
                            "hfl_components/b.py": "def f():\n    from .a import g\n",
                            "hfl_components/c.py": "X = 'hfl_components.'\nT = {'t': X + 'd:run'}\n",
                            "hfl_components/d.py": "import hfl_components.c\n",
                            "hfl_components/e.py": "import hfl_components.a\n"})
    assert set(cycle_edges(mods)) == {
        "hfl_components/a.py -> hfl_components.b", "hfl_components/b.py -> hfl_components.a",
        "hfl_components/c.py -> hfl_components.d", "hfl_components/d.py -> hfl_components.c"}


def test_private_names_and_private_modules(tmp_path):
    mods = _tree(tmp_path, {
        "hfl_components/__init__.py": "", "hfl_components/p/__init__.py": "from ._part import run\n",
        "hfl_components/p/_part.py": "def run(): pass\ndef _h(): pass\n",
        "hfl_components/p/q.py": "from ._part import run\n",  # inside the package: fine
        "hfl_components/x.py": "from hfl_components.p._part import run\n",
        "hfl_components/y.py": "from hfl_components.p import q\nimport hfl_components.p.q as qq\n"
                               "def f():\n    return q._k, qq._m, q.__name__\n",
        "hfl_components/z.py": "from hfl_components.y import _w, f\n"
                               "T = ('hfl_components.p.q:_run', 'hfl_components.y:f')\n"})
    assert set(private_uses(mods)) == {
        "hfl_components/x.py:hfl_components.p._part", "hfl_components/y.py:hfl_components.p.q._k",
        "hfl_components/y.py:hfl_components.p.q._m", "hfl_components/z.py:hfl_components.y._w",
        "hfl_components/z.py:hfl_components.p.q:_run"}


def test_a_module_passing_on_a_name_it_does_not_own_is_a_shim(tmp_path):
    mods = _tree(tmp_path, {
        "hfl_components/__init__.py": "from .a import f\n",  # a package face: fine
        "hfl_components/a.py": "def f(): pass\ndef g(): pass\ndef h(): pass\n",
        "hfl_components/b.py": "from .a import f, g, h\n__all__ = ['f']\ndef k():\n    return g\n",
        "hfl_components/c.py": "from hfl_components.b import k, g\n\ndef m():\n    return k, g\n"})
    assert reexports(mods) == {
        "hfl_components/b.py:f": "line 1: imported and listed in __all__",
        "hfl_components/b.py:h": "line 1: imported from hfl_components.a and not used here",
        "hfl_components/b.py:g": "hfl_components/c.py:1 imports g from here; it is hfl_components.a's"}


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(tmp_path):
    src = ('def f(a,\n      b):\n    """doc\n\n    more"""\n    # note\n    x = ("s"\n         "t")\n\n'
           '    def g():\n        "inner doc"\n        return 1\n    return x\n')
    mods = _tree(tmp_path, {"hfl_components/__init__.py": "", "hfl_components/a.py": src})
    assert sorted(code_lines(src)) == [1, 2, 7, 8, 10, 12, 13]
    assert long_functions(mods, cap=4) == {"hfl_components/a.py:f": "line 1: 5 code lines"}
    assert long_functions(mods, cap=5) == {}


def test_the_ratchet_fails_on_a_new_violation_and_on_a_listed_one_that_is_gone(monkeypatch):
    monkeypatch.setitem(ALLOWED, "cycle", {"a.py -> b", "c.py -> d"})
    _ratchet("cycle", {"a.py -> b": "", "c.py -> d": ""})
    with pytest.raises(AssertionError, match=r"1 new cycle violation.*\n\s+e.py -> f"):
        _ratchet("cycle", {"a.py -> b": "", "c.py -> d": "", "e.py -> f": ""})
    with pytest.raises(AssertionError, match=r"no longer violate.*\n\s+c.py -> d"):
        _ratchet("cycle", {"a.py -> b": ""})


def test_exits_are_found_outside_the_command_line_and_the_scripts_main_blocks(tmp_path):
    mods = _tree(tmp_path, {
        "hfl_components/__init__.py": "",
        "hfl_components/a.py": "import sys as s\nimport argparse\ndef f():\n    s.exit(1)\nclass C:\n"
                               "    def m(self):\n        raise SystemExit('x')\n",
        "hfl_components/b.py": "import sys\ndef main():\n    from argparse import ArgumentParser\n"
                               "if __name__ == '__main__':\n    sys.exit(main())\n"})
    assert set(exits(mods, scripts={})) == {
        "hfl_components/a.py:<module>:argparse", "hfl_components/a.py:f:sys.exit", "hfl_components/a.py:C.m:SystemExit",
        "hfl_components/b.py:main:argparse", "hfl_components/b.py:<module>:sys.exit"}
    assert set(exits(mods, scripts={"hfl_components/b.py": {"main"}})) == {
        "hfl_components/a.py:<module>:argparse", "hfl_components/a.py:f:sys.exit", "hfl_components/a.py:C.m:SystemExit"}


def current() -> dict[str, dict[str, str]]:
    """Today's violations of each seam rule (key -> where)."""
    mods = load(REPO)
    return {"cycle": cycle_edges(mods), "private": private_uses(mods),
            "reexport": reexports(mods, load(REPO, CONSUMERS).values()), "long_function": long_functions(mods),
            "exit": exits(mods)}


if __name__ == "__main__":  # print today's violations in the allow-lists' form (to shrink them after a fix)
    for rule, found in current().items():
        print(f"    {rule!r}: {{  # {len(found)}")
        print("".join(f'        "{k}",  # {v}\n' for k, v in sorted(found.items())), end="")
        print("    },")


# ------------------------------------------------------------------------------------------------ allow-lists
# Today's violations, rule by rule. Remove an entry when you fix it (the test says which); never add one.
ALLOWED: dict[str, set[str]] = {
    'cycle': set(),  # 0
    'private': set(),  # 0
    'reexport': set(),  # 0
    'long_function': set(),  # 0
    'exit': set(),  # 0
}
