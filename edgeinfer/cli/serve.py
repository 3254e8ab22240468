"""`edgeinfer serve [MODEL]`: an OpenAI-compatible HTTP server (needs the `serve` extra).

It serves every model of the store by name (edgeinfer.ModelService): MODEL is the default (for
requests that name none) and is loaded at start with `--preload`'s; others load on first use.
Per-model settings come from $EDGEINFER_HOME/serve.toml; the flags --parallel, --ctx, --threads,
--kv-type, the placement flags and --speculate are the default model's (over its table)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from ._common import add_placement_options, add_suffix_memory_option, common_options, ctx_type, duration_type, int_range, placement_options, size_type, THREADS_HELP, threads_type
from ._tuned import add_untuned_option, tuned_for

__all__ = ["register"]

MISSING_SERVE = "the server needs starlette and uvicorn: pip install 'edgeinfer[serve]'"
API_KEY_ENV = "EDGEINFER_API_KEY"
# After Ctrl-C or SIGTERM the process exits within --grace and this many seconds more, whatever
# is stuck (a llama.cpp call cannot be interrupted: a long prompt's decode, a model's unload).
SHUTDOWN_MARGIN = 10.0


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
    import edgeinfer
    from edgeinfer.service import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_LOADED, DEFAULT_SLOT_QUOTA

    batch_defaults, load_defaults = edgeinfer.BatchOptions(), edgeinfer.DEFAULT_LOAD  # the library's defaults
    p = sub.add_parser(
        "serve",
        parents=[common_options()],
        help="serve the store's models over the OpenAI HTTP API (by name, parallel requests, continuous batching)",
        description="Serve the store's models at http://HOST:PORT/v1 (chat/completions, completions, embeddings, "
        "models; /health, /metrics; /edgeinfer/ps and /edgeinfer/stop for `edgeinfer ps` and `edgeinfer stop`). "
        "A request's model is loaded on first use and kept --keep-alive after its last request; the least "
        "recently used idle model is unloaded when --max-loaded or --max-memory would be passed. Per-model "
        "settings: $EDGEINFER_HOME/serve.toml ([models.\"NAME:TAG\"] tables with parallel, ctx, kv_type, speculate, "
        "keep_alive, alias, ...; [defaults]). Requests run in parallel slots of their model's context. Binds "
        "127.0.0.1 unless told otherwise; "
        f"any other address needs an API key ({API_KEY_ENV}, --api-key-file or --api-key). Web pages cannot "
        "use it unless --cors-origins lets them. Ctrl-C or SIGTERM stops cleanly. One log line per request.",
    )
    p.add_argument("model", nargs="?", help="the default model, loaded at start (store name or .gguf path; "
                   "default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8080,
                   help="port (default: 8080; 0 picks a free one)")
    p.add_argument("--parallel", "-np", type=int, help="requests decoded together (the default model's slots; "
                   f"default: serve.toml's, else {batch_defaults.parallel})")
    p.add_argument("--ctx", type=ctx_type, help="the default model's whole context in tokens, split evenly between "
                   "its slots (default: serve.toml's, else min(model's, 4096))")
    p.add_argument("--kv-unified", "-kvu", action="store_const", const=True, default=None,
                   help="one KV cache shared by the default model's slots, as llama-server's -kvu (default: a "
                   "stream per slot, as llama-server with -np N: each request's attention covers its own cells "
                   "only, but drafts of unequal length cost the step an extra pass)")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    p.add_argument("--kv-type", type=str.lower, help="the default model's KV-cache type: f16, q8_0, q4_0 "
                   f"(default: serve.toml's, else {load_defaults.kv_type})")
    add_placement_options(p, drafts=True)
    p.add_argument("--speculate", metavar="SPEC",
                   help="the default model's speculation for requests: off | lookup | suffix | auto | auto=MODEL | "
                   "draft=MODEL | self=Q4_K_M | mtp | eagle3=MODEL | medusa=HEADS (a draft model, self-draft or head is opened "
                   "when the model loads, one "
                   "sequence per slot; suffix and auto draft from earlier answers, one memory per API key); a request may "
                   "turn it off or choose lookup or suffix with the extra body field "
                   "'speculation' (default: serve.toml's, else off)")
    add_suffix_memory_option(p, "server")  # every model's ([defaults]' suffix_memory) and the default model's
    many = p.add_argument_group("models by name")
    many.add_argument("--keep-alive", type=duration_type("--keep-alive"), default=DEFAULT_KEEP_ALIVE, metavar="DURATION",
                      help="how long a model stays loaded after its last request: seconds or 30s / 5m / 1h; 0 "
                      "unloads it after each request, -1 keeps it (a request's 'keep_alive' field and serve.toml "
                      f"override it; default {DEFAULT_KEEP_ALIVE:g} s)")
    many.add_argument("--max-loaded", "--models-max", type=int_range(1, 64), default=DEFAULT_MAX_LOADED, metavar="N",
                      help="models loaded at once; the least recently used idle one is unloaded to make room "
                      f"(default {DEFAULT_MAX_LOADED})")
    many.add_argument("--max-memory", type=size_type("--max-memory", auto=True), metavar="SIZE",
                      help="memory the loaded models may take, by edgeinfer fit's estimate (weights, KV cache "
                      "for their slots, compute buffers): e.g. 6G or 5.5GiB (default: what this machine has "
                      "available at start)")
    many.add_argument("--preload", action="extend", nargs="+", default=[], metavar="MODEL",
                      help="more models to load at start, besides the default one (names or .gguf paths)")
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
                     help="requests per model that may wait for one of its slots or its load (default 32); "
                     "more get 503 with Retry-After")
    lim.add_argument("--max-connections", type=int_range(1, 1 << 16), default=128,
                     help="open connections (default 128); a request on one more gets 503")
    lim.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="S",
                     help="seconds a request's head may take to arrive (default 10)")
    lim.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                     help="seconds a request's body may take to arrive after its head (default 30)")
    lim.add_argument("--stall-timeout", type=_seconds, default=30.0, metavar="S",
                     help="seconds a client may read nothing of its response before it is disconnected and "
                     "its request cancelled (default 30)")
    lim.add_argument("--work-timeout", type=_seconds, default=300.0, metavar="S",
                     help="seconds a CPU-heavy step may take from its arrival — tokenizing a prompt, a chat "
                     "template, an embeddings call — before the request gets 503 (default 300)")
    lim.add_argument("--max-embed-tokens", type=int_range(1, (1 << 31) - 1), default=32768, metavar="N",
                     help="tokens one embeddings request may embed, all its inputs together (default 32768); "
                     "more is a 400 before any work")
    slots = p.add_argument_group("slot files (llama-server's)")
    slots.add_argument("--slot-save-path", metavar="DIR",
                       help="a folder for POST /slots/{id}?action=save|restore (made if missing); without it (or "
                       "[slots] path in serve.toml) slot actions answer 501")
    slots.add_argument("--slot-quota", type=size_type("--slot-quota"), metavar="SIZE",
                       help="the most the slot folder's files may take together, e.g. 2G (default: serve.toml's, "
                       f"else {DEFAULT_SLOT_QUOTA / (1 << 30):g}GiB); a save that could pass it is a 507")
    lim.add_argument("--grace", type=float, default=5.0,
                     help="seconds running requests may finish after Ctrl-C or SIGTERM before they are cancelled; "
                     f"the process exits at most {SHUTDOWN_MARGIN:g} s later, whatever is stuck (exit status 1 then)")
    add_untuned_option(p)
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


# What a running server says on stderr: its access lines and warnings, and the models it loads and
# unloads (on demand, to make room, when a keep-alive runs out, on `edgeinfer stop`).
_SERVER_LOGGERS = ("edgeinfer_server", "edgeinfer.service")


@contextlib.contextmanager
def _server_log_to_stderr() -> Iterator[None]:
    """The server's lines (_SERVER_LOGGERS) on stderr as `edgeinfer: ...` (restored after)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("edgeinfer: %(message)s"))
    loggers = [logging.getLogger(name) for name in _SERVER_LOGGERS]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(min(logging.INFO, lg.getEffectiveLevel()))  # (-vv keeps its debug lines)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _say_progress(event) -> None:  # noqa: ANN001 - edgeinfer.SpeculationProgress
    """Preparing a draft model at start-up (a self-draft may be quantized first): one line a stage."""
    if event.stage != "quantize" or event.done in (0, event.total):
        print(f"edgeinfer: {event.message}", file=sys.stderr, flush=True)


def _is_path(model: str) -> bool:
    return model.endswith(".gguf") or "/" in model or model.startswith((".", "~"))


def _service_options(args: argparse.Namespace, store):  # noqa: ANN001, ANN202 - edgeinfer types
    """The ModelService's options: serve.toml, and the flags (the default model's over its table)."""
    import edgeinfer
    from edgeinfer.service import SETTINGS_FILE, read_settings_file

    defaults, tables = read_settings_file(store.root / SETTINGS_FILE)
    tuned = tuned_for(args.model, args.untuned)  # the default model's profile: under its table and the flags
    default_model = tuned.model
    if tuned.setup is not None:
        s = tuned.setup
        slots = tuned.serve or {}
        profile = edgeinfer.ModelSettings(threads=s.threads, kv_type=s.kv_type_k, kv_type_k=s.kv_type_k,
                                          kv_type_v=s.kv_type_v, flash_attn=s.flash_attn, speculate=s.speculate,
                                          parallel=slots.get("parallel"), ctx=slots.get("ctx"))
        tables = {**tables, s.model: tables.get(s.model, edgeinfer.ModelSettings()).over(profile)}
    placement = {k: v for k, v in placement_options(args).items() if v not in (None, (), "auto")}
    flags = edgeinfer.ModelSettings(
        parallel=args.parallel, ctx=args.ctx, threads=args.threads, kv_type=args.kv_type,
        kv_unified=args.kv_unified, speculate=args.speculate, gpu_layers=placement.get("n_gpu_layers"), rpc=placement.get("rpc"),
        tensor_split=placement.get("tensor_split"), draft_gpu_layers=placement.get("draft_gpu_layers"),
        suffix_memory=args.suffix_memory,
    ).validate()
    if args.suffix_memory is not None:  # a server's memory is every model's: over [defaults] too
        defaults = replace(defaults, suffix_memory=args.suffix_memory)
    preloads = {args.model or ""} | set(args.preload)
    if len(preloads) > args.max_loaded:
        raise edgeinfer.InvalidOptionError(f"{len(preloads)} models to load at start (the default and --preload) "
                                           f"but --max-loaded is {args.max_loaded}")
    return edgeinfer.ServiceOptions(keep_alive=args.keep_alive, max_loaded=args.max_loaded,
                                    max_memory=args.max_memory, default_model=default_model, defaults=defaults,
                                    models=tables, default_settings=flags).validate()


def _slot_settings(args: argparse.Namespace, store):  # noqa: ANN001, ANN202 - edgeinfer types
    """The slot folder (made now if missing; None: off) and quota: the flags over serve.toml's [slots]."""
    import edgeinfer
    from edgeinfer.service import DEFAULT_SLOT_QUOTA, SETTINGS_FILE, read_slot_settings

    table = read_slot_settings(store.root / SETTINGS_FILE)
    folder = Path(args.slot_save_path).expanduser() if args.slot_save_path else table.path
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise edgeinfer.InvalidOptionError(f"cannot make the slot folder {folder}: {e.strerror or e}") from None
    return folder, args.slot_quota or table.quota or DEFAULT_SLOT_QUOTA


def _preload(service, model):  # noqa: ANN001, ANN202 - edgeinfer types
    """Load a model at start (the default one: None); a context split too small names the flags."""
    import edgeinfer

    try:
        status = service.preload(model)
    except edgeinfer.ContextLengthError as e:  # e.g. the context split into too small slots
        if "--ctx" in str(e):
            raise
        raise edgeinfer.ContextLengthError(f"{e} (the --ctx context is split between --parallel slots)") from None
    except edgeinfer.NoRoomError:
        raise edgeinfer.InvalidOptionError(
            f"{model or 'the default model'} does not fit beside the models loaded before it: raise --max-memory "
            "or --max-loaded, or preload fewer") from None
    layout = ", one KV cache" if status.kv_unified and status.parallel > 1 else ""
    print(f"edgeinfer: loaded {status.name} in {status.load_s or 0:.1f} s ({status.parallel} slots of "
          f"{status.n_ctx_per_request} tokens{layout}, ~{status.memory.total / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    return status


class _ExitDeadline:
    """Once armed (the first Ctrl-C or SIGTERM), the process ends by `seconds` from then: a
    shutdown that is not done by then (a thread stuck in llama.cpp, an unload) is cut short with
    exit status 1 and one line saying so."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.seconds, self._exit)
            self._timer.daemon = True
            self._timer.start()

    def _exit(self) -> None:
        print(f"edgeinfer: the server did not stop within {self.seconds:g} s of the signal (--grace + "
              f"{SHUTDOWN_MARGIN:g} s): exiting now", file=sys.stderr, flush=True)
        os._exit(1)


def serve(args: argparse.Namespace) -> int:
    import edgeinfer

    # The library and the other commands never import web frameworks; this command does, here only.
    if not _serve_extra_available():
        raise edgeinfer.EdgeInferError(MISSING_SERVE)
    import edgeinfer_server

    slot_folder, slot_quota = _slot_settings(args, edgeinfer.Store())
    config = edgeinfer_server.ServerConfig(
        host=args.host, port=args.port, api_key=api_key(args), max_body_bytes=args.max_body,
        max_tokens_limit=args.max_tokens_limit, shutdown_grace_s=args.grace,
        allowed_hosts=args.allowed_hosts, cors_origins=args.cors_origins, max_queue=args.max_queue,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, stall_timeout_s=args.stall_timeout, work_timeout_s=args.work_timeout,
        max_embed_tokens=args.max_embed_tokens, slot_save_path=slot_folder, slot_quota=slot_quota,
    ).validate()  # a refused option is a one-line error before the model loads
    options = _service_options(args, edgeinfer.Store())  # a bad flag or serve.toml: an error before loading
    sock = edgeinfer_server.bind(config.host, config.port)  # ... and so is a port in use
    deadline = _ExitDeadline(config.shutdown_grace_s + SHUTDOWN_MARGIN)
    try:
        service = edgeinfer.ModelService(options, progress=_say_progress)
        try:
            default = _preload(service, None)
            for model in args.preload:
                _preload(service, Path(model) if _is_path(model) else model)

            def ready(url: str) -> None:
                more = f"; also {', '.join(s.name for s in service.ps() if s.name != default.name)}" \
                    if len(service.ps()) > 1 else ""
                print(f"edgeinfer: serving {default.name} at {url} ({default.parallel} slots of "
                      f"{default.n_ctx_per_request} tokens{more}; any store model on request, up to "
                      f"{options.max_loaded} at once in {service.budget / 1e9:.1f} GB; Ctrl-C stops)",
                      file=sys.stderr, flush=True)

            with _server_log_to_stderr():
                edgeinfer_server.serve(service, config, sock=sock, on_ready=ready, on_signal=deadline.arm)
        except KeyboardInterrupt:  # a Ctrl-C outside uvicorn's handling (before it started): stop as well
            deadline.arm()
        finally:
            service.close(timeout=SHUTDOWN_MARGIN)
    finally:
        sock.close()
    print("edgeinfer: server stopped", file=sys.stderr)
    return 0
