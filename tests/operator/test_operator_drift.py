"""Drift detection and the three-way merge patch."""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from kmock_harness import apply_merge_patch

from vsurge_operator import drift

WANT = {
    "metadata": {"name": "m", "labels": {"a": "1", "b": "2"}},
    "spec": {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "c", "env": [{"name": "X", "value": "1"}]}]}},
    },
}


def server_defaults(obj: dict) -> dict:
    """What an API server adds: fields we never set, inside dicts and inside list items."""
    live = copy.deepcopy(obj)
    live["metadata"]["uid"] = "u"
    live["metadata"]["resourceVersion"] = "7"
    live["spec"]["revisionHistoryLimit"] = 10
    for c in live["spec"]["template"]["spec"]["containers"]:
        c["imagePullPolicy"] = "IfNotPresent"
        c["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 2}
    return live


def test_live_object_with_server_defaults_needs_no_write():
    want = drift.with_last_applied(WANT)
    assert drift.plan(want, server_defaults(want)) is None


def test_changed_field_is_patched_and_the_patch_converges():
    want = drift.with_last_applied(WANT)
    live = server_defaults(want)
    live["spec"]["replicas"] = 7  # someone edited it by hand
    patch = drift.plan(want, live)
    assert patch is not None and patch["spec"]["replicas"] == 2
    fixed = apply_merge_patch(live, patch)
    assert drift.plan(want, fixed) is None
    assert fixed["spec"]["revisionHistoryLimit"] == 10, "server-owned fields are left alone"


def test_fields_we_stopped_setting_are_removed():
    old = drift.with_last_applied(WANT)
    live = server_defaults(old)
    live["metadata"]["labels"]["added-by-someone"] = "x"
    new_want = copy.deepcopy(WANT)
    del new_want["metadata"]["labels"]["b"]
    new = drift.with_last_applied(new_want)
    patch = drift.plan(new, live)
    assert patch["metadata"]["labels"]["b"] is None
    assert "added-by-someone" not in patch["metadata"]["labels"], "labels we never set are not touched"
    fixed = apply_merge_patch(live, patch)
    assert fixed["metadata"]["labels"] == {"a": "1", "added-by-someone": "x"}
    assert drift.plan(new, fixed) is None


def test_list_items_compare_by_position_and_length():
    assert drift.is_subset([{"a": 1}], [{"a": 1, "b": 2}])
    assert not drift.is_subset([{"a": 1}], [{"a": 1}, {"a": 2}])
    assert not drift.is_subset([{"a": 1}, {"a": 2}], [{"a": 2}, {"a": 1}])
    assert not drift.is_subset({"x": True}, {"x": 1}), "a bool is not an int"
    assert not drift.is_subset({"x": "1"}, {"x": 1})
    assert not drift.is_subset({"x": {}}, {"x": None})


def test_last_applied_annotation_round_trip():
    want = drift.with_last_applied(WANT)
    recorded = json.loads(want["metadata"]["annotations"][drift.LAST_APPLIED_ANNOTATION])
    assert recorded == WANT
    assert drift.last_applied(want) == WANT
    assert drift.with_last_applied(want) == want, "idempotent"
    broken = copy.deepcopy(want)
    broken["metadata"]["annotations"][drift.LAST_APPLIED_ANNOTATION] = "{not json"
    assert drift.last_applied(broken) is None
    assert drift.last_applied(None) is None


keys = st.sampled_from(["a", "b", "c", "d"])
leaves = st.one_of(st.integers(0, 3), st.text(max_size=2), st.booleans())
trees = st.recursive(
    leaves,
    lambda children: st.one_of(st.dictionaries(keys, children, max_size=3), st.lists(children, max_size=2)),
    max_leaves=8,
)
objects = st.dictionaries(keys, trees, min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(want=objects, before=objects, live=objects)
def test_plan_always_converges(want, before, live):
    """Whatever the live object and whatever we applied before, one patch makes it match."""
    want_a = drift.with_last_applied({"metadata": {"name": "x"}, "spec": want})
    before_a = drift.with_last_applied({"metadata": {"name": "x"}, "spec": before})
    current = apply_merge_patch(before_a, {"spec": live})  # someone else changed things since
    patch = drift.plan(want_a, current)
    result = current if patch is None else apply_merge_patch(current, patch)
    assert drift.is_subset(want_a, result)
    assert drift.plan(want_a, result) is None
