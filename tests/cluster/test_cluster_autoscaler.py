"""The built-in autoscaler on a real cluster, scraping a real `vsurge serve` (tiny model) at its pod IP.

The model's first pod gets the IP where the server listens (127.0.0.X, ports 11556/11557 as in the pod
spec); the operator lists the pods by label selector from the real server, scrapes podIP:11557/metrics,
and writes replicas through the scale subresource; the Deployment and the controller-manager follow.
Load is real: four clients keep the server's four decode slots busy.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from clusterkit import IM, Kubelet, events, inference_model, start_operator, wait_for

from vsurge_operator import kube

pytestmark = pytest.mark.timeout(300)


def test_autoscaler_scales_on_real_slot_occupancy(k8s, namespace, tmp_path, tiny_server):
    api = k8s.kube()
    first: list[str] = []

    def ip_for(pod):
        if not first:  # the model's first pod is where the real server listens
            first.append(pod["metadata"]["name"])
            return tiny_server.ip
        return None

    kubelet = Kubelet(api, namespace, ip_for=ip_for).start()
    op = start_operator(k8s.kubeconfig, tmp_path / "operator.log", f"--namespace={namespace}")
    stop = threading.Event()
    try:
        api.create(
            IM,
            namespace,
            inference_model(
                "auto",
                namespace,
                model={"source": "default", "servedName": tiny_server.served_name},
                autoscaling={
                    "enabled": True,
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "target": 0.5,
                    "intervalSeconds": 1,
                    "scaleDownStabilizationSeconds": 3,
                    "policyPeriodSeconds": 1,
                },
            ),
        )

        def status():
            return (api.get(IM, namespace, "auto") or {}).get("status") or {}

        # Idle: the operator reads 0 from the real /metrics and keeps the minimum.
        st = wait_for(lambda: (s := status()).get("occupancy") == 0 and s, 30, message="occupancy 0 scraped")
        assert st["autoscaler"]["currentValue"] == 0 and st["autoscaler"]["desiredReplicas"] == 1

        # Load: four streams of 40 tokens each, over and over -> occupancy near 1 -> two replicas.
        def client():
            with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
                while not stop.is_set():
                    http.post(
                        "/v1/completions",
                        json={"model": "auto", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True},
                    )

        workers = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for w in workers:
            w.start()
        wait_for(
            lambda: (api.get(IM, namespace, "auto") or {}).get("spec", {}).get("replicas") == 2,
            40,
            message="scaled up",
        )
        wait_for(
            lambda: api.get(kube.DEPLOYMENT, namespace, "auto")["spec"]["replicas"] == 2,
            10,
            message="Deployment 2",
        )
        wait_for(
            lambda: len(api.list(kube.POD, namespace, "vsurge.io/model=auto")) == 2, 10, message="second pod"
        )
        # kopf posts the event from its own queue, after the scale patch: wait for it, do not read once.
        scale_up = wait_for(lambda: events(api, namespace, "ScaledUp"), 10, message="ScaledUp event")
        assert "1 -> 2" in scale_up[0]["message"], scale_up
        measured = float(scale_up[0]["message"].split("slotOccupancy ")[1].split()[0])
        assert measured > 0.55, scale_up[0]["message"]  # the real server's slots were busy

        # Load gone: back to one replica after the 3 s window (the second pod, without a server, counts
        # as at target when scaling down, and the measured one reads 0).
        stop.set()
        for w in workers:
            w.join(30)
        t0 = time.monotonic()
        wait_for(
            lambda: (api.get(IM, namespace, "auto") or {}).get("spec", {}).get("replicas") == 1,
            40,
            message="scaled down",
        )
        assert time.monotonic() - t0 >= 1.5
        wait_for(
            lambda: (
                len(
                    [
                        p
                        for p in api.list(kube.POD, namespace, "vsurge.io/model=auto")
                        if not p["metadata"].get("deletionTimestamp")
                    ]
                )
                == 1
            ),
            20,
            message="one pod",
        )
        wait_for(lambda: events(api, namespace, "ScaledDown"), 10, message="ScaledDown event")
        assert not kubelet.errors
    finally:
        stop.set()
        op.stop()
        kubelet.stop()
