"""The serving benchmark's workloads: random-word prompts, passages of real prose, jobs with their own
max_tokens, and the named presets (arriving traffic with long prompts; the CPU like-for-like pair).

The prose is the opening of Jane Austen's *Pride and Prejudice* (1813, public domain; benchmarks/data/
prose.txt, 5 KB): a prose request asks to continue a passage of it, so prompts are natural text and,
through the chat template, answers end where the model says so (EOS), as in real chat traffic.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

PROSE = Path(__file__).resolve().parent / "data" / "prose.txt"

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "not",
    "but",
    "they",
    "one",
    "their",
    "also",
    "its",
    "first",
    "new",
    "after",
    "who",
    "two",
    "been",
    "have",
    "more",
    "other",
    "when",
    "time",
    "into",
    "during",
    "city",
    "world",
    "river",
    "music",
    "school",
    "system",
    "model",
    "serving",
    "token",
    "engine",
    "stream",
    "batch",
    "cache",
    "device",
    "memory",
]


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


@dataclass(frozen=True)
class Job:
    """One request of a workload: its prompt and, where the workload varies it, its own max_tokens."""

    prompt: str
    max_tokens: int | None = None  # None: --max-tokens
    prompt_words: int = 0


@dataclass(frozen=True)
class Preset:
    """A named workload: every server is measured on exactly the same requests (fixed seed)."""

    description: str
    num_requests: int
    concurrency: int
    prompt_tokens: tuple[int, int]  # inclusive range, drawn uniformly per request
    max_tokens: tuple[int, int]  # inclusive range, drawn uniformly per request
    endpoint: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    # random: random words; quote: a passage of random words given twice and asked for a third time
    # (the output repeats its context, as in summarising, quoting or editing: n-gram speculation's case);
    # prose: a passage of real prose to be continued (prompt_tokens counts its words)
    prompts: str = "random"


# Issue 14's workload: arriving traffic with long prompts, where decode can stall behind prefill.
PRESETS: dict[str, Preset] = {
    "mixed-32": Preset(
        "64 streaming /v1/completions, 32 in flight, prompts 32-512 tokens, max_tokens 16-256, ignore_eos, "
        "temperature 0",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
    ),
    "mixed-64": Preset(
        "the mixed-32 requests at 64 in flight",
        num_requests=64,
        concurrency=64,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
    ),
    "sampled-32": Preset(
        "the mixed-32 requests at temperature 1.0 (text that seldom repeats itself: speculation's worst case)",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
        temperature=1.0,
    ),
    "quote-32": Preset(
        "64 streaming /v1/completions, 32 in flight: a passage of 48-160 words given twice, then asked for "
        "again; max_tokens 64-192, ignore_eos, temperature 0 (repetitive output: speculation's case)",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(48, 160),
        max_tokens=(64, 192),
        prompts="quote",
    ),
    # The CPU like-for-like pair (docs/performance.md, "CPU against peers"): the same 48 requests at 24 in
    # flight on every server, one run of random prompts that generate exactly max_tokens, one of chat.
    "random-24": Preset(
        "48 streaming /v1/completions, 24 in flight, prompts 32-512 tokens of random words, max_tokens "
        "16-256, ignore_eos, temperature 0",
        num_requests=48,
        concurrency=24,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
    ),
    "chat-24": Preset(
        "48 streaming /v1/chat/completions, 24 in flight: continue a passage of 32-384 words of real prose, "
        "max_tokens 64-256, answers end at EOS, temperature 0",
        num_requests=48,
        concurrency=24,
        prompt_tokens=(32, 384),
        max_tokens=(64, 256),
        endpoint="chat",
        ignore_eos=False,
        prompts="prose",
    ),
}


@functools.cache
def _prose_words() -> tuple[str, ...]:
    return tuple(PROSE.read_text().split())


def prose_passage(rng: random.Random, words: int) -> str:
    """A request to continue ``words`` words of the prose taken from a random place (wrapping round)."""
    text = _prose_words()
    start = rng.randrange(len(text))
    passage = " ".join(text[(start + i) % len(text)] for i in range(words))
    return f"Continue this passage from a novel, in the same style:\n\n{passage}"


def make_jobs(
    n: int,
    prompt_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int,
    prompts: str = "random",
) -> list[Job]:
    """n requests with prompt lengths and max_tokens drawn uniformly from the inclusive ranges.

    A prompt of N tokens is N words of WORDS: each is one token (with its leading space) for the
    SmolLM2/Llama BPE vocabularies, so every server sees the same text and about the same length; the
    exact counts come back in each answer's usage. Prompts are random, so no prefix cache gets them free.
    ``prompts="quote"``: the drawn length is the passage's; the prompt holds it twice (about 2x + 12
    tokens) and asks for it once more.
    """
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        words = rng.randint(*prompt_tokens)
        if prompts == "prose":
            jobs.append(
                Job(prompt=prose_passage(rng, words), max_tokens=rng.randint(*max_tokens), prompt_words=words)
            )
            continue
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if prompts == "quote":
            text = f"Text: {text}\nThe same text again: {text}\nThe same text once more:"
        elif prompts != "random":
            raise ValueError(f"unknown prompt kind {prompts!r}")
        jobs.append(Job(prompt=text, max_tokens=rng.randint(*max_tokens), prompt_words=words))
    return jobs


def as_jobs(prompts: list[str] | list[Job]) -> list[Job]:
    return [p if isinstance(p, Job) else Job(p) for p in prompts]
