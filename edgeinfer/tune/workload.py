"""The work `tune` measures on: prompts in JSONL, one request per line.

    {"name": "code edit", "kind": "code-edit", "max_tokens": 160, "messages": [{"role": "user", "content": "..."}]}
    {"prompt": "Summarize: ...", "max_tokens": 64}        # a prompt alone is one user message

Each line is a chat request (`messages` as `Engine.chat` takes them, or `prompt`), answered greedily
(temperature 0: every setup of one quant writes the same tokens, so their times compare like for
like) up to `max_tokens` (default 128). `name` and `kind` only label tables.

The built-in workload (`edgeinfer/data/tune_workload.jsonl`, written for edgeinfer and shipped under
its Apache-2.0 licence; nothing in it is copied from elsewhere) is four requests, one of each kind
a local model is asked for most:
- chat: a short explanation in prose (64 tokens);
- code edit: a 25-line Python function to rewrite with one change and a rename, answered whole
  (160 tokens: most of the answer copies the prompt, as real edits do);
- extraction: an order in a customer's message to JSON (96 tokens);
- long context: a 680-word lab handbook and a question that needs two passages quoted (about
  900 prompt tokens, 64 generated).

384 tokens in all: on the 1.5B on 2 cores the whole workload is about a minute a setup, which is
what the last stage of a 10-minute search can afford twice for two setups.

A file is bounded before anything runs: at most 1 MiB, 64 requests, 4,096 tokens each; a bad line
is one error naming its line number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..engine.core.options import GenerateOptions, SamplingOptions, SpeculationOptions
from ..errors import InvalidOptionError

__all__ = ["WorkItem", "Workload", "load_workload", "default_workload", "MAX_ITEMS", "MAX_BYTES", "MAX_TOKENS"]

MAX_BYTES = 1 << 20
MAX_ITEMS = 64
MAX_TOKENS = 4096
_DEFAULT_MAX_TOKENS = 128
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class WorkItem:
    name: str
    kind: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int

    def chat_messages(self, model: str | Path | None) -> list[dict[str, str]]:
        """The request as `run MODEL` sends it: with the model's default system prompt, when it has
        one and the request sets none (the default model's, edgeinfer.default_system_prompt)."""
        from ..default_model import default_system_prompt

        messages = [dict(m) for m in self.messages]
        system = default_system_prompt(model)
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def options(self, speculation: SpeculationOptions, max_tokens: int | None = None) -> GenerateOptions:
        """Greedy, up to `max_tokens` (default: the request's own)."""
        return GenerateOptions(max_tokens=max_tokens or self.max_tokens, sampling=SamplingOptions(temperature=0.0),
                               speculation=speculation).validate()


@dataclass(frozen=True)
class Workload:
    name: str  # "built-in" or the file's name
    items: tuple[WorkItem, ...]
    sha256: str  # of the file's bytes: measurements are kept per workload

    @property
    def total_tokens(self) -> int:
        return sum(i.max_tokens for i in self.items)

    def describe(self) -> str:
        kinds = ", ".join(f"{i.name} ({i.max_tokens})" for i in self.items)
        return f"{self.name}: {len(self.items)} requests — {kinds}"


def _item(data: Any, where: str) -> WorkItem:
    def bad(why: str) -> InvalidOptionError:
        return InvalidOptionError(f"{where}: {why}")

    if not isinstance(data, dict):
        raise bad("each line must be a JSON object")
    unknown = set(data) - {"name", "kind", "messages", "prompt", "max_tokens"}
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))} (known: name, kind, messages, prompt, max_tokens)")
    if ("messages" in data) == ("prompt" in data):
        raise bad("give either 'messages' or 'prompt'")
    if "prompt" in data:
        if not isinstance(data["prompt"], str) or not data["prompt"].strip():
            raise bad("'prompt' must be a non-empty string")
        messages: list[dict[str, str]] = [{"role": "user", "content": data["prompt"]}]
    else:
        raw = data["messages"]
        if not isinstance(raw, list) or not raw:
            raise bad("'messages' must be a non-empty list")
        messages = []
        for m in raw:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise bad("each message must be {\"role\": system|user|assistant, \"content\": TEXT}")
            messages.append({"role": m["role"], "content": m["content"]})
        if messages[-1]["role"] != "user":
            raise bad("the last message must be the user's")
    max_tokens = data.get("max_tokens", _DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise bad(f"'max_tokens' must be an integer in [1, {MAX_TOKENS}], got {max_tokens!r}")
    name, kind = data.get("name", ""), data.get("kind", "")
    if not isinstance(name, str) or not isinstance(kind, str):
        raise bad("'name' and 'kind' must be strings")
    return WorkItem(name=name[:40] or where.rpartition(" ")[2], kind=kind[:40] or "chat", messages=tuple(messages),
                    max_tokens=max_tokens)


def parse_workload(raw: bytes, name: str) -> Workload:
    if len(raw) > MAX_BYTES:
        raise InvalidOptionError(f"workload {name} is larger than {MAX_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidOptionError(f"workload {name} is not UTF-8 (byte offset {e.start})") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(items) == MAX_ITEMS:
            raise InvalidOptionError(f"workload {name} has more than {MAX_ITEMS} requests")
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidOptionError(f"workload {name} line {n}: not JSON ({getattr(e, 'msg', 'nested too deeply')})") from None
        items.append(_item(data, f"workload {name} line {n}"))
    if not items:
        raise InvalidOptionError(f"workload {name} holds no requests (one JSON object a line)")
    return Workload(name=name, items=tuple(items), sha256=hashlib.sha256(raw).hexdigest())


def load_workload(path: str | Path) -> Workload:
    """A JSONL workload file, checked (InvalidOptionError naming the line when it is wrong)."""
    p = Path(path).expanduser()
    try:
        if not p.is_file():
            raise InvalidOptionError(f"no workload file {p}" + (" (a directory?)" if p.exists() else ""))
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InvalidOptionError(f"cannot read workload {p}: {e.strerror or e}") from None
    return parse_workload(raw, p.name)


def default_workload() -> Workload:
    """The built-in mix: chat, code edit, extraction, long context (see the module)."""
    raw = (resources.files("edgeinfer") / "data" / "tune_workload.jsonl").read_bytes()
    return parse_workload(raw, "built-in")
