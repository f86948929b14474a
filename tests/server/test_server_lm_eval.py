"""A real evaluation client against `vsurge serve`: lm-eval's `local-completions` (log-likelihoods through
echo + logprobs, and generate_until) and `local-chat-completions`, on tiny tasks defined here from local
JSON files (nothing from a hub), scored beside lm-eval's own transformers model (`hf`) on the same
checkpoint: the same answers, the same per-document log-likelihoods."""

from __future__ import annotations

import json
import logging

import pytest
from server_helpers import MODEL

pytestmark = pytest.mark.slow  # two evaluation runs (ours and transformers'): ~2 min on 2 cores

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (pip install -e '.[test]')")

DOCS = [
    {"q": "one two three", "choices": [" four", " five", " one"], "gold": 0},
    {"q": "red green", "choices": [" blue", " red", " cat"], "gold": 0},
    {"q": "a b c d", "choices": [" e", " f", " a b"], "gold": 0},
    {"q": "Hello", "choices": [" world", " there", "!"], "gold": 1},
    {"q": "The capital of France is", "choices": [" Paris", " London", " Rome"], "gold": 0},
    {"q": "1 2 3", "choices": [" 4", " 5 6", " 7"], "gold": 0},
]

MC_TASK = """
task: vsurge_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""

GEN_TASK = """
task: vsurge_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{choices[gold]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    d = tmp_path_factory.mktemp("lm-eval-tasks")
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    (d / "mc.yaml").write_text(MC_TASK.format(data=data))
    (d / "gen.yaml").write_text(GEN_TASK.format(data=data))
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    return TaskManager(include_path=str(d))


def _evaluate(task_manager, model: str, model_args: dict, tasks: list[str], **kw):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=",".join(f"{k}={v}" for k, v in model_args.items()),
        tasks=tasks,
        task_manager=task_manager,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        **kw,
    )


@pytest.fixture(scope="module")
def reference(task_manager, tiny_dir):
    """lm-eval's own transformers model on the same checkpoint."""
    return _evaluate(
        task_manager,
        "hf",
        {"pretrained": tiny_dir, "device": "cpu", "dtype": "float32"},
        ["vsurge_tiny_mc", "vsurge_tiny_gen"],
    )


def _by_doc(results, task):
    return {s["doc_id"]: s for s in results["samples"][task]}


def test_lm_eval_local_completions_matches_transformers(server, task_manager, tiny_dir, reference):
    ours = _evaluate(
        task_manager,
        "local-completions",
        {
            "model": MODEL,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": tiny_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
        },
        ["vsurge_tiny_mc", "vsurge_tiny_gen"],
    )
    for task, metric in (("vsurge_tiny_mc", "acc,none"), ("vsurge_tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == reference["results"][task][metric], task
    mine, theirs = _by_doc(ours, "vsurge_tiny_mc"), _by_doc(reference, "vsurge_tiny_mc")
    assert len(mine) == len(DOCS)
    for doc_id, s in mine.items():
        ll = [r[0] for r in s["filtered_resps"]]
        want = [r[0] for r in theirs[doc_id]["filtered_resps"]]
        assert ll == pytest.approx(want, abs=2e-3), doc_id
        assert [r[1] for r in s["filtered_resps"]] == [r[1] for r in theirs[doc_id]["filtered_resps"]]
    mine, theirs = _by_doc(ours, "vsurge_tiny_gen"), _by_doc(reference, "vsurge_tiny_gen")
    assert [mine[i]["filtered_resps"] for i in sorted(mine)] == [
        theirs[i]["filtered_resps"] for i in sorted(theirs)
    ]
    print(
        "lm-eval scores (ours, transformers):",
        {t: (ours["results"][t], reference["results"][t]) for t in mine and ours["results"]},
    )


def test_lm_eval_local_chat_completions_generates(server, task_manager, tiny_dir):
    ours = _evaluate(
        task_manager,
        "local-chat-completions",
        {"model": MODEL, "base_url": f"{server.url}/v1/chat/completions", "max_retries": 1},
        ["vsurge_tiny_gen"],
        apply_chat_template=True,
    )
    samples = ours["samples"]["vsurge_tiny_gen"]
    assert len(samples) == len(DOCS)
    assert all(isinstance(s["resps"][0][0], str) for s in samples)
    assert 0.0 <= ours["results"]["vsurge_tiny_gen"]["exact_match,none"] <= 1.0
