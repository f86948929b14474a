""".ci/serve runs the README's own curl example (read by .ci/readme_example.py): check that reading, and that
the example asks what `make serve` serves (its port, its model name), so a README edit cannot silently break CI."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("readme_example", REPO / ".ci" / "readme_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme_example = _load()


def test_curl_example_targets_what_make_serve_serves():
    from vsurge.cli.main import DEFAULT_PORT, parse_serve_config

    curl = readme_example.curl_example()
    words = shlex.split(curl)
    assert words[0] == "curl"
    assert f"localhost:{DEFAULT_PORT}/v1/chat/completions" in words
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == parse_serve_config(["--model", "default"]).model_name
    assert body["messages"] and body["messages"][0]["role"] == "user"
    # the Makefile's serve target runs the default model on the default port
    makefile = (REPO / "Makefile").read_text()
    assert "vsurge serve --model default $(ARGS)" in makefile


def test_curl_example_printed_as_written():
    out = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "readme_example.py"), "curl"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == readme_example.curl_example()
    assert out.strip() in (REPO / "README.md").read_text()


def test_two_curl_examples_are_refused():
    text = "```bash\ncurl -s x/v1/chat/completions\n```\n\n```bash\ncurl -s y/v1/chat/completions\n```\n"
    with pytest.raises(SystemExit, match="found 2"):
        readme_example.curl_example(text)


GOOD = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "SmolLM2-135M-Instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def _bad(**change):
    answer = json.loads(json.dumps(GOOD))
    for path, value in change.items():
        node = answer
        *parents, last = path.split("__")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[last] = value
    return json.dumps(answer)


def test_answer_check_accepts_a_chat_completion():
    assert readme_example.check_answer(json.dumps(GOOD), "SmolLM2-135M-Instruct")["choices"][0]


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        json.dumps({"error": {"message": "boom", "type": "server_error"}}),
        _bad(object="text_completion"),
        _bad(choices=[]),
        _bad(choices__0__message__content=""),
        _bad(choices__0__message__content="   "),
        _bad(choices__0__message__role="user"),
        _bad(choices__0__finish_reason=None),
        _bad(usage=None),
        _bad(model="other"),
    ],
)
def test_answer_check_refuses_other_shapes(raw):
    with pytest.raises(ValueError):
        readme_example.check_answer(raw, "SmolLM2-135M-Instruct")
