"""The RPC workers this process offloads to: added as ggml devices, their connections hardened, a
lost one reported in one line.

Workers are added as llama.cpp's `add_rpc_devices` does, through
`ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server")`, but not registered
globally: a load uses them only when its own options name them. Each is probed first
(rpc_client.py): ggml-rpc aborts the process on a worker that is down, busy or incompatible.

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
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .registry import ABORT_CALLBACK, DeviceInfo, c_text, device_info, ggml, require_rpc
from .rpc_client import RpcWorkerError, probe_worker

__all__ = ["harden", "our_sockets", "rpc_devices"]

log = logging.getLogger(__name__)

_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


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
def our_sockets(endpoints: Sequence[str]) -> Iterator[list[tuple[str, int, socket.socket]]]:
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
    with our_sockets([endpoint]) as socks:
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


def harden(endpoints: Sequence[str]) -> int:
    """TCP keepalive and a user timeout on our connections to the workers, so that a worker whose
    host vanishes ends the process with the lost-worker error (see the module's docstring) instead
    of leaving a decode waiting for an answer that never comes. Returns how many sockets it set."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30_000)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    n = 0
    with our_sockets(endpoints) as socks:
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
        text = c_text(message)
        if "RPC" in text or "rpc" in text:
            os.write(2, _lost_worker_message(text).encode("utf-8", errors="replace"))
            os._exit(1)
        os.write(2, (text + "\n").encode("utf-8", errors="replace"))
    except BaseException:  # noqa: BLE001, S110 - nothing may cross back into C, and stderr may be gone
        pass


def _install_abort_handler() -> None:
    global _abort_callback_ref
    if _abort_callback_ref is None:
        _abort_callback_ref = ABORT_CALLBACK(_on_ggml_abort)
        ggml().ggml_set_abort_callback(_abort_callback_ref)


def _worker_devices(endpoint: str) -> list[int]:
    """The worker's devices as ggml device handles (added once per process, as llama.cpp's
    add_rpc_devices does, but not registered globally)."""
    with _workers_lock:
        known = _workers.get(endpoint)
        if known is not None:
            return known.devices
        reg_rpc = require_rpc()
        g = ggml()
        add_server = _ADD_SERVER(g.ggml_backend_reg_get_proc_address(reg_rpc, b"ggml_backend_rpc_add_server"))
        _install_abort_handler()
        reg = add_server(endpoint.encode())
        if not reg:
            raise RpcWorkerError(f"RPC worker {endpoint} has no devices")
        devices = [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))]
        _workers[endpoint] = _Worker(endpoint, devices)
        return devices


def rpc_devices(endpoints: Sequence[str]) -> list[tuple[int, DeviceInfo]]:
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
            infos = [device_info(d, "rpc", endpoint) for d in handles]
        else:
            worker = probe_worker(endpoint)
            handles = _worker_devices(endpoint)
            infos = [_device_info_from_probe(d, endpoint, worker.memory[i] if i < len(worker.memory) else (0, 0))
                     for i, d in enumerate(handles)]
        out.extend(zip(handles, infos))
    return out


def _device_info_from_probe(dev: int, endpoint: str, memory: tuple[int, int]) -> DeviceInfo:
    """A worker's device described without asking ggml-rpc (which would open a connection)."""
    g = ggml()
    return DeviceInfo(name=c_text(g.ggml_backend_dev_name(dev)), description=c_text(g.ggml_backend_dev_description(dev)),
                      kind="rpc", backend=f"RPC[{endpoint}]", memory_free=memory[0], memory_total=memory[1],
                      endpoint=endpoint)
