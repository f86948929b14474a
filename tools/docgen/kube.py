"""The InferenceModel CRD reference and the chart's values reference, read from the schemas that the API
server and Helm enforce (helm/vsurge/crds/inferencemodels.vsurge.io.yaml, helm/vsurge/values.schema.json),
so the page says what the cluster accepts and cannot say anything else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .blocks import cell, code

CHART = Path(__file__).resolve().parents[2] / "helm" / "vsurge"
CRD = CHART / "crds" / "inferencemodels.vsurge.io.yaml"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "")
    if kind == "array":
        item = node.get("items", {})
        return f"[]{item.get('type', 'object')}" if item else "array"
    if kind == "object" and "additionalProperties" in node and "properties" not in node:
        value = node["additionalProperties"]
        return f"map[string]{value.get('type', 'any')}" if isinstance(value, dict) else "object"
    return kind


def _constraints(node: dict[str, Any], required: bool) -> str:
    parts = []
    if required:
        parts.append("required")
    if "enum" in node:
        parts.append("one of " + ", ".join(code(v) for v in node["enum"]))
    for key, word in (
        ("minimum", ">="),
        ("maximum", "<="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
    ):
        if key in node:
            parts.append(f"{word} {node[key]}")
    if "maxLength" in node:
        parts.append(f"length <= {node['maxLength']}")
    if "pattern" in node:
        parts.append(f"pattern {code(node['pattern'])}")
    for rule in node.get("x-kubernetes-validations", []):
        parts.append(f"rule: {cell(rule.get('message') or rule['rule'])}")
    return "; ".join(parts)


def _default(value: Any) -> str:
    return "" if value is None else code(json.dumps(value) if not isinstance(value, str) else value)


def _crd_rows(node: dict[str, Any], path: str, required: bool, out: list[str]) -> None:
    out.append(
        f"| `{path}` | {cell(_type(node))} | {_default(node.get('default'))} | {_constraints(node, required)} "
        f"| {cell(node.get('description', ''))} |"
    )
    _crd_children(node, path, out)


def _crd_children(node: dict[str, Any], path: str, out: list[str]) -> None:
    target = node.get("items", node) if node.get("type") == "array" else node
    suffix = "[]" if target is not node else ""
    needed = set(target.get("required", []))
    for name, child in target.get("properties", {}).items():
        _crd_rows(child, f"{path}{suffix}.{name}", name in needed, out)


def crd_version() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version


def crd_table(part: str) -> str:
    """Every field under ``.spec`` or ``.status``, depth first, in the schema's order."""
    root = crd_version()["schema"]["openAPIV3Schema"]["properties"][part]
    lines = ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    _crd_children(root, part, lines)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- chart values


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = schema
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _value_type(schema: dict[str, Any], node: dict[str, Any]) -> str:
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        return f"[]{_value_type(schema, _resolve(schema, node['items']))}"
    if "oneOf" in node or "anyOf" in node:
        return " or ".join(sorted({_type(n) or "any" for n in node.get("oneOf", node.get("anyOf", []))}))
    kind = node.get("type", "")
    return " or ".join(kind) if isinstance(kind, list) else _type(node)


def _described(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    """Whether anything below ``node`` carries a description (then it is walked into)."""
    node = _resolve(schema, node)
    return any("description" in c or _described(schema, c) for c in node.get("properties", {}).values())


def _value_rows(schema: dict[str, Any], node: dict[str, Any], value: Any, path: str, out: list[str]) -> None:
    own = node.get("description")  # beside a $ref: this use's own words
    resolved = _resolve(schema, node)
    children = resolved.get("properties", {})
    walk = isinstance(value, dict) and value and children and _described(schema, node)
    if own or not walk:
        text = own or resolved.get("description")
        if not text:
            raise ValueError(
                f"values.schema.json: {path} has no description: add one (a row of docs/kubernetes.md's values "
                "table comes from it)"
            )
        default = "" if walk else code(json.dumps(value) if not isinstance(value, str) else json.dumps(value))
        constraints = _constraints(resolved, False)
        out.append(
            f"| `{path}` | {cell(_value_type(schema, resolved))} | {default} | {constraints} | {cell(text)} |"
        )
    if walk:
        for key, child_value in value.items():
            if key not in children:
                raise ValueError(f"values.yaml: {path}.{key} is not in values.schema.json")
            _value_rows(schema, children[key], child_value, f"{path}.{key}", out)


def values_table() -> str:
    """One row per key of values.yaml (an object whose keys the schema describes is walked into)."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    values = yaml.safe_load(VALUES.read_text(encoding="utf-8"))
    lines = ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for key, value in values.items():
        if key not in schema["properties"]:
            raise ValueError(f"values.yaml: {key} is not in values.schema.json")
        _value_rows(schema, schema["properties"][key], value, key, lines)
    return "\n".join(lines)
