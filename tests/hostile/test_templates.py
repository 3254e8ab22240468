"""Hostile chat templates: each ends in one ChatTemplateError line, within its limits, and the
process neither hangs nor takes gigabytes."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from edgeinfer.engine.chat.template import CHATML_TEMPLATE, TemplateLimits, render_chat
from edgeinfer.errors import ChatTemplateError, EdgeInferError, InvalidOptionError

MESSAGES = [{"role": "user", "content": "Hi"}]
LIMITS = TemplateLimits(seconds=0.5, max_chars=100_000)

# name -> (template, what the one-line message must mention)
HOSTILE = {
    "nested range loops (a hang)": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    "nested loops over a list": (
        "{% set l = range(50000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}", "longer than"),
    "endless recursion of a loop": (
        "{% for m in messages recursive %}{{ loop([m, m]) }}{% endfor %}", ""),
    "string repetition": ("{{ 'x' * 10**8 }}", "output limit"),
    "list repetition": ("{{ ([1] * 10**9)|length }}", "output limit"),
    "huge power": ("{{ 7 ** 100000000 }}", "too large"),
    "format width via getattr": ("{% set f = '{:>1000000000}'.format %}{{ f('x') }}", "width"),
    "concatenation doubling": (
        "{% set ns = namespace(s='x' * 50000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "output limit"),
    "plus doubling": (
        "{% set ns = namespace(s='x' * 50000) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "output limit"),
    "huge output in a loop": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output limit"),
    "center width": ("{{ 'x'|center(10**9) }}", "output limit"),
    "ljust method": ("{{ 'x'.ljust(10**9) }}", "output limit"),
    "percent width": ("{{ '%1000000000s' % 'x' }}", "width"),
    "format width": ("{{ '{:>1000000000}'.format('x') }}", "width"),
    "replace blow-up": ("{% set s = 'a' * 90000 %}{{ s.replace('a', s) }}", "replace"),
    "join of shared big strings": ("{{ (['x' * 90000] * 1000)|join }}", "output limit"),
    "string of a big list": ("{{ (['x' * 90000] * 1000)|string }}", "output limit"),
    "OverflowError": ("{{ range(10**7) }}", ""),
    "float overflow": ("{{ 10.0 ** 400 }}", "OverflowError"),
    "RecursionError": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "TypeError": ("{{ messages + 1 }}", "TypeError"),
    "ValueError": ("{{ 'abc'.index('z') }}", "ValueError"),
    "ZeroDivisionError": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "syntax error": ("{% for m in messages %}{{ m['content'] }", "syntax error"),
    "undefined method": ("{{ messages[0].nothing.deeper }}", "Undefined"),
    "raise_exception": ("{{ raise_exception('this template refuses') }}", "this template refuses"),
    "sandbox escape attempt": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ""),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_line_error_within_limits(name):
    template, mentions = HOSTILE[name]
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError) as info:
            render_chat(template, MESSAGES, "<s>", "</s>", name="evil.gguf", limits=LIMITS)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("chat template of evil.gguf failed: ")
    assert mentions in message
    assert elapsed < LIMITS.seconds + 1.5  # the deadline plus scheduling slack on a shared machine
    assert peak < 64 * LIMITS.max_chars  # no gigabytes: a bounded multiple of the output limit


@pytest.mark.slow  # waits the whole default 2 s
def test_default_limits_stop_a_hang():
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 2 s"):
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    MESSAGES, "", "", name="m")
    assert time.monotonic() - started < 5


def test_ordinary_templates_render_unchanged():
    text = render_chat(CHATML_TEMPLATE, MESSAGES, "", "")
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # the built-in name renders the same template
    assert render_chat("chatml", MESSAGES, "", "") == text
    # numbers, filters and formatting that stay within the limits still work
    tpl = "{{ '%05d' % 42 }} {{ '{:>6}'.format('ab') }} {{ 'x'|center(7) }} {{ ('ab' * 3)|upper }} {{ 2 ** 10 }}"
    assert render_chat(tpl, MESSAGES, "", "") == "00042     ab    x    ABABAB 1024"


def test_output_exactly_at_the_limit_is_accepted():
    limits = TemplateLimits(seconds=2, max_chars=1000)
    assert render_chat("{{ 'z' * 1000 }}", MESSAGES, "", "", limits=limits) == "z" * 1000
    with pytest.raises(ChatTemplateError, match="output limit"):
        render_chat("{{ 'z' * 1001 }}", MESSAGES, "", "", limits=limits)


def test_the_deadline_leaves_no_trace_function_behind():
    import sys

    before = sys.gettrace()
    with pytest.raises(ChatTemplateError):
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    MESSAGES, "", "", limits=TemplateLimits(seconds=0.2))
    render_chat(CHATML_TEMPLATE, MESSAGES, "", "")
    assert sys.gettrace() is before


@pytest.mark.parametrize("limits", [TemplateLimits(seconds=0), TemplateLimits(max_chars=-1),
                                    TemplateLimits(seconds=float("nan"))])
def test_bad_limits_are_option_errors(limits):
    with pytest.raises(InvalidOptionError):
        render_chat(CHATML_TEMPLATE, MESSAGES, "", "", limits=limits)


def test_bad_messages_are_option_errors():
    with pytest.raises(InvalidOptionError):
        render_chat(CHATML_TEMPLATE, [{"role": "user"}], "", "")
    with pytest.raises(InvalidOptionError):
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": 5}], "", "")


def test_template_error_is_an_edgeinfer_error():
    assert issubclass(ChatTemplateError, EdgeInferError)


def test_engine_with_an_unusable_template_says_so_and_chatml_is_there_on_request(tmp_path):
    """A model whose own template is broken: `chat` fails in one line, the engine stays usable,
    and the built-in ChatML template works when asked for."""
    from gguf import GGUFValueType

    import edgeinfer

    from .gguf_samples import write_model

    broken = "{% for m in messages %}{{ m['content'] }"
    path = write_model(tmp_path / "broken.gguf", meta={"tokenizer.chat_template": (broken, GGUFValueType.STRING)})
    with edgeinfer.load(path, n_ctx=64, n_threads=1) as engine:
        with pytest.raises(ChatTemplateError, match="^chat template of broken.gguf failed: syntax error") as info:
            engine.chat(MESSAGES)
        assert "\n" not in str(info.value)
        engine.chat_template = "chatml"
        assert engine.render_chat(MESSAGES).startswith("<|im_start|>user\nHi<|im_end|>\n")
        done = engine.chat(MESSAGES, edgeinfer.GenerateOptions(max_tokens=2)).result()
        assert done.tokens
        with pytest.raises(InvalidOptionError):
            engine.chat_template = ""
