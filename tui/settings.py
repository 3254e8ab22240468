"""Per-chat settings: system prompt, sampling and speculation, stored as JSON with the chat."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["ChatSettings", "SpeculationSettings", "SPECULATION_CHOICES"]

# (method, label) pairs, in the order the speculation panel shows them.
SPECULATION_CHOICES: tuple[tuple[str, str], ...] = (
    ("off", "Off"),
    ("lookup", "Prompt lookup (n-grams)"),
    ("draft", "Draft model"),
    ("self", "Self-draft (quantized copy)"),
    ("auto", "Auto (pick what pays)"),
)


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass(frozen=True)
class SpeculationSettings:
    method: str = "off"
    draft_model: str | None = None
    self_quant: str = "Q3_K_M"
    draft_max: int = 16

    def to_options(self) -> Any:
        import edgeinfer

        return edgeinfer.SpeculationOptions(
            method=self.method,
            draft_model=self.draft_model if self.method == "draft" else None,
            self_quant=self.self_quant,
            draft_max=self.draft_max,
        )

    def describe(self) -> str:
        if self.method == "off":
            return "spec off"
        if self.method == "draft":
            return f"spec draft={self.draft_model} k≤{self.draft_max}"
        if self.method == "self":
            return f"spec self={self.self_quant} k≤{self.draft_max}"
        return f"spec {self.method} k≤{self.draft_max}"


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str = ""
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 512
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        data = dict(data or {})
        spec = _from_dict(SpeculationSettings, data.pop("speculation", None) or {})
        base = _from_dict(cls, data)
        return replace(base, speculation=spec)

    def to_options(self) -> Any:
        """edgeinfer.GenerateOptions, validated (raises InvalidOptionError with a one-line message)."""
        import edgeinfer

        return edgeinfer.GenerateOptions(
            max_tokens=self.max_tokens,
            sampling=edgeinfer.SamplingOptions(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                repeat_penalty=self.repeat_penalty,
                seed=self.seed,
            ),
            speculation=self.speculation.to_options(),
        ).validate()

    def messages(self, turns: list[tuple[str, str]]) -> list[dict[str, str]]:
        """The chat-template input: the system prompt (if any) and the (role, content) turns."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return out + [{"role": r, "content": c} for r, c in turns]
