"""The container images in docker/: read with a small Dockerfile reader (tests/helm/dockerkit.py).

No Docker engine runs here, so these check what can be checked without building: the files parse, every file
they copy exists in the repository and is sent in the build context, the final user is a non-root numeric user,
the entrypoints are the contracts the chart and the operator rely on, and the images are reproducible: bases
pinned by digest, each installing its hashed lock (docker/locks/), which `docker/build-images.sh --check`
verifies against pyproject.toml (run here, and shown failing on a stale lock, an unhashed pin and an
unpinned base); everything the router imports is in the router's lean lock.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerkit import (
    DOCKERFILES,
    REPO,
    copy_sources,
    dockerignore_for,
    final_user,
    is_ignored,
    parse,
    substitute,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
_spec = importlib.util.spec_from_file_location("docker_locks", REPO / "docker" / "locks.py")
locks = importlib.util.module_from_spec(_spec)
sys.modules["docker_locks"] = locks  # dataclasses look their module up
_spec.loader.exec_module(locks)

# The contract of each image: entrypoint, default command, the lock it installs (and the extras it holds).
CONTRACT = {
    "service": {
        "entrypoint": ["vsurge"],
        "cmd": ["serve"],
        "lock": "service-tpu",
        "extras": ("serve", "tpu"),
    },
    "operator": {
        "entrypoint": ["python", "-m", "vsurge_operator"],
        "cmd": None,
        "lock": "operator",
        "extras": (),
    },
    "router": {"entrypoint": ["vsurge"], "cmd": ["route"], "lock": "router", "extras": ("router",)},
}
HEAVY = ("jax", "jaxlib", "flax", "transformers", "tokenizers", "torch", "boto3", "google-cloud-storage")


@pytest.fixture(params=sorted(DOCKERFILES))
def image(request: pytest.FixtureRequest) -> str:
    return request.param


def test_dockerfiles_parse(image: str) -> None:
    dockerfile = parse(DOCKERFILES[image])
    assert len(dockerfile.stages) == 2, "a build stage and a slim runtime stage"
    for stage in dockerfile.stages:
        # by digest: a tag moves, a digest is one image
        assert re.fullmatch(r"python:3\.1[1-9](\.\d+)?-slim(-[a-z]+)?@sha256:[0-9a-f]{64}", stage.base), (
            stage.base
        )
    names = [s.name for s in dockerfile.stages]
    for stage in dockerfile.stages:
        for ins in stage.all("COPY"):
            if "from" in ins.flags:
                assert ins.flags["from"] in names[: dockerfile.stages.index(stage)], ins.flags


def test_copied_files_exist_and_are_in_the_context(image: str) -> None:
    path = DOCKERFILES[image]
    ignore_file = dockerignore_for(path)
    sources = copy_sources(parse(path))
    assert sources, "the image copies nothing from the repository"
    for ins, source in sources:
        matches = sorted(REPO.glob(source)) if any(c in source for c in "*?[") else [REPO / source]
        assert matches and all(m.exists() for m in matches), (
            f"{path.name}:{ins.line}: {ins.cmd} {source}: not in the repository"
        )
        for match in matches:
            rel = match.relative_to(REPO).as_posix()
            assert not is_ignored(rel, ignore_file), (
                f"{path.name}:{ins.line}: {rel} is excluded by {ignore_file.name}"
            )
            if match.is_dir():
                files = [f for f in match.rglob("*.py") if "__pycache__" not in f.parts]
                sent = [f for f in files if not is_ignored(f.relative_to(REPO).as_posix(), ignore_file)]
                assert sent or not files, f"{rel}: every Python file is excluded from the build context"


def test_build_context_leaves_out_the_bulk(image: str) -> None:
    ignore_file = dockerignore_for(DOCKERFILES[image])
    assert ignore_file.exists(), "no .dockerignore: the whole repository (.venv included) would be sent"
    for rel in (".venv/lib/x.py", ".git/HEAD", "tests/helm/conftest.py", "service/vsurge/__pycache__/a.pyc"):
        assert is_ignored(rel, ignore_file), rel
    for rel in ("pyproject.toml", "service/vsurge/__init__.py", "operator/vsurge_operator/__main__.py"):
        assert not is_ignored(rel, ignore_file), rel


def test_final_user_is_not_root(image: str) -> None:
    user, group = final_user(DOCKERFILES[image])
    # Numeric, so that the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert user.isdigit() and int(user) > 0, f"USER {user!r}"
    assert group is not None and group.isdigit() and int(group) > 0, f"group {group!r}"
    # The user exists in the image, with that uid.
    runs = " ".join(i.rest for i in parse(DOCKERFILES[image]).final.all("RUN"))
    env = parse(DOCKERFILES[image]).final.env
    assert re.search(rf"useradd\b.*--uid {user}\b", substitute(runs, env).replace('"', "")), (
        "no useradd for it"
    )


def test_entrypoint_and_command(image: str) -> None:
    final = parse(DOCKERFILES[image]).final
    (entrypoint,) = final.all("ENTRYPOINT")[-1:]
    assert entrypoint.exec_form == CONTRACT[image]["entrypoint"], "exec form, so signals reach the process"
    cmds = final.all("CMD")
    expected_cmd = CONTRACT[image]["cmd"]
    if expected_cmd is None:
        assert cmds == []
    else:
        assert cmds[-1].exec_form == expected_cmd


def _installed(dockerfile, build_args: dict[str, str] | None = None) -> list[str]:
    """What `pip install` installs in the image, its ARGs at their defaults or at `build_args`: each lock
    (by name, only with --require-hashes) and "." (the project, only with --no-deps)."""
    out = []
    for stage in dockerfile.stages:
        env = {**stage.env, **(build_args or {})}
        for run in (substitute(i.rest, env) for i in stage.all("RUN")):
            for args in re.findall(r"pip install ([^&;]*)", run):
                words = args.split()
                if "-r" in words:
                    assert "--require-hashes" in words, f"pip install {args}: a lock without its hashes"
                    out.append(re.fullmatch(r"docker/locks/([\w-]+)\.txt", words[words.index("-r") + 1])[1])
                else:
                    assert "--no-deps" in words and words[-1] == ".", f"pip install {args}: not from a lock"
                    out.append(".")
    return out


def test_installs_its_lock_then_the_project(image: str) -> None:
    dockerfile = parse(DOCKERFILES[image])
    assert _installed(dockerfile) == ["build", CONTRACT[image]["lock"], "."]
    lock = next(lk for lk in locks.IMAGES if lk.name == CONTRACT[image]["lock"])
    assert lock.extras == CONTRACT[image]["extras"] and lock.dockerfile == DOCKERFILES[image].name
    for extra in lock.extras:
        assert extra in PYPROJECT["project"]["optional-dependencies"], f"pyproject has no extra {extra!r}"


def test_service_image_has_a_variant_per_accelerator() -> None:
    # --build-arg ACCELERATOR=cuda|cpu: the engine (serve) plus jax's CUDA 12 wheels, or nothing more
    dockerfile = parse(DOCKERFILES["service"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    for accelerator in ("tpu", "cuda", "cpu"):
        assert _installed(dockerfile, {"ACCELERATOR": accelerator}) == [
            "build",
            f"service-{accelerator}",
            ".",
        ]
        assert "vsurge[serve]" in extras[accelerator], (
            accelerator
        )  # pip install "vsurge[cuda]" brings the engine
    cuda = extras["cuda"]
    assert any(re.match(r"jax\[cuda12\]", dep) for dep in cuda), cuda
    # the extra asks for the same jax as the engine (jax's extra pins its plugin to that version)
    engine_jax = next(d for d in extras["serve"] if re.match(r"jax\b", d))
    cuda_jax = next(d for d in cuda if d.startswith("jax[cuda12]"))
    assert cuda_jax.removeprefix("jax[cuda12]") == engine_jax.removeprefix("jax")
    # docker/build-images.sh builds one image per accelerator, the names the chart's images.model expects
    script = (REPO / "docker" / "build-images.sh").read_text()
    for accelerator, repo in (
        ("router", "vsurge-router"),
        ("tpu", "vsurge-service"),
        ("cuda", "vsurge-service-cuda"),
        ("cpu", "vsurge-service-cpu"),
    ):
        if accelerator == "router":
            assert "-f docker/router.Dockerfile" in script and f"/{repo}:" in script
            continue
        assert f"ACCELERATOR={accelerator}" in script and f"/{repo}:" in script, accelerator


def test_operator_image_installs_no_engine() -> None:
    """The core dependencies (what the operator image installs) hold no engine, model or storage library."""
    core = " ".join(PYPROJECT["project"]["dependencies"]).lower()
    for heavy in (
        "jax",
        "flax",
        "transformers",
        "boto3",
        "google-cloud-storage",
        "huggingface",
        "llguidance",
        "torch",
    ):
        assert heavy not in core, heavy
    for heavy in ("jax", "flax", "transformers", "boto3", "google-cloud-storage", "llguidance"):
        assert any(d.startswith(heavy) for d in PYPROJECT["project"]["optional-dependencies"]["serve"]), heavy


def test_service_image_entrypoint_is_the_cli() -> None:
    assert PYPROJECT["project"]["scripts"].get("vsurge") == "vsurge.cli.main:main"
    final = parse(DOCKERFILES["service"]).final
    assert final.env["VSURGE_CACHE_DIR"] == "/cache"
    (volume,) = final.all("VOLUME")
    assert volume.args == ["/cache"]
    assert "/cache" in " ".join(i.rest for i in final.all("RUN")) and "chown" in " ".join(
        i.rest for i in final.all("RUN")
    ), "/cache must belong to the non-root user"
    exposed = {p for i in final.all("EXPOSE") for p in i.args}
    assert {"11556", "11557"} <= exposed
    assert final.env["PATH"].startswith("/opt/venv/bin:")


def test_operator_module_is_runnable() -> None:
    """The operator image runs `python -m vsurge_operator`: the package needs a __main__ module."""
    main = REPO / "operator" / "vsurge_operator" / "__main__.py"
    if not main.exists():
        pytest.skip(f"{main.relative_to(REPO)} is not written yet (the operator's engineer owns it)")
    assert "__name__" in main.read_text() or "main(" in main.read_text(), "__main__.py runs nothing"


# ---------------------------------------------------------------------------------- the reader itself


def test_reader_handles_the_dockerfile_syntax(tmp_path: Path) -> None:
    f = tmp_path / "Dockerfile"
    f.write_text(
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.12-slim\n"
        "FROM ${BASE} AS build\n"
        "COPY --chown=1:1 a.txt \\\n"
        "  # a comment inside a continuation\n"
        "  b.txt /dst/\n"
        "FROM $BASE\n"
        "ARG UID=42\n"
        "ENV HOME=/home/u \\\n    X=1\n"
        "COPY --from=build /dst /dst\n"
        'COPY ["c d.txt", "/x/"]\n'
        "USER ${UID}:${GID:-7}\n"
        'ENTRYPOINT ["app", "--flag"]\n'
        "CMD serve --port 1\n"
    )
    d = parse(f)
    assert [s.base for s in d.stages] == ["python:3.12-slim", "python:3.12-slim"]
    assert d.stages[0].name == "build"
    assert [src for _, src in copy_sources(d)] == ["a.txt", "b.txt", "c d.txt"]
    assert d.final.env["HOME"] == "/home/u" and d.final.env["X"] == "1"
    assert final_user(f) == ("42", "7")
    assert d.final.all("ENTRYPOINT")[0].exec_form == ["app", "--flag"]
    assert d.final.all("CMD")[0].exec_form is None and d.final.all("CMD")[0].args == ["serve", "--port", "1"]


def test_reader_finds_problems(tmp_path: Path) -> None:
    """Controls: a root user, a missing file and an ignored file are each seen."""
    f = tmp_path / "Dockerfile"
    f.write_text("FROM python:3.12-slim\nCOPY no/such/file /x\n")
    assert final_user(f) == ("root", None)
    ((_, source),) = copy_sources(parse(f))
    assert not (REPO / source).exists()
    ignore = tmp_path / "Dockerfile.dockerignore"
    ignore.write_text("*\n!service\nservice/**/*.md\n")
    assert is_ignored("README.md", ignore) and is_ignored("service/a/b.md", ignore)
    assert not is_ignored("service/a/b.py", ignore)
    f.write_text("FROM python:3.12-slim\nRUN <<EOF\necho\nEOF\n")
    with pytest.raises(ValueError, match="heredocs"):
        parse(f)


# ---------------------------------------------------------------------------------- locks and digests


def test_lock_check_passes_on_the_repository() -> None:
    """`docker/build-images.sh --check`, as CI or a release runs it: every lock and Dockerfile holds."""
    out = subprocess.run(
        ["bash", str(REPO / "docker" / "build-images.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(locks.IMAGES) and all(line.startswith("ok ") for line in lines), out.stdout
    for lock in locks.IMAGES:
        assert any(f"docker/locks/{lock.name}.txt:" in line for line in lines), lock.name


def test_lock_check_fails_on_a_stale_lock() -> None:
    """A dependency added to pyproject, or tightened past the locked version, without a relock."""
    router = next(lk for lk in locks.IMAGES if lk.name == "router")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert locks.check_lock(router, project)[0] == []
    extra = project["project"]["optional-dependencies"]["router"]
    extra.append("left-pad-for-python>=1")
    extra[:] = [("httpx>=999" if d.startswith("httpx") else d) for d in extra]
    problems, _ = locks.check_lock(router, project)
    assert any("left-pad-for-python>=1 is not in the lock" in p for p in problems), problems
    assert any("httpx>=999 but the lock pins httpx==" in p for p in problems), problems
    # a self-reference is followed: the tpu image's lock must hold the serve extra's dependencies too
    tpu = next(lk for lk in locks.IMAGES if lk.name == "service-tpu")
    names = {r.name for r in locks.requirements(tpu, PYPROJECT)}
    assert {"jax", "transformers", "kopf"} <= names


def test_lock_reader_and_dockerfile_check_find_problems(tmp_path: Path) -> None:
    lock = tmp_path / "x.txt"
    lock.write_text(
        "httpx==0.29.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "idna==3.21\n"  # no hash: pip --require-hashes would refuse it; the check says so first
        "requests>=2\n"  # not pinned
    )
    pins, problems = locks.read_lock(lock)
    assert [p.name for p in pins] == ["httpx", "idna"]
    assert any("idna==3.21 has no hash" in p for p in problems), problems
    assert any("not a pinned requirement: requests>=2" in p for p in problems), problems
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text(
        "ARG BASE=python:3.11-slim-bookworm\nFROM ${BASE}\n"
        "RUN pip install -r docker/locks/router.txt && pip install .\n"
    )
    problems = locks.check_dockerfile(locks.Lock("router", False, ("router",), "router.Dockerfile"), unpinned)
    assert any("is not pinned by @sha256 digest" in p for p in problems), problems
    assert any("--require-hashes -r docker/locks/router.txt" in p for p in problems), problems
    assert any("--no-deps" in p for p in problems), problems


def _third_party_imports(package: Path) -> set[str]:
    """The top-level names of every non-vsurge, non-stdlib module imported anywhere in ``package`` (module
    level and inside functions alike)."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n != "vsurge" and n not in sys.stdlib_module_names}


def test_everything_the_router_imports_is_in_its_lean_lock() -> None:
    """The router image installs only docker/locks/router.txt: each module service/vsurge/router imports
    must come from a distribution pinned there (a dependency added to the core for the router, and not to
    the router extra, fails here), and none of the engine's is."""
    import importlib.metadata as md

    distributions = md.packages_distributions()
    pins, _ = locks.read_lock(locks.LOCKS / "router.txt")
    pinned = {p.name for p in pins}
    imported = _third_party_imports(REPO / "service" / "vsurge" / "router")
    assert {"starlette", "httpx", "kubernetes"} <= imported  # the scan sees the function-level imports too
    missing = {}
    for module in sorted(imported):
        dists = {locks.canonicalize_name(d) for d in distributions.get(module, [])}
        if not dists & pinned:
            missing[module] = sorted(dists)
    assert not missing, f"imported by the router, not in docker/locks/router.txt: {missing}"
    assert not pinned & {locks.canonicalize_name(h) for h in HEAVY + ("kopf",)}, sorted(pinned)
