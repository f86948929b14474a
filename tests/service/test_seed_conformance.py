"""The seed's API, name by name, from its document: every name matches (inspect) or is in docs/seed.md's
"Differences from the seed" table with its reason; the table lists only names of the seed, and none that
matches while the table says it does not.

The document is ``../shared/seed/vsurge-api.txt`` beside the repository (as the cluster suite's
``../shared/k8s``; ``VSURGE_SEED_DOC`` overrides); without it these tests are skipped, the reason printed
(under ``CI=true`` they fail instead: tests/needs_kit.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import seed_conformance as sc
from needs_kit import unless

pytestmark = unless(
    sc.SEED_DOC.exists(), f"no seed document at {sc.SEED_DOC} (../shared/seed beside the repository)"
)


@pytest.fixture(scope="module")
def names() -> list[sc.SeedName]:
    return sc.parse(sc.SEED_DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def results(names):
    return sc.check(names)


@pytest.fixture(scope="module")
def diffs() -> dict[str, tuple[str, str]]:
    return sc.differences(sc.DIFF_DOC.read_text(encoding="utf-8"))


def test_the_document_parses_into_its_classes_and_members(names):
    by_kind = {
        k: [n.key for n in names if n.kind == k] for k in ("class", "argument", "method", "property", "type")
    }
    assert by_kind["class"] == [
        "oDriver",
        "oEngine",
        "vDriver",
        "vEngine",
        "vSurge",
        "vSurgeApiServer",
        "vSurgeRequest",
    ]
    # a sample of each kind, read from the text (not a list copied by hand)
    assert (
        "oEngine(storage)" in by_kind["argument"]
        and "vSurgeRequest(is_client_side_tokenization)" in by_kind["argument"]
    )
    assert "oEngine.forward" in by_kind["method"] and "vSurge.should_buffer_response" in by_kind["method"]
    assert "vEngine.prng_key" in by_kind["property"] and "oDriver.num_used_slots" in by_kind["property"]
    assert {"ResultTokens", "AbstractDriver", "ActiveSequenceBatch", "CountTokenRequest"} <= set(
        by_kind["type"]
    )
    fire = next(n for n in names if n.key == "vSurgeApiServer.fire")
    assert [(p.name, p.default) for p in fire.params][:3] == [
        ("host", "0.0.0.0"),
        ("port", 11556),
        ("metrics_port", None),
    ]
    create = next(n for n in names if n.key == "vSurge.create_odriver")
    assert create.is_classmethod and [p.name for p in create.params][2:4] == ["storage", "manager"]
    assert next(n for n in names if n.key == "vSurge.complete").is_async
    print(f"{len(names)} names: " + ", ".join(f"{k} {len(v)}" for k, v in by_kind.items()))


def test_every_name_matches_or_is_a_listed_difference(results, diffs):
    print("\n" + sc.table(results, diffs))
    unlisted = [
        f"{n.key}: {status} ({detail})"
        for n, status, detail in results
        if status != "same" and n.key not in diffs
    ]
    assert not unlisted, "names that differ from the seed and are not in docs/seed.md's table:\n" + "\n".join(
        unlisted
    )
    wrong = [
        f"{n.key}: the table says {diffs[n.key][0]!r}, inspect finds {status!r}"
        for n, status, _ in results
        if status != "same" and diffs.get(n.key, (status,))[0] != status
    ]
    assert not wrong, "\n".join(wrong)


def test_the_table_is_current(names, results, diffs):
    keys = {n.key for n in names}
    assert not set(diffs) - keys, f"the table lists names the seed does not have: {sorted(set(diffs) - keys)}"
    assert all(status in sc.STATUSES[1:] for status, _ in diffs.values()), diffs
    assert all(len(reason) > 20 for _, reason in diffs.values()), "every difference gives its reason"
    found = {n.key: status for n, status, _ in results}
    stale = [
        k
        for k, (status, _) in diffs.items()
        if status in ("other signature", "missing") and found[k] == "same"
    ]
    assert not stale, f"listed as differing but they match now: {stale}"


def test_the_seed_attributes_are_there_on_real_objects(tiny_llama, names):
    """What inspect takes from declarations, read on real engines, drivers and requests."""
    import vsurge

    model, tok = tiny_llama
    engine = vsurge.vEngine(model, tok, 2, None, [16], None, 64)
    paged = vsurge.oEngine(model, tok, None, None, 2, None, [16], None, 64, kv_cache_bytes=1 << 20)
    objects = {
        "vEngine": engine,
        "oEngine": paged,
        "vDriver": vsurge.vDriver(engine, engine),
        "oDriver": vsurge.oDriver(paged),
        "vSurgeRequest": vsurge.vSurgeRequest("hi", 8),
    }
    for n in names:
        if n.owner in objects and n.kind == "property":
            getattr(objects[n.owner], n.name)  # raises if absent
    request = objects["vSurgeRequest"]
    for n in names:
        if n.owner == "vSurgeRequest" and n.kind == "argument" and n.default is not sc.NO_DEFAULT:
            assert getattr(request, n.name) == n.default, n.key
    assert isinstance(engine.prng_key, type(paged.prng_key)) and np.shape(engine.prng_key) == (2,)
