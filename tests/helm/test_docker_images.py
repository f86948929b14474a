"""The container images in docker/: read with a small Dockerfile reader (tests/helm/dockerkit.py).

No Docker engine runs here, so these check what can be checked without building: the files parse, every file
they copy exists in the repository and is sent in the build context, the final user is a non-root numeric user,
and the entrypoints are the contracts the chart and the operator rely on.
"""

from __future__ import annotations

import re
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

# The contract of each image: entrypoint, default command, what pip installs.
CONTRACT = {
    "service": {"entrypoint": ["vsurge"], "cmd": ["serve"], "install": ".[serve,tpu]"},
    "operator": {"entrypoint": ["python", "-m", "vsurge_operator"], "cmd": None, "install": "."},
}


@pytest.fixture(params=sorted(DOCKERFILES))
def image(request: pytest.FixtureRequest) -> str:
    return request.param


def test_dockerfiles_parse(image: str) -> None:
    dockerfile = parse(DOCKERFILES[image])
    assert len(dockerfile.stages) == 2, "a build stage and a slim runtime stage"
    for stage in dockerfile.stages:
        assert re.fullmatch(r"python:3\.1[1-9]-slim(-[a-z]+)?", stage.base), stage.base
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
    """What `pip install` installs in the image, its ARGs at their defaults or at `build_args`."""
    out = []
    for stage in dockerfile.stages:
        env = {**stage.env, **(build_args or {})}
        runs = " ".join(substitute(i.rest, env) for i in stage.all("RUN"))
        out += re.findall(r"pip install (?!--upgrade)\"?([^\"\s]+)\"?", runs)
    return out


def test_installs_the_project(image: str) -> None:
    dockerfile = parse(DOCKERFILES[image])
    installed = _installed(dockerfile)
    assert installed == [CONTRACT[image]["install"]]
    extras = re.findall(r"\[(\w+)\]", CONTRACT[image]["install"])
    for extra in extras:
        assert extra in PYPROJECT["project"]["optional-dependencies"], f"pyproject has no extra {extra!r}"


def test_service_image_has_a_variant_per_accelerator() -> None:
    # --build-arg ACCELERATOR=cuda|cpu: the engine (serve) plus jax's CUDA 12 wheels, or nothing more
    dockerfile = parse(DOCKERFILES["service"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    for accelerator in ("tpu", "cuda", "cpu"):
        assert _installed(dockerfile, {"ACCELERATOR": accelerator}) == [f".[serve,{accelerator}]"]
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
        ("tpu", "vsurge-service"),
        ("cuda", "vsurge-service-cuda"),
        ("cpu", "vsurge-service-cpu"),
    ):
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
    assert PYPROJECT["project"]["scripts"].get("vsurge") == "vsurge.cli:main"
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
