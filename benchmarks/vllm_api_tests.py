"""vLLM's own OpenAI-API tests, run against ``vsurge serve`` (docs/api.md, "vLLM's API tests").

    python benchmarks/vllm_api_tests.py --vllm-src PATH [--vllm-python PY] [--junit OUT.xml] [-- PYTEST ARGS]

PATH is a vLLM source tree with its ``tests/`` (a git checkout, or the sdist unpacked:
``pip download --no-deps --no-binary :all: vllm==0.32.0`` gives ``vllm-0.32.0.tar.gz``); PY is a Python
with that vLLM installed, plus pytest, pytest-asyncio and tblib (default: ``$PEERS/vllm-venv/bin/python``,
docs/performance.md's recipe). Nothing of vLLM is copied here: pytest runs in PATH with
benchmarks/vllm_api_plugin.py loaded, which starts this checkout's ``vsurge serve`` wherever a test starts
``vllm serve`` (one server at a time, with vSurge's default slot count) on ``--model`` (default: the
float32 Hugging Face copy of the default GGUF that benchmarks/peers.py makes for vLLM; the tests load the
same tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# The files that exercise the API vSurge implements: completions (logprobs, echo, allowed_token_ids, prompt
# logprobs, streaming, n, ...), chat (structured outputs, tools, logprobs, /invocations, LoRA models),
# tokenization (/tokenize, /detokenize, /tokenizer_info), explicit logprob token ids, /v1/models.
SELECTION = [
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/entrypoints/openai/models/test_models.py",
]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def default_model() -> str:
    sys.path.insert(0, HERE)
    import peers

    class Opts:
        gguf = None
        model = "default"

    return peers.hf_model_dir(peers.gguf_path(Opts()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-src", required=True, help="a vLLM source tree (with tests/)")
    ap.add_argument("--vllm-python", help="Python with vLLM and pytest installed (default: $PEERS/vllm-venv)")
    ap.add_argument(
        "--model", help="Hugging Face model directory to serve (default: the default model's copy)"
    )
    ap.add_argument("--junit", help="write pytest's JUnit XML here (OUT-N.xml per file of the selection)")
    ap.add_argument("--logs", help="directory for the servers' logs (default: a new temporary one)")
    ap.add_argument("--timeout", type=int, default=600, help="per-test limit in seconds (pytest-timeout)")
    ap.add_argument(
        "--max-context",
        type=int,
        help="cap the tests' --max-model-len (their 8192 makes a CPU start take far longer; the tests that "
        "read max_model_len then fail)",
    )
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="one more `vsurge serve` flag (repeatable)"
    )
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: the selection)")
    args = ap.parse_args(argv)
    py = args.vllm_python or os.path.join(
        os.environ.get("PEERS", os.path.expanduser("~/peers")), "vllm-venv/bin/python"
    )
    src = os.path.abspath(args.vllm_src)
    logs = args.logs or tempfile.mkdtemp(prefix="vsurge-api-tests-")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    env.update(
        VSURGE_API_TESTS_CMD=json.dumps([sys.executable, "-m", "vsurge.cli"]),
        VSURGE_API_TESTS_MODEL=os.path.abspath(args.model or default_model()),
        VSURGE_API_TESTS_LOGS=logs,
        VSURGE_API_TESTS_SERVE_ARGS=json.dumps(args.serve_arg),
        VSURGE_API_TESTS_MAX_CONTEXT=str(args.max_context or ""),
        PYTHONPATH=HERE,  # the plugin; vLLM's tests find their own package from the rootdir
        HF_HUB_OFFLINE="1",  # every model and tokenizer the run needs is local
        VLLM_TARGET_DEVICE="cpu",
    )
    base = [py, "-m", "pytest", "-p", "vllm_api_plugin", "-p", "no:cacheprovider", "-rA", "-q"]
    # the limit is the test's own: a module's server starts in its fixture, which may compile for minutes
    base += ["--timeout", str(args.timeout), "-o", "timeout_func_only=true"]
    # one pytest per file: each file starts its own server anyway, and its results are in when it ends
    runs = [args.pytest_args] if args.pytest_args else [[f] for f in SELECTION]
    print(f"# in {src}, server logs in {logs}", flush=True)
    worst = 0
    for n, targets in enumerate(runs):
        cmd = list(base)
        if args.junit:
            stem = args.junit.removesuffix(".xml")
            cmd += ["--junitxml", os.path.abspath(f"{stem}-{n}.xml" if len(runs) > 1 else args.junit)]
        cmd += targets
        print(f"# {' '.join(cmd)}", flush=True)
        worst = max(worst, subprocess.call(cmd, cwd=src, env=env))
    return worst


if __name__ == "__main__":
    sys.exit(main())
