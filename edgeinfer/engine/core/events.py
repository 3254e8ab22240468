"""Typed events a generation streams, and the statistics it ends with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "TokenEvent",
    "ScoredTokenEvent",
    "DoneEvent",
    "SpeculationProgress",
    "PrefillProgress",
    "GenerationStats",
    "SpeculationStats",
    "FinishReason",
    "Event",
    "ToolCall",
    "ToolCallEvent",
]

FinishReason = Literal["eos", "stop", "length", "cancelled", "tool_calls"]


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: `arguments` is the JSON text of its arguments, as the model
    wrote it (OpenAI's `tool_calls[i].function`; it parses whenever a grammar enforced the call)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A piece of the tool call number `index` of this reply (engine/chat/tools.py parses them out of the
    text): the first event of a call has `arguments == ""`, later ones each carry the next piece of
    the arguments' JSON text (OpenAI's streamed `tool_calls[i].function.arguments` chunks), and the
    last one also the whole `call`."""

    index: int
    id: str
    name: str
    arguments: str = ""
    call: ToolCall | None = None


@dataclass(frozen=True)
class SpeculationProgress:
    """Speculation being prepared before a request can start: a self-draft copy of the model
    being quantized (stage "quantize", `done`/`total` tensors), a draft model being loaded
    ("load"), then "ready". `Engine.prepare_speculation` reports these to its callback; a
    generation whose speculation was not prepared yields them before its first token."""

    stage: Literal["quantize", "load", "ready"]
    message: str
    done: int = 0
    total: int = 0  # 0: unknown


@dataclass(frozen=True)
class PrefillProgress:
    """The prompt being read before the first token: `done` of `total` prompt tokens are in the
    KV cache (cached ones included). Sent after each prefill step of a prompt that takes more
    than one step, so a front end can show progress on a long prompt."""

    done: int
    total: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the newly printable text (may be empty while a multi-byte
    character or a possible stop string is pending). `drafted` is True when the token was proposed
    by the drafter and accepted by the target."""

    token: int
    text: str
    drafted: bool = False


@dataclass(frozen=True)
class ScoredTokenEvent(TokenEvent):
    """A TokenEvent with the model's log-probability of the token (before sampling settings) and
    the `top` most likely alternatives as (token, logprob), when the request asked for them."""

    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class SpeculationStats:
    method: str = "off"
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification decodes that carried at least one drafted token
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    plain_steps: int = 0  # steps where the policy drafted nothing (no match, or it would not pay)
    note: str = ""  # why a drafter was switched off, when it was
    draft_cost: float = 0.0  # a draft model's or head's drafted token, in target steps (measured; 0: none)
    remembered: int = 0  # accepted tokens the suffix drafter drew from earlier answers (its scope's)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.per_position_drafted) < n_drafted:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(n_drafted):
            self.per_position_drafted[i] += 1
            if i < n_accepted:
                self.per_position_accepted[i] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            **({"draft_cost": self.draft_cost} if self.draft_cost else {}),
            **({"remembered": self.remembered} if self.remembered else {}),
            **({"note": self.note} if self.note else {}),
        }


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the previous request's KV cache
    generated_tokens: int = 0
    ttft_s: float = 0.0  # request queued to first generated token (waiting for a slot and prefill included)
    queue_s: float = 0.0  # waiting for a slot (another request held the engine, or every slot was busy)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token to last token
    speculation: SpeculationStats | None = None

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens actually processed (cached ones excluded) per second."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "queue_s": round(self.queue_s, 6),
            "prefill_tok_s": round(self.prefill_tok_s, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
        }
        if self.speculation is not None:
            out["speculation"] = self.speculation.to_dict()
        return out


@dataclass(frozen=True)
class DoneEvent:
    """The last event of every generation, also after a cancel."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls made (`text` is then the rest, the content)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stats"] = self.stats.to_dict()
        return d


Event = TokenEvent | ToolCallEvent | SpeculationProgress | PrefillProgress | DoneEvent
