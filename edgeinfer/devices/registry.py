"""ggml's backend registry through ctypes: the backends and devices this llama.cpp build has.

The build decides what exists. llama-cpp-python compiles llama.cpp with the backends its
CMAKE_ARGS name (Metal by default on Apple Silicon; `-DGGML_CUDA=on`, `-DGGML_VULKAN=on`,
`-DGGML_RPC=ON`); ggml's backend registry lists them and their devices, with the memory each reports
(`ggml_backend_dev_memory`). `llama_supports_gpu_offload()` is no guide to a GPU (it is true for any
build with RPC compiled in): `local_gpu_devices()` is.
"""

from __future__ import annotations

import ctypes
import shlex
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EdgeInferError
from .rpc_client import RPC_PROTOCOL

__all__ = [
    "ABORT_CALLBACK",
    "DEV_ACCEL",
    "DEV_CPU",
    "DEV_GPU",
    "DEV_IGPU",
    "BackendInfo",
    "BuildInfo",
    "DeviceInfo",
    "RpcUnavailableError",
    "build_info",
    "c_text",
    "device_info",
    "device_memory",
    "ggml",
    "has_rpc",
    "local_gpu_devices",
    "local_gpu_handles",
    "rebuild_command",
    "require_rpc",
]

# ggml_backend_dev_type (ggml-backend.h)
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL, DEV_META = range(5)


class RpcUnavailableError(EdgeInferError, RuntimeError):
    """This llama-cpp-python was built without llama.cpp's RPC backend (a cached wheel)."""


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


class _DevCaps(ctypes.Structure):
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class _DevProps(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _DevCaps)]


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
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
    "ggml_set_abort_callback": (ctypes.c_void_p, [ABORT_CALLBACK]),
}

_ggml_lock = threading.Lock()
_ggml_lib: Any = None


def ggml() -> Any:
    """libggml (and, through its dependencies, libggml-base) with the registry's signatures set."""
    global _ggml_lib
    with _ggml_lock:
        if _ggml_lib is None:
            from ..llama_backend import backend

            ll = backend()  # llama_backend_init: ggml's backends are registered
            from llama_cpp._ctypes_extensions import load_shared_library

            lib = load_shared_library("ggml", Path(ll.__file__).parent / "lib")
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _ggml_lib = lib
    return _ggml_lib


def c_text(raw: bytes | None) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


def device_memory(dev: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml().ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


_KINDS = {DEV_CPU: "cpu", DEV_GPU: "gpu", DEV_IGPU: "igpu", DEV_ACCEL: "accel", DEV_META: "meta"}


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


def device_info(dev: int, kind: str | None = None, endpoint: str | None = None) -> DeviceInfo:
    g = ggml()
    free, total = device_memory(dev)
    reg = g.ggml_backend_dev_backend_reg(dev)
    return DeviceInfo(
        name=c_text(g.ggml_backend_dev_name(dev)),
        description=c_text(g.ggml_backend_dev_description(dev)),
        kind=kind or _KINDS.get(g.ggml_backend_dev_type(dev), "other"),
        backend=c_text(g.ggml_backend_reg_name(reg)) if reg else "",
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
    g = ggml()
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
    return ggml().ggml_backend_reg_by_name(b"RPC")


def _registry() -> Iterator[tuple[str, int, list[int]]]:
    g = ggml()
    for i in range(g.ggml_backend_reg_count()):
        reg = g.ggml_backend_reg_get(i)
        yield c_text(g.ggml_backend_reg_name(reg)), reg, [g.ggml_backend_reg_dev_get(reg, j)
                                                         for j in range(g.ggml_backend_reg_dev_count(reg))]


def local_gpu_handles() -> list[int]:
    """llama.cpp's default offload devices without RPC (llama.cpp: llama_prepare_model_devices):
    every GPU (one per device id when two backends see the same card), integrated GPUs only when
    there is no discrete one."""
    g = ggml()
    gpus: list[int] = []
    seen: set[str] = set()
    igpus: list[int] = []
    for _name, _reg, devs in _registry():
        for dev in devs:
            kind = g.ggml_backend_dev_type(dev)
            if kind == DEV_GPU:
                props = _DevProps()
                g.ggml_backend_dev_get_props(dev, ctypes.byref(props))
                dev_id = c_text(props.device_id)
                if dev_id and dev_id in seen:
                    continue
                seen.add(dev_id) if dev_id else None
                gpus.append(dev)
            elif kind == DEV_IGPU and (not igpus or g.ggml_backend_dev_backend_reg(dev)
                                        == g.ggml_backend_dev_backend_reg(igpus[-1])):
                igpus.append(dev)
    return gpus or igpus


def local_gpu_devices() -> tuple[DeviceInfo, ...]:
    """The local devices layers can be offloaded to (empty on a CPU-only build)."""
    return tuple(device_info(d) for d in local_gpu_handles())


def _cpu_features() -> dict[str, str]:
    g = ggml()
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
        out[c_text(features[i].name)] = c_text(features[i].value)
        i += 1
    return out


def build_info() -> BuildInfo:
    from importlib.metadata import version

    from ..llama_backend import backend

    ll = backend()
    backends = tuple(BackendInfo(name, tuple(device_info(d) for d in devs)) for name, _reg, devs in _registry())
    info = ll.llama_print_system_info()
    return BuildInfo(
        llama_cpp_python=version("llama-cpp-python"),
        backends=backends,
        rpc=has_rpc(),
        rpc_protocol=RPC_PROTOCOL,
        supports_gpu_offload=bool(ll.llama_supports_gpu_offload()),
        local_gpus=local_gpu_devices(),
        cpu_features=_cpu_features(),
        system_info=c_text(info).strip(),
    )


# -- RPC workers -------------------------------------------------------------------------------------
