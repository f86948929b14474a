"""The servers `serving.py --peers` measures, one at a time: how each is found, started, awaited and stopped.

A peer is a command line that serves the OpenAI API on a loopback port, plus the path that answers 200 once
it can take requests. `discover()` turns the options into peers, or into a skip with its reason when a
binary or a model it needs is not there: peers are optional and the benchmark runs with what it finds.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

NGRAM_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", "4"]
BF16_KV_ARGS = ["--kv-cache-dtype", "bfloat16"]
BF16_ARGS = [*BF16_KV_ARGS, "--prefill-dtype", "bfloat16", "--decode-dtype", "bfloat16"]
# `vsurge serve` arguments of each vSurge server: a driver, n-gram speculative decoding (K draft tokens per
# step), a bfloat16 KV cache, bfloat16 prefill and decode matmuls as well, and combinations
VSURGE_MODES = {
    "vsurge-default": [],  # `vsurge serve` as a user starts it: slots, context and buckets its own defaults
    "vsurge-vdriver": ["--driver", "vdriver"],
    "vsurge-odriver": ["--driver", "odriver"],
    "vsurge-ngram": ["--driver", "vdriver", *NGRAM_ARGS],
    "vsurge-bf16kv": ["--driver", "vdriver", *BF16_KV_ARGS],
    "vsurge-bf16kv-ngram": ["--driver", "vdriver", *BF16_KV_ARGS, *NGRAM_ARGS],
    "vsurge-bf16": ["--driver", "vdriver", *BF16_ARGS],
    "vsurge-bf16-ngram": ["--driver", "vdriver", *BF16_ARGS, *NGRAM_ARGS],
}
SERVERS = (*VSURGE_MODES, "vllm", "llama.cpp")
# Context per sequence on every server: the longest prompt (512) + the longest answer (256) fits.
CONTEXT_PER_SEQUENCE = 1024
# Buckets up to the longest prompt (longer ones are prefilled in chunks). The default buckets run up to
# max_length itself, which a 1024 context cannot prefill (a prompt must leave room for one token);
# --vsurge-args "--prefill-lengths ..." overrides this (the last occurrence wins).
VSURGE_PREFILL_LENGTHS = "32,64,128,256,512"


@dataclass
class Peer:
    name: str
    argv: list[str]
    port: int
    ready_path: str  # GET answers 200 only once the server takes requests
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@dataclass
class Skipped:
    name: str
    reason: str


class PeerFailed(RuntimeError):
    """A peer exited or did not become ready; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vsurge_argv() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "vsurge")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from vsurge.cli.main import main; sys.exit(main())"]


# Where docs/performance.md's recipes install each peer, under the directory the reader chose as $PEERS.
PEERS_LAYOUT = {
    "vllm": os.path.join("vllm-venv", "bin", "vllm"),
    "llama-server": os.path.join("llama-build", "bin", "llama-server"),
}


def _binary(explicit: str | None, env_var: str, name: str) -> str | None:
    """An explicit path, then $ENV_VAR, then $PEERS/<the recipe's place>, then PATH; None when none of them
    names an executable."""
    peers_dir = os.environ.get("PEERS")
    in_peers = os.path.join(peers_dir, PEERS_LAYOUT[name]) if peers_dir else None
    for cand in (explicit, os.environ.get(env_var), in_peers, shutil.which(name)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def discover(opts: Any, concurrency: int) -> list[Peer | Skipped]:
    """The peers named in opts.servers, in that order, each a Peer or a Skipped with its reason.

    opts: model, servers (list), vllm, llama_server, gguf, hf_model, vsurge_args, vllm_args, llama_args
    (the extra-argument strings are split like a shell would).
    """
    out: list[Peer | Skipped] = []
    for name in opts.servers:
        if name not in SERVERS:
            out.append(Skipped(name, f"unknown server (known: {', '.join(SERVERS)})"))
        elif name.startswith("vsurge-"):
            port = free_port()
            mode = VSURGE_MODES[name]
            argv = _vsurge_argv() + [
                "serve", "--model", opts.model, *mode,
                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1",
                "--drain-timeout", "5", "--log-level", "warning",
            ]  # fmt: skip
            if name != "vsurge-default":
                argv += [
                    "--max-concurrent-decodes", str(concurrency), "--max-length", str(CONTEXT_PER_SEQUENCE),
                    "--prefill-lengths", VSURGE_PREFILL_LENGTHS,
                ]  # fmt: skip
            out.append(Peer(name, argv + shlex.split(opts.vsurge_args or ""), port, "/readiness"))
        elif name == "vllm":
            binary = _binary(opts.vllm, "VLLM_BIN", "vllm")
            if binary is None:
                out.append(
                    Skipped(
                        name,
                        "no vllm: pass --vllm PATH/bin/vllm, set VLLM_BIN or PEERS "
                        "(docs/performance.md: installing the peers)",
                    )
                )
                continue
            try:
                hf_dir = opts.hf_model or hf_model_dir(gguf_path(opts))
            except Exception as e:  # the reason goes into the table, the other servers still run
                out.append(Skipped(name, f"no HF model directory for vLLM: {type(e).__name__}: {e}"[:300]))
                continue
            port = free_port()
            argv = [
                binary, "serve", hf_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--served-model-name", "smollm2",
                # on the CPU backend this is the fraction of host memory vLLM reserves; its default (0.92)
                # refuses to start when anything else holds memory: 20% of 24 GiB holds weights + KV
                "--gpu-memory-utilization", "0.2",
            ]  # fmt: skip
            # the CPU platform even where the vllm dist-info's version lacks "+cpu" (docs/performance.md: peers)
            env = {"VLLM_TARGET_DEVICE": "cpu"}
            out.append(Peer(name, argv + shlex.split(opts.vllm_args or ""), port, "/health", env))
        else:  # llama.cpp
            binary = _binary(opts.llama_server, "LLAMA_SERVER", "llama-server")
            if binary is None:
                out.append(
                    Skipped(
                        name,
                        "no llama-server: pass --llama-server PATH, set LLAMA_SERVER or PEERS "
                        "(docs/performance.md: installing the peers)",
                    )
                )
                continue
            try:
                gguf = gguf_path(opts)
            except Exception as e:
                out.append(Skipped(name, f"no GGUF file: {type(e).__name__}: {e}"[:300]))
                continue
            port = free_port()
            argv = [
                binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(concurrency),
                "-c", str(concurrency * CONTEXT_PER_SEQUENCE),
                # one HTTP thread per stream: the default (one per core) leaves connections beyond the
                # second waiting, and the client's writes to them fail ("Can not write request body")
                "--threads-http", str(concurrency + 4),
            ]  # fmt: skip
            out.append(Peer(name, argv + shlex.split(opts.llama_args or ""), port, "/health"))
    return out


def gguf_path(opts: Any) -> str:
    """The GGUF llama.cpp loads: --gguf, else the model itself when it is a .gguf, else vSurge's default."""
    if opts.gguf:
        return opts.gguf
    if str(opts.model).endswith(".gguf"):
        return str(opts.model)
    if opts.model != "default":
        raise ValueError("--model is not a GGUF file: pass --gguf for llama.cpp and --hf-model for vLLM")
    from vsurge.models.default_model import default_model_path

    return str(default_model_path())


def hf_model_dir(gguf: str) -> str:
    """A float32 Hugging Face directory made from the GGUF (dequantised, cached beside the vSurge cache).

    vLLM loads HF checkpoints; transformers reads GGUF and writes one. Needs torch and transformers in the
    interpreter running the benchmark (the test environment has both); vSurge itself never imports them.
    """
    from vsurge.models.default_model import cache_dir

    out = cache_dir() / "bench" / (os.path.basename(gguf).removesuffix(".gguf") + "-f32-hf")
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype="float32")
    # The weights are dequantised already; without this transformers refuses to save a "gguf-quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return str(out)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the peer's process group (it may have workers), SIGKILL after grace_s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running(peer: Peer, log_dir: str, ready_timeout_s: float) -> Iterator[tuple[subprocess.Popen, float]]:
    """Start the peer (own process group, output to log_dir/<name>.log), wait until ready, stop it after.

    Yields (process, seconds to ready). Raises PeerFailed if it exits or is not ready in ready_timeout_s.
    """
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{peer.name}.log")
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            peer.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **peer.env},
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{peer.port}{peer.ready_path}"
        while not _ready(url):
            if proc.poll() is not None:
                raise PeerFailed(
                    f"{peer.name} exited with {proc.returncode} ({log_path}):\n{_tail(log_path)}"
                )
            if time.monotonic() - t0 > ready_timeout_s:
                raise PeerFailed(
                    f"{peer.name} not ready in {ready_timeout_s:.0f}s ({log_path}):\n{_tail(log_path)}"
                )
            time.sleep(0.5)
        yield proc, time.monotonic() - t0
    finally:
        stop(proc)


def _ms(d: dict[str, float | None] | None, key: str) -> str:
    if not d or d.get(key) is None:
        return "-"
    v = d[key]
    return f"{v:.2f} s" if v >= 1 else f"{v * 1000:.0f} ms"


def table(rows: list[tuple[str, dict[str, Any] | None, str]]) -> str:
    """One markdown table: (server, summary from serving.summarize or None, note) per row."""
    head = "| server | output tok/s | TTFT p50 | TPOT p50 | TTFT p99 | TPOT p99 | ok | note |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, s, note in rows:
        if s is None:
            lines.append(f"| {name} | - | - | - | - | - | - | {note} |")
            continue
        lines.append(
            f"| {name} | {s['output_token_throughput']:.1f} | {_ms(s['ttft_s'], 'p50')} | "
            f"{_ms(s['tpot_s'], 'p50')} | {_ms(s['ttft_s'], 'p99')} | {_ms(s['tpot_s'], 'p99')} | "
            f"{s['completed']}/{s['requests']} | {note} |"
        )
    return "\n".join(lines)
