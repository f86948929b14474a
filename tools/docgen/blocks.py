"""Generated blocks inside hand-written Markdown files.

A block is everything between ``<!-- BEGIN GENERATED: name ... -->`` and ``<!-- END GENERATED: name -->``:
the text around it is prose a person writes, the text inside it is whatever the generator says, so the two
can live in one page without the generator ever touching the prose.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

REGENERATE = "python tools/gen_docs.py"


def begin_marker(name: str) -> str:
    return f"<!-- BEGIN GENERATED: {name} (do not edit; regenerate with `{REGENERATE}`) -->"


def end_marker(name: str) -> str:
    return f"<!-- END GENERATED: {name} -->"


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"^<!-- BEGIN GENERATED: {re.escape(name)}\b[^\n]*-->\n(.*?)^<!-- END GENERATED: {re.escape(name)} -->$",
        re.S | re.M,
    )


def block_names(text: str) -> list[str]:
    """The names of the generated blocks in ``text``, in order."""
    return re.findall(r"^<!-- BEGIN GENERATED: ([\w.-]+)", text, flags=re.M)


def replace_blocks(text: str, generators: Mapping[str, Callable[[], str]]) -> str:
    """``text`` with every generated block's body rewritten; an unknown block name is an error."""
    out = text
    for name in block_names(text):
        if name not in generators:
            raise KeyError(f"no generator for the block {name!r} (known: {', '.join(sorted(generators))})")
        body = generators[name]().rstrip("\n") + "\n"
        match = _pattern(name).search(out)
        if match is None:
            raise ValueError(f"block {name!r}: its END marker is missing")
        out = out[: match.start()] + f"{begin_marker(name)}\n{body}{end_marker(name)}" + out[match.end() :]
    return out


def cell(text: object) -> str:
    """One Markdown table cell: pipes escaped, no line breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: object) -> str:
    """Inline code that survives a table cell (a backtick inside is doubled up around)."""
    s = " ".join(str(text).split()).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


# ------------------------------------------------------------------------------------------ in code
# The same idea in a YAML or Python file: ``# BEGIN GENERATED: name`` / ``# END GENERATED: name`` comment
# lines, the body indented as the BEGIN line is (a YAML block sits at its place in the tree).


def comment_begin(name: str) -> str:
    return f"# BEGIN GENERATED: {name} (do not edit; regenerate with `{REGENERATE}`)"


def replace_comment_block(text: str, name: str, body: str) -> str:
    """``text`` with the body of its ``# BEGIN GENERATED: name`` block replaced by ``body``."""
    pattern = re.compile(
        rf"^([ \t]*)# BEGIN GENERATED: {re.escape(name)}\b[^\n]*\n.*?^\1# END GENERATED: {re.escape(name)}[ \t]*$",
        re.S | re.M,
    )
    match = pattern.search(text)
    if match is None:
        raise ValueError(f"no generated block {name!r} (or its END line is missing)")
    indent = match.group(1)
    lines = [f"{indent}{line}" if line else "" for line in body.rstrip("\n").split("\n")]
    block = "\n".join([f"{indent}{comment_begin(name)}", *lines, f"{indent}# END GENERATED: {name}"])
    return text[: match.start()] + block + text[match.end() :]
