"""Code written against EasyDeL's vSurge, run here unchanged: the seed's way of building, calling and serving.

    python examples/seed_style.py                      # the default model (SmolLM2-135M-Instruct)
    python examples/seed_style.py --model DIR --port 8000

Engines built with positional arguments (the seed's order), `vSurge.create_odriver(...)`, `complete()` over
`vSurgeRequest` in both tokenization modes with the response helpers, then `vSurgeApiServer(...).fire(...)`
with `metrics_port=-1` (no /metrics), until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio

import vsurge
from vsurge import SamplingParams, vDriver, vEngine, vSurge, vSurgeApiServer, vSurgeRequest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def ask(surge: vSurge, prompt: str) -> str:
    """Server-side tokenization: text in, text out (complete() buffers steps that end inside a character)."""
    text = ""
    async for step in surge.complete(vSurgeRequest(prompt, 24, temperature=0.0)):
        text += step[0].text
    return text


async def ask_client_side(surge: vSurge, prompt: str) -> list[int]:
    """Client-side tokenization: the steps as the driver made them, token ids for the client to decode."""
    request = vSurgeRequest(prompt, 24, 1.0, 0, 0.0, 0.7, is_client_side_tokenization=True)
    request.temperature = 0.0  # a request is a record: the driver reads it when it is submitted
    ids: list[int] = []
    async for step in surge.complete(request):
        for sample in surge.process_client_side_tokenization_response(step):
            ids += sample.token_ids
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="default", help="a model directory or GGUF file (default: default)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=11556)
    args = parser.parse_args()

    model, processor = vsurge.load_model(args.model)
    # positional, in the seed's order: model, processor, max_concurrent_decodes, max_concurrent_prefill,
    # prefill_lengths, max_prefill_length, max_length
    engine = vEngine(model, processor, 2, 1, [64], 64, 128)
    dense = vSurge(vDriver(engine, engine), "dense")
    # model, processor, storage, manager, page_size, hbm_utilization, max_concurrent_prefill,
    # max_concurrent_decodes, prefill_lengths, max_prefill_length, max_length
    paged = vSurge.create_odriver(
        model, processor, None, None, 16, 0.6, 1, 2, [64], 64, 128, vsurge_name="paged"
    )
    for surge in (dense, paged):
        surge.compile()
        surge.start()

    prompt = processor.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    print(f"prompt tokens: {dense.count_tokens(prompt)}", flush=True)
    for surge in (dense, paged):
        answer = asyncio.run(ask(surge, prompt))
        ids = asyncio.run(ask_client_side(surge, prompt))
        print(f"{surge.vsurge_name} complete(): {answer!r}", flush=True)
        print(
            f"{surge.vsurge_name} client-side ids decode to: {processor.decode(ids, skip_special_tokens=True)!r}"
        )
    (sample,) = asyncio.run(dense.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0)))
    print(f"generate(one prompt) -> [ReturnSample]: {sample.text!r}", flush=True)

    # the engines are compiled and running: fire() serves them as they are
    vSurgeApiServer({"dense": dense, "paged": paged}, max_workers=4).fire(
        host=args.host, port=args.port, metrics_port=-1, log_level="warning"
    )


if __name__ == "__main__":
    main()
