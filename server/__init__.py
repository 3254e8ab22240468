"""`edgeinfer serve`: an OpenAI-compatible HTTP server over edgeinfer's BatchEngine.

Installed as `edgeinfer_server` (from the `server/` folder) with the `serve` extra; it uses only
edgeinfer's public API, and edgeinfer itself never imports it or any web framework.

    config = edgeinfer_server.ServerConfig(port=8080)
    sock = edgeinfer_server.bind(config.host, config.port)    # a taken port fails before the load
    engine = edgeinfer.BatchEngine.load(None, batch=edgeinfer.BatchOptions(parallel=4))
    edgeinfer_server.serve(engine, config, sock=sock)
"""

from __future__ import annotations

from .app import create_app
from .config import ServerConfig, check_credentials, is_loopback
from .errors import APIError
from .run import ListenError, bind, serve

__all__ = ["create_app", "serve", "bind", "ListenError", "ServerConfig", "APIError", "check_credentials",
           "is_loopback"]
