"""Tenants: API keys -> tenant, each with its limits and the models it may use (`--api-keys-file`).

```yaml
tenants:
  - name: team-a
    keys:
      - sk-team-a-2f9c0e51b7d84a6f          # a key as clients send it (Authorization: Bearer ...)
      - sha256:5e884898da28047151d0e56f...  # or its SHA-256 in hex: the file then holds no usable key
    requestsPerSecond: 10                   # optional: sustained request rate (a token bucket)
    burst: 20                               # optional: the bucket's size (default max(1, requestsPerSecond))
    tokensPerMinute: 200000                 # optional: prompt + completion tokens a minute, from usage
    models: [llama, qwen]                   # optional: the models it may use (default: every one)
```

A key is compared in constant time: the presented key is hashed (SHA-256) and compared with every known
digest by `hmac.compare_digest`, without stopping at a match, so neither the key's content nor which
entry matched shows in the time taken. Keys never appear in a log line or an error message: problems in
the file name the entry (`tenants[1] (team-b).keys[0]`), not the key. A key is at least 16 characters.

The file is re-read when it changes (a Kubernetes Secret volume is updated in place); a broken edit is
logged and the previous tenants are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

MIN_KEY_LENGTH = 16
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})$")
_TENANT_KEYS = {"name", "keys", "requestsPerSecond", "burst", "tokensPerMinute", "models"}


class ApiKeysError(ValueError):
    """The API keys file is invalid; the message names the entry, never a key."""


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_second: float | None = None
    burst: float | None = None
    tokens_per_minute: float | None = None
    models: frozenset[str] | None = None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _limit(value: Any, where: str, *, minimum: float = 0.0) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= minimum:
        raise ApiKeysError(f"{where}: expected a number > {minimum:g}")
    return float(value)


def _parse_tenant(entry: Any, i: int, seen: dict[bytes, str]) -> tuple[Tenant, list[bytes]]:
    where = f"tenants[{i}]"
    if not isinstance(entry, Mapping):
        raise ApiKeysError(f"{where}: expected a mapping with `name` and `keys`")
    unknown = set(entry) - _TENANT_KEYS
    if unknown:
        raise ApiKeysError(f"{where}: unknown key(s) {sorted(map(str, unknown))}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiKeysError(f"{where}.name: 1-63 letters, digits, '.', '_' or '-', starting alphanumeric")
    where = f"tenants[{i}] ({name})"
    keys = entry.get("keys")
    if not isinstance(keys, list) or not keys:
        raise ApiKeysError(f"{where}.keys: a non-empty list of keys is required")
    digests: list[bytes] = []
    for j, key in enumerate(keys):
        at = f"{where}.keys[{j}]"
        if not isinstance(key, str):
            raise ApiKeysError(f"{at}: expected a string")
        m = _DIGEST.match(key.strip())
        if m:
            d = bytes.fromhex(m.group(1))
        elif len(key) < MIN_KEY_LENGTH or key != key.strip() or any(c.isspace() for c in key):
            raise ApiKeysError(
                f"{at}: a key must be at least {MIN_KEY_LENGTH} characters without spaces "
                "(or sha256:<64 hex digits>)"
            )
        else:
            d = digest(key)
        if d in seen:
            raise ApiKeysError(f"{at}: the same key is already listed at {seen[d]}")
        seen[d] = at
        digests.append(d)
    models = entry.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ApiKeysError(f"{where}.models: expected a list of model names")
        models = frozenset(models)
    rps = _limit(entry.get("requestsPerSecond"), f"{where}.requestsPerSecond")
    burst = _limit(entry.get("burst"), f"{where}.burst", minimum=0.0)
    if burst is not None and rps is None:
        raise ApiKeysError(f"{where}.burst: only with requestsPerSecond")
    if burst is not None and burst < 1:
        raise ApiKeysError(f"{where}.burst: must be >= 1")
    tenant = Tenant(
        name=name,
        requests_per_second=rps,
        burst=burst if burst is not None else (max(1.0, rps) if rps is not None else None),
        tokens_per_minute=_limit(entry.get("tokensPerMinute"), f"{where}.tokensPerMinute"),
        models=models,
    )
    return tenant, digests


class KeyRing:
    """Digests of every key, and the tenant each one belongs to."""

    def __init__(self, entries: Sequence[tuple[bytes, Tenant]]) -> None:
        self._entries = list(entries)
        self.tenants = {t.name: t for _, t in self._entries}

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None; constant time in the key and the matching entry."""
        presented = digest(key)
        found: Tenant | None = None
        for d, tenant in self._entries:
            if hmac.compare_digest(d, presented):
                found = tenant
        return found


def parse_api_keys(data: Any) -> KeyRing:
    """The parsed YAML document -> KeyRing; raises ApiKeysError naming the offending entry."""
    if not isinstance(data, Mapping) or set(data) - {"tenants"}:
        raise ApiKeysError("the top level must be a mapping with a `tenants` list")
    items = data.get("tenants")
    if not isinstance(items, list) or not items:
        raise ApiKeysError("`tenants` must be a non-empty list of {name, keys, ...}")
    seen: dict[bytes, str] = {}
    names: set[str] = set()
    entries: list[tuple[bytes, Tenant]] = []
    for i, entry in enumerate(items):
        tenant, digests = _parse_tenant(entry, i, seen)
        if tenant.name in names:
            raise ApiKeysError(f"tenants[{i}] ({tenant.name}): the name is listed twice")
        names.add(tenant.name)
        entries.extend((d, tenant) for d in digests)
    return KeyRing(entries)


def load_api_keys(path: str | Path) -> tuple[KeyRing, str]:
    """Read and parse the file: the key ring and the text it came from; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ApiKeysError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_api_keys_text(text, path), text


def parse_api_keys_text(text: str, path: str | Path = "<api keys>") -> KeyRing:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        # The parser's message quotes the offending line, which may hold a key: say where only.
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ApiKeysError(f"{path}: not valid YAML{at}") from None
    try:
        return parse_api_keys(data)
    except ApiKeysError as e:
        raise ApiKeysError(f"{path}: {e}") from None


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


class ApiKeys:
    """The current key ring, re-read from its file when the file changes."""

    def __init__(self, path: str | Path, reload_seconds: float = 5.0) -> None:
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self.ring, self._text = load_api_keys(self.path)  # a bad file at start-up is fatal
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0

    async def start(self, table: Any = None) -> None:
        log.info("API keys %s: %d tenant(s)", self.path, len(self.ring.tenants))
        if self.reload_seconds > 0:
            self._task = asyncio.create_task(self._poll(), name="vsurge-router-api-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.reload_seconds)
            try:
                text = self.path.read_text(encoding="utf-8")
            except OSError as e:
                log.warning("API keys %s: cannot read (%s); keeping the previous keys", self.path, e.strerror)
                continue
            if text == self._text:
                continue
            self._text = text
            try:
                ring = parse_api_keys_text(text, self.path)
            except ApiKeysError as e:
                log.error("%s; keeping the previous keys", e)
                continue
            self.ring = ring
            self.reloads += 1
            log.info("API keys %s reloaded: %d tenant(s)", self.path, len(ring.tenants))
