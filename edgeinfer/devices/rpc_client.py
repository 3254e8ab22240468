"""A Python client of llama.cpp's ggml-rpc protocol: worker addresses, and the probe that asks a worker
its protocol version and its devices' memory before ggml-rpc itself connects.

ggml-rpc aborts the process on a worker that is down, busy with another client (a worker serves one
client at a time) or speaks another protocol version; asked here first (a TCP connection and the
protocol's HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY messages), each is a one-line error before any
weight moves.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import EdgeInferError, InvalidOptionError

__all__ = [
    "DEFAULT_RPC_PORT",
    "MAX_RPC_WORKERS",
    "RPC_PROTOCOL",
    "RpcWorkerError",
    "WorkerInfo",
    "parse_endpoint",
    "parse_endpoints",
    "probe_worker",
]

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of ggml-rpc.h in the llama.cpp that llama-cpp-python 0.3.36
# vendors (tests/test_rpc.py checks it against what our own worker answers).
RPC_PROTOCOL: tuple[int, int, int] = (7, 0, 0)
DEFAULT_RPC_PORT = 50052
MAX_RPC_WORKERS = 16  # GGML_RPC_MAX_SERVERS
_PROBE_TIMEOUT = 5.0

# ggml-rpc's messages (ggml-rpc.cpp: rpc_cmd, rpc_msg_hello_rsp; transport.h: RPC_CONN_CAPS_SIZE)
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CONN_CAPS = 24


class RpcWorkerError(EdgeInferError, ConnectionError):
    """An RPC worker that is down, busy, unreachable or speaks another protocol version."""


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
