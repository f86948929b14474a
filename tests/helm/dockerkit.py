"""A small Dockerfile reader for the image tests (no Docker engine runs here).

It follows the Dockerfile reference closely enough for docker/: parser directives and comments, line
continuations, exec (JSON) and shell forms, instruction flags (``COPY --from=...``), build stages, and
``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` substitution from ARG and ENV. Heredocs are refused rather than
misread. ``.dockerignore`` files are matched with Docker's rules: the last matching pattern wins, ``!``
re-includes, ``**`` spans directories, and a pattern that matches a directory matches everything below it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "service": REPO / "docker" / "service.Dockerfile",
    "operator": REPO / "docker" / "operator.Dockerfile",
    "router": REPO / "docker" / "router.Dockerfile",
}

_VAR = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def substitute(text: str, env: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        if name in env and env[name] != "":
            return env[name]
        return m.group("default") or ""

    return _VAR.sub(repl, text)


@dataclass
class Instruction:
    cmd: str
    rest: str
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    exec_form: list[str] | None = None

    @property
    def args(self) -> list[str]:
        """Exec form as written, or the shell form split like a shell would (for COPY, ENV, USER ...)."""
        return self.exec_form if self.exec_form is not None else shlex.split(self.rest)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    in_directives = True
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if in_directives:
            if re.match(r"^#\s*escape\s*=", stripped):
                raise ValueError(f"line {number}: only the default escape character is supported")
            in_directives = bool(re.match(r"^#\s*[a-z]+\s*=", stripped))
        if not stripped or stripped.startswith("#"):
            continue  # blank lines and comments are dropped, even inside a continued instruction
        if not buf:
            start = number
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, " ".join(part.strip() for part in buf)))
        buf = []
    if buf:
        raise ValueError(f"line {start}: the file ends inside a continued instruction")
    return out


def parse(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, logical in _logical_lines(path.read_text()):
        cmd, _, rest = logical.strip().partition(" ")
        cmd = cmd.upper()
        rest = rest.strip()
        if "<<" in rest and cmd in {"RUN", "COPY", "ADD"}:
            raise ValueError(f"{path.name}:{line}: heredocs are not supported by this reader")
        ins = Instruction(cmd, rest, line)
        while ins.rest.startswith("--"):
            flag, _, ins.rest = ins.rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            ins.flags[key] = value
            ins.rest = ins.rest.strip()
        if ins.rest.startswith("["):
            try:
                parsed = json.loads(ins.rest)
            except json.JSONDecodeError:
                parsed = None  # Docker treats an invalid JSON array as the shell form
            if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed):
                ins.exec_form = parsed
        if cmd == "FROM":
            words = ins.rest.split()
            base = substitute(words[0], global_args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            if len(words) not in (1, 3):
                raise ValueError(f"{path.name}:{line}: cannot read FROM {ins.rest!r}")
            stages.append(Stage(base, name, env=dict(global_args)))
            continue
        if not stages:
            if cmd != "ARG":
                raise ValueError(f"{path.name}:{line}: only ARG may come before the first FROM, not {cmd}")
            key, _, default = ins.rest.partition("=")
            global_args[key] = default
            continue
        stage = stages[-1]
        if cmd == "ARG":
            key, _, default = ins.rest.partition("=")
            stage.env[key] = default or global_args.get(key, "")
        elif cmd == "ENV":
            words = ins.args
            if len(words) >= 2 and "=" not in words[0]:
                stage.env[words[0]] = substitute(" ".join(words[1:]), stage.env)
            else:
                for word in words:
                    key, eq, value = word.partition("=")
                    if not eq:
                        raise ValueError(f"{path.name}:{line}: cannot read ENV {ins.rest!r}")
                    stage.env[key] = substitute(value, stage.env)
        stage.instructions.append(ins)
    if not stages:
        raise ValueError(f"{path}: no FROM")
    return Dockerfile(path, global_args, stages)


def final_user(path: Path) -> tuple[str, str | None]:
    """The ``USER`` the final stage runs as: (user, group or None)."""
    dockerfile = parse(path)
    users = dockerfile.final.all("USER")
    if not users:
        return ("root", None)  # the default user of an image
    spec = substitute(users[-1].rest, dockerfile.final.env)
    user, _, group = spec.partition(":")
    return (user, group or None)


def copy_sources(dockerfile: Dockerfile) -> list[tuple[Instruction, str]]:
    """Every COPY/ADD source taken from the build context (not from another stage or a URL)."""
    out = []
    for stage in dockerfile.stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            if "from" in ins.flags:
                continue
            args = [substitute(a, stage.env) for a in ins.args]
            if len(args) < 2:
                raise ValueError(
                    f"{dockerfile.path.name}:{ins.line}: {ins.cmd} needs a source and a destination"
                )
            for source in args[:-1]:
                if ins.cmd == "ADD" and re.match(r"^(https?|git)://|^git@", source):
                    continue
                out.append((ins, source))
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "$")


def dockerignore_for(dockerfile: Path) -> Path:
    """BuildKit reads ``<Dockerfile>.dockerignore`` beside the Dockerfile first, then the context's."""
    specific = dockerfile.with_name(dockerfile.name + ".dockerignore")
    return specific if specific.exists() else REPO / ".dockerignore"


def is_ignored(relpath: str, ignore_file: Path) -> bool:
    if not ignore_file.exists():
        return False
    patterns = []
    for raw in ignore_file.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line[1:].strip() if negated else line
        line = line.strip("/")
        patterns.append((negated, _pattern_regex(line)))
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negated, regex in patterns:
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored
