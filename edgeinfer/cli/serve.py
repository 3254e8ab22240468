"""`edgeinfer serve [MODEL]`: an OpenAI-compatible HTTP server (needs the `serve` extra)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ._common import common_options, ctx_type, THREADS_HELP, threads_type

__all__ = ["register"]

MISSING_SERVE = "the server needs starlette and uvicorn: pip install 'edgeinfer[serve]'"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common_options()],
        help="serve a model over the OpenAI HTTP API (parallel requests, continuous batching)",
        description="Serve a model at http://HOST:PORT/v1 (chat/completions, completions, models; /health, "
        "/metrics). Requests run in parallel slots of one context. Binds 127.0.0.1 unless told otherwise; "
        "any other address needs --api-key. Ctrl-C stops cleanly.",
    )
    p.add_argument("model", nargs="?", help="model (store name or .gguf path; default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="requests decoded together (slots; default 4)")
    p.add_argument("--ctx", type=ctx_type, help="whole context in tokens, split evenly between the slots "
                   "(default: min(model's, 4096))")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    p.add_argument("--kv-type", default="f16", help="KV-cache type: f16, q8_0, q4_0")
    p.add_argument("--speculate", default="off", metavar="SPEC",
                   help="default for requests: off | lookup | auto (= lookup with parallel sequences); "
                   "a request may choose its own with the extra body field 'speculation'")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (mandatory off localhost)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask for")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds running requests may finish after Ctrl-C before they are cancelled")
    p.set_defaults(func=serve)


def _serve_extra_available() -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn", "edgeinfer_server"))
    except (ImportError, ValueError):
        return False


def serve(args: argparse.Namespace) -> int:
    import edgeinfer

    # The library and the other commands never import web frameworks; this command does, here only.
    if not _serve_extra_available():
        raise edgeinfer.EdgeInferError(MISSING_SERVE)
    import edgeinfer_server

    config = edgeinfer_server.ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, max_body_bytes=args.max_body,
        max_tokens_limit=args.max_tokens_limit, default_speculation=args.speculate, shutdown_grace_s=args.grace,
    ).validate()  # a refused bind is a one-line error before the model loads
    load = edgeinfer.LoadOptions(n_ctx=args.ctx, n_threads=args.threads, kv_type=args.kv_type).validate()
    engine = edgeinfer.BatchEngine.load(args.model, load, edgeinfer.BatchOptions(parallel=args.parallel))
    try:
        def ready(url: str) -> None:
            print(f"edgeinfer: serving {engine.name} at {url} ({engine.parallel} slots of {engine.n_ctx} tokens; "
                  "Ctrl-C stops)", file=sys.stderr, flush=True)

        edgeinfer_server.serve(engine, config, on_ready=ready)
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it has already handled with a clean shutdown
    finally:
        engine.close()
    print("edgeinfer: server stopped", file=sys.stderr)
    return 0
