"""API errors from the real server: a validating admission webhook (a real HTTPS server on loopback that
kube-apiserver calls) answers the operator's Deployment writes with 500 and 409 a few times; the server
returns those codes to the operator, which must mark Degraded/ApiError, retry, and converge with one
Deployment and no leftover error. Admission is the server's own way to fail a write, so nothing of ours is
mocked.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterkit import IM, Kubelet, condition, events, inference_model, start_operator, wait_for

from vsurge_operator import kube

WEBHOOKS = kube.Resource("admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", "X")


def _self_signed(directory: Path) -> tuple[Path, Path, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vsurge-test-webhook")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / "wh.crt").write_bytes(pem)
    (directory / "wh.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return directory / "wh.crt", directory / "wh.key", pem


class Webhook:
    """Denies the next admission requests with the queued HTTP codes, then allows everything."""

    def __init__(self, directory: Path) -> None:
        crt, key, self.ca_pem = _self_signed(directory)
        self.plan: list[tuple[str, int]] = []  # (operation, code) still to fail
        self.seen: list[tuple[str, str, int]] = []  # (operation, name, answered code)
        self.lock = threading.Lock()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                req = review["request"]
                op = req["operation"]
                with hook.lock:
                    code = 200
                    for i, (want_op, _code) in enumerate(hook.plan):
                        if want_op == op:
                            code = hook.plan.pop(i)[1]
                            break
                    hook.seen.append((op, req.get("name") or "", code))
                response = {"uid": req["uid"], "allowed": code == 200}
                if code != 200:
                    response["status"] = {"code": code, "message": f"test webhook says {code}"}
                body = json.dumps(
                    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook(k8s, tmp_path) -> Iterator[Webhook]:
    hook = Webhook(tmp_path)
    api = k8s.kube()
    name = f"vsurge-test-{hook.port}"
    api.request(
        "POST",
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "faults.vsurge.io",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{hook.port}/validate",
                        "caBundle": base64.b64encode(hook.ca_pem).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": ["apps"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["deployments"],
                        }
                    ],
                    # Only the objects of the model under test (1.20 has no kubernetes.io/metadata.name label).
                    "objectSelector": {"matchLabels": {"vsurge.io/model": "faulty"}},
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 5,
                }
            ],
        },
    )
    try:
        yield hook
    finally:
        api.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}")
        hook.close()


def test_500_and_409_from_the_server_are_retried_and_converge(k8s, namespace, tmp_path, webhook):
    api = k8s.kube()
    kubelet = Kubelet(api, namespace).start()
    webhook.plan = [("CREATE", 500), ("CREATE", 409)]
    op = start_operator(k8s.kubeconfig, tmp_path / "operator.log", f"--namespace={namespace}")
    try:
        api.create(IM, namespace, inference_model("faulty", namespace, replicas=1))
        wait_for(
            lambda: api.get(kube.DEPLOYMENT, namespace, "faulty"), 20, message="Deployment after 2 failures"
        )
        creates = [code for o, n, code in webhook.seen if o == "CREATE"]
        assert creates[:3] == [500, 409, 200], webhook.seen

        # kopf posts events from a queue of its own, after the handler returned: wait for both.
        def both_reported() -> bool:
            warnings = [e["message"] for e in events(api, namespace, "ApiError")]
            return any("500" in m for m in warnings) and any("409" in m for m in warnings)

        wait_for(both_reported, 20, message="ApiError events for the 500 and the 409")
        wait_for(
            lambda: (api.get(IM, namespace, "faulty") or {}).get("status", {}).get("readyReplicas") == 1,
            20,
            message="ready",
        )
        wait_for(
            lambda: condition(api.get(IM, namespace, "faulty"), "Degraded").get("status") == "False",
            20,
            message="recovered",
        )

        # An edit whose Deployment patch is refused twice (409, then 500) still reaches the Deployment.
        webhook.plan = [("UPDATE", 409), ("UPDATE", 500)]
        api.patch(IM, namespace, "faulty", {"spec": {"replicas": 2}})
        wait_for(
            lambda: api.get(kube.DEPLOYMENT, namespace, "faulty")["spec"]["replicas"] == 2,
            20,
            message="patched",
        )
        updates = [code for o, n, code in webhook.seen if o == "UPDATE"]
        assert updates[:3] == [409, 500, 200], webhook.seen
        wait_for(
            lambda: (api.get(IM, namespace, "faulty") or {}).get("status", {}).get("readyReplicas") == 2,
            20,
            message="2 ready",
        )
        wait_for(
            lambda: condition(api.get(IM, namespace, "faulty"), "Degraded").get("status") == "False",
            20,
            message="recovered",
        )
        assert len(api.list(kube.DEPLOYMENT, namespace)) == 1
        assert op.proc.poll() is None  # survived
    finally:
        op.stop()
        kubelet.stop()
