"""Where a model's layers run: the backends and devices this llama.cpp build has, llama.cpp's RPC
workers, and the `llama_model_params` of every load.

The build decides what exists. llama-cpp-python compiles llama.cpp with the backends its
CMAKE_ARGS name (Metal by default on Apple Silicon; `-DGGML_CUDA=on`, `-DGGML_VULKAN=on`,
`-DGGML_RPC=ON`); ggml's backend registry lists them and their devices, with the memory each reports
(`ggml_backend_dev_memory`). A *device* here is anything llama.cpp can offload layers to: a local
GPU or integrated GPU, or a device of an RPC worker. The local CPU is the *host*: it always holds the
input embedding and whatever layers are not offloaded.

Placement (`LoadOptions.n_gpu_layers`, `.rpc`, `.tensor_split`) follows llama.cpp's rule: of the
model's n_layer + 1 layers (the output layer counts as the last), the first ones stay on the host and
the last `n_gpu_layers` go to the devices, split between them in proportion to their free memory or
to `tensor_split`. Devices come in llama.cpp's order: RPC workers first (in `rpc` order), then local
GPUs. Our `tensor_split` has one more entry than llama.cpp's: the host's share comes first, so
`(1, 1, 1)` with two workers puts a third of the layers on each machine. `n_gpu_layers="auto"` puts
on the devices as many layers as fit in the memory they report, 0 where there is no device;
`llama_supports_gpu_offload()` is no guide (it is true for any build with RPC compiled in).

RPC workers (`edgeinfer rpc-worker`, or llama.cpp's `rpc-server`) are probed here in Python first
(a TCP connection and the protocol's HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY messages) so that a
worker that is down, busy with another client (a worker serves one client at a time) or speaks
another protocol version is a one-line error before any weight moves: ggml-rpc itself aborts the
process on all three. Workers are then added as llama.cpp's `add_rpc_devices` does, through
`ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server")`, but not registered
globally: a load uses them only when its own options name them.

A worker lost while a model uses it cannot be survived in-process: every RPC call of ggml-rpc checks
its status with `RPC_STATUS_ASSERT` -> `GGML_ABORT` -> `abort()` (ggml-rpc.cpp), and nothing in
llama.cpp can unwind from there. What edgeinfer does instead: a ggml abort callback turns that abort
into one line (`edgeinfer: error: lost RPC worker HOST:PORT ...`) and exit status 1 instead of a
SIGABRT and a backtrace, and after each load the client's sockets to the workers get TCP keepalive
and a user timeout, so a worker whose host vanishes without closing the connection ends the process
the same way within about half a minute instead of leaving a decode waiting for ever. A worker that
is alive but stopped (SIGSTOP) still keeps its connection alive, as with llama.cpp's own tools.
Whoever must survive a lost worker runs the RPC-backed model in a process it can restart.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import math
import os
import shlex
import socket
import stat
import struct
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EdgeInferError, InvalidOptionError

__all__ = [
    "DEFAULT_RPC_PORT",
    "MAX_RPC_WORKERS",
    "RPC_PROTOCOL",
    "BackendInfo",
    "BuildInfo",
    "DeviceInfo",
    "ModelSizes",
    "Part",
    "Placement",
    "PlacementError",
    "RpcUnavailableError",
    "RpcWorkerError",
    "WorkerInfo",
    "build_info",
    "check_placement",
    "check_worker_host",
    "has_rpc",
    "host_only",
    "last_placement",
    "local_gpu_devices",
    "offload_targets",
    "parse_endpoint",
    "parse_endpoints",
    "placement_fields",
    "plan_placement",
    "port_is_free",
    "probe_worker",
    "rebuild_command",
    "require_rpc",
    "start_rpc_server",
]

log = logging.getLogger(__name__)

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of ggml-rpc.h in the llama.cpp that llama-cpp-python 0.3.36
# vendors (tests/test_rpc.py checks it against what our own worker answers).
RPC_PROTOCOL: tuple[int, int, int] = (7, 0, 0)
DEFAULT_RPC_PORT = 50052
MAX_RPC_WORKERS = 16  # GGML_RPC_MAX_SERVERS
_PROBE_TIMEOUT = 5.0
# Kept free on every device when "auto" decides how many layers fit (drivers, fragmentation,
# what our estimate of compute buffers misses).
_DEVICE_MARGIN = 256 << 20

# ggml_backend_dev_type (ggml-backend.h)
_DEV_CPU, _DEV_GPU, _DEV_IGPU, _DEV_ACCEL, _DEV_META = range(5)

# ggml-rpc's messages (ggml-rpc.cpp: rpc_cmd, rpc_msg_hello_rsp; transport.h: RPC_CONN_CAPS_SIZE)
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CONN_CAPS = 24


class RpcUnavailableError(EdgeInferError, RuntimeError):
    """This llama-cpp-python was built without llama.cpp's RPC backend (a cached wheel)."""


class RpcWorkerError(EdgeInferError, ConnectionError):
    """An RPC worker that is down, busy, unreachable or speaks another protocol version."""


class PlacementError(InvalidOptionError):
    """A placement that does not fit the memory the devices report, refused before loading."""


def rebuild_command() -> str:
    """The pip command that rebuilds this llama-cpp-python with the RPC backend (pip reuses a cached
    wheel whatever CMAKE_ARGS say, hence --no-cache-dir)."""
    try:
        from importlib.metadata import version

        pinned = f"=={version('llama-cpp-python')}"
    except Exception:  # noqa: BLE001 - only the exact version is lost
        pinned = ""
    return (f'CMAKE_ARGS="-DGGML_RPC=ON" {shlex.quote(sys.executable)} -m pip install --force-reinstall '
            f"--no-cache-dir --no-deps llama-cpp-python{pinned}")


# -- ggml's backend registry through ctypes ------------------------------------------------------------


class _DevCaps(ctypes.Structure):
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class _DevProps(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _DevCaps)]


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p))
_GET_MEMORY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_GET_FEATURES = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ggml_backend_reg_count": (ctypes.c_size_t, []),
    "ggml_backend_reg_get": (ctypes.c_void_p, [ctypes.c_size_t]),
    "ggml_backend_reg_by_name": (ctypes.c_void_p, [ctypes.c_char_p]),
    "ggml_backend_reg_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_backend_reg_dev_count": (ctypes.c_size_t, [ctypes.c_void_p]),
    "ggml_backend_reg_dev_get": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
    "ggml_backend_reg_get_proc_address": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
    "ggml_backend_dev_count": (ctypes.c_size_t, []),
    "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
    "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_backend_dev_description": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_backend_dev_memory": (None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    "ggml_backend_dev_type": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_backend_dev_get_props": (None, [ctypes.c_void_p, ctypes.POINTER(_DevProps)]),
    "ggml_backend_dev_backend_reg": (ctypes.c_void_p, [ctypes.c_void_p]),
    "ggml_set_abort_callback": (ctypes.c_void_p, [_ABORT_CALLBACK]),
}

_ggml_lock = threading.Lock()
_ggml_lib: Any = None


def _ggml() -> Any:
    """libggml (and, through its dependencies, libggml-base) with the registry's signatures set."""
    global _ggml_lib
    with _ggml_lock:
        if _ggml_lib is None:
            from .llama_backend import backend

            ll = backend()  # llama_backend_init: ggml's backends are registered
            from llama_cpp._ctypes_extensions import load_shared_library

            lib = load_shared_library("ggml", Path(ll.__file__).parent / "lib")
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _ggml_lib = lib
    return _ggml_lib


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


def _memory(dev: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _ggml().ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


_KINDS = {_DEV_CPU: "cpu", _DEV_GPU: "gpu", _DEV_IGPU: "igpu", _DEV_ACCEL: "accel", _DEV_META: "meta"}


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the registry or of an RPC worker."""

    name: str  # "CPU", "CUDA0", "Metal", "RPC0"
    description: str
    kind: str  # cpu | gpu | igpu | accel | rpc
    backend: str  # the registry entry: "CPU", "CUDA", "RPC[127.0.0.1:50052]"
    memory_free: int  # bytes; 0 and 0: the device reports nothing
    memory_total: int
    endpoint: str | None = None  # an RPC worker's host:port

    @property
    def label(self) -> str:
        return f"{self.name} ({self.endpoint})" if self.endpoint else self.name


def _device_info(dev: int, kind: str | None = None, endpoint: str | None = None) -> DeviceInfo:
    g = _ggml()
    free, total = _memory(dev)
    reg = g.ggml_backend_dev_backend_reg(dev)
    return DeviceInfo(
        name=_text(g.ggml_backend_dev_name(dev)),
        description=_text(g.ggml_backend_dev_description(dev)),
        kind=kind or _KINDS.get(g.ggml_backend_dev_type(dev), "other"),
        backend=_text(g.ggml_backend_reg_name(reg)) if reg else "",
        memory_free=free,
        memory_total=total,
        endpoint=endpoint,
    )


@dataclass(frozen=True)
class BackendInfo:
    name: str
    devices: tuple[DeviceInfo, ...]


@dataclass(frozen=True)
class BuildInfo:
    """What this llama.cpp build has (`edgeinfer doctor`)."""

    llama_cpp_python: str
    backends: tuple[BackendInfo, ...]
    rpc: bool  # the RPC backend is compiled in
    rpc_protocol: tuple[int, int, int]
    supports_gpu_offload: bool  # llama_supports_gpu_offload(): also true for RPC alone
    local_gpus: tuple[DeviceInfo, ...]  # what n_gpu_layers offloads to without --rpc
    cpu_features: dict[str, str] = field(default_factory=dict)
    system_info: str = ""


def has_rpc() -> bool:
    """The RPC backend is compiled in and offers the two functions edgeinfer uses."""
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    return bool(reg and g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
                and g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server"))


def require_rpc() -> int:
    """The RPC backend's registry entry, or RpcUnavailableError with the command that rebuilds."""
    if not has_rpc():
        raise RpcUnavailableError(
            "this llama-cpp-python was built without llama.cpp's RPC backend (a wheel pip had cached?); "
            f"rebuild it with: {rebuild_command()}"
        )
    return _ggml().ggml_backend_reg_by_name(b"RPC")


def _registry() -> Iterator[tuple[str, int, list[int]]]:
    g = _ggml()
    for i in range(g.ggml_backend_reg_count()):
        reg = g.ggml_backend_reg_get(i)
        yield _text(g.ggml_backend_reg_name(reg)), reg, [g.ggml_backend_reg_dev_get(reg, j)
                                                         for j in range(g.ggml_backend_reg_dev_count(reg))]


def _local_gpu_handles() -> list[int]:
    """llama.cpp's default offload devices without RPC (llama.cpp: llama_prepare_model_devices):
    every GPU (one per device id when two backends see the same card), integrated GPUs only when
    there is no discrete one."""
    g = _ggml()
    gpus: list[int] = []
    seen: set[str] = set()
    igpus: list[int] = []
    for _name, _reg, devs in _registry():
        for dev in devs:
            kind = g.ggml_backend_dev_type(dev)
            if kind == _DEV_GPU:
                props = _DevProps()
                g.ggml_backend_dev_get_props(dev, ctypes.byref(props))
                dev_id = _text(props.device_id)
                if dev_id and dev_id in seen:
                    continue
                seen.add(dev_id) if dev_id else None
                gpus.append(dev)
            elif kind == _DEV_IGPU and (not igpus or g.ggml_backend_dev_backend_reg(dev)
                                        == g.ggml_backend_dev_backend_reg(igpus[-1])):
                igpus.append(dev)
    return gpus or igpus


def local_gpu_devices() -> tuple[DeviceInfo, ...]:
    """The local devices layers can be offloaded to (empty on a CPU-only build)."""
    return tuple(_device_info(d) for d in _local_gpu_handles())


def _cpu_features() -> dict[str, str]:
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"CPU")
    if not reg:
        return {}
    address = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not address:
        return {}
    features = _GET_FEATURES(address)(reg)
    out: dict[str, str] = {}
    i = 0
    while features and features[i].name:
        out[_text(features[i].name)] = _text(features[i].value)
        i += 1
    return out


def build_info() -> BuildInfo:
    from importlib.metadata import version

    from .llama_backend import backend

    ll = backend()
    backends = tuple(BackendInfo(name, tuple(_device_info(d) for d in devs)) for name, _reg, devs in _registry())
    info = ll.llama_print_system_info()
    return BuildInfo(
        llama_cpp_python=version("llama-cpp-python"),
        backends=backends,
        rpc=has_rpc(),
        rpc_protocol=RPC_PROTOCOL,
        supports_gpu_offload=bool(ll.llama_supports_gpu_offload()),
        local_gpus=local_gpu_devices(),
        cpu_features=_cpu_features(),
        system_info=_text(info).strip(),
    )


# -- RPC workers -------------------------------------------------------------------------------------


def parse_endpoint(text: str) -> str:
    """A worker address `host:port` (an IPv4 address or a host name: ggml-rpc connects over IPv4),
    normalised; InvalidOptionError (one line) otherwise."""
    if not isinstance(text, str):
        raise InvalidOptionError(f"an RPC worker is 'host:port', got {type(text).__name__} {text!r}")
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or ":" in host or any(c.isspace() for c in host):
        raise InvalidOptionError(f"an RPC worker is 'host:port' (IPv4 or a host name), got {text!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidOptionError(f"RPC worker {text!r}: the port must be 1..65535")
    return f"{host}:{int(port)}"


def parse_endpoints(text: str | Sequence[str]) -> tuple[str, ...]:
    """`host:port,host:port` (or a sequence of them) as a tuple, without duplicates."""
    items = [s for s in text.split(",")] if isinstance(text, str) else list(text)
    out = tuple(parse_endpoint(s) for s in items if not isinstance(s, str) or s.strip())
    if isinstance(text, str) and not out:
        raise InvalidOptionError("no RPC worker given: expected host:port[,host:port...]")
    dupes = sorted({e for e in out if out.count(e) > 1})
    if dupes:
        raise InvalidOptionError(f"RPC worker {dupes[0]} is named twice")
    if len(out) > MAX_RPC_WORKERS:
        raise InvalidOptionError(f"at most {MAX_RPC_WORKERS} RPC workers (llama.cpp's limit), got {len(out)}")
    return out


def _check_gpu_layers(name: str, value: object) -> None:
    if value in ("all", "auto"):
        return
    if isinstance(value, str) or not isinstance(value, int) or isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be a number of layers, 'all' or 'auto', got {value!r}")
    if not 0 <= value <= 2**31 - 1:
        raise InvalidOptionError(f"{name} must be in [0, {2**31 - 1}], got {value}")


def check_placement(n_gpu_layers: object = "auto", rpc: object = (), tensor_split: object = (),
                    draft_gpu_layers: object = None) -> None:
    """Refuse placement options of the wrong type or range with one InvalidOptionError line (the
    LoadOptions fields of the same names)."""
    _check_gpu_layers("n_gpu_layers", n_gpu_layers)
    if draft_gpu_layers is not None:
        _check_gpu_layers("draft_gpu_layers", draft_gpu_layers)
    if isinstance(rpc, str) or not isinstance(rpc, (tuple, list)):
        raise InvalidOptionError(f"rpc must be a tuple of 'host:port' strings, got {type(rpc).__name__} {rpc!r}")
    parse_endpoints(rpc)
    if isinstance(tensor_split, str) or not isinstance(tensor_split, (tuple, list)):
        raise InvalidOptionError(f"tensor_split must be a tuple of numbers, got {type(tensor_split).__name__} "
                                 f"{tensor_split!r}")
    for share in tensor_split:
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not math.isfinite(share):
            raise InvalidOptionError(f"a tensor_split share must be a finite number, got {share!r}")
        if share < 0:
            raise InvalidOptionError(f"tensor_split shares must be >= 0, got {share}")
    if tensor_split and not sum(tensor_split) > 0:
        raise InvalidOptionError("tensor_split needs at least one share above 0")
    if tensor_split and isinstance(n_gpu_layers, int) and not isinstance(n_gpu_layers, bool):
        raise InvalidOptionError("give a number of GPU layers or a tensor split, not both (the split's first "
                                 "share, the host's, sets how many layers stay on the CPU)")


def check_worker_host(host: str, allow_unauthenticated: bool = False) -> str:
    """The address an RPC worker may listen on: an IPv4 address (ggml-rpc binds nothing else),
    loopback unless `allow_unauthenticated` (llama.cpp's RPC server has no authentication and no
    encryption: whoever reaches the port can run graphs and read and write its buffers)."""
    host = "127.0.0.1" if host == "localhost" else host
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise InvalidOptionError(f"--host must be an IPv4 address (llama.cpp's RPC server binds nothing else), got {host!r}") from None
    if not address.is_loopback and not allow_unauthenticated:
        raise InvalidOptionError(
            f"refusing to listen on {host}: llama.cpp's RPC server has no authentication or encryption, so anyone who "
            "reaches the port can use this machine's memory and compute; never expose it to an open network. "
            "On a trusted network pass --i-know-this-is-unauthenticated"
        )
    return host


@dataclass(frozen=True)
class WorkerInfo:
    """What an RPC worker answered: its protocol version and its devices' memory."""

    endpoint: str
    protocol: tuple[int, int, int]
    memory: tuple[tuple[int, int], ...]  # (free, total) bytes per device

    @property
    def version(self) -> str:
        return "v{}.{}.{}".format(*self.protocol)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _request(sock: socket.socket, cmd: int, payload: bytes, expect: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != expect:
        raise ValueError(f"answered with {size} bytes where v{RPC_PROTOCOL[0]} sends {expect}")
    return _recv_exact(sock, size)


def _compatible(protocol: tuple[int, int, int]) -> bool:
    """ggml-rpc's own rule (negotiate_hello): the same major version, a minor version not newer."""
    return protocol[0] == RPC_PROTOCOL[0] and protocol[1] <= RPC_PROTOCOL[1]


def probe_worker(endpoint: str, timeout: float = _PROBE_TIMEOUT) -> WorkerInfo:
    """Connect to an RPC worker, check its protocol version and read its devices' memory; then
    close the connection (the worker goes back to waiting for a client). RpcWorkerError (one line)
    when it is down, busy or incompatible."""
    endpoint = parse_endpoint(endpoint)
    host, _, port = endpoint.rpartition(":")
    what = f"RPC worker {endpoint}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.gaierror as e:
        raise RpcWorkerError(f"{what}: cannot resolve {host!r} ({e.strerror})") from None
    except ConnectionRefusedError:
        raise RpcWorkerError(f"{what} is not running (connection refused): start `edgeinfer rpc-worker --port {port}` "
                             "there") from None
    except TimeoutError:
        raise RpcWorkerError(f"{what} is unreachable (no answer to connect within {timeout:g} s)") from None
    except OSError as e:
        raise RpcWorkerError(f"{what} is unreachable ({e.strerror or e})") from None
    with sock:
        try:
            hello = _request(sock, _CMD_HELLO, bytes(_CONN_CAPS), 4 + _CONN_CAPS)
            protocol = (hello[0], hello[1], hello[2])
            if not _compatible(protocol):
                raise RpcWorkerError(
                    f"{what} speaks RPC protocol v{protocol[0]}.{protocol[1]}.{protocol[2]}, this build "
                    f"v{RPC_PROTOCOL[0]}.{RPC_PROTOCOL[1]}.{RPC_PROTOCOL[2]}: run the same llama.cpp on both sides"
                )
            (count,) = struct.unpack("<I", _request(sock, _CMD_DEVICE_COUNT, b"", 4))
            memory = []
            for i in range(min(count, 64)):
                free, total = struct.unpack("<QQ", _request(sock, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                memory.append((free, total))
        except RpcWorkerError:
            raise
        except TimeoutError:
            raise RpcWorkerError(
                f"{what} accepted the connection but did not answer within {timeout:g} s: it is probably serving "
                "another client (llama.cpp's RPC server takes one at a time)"
            ) from None
        except (EOFError, ConnectionError):
            raise RpcWorkerError(
                f"{what} closed the connection during the handshake: it speaks another RPC protocol than this "
                f"build's v{RPC_PROTOCOL[0]} (run the same llama.cpp on both sides)"
            ) from None
        except ValueError as e:
            raise RpcWorkerError(f"{what} {e}: another RPC protocol version (run the same llama.cpp on both sides)") from None
    if not memory:
        raise RpcWorkerError(f"{what} has no devices")
    return WorkerInfo(endpoint, protocol, tuple(memory))


@dataclass
class _Worker:
    endpoint: str
    devices: list[int]  # ggml_backend_dev_t of its devices, in order


_workers_lock = threading.Lock()
_workers: dict[str, _Worker] = {}
_abort_callback_ref: Any = None


def _addresses(endpoint: str) -> set[tuple[str, int]]:
    host, _, port = endpoint.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return set()
    return {(info[4][0], int(port)) for info in infos}


@contextlib.contextmanager
def _our_sockets(endpoints: Sequence[str]) -> Iterator[list[tuple[str, int, socket.socket]]]:
    """This process's TCP connections to these workers (ggml-rpc's own sockets) as (endpoint, its
    descriptor, a duplicate socket object); the duplicates are closed afterwards (which leaves the
    connection open)."""
    wanted = {addr: e for e in endpoints for addr in _addresses(e)}
    found: list[tuple[str, int, socket.socket]] = []
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        fds = [int(n) for n in os.listdir(fd_dir) if n.isdigit()]
    except OSError:
        fds = []
    try:
        for fd in fds:
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                peer = dup.getpeername() if dup.family == socket.AF_INET else None
            except OSError:
                peer = None
            if peer is not None and (peer[0], peer[1]) in wanted:
                found.append((wanted[(peer[0], peer[1])], fd, dup))
            else:
                dup.close()
        yield found
    finally:
        for _e, _fd, s in found:
            s.close()


def _connected(endpoint: str) -> bool:
    """This process holds a live connection to the worker (a model of ours is on it)."""
    with _our_sockets([endpoint]) as socks:
        for _e, _fd, s in socks:
            if _peer_state(s) == "open":
                return True
    return False


def _peer_state(sock: socket.socket) -> str:
    """open | closed (the worker ended the connection or died) for one of our connections."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open"
    except OSError:
        return "closed"
    return "open" if data else "closed"


def _harden(endpoints: Sequence[str]) -> int:
    """TCP keepalive and a user timeout on our connections to the workers, so that a worker whose
    host vanishes ends the process with the lost-worker error (see the module's docstring) instead
    of leaving a decode waiting for an answer that never comes. Returns how many sockets it set."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30_000)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    n = 0
    with _our_sockets(endpoints) as socks:
        for endpoint, fd, s in socks:
            with _known_lock:
                _known_sockets[(fd, os.fstat(fd).st_ino)] = endpoint
            try:
                for level, opt, value in options:
                    s.setsockopt(level, opt, value)
                n += 1
            except OSError as e:
                log.debug("could not set keepalive on the connection to %s: %s", endpoint, e)
    return n


# (descriptor, socket inode) of ggml-rpc's connections -> the worker, recorded after each load so
# that a lost worker can be named even once its connection has no peer address any more.
_known_lock = threading.Lock()
_known_sockets: dict[tuple[int, int], str] = {}


def _lost_worker_message(message: str) -> str:
    """The one line for a ggml abort caused by a worker (which one, when it can be told)."""
    dead: set[str] = set()
    with _known_lock:
        known = dict(_known_sockets)
    for (fd, inode), endpoint in known.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # that descriptor now belongs to something else
            with socket.socket(fileno=os.dup(fd)) as s:
                try:
                    s.getpeername()  # a reset connection has no peer any more (ENOTCONN)
                except OSError:
                    dead.add(endpoint)
                    continue
                if _peer_state(s) == "closed":
                    dead.add(endpoint)
        except OSError:
            continue
    who = ", ".join(sorted(dead)) if dead else "one of " + (", ".join(sorted(_workers)) or "?")
    reason = message.split(": ", 1)[-1].strip() if ": " in message else message.strip()
    return (f"edgeinfer: error: lost RPC worker {who} while it held part of the model ({reason}); llama.cpp cannot "
            "go on without it, so this process ends: restart the worker and run again\n")


def _on_ggml_abort(message: bytes | None) -> None:
    """ggml's abort callback: for ggml-rpc's aborts, one line and exit status 1 instead of SIGABRT;
    any other abort is printed as ggml would and then aborts as before."""
    try:
        text = _text(message)
        if "RPC" in text or "rpc" in text:
            os.write(2, _lost_worker_message(text).encode("utf-8", errors="replace"))
            os._exit(1)
        os.write(2, (text + "\n").encode("utf-8", errors="replace"))
    except BaseException:  # noqa: BLE001, S110 - nothing may cross back into C, and stderr may be gone
        pass


def _install_abort_handler() -> None:
    global _abort_callback_ref
    if _abort_callback_ref is None:
        _abort_callback_ref = _ABORT_CALLBACK(_on_ggml_abort)
        _ggml().ggml_set_abort_callback(_abort_callback_ref)


def _worker_devices(endpoint: str) -> list[int]:
    """The worker's devices as ggml device handles (added once per process, as llama.cpp's
    add_rpc_devices does, but not registered globally)."""
    with _workers_lock:
        known = _workers.get(endpoint)
        if known is not None:
            return known.devices
        reg_rpc = require_rpc()
        g = _ggml()
        add_server = _ADD_SERVER(g.ggml_backend_reg_get_proc_address(reg_rpc, b"ggml_backend_rpc_add_server"))
        _install_abort_handler()
        reg = add_server(endpoint.encode())
        if not reg:
            raise RpcWorkerError(f"RPC worker {endpoint} has no devices")
        devices = [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))]
        _workers[endpoint] = _Worker(endpoint, devices)
        return devices


def _rpc_devices(endpoints: Sequence[str]) -> list[tuple[int, DeviceInfo]]:
    """Every device of these workers, checked first: a worker that is down, busy or speaks another
    protocol is a one-line RpcWorkerError before ggml-rpc connects (it would abort the process)."""
    if not endpoints:
        return []
    require_rpc()
    out: list[tuple[int, DeviceInfo]] = []
    for endpoint in endpoints:
        if endpoint in _workers and _connected(endpoint):
            # A model of this process is on it: the worker is serving us and cannot answer a
            # probe, but the connection is alive; ggml-rpc asks through that connection.
            handles = _workers[endpoint].devices
            infos = [_device_info(d, "rpc", endpoint) for d in handles]
        else:
            worker = probe_worker(endpoint)
            handles = _worker_devices(endpoint)
            infos = [_device_info_from_probe(d, endpoint, worker.memory[i] if i < len(worker.memory) else (0, 0))
                     for i, d in enumerate(handles)]
        out.extend(zip(handles, infos))
    return out


def _device_info_from_probe(dev: int, endpoint: str, memory: tuple[int, int]) -> DeviceInfo:
    """A worker's device described without asking ggml-rpc (which would open a connection)."""
    g = _ggml()
    return DeviceInfo(name=_text(g.ggml_backend_dev_name(dev)), description=_text(g.ggml_backend_dev_description(dev)),
                      kind="rpc", backend=f"RPC[{endpoint}]", memory_free=memory[0], memory_total=memory[1],
                      endpoint=endpoint)


# -- placement -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """What one machine or device holds under a placement (bytes; compute is an estimate)."""

    name: str  # "host" or a device name (RPC0, CUDA0)
    where: str  # "this machine (CPU)", an RPC worker's host:port, a GPU's description
    layers: tuple[int, int]  # [first, end) over 0..n_layer (index n_layer is the output layer)
    weights: int
    kv_cache: int
    compute: int
    memory_free: int | None  # what the device reports (None: not reported)
    memory_total: int | None

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute

    @property
    def fits(self) -> bool | None:
        """None when the device reports no memory."""
        return None if self.memory_free is None else self.total <= self.memory_free


@dataclass(frozen=True)
class Placement:
    """Where each part of a model lands: the host first, then the devices in llama.cpp's order."""

    parts: tuple[Part, ...]
    n_layer: int  # repeating layers (the output layer is one more)
    n_gpu_layers: int  # layers (of n_layer + 1) on the devices
    tensor_split: tuple[float, ...]  # llama.cpp's, one per device; () = in proportion to free memory
    note: str | None = None  # e.g. why --gpu-layers was ignored

    @property
    def devices(self) -> tuple[Part, ...]:
        return self.parts[1:]

    @property
    def host(self) -> Part:
        return self.parts[0]

    @property
    def fits(self) -> bool:
        """Every device that reports memory holds its part (the host's is fit.py's business: mapped
        weights may page)."""
        return all(p.fits is not False for p in self.devices)

    def summary(self) -> str:
        """One line: 'CPU' or 'CPU 10 layers + RPC0 127.0.0.1:50052 11 + RPC1 ... 10'."""
        used = [p for p in self.devices if p.n_layers]
        if not used:
            return "CPU"
        parts = [f"CPU {self.host.n_layers}"] if self.host.n_layers else ["CPU (input)"]
        parts += [f"{p.name} {p.where} {p.n_layers}" if p.where.count(":") == 1 else f"{p.name} {p.n_layers}"
                  for p in used]
        return " + ".join(parts) + f" (of {self.n_layer + 1} layers)"


def _split_points(shares: Sequence[float]) -> list[Any]:
    import numpy as np

    cum = np.cumsum(np.asarray(shares, dtype=np.float32), dtype=np.float32)
    return list(cum / cum[-1]) if len(cum) and cum[-1] > 0 else []


def _assign_layers(n_layer: int, n_gpu: int, shares: Sequence[float]) -> list[int]:
    """llama.cpp's layer assignment (llama-model.cpp load_tensors): for each of the n_layer + 1
    layers, -1 for the host or the index of its device. Float32, as llama.cpp computes it."""
    import bisect

    import numpy as np

    total = n_layer + 1
    n_gpu = min(max(n_gpu, 0), total) if shares else 0
    start = total - n_gpu
    points = _split_points(shares)
    out = []
    for il in range(total):
        if il < start:
            out.append(-1)
        else:
            x = np.float32(il - start) / np.float32(n_gpu)
            out.append(min(bisect.bisect_right(points, x), len(shares) - 1))
    return out


@dataclass(frozen=True)
class ModelSizes:
    """What a placement moves, per layer (edgeinfer.fit.model_sizes reads it from a GGUF)."""

    n_layer: int
    layer_weights: tuple[int, ...]  # per repeating layer
    output_weights: int  # the output layer (output norm and matrix, or the tied embedding it copies)
    tied_output: int  # bytes of output_weights that are the token embedding (no copy on the host)
    input_weights: int  # the token embedding and anything outside the layers (always on the host)
    kv_per_layer: int
    activations: int  # f32 activations of one ubatch, without the logits
    logits: int  # f32 logits of one ubatch
    host_extra: int  # llama.cpp's fixed overhead (context, output buffer)


def _parts(sizes: ModelSizes, owner: list[int], devices: Sequence[DeviceInfo], host_free: int | None) -> tuple[Part, ...]:
    n = sizes.n_layer
    weights = [0] * (len(devices) + 1)
    kv = [0] * (len(devices) + 1)
    span: list[list[int]] = [[n + 1, 0] for _ in range(len(devices) + 1)]
    for il, d in enumerate(owner):
        k = d + 1
        weights[k] += sizes.layer_weights[il] if il < n else sizes.output_weights - (sizes.tied_output if k == 0 else 0)
        kv[k] += sizes.kv_per_layer if il < n else 0
        span[k] = [min(span[k][0], il), max(span[k][1], il + 1)]
    weights[0] += sizes.input_weights
    holds_output = owner[n] + 1 if owner else 0
    parts = []
    for k in range(len(devices) + 1):
        lo, hi = span[k] if span[k][1] else (0, 0)
        used = bool(hi) or k == 0
        compute = (sizes.activations + (sizes.logits if k == holds_output else 0)) if used else 0
        if k == 0:
            compute += sizes.host_extra
            parts.append(Part("host", "this machine (CPU)", (lo, hi), weights[0], kv[0], compute, host_free, None))
        else:
            dev = devices[k - 1]
            reported = dev.memory_free or dev.memory_total
            parts.append(Part(dev.name, dev.endpoint or dev.description or dev.name, (lo, hi), weights[k], kv[k], compute,
                              dev.memory_free if reported else None, dev.memory_total if reported else None))
    return tuple(parts)


def _no_gpu_note(asked: int | str) -> str | None:
    if asked in ("auto", 0):
        return None
    return (f"this llama.cpp build has no GPU backend: --gpu-layers {asked} has nothing to offload to, so every layer "
            "runs on the CPU (`edgeinfer doctor` shows the build and how to build for Metal, CUDA or Vulkan)")


def _gpu_layers_value(value: int | str, n_layer: int) -> int | None:
    """An explicit n_gpu_layers as a count of the n_layer + 1 layers; None for auto."""
    if value == "auto":
        return None
    if value == "all":
        return n_layer + 1
    return min(int(value), n_layer + 1)


def plan_placement(sizes: ModelSizes, devices: Sequence[DeviceInfo], *, n_gpu_layers: int | str = "auto",
                   tensor_split: Sequence[float] = (), host_free: int | None = None, strict: bool = True) -> Placement:
    """Where each layer lands over these offload devices (in llama.cpp's order); pure arithmetic.
    `n_gpu_layers` and `tensor_split` as in LoadOptions. With `strict`, an explicit placement that a
    device cannot hold raises PlacementError (else `fits` says so)."""
    n = sizes.n_layer
    total = n + 1
    if not devices:
        if tensor_split:
            raise InvalidOptionError("--tensor-split: nothing to split over (this build has no GPU backend and no RPC "
                                     "workers were given; see `edgeinfer doctor`)")
        return Placement(_parts(sizes, [-1] * total, [], host_free), n, 0, (), _no_gpu_note(n_gpu_layers))
    shares: list[float]
    if tensor_split:
        split = list(tensor_split)
        if len(split) != len(devices) + 1:
            names = ", ".join(["host"] + [d.label for d in devices])
            raise InvalidOptionError(f"--tensor-split has {len(split)} values for {len(devices) + 1} parts ({names})")
        host_share, shares = split[0], split[1:]
        n_gpu = 0 if sum(shares) <= 0 else total - int(total * host_share / sum(split) + 0.5)
        if n_gpu_layers == "all" and n_gpu != total:
            raise InvalidOptionError("--gpu-layers all and a host share in --tensor-split contradict each other")
        explicit = True
    else:
        # llama.cpp's own default: in proportion to the memory each device has free
        shares = [float(d.memory_free or d.memory_total or (host_free or 0) or 1) for d in devices]
        asked = _gpu_layers_value(n_gpu_layers, n)
        explicit = asked is not None
        n_gpu = asked if asked is not None else total
    owner = _assign_layers(n, n_gpu, shares)
    parts = _parts(sizes, owner, devices, host_free)
    if not explicit:  # auto: the most layers the devices hold, with a margin
        while n_gpu > 0 and any(p.memory_free is not None and p.total + _DEVICE_MARGIN > p.memory_free
                                for p in parts[1:]):
            n_gpu -= 1
            owner = _assign_layers(n, n_gpu, shares)
            parts = _parts(sizes, owner, devices, host_free)
    counts = tuple(float(owner.count(k)) for k in range(len(devices)))
    placement = Placement(parts, n, n_gpu, counts, None)
    if strict and explicit and not placement.fits:
        p = next(p for p in placement.devices if p.fits is False)
        raise PlacementError(
            f"{p.name} ({p.where}) would hold {_gb(p.total)} (weights {_gb(p.weights)}, KV cache {_gb(p.kv_cache)}, "
            f"compute {_gb(p.compute)}) but reports {_gb(p.memory_free or 0)} free: give it a smaller share "
            "(--tensor-split), fewer --gpu-layers, or more workers"
        )
    return placement


def host_only(n_gpu_layers: int | str = "auto") -> Placement:
    """The placement of a load with no device to offload to (nothing to plan: the file is not read)."""
    return Placement((Part("host", "this machine (CPU)", (0, 0), 0, 0, 0, None, None),), 0, 0, (),
                     _no_gpu_note(n_gpu_layers))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def offload_targets(rpc: Sequence[str] = ()) -> list[tuple[int, DeviceInfo]]:
    """The devices a load can offload to, as (ggml_backend_dev_t, DeviceInfo) in llama.cpp's order:
    the RPC workers' (probed first: RpcWorkerError), then local GPUs."""
    local = [(d, _device_info(d)) for d in _local_gpu_handles()]
    return _rpc_devices(rpc) + local


_last_lock = threading.Lock()
_last: dict[str, Placement] = {}


def last_placement(path: str | Path) -> Placement | None:
    """The placement of this process's latest load of `path` (what `bench` reports)."""
    with _last_lock:
        return _last.get(str(Path(path).resolve()))


def placement_fields(ll: Any, path: str | Path, placement: Placement,
                     targets: Sequence[tuple[int, DeviceInfo]]) -> dict[str, Any]:
    """The llama_model_params fields of `placement` over `targets` (for set_fields): the devices
    that hold layers as an explicit NULL-terminated list (an empty one: the CPU alone, not every
    device), n_gpu_layers, and llama.cpp's tensor_split as the planned layer count of each (so that
    llama.cpp's split is exactly the plan); with RPC workers, a progress callback that sets keepalive
    on their connections once the weights are loaded. Ctypes keeps the arrays and the callback alive
    for as long as the struct they are assigned to."""
    path = Path(path)
    if placement.note:
        warnings.warn(placement.note, RuntimeWarning, stacklevel=3)
    with _last_lock:
        _last[str(path.resolve())] = placement
    used = [k for k, p in enumerate(placement.devices) if p.n_layers]
    handles = [targets[k][0] for k in used]
    devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    split = (ctypes.c_float * max(int(ll.llama_max_devices()), 1))()
    for i, k in enumerate(used):
        split[i] = placement.tensor_split[k]
    fields: dict[str, Any] = {"n_gpu_layers": placement.n_gpu_layers if handles else 0,
                              "devices": ctypes.cast(devices, ctypes.c_void_p), "tensor_split": split}
    endpoints = sorted({d.endpoint for _h, d in (targets[k] for k in used) if d.endpoint})
    if endpoints:
        def on_progress(progress: float, _data: Any) -> bool:
            if progress >= 1.0:
                try:
                    log.debug("keepalive set on %d connection(s) to RPC workers", _harden(endpoints))
                except Exception:  # never into C
                    log.debug("could not set keepalive on the RPC connections", exc_info=True)
            return True

        fields["progress_callback"] = ll.llama_progress_callback(on_progress)
    log.info("placement of %s: %s", path.name, placement.summary())
    return fields


# -- the worker side -----------------------------------------------------------------------------------


_mem_callback_ref: Any = None


def _cap_reported_memory(dev: int, cap: int) -> None:
    """Make `dev` report at most `cap` bytes (free and total) to the RPC clients that plan on it:
    its get_memory entry (the third function of ggml_backend_device_i, ggml-backend-impl.h) is
    replaced by one that clamps the original's answer. Only for a process that is a worker."""
    global _mem_callback_ref
    g = _ggml()
    slots = ctypes.cast(dev, ctypes.POINTER(ctypes.c_void_p))
    original = _GET_MEMORY(slots[2])

    def get_memory(d: Any, free: Any, total: Any) -> None:
        original(d, free, total)
        free[0] = min(free[0], cap)
        total[0] = min(total[0], cap)

    _mem_callback_ref = _GET_MEMORY(get_memory)
    slots[2] = ctypes.cast(_mem_callback_ref, ctypes.c_void_p).value
    free, total = _memory(dev)
    if total > cap or free > cap:
        raise RuntimeError(f"could not cap the memory {_text(g.ggml_backend_dev_name(dev))} reports")


def _server_devices() -> list[int]:
    """The devices a worker serves (llama.cpp's rpc-server: every GPU, else the CPU)."""
    g = _ggml()
    devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
    gpus = [d for d in devs if g.ggml_backend_dev_type(d) not in (_DEV_CPU, _DEV_ACCEL)
            and not _text(g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(d))).startswith("RPC")]
    return gpus or [d for d in devs if g.ggml_backend_dev_type(d) == _DEV_CPU][:1]


def start_rpc_server(host: str, port: int, *, threads: int, mem_bytes: int | None = None,
                     cache_dir: str | Path | None = None, allow_unauthenticated: bool = False) -> tuple[list[DeviceInfo], Any]:
    """Prepare llama.cpp's RPC server in this process: returns the devices it will serve and a
    function that runs it (blocking for ever; it returns only when the server could not start,
    e.g. the port is taken). The host must be loopback unless `allow_unauthenticated`."""
    host = check_worker_host(host, allow_unauthenticated)
    if not 1 <= port <= 65535:
        raise InvalidOptionError(f"--port must be 1..65535, got {port}")
    if mem_bytes is not None and mem_bytes <= 0:
        raise InvalidOptionError("--mem must be more than 0")
    reg = require_rpc()
    g = _ggml()
    start = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server")
    devices = _server_devices()
    if not devices:
        raise RpcUnavailableError("this llama.cpp build has no device to serve")
    if mem_bytes is not None:
        for d in devices:
            _cap_reported_memory(d, mem_bytes)
    cache = None
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cache = str(Path(cache_dir).resolve()).encode()
    array = (ctypes.c_void_p * len(devices))(*devices)
    endpoint = f"{host}:{port}".encode()
    fn = _START_SERVER(start)

    def serve() -> None:
        fn(endpoint, cache, threads, len(devices), array)

    return [_device_info(d) for d in devices], serve


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on host:port (checked by binding it, as the server will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True

