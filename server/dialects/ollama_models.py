"""Ollama's model routes over edgeinfer's ModelService and store, with Ollama's field names:

- `GET /api/tags`: every model a request may name (`/v1/models`' list): name, model, modified_at,
  size, digest (the GGUF's sha256 where the store knows it), details (format gguf, family and
  families from the architecture, parameter_size, quantization_level: the nominal file type).
- `POST /api/show` {"model"}: details, model_info (the GGUF's scalar metadata), template (the
  model's chat template), parameters (`num_ctx` a request gets here), capabilities (completion,
  tools), modelfile (a FROM line naming the file), license.
- `GET /api/ps`: the loaded models: size (edgeinfer fit's estimate of weights, cache, buffers),
  size_vram 0 (the estimate does not split devices), expires_at, context_length (per request).
- `DELETE /api/delete` {"model"}: unloads it, then removes it from the store (as `edgeinfer rm`: a
  file the store does not own stays on disk); a file the operator configured is not the store's.
- `GET /api/version`, and `HEAD /` (the probe Ollama's CLI and libraries send): 200.
- `POST /api/embed` {"model", "input", "truncate" (default true, as Ollama's), "dimensions"} and
  the legacy `POST /api/embeddings` {"model", "prompt"}: the `/v1/embeddings` path; /api/embed's
  vectors are L2-normalized and the legacy route's are not, as Ollama's. A model that declares no
  pooling type (a generative model) is refused, as Ollama refuses models without the embedding
  capability (`/v1/embeddings` with `pooling` embeds with it anyway).
- `/api/create`, `/api/copy`, `/api/push`, `/api/blobs/...`: 501 saying what to use instead.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import edgeinfer
from edgeinfer.engine.chat.template import template_supports_tools
from edgeinfer.embedding_meta import POOLING_NAMES, POOLING_TYPES, pooling_key
from edgeinfer.engine.chat.tools import detect_format
from edgeinfer.service import ModelPlan, ModelService

from ..embeddings import EmbeddingsRequest, run_embeddings
from ..errors import APIError, from_library_error
from ..routing import keep_alive_field, plan_for
from .common import bad, check_fields, check_object, int_field, text_field

__all__ = ["tags_body", "show_body", "ps_body", "delete_model", "handle_embed", "OLLAMA_VERSION",
           "not_supported"]

OLLAMA_VERSION = "0.9.0"  # the Ollama release whose API these routes follow (format schemas, streamed tool calls)
_FOREVER = "2318-01-01T00:00:00Z"  # Ollama's expires_at for keep_alive < 0


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def parameter_size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _details(plan: ModelPlan) -> dict[str, Any]:
    info, m = plan.info, plan.manifest
    arch = m.architecture if m is not None else info.architecture
    quant = (m.quant if m is not None else None) or info.file_type or ""
    return {"parent_model": (m.derived_from if m is not None else None) or "", "format": "gguf", "family": arch,
            "families": [arch], "parameter_size": parameter_size(m.parameters if m is not None else info.parameter_count),
            "quantization_level": quant.upper()}


def _identity(plan: ModelPlan) -> dict[str, Any]:
    m = plan.manifest
    stat = plan.path.stat()
    return {"name": plan.name, "model": plan.name,
            "modified_at": m.created if m is not None and m.created else _iso(stat.st_mtime),
            "size": m.size if m is not None else stat.st_size, "digest": m.sha256 if m is not None else "",
            "details": _details(plan)}


def tags_body(service: ModelService) -> dict[str, Any]:
    """/api/tags (in a worker thread: it reads each model's GGUF header once)."""
    models = []
    for entry in service.catalog():
        try:
            models.append(_identity(service.plan(entry.name)))
        except (edgeinfer.EdgeInferError, OSError):
            continue  # a model whose file went away since the listing: not one a request may name
    return {"models": models}


def _model_name(body: Any, where: str) -> str:
    body = check_object(body)
    check_fields(body, {"model", "name", "verbose"}, where)
    name = text_field(body, "model") or text_field(body, "name")  # "name": the older clients' field
    if not name:
        raise bad("'model' is required", "model")
    return name


def show_body(service: ModelService, body: Any) -> dict[str, Any]:
    """/api/show (in a worker thread)."""
    name = _model_name(body, "/api/show")
    try:
        plan = service.plan(name)
        identity = _identity(plan)
    except (edgeinfer.ModelNotFoundError, FileNotFoundError) as e:
        raise APIError(404, str(e)) from None
    except edgeinfer.EdgeInferError as e:
        raise from_library_error(e) from None
    info = plan.info
    template = str(info.metadata.get("tokenizer.chat_template") or "")
    model_info = {k: v for k, v in info.metadata.items()
                  if isinstance(v, (str, int, float, bool)) and k != "tokenizer.chat_template"}
    model_info["general.parameter_count"] = info.parameter_count
    capabilities = ["completion", *(["embedding"] if embeds(plan) else [])]
    if not template or detect_format(template) is not None or not template_supports_tools(template):
        capabilities.append("tools")  # a template without tools gets edgeinfer's Hermes fallback
    return {"license": str(info.metadata.get("general.license") or ""), "modelfile": f"FROM {plan.path}\n",
            "parameters": f"num_ctx {plan.n_ctx_per_request}", "template": template, "details": identity["details"],
            "model_info": model_info, "capabilities": capabilities, "modified_at": identity["modified_at"]}


def ps_body(service: ModelService) -> dict[str, Any]:
    """/api/ps (in a worker thread)."""
    now = dt.datetime.now(dt.timezone.utc).timestamp()
    models = []
    for s in service.ps():
        try:
            plan = service.plan(s.name)
            identity = _identity(plan)
        except (edgeinfer.EdgeInferError, OSError):
            identity = {"name": s.name, "model": s.name, "digest": "", "details": {}}
        expires = _FOREVER if s.keep_alive < 0 else _iso(s.expires_at if s.expires_at is not None
                                                         else now + s.keep_alive)
        models.append({"name": identity["name"], "model": identity["model"], "size": s.memory.total,
                       "digest": identity["digest"], "details": identity["details"], "expires_at": expires,
                       "size_vram": 0, "context_length": s.n_ctx_per_request})
    return {"models": models}


def delete_model(service: ModelService, body: Any) -> None:
    """/api/delete (in a worker thread): unload the model, then remove it from the store."""
    name = _model_name(body, "/api/delete")
    store = service.store
    try:
        path, manifest = service.resolve(name)
    except edgeinfer.ModelNotFoundError:
        raise APIError(404, f"model {name[:200]!r} not found") from None
    except edgeinfer.EdgeInferError as e:
        raise from_library_error(e) from None
    if manifest is None or store.find(manifest.ref) is None:
        raise bad(f"{name[:200]!r} is a file the server was given ({Path(path).name}), not a model of its store: "
                  "it is not deleted", "model")
    try:
        service.stop(manifest.ref)
    except edgeinfer.ModelNotLoadedError:
        pass
    except edgeinfer.EdgeInferError as e:
        raise APIError(409, f"{manifest.ref} cannot be unloaded: {e}") from None
    try:
        store.remove(manifest.ref)
    except edgeinfer.EdgeInferError as e:
        raise APIError(409, str(e)) from None


async def handle_embed(service: Any, request: Request, legacy: bool) -> Response:
    """/api/embed, or the legacy /api/embeddings."""
    body = check_object(await service.read_json(request))
    fields = {"model", "prompt", "options", "keep_alive"} if legacy else \
        {"model", "input", "truncate", "options", "keep_alive", "dimensions"}
    check_fields(body, fields, "/api/embeddings" if legacy else "/api/embed")
    model = text_field(body, "model", required=True, empty=False)
    options = body.get("options")
    if options is not None and (not isinstance(options, Mapping) or any(v is not None for v in options.values())):
        raise bad("'options' are not supported by the embedding routes (the embedding context is the model's)",
                  "options")
    keep_alive = keep_alive_field(body)
    if legacy:
        prompt = text_field(body, "prompt", required=True)
        if not prompt:
            return JSONResponse({"embedding": []})
        inputs: tuple[str, ...] = (prompt,)
    else:
        value = body.get("input")
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad("'input' must be a non-empty string or a list of non-empty strings", "input")
        if len(value) > 2048:
            raise bad(f"'input' has {len(value)} items, more than the 2048 one request may embed", "input")
        inputs = tuple(value)
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad("'truncate' must be true or false", "truncate")
    options_ = edgeinfer.EmbedOptions(normalize=not legacy, truncate=truncate,
                                      dimensions=int_field(body, "dimensions", 1, 1 << 20))
    started = time.perf_counter()
    plan = await plan_for(service.models, model)
    parsed = EmbeddingsRequest(model, inputs, options_, False)

    def encode(result: Any, name: str, load_s: float) -> bytes:
        if legacy:
            return json.dumps({"embedding": result.vectors[0].tolist()}).encode()
        return json.dumps({"model": name, "embeddings": result.vectors.tolist(),
                           "total_duration": int((time.perf_counter() - started) * 1e9),
                           "load_duration": int(load_s * 1e9), "prompt_eval_count": result.prompt_tokens}).encode()

    if not embeds(plan):
        raise bad(f"{plan.name} does not support embeddings: it declares no pooling type (a generative model); "
                  "/v1/embeddings with \"pooling\": \"mean\" embeds with it anyway", "model")
    return await run_embeddings(service, request, parsed, keep_alive, encode)


def embeds(plan: ModelPlan) -> bool:
    """Whether a model declares a pooling type that makes one vector per text (an embedding model)."""
    code = plan.info.metadata.get(pooling_key(plan.info.architecture))
    try:
        return POOLING_NAMES.get(int(code)) in POOLING_TYPES
    except (TypeError, ValueError):
        return False


def not_supported(what: str) -> APIError:
    hints = {
        "create": "put a GGUF you have into the store with `edgeinfer import PATH` (or name it in serve.toml)",
        "copy": "give a model more names with `alias` in serve.toml",
        "push": "edgeinfer does not publish models",
        "blobs": "edgeinfer does not take uploads: `edgeinfer import PATH` on the server's machine",
    }
    return APIError(501, f"/api/{what} is not supported by edgeinfer: {hints[what]}")
