"""The tests' layout: tests/unit starts no process, every tests/e2e file starts one (train.py,
python -m boost_jax..., a script), read from each file's syntax tree, not run."""

import ast
import glob
import importlib.util
import os

from train_proc import ROOT

TESTS = os.path.join(ROOT, "tests")
# helpers that start a process, by the module they come from
PROCESS_HELPERS = {"TrainProcess": "train_proc", "run_pair": "benchmarks.qgz_demo",
                   "run_all": "benchmarks.cross_node_quant_demo"}


def _files(folder):
    return sorted(glob.glob(os.path.join(TESTS, folder, "*.py")))


def _tree(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _imports(tree):
    """Modules imported, and the names imported from a module (`from m import name`)."""
    modules, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module.split(".")[0])
            names |= {a.name for a in node.names}
    return modules, names


def _uses(tree, name):
    return any(isinstance(n, ast.Name) and n.id == name or isinstance(n, ast.Attribute)
               and n.attr == name for n in ast.walk(tree))


def _starts_a_process(tree):
    """What marks a file as starting a process: subprocess itself or a helper built on it."""
    modules, names = _imports(tree)
    found = {"subprocess"} & modules
    found |= {n for n in PROCESS_HELPERS if n in names}
    if _uses(tree, "Popen"):
        found.add("Popen")
    return found


def test_unit_tests_start_no_process():
    files = _files("unit")
    assert len(files) > 20
    bad = {os.path.basename(p): sorted(_starts_a_process(_tree(p))) for p in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"tests/unit files that start a process (move those tests to tests/e2e): {bad}"


def test_every_e2e_file_starts_a_process():
    files = _files("e2e")
    assert len(files) > 10
    idle = [os.path.basename(p) for p in files if not _starts_a_process(_tree(p))]
    assert not idle, f"tests/e2e files that start no process (move them to tests/unit): {idle}"


def _starts_processes(module: str) -> bool:
    """The module imports subprocess, or a name from another helper module that does."""
    tree = _tree(importlib.util.find_spec(module).origin)
    if "subprocess" in _imports(tree)[0]:
        return True
    return any(isinstance(n, ast.ImportFrom) and n.module in PROCESS_HELPERS.values()
               and n.module != module and _starts_processes(n.module)
               for n in ast.walk(tree))


def test_the_process_helpers_do_start_one():
    for name, module in PROCESS_HELPERS.items():
        tree = _tree(importlib.util.find_spec(module).origin)
        assert _starts_processes(module), module
        assert any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name
                   for n in tree.body), (module, name)
    assert not _starts_processes("benchmarks.common")  # imports no helper, no subprocess


def test_test_files_live_in_one_folder_under_unique_names():
    """pytest imports test files by basename (the default prepend mode): one name, one file."""
    assert not glob.glob(os.path.join(TESTS, "test_*.py"))
    names = [os.path.basename(p) for p in _files("unit") + _files("e2e")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
