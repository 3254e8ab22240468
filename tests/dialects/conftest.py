"""The one server the dialect tests share (a session fixture: one per pytest-xdist worker that runs
any of tests/dialects/): the real CLI in a subprocess (tests/test_server.py's Server) on an F16
copy of the default model — F16 because
its greedy output does not depend on the batch shape (DESIGN.md: Q4_1's batched rows round
differently), so each dialect's answer can be compared token for token with the OpenAI route's.

Besides the chat model it serves a tiny Qwen3-Embedding-shaped model (random weights, converted
once per run; named in the server's serve.toml, so a request names it by its file stem) for the
embedding routes, and pulls from a local Hugging Face Hub (tests/hub_server.py) started before it
(HF_ENDPOINT in its environment) that holds one small GGUF repository. It requires an API key
(so every route's key rule is exercised) and lets one other origin's pages in (CORS).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import HubServer, tiny_gguf
from once_per_run import once_per_run
from test_server import Server

sys.path.insert(0, str(Path(__file__).parent))  # dialect_support

from dialect_support import APP_ORIGIN, EMBED_MODEL, KEY, TINY_REPO  # noqa: E402


@pytest.fixture(scope="session")
def embedding_gguf(tmp_path_factory) -> Path:
    """A Qwen3-Embedding-shaped model (last-token pooling, normalized) as an F32 GGUF, made once per run."""
    def make(root: Path) -> Path:
        import edgeinfer
        from edgeinfer.convert import convert_model
        from hf_models import make_embedding_hf_model

        folder = make_embedding_hf_model(root / "dialect-embedding-hf")
        out = root / "dialect-embedding" / f"{EMBED_MODEL}.gguf"
        out.parent.mkdir(exist_ok=True)
        convert_model(folder, "f32", output=out, register=False, store=edgeinfer.Store(root / "dialect-convert-store"))
        return out

    return once_per_run(tmp_path_factory, "dialect-embedding-gguf", make)


@pytest.fixture(scope="session")
def dialect_hub(tmp_path_factory) -> Iterator[HubServer]:
    with HubServer() as hub:
        hub.add_repo(TINY_REPO, {"Tiny-Q8_0.gguf": tiny_gguf(tmp_path_factory.mktemp("tiny") / "t.gguf", "Q8_0",
                                                             rows=4096),
                                 "README.md": "# tiny\n"})
        yield hub


@pytest.fixture(scope="session")
def dialect_server(q4_path, embedding_gguf, dialect_hub, tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("serve-dialects")
    (home / "serve.toml").write_text(f'[models."{embedding_gguf}"]\nparallel = 1\nctx = 512\n')
    key_file = home / "key.txt"
    key_file.write_text(KEY + "\n")
    saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN")}
    os.environ.update(HF_ENDPOINT=dialect_hub.url, HF_HOME=str(home / "hf-home"))  # the child's, at its start
    os.environ.pop("HF_HUB_OFFLINE", None)
    os.environ.pop("HF_TOKEN", None)
    try:
        server = Server(q4_path, home, "--parallel", "4", "--ctx", "8192", "--max-tokens-limit", "512",
                        "--api-key-file", str(key_file), "--cors-origins", APP_ORIGIN)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield server
    assert server.stop() == 0
    assert not any("Traceback" in line for line in server.log), "".join(server.log)
