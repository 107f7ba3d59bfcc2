"""OpenAI's strict mode for JSON schemas (``"strict": true`` in a ``json_schema``
response format or a tool's function): the schema must be one that a reply can match
exactly, or the request is refused with a 400 naming the rule and where it is broken.

The rules, as OpenAI documents them for Structured Outputs: the root is an object
(not an ``anyOf``); every object is closed (``additionalProperties: false``) and
requires every key it lists (an optional field is written as a union with ``null``);
the composition keywords ``allOf``, ``not``, ``if``/``then``/``else``,
``dependentRequired`` and ``dependentSchemas`` are not supported. ``$defs`` and refs
into them, recursion included, are allowed: each definition is held to the same rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

UNSUPPORTED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas")
# Keywords whose value is one subschema, or a map or list of subschemas, to check too.
ONE_SCHEMA = ("items", "additionalItems", "contains", "propertyNames")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def strict_schema_error(schema: object) -> str | None:
    """Which strict-mode rule ``schema`` breaks first and where (a JSON pointer), or
    None when it keeps them all."""
    if not isinstance(schema, dict):
        return "strict mode: the schema must be a JSON object"
    if "anyOf" in schema and not _is_object(schema):
        return "strict mode: the root must be an object, not an anyOf"
    root = _resolved(schema, schema)
    if not _is_object(root):
        return "strict mode: the root must be an object (type: object)"
    for pointer, node in _subschemas(schema):
        problem = _broken_rule(node)
        if problem is not None:
            return f"strict mode: {problem} (at {pointer or '/'})"
    return None


def _broken_rule(node: dict[str, Any]) -> str | None:
    for keyword in UNSUPPORTED:
        if keyword in node:
            return f"{keyword} is not supported"
    if not _is_object(node):
        return None
    if node.get("additionalProperties") is not False:
        return "every object must set additionalProperties to false"
    listed = node.get("properties") or {}
    required = node.get("required") or []
    missing = [key for key in listed if key not in required] if isinstance(listed, dict) else []
    if missing:
        return (
            f"every property must be required, but {missing[0]!r} is not (write an optional "
            "field as a union with null)"
        )
    return None


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _resolved(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or what its local ref points at (one step: enough to see the root's type)."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return node
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node  # a ref that does not resolve: the grammar compiler names it
        target = target[part]
    return target if isinstance(target, dict) else node


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, subschema) for the schema and every schema inside it, parents
    first. Iterative: a deep schema cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield pointer, node
        children: list[tuple[str, Any]] = []
        for keyword in ONE_SCHEMA:
            if isinstance(node.get(keyword), dict):
                children.append((f"{pointer}/{keyword}", node[keyword]))
        if isinstance(node.get("additionalProperties"), dict):
            children.append((f"{pointer}/additionalProperties", node["additionalProperties"]))
        for keyword in SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                children += [
                    (f"{pointer}/{keyword}/{_escape(key)}", child)
                    for key, child in node[keyword].items()
                ]
        for keyword in (*SCHEMA_LISTS, "items"):
            if isinstance(node.get(keyword), list):
                children += [
                    (f"{pointer}/{keyword}/{i}", child) for i, child in enumerate(node[keyword])
                ]
        stack.extend(reversed(children))


def _escape(key: object) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
