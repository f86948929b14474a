"""Options read from a flag or a `VSURGE_*` environment variable, shared by `vsurge serve` and `vsurge route`.

The rule both commands promise: a flag wins over its variable, the variable over the default, and a bad
value stops the command with a message naming the flag (argparse) or the variable (`error`). Parsing
functions raise ValueError with the reason; this module adds the name. It imports only argparse, so
`vsurge --help` stays instant.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar


class EnvOption(Protocol):
    """What both commands' option records provide (read-only, so dataclass fields and properties fit)."""

    @property
    def flag(self) -> str: ...
    @property
    def env(self) -> str: ...
    @property
    def parse(self) -> Callable[[str], Any]: ...
    @property
    def help(self) -> str: ...
    @property
    def metavar(self) -> str | None: ...
    @property
    def dest(self) -> str: ...


Opt = TypeVar("Opt", bound=EnvOption)


# ---------------------------------------------------------------------------------------- text parsers
# Text -> value; ValueError with the reason (range checks live with the option: EngineConfig's fields).


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def parse_int_list(text: str) -> list[int]:
    """``"512, 128,256"`` -> ``[512, 128, 256]``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("expected comma-separated integers, e.g. 128,256,512")
    return [parse_int(p) for p in parts]


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    parse.__name__ = "choice"
    return parse


def _cli_type(opt: EnvOption) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return opt.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    # argparse names the type in "invalid <name> value" messages.
    parse.__name__ = opt.dest
    return parse


def add_env_arguments(
    parser: argparse.ArgumentParser,
    options: Iterable[Opt],
    default_of: Callable[[Opt], Any],
) -> None:
    """Add one flag per option; its help shows `default_of(opt)` (unless None) and the variable."""
    for opt in options:
        default = default_of(opt)
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            opt.flag,
            dest=opt.dest,
            type=_cli_type(opt),
            default=None,  # None means "not given": the variable, then the default, fill it in
            metavar=opt.metavar,
            help=f"{opt.help}{shown} [env {opt.env}]",
        )


def parse_env(name: str, env: Mapping[str, str], parse: Callable[[str], Any], error: type[Exception]) -> Any:
    """`parse(env[name])`; a ValueError becomes `error` with a message naming the variable and its value."""
    try:
        return parse(env[name])
    except ValueError as e:
        raise error(f"{name}={env[name]!r}: {e}") from None


def flag_or_env_values(
    ns: argparse.Namespace,
    env: Mapping[str, str],
    options: Iterable[Opt],
    default_of: Callable[[Opt], Any],
    error: type[Exception],
) -> dict[str, Any]:
    """{dest: the flag's value, else the parsed variable, else `default_of(opt)`}.

    An empty variable counts as unset, so `VSURGE_X=` does not override the default. A bad variable raises
    `error`.
    """
    values: dict[str, Any] = {}
    for opt in options:
        value = getattr(ns, opt.dest, None)
        if value is None and env.get(opt.env, "") != "":
            value = parse_env(opt.env, env, opt.parse, error)
        values[opt.dest] = default_of(opt) if value is None else value
    return values
