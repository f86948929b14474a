"""The drivers' structure (issue 12): one pipeline by composition, typed queue messages, declared request
state. Behaviour is covered by test_vsurge.py / test_odriver.py; these fail if the structure regresses."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from vsurge.contracts.sampling_params import SamplingParams
from vsurge.drivers import pipeline, queue_messages
from vsurge.drivers.active_request import ActiveRequest
from vsurge.drivers.dense import slot_scheduler, vdriver
from vsurge.drivers.paged import odriver

STEPPER_METHODS = [
    name for name, _ in inspect.getmembers(pipeline.Stepper, inspect.isfunction) if not name.startswith("_")
]


def test_the_drivers_compose_the_pipeline_instead_of_inheriting():
    assert not issubclass(odriver.oDriver, vdriver.vDriver)
    for cls in (vdriver.vDriver, odriver.oDriver):
        # no thread loop, lifecycle or detokenizer of their own: those are the pipeline's
        own = set(vars(cls))
        assert not own & {"_detokenize_loop", "_generate_loop", "_finish", "_fail", "_flush", "_finalize"}
    assert "step_loop" in vars(pipeline.Pipeline) and "detokenize_loop" in vars(pipeline.Pipeline)


@pytest.mark.parametrize("stepper", [vdriver.DenseSlots, odriver.PagedSteps])
def test_each_driver_supplies_a_complete_stepper(stepper):
    assert set(STEPPER_METHODS) == {"init_state", "plan", "step", "stepped", "lose_state", "stopped"}
    for name in STEPPER_METHODS:
        ours = inspect.signature(getattr(stepper, name))
        theirs = inspect.signature(getattr(pipeline.Stepper, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_queue_messages_are_typed_dataclasses():
    for name in ("PrefilledPack", "Prefilled", "Prepared", "FirstToken", "Step", "Abort", "Preempt"):
        cls = getattr(queue_messages, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
    owner = slot_scheduler.SlotOwner(ActiveRequest([1, 2], SamplingParams(max_tokens=1)), 0, 3)
    assert queue_messages.requests_of(queue_messages.FirstToken(owner, None)) == [owner.req]
    assert queue_messages.requests_of(queue_messages.Step(None, [None, owner, owner])) == [owner.req]


def test_active_request_declares_all_of_its_state():
    req = ActiveRequest([1, 2, 3], SamplingParams(max_tokens=2, n=2))
    assert not hasattr(req, "__dict__")
    with pytest.raises(AttributeError):
        req._in_pipeline = True  # the undeclared attribute drivers used to set from outside
    req.in_pipeline, req.finalized = True, True  # declared: fine
