"""Which short system prompt makes the default model (SmolLM2-135M-Instruct Q4_1) answer common
questions, greedily: candidate prompts × a dozen questions, each scored honestly and simply.

A reply scores when it contains the expected fact (a case-insensitive word match) and ends by
itself (EOS) within --max-tokens tokens; a correct fact buried in 512 tokens of rambling does not
count. "none" is the model's own template default (SmolLM2's template adds "You are a helpful AI
assistant named SmolLM, trained by Hugging Face" when a chat has no system message).

    .venv/bin/python -m benchmarks.bench_default_prompt [--model REF] [--max-tokens 96] [--show]

The winner is edgeinfer.DEFAULT_SYSTEM_PROMPT (edgeinfer/default_model.py); the table is in
benchmarks/RESULTS.md, and tests/test_default_prompt.py checks the gain on a few of these questions.
"""

from __future__ import annotations

import argparse
import re

# (question, regex of the expected fact)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", r"paris"),
    ("How many days are in a week?", r"seven|7"),
    ("What is 2 + 2?", r"four|4"),
    ("What color is the sky on a clear day?", r"blue"),
    ("Who wrote Romeo and Juliet?", r"shakespeare"),
    ("What is the largest planet in our solar system?", r"jupiter"),
    ("At what temperature does water boil, in degrees Celsius?", r"100"),
    ("How many legs does a spider have?", r"eight|8"),
    ("What is the chemical formula of water?", r"h2o|h₂o"),
    ("What language is spoken in Spain?", r"spanish"),
    ("What is the opposite of hot?", r"cold"),
    ("How do you say hello in French?", r"bonjour"),
)

# Questions no candidate was chosen on: the winner must hold up here too.
HELD_OUT: tuple[tuple[str, str], ...] = (
    ("What is the capital of Japan?", r"tokyo"),
    ("How many hours are in a day?", r"24|twenty-four"),
    ("At what temperature does water freeze, in degrees Celsius?", r"0|zero"),
    ("Who painted the Mona Lisa?", r"leonardo|da vinci"),
    ("What gas do plants take from the air to make their food?", r"carbon dioxide|co2|co₂"),
    ("How many continents are there?", r"seven|7"),
    ("What is the largest ocean on Earth?", r"pacific"),
    ("What is 10 minus 3?", r"seven|7"),
    ("Which animal is known as the king of the jungle?", r"lions?"),
    ("What is the capital of Italy?", r"rome"),
)

# Longer requests, where a prompt that only asks for short answers would cripple the reply: each
# passes when its check holds on the reply (up to TASK_TOKENS tokens; ending by EOS is not required).
_FRUITS = r"apples?|bananas?|oranges?|grapes?|mangos?|mangoes|strawberr(?:y|ies)|pears?|cherr(?:y|ies)|peach(?:es)?|" \
          r"pineapples?|lemons?|kiwis?|watermelons?|blueberr(?:y|ies)|plums?|limes?"


def _three_fruits(text: str) -> bool:
    return len({m.lower().rstrip("s") for m in re.findall(rf"\b(?:{_FRUITS})\b", text, flags=re.I)}) >= 3


def _a_function(text: str) -> bool:
    return re.search(r"def \w+\([^)]*\):\s*\n\s+return\b", text) is not None


def _paragraphs(text: str) -> bool:  # at least two paragraphs of some length
    return len([p for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 20]) >= 2


TASKS: tuple[tuple[str, object], ...] = (
    ("List three fruits.", _three_fruits),
    ("Write a Python function that returns the sum of two numbers.", _a_function),
    ("Write a short story about a cat, in three paragraphs.", _paragraphs),
)
TASK_TOKENS = 200

# None: no system message (the template's own default).
CANDIDATES: tuple[str | None, ...] = (
    None,
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer in English, in one or two short sentences.",
    "Answer the question directly, briefly and accurately, in English.",
    "You are a concise assistant. Give the answer first, in English, then stop.",
    "You are a helpful assistant. Reply in English. Keep answers short: one or two sentences unless asked for more.",
    "Answer directly, briefly and accurately, in English.",
    "Be brief and accurate. Answer in English.",
    "Answer the question directly and accurately, in English, in one short sentence.",
)


def score(text: str, finish_reason: str, fact: str) -> tuple[bool, bool]:
    """(the fact is in the reply, the reply ended by EOS)."""
    return bool(re.search(rf"\b(?:{fact})\b", text, flags=re.I)), finish_reason == "eos"


def measure_tasks(engine, system: str | None, tasks=TASKS) -> list[dict]:  # noqa: ANN001
    import edgeinfer

    options = edgeinfer.GenerateOptions(max_tokens=TASK_TOKENS, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    rows = []
    for request, check in tasks:
        done = engine.chat([{"role": "user", "content": request}], options, system=system).result()
        rows.append({"question": request, "text": done.text, "tokens": done.stats.generated_tokens,
                     "correct": check(done.text), "ended": done.finish_reason == "eos"})
    return rows


def measure(engine, system: str | None, max_tokens: int, questions=QUESTIONS) -> list[dict]:  # noqa: ANN001
    import edgeinfer

    options = edgeinfer.GenerateOptions(max_tokens=max_tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    rows = []
    for question, fact in questions:
        done = engine.chat([{"role": "user", "content": question}], options, system=system).result()
        correct, ended = score(done.text, done.finish_reason, fact)
        rows.append({"question": question, "text": done.text, "tokens": done.stats.generated_tokens,
                     "correct": correct, "ended": ended})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="store ref or GGUF path (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", action="store_true", help="print every reply")
    args = ap.parse_args()

    import edgeinfer

    def cells(rows: list[dict]) -> str:
        n = len(rows)
        both = sum(r["correct"] and r["ended"] for r in rows)
        mean = sum(r["tokens"] for r in rows) / n
        return (f"{sum(r['correct'] for r in rows)}/{n} | {sum(r['ended'] for r in rows)}/{n} | **{both}/{n}** "
                f"| {mean:.0f}")

    print(f"{len(QUESTIONS)} questions the prompts were chosen on, {len(HELD_OUT)} held out; greedy, "
          f"at most {args.max_tokens} tokens\n")
    print("| system prompt | fact | ended by EOS | **score** | mean tokens | held out: fact | ended | **score** "
          f"| mean tokens | longer requests met (of {len(TASKS)}) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with edgeinfer.load(args.model, n_ctx=1024, n_threads=args.threads) as engine:
        for system in CANDIDATES:
            tuned = measure(engine, system, args.max_tokens, QUESTIONS)
            held = measure(engine, system, args.max_tokens, HELD_OUT)
            tasks = measure_tasks(engine, system)
            label = "none (the template's default)" if system is None else f"`{system}`"
            print(f"| {label} | {cells(tuned)} | {cells(held)} | {sum(r['correct'] for r in tasks)} |", flush=True)
            if args.show:
                for r in tuned + held + tasks:
                    mark = ("F" if r["correct"] else "-") + ("E" if r["ended"] else "-")
                    print(f"    {mark} {r['question']} → {r['text'][:160]!r}")


if __name__ == "__main__":
    main()
