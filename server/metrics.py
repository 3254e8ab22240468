"""Prometheus text exposition of the server's counters and the engine's state."""

from __future__ import annotations

import collections
import threading

import edgeinfer

__all__ = ["HttpCounters", "render"]


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


def render(model: str, m: edgeinfer.BatchMetrics, http: dict[tuple[str, int], int]) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP edgeinfer_{name} {help_}")
        lines.append(f"# TYPE edgeinfer_{name} {kind}")
        for labels, value in samples:
            lines.append(f"edgeinfer_{name}{{{labels}}} {value:g}" if labels else f"edgeinfer_{name} {value:g}")

    mod = f'model="{_escape(model)}"'
    metric("http_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
           [(f'endpoint="{_escape(e)}",status="{s}"', n) for (e, s), n in sorted(http.items())])
    metric("requests_submitted_total", "counter", "Generation requests queued.", [(mod, m.requests_submitted)])
    metric("requests_finished_total", "counter", "Generation requests ended, by finish reason.",
           [(f'{mod},reason="{_escape(r)}"', n) for r, n in sorted(m.requests_finished.items())])
    metric("prompt_tokens_total", "counter", "Prompt tokens of requests started.", [(mod, m.prompt_tokens)])
    metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's cache.",
           [(mod, m.cached_prompt_tokens)])
    metric("generated_tokens_total", "counter", "Tokens generated.", [(mod, m.generated_tokens)])
    metric("queue_depth", "gauge", "Requests waiting for a free slot.", [(mod, m.queue_depth)])
    metric("slots_busy", "gauge", "Slots running a request.", [(mod, m.active)])
    metric("decode_steps_total", "counter", "llama_decode calls of the scheduler.", [(mod, m.steps)])
    metric("decode_rows_total", "counter", "Rows decoded (prompt chunks, tokens and drafts).", [(mod, m.rows)])
    metric("slot_decode_tokens_per_second", "gauge", "Decode speed of each slot's current or last request.",
           [(f'{mod},slot="{s.index}"', round(s.decode_tok_s, 3)) for s in m.slots])
    metric("slot_cached_tokens", "gauge", "Tokens in each slot's KV cache.",
           [(f'{mod},slot="{s.index}"', s.cached_tokens) for s in m.slots])
    metric("speculation_drafted_tokens_total", "counter", "Tokens proposed by prompt lookup.", [(mod, m.drafted)])
    metric("speculation_accepted_tokens_total", "counter", "Drafted tokens the model accepted.", [(mod, m.accepted)])
    metric("speculation_acceptance_ratio", "gauge", "Accepted / drafted since start.",
           [(mod, round(m.accepted / m.drafted, 4) if m.drafted else 0.0)])
    metric("cost_curve_calibrating", "gauge", "1 while the idle measurement of the decode cost curve is unfinished.",
           [(mod, int(m.calibrating))])
    return "\n".join(lines) + "\n"
