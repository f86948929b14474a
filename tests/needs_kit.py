"""Tests that need a kit beside the repository (``../shared/k8s``: the cluster suite; ``../shared/seed``: the
seed conformance tests). Without the kit they are skipped, with the reason printed at the end of the run; under
``CI=true`` they fail instead, so a CI run that silently ran less than the whole suite cannot pass.

``missing(reason)`` is the marker a test or module gets when its kit is absent; ``tests/conftest.py`` fails a
test so marked at setup (before its fixtures start anything), with the reason and how to get the kit.
"""

from __future__ import annotations

import os

import pytest

MARKER = "kit_missing"


def in_ci() -> bool:
    """CI=true, as GitHub Actions, GitLab CI and most runners set it."""
    return os.environ.get("CI") == "true"


def missing(reason: str) -> pytest.MarkDecorator:
    """A skip with ``reason``; under CI=true the marker that fails the test instead."""
    if in_ci():
        return getattr(pytest.mark, MARKER)(reason)
    return pytest.mark.skip(reason=reason)


def unless(present: bool, reason: str) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: nothing when the kit is ``present``, else ``missing(reason)``."""
    return [] if present else [missing(reason)]


def skip_or_fail(reason: str) -> None:
    """Inside a fixture: skip, or under CI=true fail, with ``reason``."""
    if in_ci():
        pytest.fail(failure(reason), pytrace=False)
    pytest.skip(reason)


def failure(reason: str) -> str:
    return (
        f"{reason}. CI=true: a CI run must run these tests, so a missing kit fails it "
        "(put the kit beside the repository, or run without CI=true to skip them)"
    )


def fail_marked(item: pytest.Item) -> None:
    """Fail ``item`` at setup when it carries the marker (see tests/conftest.py)."""
    mark = item.get_closest_marker(MARKER)
    if mark is not None:
        pytest.fail(failure(mark.args[0]), pytrace=False)
