"""The worker side: this machine lent to another as llama.cpp's RPC server (`edgeinfer rpc-worker`).

llama.cpp's RPC server has no authentication and no encryption, so it listens on loopback unless
its caller says the network is trusted.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import socket
from pathlib import Path
from typing import Any

from ..errors import InvalidOptionError
from .registry import DEV_ACCEL, DEV_CPU, DeviceInfo, RpcUnavailableError, c_text, device_info, device_memory, ggml, \
    require_rpc

__all__ = ["check_worker_host", "port_is_free", "start_rpc_server"]

_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p))
_GET_MEMORY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))


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


_mem_callback_ref: Any = None


def _cap_reported_memory(dev: int, cap: int) -> None:
    """Make `dev` report at most `cap` bytes (free and total) to the RPC clients that plan on it:
    its get_memory entry (the third function of ggml_backend_device_i, ggml-backend-impl.h) is
    replaced by one that clamps the original's answer. Only for a process that is a worker."""
    global _mem_callback_ref
    g = ggml()
    slots = ctypes.cast(dev, ctypes.POINTER(ctypes.c_void_p))
    original = _GET_MEMORY(slots[2])

    def get_memory(d: Any, free: Any, total: Any) -> None:
        original(d, free, total)
        free[0] = min(free[0], cap)
        total[0] = min(total[0], cap)

    _mem_callback_ref = _GET_MEMORY(get_memory)
    slots[2] = ctypes.cast(_mem_callback_ref, ctypes.c_void_p).value
    free, total = device_memory(dev)
    if total > cap or free > cap:
        raise RuntimeError(f"could not cap the memory {c_text(g.ggml_backend_dev_name(dev))} reports")


def _server_devices() -> list[int]:
    """The devices a worker serves (llama.cpp's rpc-server: every GPU, else the CPU)."""
    g = ggml()
    devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
    gpus = [d for d in devs if g.ggml_backend_dev_type(d) not in (DEV_CPU, DEV_ACCEL)
            and not c_text(g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(d))).startswith("RPC")]
    return gpus or [d for d in devs if g.ggml_backend_dev_type(d) == DEV_CPU][:1]


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
    g = ggml()
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

    return [device_info(d) for d in devices], serve


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
