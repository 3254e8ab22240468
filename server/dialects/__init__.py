"""Three more API dialects over the same service and engine: OpenAI's Responses
(`/v1/responses`), Anthropic's Messages (`/v1/messages`, `/v1/messages/count_tokens`) and Ollama's
API (`/api/...`, `HEAD /`). Each route translates its request into the body the OpenAI routes
parse (server/protocol.py) and runs it down the one request path (server/app.py's `generate`);
only the reply is the dialect's (server/reply.py). Errors take each dialect's shape
(server/dialects/shapes.py); the Host, Origin, CORS, key and size rules are the server's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import edgeinfer

from .anthropic import handle_count_tokens, handle_messages
from .ollama import handle_ollama_generation
from .ollama_models import OLLAMA_VERSION, delete_model, handle_embed, not_supported, ps_body, show_body, tags_body
from .ollama_pull import PullRoute
from .response_store import ResponseStore
from .responses import handle_responses
from .shapes import ANTHROPIC, OLLAMA, OPENAI

__all__ = ["dialect_routes"]


def dialect_routes(service: Any, endpoint: Callable[..., Callable[[Request], Any]]) -> list[Route]:
    """The routes of the three dialects; `endpoint(name, handler, shape)` is the app's wrapper
    (the key check, errors in the dialect's shape, the request counters)."""
    store = ResponseStore()
    pull = PullRoute(service)
    models = service.models

    async def version(request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION, "edgeinfer": edgeinfer.__version__})

    async def probe(request: Request) -> Response:
        return Response("Ollama is running", media_type="text/plain")

    async def tags(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(tags_body, models))

    async def show(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(show_body, models, await service.read_json(request)))

    async def ps(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(ps_body, models))

    async def delete(request: Request) -> Response:
        await run_in_threadpool(delete_model, models, await service.read_json(request))
        return Response(status_code=200)

    def unsupported(what: str):
        async def refuse(request: Request) -> Response:
            raise not_supported(what)
        return refuse

    return [
        Route("/v1/responses", endpoint("responses", lambda r: handle_responses(service, store, r), OPENAI),
              methods=["POST"]),
        Route("/v1/messages", endpoint("messages", lambda r: handle_messages(service, r), ANTHROPIC),
              methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint("count_tokens", lambda r: handle_count_tokens(service, r),
                                                    ANTHROPIC), methods=["POST"]),
        Route("/api/chat", endpoint("ollama_chat", lambda r: handle_ollama_generation(service, r, "chat"), OLLAMA),
              methods=["POST"]),
        Route("/api/generate", endpoint("ollama_generate", lambda r: handle_ollama_generation(service, r, "generate"),
                                        OLLAMA), methods=["POST"]),
        Route("/api/embed", endpoint("ollama_embed", lambda r: handle_embed(service, r, False), OLLAMA),
              methods=["POST"]),
        Route("/api/embeddings", endpoint("ollama_embeddings", lambda r: handle_embed(service, r, True), OLLAMA),
              methods=["POST"]),
        Route("/api/tags", endpoint("ollama_tags", tags, OLLAMA), methods=["GET"]),
        Route("/api/show", endpoint("ollama_show", show, OLLAMA), methods=["POST"]),
        Route("/api/ps", endpoint("ollama_ps", ps, OLLAMA), methods=["GET"]),
        Route("/api/pull", endpoint("ollama_pull", pull, OLLAMA), methods=["POST"]),
        Route("/api/delete", endpoint("ollama_delete", delete, OLLAMA), methods=["DELETE"]),
        Route("/api/version", endpoint("ollama_version", version, OLLAMA), methods=["GET"]),
        Route("/", endpoint("ollama_probe", probe, OLLAMA), methods=["HEAD"]),
        *(Route(f"/api/{what}", endpoint(f"ollama_{what}", unsupported(what), OLLAMA), methods=["POST"])
          for what in ("create", "copy", "push")),
        Route("/api/blobs/{digest}", endpoint("ollama_blobs", unsupported("blobs"), OLLAMA), methods=["HEAD", "POST"]),
    ]
