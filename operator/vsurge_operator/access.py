"""Who may reach a model's pods: the NetworkPolicy ``<model>`` the operator renders for every model.

With the operator's ``--network-policy`` (the chart's ``networkPolicy.enabled``, on by default) each
model's pods admit, and nothing else:

- the ``http`` port (11556) from the namespaces that send requests: the router's and the endpoint
  picker's (the chart's release namespace), the Gateway's (``networkPolicy.servingFromNamespaces``),
  and the address ranges of proxies that are not pods (``networkPolicy.servingFromCIDRs``: e.g. a GKE
  Gateway's proxy-only subnet);
- the ``metrics`` port (11557) from the monitoring namespaces (``networkPolicy.metricsFromNamespaces``);
- both from the operator's own namespace (the autoscaler reads ``/metrics``, the status ``/v1/models``);
- a multi-host model's own pods on any port (the step lane and the coordinator: lane.py's policy).

NetworkPolicies add up: a pod is reachable from what any policy selecting it admits, so the lane's policy
admits only the group's own pods when this one is rendered. A CNI without NetworkPolicy support ignores
both (the pods' own API key, spec.apiKeySecret, still holds there). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vsurge_operator import labels
from vsurge_operator.spec import HTTP_PORT, METRICS_PORT, ModelSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.21+)


@dataclass(frozen=True)
class Access:
    """The operator's settings for the model policies (OperatorConfig)."""

    enabled: bool = False
    serving_namespaces: tuple[str, ...] = ()
    serving_cidrs: tuple[str, ...] = ()
    metrics_namespaces: tuple[str, ...] = ()
    operator_namespace: str | None = None


def _namespaces(names: Sequence[str]) -> list[dict[str, Any]]:
    if not names:
        return []
    values = sorted(dict.fromkeys(names))
    return [
        {
            "namespaceSelector": {
                "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": values}]
            }
        }
    ]


def _rule(peers: list[dict[str, Any]], port: int) -> list[dict[str, Any]]:
    # a rule with no peers would admit everyone: a port nobody is named for gets no rule (closed)
    return [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}] if peers else []


def network_policy(model: ModelSpec, access: Access) -> dict[str, Any] | None:
    if not access.enabled:
        return None
    own = [access.operator_namespace] if access.operator_namespace else []
    serving = _namespaces([*access.serving_namespaces, *own])
    serving += [{"ipBlock": {"cidr": c}} for c in access.serving_cidrs]
    metrics = _namespaces([*access.metrics_namespaces, *own])
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": labels.owned_metadata(model),
        "spec": {
            "podSelector": {"matchLabels": labels.selector_labels(model)},
            "policyTypes": ["Ingress"],
            "ingress": _rule(serving, HTTP_PORT) + _rule(metrics, METRICS_PORT),
        },
    }
