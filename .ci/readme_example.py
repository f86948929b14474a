"""Print one of README.md's own examples, so CI runs exactly what the README says (they cannot drift).

    python3 .ci/readme_example.py curl     # the `curl` request to the server `make serve` starts
    python3 .ci/readme_example.py check    # check an answer (JSON on stdin) has the chat.completion shape

Only the standard library: this runs before any venv exists.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)  # info strings such as "bash run server"


def bash_blocks(text: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(text) if lang in ("bash", "sh", "shell", "")]


def curl_example(text: str | None = None) -> str:
    """The README's one bash block that is a `curl` call to /v1/chat/completions, as written."""
    text = README.read_text(encoding="utf-8") if text is None else text
    found = [
        b.strip() for b in bash_blocks(text) if b.lstrip().startswith("curl ") and "/v1/chat/completions" in b
    ]
    if len(found) != 1:
        raise SystemExit(f"README.md: expected one curl example to /v1/chat/completions, found {len(found)}")
    return found[0]


def check_answer(raw: str, model: str | None = None) -> dict:
    """The answer must be an OpenAI chat.completion with non-empty assistant text; returns it parsed."""
    try:
        answer = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the answer is not JSON ({exc}): {raw[:500]!r}") from None
    problems = []
    if not isinstance(answer, dict):
        raise ValueError(f"the answer is not a JSON object: {raw[:500]!r}")
    if "error" in answer:
        problems.append(f"an error answer: {answer['error']}")
    if answer.get("object") != "chat.completion":
        problems.append(f"object is {answer.get('object')!r}, not 'chat.completion'")
    if not isinstance(answer.get("id"), str) or not answer.get("id"):
        problems.append("no id")
    if not isinstance(answer.get("created"), int):
        problems.append("no integer created")
    if model is not None and answer.get("model") != model:
        problems.append(f"model is {answer.get('model')!r}, not {model!r}")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        problems.append("no choices")
    else:
        choice = choices[0]
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            problems.append("choices[0] has no message")
        else:
            if message.get("role") != "assistant":
                problems.append(f"choices[0].message.role is {message.get('role')!r}")
            content = message.get("content")
            if not isinstance(content, str) or not content.strip():
                problems.append(f"choices[0].message.content is empty: {content!r}")
        if choice.get("finish_reason") not in ("stop", "length"):
            problems.append(f"choices[0].finish_reason is {choice.get('finish_reason')!r}")
    usage = answer.get("usage")
    if not isinstance(usage, dict) or not all(
        isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    ):
        problems.append(f"usage is {usage!r}")
    if problems:
        raise ValueError("; ".join(problems) + f"\nthe answer: {raw[:2000]}")
    return answer


def _requested_model(curl: str) -> str | None:
    match = re.search(r'"model"\s*:\s*"([^"]+)"', curl)
    return match.group(1) if match else None


def main(argv: list[str]) -> int:
    if argv == ["curl"]:
        print(curl_example())
        return 0
    if argv == ["check"]:
        try:
            answer = check_answer(sys.stdin.read(), _requested_model(curl_example()))
        except ValueError as exc:
            print(f"the README's curl example got a bad answer: {exc}", file=sys.stderr)
            return 1
        print(f"answer: {answer['choices'][0]['message']['content']!r} ({answer['usage']})")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
