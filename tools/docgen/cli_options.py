"""The option tables of `vsurge serve` and `vsurge route`, read from the real argparse parsers.

The parser is the contract: a flag that exists is in the table, with the variable and the default its own
help prints (``env_options.add_env_arguments`` writes ``(default: X) [env NAME]`` into every help), so a
flag added anywhere (EngineConfig, cli.py, the router's config) appears here without anyone writing it.
Choice lists are asked of the option's own parser: it is given a value no option takes, and its refusal
("must be one of a, b, got ...") names the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from .blocks import cell, code

_HELP = re.compile(
    r"^(?P<text>.*?)(?: \(default: (?P<default>.*)\))?(?: \[env (?P<env>[A-Z0-9_]+)\])?$", re.S
)
_CHOICES = re.compile(r"must be one of (?P<choices>.+?), got ")
_PROBE = "\x00not-a-value"


@dataclasses.dataclass(frozen=True)
class Row:
    flags: str
    env: str
    default: str
    meaning: str
    dest: str


def subparser(name: str) -> argparse.ArgumentParser:
    """The parser of `vsurge NAME`, built the way `vsurge` builds it."""
    from vsurge.cli.main import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(f"vsurge has no subcommand {name!r}")


def _choices(action: argparse.Action) -> list[str] | None:
    if action.choices:
        return [str(c) for c in action.choices]
    if not callable(action.type):
        return None
    try:
        action.type(_PROBE)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        match = _CHOICES.search(str(e))
        return match.group("choices").split(", ") if match else None
    except Exception:  # a parser that needs more than text (e.g. imports): no choice list to show
        return None
    return None


def rows(name: str) -> list[Row]:
    """One row per option of `vsurge NAME`, in the parser's order (help and positional arguments left out)."""
    out = []
    for action in subparser(name)._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        match = _HELP.match(" ".join((action.help or "").split()))
        text, default, env = match.group("text"), match.group("default"), match.group("env")
        choices = _choices(action)
        flags = ", ".join(action.option_strings)
        if choices:
            flags += " " + "|".join(choices)
        elif action.metavar:
            flags += f" {action.metavar}"
        elif action.nargs != 0 and not isinstance(action, argparse._StoreConstAction):
            flags += f" {action.dest.upper()}"
        out.append(Row(flags, env or "", default or "", text, action.dest))
    return out


def table(name: str) -> str:
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for r in rows(name):
        lines.append(
            f"| {code(r.flags)} | {code(r.env) if r.env else ''} | {cell(r.default)} | {cell(r.meaning)} |"
        )
    return "\n".join(lines)


def engine_only_table() -> str:
    """EngineConfig's fields that are not serve options: settable from Python (`EngineConfig(...)`)."""
    from vsurge.contracts.engine_config import EngineConfig

    lines = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("serve"):
            continue
        default: Any = f.default
        lines.append(f"| `{f.name}` | {code(repr(default))} | {cell(f.metadata.get('help', ''))} |")
    return "\n".join(lines)
