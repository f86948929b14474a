"""The images' Python lock files (docker/locks/*.txt): made from pyproject.toml, checked against it.

    python docker/locks.py lock     # re-resolve every lock (needs `uv` and the package index)
    python docker/locks.py check    # offline: each lock matches pyproject.toml, each Dockerfile uses it

`docker/build-images.sh --lock` / `--check` run these. An image installs its lock with
``pip install --require-hashes -r docker/locks/<image>.txt`` (every distribution pinned to one version and
its files' sha256: what was resolved is what installs, and a file changed on the index fails the build),
then vsurge itself with ``pip install --no-deps .``. The locks are universal (``uv pip compile
--universal``: markers kept, valid on every Python the project supports), so the same lock installs in the
image (Python 3.12) and in the lean-install test here.

`check` fails, naming each problem, when a dependency of the image's part of pyproject.toml (the core,
the extras it installs, ``vsurge[...]`` self-references followed) is missing from its lock or pinned at a
version its specifier refuses (a dependency added or tightened without a relock), when a pin has no hash,
when the lock pins vsurge itself, and when a Dockerfile's base image is not pinned by digest or it does not
install its lock with --require-hashes and the project with --no-deps.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "docker" / "locks"
PROJECT = "vsurge"
# The environment of every image (the Dockerfiles' base: CPython 3.12 on Debian, x86_64): the markers of
# pyproject's dependencies and of the lock's pins are evaluated for it. 3.11: the Python the test suite
# runs on, so an image holds the library versions it tested (on 3.12 the resolver picks a newer JAX).
IMAGE_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.10",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
LOWEST_PYTHON = "3.11"  # pyproject's requires-python: a universal lock covers it and up
REFRESH = "docker/build-images.sh --lock"


@dataclass(frozen=True)
class Lock:
    """One image's lock: which part of pyproject it holds and which Dockerfile installs it."""

    name: str
    core: bool  # the project's own dependencies
    extras: tuple[str, ...]
    dockerfile: str | None  # None: the build lock, which every Dockerfile installs
    build_args: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> Path:
        return LOCKS / f"{self.name}.txt"


# What builds vsurge's own wheel ([build-system].requires): installed from its lock, then
# `pip install --no-build-isolation`, so the build does not fetch unpinned setuptools either.
BUILD = Lock("build", False, (), None)
IMAGES: tuple[Lock, ...] = (
    BUILD,
    Lock("operator", True, (), "operator.Dockerfile"),
    # the router needs only what `vsurge route` imports (pyproject's router extra), not the core's kopf
    Lock("router", False, ("router",), "router.Dockerfile"),
    *(
        Lock(f"service-{acc}", True, ("serve", acc), "service.Dockerfile", (("ACCELERATOR", acc),))
        for acc in ("tpu", "cuda", "cpu")
    ),
)


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements(lock: Lock, project: dict | None = None) -> list[Requirement]:
    """What ``lock`` must satisfy: its part of pyproject, self-references (``vsurge[serve]``) expanded."""
    project = project or _pyproject()
    if lock is BUILD:
        return [Requirement(r) for r in project["build-system"]["requires"]]
    meta = project["project"]
    extras = meta.get("optional-dependencies", {})
    out: list[Requirement] = []
    seen: set[str] = set()

    def add(texts: list[str]) -> None:
        for text in texts:
            req = Requirement(text)
            if canonicalize_name(req.name) == PROJECT:
                for extra in sorted(req.extras):
                    if extra not in seen:
                        seen.add(extra)
                        add(extras[extra])
                continue
            if req.marker is None or req.marker.evaluate(IMAGE_ENV):
                out.append(req)

    if lock.core:
        add(meta.get("dependencies", []))
    for extra in lock.extras:
        if extra not in extras:
            raise KeyError(f"pyproject.toml has no extra {extra!r} (the {lock.name} image installs it)")
        seen.add(extra)
        add(extras[extra])
    return out


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    marker: Marker | None
    hashes: int
    line: int


def read_lock(path: Path) -> tuple[list[Pin], list[str]]:
    """The pins of a ``--generate-hashes`` lock file, and what in it is not a hashed ``name==version``."""
    pins: list[Pin] = []
    problems: list[str] = []
    current: list | None = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash=sha256:"):
            if current is None or not re.fullmatch(r"--hash=sha256:[0-9a-f]{64}\s*\\?", line):
                problems.append(f"{path.name}:{number}: a hash outside a pin, or not sha256: {line}")
            else:
                current[3] += 1
            continue
        if current is not None:
            pins.append(Pin(*current))
            current = None
        m = _PIN.match(line)
        if m is None:
            problems.append(f"{path.name}:{number}: not a pinned requirement: {line}")
            continue
        marker = Marker(m.group(4)) if m.group(4) else None
        current = [canonicalize_name(m.group(1)), Version(m.group(3)), marker, 0, number]
    if current is not None:
        pins.append(Pin(*current))
    problems += [f"{path.name}:{p.line}: {p.name}=={p.version} has no hash" for p in pins if not p.hashes]
    return pins, problems


def check_lock(lock: Lock, project: dict | None = None) -> tuple[list[str], str]:
    """(problems, a one-line summary) of ``lock`` against pyproject."""
    if not lock.path.exists():
        return [f"{lock.path.relative_to(REPO)}: missing (run `{REFRESH}`)"], ""
    pins, problems = read_lock(lock.path)
    applying = [p for p in pins if p.marker is None or p.marker.evaluate(IMAGE_ENV)]
    by_name: dict[str, list[Pin]] = {}
    for pin in applying:
        by_name.setdefault(pin.name, []).append(pin)
    if PROJECT in by_name:
        problems.append(f"{lock.path.name}: pins {PROJECT} itself (the image installs it with --no-deps)")
    reqs = requirements(lock, project)
    for req in reqs:
        name = canonicalize_name(req.name)
        found = by_name.get(name)
        if not found:
            problems.append(f"{lock.path.name}: {req} is not in the lock (run `{REFRESH}`)")
        elif not any(req.specifier.contains(p.version, prereleases=True) for p in found):
            versions = ", ".join(str(p.version) for p in found)
            problems.append(f"{lock.path.name}: {req} but the lock pins {name}=={versions} (run `{REFRESH}`)")
    part = " + ".join((["core"] if lock.core else []) + [f"[{e}]" for e in lock.extras]) or "build-system"
    summary = (
        f"{lock.path.relative_to(REPO)}: {len(reqs)} requirements of {part} satisfied by "
        f"{len(applying)} pins, {sum(p.hashes for p in pins)} hashes"
    )
    return problems, summary


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _dockerfile_text(path: Path) -> str:
    """The Dockerfile with its line continuations joined (one instruction a line)."""
    return re.sub(r"\\\n", " ", path.read_text())


def check_dockerfile(lock: Lock, path: Path | None = None) -> list[str]:
    """The base images are pinned by digest; the lock is installed with --require-hashes; vsurge with
    --no-deps (``path``: another Dockerfile than the lock's own, for the tests)."""
    assert lock.dockerfile is not None
    path = path or REPO / "docker" / lock.dockerfile
    if not path.exists():
        return [f"docker/{lock.dockerfile}: missing"]
    text = _dockerfile_text(path)
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    args.update(lock.build_args)

    def substitute(value: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)

    problems = []
    for base in re.findall(r"^FROM\s+(\S+)", text, re.M):
        image = substitute(base)
        if not _DIGEST.search(image):
            problems.append(
                f"docker/{lock.dockerfile}: FROM {base} = {image} is not pinned by @sha256 digest"
            )
    runs = substitute(" ".join(re.findall(r"^RUN\s+(.*)$", text, re.M)))
    wanted = f"docker/locks/{lock.name}.txt"
    if not re.search(rf"pip install [^&;]*--require-hashes [^&;]*-r {re.escape(wanted)}", runs):
        problems.append(f"docker/{lock.dockerfile}: no `pip install --require-hashes -r {wanted}`")
    if not re.search(r"pip install --require-hashes -r docker/locks/build\.txt", runs):
        problems.append(
            f"docker/{lock.dockerfile}: no `pip install --require-hashes -r docker/locks/build.txt`"
        )
    if not re.search(r"pip install --no-deps --no-build-isolation \.(\s|$)", runs):
        problems.append(
            f"docker/{lock.dockerfile}: vsurge is not installed with `pip install --no-deps --no-build-isolation .`"
        )
    return problems


def check(out=sys.stdout) -> int:
    """Every lock and Dockerfile; 0 when all hold."""
    project = _pyproject()
    failed = 0
    for lock in IMAGES:
        problems, summary = check_lock(lock, project)
        if lock.dockerfile is not None:
            problems += check_dockerfile(lock)
            summary += f"; docker/{lock.dockerfile}: FROM pinned by digest, installs it with --require-hashes"
        for problem in problems:
            print(f"FAIL {problem}", file=out)
        if not problems:
            print(f"ok   {summary}", file=out)
        failed += bool(problems)
    return 1 if failed else 0


def lock(names: list[str] | None = None) -> int:
    """Resolve each image's requirements into its lock with `uv pip compile --universal --generate-hashes`."""
    uv = shutil.which("uv")
    if uv is None:
        print("uv not found: pip install uv", file=sys.stderr)
        return 1
    LOCKS.mkdir(parents=True, exist_ok=True)
    project = _pyproject()
    for image in IMAGES:
        if names and image.name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / f"{image.name}.in"
            source.write_text("".join(f"{r}\n" for r in requirements(image, project)))
            cmd = [uv, "pip", "compile", str(source), "--universal", "--generate-hashes", "--no-annotate"]
            cmd += ["--python-version", LOWEST_PYTHON, "--custom-compile-command", REFRESH, "-q"]
            if image is BUILD:  # setuptools is what a lock leaves out unless asked
                cmd.append("--allow-unsafe")
            cmd += ["-o", str(image.path)]
            print(f"locking {image.path.relative_to(REPO)}", flush=True)
            subprocess.run(cmd, check=True, cwd=REPO)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check()
    if argv[:1] == ["lock"]:
        return lock(argv[1:])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
