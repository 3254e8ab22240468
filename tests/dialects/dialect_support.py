"""What the dialect tests share besides the server (tests/dialects/conftest.py): its names, its
key, and a raw request helper."""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
from test_server import MODEL_FILE

__all__ = ["KEY", "MODEL", "EMBED_MODEL", "APP_ORIGIN", "TINY_REPO", "auth", "send"]

KEY = "dialect-key-123"
MODEL = MODEL_FILE  # the chat model's name (its file name)
EMBED_MODEL = "tiny-embedding-f32"  # the embedding model's name (its file stem)
APP_ORIGIN = "http://app.example:3000"  # --cors-origins
TINY_REPO = "tester/Tiny-GGUF"  # on the local hub: one Q8_0 file


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def send(method: str, url: str, body: Any, status: int, headers: dict[str, str] | None = None) -> Any:
    """A raw request (bytes as they are, anything else as JSON) that must get `status`; its JSON body.
    `headers` replace the API key (None: the key as a Bearer token)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.request(method, url, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(auth() if headers is None else headers)})
    assert r.status_code == status, (url, r.text[:500])
    return r.json()
