"""The Waker with a fake scaler: one patch per wake-up, no patch for a starting model, deletion, failures."""

from __future__ import annotations

import asyncio

import pytest

from vsurge.router.table import Backend, EndpointTable, WakeTarget
from vsurge.router.wake import NotServable, UnknownModel, WakeFailed, Waker, WakeTimeout

TARGET = WakeTarget("models", "m")


def _backend(upstreams: tuple[str, ...] = (), desired: int | None = 0) -> Backend:
    return Backend(
        "m", upstreams, key="k8s/models/m", group="k8s:models", wake=TARGET, desired_replicas=desired
    )


class FakeScaler:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[WakeTarget, int]] = []
        self.fail = fail

    async def __call__(self, target: WakeTarget, replicas: int) -> None:
        self.calls.append((target, replicas))
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("forbidden")


def test_concurrent_requests_share_one_patch_and_get_the_replica() -> None:
    async def scenario() -> tuple[list, list]:
        table = EndpointTable()
        table.upsert(_backend())
        scaler = FakeScaler()
        waker = Waker(table, scaler, timeout_s=5)
        held = [asyncio.create_task(waker.upstreams_for("m")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in held)
        table.upsert(_backend(desired=1))  # the watch sees the patch...
        await asyncio.sleep(0.05)
        table.upsert(_backend(("http://r:1",), desired=1))  # ...then a ready replica
        return scaler.calls, await asyncio.gather(*held)

    calls, results = asyncio.run(scenario())
    assert calls == [(TARGET, 1)]
    assert results == [("http://r:1",)] * 3


def test_a_starting_model_is_waited_for_without_a_patch() -> None:
    async def scenario() -> list:
        table = EndpointTable()
        table.upsert(_backend(desired=2))
        scaler = FakeScaler()
        waker = Waker(table, scaler, timeout_s=5)
        task = asyncio.create_task(waker.upstreams_for("m"))
        await asyncio.sleep(0.05)
        table.upsert(_backend(("http://r:1",), desired=2))
        assert await task == ("http://r:1",)
        return scaler.calls

    assert asyncio.run(scenario()) == []


def test_timeout_deletion_refusal_and_static_models() -> None:
    async def scenario() -> None:
        table = EndpointTable()
        table.upsert(_backend())
        with pytest.raises(WakeTimeout, match="after 0.2s"):
            await Waker(table, FakeScaler(), timeout_s=0.2).upstreams_for("m")

        waker = Waker(EndpointTable(), FakeScaler(), timeout_s=5)
        waker.table.upsert(_backend())
        task = asyncio.create_task(waker.upstreams_for("m"))
        await asyncio.sleep(0.05)
        waker.table.remove("k8s/models/m")
        with pytest.raises(UnknownModel):
            await task

        refused = FakeScaler(fail=True)
        with pytest.raises(WakeFailed, match="RuntimeError: forbidden"):
            await Waker(table, refused, timeout_s=5).upstreams_for("m")

        static = EndpointTable()
        static.upsert(Backend("s", (), key="static/s", group="static"))
        with pytest.raises(NotServable):
            await Waker(static, FakeScaler(), timeout_s=5).upstreams_for("s")
        with pytest.raises(NotServable):  # no Kubernetes access: nothing can wake it
            await Waker(table, None, timeout_s=5).upstreams_for("m")
        with pytest.raises(UnknownModel):
            await Waker(table, FakeScaler(), timeout_s=5).upstreams_for("nope")

    asyncio.run(scenario())
