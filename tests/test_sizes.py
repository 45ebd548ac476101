"""Files along their seams: no product file (chest_xray, hfl_components, nvflare_jobs) reaches 500 lines and no
product function body reaches 80 lines (from its first statement, docstring included, to its end). No exemptions:
a file or function that grows past a limit is cut into private parts behind one public face."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("chest_xray", "hfl_components", "nvflare_jobs")
MAX_FILE_LINES = 500
MAX_BODY_LINES = 80


def _product_files() -> list[Path]:
    return sorted(f for pkg in PRODUCT for f in (REPO / pkg).rglob("*.py"))


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from a function's first body statement (its docstring, if any) to its last line."""
    return node.end_lineno - node.body[0].lineno + 1


def test_body_lines_counts_from_the_first_statement():
    f = ast.parse('def f(a,\n      b):\n    """doc"""\n    x = 1\n\n    return x\n').body[0]
    assert body_lines(f) == 4


def test_no_product_file_reaches_500_lines():
    big = [f"{f.relative_to(REPO)}: {n} lines" for f in _product_files()
           if (n := len(f.read_text().splitlines())) >= MAX_FILE_LINES]
    assert not big, "files at or above the limit (cut them along their seams):\n" + "\n".join(big)


def test_no_product_function_body_reaches_80_lines():
    long = []
    for f in _product_files():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) >= MAX_BODY_LINES:
                long.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name}: {body_lines(node)} lines")
    assert not long, "function bodies at or above the limit (cut them into steps):\n" + "\n".join(long)
