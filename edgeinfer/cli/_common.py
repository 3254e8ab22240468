"""Pieces shared by the CLI commands: common flags, bounded number types, prompt text decoding,
and a plain-text progress bar (no rich)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = [
    "common_options",
    "ProgressBar",
    "format_bytes",
    "print_table",
    "int_range",
    "threads_type",
    "THREADS_HELP",
    "ctx_type",
    "INT32_MAX",
    "UINT32_MAX",
    "add_encoding_option",
    "decode_bytes",
    "argument_text",
    "add_kv_options",
    "kv_options",
    "add_placement_options",
    "placement_options",
    "add_suffix_memory_option",
    "rpc_workers_type",
    "duration_type",
    "size_type",
]

INT32_MAX = 2**31 - 1  # a C int: every count llama.cpp takes (threads, tokens, top-k, context)
UINT32_MAX = 2**32 - 1  # the sampler seed


def common_options() -> argparse.ArgumentParser:
    """Flags every command accepts, before or after the command name."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="show edgeinfer's diagnostics on stderr (-vv: also llama.cpp's log lines)")
    return p


def add_kv_options(p: argparse.ArgumentParser) -> None:
    """--kv-type (both caches), --kv-type-k, --kv-type-v over every type llama.cpp's CPU path takes."""
    from ..kv_types import KV_TYPE_NAMES

    names = ", ".join(KV_TYPE_NAMES)
    p.add_argument("--kv-type", default="f16", type=str.lower, metavar="TYPE",
                   help=f"KV-cache type of K and V: {names} (default f16; a quantized V turns flash attention on)")
    p.add_argument("--kv-type-k", type=str.lower, metavar="TYPE", help="K-cache type (default: --kv-type)")
    p.add_argument("--kv-type-v", type=str.lower, metavar="TYPE", help="V-cache type (default: --kv-type)")


def kv_options(args: argparse.Namespace) -> dict[str, str | None]:
    """The LoadOptions fields of the --kv-type* flags."""
    return {"kv_type": args.kv_type, "kv_type_k": args.kv_type_k, "kv_type_v": args.kv_type_v}


def _gpu_layers(text: str) -> int | str:
    value = text.strip().lower()
    if value in ("all", "auto"):
        return value
    try:
        n = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers, 'all' or 'auto', got {text!r}") from None
    if not 0 <= n <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and {INT32_MAX}, got {n}")
    return n


def rpc_workers_type(text: str) -> tuple[str, ...]:
    from edgeinfer.devices import parse_endpoints
    from edgeinfer.errors import InvalidOptionError

    try:
        return parse_endpoints(text)
    except InvalidOptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tensor_split(text: str) -> tuple[float, ...]:
    import math

    try:
        shares = tuple(float(s) for s in text.replace("/", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected shares like 1,1,1 (the host first), got {text!r}") from None
    if any(not math.isfinite(s) or s < 0 for s in shares) or not sum(shares) > 0:
        raise argparse.ArgumentTypeError(f"shares must be numbers >= 0, at least one above 0, got {text!r}")
    return shares


def add_placement_options(p: argparse.ArgumentParser, drafts: bool = False) -> None:
    """--gpu-layers, --rpc, --tensor-split: where a model's layers run (edgeinfer.devices); with
    `drafts`, --draft-gpu-layers for the draft model of a command that speculates."""
    p.add_argument("--gpu-layers", type=_gpu_layers, default="auto", metavar="N|all|auto",
                   help="layers on GPUs and RPC workers (default auto: as many as their memory holds; none on a "
                   "CPU-only build; `edgeinfer doctor` shows what this build has)")
    p.add_argument("--rpc", type=rpc_workers_type, default=(), metavar="HOST:PORT,...",
                   help="put part of the model on these llama.cpp RPC workers (`edgeinfer rpc-worker` there)")
    p.add_argument("--tensor-split", type=_tensor_split, default=(), metavar="HOST,DEV1,...",
                   help="shares of the layers: this machine first, then each worker in --rpc order, then local GPUs "
                   "(e.g. 1,1,1; default: by the devices' free memory)")
    if drafts:
        p.add_argument("--draft-gpu-layers", type=_gpu_layers, default=None, metavar="N|all|auto",
                       help="layers of a draft model or self-draft on GPUs and workers (default: as the target's)")


def placement_options(args: argparse.Namespace) -> dict[str, object]:
    """The LoadOptions fields of the placement flags."""
    out = {"n_gpu_layers": args.gpu_layers, "rpc": args.rpc, "tensor_split": args.tensor_split}
    if hasattr(args, "draft_gpu_layers"):  # the commands that load draft models
        out["draft_gpu_layers"] = args.draft_gpu_layers
    return out


def add_suffix_memory_option(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--suffix-memory: LoadOptions.suffix_memory (its default, off, is the library's)."""
    p.add_argument("--suffix-memory", metavar="store|DIR|off",
                   help="keep the suffix drafter's memory of earlier answers (--speculate suffix or auto) on disk, "
                   "so a restarted " + (scope or "run") + " drafts from them: token ids only, per model file"
                   + (" and API key" if scope else "") + ", never text; store: $EDGEINFER_HOME/cache/suffix, "
                   "or a folder (default off: in memory only)")


def duration_type(flag: str) -> Callable[[str], float]:
    """An argparse type: seconds from 90, 30s, 5m, 1h30m (edgeinfer.service.parse_duration; negative
    means for ever, -1), a wrong one a one-line error naming `flag`."""

    def parse(text: str) -> float:
        from edgeinfer.errors import InvalidOptionError
        from edgeinfer.service import parse_duration

        try:
            return parse_duration(text, flag)
        except InvalidOptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def size_type(flag: str, *, auto: bool = False) -> Callable[[str], int | None]:
    """An argparse type: bytes from 8G, 7.5GiB or a number (edgeinfer.service.parse_size); with
    `auto`, "auto" is None (the caller's default)."""

    def parse(text: str) -> int | None:
        from edgeinfer.errors import InvalidOptionError
        from edgeinfer.service import parse_size

        if auto and text.strip().lower() == "auto":
            return None
        try:
            return parse_size(text, flag)
        except InvalidOptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def int_range(lo: int, hi: int | Callable[[], int]) -> Callable[[str], int]:
    """An argparse type: a decimal integer in [lo, hi] (hi may be computed when parsing), so that
    a value never wraps through ctypes and a typo reads as one line naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        top = hi() if callable(hi) else hi
        if not lo <= value <= top:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {top}, got {value}")
        return value

    return parse


MIN_CTX = 16  # the smallest context LoadOptions accepts
CTX_BLOCK = 256  # llama.cpp rounds every context up to a multiple of this


def ctx_type(text: str) -> int:
    """--ctx: a context size; the message says what llama.cpp really does with small ones."""
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value > INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {INT32_MAX} tokens, got {value}")
    if value < MIN_CTX:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_CTX} tokens, got {value} (llama.cpp rounds a context up to a multiple "
            f"of {CTX_BLOCK}, so the smallest real one is {CTX_BLOCK})"
        )
    return value


def _max_threads() -> int:
    from edgeinfer.llama_backend import max_threads

    return max_threads()


# --threads: at most a few per CPU (9,999 threads once took the machine to a load of 1,000)
threads_type = int_range(1, _max_threads)
THREADS_HELP = "CPU threads (default: EDGEINFER_THREADS, else the cores other processes leave free, re-checked while decoding)"


def add_encoding_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoding-errors", choices=("strict", "replace"), default="strict",
                   help="text that is not UTF-8: strict = refuse it (default), replace = use U+FFFD for bad bytes")


def decode_bytes(raw: bytes, what: str, errors: str = "strict") -> str:
    """UTF-8 text, or one line naming the first bad byte (errors="replace" substitutes U+FFFD)."""
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        from edgeinfer.errors import InvalidOptionError

        raise InvalidOptionError(
            f"{what} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "pass --encoding-errors replace to read it anyway"
        ) from None


def argument_text(text: str, what: str, errors: str = "strict") -> str:
    """A command-line string as valid Unicode: Python keeps bytes that are not UTF-8 in argv as
    lone surrogates (U+DC80..U+DCFF), which no tokenizer can take."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")  # the bytes the user typed
    except UnicodeEncodeError:  # a surrogate no byte made (only possible in-process)
        if errors == "replace":
            return text.encode("utf-8", "replace").decode("utf-8")
        from edgeinfer.errors import InvalidOptionError

        raise InvalidOptionError(f"{what} holds a lone surrogate, not text; "
                                 "pass --encoding-errors replace to use it anyway") from None
    return decode_bytes(raw, what, errors)


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def print_table(rows: list[list[str]], header: list[str], out: TextIO | None = None) -> None:
    """Left-aligned text table; numbers are right-aligned."""
    out = out or sys.stdout
    table = [header] + rows
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            s = str(cell)
            numeric = s.replace(".", "", 1).replace("%", "").replace("×", "").replace("-", "", 1).isdigit()
            cells.append(s.rjust(widths[i]) if numeric and row is not header else s.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    print(fmt(header), file=out)
    for r in rows:
        print(fmt(r), file=out)


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most 10 times a second.

    Shows count/total, rate and ETA; `unit="B"` formats bytes. Silent when stderr is not a
    terminal except for the final line, so logs stay readable.
    """

    def __init__(self, label: str, total: float | None, unit: str = "", stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._tty = self.stream.isatty()

    def _fmt(self, n: float) -> str:
        return format_bytes(n) if self.unit == "B" else f"{n:.0f}{self.unit}"

    def update(self, done: float, total: float | None = None, label: str | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if label is not None:
            self.label = label
        now = time.monotonic()
        if self._tty and now - self._last_draw >= 0.1:
            self._last_draw = now
            self.stream.write("\r\033[K" + self._line(now))
            self.stream.flush()

    def _rate(self, now: float) -> float | None:
        """Items per second, or None until it means something (no "0/s" before the first item)."""
        elapsed = now - self.start
        if self.done <= 0 or elapsed < 0.5:
            return None
        return self.done / elapsed

    def _fmt_rate(self, rate: float) -> str:
        if self.unit == "B":
            return f"{format_bytes(rate)}/s"
        return f"{rate:.0f}{self.unit}/s" if rate >= 10 else f"{rate:.1f}{self.unit}/s"

    def _line(self, now: float) -> str:
        rate = self._rate(now)
        speed = f" {self._fmt_rate(rate)}" if rate is not None and rate >= 0.05 else ""
        if self.total:
            frac = min(self.done / self.total, 1.0)
            width = 24
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            eta = f" ETA {(self.total - self.done) / rate:4.0f}s" if speed and self.done < self.total else ""
            # bytes carry their unit on each side; a count carries it once ("272/272 tensors")
            count = (f"{self._fmt(self.done)}/{self._fmt(self.total)}" if self.unit == "B"
                     else f"{self.done:.0f}/{self.total:.0f}{self.unit}")
            return f"{self.label} [{bar}] {frac * 100:5.1f}% {count}{speed}{eta}"
        return f"{self.label} {self._fmt(self.done)}{speed}"

    def close(self) -> None:
        """End the bar's line; a bar that never moved (the work failed before it began) leaves no
        line behind, so an error message stands alone."""
        now = time.monotonic()
        if self.done <= 0:
            if self._tty:
                self.stream.write("\r\033[K")
                self.stream.flush()
            return
        prefix = "\r\033[K" if self._tty else ""
        self.stream.write(prefix + self._line(now) + f" ({now - self.start:.1f}s)\n")
        self.stream.flush()
