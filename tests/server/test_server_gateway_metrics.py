"""The model-server protocol of the Gateway API Inference Extension: `/metrics` carries the series its
endpoint picker reads by default (vLLM's names), beside vSurge's own, and they agree with `/load`."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL

from vsurge.drivers.metrics import DriverMetrics
from vsurge.server.metrics import gateway_metrics

GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_endpoint_pickers_metrics_are_served_and_match_load(http) -> None:
    families = _families(http.get("/metrics").text)
    load = http.get("/load").json()["models"][MODEL]
    for name in (*GIE_GAUGES, "vllm:gpu_cache_usage_perc"):
        fam = families[name]
        assert fam.type == "gauge", name
        (sample,) = [s for s in fam.samples if s.labels == {"model_name": MODEL}]
        want = {
            "vllm:num_requests_waiting": load["requests_waiting"],
            "vllm:num_requests_running": load["requests_running"],
        }.get(name, load["kv_usage"])
        assert sample.value == want, name
    # No LoRA on this engine: the family is declared, without samples.
    assert families["vllm:lora_requests_info"].samples == []
    # vSurge's own names are still there.
    assert "vsurge_requests_waiting" in families and "vsurge_slot_occupancy" in families


@dataclass
class _WithLora(DriverMetrics):
    max_loras: int = 4
    running_loras: list = field(default_factory=lambda: ["sql", "chat"])
    waiting_loras: list = field(default_factory=lambda: ["legal"])


def test_values_for_each_driver_and_lora_labels() -> None:
    paged = DriverMetrics(
        slots_used=1, slots_total=4, requests_running=1, requests_waiting=3, pages_used=30, pages_total=120
    )
    dense = DriverMetrics(slots_used=3, slots_total=8, requests_running=3)
    fams = {f.name: f for f in gateway_metrics([("p", paged), ("d", dense), ("l", _WithLora(slots_total=2))])}
    kv = {s.labels["model_name"]: s.value for s in fams["vllm:kv_cache_usage_perc"].samples}
    assert kv == {"p": 0.25, "d": 0.375, "l": 0.0}  # pages on odriver, slots on vdriver
    waiting = {s.labels["model_name"]: s.value for s in fams["vllm:num_requests_waiting"].samples}
    assert waiting == {"p": 3.0, "d": 0.0, "l": 0.0}
    (lora,) = fams["vllm:lora_requests_info"].samples
    assert lora.labels == {
        "max_lora": "4",
        "running_lora_adapters": "sql,chat",
        "waiting_lora_adapters": "legal",
    }
    assert lora.value > 1.7e9  # a timestamp: the picker keeps the newest report
