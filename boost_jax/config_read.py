"""Reading a config: a strict YAML file and `key=value` overrides into nested mappings, and
those into a typed tree, each value checked against its dataclass annotation.

    read_yaml(path)                  the mapping in a YAML file; a key given twice in one block
                                     is an error, not silently the last
    parse_overrides(["k=v", ...])    the command line's overrides: text keys verbatim, other
                                     values read as YAML
    set_dotted(root, tree, k, v)     a dotted override `a.b.c=v` into the nested dicts
    build(cls, data)                 nested dicts → dataclass `cls`, one-line ConfigError per
                                     mistake (the key, what was expected, the closest valid key)

int → float is the only implicit conversion (and a number YAML 1.1 leaves as text, `1e-3`);
strings are refused if they hold a control character or are not UTF-8 (a newline in a path
would become a line of a generated script).
The schema itself is boost_jax/config.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import types
import typing
from typing import Any, Literal, Union

import yaml

from boost_jax.errors import ConfigError, UserError, control_char, lone_surrogate

INT64 = 2**63  # every integer value fits numpy's int64


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"a list of {_type_name(arg)}"
    if dataclasses.is_dataclass(tp):
        return "{" + ", ".join(f"{f.name}: ..." for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


class _WrongType(ConfigError):
    pass


def _coerce_literal(key: str, value: Any, tp) -> Any:
    typed = shown(value)
    if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans
        typed = (f"{str(value).lower()} (YAML reads {'yes/on' if value else 'no/off'} as a "
                 "boolean)")
        value = "on" if value else "off"
    if value not in typing.get_args(tp):
        raise ConfigError(f"{key}={typed} is not valid: expected {_type_name(tp)}")
    return value


def _coerce_union(key: str, value: Any, tp, bad: _WrongType) -> Any:
    """The first member that takes `value` (None only where the union allows it)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(key, value, a)
        except _WrongType:  # another member may take it; a value out of range is final
            pass
    raise bad


def _coerce_list(key: str, value: Any, tp, bad: _WrongType) -> list:
    (arg,) = typing.get_args(tp)
    if isinstance(value, str):  # `tp_axes=pair` on the command line
        value = [v for v in value.split(",") if v]
    if not isinstance(value, (list, tuple)):
        raise bad
    return [_coerce(f"{key}[{i}]", v, arg) for i, v in enumerate(value)]


def _coerce_int(key: str, value: Any, bad: _WrongType) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad
    if not -INT64 <= value < INT64:
        raise ConfigError(f"{key}={value} is out of range; use a value of at most {INT64 - 1}")
    return value


def _coerce_float(key: str, value: Any, bad: _WrongType) -> float:
    if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        if not value.isascii():  # float() would read other scripts' digits
            raise bad
        try:
            value = float(value)
        except ValueError:
            raise bad from None
        if not math.isfinite(value):  # `nan`, `inf` typed as strings
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    return float(value)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = \
    2, 6, 6, 80, 80


def shown(value: Any) -> str:
    """`value` as an error shows it: short whatever its size (YAML aliases can make a list of
    a billion items from a few lines; it is never written out whole)."""
    text = _SHORT.repr(value)
    return text if len(text) <= 160 else text[:160] + "..."


# a path is at most PATH_MAX (4096) bytes on Linux; a run's name heads plots, logs and scripts
MAX_TEXT, MAX_NAME = 4096, 256


def _coerce_str(key: str, value: Any, bad: _WrongType) -> str:
    if not isinstance(value, str):
        raise bad
    cap = MAX_NAME if key == "name" else MAX_TEXT
    if len(value) > cap:  # never echoed: it may be megabytes
        raise ConfigError(f"{key} is {len(value):,} characters long, more than the {cap:,} it "
                          f"may have; shorten it (it starts {value[:40]!r})")
    c = control_char(value)
    if c is not None:  # a newline in a name or path would become a line of a script
        raise ConfigError(f"{key}={value!r} contains a control character ({c}); remove it")
    if lone_surrogate(value) is not None:  # bytes of the command line that are not UTF-8
        raise ConfigError(f"{key}={value!r} is not UTF-8 text; write it in UTF-8")
    return value


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against annotation `tp`; int→float is the only implicit conversion."""
    origin = typing.get_origin(tp)
    bad = _WrongType(f"{key}={shown(value)} has the wrong type: expected {_type_name(tp)}")
    if origin is Literal:
        return _coerce_literal(key, value, tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(key, value, tp, bad)
    if dataclasses.is_dataclass(tp):  # an entry of a list of records (data.sources)
        return _record(key, value, tp)
    if origin is list:
        return _coerce_list(key, value, tp, bad)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        return _coerce_int(key, value, bad)
    if tp is float:
        return _coerce_float(key, value, bad)
    if tp is str:
        return _coerce_str(key, value, bad)
    raise bad


def _record(key: str, value: Any, tp):
    """A {field: value} mapping as dataclass `tp`, each field coerced; one line per mistake."""
    fields = [f.name for f in dataclasses.fields(tp)]
    shape = "{" + ", ".join(f"{f}: ..." for f in fields) + "}"
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={shown(value)} has the wrong type: expected a mapping {shape}")
    for k in value:
        if k not in fields:
            raise ConfigError(f"{key} has unknown key {k!r}; each entry is {shape}")
    required = [f.name for f in dataclasses.fields(tp) if f.default is dataclasses.MISSING]
    for k in required:
        if k not in value:
            raise ConfigError(f"{key} has no {k!r}; each entry is {shape}")
    hints = typing.get_type_hints(tp)
    try:
        return tp(**{k: _coerce(f"{key}.{k}", v, hints[k]) for k, v in value.items()})
    except _WrongType as e:  # final: named at the field (`weight`), not the whole list
        raise ConfigError(str(e)) from None


def all_keys(cls, prefix="") -> list[str]:
    """Every dotted leaf key of dataclass `cls`."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def unknown_key(root, key: str, lead: str = "") -> ConfigError:
    """The error for `key`, not a key of dataclass `root`: the closest valid spelling."""
    valid = all_keys(root)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # match on the last component: `stesp` → `train.steps`
        leaf = key.split(".")[-1]
        close = [k for k in valid if k.split(".")[-1] in
                 difflib.get_close_matches(leaf, [v.split(".")[-1] for v in valid], n=1, cutoff=0.6)]
    hint = f"; did you mean {close[0]!r}?" if close else "; see boost_jax/config.py for valid keys"
    return ConfigError(f"{lead}unknown config key {key!r}{hint}")


def build(cls, data: dict, prefix: str = "", root=None):
    """`data` (nested mappings) as dataclass `cls`, every value coerced to its annotation;
    unknown keys are named against `root`'s (default `cls`) with the closest valid spelling."""
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got "
                          f"{shown(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            full = prefix + str(key)
            if full in all_keys(root):  # `train.steps: 5` in a file
                head, _, leaf = full.rpartition(".")
                raise ConfigError(f"config key {full!r} is written dotted in a file; nest it: "
                                  f"{head}: on one line, then {leaf}: ... indented under it")
            for _ in range(4):  # the dotted key, a few levels deep (an alias may loop)
                if not (isinstance(value, dict) and value):
                    break
                key, value = next(iter(value.items()))
                full += f".{key}"
            raise unknown_key(root, full)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):  # an empty section (`model:`) keeps the defaults
            kwargs[key] = build(tp, {} if value is None else value, prefix + key + ".", root)
        else:
            kwargs[key] = _coerce(prefix + key, value, tp)
    return cls(**kwargs)


def set_dotted(root, tree: dict, key: str, value: Any) -> None:
    """tree[a][b][c] = value for key `a.b.c` (an unknown key is named against `root`'s). A
    section (`model={d_model: 64}`) takes a mapping, merged into what the file set."""
    parts = key.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        nxt = node.setdefault(p, {})
        if nxt is None and dataclasses.is_dataclass(annotation(root, ".".join(parts[:i + 1]))):
            nxt = node[p] = {}  # an empty section in the file (`model:`) keeps the defaults
        if not isinstance(nxt, dict):
            raise unknown_key(root, key)
        node = nxt
    if dataclasses.is_dataclass(annotation(root, key)):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={shown(value)} sets a whole section: give its keys, e.g. "
                              f"{key}.KEY=VALUE, or a mapping such as {key}={{KEY: VALUE}}")
        for k, v in value.items():
            set_dotted(root, tree, f"{key}.{k}", v)
        return
    node[parts[-1]] = value


YAML_NULLS = ("null", "Null", "NULL", "~")


def annotation(root, key: str):
    """The annotation of dotted `key` in dataclass `root` (None: no such key)."""
    tp = root
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
        if tp is None:
            return None
    return tp


def _text_key(tp) -> bool:
    """A key whose value is text (str, or str or null): typed verbatim, never read as YAML."""
    if tp is str:
        return True
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else ()
    return set(args) == {str, type(None)}


def parse_overrides(overrides: list[str], root=None) -> list[tuple[str, Any]]:
    """`key=value` strings → (key, value). A text key of `root` keeps the value exactly as typed
    (`out_dir=/a #b` is that path, `yes` a name; a YAML null is None where null is allowed);
    other values are read as YAML, and one YAML cannot read stays a string."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=50")
        key, raw = item.split("=", 1)
        key = key.strip()
        tp = annotation(root, key) if root is not None else None
        if tp is not None and _text_key(tp):
            value = None if tp is not str and raw in YAML_NULLS else raw
        else:
            try:
                value = yaml.load(raw, Loader=_PlainNumbers) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
            except RecursionError:
                raise ConfigError(f"override {key}=... nests too deeply to be a value; use a "
                                  "plain value or a flat list such as [a,b]") from None
        out.append((key, value))
    return out


# --------------------------------------------------------------------------- YAML files


class _PlainNumbers(yaml.SafeLoader):
    """SafeLoader reading numbers as written: YAML 1.1's octal (`010` is 8) and base-60
    (`1:30` is 90) integers and floats stay text, which a number key then refuses."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_PlainNumbers.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag not in (_INT, _FLOAT)]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_PlainNumbers.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"),
                                    list("-+0123456789"))
_PlainNumbers.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


class _StrictLoader(_PlainNumbers):
    """_PlainNumbers that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`, merged by super()
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key that is not a plain name", key_node.start_mark)
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


CONFIG_LIMIT = 16 << 20  # far above any real config; /dev/zero or a 1 GB file stops at once


def _read_text(path: str) -> str:
    from boost_jax.file_kind import read_regular

    try:
        raw = read_regular(path, "config file", CONFIG_LIMIT)
    except UserError as e:
        raise ConfigError(str(e)) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} on "
                          f"line {line}); save it as UTF-8") from None


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file at `path`, or a one-line ConfigError naming the problem."""
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a folder; pass a YAML file, e.g. --config "
                          "configs/demo.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist; pass --config configs/demo.yaml")
    try:
        tree = yaml.load(_read_text(path), Loader=_StrictLoader)
    except RecursionError:
        raise ConfigError(f"config file {path!r} nests too deeply to be a config; write it as "
                          "model:, train:, ... blocks of key: value") from None
    except _DuplicateKey as e:
        raise ConfigError(
            f"config file {path!r} sets {e.key!r} twice in one block (lines {e.first} and "
            f"{e.again}); keep one (YAML would silently use only the second)") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"config file {path!r} is not valid YAML{where}; fix the syntax") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path!r} holds a YAML {type(tree).__name__}, not a mapping of sections; "
            "write it as model:, train:, ... blocks of key: value")
    return tree
