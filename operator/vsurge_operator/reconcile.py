"""One reconcile pass: validate, build the desired objects, apply them, write status.

Framework-free (no kopf here) so that it can be driven by kopf handlers, by a timer, or directly in
tests. Errors from the API escape to the caller, which decides about retrying; ``report_failure``
records them in status and as an Event first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from vsurge_operator import (
    access,
    apply,
    compile_cache,
    disruption,
    gateway,
    kube,
    lane,
    manifests,
    model_secrets,
    status,
    tracing,
    validation,
)
from vsurge_operator import spec as specmod
from vsurge_operator.config import OperatorConfig

logger = logging.getLogger(__name__)

# (body, type "Normal"/"Warning", reason, message) -> post a Kubernetes Event about the object.
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def _no_events(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    logger.info("event %s %s: %s", type_, reason, message)


class MissingApi(Exception):
    """A resource kind the model needs is not installed in the cluster."""


# kinds of other projects' CRDs, and what to install when the cluster does not serve them
_OTHER_PROJECTS = {
    "LeaderWorkerSet": "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) is not served by this cluster; "
    "install LWS to run multi-host TPU slices",
    "InferencePool": "InferencePool (inference.networking.k8s.io/v1) is not served by this cluster; install "
    "the Gateway API Inference Extension's CRDs, or set spec.gateway.inferencePool to false",
}


@dataclass
class Outcome:
    applied: list[apply.Applied] = field(default_factory=list)
    errors: list[validation.FieldError] = field(default_factory=list)
    status_patch: dict[str, Any] | None = None
    removed: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(a.action != "unchanged" for a in self.applied) or bool(self.removed)


def _ident(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata", {})
    return meta.get("namespace", "default"), meta.get("name", "")


class Reconciler:
    def __init__(self, api: kube.Kube, config: OperatorConfig, events: EventSink | None = None) -> None:
        self.api = api
        self.config = config
        self.events = events if events is not None else _no_events

    def reconcile(self, body: Mapping[str, Any], *, trigger: str = "event") -> Outcome:
        namespace, name = _ident(body)
        with tracing.span(
            "vsurge.reconcile",
            {"k8s.namespace.name": namespace, "vsurge.model": name, "vsurge.reconcile.trigger": trigger},
        ) as span:
            outcome = self._reconcile(body)
            span.set_attribute("vsurge.reconcile.changed", outcome.changed)
            span.set_attribute("vsurge.reconcile.valid", not outcome.errors)
            return outcome

    def _reconcile(self, body: Mapping[str, Any]) -> Outcome:
        namespace, name = _ident(body)
        previous = body.get("status") or {}
        now = status.now_rfc3339()
        generation = int(body.get("metadata", {}).get("generation", 0) or 0)

        errors = validation.validate(body, default_image=self.config.model_images())
        if errors:
            # Nothing is created or changed for an invalid spec; pods of an earlier valid spec keep serving.
            message = validation.format_errors(errors)
            new = status.failed(previous, generation, "InvalidSpec", message, now, invalid=True)
            patch = self._write_status(body, new)
            if patch is not None:
                self.events(body, "Warning", "InvalidSpec", message)
            return Outcome(errors=errors, status_patch=patch)

        model = specmod.parse(body, default_image=self.config.model_images())
        model = compile_cache.with_default(model, self.config.compile_cache_access_mode)
        outcome = Outcome()
        try:  # Secrets: only where the chart's Roles grant them (secretNamespaces / watchNamespaces)
            lane_version = lane.ensure_secret(self.api, model) if model.multi_host else None
            model_secrets.ensure_cache_key(self.api, model)
        except ApiException as e:
            if e.status == 403:
                raise model_secrets.SecretsForbidden(namespace) from e
            raise
        reach, pool = self.surroundings()
        desired = manifests.desired_objects(model, lane_version, reach=reach, pool=pool)
        for obj in desired:
            try:
                applied = apply.ensure(self.api, obj, model.uid)
            except ApiException as e:
                if e.status == 404 and obj["kind"] in _OTHER_PROJECTS:
                    raise MissingApi(_OTHER_PROJECTS[obj["kind"]]) from e
                raise
            outcome.applied.append(applied)
            if applied.action != "unchanged":
                verb = "Created" if applied.action == "created" else "Updated"
                self.events(body, "Normal", verb, f"{verb} {applied.kind} {applied.name}")

        # The workload kind changed (topology moved between one host and several): remove the old one.
        old_kind = previous.get("workloadKind")
        new_kind = outcome.applied[0].kind
        stale = old_kind and old_kind != new_kind and old_kind in kube.BY_KIND
        if stale and apply.remove_if_controlled(self.api, kube.BY_KIND[old_kind], namespace, name, model.uid):
            outcome.removed.append(old_kind)
            self.events(body, "Normal", "Deleted", f"Deleted {old_kind} {name} (replaced by {new_kind})")
        if stale and not model.multi_host:  # one host now: no step lane
            for kind in lane.remove(self.api, model):
                outcome.removed.append(kind)
                self.events(
                    body, "Normal", "Deleted", f"Deleted {kind} {lane.name(model)} (one host: no lane)"
                )

        for kind, name_ in self._leftovers(model, desired):
            outcome.removed.append(kind)
            self.events(body, "Normal", "Deleted", f"Deleted {kind} {name_} (no longer wanted)")

        pods = self._pods(model)
        new = status.reconciled(model, outcome.applied[0].live, previous, now, pods)
        outcome.status_patch = self._write_status(body, new)
        degraded = status.source_error(pods)
        was = next((c for c in previous.get("conditions") or [] if c.get("type") == status.DEGRADED), {})
        if degraded and (was.get("reason"), was.get("message")) != (status.MODEL_SOURCE_ERROR, degraded):
            self.events(body, "Warning", status.MODEL_SOURCE_ERROR, degraded)
        # the pod watch records a group failure with its Event; when this pass sees the pod first, the watch
        # finds it recorded and stays silent, so the Event is posted here
        failure = (new.get("lastGroupFailure") or {}).get("message")
        if failure and failure != (previous.get("lastGroupFailure") or {}).get("message"):
            self.events(body, "Warning", lane.GROUP_FAILED, failure)
        return outcome

    def surroundings(self) -> tuple[access.Access, gateway.PoolDefaults]:
        """The operator's settings for the model policies and pools (config.py)."""
        c = self.config
        reach = access.Access(
            enabled=c.network_policy,
            serving_namespaces=c.serving_from_namespaces,
            serving_cidrs=c.serving_from_cidrs,
            metrics_namespaces=c.metrics_from_namespaces,
            operator_namespace=c.namespace,
        )
        pool = gateway.PoolDefaults(
            c.inference_pool, c.endpoint_picker, c.endpoint_picker_port, c.endpoint_picker_failure_mode
        )
        return reach, pool

    def _leftovers(self, model: specmod.ModelSpec, desired: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Delete what the model no longer wants and we control: its pool or policy (turned off), the
        budgets of groups scaled away."""
        have = {(o["kind"], o["metadata"]["name"]) for o in desired}
        out = []
        for res in (kube.INFERENCE_POOL, kube.NETWORK_POLICY):
            if (res.kind, model.name) in have:
                continue
            try:
                if apply.remove_if_controlled(self.api, res, model.namespace, model.name, model.uid):
                    out.append((res.kind, model.name))
            except ApiException as e:
                if e.status not in (403, 404):  # not served (no GIE CRDs) or not ours to read: nothing to do
                    raise
        live = self.api.list(kube.PDB, model.namespace, label_selector=manifests.selector_string(model))
        for name in disruption.stale(model, live):
            if self.api.delete(kube.PDB, model.namespace, name):
                out.append((kube.PDB.kind, name))
        return out

    def _pods(self, model: specmod.ModelSpec) -> list[dict[str, Any]] | None:
        """The model's pods (for their termination messages); None when they cannot be read."""
        want = manifests.selector_labels(model)
        try:
            items = self.api.list(kube.POD, model.namespace, label_selector=manifests.selector_string(model))
        except ApiException as e:
            logger.debug("could not list the pods of %s: %s", model.name, describe(e))
            return None
        labels = lambda p: (p.get("metadata") or {}).get("labels") or {}
        return [p for p in items if all(labels(p).get(k) == v for k, v in want.items())]

    def _write_status(self, body: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
        patch = status.status_patch(body.get("status"), new)
        if patch is None:
            return None
        namespace, name = _ident(body)
        try:
            self.api.patch(kube.INFERENCE_MODEL, namespace, name, {"status": patch}, subresource="status")
        except ApiException as e:
            if e.status == 404:  # deleted meanwhile; nothing to report on
                return None
            raise
        return patch

    def report_failure(self, body: Mapping[str, Any], exc: BaseException) -> None:
        """Mark Degraded and post a Warning Event; best effort, never raises."""
        if isinstance(exc, apply.OwnershipConflict):
            reason = "OwnershipConflict"
        elif isinstance(exc, MissingApi):
            reason = "MissingApi"
        elif isinstance(exc, model_secrets.SecretsForbidden):
            reason = "SecretsForbidden"
        elif isinstance(exc, ApiException):
            reason = "ApiError"
        else:
            reason = "ReconcileError"
        message = describe(exc)
        try:
            self.events(body, "Warning", reason, message)
        except Exception:  # events are advisory; the status below matters more
            logger.exception("could not post an event")
        generation = int(body.get("metadata", {}).get("generation", 0) or 0)
        new = status.failed(
            body.get("status"), generation, reason, message, status.now_rfc3339(), invalid=False
        )
        try:
            self._write_status(body, new)
        except Exception as e:  # the API is failing already; the retry will try again
            logger.warning("could not record the failure in status: %s", describe(e))


def describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"Kubernetes API returned {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"[:500]
