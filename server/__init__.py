"""`edgeinfer serve`: an OpenAI-compatible HTTP server over edgeinfer's ModelService (BatchEngines by name).

Installed as `edgeinfer_server` (from the `server/` folder) with the `serve` extra; it uses only
edgeinfer's public API, and edgeinfer itself never imports it or any web framework.

    config = edgeinfer_server.ServerConfig(port=8080)
    sock = edgeinfer_server.bind(config.host, config.port)    # a taken port fails before the load
    with edgeinfer.ModelService(edgeinfer.ServiceOptions(max_loaded=2)) as models:
        models.preload(None)                                  # the default model, loaded now
        edgeinfer_server.serve(models, config, sock=sock)
"""

from __future__ import annotations

from .app import create_app
from .config import ServerConfig, check_credentials, is_loopback
from .errors import APIError
from .run import ListenError, bind, serve

__all__ = ["create_app", "serve", "bind", "ListenError", "ServerConfig", "APIError", "check_credentials",
           "is_loopback"]
