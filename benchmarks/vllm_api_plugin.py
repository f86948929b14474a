"""A pytest plugin, loaded into vLLM's own test run by benchmarks/vllm_api_tests.py, that points vLLM's
OpenAI-API tests at ``vsurge serve`` instead of ``vllm serve``.

It runs inside vLLM's virtual environment (vLLM's tests import vLLM's helpers), so it imports nothing of
vSurge: the server is a subprocess. What it changes, and why each change keeps the tests' meaning:

- ``tests.utils.RemoteOpenAIServer`` starts ``vsurge serve`` on the model the launcher chose, served under
  the test's own model name (the tests send ``model=MODEL_NAME``); the vLLM flags with a vSurge equivalent
  are translated (port, seed, context, LoRA modules, API key, tool parser), the rest are listed in the
  server's log and dropped. No model download, no GPU-memory wait (there is no GPU).
- ``vllm.tokenizers.get_tokenizer`` of a hub name loads the served model's tokenizer: the tests compare our
  ids with the tokenizer they load, so it must be the one we serve.
- ``hf_api().snapshot_download`` (the LoRA fixtures) answers with a random PEFT adapter written for the
  served model's shapes: vLLM's adapters are for its own test models.

Configured by the launcher through the environment: VSURGE_API_TESTS_CMD (the server's argv prefix, JSON),
VSURGE_API_TESTS_MODEL (a Hugging Face directory both sides read), VSURGE_API_TESTS_LOGS (a directory for
the servers' output), VSURGE_API_TESTS_SERVE_ARGS (more serve flags, JSON), VSURGE_API_TESTS_MAX_CONTEXT (a
cap on the tests' --max-model-len), VSURGE_API_TESTS_START_S (how long a server may take to be ready).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# vLLM flag -> vSurge flag, for flags that take a value and mean the same thing.
SAME_MEANING = {
    "--port": "--port",
    "--host": "--host",
    "--seed": "--seed",
    "--api-key": "--api-key",
    "--tool-call-parser": "--tool-call-parser",
    "--max-lora-rank": "--max-lora-rank",
}
TOOL_PARSERS = {"hermes", "llama3_json", "mistral"}


def _env_json(name: str, default: Any) -> Any:
    raw = os.environ.get(name)
    return json.loads(raw) if raw else default


def translate(model_name: str, vllm_args: list[str]) -> tuple[list[str], list[str]]:
    """The ``vsurge serve`` flags for a test's ``vllm serve MODEL ARGS``, and the vLLM flags dropped."""
    out = ["--served-model-name", model_name, "--metrics-port", "-1", "--drain-timeout", "5"]
    dropped: list[str] = []
    i = 0
    while i < len(vllm_args):
        flag = vllm_args[i]
        value = vllm_args[i + 1] if i + 1 < len(vllm_args) and not vllm_args[i + 1].startswith("--") else None
        name, eq, inline = flag.partition("=")
        if eq:
            value, flag = inline, name
        step = 1 if eq or value is None else 2
        if flag in SAME_MEANING and value is not None:
            if flag != "--tool-call-parser" or value in TOOL_PARSERS:
                out += [SAME_MEANING[flag], value]
            else:
                dropped += [flag, value]
        elif flag == "--max-model-len" and value is not None:
            cap = int(os.environ.get("VSURGE_API_TESTS_MAX_CONTEXT") or 0)
            out += ["--max-length", str(min(int(value), cap) if cap else int(value))]
        elif flag == "--served-model-name" and value is not None:
            out[1] = value
        elif flag == "--lora-modules":
            # one or more NAME=PATH (or JSON objects) follow the flag
            j = i + 1
            while j < len(vllm_args) and not vllm_args[j].startswith("--"):
                item = vllm_args[j]
                if item.startswith("{"):
                    spec = json.loads(item)
                    item = f"{spec['name']}={spec['path']}"
                out += ["--lora", item]
                j += 1
            step = j - i
        else:
            dropped += [flag] + ([value] if value is not None and not eq else [])
        i += step
    return out, dropped


def write_adapter(model_dir: str, directory: str, rank: int = 8) -> str:
    """A PEFT LoRA adapter (q and v projections, small random A and B) for the model in ``model_dir``."""
    import numpy as np
    from safetensors.numpy import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    rng = np.random.RandomState(1)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * rng.randn(rank, hidden)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.randn(width, rank)).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs)}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return directory


class _Adapters:
    """Stands in for huggingface_hub's HfApi in the tests' LoRA fixtures: one local adapter per repo id."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.root = tempfile.mkdtemp(prefix="vsurge-api-tests-lora-")

    def snapshot_download(self, repo_id: str, **_: Any) -> str:
        path = os.path.join(self.root, repo_id.replace("/", "--"))
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            write_adapter(self.model_dir, path)
        return path


def _patch_launcher(model_dir: str) -> None:
    import tests.utils as vllm_test_utils

    cmd = _env_json("VSURGE_API_TESTS_CMD", None)
    if not cmd:
        raise RuntimeError(
            "VSURGE_API_TESTS_CMD is not set: run this plugin through benchmarks/vllm_api_tests.py"
        )
    logs = os.environ.get("VSURGE_API_TESTS_LOGS") or tempfile.mkdtemp(prefix="vsurge-api-tests-")
    extra = _env_json("VSURGE_API_TESTS_SERVE_ARGS", [])
    counter = {"n": 0}

    def start_server(
        self: Any, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None
    ) -> None:
        args, dropped = translate(model, vllm_serve_args)
        env = os.environ.copy()
        env.pop("PYTHONPATH", None)  # vLLM's test tree must not shadow the server's modules
        env.update(env_dict or {})
        counter["n"] += 1
        log_path = os.path.join(logs, f"server-{os.getpid()}-{counter['n']}.log")  # one pytest per file
        # the served model linked under the test's model name (a local copy of that hub id), so the model
        # card's root is the name the test gave, as vLLM answers
        links = tempfile.mkdtemp(prefix="vsurge-api-tests-models-")
        os.makedirs(os.path.join(links, os.path.dirname(model)), exist_ok=True)
        os.symlink(model_dir, os.path.join(links, model))
        argv = [*cmd, "serve", "--model", model, *args, *extra]
        log = open(log_path, "w")  # noqa: SIM115 - the server writes to it for as long as it runs
        log.write(f"# {' '.join(argv)}\n# vLLM flags without a vSurge meaning, dropped: {dropped}\n")
        log.flush()
        print(f"[vsurge] {' '.join(argv)} (log: {log_path}; dropped: {dropped})", file=sys.stderr)
        self.proc = subprocess.Popen(
            argv, cwd=links, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_for_server(self: Any, *, url: str, timeout: float) -> None:
        # vLLM listens only once its engine runs, so its /health answering means ready; vsurge serve answers
        # /health while it compiles, and says ready on /readiness (docs/api.md's probes)
        import requests

        ready, start = url.rsplit("/", 1)[0] + "/readiness", time.time()
        # compiling every program on a busy CPU can outlast vLLM's 480 s default
        timeout = max(timeout, float(os.environ.get("VSURGE_API_TESTS_START_S", "1800")))
        while True:
            try:
                if requests.get(ready, timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self._poll() is not None:
                raise RuntimeError(f"vsurge serve exited with {self._poll()} (log in {logs})")
            if time.time() - start > timeout:
                raise RuntimeError(f"vsurge serve not ready in {timeout:.0f} s (log in {logs})")
            time.sleep(1.0)

    cls = vllm_test_utils.RemoteOpenAIServer
    cls._start_server = start_server
    cls._wait_for_server = wait_for_server
    cls._pre_download_model = lambda self, model, args: None
    cls._get_gpu_memory_used = lambda self: None
    cls._wait_for_gpu_memory_release = lambda self, *a, **k: None


def _patch_tokenizers(model_dir: str) -> None:
    import vllm.tokenizers as tokenizers
    import vllm.tokenizers.registry as registry

    original = registry.get_tokenizer

    def get_tokenizer(tokenizer_name: Any = None, *args: Any, **kwargs: Any) -> Any:
        if tokenizer_name is None or not os.path.isdir(str(tokenizer_name)):
            tokenizer_name = model_dir
        return original(tokenizer_name, *args, **kwargs)

    registry.get_tokenizer = get_tokenizer
    tokenizers.get_tokenizer = get_tokenizer


def _patch_adapters(model_dir: str) -> None:
    import vllm.transformers_utils.repo_utils as repo_utils

    adapters = _Adapters(model_dir)
    repo_utils.hf_api = lambda *a, **k: adapters


def pytest_configure(config: Any) -> None:
    model_dir = os.environ.get("VSURGE_API_TESTS_MODEL")
    if not model_dir:
        raise RuntimeError(
            "VSURGE_API_TESTS_MODEL is not set: run this plugin through benchmarks/vllm_api_tests.py"
        )
    root = str(config.rootpath)
    if root not in sys.path:
        sys.path.insert(0, root)
    _patch_launcher(model_dir)
    _patch_tokenizers(model_dir)
    _patch_adapters(model_dir)
