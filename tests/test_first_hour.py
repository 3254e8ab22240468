"""A new user's first hour (issue 26): the default model's first answers, `recommend` on a
dequantized copy, and the CLI's papercuts — each as the user meets it."""

from __future__ import annotations

import json

import pytest

# Questions of benchmarks/bench_default_prompt.py on which the template's own default fails (no
# answer, or no end within the budget) and the default system prompt was measured to answer.
FAILING_WITHOUT = (
    ("What is the capital of France?", r"paris"),
    ("What is the capital of Italy?", r"rome"),
    ("Who wrote Romeo and Juliet?", r"shakespeare"),
    ("What color is the sky on a clear day?", r"blue"),
)
BUDGET = 96  # tokens: the benchmark's --max-tokens


def _ask(capsys: pytest.CaptureFixture[str], question: str, *extra: str) -> dict:
    from edgeinfer.cli import main

    assert main(["run", question, "--temperature", "0", "-n", str(BUDGET), "--threads", "1", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_default_system_prompt_makes_the_default_model_answer(capsys: pytest.CaptureFixture[str]):
    """`edgeinfer run QUESTION` at temperature 0 answers common questions with the fact and ends by
    itself, where the model's template default (`--system ''`) rambles: "What is the capital of
    France?" gave 512 tokens of French."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.bench_default_prompt import score

    def passes(data: dict, fact: str) -> bool:
        return all(score(data["text"], data["finish_reason"], fact))

    with_default = [passes(_ask(capsys, q), fact) for q, fact in FAILING_WITHOUT]
    without = [passes(_ask(capsys, q, "--system", ""), fact) for q, fact in FAILING_WITHOUT]
    assert sum(with_default) >= 3 and sum(with_default) - sum(without) >= 2, (with_default, without)
    paris = _ask(capsys, FAILING_WITHOUT[0][0])
    assert "Paris" in paris["text"] and paris["finish_reason"] == "eos" and paris["tokens"] and len(paris["tokens"]) < 32


def test_default_system_prompt_is_the_default_models_only():
    """One source: the default model (any tag of it, or its shipped file) gets the measured prompt
    when a chat sets none; every other model keeps its own template's default."""
    import edgeinfer
    from edgeinfer.default_model import default_model_file

    assert edgeinfer.default_system_prompt(None) == edgeinfer.DEFAULT_SYSTEM_PROMPT
    assert edgeinfer.default_system_prompt(edgeinfer.DEFAULT_MODEL) == edgeinfer.DEFAULT_SYSTEM_PROMPT
    assert edgeinfer.default_system_prompt("smollm2-135m-instruct:f16") == edgeinfer.DEFAULT_SYSTEM_PROMPT
    assert edgeinfer.default_system_prompt(default_model_file()) == edgeinfer.DEFAULT_SYSTEM_PROMPT
    assert edgeinfer.default_system_prompt("qwen2.5-coder-1.5b-instruct:q4_k_m") is None
    assert edgeinfer.default_system_prompt("/elsewhere/model.gguf") is None
