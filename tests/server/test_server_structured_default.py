"""Structured output on the default model (SmolLM2-135M-Instruct) through the real server and the openai
client: `client.chat.completions.parse(..., response_format=<pydantic model>)` on 50 varied prompts, every
answer parsed by the client and validated with jsonschema."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # loads and compiles the default model

SUBJECTS = [
    "a cat",
    "the moon",
    "Paris",
    "a red bicycle",
    "the Nile",
    "a thunderstorm",
    "chess",
    "a violin",
    "Mount Everest",
    "a lighthouse",
    "coffee",
    "a robot",
    "the ocean",
    "jazz",
    "a library",
    "tulips",
    "a volcano",
    "the Roman empire",
    "penguins",
    "a train station",
    "honey bees",
    "the desert",
    "a castle",
    "rainbows",
    "a bakery",
]
ASKS = ["Describe {} as a record.", "Give me facts about {}."]


class Fact(BaseModel):
    subject: str = Field(max_length=40)
    category: Literal["animal", "place", "object", "idea", "event", "other"]
    rating: int = Field(ge=1, le=10)
    safe: bool
    # every string bounded: a 135M model left an unbounded string may fill any max_tokens (a run saw one
    # keyword run past 300 tokens); with bounds the longest valid answer fits max_tokens
    keywords: list[Annotated[str, Field(max_length=24)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def default_client():
    import openai

    import vsurge
    from vsurge import vSurge
    from vsurge.server import start, vSurgeApiServer

    model, tok = vsurge.load_model("default")
    surge = vSurge.create_vdriver(
        model,
        tok,
        max_concurrent_decodes=16,
        max_length=512,
        prefill_lengths=[64, 128, 256],
        vsurge_name="smol",
    )
    api = vSurgeApiServer({"smol": surge})
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=True, progress=None)
    try:
        running.wait_ready(1200)  # compiling the default model's programs takes minutes on 2 cores
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=600)
    finally:
        running.stop()


def test_parse_pydantic_on_fifty_prompts(default_client):
    prompts = [a.format(s) for s in SUBJECTS for a in ASKS]
    assert len(prompts) == 50
    schema = Fact.model_json_schema()

    def one(i: int):
        return default_client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": prompts[i]}],
            response_format=Fact,
            temperature=0.7,
            seed=i,
            max_tokens=400,
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    for r in results:
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Fact)
        jsonschema.validate(json.loads(msg.content), schema)


CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Rome", "Sydney", "Toronto", "Mumbai"]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "population_millions", "landmarks"],
}


def test_city_answers_keep_the_schemas_order(default_client):
    """Issue 37's report: with keys sorted, "landmarks" (an unbounded array) came first and 3 of these 8
    answers were cut at max_tokens=200 before "name" and "population_millions". In the schema's order both
    are always written, first; an answer that still runs out inside the array has them."""

    def one(city: str):
        return default_client.chat.completions.create(
            model="smol",
            messages=[
                {
                    "role": "user",
                    "content": f"Describe the city of {city} as JSON with its name, population in millions "
                    "and landmarks.",
                }
            ],
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, CITIES))
    for r in results:
        text = r.choices[0].message.content
        assert text.startswith('{"name": "'), text
        assert '"population_millions": ' in text, text
        if '"landmarks"' in text:  # a long number could use up the answer first: then there is none
            assert text.index('"population_millions"') < text.index('"landmarks"'), text
        if r.choices[0].finish_reason == "stop":
            answer = json.loads(text)
            jsonschema.validate(answer, CITY)
            assert list(answer) == ["name", "population_millions", "landmarks"]
