"""Config files: strict YAML (a key given twice in one block is an error, not silently the last)
read into a plain mapping, every problem a one-line ConfigError naming the fix."""

from __future__ import annotations

import os

import yaml

from boost_jax.errors import ConfigError, UserError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

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
