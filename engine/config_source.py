"""Reading an engine config source into a raw dict, for `deepfleet.engine.config.load_config`.

A source is a dict (deep-copied, so the caller's stays untouched), a path to a .json/.yaml/.yml
file, a JSON object string, or that string base64-encoded (DeepSpeed accepts it). Problems become
one-line errors naming the file, line and column (malformed JSON or YAML, duplicate keys, which
both parsers would otherwise accept silently), never exceptions. Torch-free.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `5e8` as a number (YAML 1.1 wants `5.0e+8`; DeepSpeed configs say 5e8) and
    records duplicate keys (PyYAML silently keeps the last one) in `self.duplicates` as (key, line, column)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[Any, int, int]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are left to the base class, which rejects them with a mark
            if key in seen:
                self.duplicates.append((key, key_node.start_mark.line + 1, key_node.start_mark.column + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _no_duplicates(where: str, errors: list[str]):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                errors.append(f"{key}: duplicate key in {where}; keep only one")
            out[key] = value
        return out

    return hook


def read_source(source: Any, errors: list[str]) -> dict | None:
    """The raw config dict, or None with `errors` explaining why it cannot be read."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
        return _parse_json_string(source, errors)
    if not isinstance(source, (str, Path)) or not str(source).strip():
        errors.append(
            f"config: expected a dict, a file path or a JSON string, got {type(source).__name__} {source!r}; "
            "pass one of those"
        )
        return None
    path = Path(source)
    try:
        exists, is_file = path.exists(), path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the OS, a NUL byte, ...
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        exists, is_file = False, False
        errors.append(f"config: {_shorten(source)!r} is not a usable path ({reason}); pass a path to a "
                      ".json/.yaml file or a JSON object string")
    if isinstance(source, str) and not exists:
        decoded = _base64_json(source)
        if decoded is not None:  # DeepSpeed also accepts a base64-encoded JSON config string
            errors.clear()
            return _parse_json_string(decoded, errors)
    if errors:
        return None
    if not exists:
        errors.append(f"config: file not found: {_shorten(path)}; pass a path to a .json/.yaml file or a JSON "
                      "object string")
        return None
    if not is_file:
        errors.append(f"config: {path} is not a file; pass a .json/.yaml config file")
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        errors.append(f"config: cannot read {path} ({reason}); check the file's permissions and encoding")
        return None
    if path.suffix.lower() in (".yaml", ".yml"):
        loader = _YamlLoader(text)
        try:
            data = loader.get_single_data()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            errors.append(f"{where}: invalid YAML: {e.problem or e.context}; fix the YAML syntax there")
            return None
        except yaml.YAMLError as e:
            errors.append(f"{path}: invalid YAML: {e}; fix the YAML syntax")
            return None
        finally:
            loader.dispose()
        errors.extend(f"{path}:{line}:{col}: duplicate key {key!r}; keep only one" for key, line, col in loader.duplicates)
    else:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates(str(path), errors))
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}; fix the JSON syntax there")
            return None
    return _top_level(data, str(path), errors)


def _shorten(value: object, limit: int = 120) -> str:
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")  # one line, control characters visible
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _parse_json_string(text: str, errors: list[str]) -> dict | None:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates("the JSON string", errors))
    except json.JSONDecodeError as e:
        errors.append(f"config: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; fix the JSON syntax there")
        return None
    return _top_level(data, "the JSON string", errors)


def _base64_json(text: str) -> str | None:
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _top_level(data: Any, where: str, errors: list[str]) -> dict | None:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"config: {where} holds a {type(data).__name__}, not an object; write a JSON/YAML mapping")
        return None
    return data
