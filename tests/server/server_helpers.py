"""Helpers for the server tests (a module of its own: `conftest` names collide across test folders)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import time

from patience import ceiling, note_slow

MODEL = "tiny"
# Small shapes: compile in seconds on two CPU cores, still room for 150-token generations.
MAX_LENGTH = 192
PREFILL_LENGTHS = [32, 64]
SLOTS = 8
# Small on purpose, so a burst can fill it and the 429 path is reachable in a test.
MAX_QUEUE = 8


def make_surge(model_dir: str, **kw):
    """The suite's vDriver vSurge over ``model_dir`` (its shapes), with engine options ``kw`` on top."""
    import vsurge
    from vsurge import vSurge

    model, processor = vsurge.load_model(model_dir)
    return vSurge.create_vdriver(
        model,
        processor,
        max_concurrent_decodes=SLOTS,
        prefill_lengths=PREFILL_LENGTHS,
        max_length=MAX_LENGTH,
        vsurge_name=MODEL,
        max_queue_size=MAX_QUEUE,
        **kw,
    )


def make_odriver_surge(model_dir: str, **kw):
    """The suite's lengths on the paged driver, with few programs to compile: 4 slots (one row bucket),
    pages of 16 tokens, 64 tokens a step."""
    import vsurge
    from vsurge import vSurge

    model, processor = vsurge.load_model(model_dir)
    return vSurge.create_odriver(
        model,
        processor,
        max_concurrent_decodes=4,
        prefill_lengths=PREFILL_LENGTHS,
        max_length=MAX_LENGTH,
        page_size=16,
        vsurge_name=MODEL,
        max_queue_size=MAX_QUEUE,
        **{"max_num_batched_tokens": 64, **kw},
    )


def serve_surge(surge, timeout: float = 600):
    """A real server (uvicorn on loopback, warmed up) over ``surge``, which it owns: stop() stops both."""
    from vsurge.server import start, vSurgeApiServer

    running = start(
        vSurgeApiServer({MODEL: surge}),
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        warm_up=True,
        progress=None,
    )
    running.wait_ready(timeout)
    return running


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    """Poll until predicate() is truthy; returns its value or fails with the last one. ``timeout`` is what
    an idle machine needs; the wait gives up at patience.ceiling(timeout)."""
    start = time.monotonic()
    value = predicate()
    while not value and time.monotonic() < start + ceiling(timeout):
        time.sleep(interval)
        value = predicate()
    assert value, f"condition not met within {ceiling(timeout):g}s"
    note_slow(time.monotonic() - start, timeout, getattr(predicate, "__name__", ""))
    return value


def self_signed_cert(directory) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 / localhost, made with `cryptography` (no openssl CLI)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vsurge-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path = os.path.join(directory, "key.pem")
    cert_path = os.path.join(directory, "cert.pem")
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path
