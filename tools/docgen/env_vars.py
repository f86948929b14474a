"""The `VSURGE_*` variables the service reads that are not a flag's: each one's meaning, and a check that
the code reads no variable this list does not describe.

The check reads the source (every string literal ``"VSURGE_..."`` under service/vsurge), so a variable added
in code without a line here fails tools/gen_docs.py --check and the docs test. The router's own variables
(``VSURGE_ROUTER_*``) are its flags' and are listed with them.
"""

from __future__ import annotations

import re
from pathlib import Path

from .blocks import cell, code

# name -> (default, meaning). Environment only: settings of the process's surroundings (a cache, a mount,
# a secret that must never be on a command line) or test and debugging overrides.
ENV_ONLY: dict[str, tuple[str, str]] = {
    "VSURGE_ENABLE_LORA_RUNTIME_UPDATES": (
        "off",
        "`1` / `true`: `vsurge serve --enable-lora-runtime-updates` (POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter answer; the InferenceModel's `spec.env` can set it)",
    ),
    "VSURGE_CACHE_DIR": (
        "`~/.cache/vsurge`",
        "the model cache (`models/<source>/<revision>/`), the default model's download and the persistent "
        "JAX compilation cache (`jax/`)",
    ),
    "VSURGE_CREDENTIALS_DIR": (
        "none",
        "a directory of store credentials; `key.json` in it is a GCS service-account key (the operator mounts "
        "`spec.model.credentialsSecret` here)",
    ),
    "VSURGE_PVC_MOUNT": (
        "`/mnt/models`",
        "where `pvc://claim/path` sources are read from (the operator mounts the claim)",
    ),
    "VSURGE_DOWNLOAD_WORKERS": (
        "8",
        "parallel byte-range streams of a remote source's download, across all files",
    ),
    "VSURGE_DOWNLOAD_CHUNK_BYTES": ("16 MiB", "size of each byte range a download fetches"),
    "VSURGE_PROGRESS_INTERVAL": ("5", "seconds between a download's progress lines"),
    "VSURGE_TERMINATION_LOG": (
        "`/dev/termination-log` in a container",
        "where `vsurge serve` writes `ModelSourceError: <message>` (and other start-up errors) before exiting 1",
    ),
    "VSURGE_LANE_SECRET_FILE": (
        "none",
        "multi-host: the file holding the step lane's shared secret (at least 32 bytes); required with more than "
        "one process, never a flag",
    ),
    "VSURGE_LANE_TIMEOUT_S": (
        "10",
        "multi-host: the failure bound T: a silent worker fails the group after 0.5 T, a wedged call after 0.75 T",
    ),
    "VSURGE_SAMPLER_IMPL": (
        "by backend",
        "`cpu` or `tpu`: force the on-device sampler's form (testing and benchmarks)",
    ),
    "VSURGE_EXECUTABLE_STORE": (
        "auto",
        "keep each engine program's compiled executable under JAX's compilation cache dir and read it back at "
        "the next start, skipping tracing and lowering: `auto` (on off the CPU), `1` or `0`",
    ),
    "VSURGE_CACHE_HMAC_KEY": (
        "a per-host key file",
        "the key every executable-store file is signed with (HMAC-SHA256, checked before anything is "
        "unpickled; the operator sets it from a per-model Secret); unset: a random key in "
        "`$VSURGE_CACHE_DIR/keys/cache-hmac.key` (0600), outside the compilation cache dir",
    ),
    "VSURGE_PALLAS_KERNEL": (
        "by backend",
        "`mosaic`, `interpret` or `reference`: force what runs inside the paged attention kernel's `shard_map`",
    ),
}

_LITERAL = re.compile(r"[\"'](VSURGE_[A-Z0-9_]*[A-Z0-9])[\"']")


def read_in_code(root: Path) -> set[str]:
    """Every complete ``"VSURGE_..."`` string literal under ``root`` (a prefix such as ``"VSURGE_"`` is not one)."""
    names: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        names.update(_LITERAL.findall(path.read_text(encoding="utf-8")))
    return names


def undocumented(root: Path, option_envs: set[str]) -> list[str]:
    """Variables the code reads that neither an option nor ENV_ONLY describes."""
    return sorted(
        n
        for n in read_in_code(root)
        if n not in option_envs and n not in ENV_ONLY and not n.startswith("VSURGE_ROUTER_")
    )


def table(root: Path, option_envs: set[str]) -> str:
    missing = undocumented(root, option_envs)
    if missing:
        raise ValueError(
            "the service reads environment variables docs/serving.md does not describe: "
            + ", ".join(missing)
            + " (add each to ENV_ONLY in tools/docgen/env_vars.py)"
        )
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, (default, meaning) in ENV_ONLY.items():
        lines.append(f"| {code(name)} | {default} | {cell(meaning)} |")
    return "\n".join(lines)
