"""End to end on loopback: three `vsurge serve` processes (two tiny models, one of them twice) behind one
`vsurge route --static-config` process, called with the official openai client.

The tests share one stack (starting it costs most of this file's time) and run in order: the last one
kills a replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import yaml
from kmock_harness import LoggedProcess, free_port
from router_helpers import clean_env, load_benchmark, metric_value, vsurge_command

# The paged engine with the flags of benchmarks/router_prefix.py, as test_router_e2e_pods.py runs it: the
# JAX compilation cache compiles these shapes once for both files.
ENGINE_FLAGS = load_benchmark("router_prefix").SERVE_FLAGS


@dataclass
class Stack:
    router: LoggedProcess
    router_url: str
    servers: dict[str, tuple[LoggedProcess, str]]  # name -> (process, base URL)

    def client(self) -> openai.OpenAI:
        # No client retries: every retry seen here is the router's.
        return openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> str:
        return httpx.get(f"{self.router_url}/metrics", timeout=10).text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("router-e2e")
    make_checkpoint(root / "alpha", "llama", seed=0)
    make_checkpoint(root / "beta", "llama", seed=1)
    env = clean_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device per server, not the suite's eight fake ones
    plan = {"alpha-1": "alpha", "alpha-2": "alpha", "beta-1": "beta"}
    servers: dict[str, tuple[LoggedProcess, str]] = {}
    router: LoggedProcess | None = None
    try:
        for name, model in plan.items():
            port = free_port()
            args = [
                *vsurge_command(),
                "serve",
                f"--model={root / model}",
                f"--served-model-name={model}",
                "--host=127.0.0.1",
                f"--port={port}",
                "--metrics-port=-1",
                *ENGINE_FLAGS,
            ]
            servers[name] = (
                LoggedProcess(args, root / f"{name}.log", env).start(),
                f"http://127.0.0.1:{port}",
            )
        for proc, url in servers.values():
            proc.wait_http(f"{url}/readiness", timeout=180)
        config = root / "static.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "models": [
                        {"name": "alpha", "upstreams": [servers["alpha-1"][1], servers["alpha-2"][1]]},
                        {"name": "beta", "upstreams": [f"{servers['beta-1'][1]}/v1"]},
                    ]
                }
            )
        )
        port = free_port()
        router = LoggedProcess(
            [
                *vsurge_command(),
                "route",
                f"--static-config={config}",
                "--host=127.0.0.1",
                f"--port={port}",
                "--eject-seconds=60",
                # No /load polling: the killed replica must be found by a failed request (the retry path),
                # and idle replicas compared by in-flight counts alone take turns.
                "--load-poll-seconds=0",
            ],
            root / "router.log",
            clean_env(),
        ).start()
        router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=30)
        yield Stack(router, f"http://127.0.0.1:{port}", servers)
    except BaseException:
        for name, (proc, _) in servers.items():
            print(f"----- {name} log -----\n{proc.log()}")
        if router is not None:
            print(f"----- router log -----\n{router.log()}")
        raise
    finally:
        if router is not None:
            router.stop()
        for proc, _ in servers.values():
            proc.stop()


def _ask(client: openai.OpenAI, model: str, stream: bool) -> str:
    messages = [{"role": "user", "content": "Hello!"}]
    if not stream:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        assert out.model == model and out.usage is not None and out.usage.completion_tokens >= 1
        assert out.choices[0].finish_reason in ("stop", "length")
        return out.choices[0].message.content or ""
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True))
    assert len(chunks) >= 2 and all(c.model == model for c in chunks)
    assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _upstream_count(text: str, model: str, upstream: str, outcome: str = "200") -> float:
    return metric_value(
        text, "vsurge_router_upstream_requests_total", model=model, upstream=upstream, outcome=outcome
    )


def test_models_are_listed(stack: Stack) -> None:
    assert sorted(m.id for m in stack.client().models.list()) == ["alpha", "beta"]


def test_both_models_answer_streamed_and_not(stack: Stack) -> None:
    client = stack.client()
    for model in ("alpha", "beta"):
        for stream in (False, True, False, True):
            assert isinstance(_ask(client, model, stream), str)
    text = client.completions.create(model="beta", prompt="Hello", max_tokens=4).choices[0].text
    assert isinstance(text, str)
    m = stack.metrics()
    a1, a2, b1 = (stack.servers[n][1] for n in ("alpha-1", "alpha-2", "beta-1"))
    # Each model went only to its own servers; the idle alpha replicas took turns.
    assert _upstream_count(m, "beta", b1) == 5
    assert _upstream_count(m, "alpha", a1) >= 1 and _upstream_count(m, "alpha", a2) >= 1
    assert _upstream_count(m, "alpha", a1) + _upstream_count(m, "alpha", a2) == 4
    assert metric_value(m, "vsurge_router_requests_total", model="alpha", code="200") == 4


def test_an_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        stack.client().chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"


def test_a_killed_replica_is_replaced_by_the_other(stack: Stack) -> None:
    proc, dead = stack.servers["alpha-1"]
    alive = stack.servers["alpha-2"][1]
    before = stack.metrics()
    proc.kill()
    client = stack.client()
    for stream in (False, True, False, True):
        assert isinstance(_ask(client, "alpha", stream), str)
    assert isinstance(_ask(client, "beta", False), str)
    after = stack.metrics()
    failed = sum(_upstream_count(after, "alpha", dead, o) for o in ("connect_error", "dropped"))
    assert failed == 1  # tried once, then ejected for the rest
    assert _upstream_count(after, "alpha", alive) - _upstream_count(before, "alpha", alive) == 4
    assert _upstream_count(after, "alpha", dead) == _upstream_count(before, "alpha", dead)
    assert stack.router.proc is not None and stack.router.proc.poll() is None
