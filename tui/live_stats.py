"""The stats line under the chat: a snapshot of the library's GenerationStats, taken in the worker."""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer import GenerationStats, SpeculationProgress

__all__ = ["LiveStats", "preparing_line", "duration_text"]

_FINISH_WORDS = {"cancelled": "cancelled", "length": "max tokens"}


@dataclass(frozen=True)
class LiveStats:
    """A generation's numbers at one moment."""

    generated: int = 0
    tok_s: float = 0.0
    method: str | None = None
    acceptance: float | None = None
    mean_len: float | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, stats: GenerationStats | None, own_rate: float = 0.0, finish_reason: str | None = None) -> LiveStats:
        """From the library's stats; `own_rate` (tokens/s seen by the UI) stands in until the
        library has measured a decode rate (it needs two tokens)."""
        if stats is None:
            return cls(tok_s=own_rate, finish_reason=finish_reason)
        spec = stats.speculation
        method = acceptance = mean_len = None
        if spec is not None:
            # A drafter that switched itself off (too slow to pay) says so instead of showing 0 %.
            method = f"{spec.method} off" if spec.note else spec.method
            acceptance = spec.acceptance_rate if spec.drafted else None
            mean_len = spec.mean_accepted_len if spec.steps else None
        rate = stats.decode_tok_s
        return cls(
            generated=stats.generated_tokens,
            tok_s=rate if rate > 0 else own_rate,
            method=method,
            acceptance=acceptance,
            mean_len=mean_len,
            ttft_s=stats.ttft_s or None,
            finish_reason=finish_reason,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
        )

    def line(self, model: str) -> str:
        """The stats line, most useful first (a narrow terminal cuts the end)."""
        parts = [f"{self.generated} tokens", f"{self.tok_s:.1f} tok/s"]
        if self.method and self.method != "off":
            if self.acceptance is not None:
                parts.append(f"{self.method} {self.acceptance * 100:.0f}% accepted, mean {self.mean_len or 0:.1f}")
            else:
                parts.append(self.method)
        if self.ttft_s:
            # a prompt read from the cache (Regenerate, the next turn) answers in milliseconds
            cached = " (prompt cached)" if self.prompt_tokens and self.cached_tokens >= 0.9 * self.prompt_tokens else ""
            parts.append(f"ttft {duration_text(self.ttft_s)}{cached}")
        if self.finish_reason:
            parts.append(_FINISH_WORDS.get(self.finish_reason, "done"))
        parts.append(model)
        return " · ".join(parts)


def duration_text(seconds: float) -> str:
    """A time as it reads: 1.05 s, 120 ms, 4.2 ms (never "0.00 s", which reads as broken)."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 0.01:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds * 1000:.1f} ms" if seconds >= 0.0001 else "<0.1 ms"


def preparing_line(model: str, ev: SpeculationProgress) -> str:
    """The stats line while speculation is prepared before the first token (a self-draft copy
    being quantized can take a while on first use): what is happening and how far it is."""
    what = f"{ev.message}: {100 * ev.done // ev.total} %" if ev.total > 0 else ev.message
    return f"{model} · {what}"
