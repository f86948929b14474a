"""The serving benchmark's report: one request's result, the run's summary (mean / p50 / p99 of TTFT, TPOT,
ITL and latency; throughput) and its text form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    status: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = sorted(values)

    def pct(p: float) -> float:
        k = (len(v) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": sum(v) / len(v), "p50": pct(0.5), "p99": pct(0.99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "statuses": statuses,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2e_s": _stats([r.latency for r in ok if r.latency is not None]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def _fmt(summary: dict[str, Any]) -> str:
    def ms(d: dict[str, float | None]) -> str:
        return " / ".join("-" if d[k] is None else f"{d[k] * 1000:.1f}" for k in ("mean", "p50", "p99"))

    return "\n".join(
        [
            f"requests            {summary['completed']}/{summary['requests']} ok   statuses {summary['statuses']}",
            f"duration            {summary['duration_s']:.2f} s",
            f"request throughput  {summary['request_throughput']:.2f} req/s",
            f"output throughput   {summary['output_token_throughput']:.1f} tok/s "
            f"(total incl. prompt {summary['total_token_throughput']:.1f} tok/s)",
            f"TTFT  ms mean/p50/p99  {ms(summary['ttft_s'])}",
            f"TPOT  ms mean/p50/p99  {ms(summary['tpot_s'])}",
            f"ITL   ms mean/p50/p99  {ms(summary['itl_s'])}",
            f"E2E   ms mean/p50/p99  {ms(summary['e2e_s'])}",
        ]
        + ([f"errors              {summary['errors']}"] if summary["errors"] else [])
    )
