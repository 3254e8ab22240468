"""`edgeinfer serve [MODEL]`: an OpenAI-compatible HTTP server (needs the `serve` extra)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator

from ._common import add_placement_options, common_options, ctx_type, int_range, placement_options, THREADS_HELP, threads_type

__all__ = ["register"]

MISSING_SERVE = "the server needs starlette and uvicorn: pip install 'edgeinfer[serve]'"
API_KEY_ENV = "EDGEINFER_API_KEY"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds (and less than 1e6), got {text}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common_options()],
        help="serve a model over the OpenAI HTTP API (parallel requests, continuous batching)",
        description="Serve a model at http://HOST:PORT/v1 (chat/completions, completions, models; /health, "
        "/metrics). Requests run in parallel slots of one context. Binds 127.0.0.1 unless told otherwise; "
        f"any other address needs an API key ({API_KEY_ENV}, --api-key-file or --api-key). Web pages cannot "
        "use it unless --cors-origins lets them. Ctrl-C or SIGTERM stops cleanly. One log line per request.",
    )
    p.add_argument("model", nargs="?", help="model (store name or .gguf path; default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8080,
                   help="port (default: 8080; 0 picks a free one)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="requests decoded together (slots; default 4)")
    p.add_argument("--ctx", type=ctx_type, help="whole context in tokens, split evenly between the slots "
                   "(default: min(model's, 4096))")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    p.add_argument("--kv-type", default="f16", help="KV-cache type: f16, q8_0, q4_0")
    add_placement_options(p, drafts=True)
    p.add_argument("--speculate", default="off", metavar="SPEC",
                   help="speculation for requests: off | lookup | auto | auto=MODEL | draft=MODEL | self=Q4_K_M "
                   "(a draft model or self-draft is opened at start-up, one sequence per slot); a request may "
                   "turn it off or choose lookup with the extra body field 'speculation'")
    key = p.add_argument_group("who may call it")
    key.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (mandatory off localhost); other users "
                     f"can read it in the process list: prefer {API_KEY_ENV} or --api-key-file")
    key.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE (one line)")
    key.add_argument("--allowed-hosts", type=_names, default=(), metavar="HOSTS",
                     help="comma-separated host names to answer besides localhost, IP addresses and --host "
                     "(.example.org: that domain and its subdomains; *: any). Other Host headers get 403 "
                     "(DNS rebinding)")
    key.add_argument("--cors-origins", type=_names, default=(), metavar="ORIGINS",
                     help="comma-separated origins (http://localhost:3000) whose web pages may call the API; "
                     "*: any. Other cross-origin requests get 403")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask for")
    lim.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    lim.add_argument("--max-queue", type=int_range(0, 1 << 20), default=32,
                     help="requests that may wait for a slot (default 32); more get 503 with Retry-After")
    lim.add_argument("--max-connections", type=int_range(1, 1 << 16), default=128,
                     help="open connections (default 128); a request on one more gets 503")
    lim.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="S",
                     help="seconds a request's head may take to arrive (default 10)")
    lim.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                     help="seconds a request's body may take to arrive after its head (default 30)")
    lim.add_argument("--stall-timeout", type=_seconds, default=30.0, metavar="S",
                     help="seconds a client may read nothing of its response before it is disconnected and "
                     "its request cancelled (default 30)")
    lim.add_argument("--grace", type=float, default=5.0,
                     help="seconds running requests may finish after Ctrl-C or SIGTERM before they are cancelled")
    p.set_defaults(func=serve)


def _serve_extra_available() -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn", "edgeinfer_server"))
    except (ImportError, ValueError):
        return False


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $EDGEINFER_API_KEY (in that order; not two flags)."""
    from edgeinfer import InvalidOptionError

    if args.api_key is not None and args.api_key_file is not None:
        raise InvalidOptionError("give the API key with --api-key or --api-key-file, not both")
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, "rb") as f:
                raw = f.read(4097)
        except OSError as e:
            raise InvalidOptionError(f"cannot read the API key file {args.api_key_file}: {e.strerror or e}") from None
        try:
            lines = [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise InvalidOptionError(f"the API key file {args.api_key_file} is not UTF-8 text") from None
        if len(raw) > 4096 or len(lines) != 1:
            raise InvalidOptionError(f"the API key file {args.api_key_file} must hold one line, the key "
                                     f"({'it is empty' if not lines else 'it holds more'})")
        return lines[0]
    return os.environ.get(API_KEY_ENV) or None


@contextlib.contextmanager
def _server_log_to_stderr() -> Iterator[None]:
    """The server's access lines and warnings on stderr as `edgeinfer: ...` (restored after)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("edgeinfer: %(message)s"))
    logger = logging.getLogger("edgeinfer_server")
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _say_progress(event) -> None:  # noqa: ANN001 - edgeinfer.SpeculationProgress
    """Preparing a draft model at start-up (a self-draft may be quantized first): one line a stage."""
    if event.stage != "quantize" or event.done in (0, event.total):
        print(f"edgeinfer: {event.message}", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    import edgeinfer

    # The library and the other commands never import web frameworks; this command does, here only.
    if not _serve_extra_available():
        raise edgeinfer.EdgeInferError(MISSING_SERVE)
    import edgeinfer_server

    config = edgeinfer_server.ServerConfig(
        host=args.host, port=args.port, api_key=api_key(args), max_body_bytes=args.max_body,
        max_tokens_limit=args.max_tokens_limit, shutdown_grace_s=args.grace,
        allowed_hosts=args.allowed_hosts, cors_origins=args.cors_origins, max_queue=args.max_queue,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, stall_timeout_s=args.stall_timeout,
    ).validate()  # a refused option is a one-line error before the model loads
    speculation = edgeinfer.SpeculationOptions.parse(args.speculate)  # a bad one is an error before loading
    load = edgeinfer.LoadOptions(n_ctx=args.ctx, n_threads=args.threads, kv_type=args.kv_type,
                                 **placement_options(args)).validate()
    sock = edgeinfer_server.bind(config.host, config.port)  # ... and so is a port in use
    try:
        try:
            engine = edgeinfer.BatchEngine.load(args.model, load, edgeinfer.BatchOptions(parallel=args.parallel),
                                                speculation=speculation, progress=_say_progress)
        except edgeinfer.ContextLengthError as e:  # e.g. the context split into too small slots
            if "--ctx" in str(e):
                raise
            raise edgeinfer.ContextLengthError(f"{e} (the --ctx context is split between --parallel slots)") from None
        try:
            def ready(url: str) -> None:
                print(f"edgeinfer: serving {engine.name} at {url} ({engine.parallel} slots of "
                      f"{engine.n_ctx_per_request} tokens; Ctrl-C stops)", file=sys.stderr, flush=True)

            with _server_log_to_stderr():
                edgeinfer_server.serve(engine, config, sock=sock, on_ready=ready)
        except KeyboardInterrupt:
            pass  # a Ctrl-C outside uvicorn's handling (before it started): stop as well
        finally:
            engine.close()
    finally:
        sock.close()
    print("edgeinfer: server stopped", file=sys.stderr)
    return 0
