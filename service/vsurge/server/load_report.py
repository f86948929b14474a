"""The `/load` report: what a router needs to pick the replica with the most headroom, read from host-side
counters only (no device sync, no lock held across an engine step), so it can be polled every 250 ms.

Per model (and summed over models at the top level):

- ``requests_waiting``: admitted by the engine, not yet decoding (prefill queue, backlog, page admission);
- ``requests_running``: holding a decode slot;
- ``slots_used`` / ``slots_total`` / ``slots_free``: decode slots (max concurrent sequences);
- ``kv_pages_used`` / ``kv_pages_total``: KV-cache pages (oDriver, paged); null on the vDriver, whose KV is a
  dense row per slot, so its KV use *is* ``slots_used`` of ``slots_total``;
- ``kv_usage``: the fraction of KV in use, comparable across drivers (pages on oDriver, slots on vDriver).

``server_load`` is vLLM's field: HTTP generation requests in flight on this server (streams included).
"""

from __future__ import annotations

from typing import Any

_SUMMED = (
    "requests_waiting",
    "requests_running",
    "slots_used",
    "slots_total",
    "slots_free",
    "kv_pages_used",
    "kv_pages_total",
)


def model_load(metrics: Any) -> dict[str, Any]:
    """One model's load from its engine's DriverMetrics."""
    used, total = int(metrics.slots_used), int(metrics.slots_total)
    pages_used, pages_total = metrics.pages_used, metrics.pages_total
    paged = pages_total is not None and pages_total > 0
    if paged:
        kv_usage = pages_used / pages_total
    else:
        kv_usage = used / total if total else 0.0
    return {
        "driver": "odriver" if paged else "vdriver",
        "requests_waiting": int(metrics.requests_waiting),
        "requests_running": int(metrics.requests_running),
        "slots_used": used,
        "slots_total": total,
        "slots_free": max(0, total - used),
        "kv_pages_used": int(pages_used) if paged else None,
        "kv_pages_total": int(pages_total) if paged else None,
        "kv_usage": round(kv_usage, 4),
    }


def load_report(state: str, in_flight: int, models: dict[str, Any]) -> dict[str, Any]:
    """The whole report: ``models`` maps a model name to its DriverMetrics (or an exception it raised)."""
    per_model: dict[str, Any] = {}
    for name, m in models.items():
        per_model[name] = {"error": type(m).__name__} if isinstance(m, BaseException) else model_load(m)
    ok = [v for v in per_model.values() if "error" not in v]
    totals: dict[str, Any] = {}
    for key in _SUMMED:
        values = [v[key] for v in ok if v[key] is not None]
        totals[key] = sum(values) if values else None
    if totals["kv_pages_total"]:
        kv_usage = totals["kv_pages_used"] / totals["kv_pages_total"]
    elif totals["slots_total"]:
        kv_usage = totals["slots_used"] / totals["slots_total"]
    else:
        kv_usage = 0.0
    return {
        "server_load": in_flight,
        "status": state,
        **totals,
        "kv_usage": round(kv_usage, 4),
        "models": per_model,
    }
