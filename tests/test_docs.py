"""The documentation cannot drift from the code: generated references are current, every relative link of
README.md and docs/*.md resolves (file and #anchor), and the blocks marked runnable run.

Runnable blocks are fenced with an info string that says so: ```` ```bash run ```` or ```` ```python run ````;
``expect=TEXT`` requires TEXT in the block's output. ``run server`` blocks need `make serve`'s server and run in the slow test, against a `vsurge serve
--model default` this test starts on a free port (the block's ``11556`` is rewritten to it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
# Pages other branches add (LoRA): a link to one is checked once it exists.
PENDING = {REPO / "docs" / "lora.md"}

# a fenced block, indented too (inside a list item): indent, fence, info string, body
_FENCE = re.compile(r"^([ \t]*)(`{3,})([^\n`]*)\n(.*?)^\1\2[ \t]*$", re.S | re.M)


def _load_gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _load_gen_docs()


# ------------------------------------------------------------------------------------------ generated


def test_generated_references_are_current():
    stale = gen_docs.stale()
    assert not stale, "\n\n".join(
        f"{diff}\n{page.relative_to(REPO)} is out of date: run `python tools/gen_docs.py`"
        for page, diff in stale.items()
    )


def test_a_new_serve_flag_makes_the_check_fail(tmp_path):
    """A flag added to `vsurge serve` (as a new EngineConfig knob or cli option would be) and not regenerated:
    `gen_docs.py --check` exits 1, names the page and the command, and shows the missing row."""
    script = textwrap.dedent(
        f"""
        import sys
        import vsurge.cli.serve_options as so
        so.SERVE_OPTIONS = (*so.SERVE_OPTIONS, so.Option(
            "--undocumented-knob", "VSURGE_UNDOCUMENTED_KNOB", int, 3, "a knob nobody documented", "N"))
        sys.argv = ["gen_docs.py", "--check"]
        sys.path.insert(0, {str(REPO / "tools")!r})
        import runpy
        runpy.run_path({str(REPO / "tools" / "gen_docs.py")!r}, run_name="__main__")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "docs/serving.md is out of date: run `python tools/gen_docs.py`" in proc.stderr
    assert (
        "+| `--undocumented-knob N` | `VSURGE_UNDOCUMENTED_KNOB` | 3 | a knob nobody documented |"
        in proc.stderr
    )


def test_an_undocumented_variable_is_named(tmp_path):
    from docgen import env_vars  # gen_docs put tools/ on sys.path

    (tmp_path / "m.py").write_text(
        'TIMEOUT = os.environ.get("VSURGE_BRAND_NEW_S", "3")\nPREFIX = "VSURGE_"\n'
    )
    assert env_vars.undocumented(tmp_path, set()) == ["VSURGE_BRAND_NEW_S"]
    with pytest.raises(ValueError, match="VSURGE_BRAND_NEW_S .*ENV_ONLY"):
        env_vars.table(tmp_path, set())


def test_a_chart_value_without_description_is_refused(monkeypatch, tmp_path):
    import json

    from docgen import kube

    schema = json.loads(kube.SCHEMA.read_text())
    del schema["properties"]["nameOverride"]["description"]
    (tmp_path / "values.schema.json").write_text(json.dumps(schema))
    monkeypatch.setattr(kube, "SCHEMA", tmp_path / "values.schema.json")
    with pytest.raises(ValueError, match="nameOverride has no description"):
        kube.values_table()


# ------------------------------------------------------------------------------------------ links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _without_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = _without_code(page.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if dest in PENDING and not dest.exists():
            continue
        if not dest.exists():
            bad.append(f"{target}: no file {_rel(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(bad)


def test_the_link_check_finds_a_broken_file_and_anchor(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "q.md").write_text("# Real heading\n\n## `code` and more (x)\n")
    page.write_text(
        "[a](q.md) [b](q.md#real-heading) [c](q.md#code-and-more-x) [d](missing.md) [e](q.md#nope) "
        "[f](#here)\n\n# Here\n\n```\n[g](not-a-link.md)\n```\n"
    )
    bad = broken_links(page)
    assert [b.split(":")[0] for b in bad] == ["missing.md", "q.md#nope"], bad


# ------------------------------------------------------------------------------------------ runnable blocks


def runnable_blocks(page: Path) -> list[tuple[str, str, set[str]]]:
    """(language, code, tags) of every block whose info string is ``<language> run [tags...]``."""
    out = []
    for _, _, info, body in _FENCE.findall(page.read_text(encoding="utf-8")):
        words = info.split()
        if len(words) >= 2 and words[1] == "run":
            out.append((words[0], textwrap.dedent(body), set(words[2:])))
    return out


BLOCKS = [
    pytest.param(
        page,
        i,
        lang,
        body,
        tags,
        id=f"{page.relative_to(REPO)}#{i}",
        marks=[pytest.mark.slow] * ("server" in tags),
    )
    for page in PAGES
    for i, (lang, body, tags) in enumerate(runnable_blocks(page))
]


def test_there_are_runnable_blocks_of_both_kinds():
    assert {b.values[2] for b in BLOCKS} >= {"bash", "python"}
    assert any("server" in b.values[4] for b in BLOCKS), "the README's quickstart against a server runs"
    assert {b.values[2] for b in BLOCKS} <= {"bash", "python"}, "a runnable block is bash or python"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # `vsurge`, `python` of this environment first
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "service"), str(REPO / "operator"), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def _run(lang: str, body: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vsurge serve --model default` (what `make serve` runs), on a free port; stopped with SIGTERM."""
    port = _free_port()
    cmd = [sys.executable, "-m", "vsurge.cli", "serve", "--model", "default", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--metrics-port", "-1"]
    # few slots and buckets: the blocks send one short prompt at a time, and every shape compiles at start
    cmd += ["--max-concurrent-decodes", "2", "--max-length", "512", "--prefill-lengths", "64,128"]
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vsurge serve exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vsurge serve not ready after 900 s")
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize(("page", "index", "lang", "body", "tags"), BLOCKS)
def test_runnable_block(page, index, lang, body, tags, request):
    env = _env()
    if "server" in tags:
        port = request.getfixturevalue("server")
        body = body.replace("11556", str(port))
    proc = _run(lang, body, env)
    where = f"{page.relative_to(REPO)}, runnable block {index} ({lang})"
    output = f"{body}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{output}"
    for tag in tags:
        if tag.startswith("expect="):
            assert tag[len("expect=") :] in proc.stdout, f"{where}: {tag!r} not in its output:\n{output}"


# ------------------------------------------------------------------------------------------ portable


# A path that only exists on one machine (a developer's checkout, a peers folder) has no place in what a
# reader runs: peers live under $PEERS, caches under VSURGE_CACHE_DIR.
_MACHINE_PATH = re.compile(r"(?<![\w.$])(/work/|/home/[a-z]|/Users/[A-Za-z])")
_SCANNED = [
    "README.md",
    "Makefile",
    "docs",
    "service",
    "operator",
    "benchmarks",
    "tools",
    ".ci",
    "helm",
    "docker",
]


def machine_paths(root: Path) -> list[str]:
    found = []
    for name in _SCANNED:
        base = root / name
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            if (
                path.suffix not in {".md", ".py", ".sh", ".yaml", ".yml", ".json", ".toml", ""}
                or "__pycache__" in path.parts
            ):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if _MACHINE_PATH.search(line):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return found


def test_no_machine_specific_paths():
    found = machine_paths(REPO)
    assert not found, "paths of one machine (use $PEERS, VSURGE_CACHE_DIR or a flag):\n" + "\n".join(found)


def test_the_path_check_sees_one(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(
        "ok: $PEERS/vllm and ~/peers\nbad: /work/peers/vllm-venv/bin/vllm\n"
    )
    assert machine_paths(tmp_path) == ["docs/x.md:2: bad: /work/peers/vllm-venv/bin/vllm"]
