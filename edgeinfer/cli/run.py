"""`edgeinfer run`: stream an answer from a model."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys

from ._common import INT32_MAX, ctx_type, add_encoding_option, add_kv_options, kv_options, argument_text, common_options, decode_bytes, int_range, threads_type, THREADS_HELP

from ._common import add_placement_options, add_suffix_memory_option, placement_options
from ._interactive import PrefillLine, stream_reply
from ._tuned import add_untuned_option, tuned_for

__all__ = ["register"]

_MAX_PROMPT_BYTES = 32 << 20  # far beyond any context; `-f /dev/zero` must end, not fill memory
# A lone argument shaped like a model reference is never silently taken as the prompt.
_MODEL_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*:[A-Za-z0-9][A-Za-z0-9._-]*$")


def register(sub: argparse._SubParsersAction) -> None:
    import edgeinfer

    p = sub.add_parser(
        "run",
        parents=[common_options()],
        intermixed=True,  # `run MODEL --temperature 0 "prompt"`
        help="generate text with a model (streams to stdout)",
        description="Generate text. With one positional argument it is the prompt unless it names a model "
        "(an argument shaped like NAME:TAG or *.gguf that names nothing is an error: use -p for such a prompt); "
        "with none, the prompt is read from -p, -f FILE or standard input, and at a terminal a line chat opens "
        "(/bye quits, /set system TEXT, \"\"\" for several lines). No model means the default model.",
    )
    p.add_argument("args", nargs="*", metavar="[MODEL] [PROMPT]", help="model (store name or .gguf path) and prompt")
    p.add_argument("-p", "--prompt", help="the prompt (also when it looks like a model name)")
    p.add_argument("-f", "--file", help="read the prompt from this file ('-' for stdin)")
    add_encoding_option(p)
    p.add_argument("--system", help="system prompt (chat mode; default: the model's own default — for the tiny "
                   "default model a short one measured to help it, edgeinfer.DEFAULT_SYSTEM_PROMPT; '' sends none)")
    p.add_argument("--raw", action="store_true", help="raw completion: no chat template")
    p.add_argument("--chatml", action="store_true", help="use the built-in ChatML template instead of the model's")
    sampling, generate = edgeinfer.DEFAULT_SAMPLING, edgeinfer.DEFAULT_GENERATE  # the library's defaults
    p.add_argument("--max-tokens", "-n", type=int_range(1, INT32_MAX), default=generate.max_tokens)
    p.add_argument("--temperature", "--temp", type=float, default=sampling.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int_range(0, INT32_MAX), default=sampling.top_k, help="0 = off (at most the vocabulary size)")
    p.add_argument("--top-p", type=float, default=sampling.top_p)
    p.add_argument("--min-p", type=float, default=sampling.min_p)
    p.add_argument("--repeat-penalty", type=float, default=sampling.repeat_penalty)
    p.add_argument("--presence-penalty", type=float, default=sampling.presence_penalty,
                   help="subtracted from the logit of each token already generated (-2..2, OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=sampling.frequency_penalty,
                   help="subtracted per occurrence of a token already generated (-2..2, OpenAI's)")
    p.add_argument("--repeat-last-n", type=int_range(0, INT32_MAX), default=sampling.repeat_last_n,
                   help="the penalties' window: the last N generated tokens (0 = penalties off)")
    p.add_argument("--seed", type=int_range(-(2**63), 2**63 - 1), help="any 64-bit integer (default: random)")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE|JSON",
                           help="constrain the output to JSON that validates against this schema (a file or inline JSON)")
    constrain.add_argument("--grammar", metavar="FILE", help="constrain the output to this GBNF grammar (llama.cpp's format)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ctx", type=ctx_type, help="context size in tokens (default: min(model's, 4096))")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    add_kv_options(p)
    add_placement_options(p, drafts=True)
    p.add_argument("--speculate", metavar="SPEC",
                   help="off (default, or the tuned profile's) | lookup | suffix | auto | auto=MODEL | draft=MODEL | "
                   "self=Q3_K_M | mtp | eagle3=MODEL | medusa=HEADS "
                   "(output is unchanged, speed may be; suffix: continuations of earlier answers (this run's, and earlier runs' with --suffix-memory) and of the prompt; "
                   "auto=MODEL: auto may draft with MODEL where it pays; mtp: the "
                   "model's own MTP layer, e.g. Qwen3.5's; eagle3: an EAGLE-3 drafter made for the model; medusa: a file of "
                   "Medusa heads made for it, from `edgeinfer convert HEADS_FOLDER -o HEADS.gguf`)")
    p.add_argument("--draft", metavar="MODEL", help="draft model for --speculate auto or draft (same as auto=MODEL)")
    p.add_argument("--draft-max", type=int_range(0, INT32_MAX),
                   help=f"longest draft per step (default {edgeinfer.DEFAULT_SPECULATION.draft_max})")
    p.add_argument("--draft-min", type=int_range(0, INT32_MAX),
                   help=f"shortest draft worth verifying (default {edgeinfer.DEFAULT_SPECULATION.draft_min})")
    add_suffix_memory_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_untuned_option(p)
    p.set_defaults(func=run, kv_type=None)  # unset --kv-type: the tuned profile's, else f16


def _split_model_and_prompt(args: argparse.Namespace) -> tuple[str | None, str | None]:
    import edgeinfer

    pos = list(args.args)
    if args.prompt is not None:
        if len(pos) > 1:
            raise edgeinfer.InvalidOptionError("with -p/--prompt, give at most a MODEL as argument")
        return (pos[0] if pos else None), args.prompt
    if len(pos) > 2:
        raise edgeinfer.InvalidOptionError("too many arguments: expected [MODEL] [PROMPT] (quote the prompt)")
    if len(pos) == 2:
        return pos[0], pos[1]
    if len(pos) == 1:
        if _names_a_model(pos[0]):
            return pos[0], None
        if _MODEL_REF_RE.match(pos[0]) or (pos[0].lower().endswith(".gguf") and not any(c.isspace() for c in pos[0])):
            raise _no_such_model(pos[0])
        return None, pos[0]
    return None, None


def _no_such_model(text: str) -> Exception:
    """"no model X — did you mean Y?" for a lone argument shaped like a model that names nothing."""
    import edgeinfer

    close = [] if text.lower().endswith(".gguf") else edgeinfer.Store().suggest(text)
    hint = f" — did you mean {' or '.join(close)}?" if close else (
        " (no such file)" if text.lower().endswith(".gguf") else " in the store (see `edgeinfer list`)")
    return edgeinfer.ModelNotFoundError(f"no model {text}{hint} (to send it as the prompt: -p {shlex.quote(text)})")


def _names_a_model(text: str) -> bool:
    import edgeinfer

    if os.path.isfile(text):
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

    errors = args.encoding_errors
    if args.file:
        if prompt is not None:
            raise edgeinfer.InvalidOptionError("give the prompt either as an argument or with -f, not both")
        if args.file == "-":
            return _read_stdin(errors)
        try:
            with open(args.file, "rb") as f:
                raw = f.read(_MAX_PROMPT_BYTES + 1)
        except OSError as e:
            raise edgeinfer.InvalidOptionError(f"cannot read prompt file {args.file}: {e.strerror}") from None
        if len(raw) > _MAX_PROMPT_BYTES:
            raise edgeinfer.InvalidOptionError(f"prompt file {args.file} is larger than {_MAX_PROMPT_BYTES >> 20} MiB")
        return decode_bytes(raw, f"prompt file {args.file}", errors)
    if prompt is not None:
        return argument_text(prompt, "the prompt argument", errors)
    if not sys.stdin.isatty():
        return _read_stdin(errors)
    raise edgeinfer.InvalidOptionError("no prompt: give one as an argument, with -p, -f FILE, or on standard input")


def _read_stdin(errors: str) -> str:
    import edgeinfer

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (e.g. replaced in-process)
        return argument_text(sys.stdin.read(_MAX_PROMPT_BYTES), "standard input", errors)
    raw = buffer.read(_MAX_PROMPT_BYTES + 1)
    if len(raw) > _MAX_PROMPT_BYTES:
        raise edgeinfer.InvalidOptionError(f"standard input is larger than {_MAX_PROMPT_BYTES >> 20} MiB")
    return decode_bytes(raw, "standard input", errors)


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


def _constraint(args: argparse.Namespace) -> dict[str, str]:
    """--json-schema FILE|JSON / --grammar FILE as GenerateOptions fields (compiled and checked by validate)."""
    import edgeinfer

    if args.grammar is not None:
        return {"grammar": _read_text_file(args.grammar, "--grammar", args.encoding_errors)}
    if args.json_schema is None:
        return {}
    spec = argument_text(args.json_schema, "--json-schema", args.encoding_errors)
    if spec.lstrip().startswith(("{", "[")) or spec.strip() in ("true", "false"):
        return {"json_schema": spec}
    if not os.path.isfile(spec):
        raise edgeinfer.InvalidOptionError(f"--json-schema: no such file {spec!r} (and not inline JSON)")
    return {"json_schema": _read_text_file(spec, "--json-schema", args.encoding_errors)}


def _read_text_file(path: str, what: str, errors: str) -> str:
    import edgeinfer
    from edgeinfer.engine.structured.grammar import MAX_GBNF_BYTES

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_GBNF_BYTES + 1)
    except OSError as e:
        raise edgeinfer.InvalidOptionError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_GBNF_BYTES:
        raise edgeinfer.InvalidOptionError(f"{what}: {path} is larger than {MAX_GBNF_BYTES} bytes")
    return decode_bytes(raw, f"{what} file {path}", errors)


def run(args: argparse.Namespace) -> int:
    import edgeinfer

    model, prompt = _split_model_and_prompt(args)
    # no prompt at a terminal: a line chat (as `ollama run`), once the model is loaded
    interactive = prompt is None and not args.file and sys.stdin.isatty() and not (args.json or args.raw)
    text = "" if interactive else _read_prompt(args, prompt)
    if not interactive and not text.strip():
        raise edgeinfer.InvalidOptionError("the prompt is empty")
    system = None if args.system is None else argument_text(args.system, "--system", args.encoding_errors)
    stop = tuple(argument_text(s, "--stop", args.encoding_errors) for s in args.stop)
    tuned = tuned_for(model, args.untuned)
    speculate, tuned_draft_max = tuned.speculate(args.speculate)
    if args.draft is not None and speculate.partition("=")[0].strip() not in ("auto", "draft"):
        raise edgeinfer.InvalidOptionError("--draft needs --speculate auto or --speculate draft")
    draft_max = args.draft_max if args.draft_max is not None else tuned_draft_max
    speculation = edgeinfer.SpeculationOptions.parse(speculate, draft_max=draft_max, draft_min=args.draft_min,
                                                     draft_model=args.draft)
    options = edgeinfer.GenerateOptions(
        max_tokens=args.max_tokens,
        stop=stop,
        sampling=edgeinfer.SamplingOptions(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repeat_penalty=args.repeat_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repeat_last_n=args.repeat_last_n,
            seed=args.seed,
        ),
        speculation=speculation,
        **_constraint(args),
    ).validate()
    load = edgeinfer.LoadOptions(**tuned.load_fields({"n_ctx": args.ctx, "n_threads": args.threads, **kv_options(args)}),
                                 **placement_options(args), suffix_memory=args.suffix_memory).validate()
    with edgeinfer.load(tuned.model, load) as engine:
        if args.ctx is not None and engine.n_ctx != args.ctx:
            print(f"edgeinfer: note: context of {args.ctx} tokens rounded to {engine.n_ctx} by llama.cpp", file=sys.stderr)
        _prepare_speculation(engine, options.speculation)
        if args.chatml:
            engine.chat_template = "chatml"
        raw = args.raw or not engine.has_chat_template  # a base model continues text; ChatML would be noise
        if raw and not args.raw:
            print(f"edgeinfer: note: {engine.name} has no chat template (a base model?): the prompt is completed "
                  "as raw text (--chatml chats with ChatML anyway)", file=sys.stderr, flush=True)
        if interactive:
            from ._interactive import line_chat

            return line_chat(engine, options, system, raw=raw)
        if raw:
            gen = engine.generate(text, options)
        else:
            messages = [{"role": "user", "content": text}]
            if system is None:  # no --system: the model's default (the default model's measured one)
                system = edgeinfer.default_system_prompt(engine.manifest.ref if engine.manifest else engine.path)
            gen = engine.chat(messages, options, system=system or None)
        # Ctrl-C cancels the generation (also inside a long prompt) and exits 130; a second one
        # stops at once.
        def on_interrupt(_signum: int, _frame: object) -> None:
            if gen.cancelled:
                raise KeyboardInterrupt
            gen.cancel()

        previous = signal.signal(signal.SIGINT, on_interrupt)
        try:
            stream_reply(gen, sys.stdout, PrefillLine(), show=not args.json)  # the prompt's progress on a terminal
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
                              "finish_reason": done.finish_reason, "stats": done.stats.to_dict(),
                              "tuned": tuned.setup.to_dict() if tuned.setup is not None else None}))
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
