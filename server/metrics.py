"""Prometheus text exposition of the server's counters, the model service's and each loaded engine's state."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import edgeinfer
from edgeinfer.service import ModelService

__all__ = ["HttpCounters", "ServiceGauges", "render"]


class HttpCounters:
    """Requests answered, by endpoint and status (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, int]] = collections.Counter()

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._counts[(endpoint, status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._counts)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class ServiceGauges:
    """The model service's own state: what it holds and what it did."""

    loaded: int
    reserved_bytes: int
    budget_bytes: int
    loads: int
    evictions: int
    expirations: int

    @classmethod
    def of(cls, service: ModelService) -> ServiceGauges:
        return cls(len(service.ps()), service.reserved, service.budget, service.loads, service.evictions,
                   service.expirations)


def render(models: Sequence[tuple[str, edgeinfer.BatchMetrics]], http: dict[tuple[str, int], int],
           service: ServiceGauges | None = None) -> str:
    """Every metric once, with a sample per loaded model (label `model`). A model's counters
    start again from 0 when it is loaded again (Prometheus reads that as a counter reset)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP edgeinfer_{name} {help_}")
        lines.append(f"# TYPE edgeinfer_{name} {kind}")
        for labels, value in samples:
            lines.append(f"edgeinfer_{name}{{{labels}}} {value:g}" if labels else f"edgeinfer_{name} {value:g}")

    def each(fn: Callable[[str, edgeinfer.BatchMetrics], list[tuple[str, float]]]) -> list[tuple[str, float]]:
        return [sample for model, m in models for sample in fn(f'model="{_escape(model)}"', m)]

    metric("http_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
           [(f'endpoint="{_escape(e)}",status="{s}"', n) for (e, s), n in sorted(http.items())])
    if service is not None:
        metric("models_loaded", "gauge", "Models held (loading, loaded or unloading).", [("", service.loaded)])
        metric("models_memory_bytes", "gauge", "Estimated memory of the models held.", [("", service.reserved_bytes)])
        metric("models_memory_budget_bytes", "gauge", "Memory the models may hold (--max-memory).",
               [("", service.budget_bytes)])
        metric("model_loads_total", "counter", "Models loaded.", [("", service.loads)])
        metric("model_evictions_total", "counter", "Idle models unloaded to make room.", [("", service.evictions)])
        metric("model_expirations_total", "counter", "Idle models unloaded when their keep_alive ran out.",
               [("", service.expirations)])
    metric("requests_submitted_total", "counter", "Generation requests queued.",
           each(lambda mod, m: [(mod, m.requests_submitted)]))
    metric("requests_finished_total", "counter", "Generation requests ended, by finish reason.",
           each(lambda mod, m: [(f'{mod},reason="{_escape(r)}"', n) for r, n in sorted(m.requests_finished.items())]))
    metric("prompt_tokens_total", "counter", "Prompt tokens of requests started.",
           each(lambda mod, m: [(mod, m.prompt_tokens)]))
    metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's cache.",
           each(lambda mod, m: [(mod, m.cached_prompt_tokens)]))
    metric("generated_tokens_total", "counter", "Tokens generated.", each(lambda mod, m: [(mod, m.generated_tokens)]))
    metric("queue_depth", "gauge", "Requests waiting for a free slot.", each(lambda mod, m: [(mod, m.queue_depth)]))
    metric("slots_busy", "gauge", "Slots running a request.", each(lambda mod, m: [(mod, m.active)]))
    metric("decode_steps_total", "counter", "llama_decode calls of the scheduler.", each(lambda mod, m: [(mod, m.steps)]))
    metric("decode_rows_total", "counter", "Rows decoded (prompt chunks, tokens and drafts).",
           each(lambda mod, m: [(mod, m.rows)]))
    metric("slot_decode_tokens_per_second", "gauge", "Decode speed of each slot's current or last request.",
           each(lambda mod, m: [(f'{mod},slot="{s.index}"', round(s.decode_tok_s, 3)) for s in m.slots]))
    metric("slot_cached_tokens", "gauge", "Tokens in each slot's KV cache.",
           each(lambda mod, m: [(f'{mod},slot="{s.index}"', s.cached_tokens) for s in m.slots]))
    metric("speculation_drafted_tokens_total", "counter", "Tokens proposed by prompt lookup.",
           each(lambda mod, m: [(mod, m.drafted)]))
    metric("speculation_accepted_tokens_total", "counter", "Drafted tokens the model accepted.",
           each(lambda mod, m: [(mod, m.accepted)]))
    metric("speculation_acceptance_ratio", "gauge", "Accepted / drafted since start.",
           each(lambda mod, m: [(mod, round(m.accepted / m.drafted, 4) if m.drafted else 0.0)]))
    metric("cost_curve_calibrating", "gauge", "1 while the idle measurement of the decode cost curve is unfinished.",
           each(lambda mod, m: [(mod, int(m.calibrating))]))
    return "\n".join(lines) + "\n"
