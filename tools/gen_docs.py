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

Needs the service importable (`pip install -e .`, or PYTHONPATH=service) and PyYAML.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docgen import blocks, cli_options, env_vars, kube  # noqa: E402

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


def pages() -> list[Path]:
    """The Markdown pages that hold generated blocks."""
    return [p for p in sorted(DOCS.glob("*.md")) if blocks.block_names(p.read_text(encoding="utf-8"))]


def stale(generators: dict[str, Callable[[], str]] | None = None) -> dict[Path, str]:
    """{page: unified diff} for every page whose generated blocks differ from what the sources give."""
    out = {}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = blocks.replace_blocks(text, generators or GENERATORS)
        if fresh != text:
            rel = page.relative_to(REPO)
            diff = difflib.unified_diff(
                text.splitlines(),
                fresh.splitlines(),
                f"{rel} (checked in)",
                f"{rel} (generated)",
                lineterm="",
            )
            out[page] = "\n".join(diff)
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
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = blocks.replace_blocks(text, GENERATORS)
        if fresh != text:
            page.write_text(fresh, encoding="utf-8")
            print(f"regenerated {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
