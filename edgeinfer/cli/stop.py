"""`edgeinfer stop MODEL`: unload a model from a running server now (as `ollama stop`), through its
/edgeinfer/stop route; requests running on it end with finish_reason "cancelled"."""

from __future__ import annotations

import argparse
import sys

from ._admin import add_server_options, admin_request
from ._common import common_options

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from edgeinfer.service import DEFAULT_STOP_TIMEOUT

    p = sub.add_parser("stop", parents=[common_options()], help="unload a model from a running server",
                       description="Unload MODEL from `edgeinfer serve` now, freeing its memory; its running "
                       "requests are cancelled (they end with finish_reason 'cancelled'). A later request for it "
                       "loads it again. An unload that takes longer than "
                       f"{DEFAULT_STOP_TIMEOUT:g} s goes on in the server: exit status 1 then, and `edgeinfer ps` "
                       "shows it until it is gone.")
    p.add_argument("model", help="the model, as `edgeinfer ps` names it (or any name a request may use)")
    add_server_options(p)
    p.set_defaults(func=stop)


def stop(args: argparse.Namespace) -> int:
    data = admin_request(args, "POST", "/edgeinfer/stop", {"model": args.model})
    n = data.get("cancelled", 0)
    cancelled = f" ({n} request{'s' if n != 1 else ''} cancelled)" if n else ""
    if data.get("stopped") is False:  # the unload goes on in the server (202)
        print(f"edgeinfer: {data.get('message') or 'still unloading'}{cancelled}", file=sys.stderr)
        return 1
    print(f"edgeinfer: stopped {data.get('model', args.model)}{cancelled}", file=sys.stderr)
    return 0
