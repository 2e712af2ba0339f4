"""Size limits on user documents, enforced before any object is built from them.

Called by `controller.spec.parse_job_yaml` (on the composed YAML node graph, so a 500-byte alias bomb
is refused after composing a handful of nodes, never expanded) and by the submit endpoint on JSON
bodies (`check_document`). Hand-written: PyYAML has no alias or depth budget, and pydantic checks
types, not the size of a free-form mapping such as an engine config.

A real job spec with a full DeepSpeed config has a few hundred nodes and a depth under ten; the
limits leave a wide margin and still keep every submit to a few milliseconds of validation.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 5_000  # scalars + mappings + sequences, aliases counted as the size they expand to
MAX_DEPTH = 32
MAX_ALIASES = 64
MAX_STRING = 65_536  # characters in one scalar
MAX_ERRORS = 20  # error lines in one answer
MAX_LINE = 300  # characters in one error line


class DocumentTooLarge(ValueError):
    """A document past one of the limits (or holding a NUL character, which PostgreSQL cannot store); the
    message is one line "(document): <problem>; <fix>"."""


def _too(what: str, limit: int) -> DocumentTooLarge:
    return DocumentTooLarge(f"(document): more than {limit} {what}; a job spec is far smaller, shorten it")


def _check_string(value: str) -> None:
    if len(value) > MAX_STRING:
        raise _too("characters in one value", MAX_STRING)
    if "\x00" in value:
        raise DocumentTooLarge("(document): a value contains a NUL character; remove it")


def check_yaml_node(root: yaml.Node) -> None:
    """Walk the composed graph as the expanded document would be, stopping at the first limit."""
    seen: set[int] = set()
    aliases = 0
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise _too("values (aliases count as what they expand to)", MAX_NODES)
        if depth > MAX_DEPTH:
            raise _too("levels of nesting", MAX_DEPTH)
        if isinstance(node, yaml.ScalarNode):
            _check_string(node.value)
            continue
        if id(node) in seen:
            aliases += 1
            if aliases > MAX_ALIASES:
                raise _too("aliases", MAX_ALIASES)
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in node.value)


def check_document(document: Any) -> None:
    """The same limits on an already parsed (JSON) document."""
    count = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise _too("values", MAX_NODES)
        if depth > MAX_DEPTH:
            raise _too("levels of nesting", MAX_DEPTH)
        if isinstance(value, str):
            _check_string(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, depth + 1))
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def short_errors(errors: list[str]) -> list[str]:
    """At most MAX_ERRORS lines of at most MAX_LINE characters (never the input back at size)."""
    lines = [e if len(e) <= MAX_LINE else e[: MAX_LINE - 1] + "…" for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        lines.append(f"(document): {len(errors) - MAX_ERRORS} more problems not shown; fix the ones above first")
    return lines
