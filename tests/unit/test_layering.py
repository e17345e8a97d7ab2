"""Layering of boost_jax/: the parallel layout is validated in one place (sharding/parallel.check)
and the step, the sharding code and the model's forward take config sections, never the whole
run Config. Read with `ast`, so a call or an import inside a function counts too."""

import ast
import pathlib

from train_proc import ROOT

PACKAGE = pathlib.Path(ROOT) / "boost_jax"
# where the run Config must not be named: the step, the sharding code, the model's forward
NO_CONFIG = ("boost_jax/step/", "boost_jax/sharding/", "boost_jax/layers/forward.py")
# validator -> the one file allowed to call it
VALIDATORS = {("stages", "validate"): "boost_jax/sharding/parallel.py",
              (None, "validate_tp"): "boost_jax/sharding/parallel.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text("utf-8"))


def _calls(tree: ast.AST, owner, name: str) -> int:
    """Calls of `owner.name(...)` (owner None: `name(...)` or `anything.name(...)`)."""
    def hit(f):
        if isinstance(f, ast.Name):
            return owner is None and f.id == name
        if isinstance(f, ast.Attribute) and f.attr == name:
            return owner is None or (isinstance(f.value, ast.Name) and f.value.id == owner)
        return False

    return sum(isinstance(n, ast.Call) and hit(n.func) for n in ast.walk(tree))


def _imports_validate_by_name(tree: ast.AST) -> bool:
    """`from ...stages import validate`: a call of it would escape _calls."""
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("stages")
               and any(a.name == "validate" for a in n.names) for n in ast.walk(tree))


def _names_config(tree: ast.AST) -> list[int]:
    """Lines that import or name `Config` (imports, hints, `config.Config`, "Config" hints)."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            hit = any(a.name.split(".")[-1] == "Config" for a in n.names)
        elif isinstance(n, ast.Name):
            hit = n.id == "Config"
        elif isinstance(n, ast.Attribute):
            hit = n.attr == "Config"
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            hit = n.value == "Config"  # a string type hint
        else:
            hit = False
        if hit:
            lines.append(n.lineno)
    return lines


def test_each_validator_is_called_from_one_place():
    for (owner, name), home in VALIDATORS.items():
        callers = {}
        for rel, tree in _modules():
            n = _calls(tree, owner, name)
            if n:
                callers[rel] = n
            assert not (owner and _imports_validate_by_name(tree)), rel
        assert callers == {home: 1}, (owner, name, callers)


def test_config_is_not_named_by_the_step_sharding_or_forward():
    bad = {rel: lines for rel, tree in _modules()
           if rel.startswith(NO_CONFIG) and (lines := _names_config(tree))}
    assert not bad, bad


def test_the_checks_see_what_they_look_for():
    """The detectors on small sources: they must fail on the shapes they guard against."""
    inner = ast.parse("def f(c):\n    from boost_jax.config import Config\n    return c\n")
    hint = ast.parse("def f(c: 'Config'): ...\n")
    attr = ast.parse("import boost_jax.config as bc\ndef f(c: bc.Config): ...\n")
    sections = ast.parse("from boost_jax.config import ModelConfig, ParallelConfig\n")
    assert _names_config(inner) and _names_config(hint) and _names_config(attr)
    assert not _names_config(sections)
    two = ast.parse("stages.validate(cfg)\nif x:\n    stages.validate(cfg)\nvalidate_tp(c, m)\n")
    assert _calls(two, "stages", "validate") == 2 and _calls(two, None, "validate_tp") == 1
    assert _calls(ast.parse("cfg.validate()"), "stages", "validate") == 0
    assert _imports_validate_by_name(ast.parse("from boost_jax.sharding.stages import validate"))
