"""`edgeinfer doctor`: what this build of llama.cpp has (backends, devices and their memory, GPU
offload, RPC, CPU features), and how to build it for a GPU."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict

from ._common import common_options, rpc_workers_type

__all__ = ["register"]

# CMAKE_ARGS of llama-cpp-python's README for each GPU backend.
GPU_BUILDS = {"Metal": "-DGGML_METAL=on", "CUDA": "-DGGML_CUDA=on", "Vulkan": "-DGGML_VULKAN=on"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        parents=[common_options()],
        help="what this llama.cpp build has: backends, devices and memory, GPU offload, RPC, CPU features",
        description="Print what this build of llama.cpp (llama-cpp-python) has: its backends and their devices with "
        "the memory they report, whether layers can be offloaded (--gpu-layers), whether RPC workers can be used "
        "(--rpc) and served (rpc-worker), the CPU features llama.cpp uses, and how to rebuild for a GPU. With --rpc "
        "it also probes those workers (protocol version, memory).",
    )
    p.add_argument("--rpc", type=rpc_workers_type, default=(), metavar="HOST:PORT,...", help="also probe these RPC workers")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _rebuild(flag: str) -> str:
    from importlib.metadata import version

    return (f'CMAKE_ARGS="-DGGML_RPC=ON {flag}" {shlex.quote(sys.executable)} -m pip install --force-reinstall '
            f"--no-cache-dir --no-deps llama-cpp-python=={version('llama-cpp-python')}")


def run(args: argparse.Namespace) -> int:
    from edgeinfer import devices

    info = devices.build_info()
    workers = []
    failed = []
    for endpoint in args.rpc:
        try:
            workers.append(devices.probe_worker(endpoint))
        except devices.RpcWorkerError as e:
            failed.append(str(e))
    if args.json:
        out = asdict(info) | {"workers": [asdict(w) for w in workers], "worker_errors": failed}
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    print(f"llama-cpp-python  {info.llama_cpp_python}")
    for backend in info.backends:
        if backend.devices:
            devs = "; ".join(f"{d.name}: {d.description} ({d.kind}, {_gib(d.memory_total)} total, "
                             f"{_gib(d.memory_free)} free)" if d.memory_total else f"{d.name}: {d.description} ({d.kind})"
                             for d in backend.devices)
        else:
            devs = "no devices of its own (workers are added with --rpc)" if backend.name == "RPC" else "no devices"
        print(f"backend {backend.name:<9} {devs}")
    if info.local_gpus:
        print(f"GPU offload       yes: --gpu-layers puts layers on {', '.join(d.name for d in info.local_gpus)} "
              "(default auto: as many as fit)")
    else:
        why = " (llama_supports_gpu_offload() says yes only because RPC is compiled in)" if info.supports_gpu_offload else ""
        print(f"GPU offload       no GPU backend in this build: every layer runs on the CPU{why}")
    if info.rpc:
        print(f"RPC               yes, protocol v{'.'.join(map(str, info.rpc_protocol))}: `edgeinfer rpc-worker` lends "
              "this machine, --rpc HOST:PORT uses other machines")
    else:
        print(f"RPC               no: rebuild with {devices.rebuild_command()}")
    on = [name for name, value in info.cpu_features.items() if value not in ("0", "")]
    print(f"CPU features      {' '.join(on) if on else info.system_info or '-'}")
    for w in workers:
        mem = ", ".join(f"device {i}: {_gib(free)} free of {_gib(total)}" for i, (free, total) in enumerate(w.memory))
        print(f"worker {w.endpoint}  protocol {w.version}; {mem}")
    for message in failed:
        print(f"worker error      {message}")
    if not info.local_gpus:
        print("\nto use a GPU, rebuild llama-cpp-python with its backend (pip would reuse the cached CPU wheel "
              "without --no-cache-dir):")
        for name, flag in GPU_BUILDS.items():
            print(f"  {name + ':':<8}{_rebuild(flag)}")
    return 1 if failed else 0
