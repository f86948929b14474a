"""The InferenceModel CRD's ``spec.engine`` and the operator's table of it, generated from EngineConfig.

Every ``vsurge serve`` knob is a field of EngineConfig (service/vsurge/contracts/engine_config.py). The operator must
not import vsurge (its image has no jax), so this runs at development time and writes two checked-in blocks:

    helm/vsurge/crds/inferencemodels.vsurge.io.yaml   the ``engine:`` node of spec: each option's type,
                                                      enum, range, description and driver rule (CEL)
    operator/vsurge_operator/engine_options.py         OPTIONS: key -> variable, kind, choices, range,
                                                      driver, which the operator parses, checks and renders

An option's key is its field name in camelCase; its variable is ``vsurge serve``'s (``VSURGE_`` + NAME).
What the schema says comes from the field: ``choices`` (or a choice knob's), the check's bounds narrowed by
``limits``, ``only`` (a DriverOnly) and the help text. The few things that are Kubernetes' own (the mesh's
pattern, the prefill buckets' order, their CEL cost bounds) come from the operator's validation module,
which checks them in code too. ``python tools/gen_docs.py`` writes both blocks; ``--check`` (and
tests/service/test_engine_config.py) fails when either differs from what EngineConfig gives.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

# Serve knobs that spec.engine does not offer, with the reason: none so far. A knob left out of the CRD
# must be named here (a test checks that every other serve knob is there).
NOT_IN_CRD: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Option:
    """One key of spec.engine, as the CRD shows it and the operator handles it."""

    key: str
    field: str  # the operator's EngineSpec attribute (EngineConfig's field name)
    env: str | None  # the pods' variable; None: the operator passes it as a flag (the LoRA bank's)
    kind: str  # string, integer, number, or integers (a list)
    description: str
    choices: tuple[Any, ...] = ()
    minimum: int | None = None  # of each item, for integers
    maximum: int | None = None
    exclusive_minimum: bool = False
    only: str | None = None  # the driver it needs, unless its value is one of idle
    idle: tuple[Any, ...] = ()
    what: str | None = None  # what it changes on that driver, for the rule's message


def camel(name: str) -> str:
    """``max_concurrent_decodes`` -> ``maxConcurrentDecodes``."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _kind(f: dataclasses.Field) -> str:
    from vsurge.contracts.env_options import parse_float, parse_int, parse_int_list

    text = f.metadata["text"]
    if f.metadata.get("choices") and all(isinstance(c, str) for c in f.metadata["choices"]):
        return "string"
    kinds = {parse_int: "integer", parse_float: "number", parse_int_list: "integers", str: "string"}
    if text not in kinds:
        raise ValueError(
            f"EngineConfig.{f.name}: its text parser {text!r} has no CRD type; teach tools/docgen/engine_crd.py"
        )
    return kinds[text]


def _default_words(f: dataclasses.Field) -> str:
    shown = f.metadata.get("shown")
    if shown is not None:
        return shown
    value = f.default
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def option(f: dataclasses.Field) -> Option:
    """The spec.engine option of an EngineConfig serve field."""
    from vsurge.contracts.engine_config import env_name, flag_name

    meta = f.metadata
    check, limits, only = meta["check"], meta.get("limits"), meta.get("only")
    choices = tuple(meta.get("choices") or ())
    lo, hi = limits if limits else (getattr(check, "minimum", None), getattr(check, "maximum", None))
    if choices:  # a list of values says it all
        lo = hi = None
    return Option(
        key=camel(f.name),
        field=f.name,
        env=env_name(f),
        kind=_kind(f),
        description=f"{meta['help']} (`vsurge serve {flag_name(f)}`, {env_name(f)}; unset: {_default_words(f)}).",
        choices=choices,
        minimum=lo,
        maximum=hi,
        exclusive_minimum=bool(getattr(check, "exclusive_minimum", False)) and not choices,
        only=only.driver if only else None,
        idle=tuple(only.idle) if only else (),
        what=only.what if only else None,
    )


def _server_options() -> list[Option]:
    """spec.engine keys that are not EngineConfig knobs: the server's parameter dtype. (The LoRA bank's
    size, maxLoras and maxLoraRank, are EngineConfig knobs; the operator also passes them as flags beside
    ``--lora``, operator/vsurge_operator/adapters.py.)"""
    from vsurge.cli.serve_options import DTYPES, SERVE_OPTIONS

    dtype = next(o for o in SERVE_OPTIONS if o.flag == "--dtype")
    return [
        Option(
            "dtype",
            "dtype",
            dtype.env,
            "string",
            f"{dtype.help} (`vsurge serve --dtype`, {dtype.env}).",
            DTYPES,
        ),
    ]


def options(fields: Iterable[dataclasses.Field] | None = None) -> list[Option]:
    """Every spec.engine option: EngineConfig's serve fields (``fields``, for a test), then the server's."""
    from vsurge.contracts.engine_config import serve_fields

    chosen = serve_fields() if fields is None else tuple(fields)
    return [option(f) for f in chosen if f.name not in NOT_IN_CRD] + _server_options()


# ------------------------------------------------------------------------------------------ the CRD


def _literal(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)


def driver_rule(o: Option, default_driver: str) -> dict[str, str]:
    """The CEL rule that keeps ``o`` to its driver (an unset driver is the server's default)."""
    idle = (
        f"self.{o.key} == {_literal(o.idle[0])}"
        if len(o.idle) == 1
        else f"self.{o.key} in [{', '.join(map(_literal, o.idle))}]"
    )
    driver = f"self.driver == '{o.only}'"
    if o.only == default_driver:
        driver = f"!has(self.driver) || {driver}"
    else:
        driver = f"has(self.driver) && {driver}"
    return {
        "rule": f"!has(self.{o.key}) || {idle} || {driver}",
        "message": f"{o.key} applies to driver {o.only}'s {o.what}",
        "fieldPath": f".{o.key}",
    }


def _property(o: Option) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "array" if o.kind == "integers" else o.kind, "description": o.description}
    bounds = node
    if o.kind == "integers":
        node["items"] = bounds = {"type": "integer"}
    if o.choices:
        node["enum"] = list(o.choices)
    if o.minimum is not None:
        bounds["minimum"] = o.minimum
        if o.exclusive_minimum:
            bounds["exclusiveMinimum"] = True
    if o.maximum is not None:
        bounds["maximum"] = o.maximum
    return node


def _kubernetes_rules(props: dict[str, Any]) -> list[dict[str, str]]:
    """What the operator adds for Kubernetes (validation.py checks the same in code): the mesh must name
    known axes once each, the prefill buckets must increase; lengths bound the CEL rules' cost."""
    from vsurge_operator import validation

    mesh = props["mesh"]
    mesh["description"] += (
        " On Kubernetes it must span every chip of the slice; the operator sets one when it is unset: tensor "
        "parallel over up to 8 chips, data parallel beyond."
    )
    axes = ", ".join(f"'{a}'" for a in validation.MESH_AXES)
    mesh.update(
        pattern=validation.MESH_PATTERN,
        maxLength=validation.MESH_MAX_LENGTH,
    )
    mesh["x-kubernetes-validations"] = [
        {
            "rule": f"[{axes}].all(a, !self.matches('(^|,)' + a + '=.*,' + a + '='))",
            "message": "the mesh repeats an axis",
        }
    ]
    lengths = props["prefillLengths"]
    lengths["description"] += " Strictly increasing, none above maxLength."
    lengths.update(minItems=1, maxItems=validation.PREFILL_LENGTHS_MAX_ITEMS)
    lengths["x-kubernetes-validations"] = [
        {
            "rule": "self.isSorted() && self.all(n, self.exists_one(m, m == n))",
            "message": "prefill buckets must be strictly increasing",
        }
    ]
    return [
        {
            "rule": "!has(self.maxLength) || !has(self.prefillLengths) || "
            "self.prefillLengths.all(n, n <= self.maxLength)",
            "message": "the longest prefill bucket exceeds maxLength",
            "fieldPath": ".prefillLengths",
        }
    ]


def engine_schema(opts: Sequence[Option], default_driver: str) -> dict[str, Any]:
    """The ``engine`` node of the CRD's spec."""
    props = {o.key: _property(o) for o in opts}
    rules = _kubernetes_rules(props) + [driver_rule(o, default_driver) for o in opts if o.only]
    return {
        "type": "object",
        "description": "vSurge engine settings: the serve options of EngineConfig (generated by "
        "tools/docgen/engine_crd.py); unset fields keep the server's defaults.",
        "x-kubernetes-validations": rules,
        "properties": props,
    }


class _Folded(str):
    """A description: written folded (``>-``), as the hand-written parts of the CRD are."""


class _Dumper(yaml.SafeDumper):
    """Block mappings, lists of scalars on one line (``enum: [a, b]``), folded descriptions."""


def _list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.Node:
    flow = all(not isinstance(v, (dict, list)) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(list, _list)
_Dumper.add_representer(_Folded, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style=">"))


def _fold(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _Folded(v) if k == "description" and len(v) > 60 else _fold(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fold(v) for v in node]
    return node


def crd_block(fields: Iterable[dataclasses.Field] | None = None) -> str:
    """The CRD's ``engine:`` node as YAML, for the generated block of the CRD file."""
    from vsurge.contracts.engine_config import EngineConfig

    node = _fold(engine_schema(options(fields), EngineConfig().driver))
    return yaml.dump({"engine": node}, Dumper=_Dumper, sort_keys=False, width=100, indent=2)


# ------------------------------------------------------------------------------------------ the operator


def _py(value: Any) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def operator_block(fields: Iterable[dataclasses.Field] | None = None) -> str:
    """``OPTIONS`` of the operator's engine_options.py: one EngineOption per spec.engine key."""
    from vsurge.contracts.engine_config import EngineConfig

    lines = [f"DEFAULT_DRIVER = {_py(EngineConfig().driver)}", "OPTIONS: tuple[EngineOption, ...] = ("]
    names = ("key", "field", "env", "kind", "choices", "minimum", "maximum", "exclusive_minimum")
    names += ("only", "idle", "what")
    defaults = {f.name: f.default for f in dataclasses.fields(Option)}
    for o in options(fields):
        lines.append("    EngineOption(")
        for name in names:
            value = getattr(o, name)
            if name in ("key", "field", "env", "kind") or value != defaults[name]:
                lines.append(f"        {name}={_py(value)},")
        lines.append("    ),")
    lines.append(")")
    return "\n".join(lines)
