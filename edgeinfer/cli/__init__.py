"""The `edgeinfer` command line. Each subcommand lives in its own module of this package and
exposes `register(subparsers)`; modules are discovered, so adding a command touches one file.

The CLI uses only edgeinfer's public API. Errors become one line on stderr and a non-zero exit;
`--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import signal
import sys
import threading
import typing
import warnings
from collections.abc import Iterator, Sequence

__all__ = ["main", "build_parser"]


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each option's default ("(default: 512)") unless its help already says it, or it
    has none worth showing (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default in ([], (), "")
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors (a bad flag value reads like every other error) and
    defaults in --help; subcommand parsers inherit the class. `intermixed=True`: flags may come
    between the positional arguments (`run MODEL --temperature 0 "prompt"`), which plain argparse
    refuses once a `*` positional has taken the arguments before the first flag."""

    def __init__(self, *args: typing.Any, intermixed: bool = False, **kwargs: typing.Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self._intermixed = intermixed

    def parse_known_args(self, args: typing.Any = None, namespace: typing.Any = None) -> typing.Any:
        if not self._intermixed:
            return super().parse_known_args(args, namespace)
        self._intermixed = False  # parse_known_intermixed_args calls parse_known_args (twice) itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = True

    def add_argument(self, *args: typing.Any, **kwargs: typing.Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.help and action.option_strings and not isinstance(action.default, bool) \
                and action.default not in (None, argparse.SUPPRESS, [], ()):
            action.help = "(default: %(default)s)"  # argparse shows nothing for an option without help
        return action

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"edgeinfer: error: {message} (see `{self.prog} --help`)\n")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        """A mistyped command names the one meant: `edgeinfer rnu` → "did you mean run?"."""
        if isinstance(action, argparse._SubParsersAction) and isinstance(value, str) and value not in action.choices:
            import difflib

            close = difflib.get_close_matches(value, list(action.choices), n=2, cutoff=0.6)
            if close:
                raise argparse.ArgumentError(action, f"unknown command {value!r} — did you mean {' or '.join(close)}?")
        super()._check_value(action, value)


def build_parser() -> argparse.ArgumentParser:
    from ._common import common_options

    parser = _Parser(
        prog="edgeinfer",
        description="Local LLM runtime on llama.cpp: pull, convert, quantize, measure, run.",
        parents=[common_options()],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        module.register(sub)
    return parser


@contextlib.contextmanager
def _logging_to_stderr(verbosity: int, debug: bool) -> Iterator[None]:
    """The library logs through `logging` and stays quiet by default; -v shows its diagnostics,
    -vv (or --debug) also llama.cpp's own log lines (logger `edgeinfer.llama_cpp`, DEBUG level).
    Set for one command and restored after it: main() also runs inside other programs and tests."""
    level = logging.DEBUG if verbosity >= 2 or debug else logging.INFO if verbosity == 1 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler.setLevel(level)
    logger = logging.getLogger("edgeinfer")
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, saved_level or logging.WARNING))
    try:
        with _warnings_as_one_line(debug):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)


@contextlib.contextmanager
def _warnings_as_one_line(debug: bool) -> Iterator[None]:
    """A warning the library raises while a command runs (e.g. a self-draft made by requantizing
    the model) reads `edgeinfer: warning: MESSAGE`, like every other line of the CLI, instead of
    Python's `path/to/module.py:141: UserWarning: ...` followed by a line of our source code.
    --debug adds where it came from. Restored after the command."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        where = f" ({category.__name__} at {filename}:{lineno})" if debug else ""
        try:
            print(f"edgeinfer: warning: {message}{where}", file=file or sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr gone or closed: a warning must never end the command
            pass

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Ctrl-C as Python's default handler gives it, but never lost in llama.cpp's log callback
    # (llama_backend.sigint_outside_callbacks); the caller's handler is back when main returns.
    owns_sigint = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if owns_sigint:
        from ..llama_backend import sigint_outside_callbacks

        signal.signal(signal.SIGINT, sigint_outside_callbacks)
    try:
        return _run(args)
    finally:
        if owns_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(args: argparse.Namespace) -> int:
    from ..errors import EdgeInferError

    debug = bool(getattr(args, "debug", False)) or bool(os.environ.get("EDGEINFER_DEBUG"))
    try:
        with _logging_to_stderr(int(getattr(args, "verbose", 0) or 0), debug):
            code = args.func(args)
        return int(code or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("edgeinfer: interrupted", file=sys.stderr)
        return 130
    except EdgeInferError as e:
        if debug:
            raise
        print(f"edgeinfer: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 1
    except OSError as e:  # a full disk, a permission problem: one line, not a traceback
        if debug:
            raise
        from ..fsutil import NO_SPACE_ERRNOS, no_space_error

        if e.errno in NO_SPACE_ERRNOS and e.filename:
            e = no_space_error(e.filename)
        print(f"edgeinfer: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
