"""What `edgeinfer ps` and `edgeinfer stop` share: the server's address, its API key, and one
request to its admin routes (/edgeinfer/ps, /edgeinfer/stop) with one-line errors."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_server_options", "admin_request", "DEFAULT_URL"]

DEFAULT_URL = "http://127.0.0.1:8080"  # `edgeinfer serve`'s default address


def add_server_options(p: argparse.ArgumentParser) -> None:
    from .serve import API_KEY_ENV

    p.add_argument("--url", default=DEFAULT_URL, help="the server's address (its /v1 suffix may be left out)")
    p.add_argument("--api-key", help=f"the server's API key (other users can read it in the process list: prefer "
                   f"{API_KEY_ENV} or --api-key-file)")
    p.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE (one line)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds to wait for the server")


def _base(url: str) -> str:
    from edgeinfer import InvalidOptionError

    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidOptionError(f"--url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def admin_request(args: argparse.Namespace, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON answer of one admin request; EdgeInferError (one line) for anything else."""
    import httpx2 as httpx

    from edgeinfer import EdgeInferError, InvalidOptionError

    from .serve import API_KEY_ENV, api_key

    base = _base(args.url)
    if not (args.timeout > 0):
        raise InvalidOptionError(f"--timeout must be more than 0 seconds, got {args.timeout}")
    key = api_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, base + route, json=body, headers=headers, timeout=args.timeout)
    except httpx.TimeoutException:
        raise EdgeInferError(f"the server at {base} did not answer within {args.timeout:g} s") from None
    except httpx.HTTPError as e:
        raise EdgeInferError(f"cannot reach a server at {base}: {e} (is `edgeinfer serve` running there? --url)") \
            from None
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code == 401:
        raise EdgeInferError(f"the server at {base} needs its API key ({API_KEY_ENV}, --api-key-file or --api-key)")
    if r.status_code == 404 and not (isinstance(data, dict) and data.get("error", {}).get("param")):
        raise EdgeInferError(f"{base} has no {route} route: is it an edgeinfer server?")
    if r.status_code >= 400:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise EdgeInferError(message or f"the server answered {r.status_code}")
    if data is None:
        raise EdgeInferError(f"the server at {base} answered {route} with something that is not JSON")
    return data
