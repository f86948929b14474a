"""Secrets a model's pods read from the environment: the compile cache's signing key (made by the operator)
and the model's own API key (the user's Secret, spec.apiKeySecret).

- ``<model>-cache-key``: with a compile cache mounted, every pod signs what it writes there and checks
  what it reads (`vsurge serve`'s executable store, ``VSURGE_CACHE_HMAC_KEY``), so a file written by
  anything without the key is refused before it is deserialized. The operator creates the Secret once,
  owned by the model (48 random bytes; never rewritten: delete it to rotate, files signed with the old
  key are then compiled over) and passes it as that variable from the Secret.
- ``VSURGE_API_KEY`` from ``spec.apiKeySecret`` (``{name, key}``): the pods refuse requests without it;
  the router reads the same Secret and sends it. The operator never reads that Secret.
- ``VSURGE_ADMIN_KEY`` from ``spec.adminKeySecret``: the admin routes' own key (runtime LoRA loading),
  which neither the router nor a tenant holds.

The operator's RBAC on Secrets is ``get`` and ``create`` in the namespaces it manages, and it only ever
reads Secrets it created (``ensure`` refuses one of that name it does not control). Pure builders, and
``ensure`` which takes the API.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from vsurge_operator import apply, kube, labels
from vsurge_operator.spec import ModelSpec

CACHE_KEY_SUFFIX = "-cache-key"
CACHE_KEY = "hmac.key"
CACHE_KEY_ENV = "VSURGE_CACHE_HMAC_KEY"
API_KEY_ENV = "VSURGE_API_KEY"
ADMIN_KEY_ENV = "VSURGE_ADMIN_KEY"
KEY_BYTES = 48


class SecretsForbidden(Exception):
    """The operator may not create or read Secrets in the model's namespace (its RBAC grants Secrets only
    in the chart's secretNamespaces, or the watched namespaces)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(
            f"the operator may not create or read Secrets in namespace {namespace} (a multi-host model's lane "
            f"Secret, a compile cache's signing key): add {namespace} to the chart's secretNamespaces, or to "
            "watchNamespaces"
        )
        self.namespace = namespace


def cache_key_name(model: ModelSpec) -> str:
    return f"{model.name}{CACHE_KEY_SUFFIX}"


def cache_key_secret(model: ModelSpec, data: bytes | None = None) -> dict[str, Any]:
    """The signing key's Secret, with fresh random bytes (as base64 text) unless ``data`` is given."""
    text = data if data is not None else base64.b64encode(secrets.token_bytes(KEY_BYTES))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": labels.owned_metadata(model, cache_key_name(model)),
        "type": "Opaque",
        "data": {CACHE_KEY: base64.b64encode(text).decode()},
    }


def ensure_cache_key(api: kube.Kube, model: ModelSpec) -> None:
    """Create the signing key's Secret when the model has a compile cache and it is missing (never rewrite
    it: the cache's files are signed with it). OwnershipConflict when a Secret of that name is not ours."""
    if model.compile_cache is None:
        return
    live = api.get(kube.SECRET, model.namespace, cache_key_name(model))
    if live is None:
        api.create(kube.SECRET, model.namespace, cache_key_secret(model))
    elif not apply.controlled_by(live, model.uid):
        raise apply.OwnershipConflict("Secret", cache_key_name(model))


def _from_secret(env: str, name: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}


def env(model: ModelSpec) -> list[dict[str, Any]]:
    """The pods' variables from these Secrets."""
    out = []
    if model.compile_cache is not None:
        out.append(_from_secret(CACHE_KEY_ENV, cache_key_name(model), CACHE_KEY))
    if model.api_key_secret is not None:
        out.append(_from_secret(API_KEY_ENV, model.api_key_secret.name, model.api_key_secret.key))
    if model.admin_key_secret is not None:
        out.append(_from_secret(ADMIN_KEY_ENV, model.admin_key_secret.name, model.admin_key_secret.key))
    return out
