"""House rules read from boost_jax's syntax trees: no docstring over 25 lines (a long
derivation belongs in benchmarks/README.md, with a pointer from the code), no function of 60
lines or more, and no name that a function reads but nothing defines (an import dropped from
an error path only fails when that error happens)."""

import ast
import builtins
import glob
import os
import symtable

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


def undefined_names(sources=None):
    """`path name` for each global name a function reads that its module never binds and
    builtins lack (symtable's scopes: what pyflakes calls an undefined name)."""
    found = []
    for path, text in sources or ((p, open(os.path.join(ROOT, p)).read()) for p, _ in _trees()):
        top = symtable.symtable(text, path, "exec")
        bound = {s.get_name() for s in top.get_symbols()
                 if s.is_assigned() or s.is_imported() or s.is_namespace()}

        def walk(table):
            for s in table.get_symbols():
                name = s.get_name()
                if s.is_referenced() and s.is_global() and not (s.is_assigned() or s.is_imported()) \
                        and name not in bound and not hasattr(builtins, name) \
                        and name not in ("__file__", "__name__"):
                    found.append(f"{path} {table.get_name()}: {name}")
            for child in table.get_children():
                walk(child)

        walk(top)
    return found


def test_no_undefined_names():
    bad = undefined_names()
    assert not bad, "names read but defined nowhere:\n" + "\n".join(bad)


def test_the_checkers_can_fail():
    """Each checker finds what it looks for once the limit is low enough, or the name gone."""
    assert long_docstrings(limit=1) and long_functions(limit=5)
    lost = "from x import Refused\n\ndef f():\n    raise Refused('no')\n"
    assert undefined_names([("a.py", lost.split("\n", 1)[1])]) == ["a.py f: Refused"]
    assert undefined_names([("a.py", lost)]) == []
