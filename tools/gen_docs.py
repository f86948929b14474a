"""Regenerate the reference sections of docs/ from the code and the schemas, or check they are current.

    python tools/gen_docs.py            # rewrite every generated block in docs/*.md
    python tools/gen_docs.py --check    # exit 1, naming each stale file, if any block differs

A generated block sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->`` in a
hand-written page (tools/docgen/blocks.py). The sources:

    serve-options, route-options   the argparse parsers of `vsurge serve` / `vsurge route` (EngineConfig's
                                   serve fields included: a new knob appears with its flag and variable)
    engine-config                  EngineConfig's fields that are Python-only
    env-vars                       the VSURGE_* variables that are no flag's (and a check that the service
                                   reads none this list lacks)
    crd-spec, crd-status           helm/vsurge/crds/inferencemodels.vsurge.io.yaml's openAPIV3Schema
    chart-values                   helm/vsurge/values.schema.json (descriptions, types, constraints) over
                                   values.yaml (keys, defaults)

Two generated blocks sit in code rather than in docs (``# BEGIN GENERATED: name`` comments), both from
EngineConfig's serve fields (tools/docgen/engine_crd.py); they are written first, so the CRD reference
above describes the fresh schema:

    engine (the CRD yaml)          the InferenceModel CRD's spec.engine
    engine-options                 operator/vsurge_operator/engine_options.py: the operator's table of it

Needs the service importable (`pip install -e .`, or PYTHONPATH=service) and PyYAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docgen import blocks, cli_options, engine_crd, env_vars, kube  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SERVICE = REPO / "service" / "vsurge"


def _option_envs() -> set[str]:
    return {r.env for name in ("serve", "route") for r in cli_options.rows(name) if r.env}


GENERATORS: dict[str, Callable[[], str]] = {
    "serve-options": lambda: cli_options.table("serve"),
    "route-options": lambda: cli_options.table("route"),
    "engine-config": cli_options.engine_only_table,
    "env-vars": lambda: env_vars.table(SERVICE, _option_envs()),
    "crd-spec": lambda: kube.crd_table("spec"),
    "crd-status": lambda: kube.crd_table("status"),
    "chart-values": kube.values_table,
}


# (file, block name, generator) of the blocks in code
CODE_BLOCKS: list[tuple[Path, str, Callable[[Iterable[dataclasses.Field] | None], str]]] = [
    (kube.CRD, "engine", engine_crd.crd_block),
    (
        REPO / "operator" / "vsurge_operator" / "engine_options.py",
        "engine-options",
        engine_crd.operator_block,
    ),
]


def fresh_code(fields: Iterable[dataclasses.Field] | None = None) -> dict[Path, tuple[str, str]]:
    """{file: (checked-in text, generated text)} of the files with generated code blocks; ``fields``:
    EngineConfig's serve fields to generate from (a test's list; default: the real ones)."""
    out: dict[Path, tuple[str, str]] = {}
    for path, name, generate in CODE_BLOCKS:
        text = out[path][1] if path in out else path.read_text(encoding="utf-8")
        fresh = blocks.replace_comment_block(text, name, generate(fields))
        out[path] = (out[path][0] if path in out else text, fresh)
    return out


def _diff(path: Path, text: str, fresh: str) -> str:
    rel = path.relative_to(REPO)
    lines = difflib.unified_diff(
        text.splitlines(), fresh.splitlines(), f"{rel} (checked in)", f"{rel} (generated)", lineterm=""
    )
    return "\n".join(lines)


def pages() -> list[Path]:
    """The Markdown pages that hold generated blocks."""
    return [p for p in sorted(DOCS.glob("*.md")) if blocks.block_names(p.read_text(encoding="utf-8"))]


def stale(
    generators: dict[str, Callable[[], str]] | None = None, fields: Iterable[dataclasses.Field] | None = None
) -> dict[Path, str]:
    """{file: unified diff} for every page (and code file) whose generated blocks differ from the sources."""
    code = fresh_code(fields)
    out = {path: _diff(path, text, fresh) for path, (text, fresh) in code.items() if fresh != text}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = blocks.replace_blocks(text, generators or GENERATORS)
        if fresh != text:
            out[page] = _diff(page, text, fresh)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for page, diff in found.items():
            print(diff, file=sys.stderr)
            print(f"{page.relative_to(REPO)} is out of date: run `{blocks.REGENERATE}`", file=sys.stderr)
        return 1 if found else 0
    for path, (text, fresh) in fresh_code().items():
        if fresh != text:
            path.write_text(fresh, encoding="utf-8")
            print(f"regenerated {path.relative_to(REPO)}")
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = blocks.replace_blocks(text, GENERATORS)
        if fresh != text:
            page.write_text(fresh, encoding="utf-8")
            print(f"regenerated {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
