"""Live figures a driver keeps for the server's /metrics and the operator's autoscaler."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .active_request import ActiveRequest


@dataclass
class DriverMetrics:
    slots_used: int = 0
    slots_total: int = 0
    slot_occupancy: float = 0.0
    prefill_queue_size: int = 0
    transfer_queue_size: int = 0
    generate_backlog_size: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)
    pages_used: int | None = None
    pages_total: int | None = None
    preemptions_total: int = 0
    prefix_cache_hits_total: int = 0
    # speculative decoding (None when it is off): draft tokens verified, and those accepted
    spec_decode_draft_tokens_total: int | None = None
    spec_decode_accepted_tokens_total: int | None = None
    # LoRA (None / empty without an adapter bank): the bank's slots, and the adapters of requests holding
    # a slot and of those waiting for one (the GIE gauge vllm:lora_requests_info)
    max_loras: int | None = None
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)


@dataclass
class RequestStats:
    """One finished sample, handed to observers (the server's histograms)."""

    model: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    ttft: float | None
    tpot: float | None
    e2e_latency: float
    queue_time: float | None
    adapter: str | None = None  # the LoRA adapter the request ran with (None: the base model)


class MetricsRecorder:
    """Counters updated from driver threads; observers are called once per finished sample."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: Counter[str] = Counter()
        self.running = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.observers: list[Callable[[RequestStats], None]] = []

    def request_started(self, req: ActiveRequest) -> None:
        with self._lock:
            self.running += 1
            self.prompt_tokens += len(req.prompt_ids)

    def tokens(self, n: int) -> None:
        with self._lock:
            self.generated_tokens += n

    def drafted(self, drafts: int, accepted: int) -> None:
        """A verify step checked ``drafts`` draft tokens and accepted ``accepted`` of them."""
        with self._lock:
            self.draft_tokens += drafts
            self.accepted_tokens += accepted

    def request_finished(self, req: ActiveRequest, now: float) -> None:
        md = req.metadata
        with self._lock:
            self.running -= 1
            for s in req.samples:
                self.finished[s.finish_reason or "abort"] += 1
        for s in req.samples:
            n = len(s.token_ids)
            stats = RequestStats(
                model=req.model,
                finish_reason=s.finish_reason or "abort",
                prompt_tokens=len(req.prompt_ids),
                generated_tokens=n,
                ttft=(s.first_token_at - md.queued_at) if s.first_token_at else None,
                tpot=(now - s.first_token_at) / (n - 1) if s.first_token_at and n > 1 else None,
                e2e_latency=now - md.queued_at,
                queue_time=(md.prefill_started_at - md.queued_at) if md.prefill_started_at else None,
                adapter=req.adapter,
            )
            for fn in list(self.observers):
                try:
                    fn(stats)
                except Exception:  # an observer's bug must not stall the driver
                    pass
