"""The seed's API read from its document, name by name, and checked against the package with `inspect`.

`parse(text)` reads ``../shared/seed/vsurge-api.txt`` (the seed's API reference as text): each
``class easydel.inference.vsurge.__init__.Name(params)`` line opens a class; within it, lines shaped like a
signature are its members (``name(params) → ret``, ``async name(...)``, ``classmethod name(...)``,
``property name[: type]``, and ``name: type [= default]`` for a record field that is also a constructor
argument); everything else is prose. The types the signatures and ``Bases:`` lines name (ResultTokens,
AbstractDriver ...) are names too, checked for import from `vsurge`.

`check(names)` gives each name a status: ``same`` (exists, with the seed's kind, positional order and
defaults; extra arguments with defaults, keyword-only ones and a default where the seed has none are
compatible), ``other signature`` or ``missing``. docs/seed.md's "Differences from the seed" table adds
``renamed`` and ``behaves differently``, which `inspect` cannot see; tests/service/test_seed_conformance.py
requires every name that is not ``same`` to be there.

    python tests/service/seed_conformance.py [seed document]   # prints the name-by-name table
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SEED_DOC = Path(os.environ.get("VSURGE_SEED_DOC", REPO.parent / "shared" / "seed" / "vsurge-api.txt"))
DIFF_DOC = REPO / "docs" / "seed.md"  # the "Differences from the seed" table

_CLASS = re.compile(r"^class easydel\.inference\.vsurge\.__init__\.(\w+)\((.*)\)$")
_METHOD = re.compile(r"^(async |classmethod |staticmethod )?([A-Za-z_]\w*)\((.*)\)(?: → (.+))?$")
_PROPERTY = re.compile(r"^property ([A-Za-z_]\w*)(?:: (.+))?$")
_FIELD = re.compile(r"^([a-z_]\w*): (.+?)(?: = (.+))?$")
_BASES = re.compile(r"^Bases: (.+)$")
# Types the seed's signatures name that belong to python, jax or flax, not to the seed's API.
_FOREIGN = {
    "Any",
    "Optional",
    "Union",
    "Dict",
    "List",
    "Sequence",
    "AsyncGenerator",
    "State",
    "Key",
    "VariableState",
    "PRNGKey",
    "Array",
    "Device",
    "object",
    "tp",
    "True",
    "False",
    "None",
}
NO_DEFAULT = object()


@dataclass
class Param:
    name: str
    default: Any = NO_DEFAULT  # the literal value, or its text when it is not a literal
    kind: str = "positional"  # positional | var_positional | var_keyword


@dataclass
class SeedName:
    """One name of the seed: ``key`` as docs/seed.md's table writes it (``vSurge``, ``vSurge(driver)``,
    ``vSurge.generate``)."""

    key: str
    owner: str | None  # the class, for a member or an argument
    name: str
    kind: str  # class | type | argument | method | property
    params: list[Param] = field(default_factory=list)
    default: Any = NO_DEFAULT  # an argument's
    position: int = -1  # an argument's
    is_async: bool = False
    is_classmethod: bool = False


def split_params(text: str) -> list[Param]:
    """``a: int, b='x', *args, **kw`` -> Params (top-level commas only)."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    parts.append(cur)
    out = []
    for p in (x.strip() for x in parts):
        if not p:
            continue
        if p.startswith("**"):
            out.append(Param(p[2:].split(":")[0].strip(), kind="var_keyword"))
            continue
        if p.startswith("*"):
            out.append(Param(p[1:].split(":")[0].strip(), kind="var_positional"))
            continue
        default = NO_DEFAULT
        if "=" in p:
            p, raw = p.rsplit("=", 1)
            default = _literal(raw.strip())
        out.append(Param(p.split(":")[0].strip(), default))
    return out


def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _type_names(text: str) -> set[str]:
    """CamelCase identifiers of an annotation, the seed's own (not python's, jax's or flax's)."""
    names = set()
    for ident in re.findall(r"[A-Za-z_][\w.]*", text):
        last = ident.split(".")[-1]
        ours = last[:1].isupper() or re.match(r"^[vo][A-Z]", last)
        if ours and last not in _FOREIGN and not last.isupper():
            names.add(last)
    return names


def parse(text: str) -> list[SeedName]:
    """Every name of the seed document, in document order (see the module docstring)."""
    names: list[SeedName] = []
    types: set[str] = set()
    cls: str | None = None
    ctor: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.strip()
        m = _CLASS.match(line)
        if m:
            cls, params = m.group(1), split_params(m.group(2))
            names.append(SeedName(cls, None, cls, "class"))
            ctor = {}
            for i, p in enumerate(params):
                ctor[p.name] = i
                names.append(
                    SeedName(f"{cls}({p.name})", cls, p.name, "argument", default=p.default, position=i)
                )
            types |= _type_names(m.group(2))
            continue
        if cls is None:
            continue
        if m := _BASES.match(line):
            types |= _type_names(m.group(1))
        elif m := _PROPERTY.match(line):
            names.append(SeedName(f"{cls}.{m.group(1)}", cls, m.group(1), "property"))
            types |= _type_names(m.group(2) or "")
        elif m := _METHOD.match(line):
            prefix, name, params, ret = m.groups()
            names.append(
                SeedName(
                    f"{cls}.{name}",
                    cls,
                    name,
                    "method",
                    params=split_params(params),
                    is_async=prefix == "async ",
                    is_classmethod=prefix == "classmethod ",
                )
            )
            types |= _type_names(params) | _type_names(ret or "")
        elif (m := _FIELD.match(line)) and m.group(1) in ctor:
            continue  # a record field that is a constructor argument: the argument is its name
    classes = {n.name for n in names if n.kind == "class"}
    for t in sorted(types - classes):
        names.append(SeedName(t, None, t, "type"))
    return names


# ------------------------------------------------------------------------------------------ checking


def _provides(cls: type, name: str) -> bool:
    from vsurge.seed_api.protocols import provides

    return provides(cls, name)


def _compatible(seed: list[Param], ours: inspect.Signature) -> str | None:
    """None if a call written for ``seed`` works on ``ours`` the same way, else what differs."""
    params = list(ours.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    i = 0
    for sp in seed:
        if sp.kind == "var_positional":
            if not var_pos:
                return f"no *{sp.name}"
            continue
        if sp.kind == "var_keyword":
            if not var_kw:
                return f"no **{sp.name}"
            continue
        if i >= len(positional):
            return f"no positional argument {sp.name!r} at position {i}"
        op = positional[i]
        if op.name != sp.name:
            return f"position {i} is {op.name!r}, the seed's is {sp.name!r}"
        if sp.default is not NO_DEFAULT:
            if op.default is op.empty:
                return f"{sp.name!r} has no default (the seed's: {sp.default!r})"
            if op.default != sp.default:
                return f"{sp.name!r} defaults to {op.default!r}, the seed's to {sp.default!r}"
        i += 1
    for op in positional[i:]:
        if op.default is op.empty:
            return f"an extra required argument {op.name!r}"
    return None


def _unbound_signature(cls: type, name: str) -> inspect.Signature:
    # follow_wrapped=False: a decorator's own signature is what a caller meets (a declared __signature__,
    # seed_forms', still counts)
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, (classmethod, staticmethod)):
        return inspect.signature(getattr(cls, name), follow_wrapped=False)
    sig = inspect.signature(raw, follow_wrapped=False)
    params = list(sig.parameters.values())[1:]  # self
    return sig.replace(parameters=params)


def check_one(n: SeedName, vsurge: Any) -> tuple[str, str]:
    """(status, detail) of one seed name against the package ``vsurge``."""
    if n.kind in ("class", "type"):
        obj = getattr(vsurge, n.name, None)
        return ("same", "") if obj is not None else ("missing", "not importable from vsurge")
    cls = getattr(vsurge, n.owner, None)
    if cls is None:
        return "missing", f"{n.owner} is not importable from vsurge"
    if n.kind == "argument":
        sig = inspect.signature(cls)
        params = [
            p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if n.position >= len(params):
            return ("missing" if n.name not in sig.parameters else "other signature"), "not positional here"
        p = params[n.position]
        if p.name != n.name:
            where = "missing" if n.name not in sig.parameters else "other signature"
            return where, f"position {n.position} is {p.name!r}"
        if n.default is not NO_DEFAULT and (p.default is p.empty or p.default != n.default):
            shown = "none" if p.default is p.empty else repr(p.default)
            return "other signature", f"default {shown}, the seed's {n.default!r}"
        return "same", ""
    if not _provides(cls, n.name):
        return "missing", ""
    raw = inspect.getattr_static(cls, n.name, None)
    if n.kind == "property":
        if raw is None or isinstance(raw, property):
            return "same", ""  # a property, or an attribute the class declares
        return "other signature", f"a {type(raw).__name__}, not a property"
    if raw is None or isinstance(raw, property) or not callable(getattr(cls, n.name)):
        return "other signature", "not a method"
    func = getattr(cls, n.name)
    is_async = inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)
    if is_async != n.is_async:
        return "other signature", "async" if n.is_async else "not async"
    if isinstance(raw, classmethod) != n.is_classmethod:
        return "other signature", "classmethod" if n.is_classmethod else "not a classmethod"
    why = _compatible(n.params, _unbound_signature(cls, n.name))
    return ("same", "") if why is None else ("other signature", why)


def check(names: list[SeedName]) -> list[tuple[SeedName, str, str]]:
    import vsurge

    return [(n, *check_one(n, vsurge)) for n in names]


# ------------------------------------------------------------------------------ the differences table


DIFF_HEADING = "## Differences from the seed"
STATUSES = ("same", "renamed", "other signature", "behaves differently", "missing")


def differences(readme: str) -> dict[str, tuple[str, str]]:
    """docs/seed.md's differences table: name -> (status, reason); a row may name several (`a`, `b`)."""
    start = readme.index(DIFF_HEADING)
    out = {}
    for line in readme[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if name in out:
                raise ValueError(f"the differences table lists {name} twice")
            out[name] = (cells[1], cells[2])
    return out


def table(results: list[tuple[SeedName, str, str]], diffs: dict[str, tuple[str, str]] | None = None) -> str:
    """The name-by-name table (docs/seed.md's status where it gives one) and the counts per status."""
    diffs = diffs or {}
    rows, counts = [], Counter()
    for n, status, detail in results:
        status = diffs.get(n.key, (status, ""))[0] if status == "same" or n.key in diffs else status
        counts[status] += 1
        rows.append(f"{n.key:60s} {status:20s} {detail}")
    summary = ", ".join(f"{s}: {counts.get(s, 0)}" for s in STATUSES)
    return "\n".join(rows) + f"\n\n{len(results)} names -- {summary}"


def main(argv: list[str]) -> int:
    doc = Path(argv[0]) if argv else SEED_DOC
    results = check(parse(doc.read_text(encoding="utf-8")))
    text = DIFF_DOC.read_text(encoding="utf-8")
    diffs = differences(text) if DIFF_HEADING in text else {}
    print(table(results, diffs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
