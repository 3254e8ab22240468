"""`edgeinfer ps`: the models a running server holds (as `ollama ps`), through its /edgeinfer/ps route."""

from __future__ import annotations

import argparse
import json
import time

from ._admin import add_server_options, admin_request
from ._common import common_options, format_bytes, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", parents=[common_options()], help="list the models a running server holds",
                       description="The models `edgeinfer serve` holds now: each one's estimated memory by part "
                       "(weights and the copies llama.cpp's CPU backend repacks, KV cache for its slots, compute buffers), busy slots, idle time and when its "
                       "keep-alive runs out; and the server process's resident memory beside their sum.")
    add_server_options(p)
    p.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    p.set_defaults(func=ps)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _until(m: dict) -> str:
    if m["state"] != "ready":
        return m["state"]
    if m["requests"]:
        return "busy"
    if m["expires_in_s"] is None:
        return "forever"
    return f"in {_duration(m['expires_in_s'])}"


def ps(args: argparse.Namespace) -> int:
    data = admin_request(args, "GET", "/edgeinfer/ps")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = []
    for m in data["models"]:
        mem = m["memory"]
        weights = format_bytes(mem["weights"]) + (f" +{format_bytes(mem['repack'])} repacked" if mem.get("repack") else "")
        rows.append([m["name"], format_bytes(mem["total"]), weights, format_bytes(mem["kv_cache"]),
                     format_bytes(mem["compute"]) + (f" +{format_bytes(mem['draft'])} draft" if mem["draft"] else ""),
                     f"{m['slots_busy']}/{m['parallel']}", str(m["n_ctx_per_request"]),
                     "-" if m["idle_s"] is None else _duration(m["idle_s"]), _until(m)])
    if rows:
        print_table(rows, ["NAME", "MEMORY", "WEIGHTS", "KV CACHE", "COMPUTE", "SLOTS", "CTX", "IDLE", "UNTIL"])
    else:
        print("no model loaded")
    proc = data.get("process") or {}
    held = f"{len(data['models'])} of {data['max_loaded']} models, ~{format_bytes(data['reserved'])} of a " \
           f"{format_bytes(data['budget'])} budget"
    if "rss" in proc:
        print(f"server process {proc['pid']}: {format_bytes(proc['rss'])} resident (mapped files "
              f"{format_bytes(proc.get('file', 0))}, anonymous {format_bytes(proc.get('anon', 0))}); {held}")
    else:
        print(held)
    age = time.time() - data.get("time", time.time())
    if age > 5:
        print(f"(the server's clock is {age:.0f} s behind this one's)")
    return 0
