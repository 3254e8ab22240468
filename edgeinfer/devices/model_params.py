"""The `llama_model_params` of every load: the devices a placement uses, in llama.cpp's terms.

A device here is anything llama.cpp can offload layers to: a local GPU or integrated GPU, or a
device of an RPC worker. The local CPU is the host: it always holds the input embedding and whatever
layers are not offloaded.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .connections import harden, rpc_devices
from .placement import Placement
from .registry import DeviceInfo, device_info, local_gpu_handles

__all__ = ["last_placement", "offload_targets", "placement_fields"]

log = logging.getLogger(__name__)


def offload_targets(rpc: Sequence[str] = ()) -> list[tuple[int, DeviceInfo]]:
    """The devices a load can offload to, as (ggml_backend_dev_t, DeviceInfo) in llama.cpp's order:
    the RPC workers' (probed first: RpcWorkerError), then local GPUs."""
    local = [(d, device_info(d)) for d in local_gpu_handles()]
    return rpc_devices(rpc) + local


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
                    log.debug("keepalive set on %d connection(s) to RPC workers", harden(endpoints))
                except Exception:  # never into C
                    log.debug("could not set keepalive on the RPC connections", exc_info=True)
            return True

        fields["progress_callback"] = ll.llama_progress_callback(on_progress)
    log.info("placement of %s: %s", path.name, placement.summary())
    return fields
