"""House rules read from boost_jax's syntax trees: no docstring over 25 lines (a long
derivation belongs in benchmarks/README.md, with a pointer from the code), and no function of 60
lines or more."""

import ast
import glob
import os

from train_proc import ROOT

MAX_DOCSTRING_LINES = 25
MAX_FUNCTION_LINES = 59
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _trees():
    paths = sorted(glob.glob(os.path.join(ROOT, "boost_jax", "**", "*.py"), recursive=True))
    assert len(paths) > 50, "boost_jax's sources not found"
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), ast.parse(f.read(), path)


def long_docstrings(limit=MAX_DOCSTRING_LINES):
    """`path:line name (N lines)` for each module, class or function docstring over `limit`."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, DOC_NODES):
                continue
            if ast.get_docstring(node, clean=False) is None:
                continue
            expr = node.body[0]  # the docstring's source lines, its quotes included
            n = expr.end_lineno - expr.lineno + 1
            if n <= limit:
                continue
            name = getattr(node, "name", "<module>")
            found.append(f"{path}:{expr.lineno} {name} ({n} lines)")
    return found


def long_functions(limit=MAX_FUNCTION_LINES):
    """`path:line name (N lines)` for each function or method longer than `limit` lines."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_docstring_over_25_lines():
    bad = long_docstrings()
    assert not bad, "docstrings over 25 lines (move derivations to benchmarks/README.md):\n" \
        + "\n".join(bad)


def test_no_function_of_60_lines():
    bad = long_functions()
    assert not bad, "functions of 60 lines or more:\n" + "\n".join(bad)


def test_the_checkers_can_fail():
    """Each checker finds what it looks for once the limit is low enough."""
    assert long_docstrings(limit=1) and long_functions(limit=5)
