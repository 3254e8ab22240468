"""Chat prompts rendered with the model's own template, in a jinja2 sandbox (templates come from
downloaded files and must not reach Python internals)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidModelError, InvalidOptionError

__all__ = ["render_chat", "CHATML_TEMPLATE", "Message"]

Message = Mapping[str, str]

# Used only when a model ships no template (base models); the common default of llama.cpp.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
    env.filters["tojson"] = __import__("json").dumps
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[Message], bos_token: str, eos_token: str) -> str:
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidOptionError("each chat message needs a 'role' and a 'content'")
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as e:
        raise InvalidModelError(f"the model's chat template failed: {e}") from None
