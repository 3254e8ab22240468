"""Per-chat settings: system prompt, sampling, speculation and KV-cache types, stored as JSON with
the chat.

The defaults are the library's own (edgeinfer.DEFAULT_GENERATE, DEFAULT_SAMPLING,
DEFAULT_SPECULATION, DEFAULT_LOAD): a chat starts with what `edgeinfer run` and the Python API use.
The KV-cache types are load options: the model host reloads the model when they change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import edgeinfer

__all__ = ["ChatSettings", "SpeculationSettings", "SPECULATION_CHOICES", "kv_label", "kv_load_options"]

# (method, label) pairs, in the order the speculation panel shows them.
SPECULATION_CHOICES: tuple[tuple[str, str], ...] = (
    ("off", "Off"),
    ("lookup", "Prompt lookup (n-grams)"),
    ("suffix", "Suffix tree (earlier answers)"),
    ("draft", "Draft model"),
    ("self", "Self-draft (quantized copy)"),
    ("auto", "Auto (pick what pays)"),
    ("medusa", "Medusa heads (a file)"),
)

_GENERATE = edgeinfer.DEFAULT_GENERATE
_SAMPLING = edgeinfer.DEFAULT_SAMPLING
_SPECULATION = edgeinfer.DEFAULT_SPECULATION
_KV_K, _KV_V = edgeinfer.DEFAULT_LOAD.kv_types


def kv_label(kv_types: tuple[str, str]) -> str:
    """'q8_0' when K and V share a type, else 'K/V' ('q8_0/f16'), as `edgeinfer fit` writes it."""
    k, v = kv_types
    return k if k == v else f"{k}/{v}"


def kv_load_options(kv_types: tuple[str, str], base: edgeinfer.LoadOptions | None = None) -> edgeinfer.LoadOptions:
    """`base` (context, threads: `edgeinfer chat`'s flags) with these K and V cache types, validated:
    an unknown type or a combination the library refuses is a one-line InvalidOptionError."""
    k, v = kv_types
    return replace(base or edgeinfer.DEFAULT_LOAD, kv_type=k, kv_type_k=k, kv_type_v=v).validate()


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass(frozen=True)
class SpeculationSettings:
    method: str = _SPECULATION.method
    draft_model: str | None = None
    self_quant: str = _SPECULATION.self_quant
    draft_max: int = _SPECULATION.draft_max

    def to_options(self) -> edgeinfer.SpeculationOptions:
        return edgeinfer.SpeculationOptions(
            method=self.method,
            draft_model=self.draft_model if self.method in ("draft", "medusa") else None,
            self_quant=self.self_quant,
            draft_max=self.draft_max,
        )

    def describe(self) -> str:
        """In words: 'lookup, drafts up to 16 tokens', 'self-draft Q3_K_M, …', 'off'."""
        if self.method == "off":
            return "off"
        what = {"draft": f"draft model {self.draft_model}", "self": f"self-draft {self.self_quant}",
                "medusa": f"Medusa heads {self.draft_model}"}.get(self.method, self.method)
        return f"{what}, drafts up to {self.draft_max} tokens"


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str = ""  # empty: the model's default (edgeinfer.default_system_prompt)
    temperature: float = _SAMPLING.temperature
    top_k: int = _SAMPLING.top_k
    top_p: float = _SAMPLING.top_p
    min_p: float = _SAMPLING.min_p
    repeat_penalty: float = _SAMPLING.repeat_penalty
    seed: int | None = _SAMPLING.seed
    max_tokens: int = _GENERATE.max_tokens
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    kv_type_k: str = _KV_K  # KV-cache types (edgeinfer.KV_TYPE_NAMES); settings saved before them load as f16
    kv_type_v: str = _KV_V

    @property
    def kv_types(self) -> tuple[str, str]:
        """The (K, V) cache types, as LoadOptions.kv_types spells them (a non-string from a
        damaged database becomes a name the host refuses with a one-line error)."""
        return str(self.kv_type_k).lower(), str(self.kv_type_v).lower()

    def with_kv_types(self, kv_types: tuple[str, str]) -> ChatSettings:
        return replace(self, kv_type_k=kv_types[0], kv_type_v=kv_types[1])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        data = dict(data or {})
        spec = _from_dict(SpeculationSettings, data.pop("speculation", None) or {})
        base = _from_dict(cls, data)
        return replace(base, speculation=spec)

    def to_options(self) -> edgeinfer.GenerateOptions:
        """edgeinfer.GenerateOptions, validated (raises InvalidOptionError with a one-line message)."""
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

    def system_for(self, model: str | None) -> str | None:
        """The system prompt sent to `model`: this chat's own, else the model's default
        (edgeinfer.default_system_prompt: the tiny default model's measured one; None for others)."""
        return self.system_prompt if self.system_prompt.strip() else edgeinfer.default_system_prompt(model)

    def messages(self, turns: list[tuple[str, str]] | list[dict[str, Any]], model: str | None = None) -> list[dict[str, Any]]:
        """The chat-template input for `model` (None: the default model): the system prompt (this
        chat's, else the model's default, if any) and the turns: (role, content) pairs, or messages
        as the engine takes them (tool calls and results: tui/tools.py's `conversation`)."""
        system = self.system_for(model)
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        return out + [dict(t) if isinstance(t, dict) else {"role": t[0], "content": t[1]} for t in turns]
