"""Discovery from a static YAML file: for local use, or a cluster without the operator.

```yaml
models:
  - name: llama            # the `model` clients send
    upstreams:             # base URLs of its replicas (`replicas:` is accepted as a synonym)
      - http://127.0.0.1:11556
      - http://127.0.0.1:11566
  - name: qwen
    upstreams: [http://qwen.models.svc.cluster.local:11556]
    adapters: [qwen-sql, qwen-chat]   # LoRA adapters its replicas serve (`vsurge serve --lora`)
```

The file is re-read every few seconds and applied when its content changes (a Kubernetes ConfigMap
volume is updated in place); a file that no longer parses is logged and the previous models are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .table import Backend, EndpointTable, UpstreamURLError, normalize_upstream

log = logging.getLogger(__name__)

GROUP = "static"
_MODEL_KEYS = {"name", "upstreams", "replicas", "adapters"}


class StaticConfigError(ValueError):
    """The static config is invalid; the message names the entry and the problem."""


@dataclass(frozen=True)
class StaticModel:
    name: str
    upstreams: tuple[str, ...]
    adapters: tuple[str, ...] = ()


def parse_static_config(data: Any) -> list[StaticModel]:
    """The parsed YAML document -> models; raises StaticConfigError naming the offending entry."""
    if data is None:
        return []
    if not isinstance(data, dict):
        raise StaticConfigError("the top level must be a mapping with a `models` list")
    unknown = set(data) - {"models"}
    if unknown:
        raise StaticConfigError(f"unknown top-level key(s) {sorted(unknown)}; expected `models`")
    models = data.get("models") or []
    if not isinstance(models, list):
        raise StaticConfigError("`models` must be a list of {name, upstreams}")
    out: list[StaticModel] = []
    seen: set[str] = set()
    for i, entry in enumerate(models):
        where = f"models[{i}]"
        if not isinstance(entry, dict):
            raise StaticConfigError(f"{where}: expected a mapping with `name` and `upstreams`")
        unknown = set(entry) - _MODEL_KEYS
        if unknown:
            raise StaticConfigError(
                f"{where}: unknown key(s) {sorted(unknown)}; expected name, upstreams, adapters"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise StaticConfigError(f"{where}.name: a non-empty string is required")
        name = name.strip()
        where = f"models[{i}] ({name})"
        if name in seen:
            raise StaticConfigError(f"{where}: the name is listed twice; list all its upstreams in one entry")
        seen.add(name)
        if "upstreams" in entry and "replicas" in entry:
            raise StaticConfigError(f"{where}: give `upstreams` or `replicas`, not both")
        key = "replicas" if "replicas" in entry else "upstreams"
        urls = entry.get(key)
        if urls is None:
            urls = []
        if isinstance(urls, str):
            urls = [urls]
        if not isinstance(urls, list):
            raise StaticConfigError(f"{where}.{key}: expected a list of URLs")
        normalized: list[str] = []
        for j, url in enumerate(urls):
            if not isinstance(url, str):
                raise StaticConfigError(f"{where}.{key}[{j}]: expected a URL string, got {url!r}")
            try:
                u = normalize_upstream(url)
            except UpstreamURLError as e:
                raise StaticConfigError(f"{where}.{key}[{j}]: {e}") from None
            if u not in normalized:
                normalized.append(u)
        out.append(StaticModel(name, tuple(normalized), _adapters(entry.get("adapters"), where)))
    names = {m.name for m in out}
    owners: dict[str, str] = {}
    for m in out:
        for a in m.adapters:
            if a in names:
                raise StaticConfigError(f"adapter {a!r} of {m.name}: a model has that name")
            if a in owners:
                raise StaticConfigError(f"adapter {a!r} is listed by {owners[a]} and {m.name}")
            owners[a] = m.name
    return out


def _adapters(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(a, str) and a.strip() for a in raw):
        raise StaticConfigError(f"{where}.adapters: expected a list of adapter names")
    return tuple(dict.fromkeys(a.strip() for a in raw))


def aliases_of(models: list[StaticModel]) -> dict[str, str]:
    """Adapter -> the model whose upstreams serve it."""
    return {a: m.name for m in models for a in m.adapters}


def load_static_config(path: str | Path) -> list[StaticModel]:
    """Read and parse the file; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise StaticConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_text(text, path)


def parse_text(text: str, path: str | Path = "<static config>") -> list[StaticModel]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise StaticConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return parse_static_config(data)
    except StaticConfigError as e:
        raise StaticConfigError(f"{path}: {e}") from None


def backends_of(models: list[StaticModel], created: int) -> list[Backend]:
    return [
        Backend(m.name, m.upstreams, key=f"{GROUP}/{m.name}", group=GROUP, created=created) for m in models
    ]


class StaticDiscovery:
    """Publishes the file's models into the table, then polls the file for changes."""

    def __init__(self, path: str | Path, reload_seconds: float = 5.0) -> None:
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self._task: asyncio.Task[None] | None = None
        self._text: str | None = None
        self._created = int(time.time())

    async def start(self, table: EndpointTable) -> None:
        # A bad file at start-up is fatal (the caller reports it); later, it only logs.
        table.expect(GROUP)
        self._text = self.path.read_text(encoding="utf-8") if self.path.exists() else None
        models = load_static_config(self.path)
        table.replace_group(GROUP, backends_of(models, self._created))
        table.set_aliases(GROUP, aliases_of(models))
        log.info("static config %s: %d model(s)", self.path, len(models))
        if self.reload_seconds > 0:
            self._task = asyncio.create_task(self._poll(table), name="vsurge-router-static")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self, table: EndpointTable) -> None:
        while True:
            await asyncio.sleep(self.reload_seconds)
            try:
                text = self.path.read_text(encoding="utf-8")
            except OSError as e:
                log.warning("static config %s: cannot read (%s); keeping the previous models", self.path, e)
                continue
            if text == self._text:
                continue
            self._text = text
            try:
                models = parse_text(text, self.path)
            except StaticConfigError as e:
                log.error("%s; keeping the previous models", e)
                continue
            table.replace_group(GROUP, backends_of(models, self._created))
            table.set_aliases(GROUP, aliases_of(models))
            log.info("static config %s reloaded: %d model(s)", self.path, len(models))
