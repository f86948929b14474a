"""spec.adapters: LoRA adapters served on a model's pods, and what the pods say they serve.

The pods get each adapter as ``vsurge serve --lora NAME=SOURCE`` (container args: the flag is the server's
contract, repeatable, and the engine's other LoRA knobs ride along as ``--max-loras`` / ``--max-lora-rank``).
A ``pvc://`` source is mounted read-only like the model's claim and passed as a path: the model's own claim
is already at ``/mnt/models``; any other claim gets ``/mnt/adapters/<n>``.

A change of spec.adapters changes the pod template, so it rolls out like any spec change (new pods ready
before old ones go, spec.rollout). The pods' args stay the single truth: a restarted or added pod serves
exactly the spec's adapters, which pushing adapters into running pods (POST /v1/load_lora_adapter, with the
server's admin key) could not promise. Adapters loaded at run time outside the spec still show in the
status (``inSpec: false``).

``status_entries`` (pure) turns what each ready pod listed in ``GET /v1/models`` (model objects whose
``parent`` is set are adapters) into ``status.adapters``; ``read_pods`` fetches those lists.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# Keep in sync with helm/vsurge/crds/inferencemodels.vsurge.io.yaml (tests compare them). An adapter is
# a model id (the servedName pattern: no '=', so NAME=SOURCE splits on the first '='), and its source is
# any model source but "default" (the bundled base model is no adapter).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
NAME_MAX_LENGTH = 128
SOURCE_PATTERN = (
    r"^(hf://[^\s]+|gs://[^\s]+|s3://[^\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?|/[^\s]*)$"
)
SOURCE_MAX_LENGTH = 1024
MAX_ADAPTERS = 64  # the CRD's maxItems (it bounds the cost of the uniqueness rule)

ADAPTER_MOUNT = "/mnt/adapters"
VOLUME_PREFIX = "adapters-"


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    source: str


def adapters_from(raw: Any) -> tuple[AdapterSpec, ...]:
    """spec.adapters of a validated body."""
    return tuple(AdapterSpec(str(a["name"]), str(a["source"])) for a in raw or ())


def validate(c: Any, spec: Mapping[str, Any], served_name: Any) -> None:
    """Record spec.adapters' problems on ``c`` (validation._Checker); the CEL rules' twin."""
    raw = spec.get("adapters")
    if raw is None:
        return
    if not isinstance(raw, list):
        c.fail("spec.adapters", "must be a list of {name, source}")
        return
    if len(raw) > MAX_ADAPTERS:
        c.fail("spec.adapters", f"at most {MAX_ADAPTERS} adapters (got {len(raw)})")
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        path = f"spec.adapters[{i}]"
        if not isinstance(item, Mapping):
            c.fail(path, "must be an object with name and source")
            continue
        for key in ("name", "source"):
            if item.get(key) is None:
                c.fail(f"{path}.{key}", "is required")
        name, source = item.get("name"), item.get("source")
        c.string(name, f"{path}.name", NAME_PATTERN)
        c.string(source, f"{path}.source", SOURCE_PATTERN)
        if isinstance(source, str) and len(source) > SOURCE_MAX_LENGTH:
            c.fail(f"{path}.source", f"must be at most {SOURCE_MAX_LENGTH} characters")
        if not isinstance(name, str):
            continue
        # Named on the list, as the CRD's CEL rules name it.
        if name in seen:
            c.fail("spec.adapters", f"adapter names must be unique: {name!r} is items {seen[name]} and {i}")
        seen.setdefault(name, i)
        if name == served_name:
            c.fail(
                "spec.adapters",
                f"adapters[{i}] is named {name!r}, the model's served name; an adapter needs a name of its own",
            )


def _claim(source: str) -> tuple[str, str] | None:
    """``pvc://claim/sub/dir`` -> (claim, "sub/dir"); None for any other source."""
    if not source.startswith("pvc://"):
        return None
    claim, _, path = source[len("pvc://") :].partition("/")
    return claim, path.strip("/")


def extra_claims(adapters: Sequence[AdapterSpec], model_source: str) -> list[str]:
    """The claims adapters read that the model's own source does not mount, in first-use order."""
    model = _claim(model_source)
    out: list[str] = []
    for a in adapters:
        c = _claim(a.source)
        if c is not None and (model is None or c[0] != model[0]) and c[0] not in out:
            out.append(c[0])
    return out


def adapter_path(source: str, model_source: str, model_mount: str) -> str:
    """What ``--lora NAME=`` gets: the source as is, except a claim becomes its mounted path."""
    c = _claim(source)
    if c is None:
        return source
    claim, path = c
    model = _claim(model_source)
    if model is not None and model[0] == claim:
        base = model_mount
    else:
        base = f"{ADAPTER_MOUNT}/{extra_claims([AdapterSpec('', source)], model_source)[0]}"
    return f"{base}/{path}" if path else base


def args(
    adapters: Sequence[AdapterSpec],
    model_source: str,
    model_mount: str,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
) -> list[str]:
    """The container args of ``vsurge serve`` for the adapters and the engine's LoRA knobs."""
    out: list[str] = []
    for a in adapters:
        out += ["--lora", f"{a.name}={adapter_path(a.source, model_source, model_mount)}"]
    if max_loras is not None:
        out += ["--max-loras", str(max_loras)]
    if max_lora_rank is not None:
        out += ["--max-lora-rank", str(max_lora_rank)]
    return out


def volume_name(index: int) -> str:
    return f"{VOLUME_PREFIX}{index}"


def volumes(adapters: Sequence[AdapterSpec], model_source: str) -> list[dict[str, Any]]:
    """Read-only volumes of the adapters' own claims (the model's claim is mounted already)."""
    return [
        {"name": volume_name(i), "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        for i, claim in enumerate(extra_claims(adapters, model_source))
    ]


def mounts(adapters: Sequence[AdapterSpec], model_source: str) -> list[dict[str, Any]]:
    return [
        {"name": volume_name(i), "mountPath": f"{ADAPTER_MOUNT}/{claim}", "readOnly": True}
        for i, claim in enumerate(extra_claims(adapters, model_source))
    ]


# ------------------------------------------------------------------------------------------ status


def listed_adapters(body: Any) -> set[str] | None:
    """The adapter ids of a ``/v1/models`` answer (model objects with a ``parent``); None if not one."""
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        return None
    return {
        str(m["id"])
        for m in body["data"]
        if isinstance(m, Mapping) and isinstance(m.get("id"), str) and m.get("parent")
    }


def status_entries(
    adapters: Sequence[AdapterSpec], listings: Iterable[set[str] | None]
) -> list[dict[str, Any]]:
    """status.adapters: each spec adapter, then any other adapter a pod lists (loaded at run time).

    ``listings`` holds one entry per ready pod: the adapters it listed, or None when it did not answer
    (it counts for nobody). ``loaded`` means every pod that answered lists it (and one did)."""
    answered = [s for s in listings if s is not None]
    names = [a.name for a in adapters]
    in_spec = set(names)
    names += sorted({n for s in answered for n in s} - in_spec)
    out = []
    for name in names:
        pods = sum(1 for s in answered if name in s)
        out.append(
            {
                "name": name,
                "loaded": bool(answered) and pods == len(answered),
                "pods": pods,
                "inSpec": name in in_spec,
            }
        )
    return out


def http_port(pod: Mapping[str, Any], default: int) -> int:
    """The pod's container port named "http" (tests and custom images may move it)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                return int(p["containerPort"])
    return default


def models_url(metrics_url: str, port: int) -> str:
    """A pod's ``/v1/models`` URL from its scrape target's ``/metrics`` URL (same address, the HTTP port)."""
    return re.sub(r":\d+/metrics$", f":{port}/v1/models", metrics_url)


async def _listing(client: httpx.AsyncClient, url: str) -> set[str] | None:
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:  # 401: a pod with an API key; its adapters stay unknown
        return None
    try:
        return listed_adapters(response.json())
    except ValueError:
        return None


async def read_pods(urls: Sequence[str], timeout: float = 2.0) -> list[set[str] | None]:
    """``GET /v1/models`` of every URL, concurrently: the adapters each lists (None: no answer)."""
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        return list(await asyncio.gather(*(_listing(client, u) for u in urls)))
