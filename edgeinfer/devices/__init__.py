"""Where a model's layers run: the backends and devices this llama.cpp build has, llama.cpp's RPC
workers, and the `llama_model_params` of every load.

    registry.py      ggml's backend registry through ctypes: backends, devices, their memory, the build
    rpc_client.py    a Python client of the ggml-rpc protocol: worker addresses, the probe of a worker
    connections.py   the workers this process offloads to: added as devices, keepalive, a lost worker
    placement.py     where each layer lands (pure arithmetic over the devices' memory)
    model_params.py  a placement as `llama_model_params` fields (devices, n_gpu_layers, tensor_split)
    worker.py        this machine lent to another as llama.cpp's RPC server
"""

from __future__ import annotations

from .model_params import last_placement, offload_targets, placement_fields
from .placement import ModelSizes, Part, Placement, PlacementError, check_placement, host_only, plan_placement
from .registry import (BackendInfo, BuildInfo, DeviceInfo, RpcUnavailableError, build_info, has_rpc, local_gpu_devices,
                       rebuild_command, require_rpc)
from .rpc_client import (DEFAULT_RPC_PORT, MAX_RPC_WORKERS, RPC_PROTOCOL, RpcWorkerError, WorkerInfo, parse_endpoint,
                         parse_endpoints, probe_worker)
from .worker import check_worker_host, port_is_free, start_rpc_server

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
