"""`edgeinfer rpc-worker`: llama.cpp's RPC server in this process, so that another machine's
edgeinfer (`--rpc HOST:PORT`) or llama.cpp (`--rpc`) can put part of a model here."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from ._common import common_options, int_range, threads_type

if TYPE_CHECKING:
    from edgeinfer.devices import WorkerInfo

__all__ = ["register"]

_READY_TIMEOUT = 30.0  # seconds for the server to answer its own first probe


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not 0 < value < 1 << 20:
        raise argparse.ArgumentTypeError(f"must be more than 0 GiB (and less than a million), got {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from edgeinfer.devices import DEFAULT_RPC_PORT

    p = sub.add_parser(
        "rpc-worker",
        parents=[common_options()],
        help="lend this machine's memory and compute to a model loaded elsewhere (llama.cpp's RPC server)",
        description="Run llama.cpp's RPC server: a process elsewhere that loads a model with --rpc HOST:PORT puts "
        "part of its layers (weights, KV cache, compute) on this machine's device (its GPUs, else its CPU). "
        "It serves one client at a time. It has NO authentication and NO encryption (llama.cpp: never expose it "
        "to an open network): it listens on 127.0.0.1 unless --host names another address together with "
        "--i-know-this-is-unauthenticated. Ctrl-C stops it.",
    )
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_range(1, 65535), default=DEFAULT_RPC_PORT, help=f"default {DEFAULT_RPC_PORT}")
    p.add_argument("--mem", type=_gib, metavar="GiB",
                   help="memory to report to clients, which split a model by it (default: what the device reports; "
                   "not a hard limit)")
    p.add_argument("--threads", type=threads_type,
                   help="CPU threads for the layers it computes (default: EDGEINFER_THREADS, else every usable core)")
    p.add_argument("--cache", nargs="?", const="", metavar="DIR",
                   help="keep the tensors clients send in DIR, so that loading the same model again reads them here "
                   "instead of over the network (--cache alone: $EDGEINFER_HOME/cache/rpc)")
    p.add_argument("--i-know-this-is-unauthenticated", dest="unauthenticated", action="store_true",
                   help="allow a --host other than loopback (only on a network you trust)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgeinfer import devices
    from edgeinfer.cpu import usable_cores
    from edgeinfer.errors import InvalidOptionError
    from edgeinfer.llama_backend import env_threads
    from edgeinfer.paths import home

    host = devices.check_worker_host(args.host, args.unauthenticated)
    threads = args.threads or env_threads() or usable_cores()
    cache = None if args.cache is None else (args.cache or str(home() / "cache" / "rpc"))
    mem = None if args.mem is None else int(args.mem * (1 << 30))
    served, serve = devices.start_rpc_server(host, args.port, threads=threads, mem_bytes=mem, cache_dir=cache,
                                             allow_unauthenticated=args.unauthenticated)
    if not devices.port_is_free(host, args.port):
        raise InvalidOptionError(f"port {args.port} on {host} is in use (another worker?): choose one with --port")
    # llama.cpp's server prints its own lines with printf: send them to stderr, keep stdout ours.
    sys.stdout.flush()
    ours = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = ours
    thread = threading.Thread(target=serve, name="llama.cpp RPC server", daemon=True)
    thread.start()
    endpoint = f"{host}:{args.port}"
    info = _wait_ready(endpoint, thread)
    if info is None:
        raise devices.RpcWorkerError(f"llama.cpp's RPC server did not start on {endpoint} (its log is above)")
    what = ", ".join(f"{d.name} ({d.description}, {_gib_text(m[1])} reported, {_gib_text(m[0])} free)"
                     for d, m in zip(served, info.memory))
    print(f"edgeinfer rpc-worker: listening on {endpoint}, llama.cpp RPC protocol {info.version}; serving {what}; "
          f"{threads} threads; cache {cache or 'off'}", flush=True)
    if not host.startswith("127."):
        print(f"edgeinfer rpc-worker: WARNING: {host} is not loopback and this server has no authentication: "
              "anyone who reaches the port can use it", file=sys.stderr, flush=True)
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        print("edgeinfer rpc-worker: stopped", file=sys.stderr, flush=True)
        _exit(0)
    print(f"edgeinfer: error: llama.cpp's RPC server on {endpoint} stopped (its log is above)", file=sys.stderr, flush=True)
    _exit(1)
    return 1  # not reached


def _wait_ready(endpoint: str, thread: threading.Thread) -> WorkerInfo | None:
    from edgeinfer.devices import RpcWorkerError, probe_worker

    deadline = time.monotonic() + _READY_TIMEOUT
    while time.monotonic() < deadline and thread.is_alive():
        try:
            return probe_worker(endpoint, timeout=2.0)
        except RpcWorkerError:
            time.sleep(0.05)
    return None


def _gib_text(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _exit(code: int) -> None:
    """The server thread is inside llama.cpp for good (its accept loop has no way out), so the
    process ends here rather than in the interpreter's shutdown, which would wait on it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
