"""`edgeinfer run`: stream an answer from a model."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from ._common import common_options

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    import edgeinfer

    p = sub.add_parser(
        "run",
        parents=[common_options()],
        help="generate text with a model (streams to stdout)",
        description="Generate text. With one positional argument it is the prompt unless it names a model; "
        "with none, the prompt is read from -f FILE or standard input. No model means the default model.",
    )
    p.add_argument("args", nargs="*", metavar="[MODEL] [PROMPT]", help="model (store name or .gguf path) and prompt")
    p.add_argument("-f", "--file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--system", help="system prompt (chat mode)")
    p.add_argument("--raw", action="store_true", help="raw completion: no chat template")
    sampling, generate = edgeinfer.DEFAULT_SAMPLING, edgeinfer.DEFAULT_GENERATE  # the library's defaults
    p.add_argument("--max-tokens", "-n", type=int, default=generate.max_tokens)
    p.add_argument("--temperature", "--temp", type=float, default=sampling.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=sampling.top_k)
    p.add_argument("--top-p", type=float, default=sampling.top_p)
    p.add_argument("--min-p", type=float, default=sampling.min_p)
    p.add_argument("--repeat-penalty", type=float, default=sampling.repeat_penalty)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ctx", type=int, help="context size in tokens (default: min(model's, 4096))")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--kv-type", default="f16", help="KV-cache type: f16, q8_0, q4_0")
    p.add_argument("--speculate", default="off", metavar="SPEC",
                   help="off | lookup | auto | draft=MODEL | self=Q3_K_M (output is unchanged, speed may be)")
    p.add_argument("--draft-max", type=int,
                   help=f"longest draft per step (default {edgeinfer.DEFAULT_SPECULATION.draft_max})")
    p.add_argument("--draft-min", type=int, help="shortest draft worth verifying")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.set_defaults(func=run)


def _split_model_and_prompt(args: argparse.Namespace) -> tuple[str | None, str | None]:
    import edgeinfer

    pos = list(args.args)
    if len(pos) > 2:
        raise edgeinfer.InvalidOptionError("too many arguments: expected [MODEL] [PROMPT] (quote the prompt)")
    if len(pos) == 2:
        return pos[0], pos[1]
    if len(pos) == 1:
        if _names_a_model(pos[0]):
            return pos[0], None
        return None, pos[0]
    return None, None


def _names_a_model(text: str) -> bool:
    import os

    import edgeinfer

    if text.endswith(".gguf") or os.path.isfile(text):
        return True
    if any(c.isspace() for c in text):
        return False
    try:
        edgeinfer.Store().get(text)
        return True
    except edgeinfer.ModelNotFoundError:
        return False


def _read_prompt(args: argparse.Namespace, prompt: str | None) -> str:
    import edgeinfer

    if args.file:
        if prompt is not None:
            raise edgeinfer.InvalidOptionError("give the prompt either as an argument or with -f, not both")
        try:
            if args.file == "-":
                return sys.stdin.read()
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise edgeinfer.InvalidOptionError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    if prompt is not None:
        return prompt
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise edgeinfer.InvalidOptionError("no prompt: give one as an argument, with -f FILE, or on standard input")


def _prepare_speculation(engine, speculation) -> None:  # noqa: ANN001 - edgeinfer types, imported lazily
    """Make the draft model ready before generating, with progress on stderr: a self-draft copy
    is quantized on first use, which must not look like a hung request."""
    from ._common import ProgressBar

    bar = None

    def on_progress(event) -> None:  # noqa: ANN001
        nonlocal bar
        if event.stage == "quantize":
            if bar is None:
                bar = ProgressBar(event.message, event.total or None, unit=" tensors")
            bar.update(event.done, event.total or None)

    engine.prepare_speculation(speculation, progress=on_progress)
    if bar is not None:
        bar.close()


def run(args: argparse.Namespace) -> int:
    import edgeinfer

    model, prompt = _split_model_and_prompt(args)
    text = _read_prompt(args, prompt)
    if not text.strip():
        raise edgeinfer.InvalidOptionError("the prompt is empty")
    speculation = edgeinfer.SpeculationOptions.parse(args.speculate, draft_max=args.draft_max, draft_min=args.draft_min)
    options = edgeinfer.GenerateOptions(
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        sampling=edgeinfer.SamplingOptions(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repeat_penalty=args.repeat_penalty,
            seed=args.seed,
        ),
        speculation=speculation,
    ).validate()
    load = edgeinfer.LoadOptions(n_ctx=args.ctx, n_threads=args.threads, kv_type=args.kv_type).validate()
    with edgeinfer.load(model, load) as engine:
        _prepare_speculation(engine, options.speculation)
        if args.raw:
            gen = engine.generate(text, options)
        else:
            messages = [{"role": "user", "content": text}]
            gen = engine.chat(messages, options, system=args.system)
        # Ctrl-C cancels the generation (also inside a long prompt) and exits 130; a second one
        # stops at once.
        def on_interrupt(_signum: int, _frame: object) -> None:
            if gen.cancelled:
                raise KeyboardInterrupt
            gen.cancel()

        previous = signal.signal(signal.SIGINT, on_interrupt)
        try:
            for event in gen:
                if isinstance(event, edgeinfer.TokenEvent) and not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        finally:
            signal.signal(signal.SIGINT, previous)
        done = gen.done
        assert done is not None
        if done.finish_reason == "cancelled":
            if not args.json:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print("edgeinfer: interrupted", file=sys.stderr)
            return 130
        if args.json:
            print(json.dumps({"model": engine.name, "text": done.text, "tokens": done.tokens,
                              "finish_reason": done.finish_reason, "stats": done.stats.to_dict()}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            s = done.stats
            line = (f"[{engine.name}: {s.prompt_tokens} prompt tokens, {s.generated_tokens} generated, "
                    f"ttft {s.ttft_s:.2f}s, prefill {s.prefill_tok_s:.0f} tok/s, decode {s.decode_tok_s:.1f} tok/s")
            if s.speculation is not None:
                sp = s.speculation
                line += (f", {sp.method}: {sp.accepted}/{sp.drafted} drafts accepted "
                         f"({sp.acceptance_rate:.0%}), mean run {sp.mean_accepted_len:.2f}")
                if sp.note:
                    line += f"; {sp.note}"
            print(line + "]", file=sys.stderr)
    return 0
