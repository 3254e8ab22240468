"""A local stand-in for the Hugging Face Hub, enough for what `huggingface_hub` 2.4.0 calls when
it reads model info and downloads files, and for what `edgeinfer.hub` calls.

Routes (found by reading the installed client and logging its requests):
  GET  /api/models/{owner}/{name}[/revision/{rev}][?blobs=true]   model info, siblings, sha
  GET  /api/models/{owner}/{name}/tree/{rev}[/{path}][?recursive=]  file listing with oid, size, lfs
  HEAD /{owner}/{name}/resolve/{rev}/{file}                          ETag, X-Repo-Commit, sizes
  GET  /{owner}/{name}/resolve/{rev}/{file}                          body, with Range (206)
  GET  /_cdn/{sha}                                                   body after a redirect (knob)

ETag is `"<sha256>"` for LFS files and the git blob sha1 for the others, as on the Hub.

Knobs, per file (`repo_id`, `path`), for the failure tests:
  cut_at[(repo, path)] = N     every response that would cross byte N of the file stops there and
                                the connection is dropped (so a resume from N gets nothing more)
  corrupt.add((repo, path))    the body served has one byte flipped
  fake_size[(repo, path)] = N  the listings and HEAD report N bytes
  tokens[repo] = "tok"         the repo is gated: 401 GatedRepo without `Authorization: Bearer tok`
  slow[(repo, path)] = s       bodies go out in 64 KiB pieces with s seconds between them
  down = True                  every API and resolve request answers 503
  bare_info = True             model info lists names only, so clients must read the tree listing
  redirect = True              resolve answers 302 to /_cdn/{sha} as the Hub does for LFS files
Every request is appended to `log` (method, path, Range header, whether it carried a token, status).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["HubServer", "RequestRecord", "git_blob_sha1", "tiny_gguf", "point_client_at", "local_hub", "LFS_SUFFIXES"]

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
_CHUNK = 1 << 20
_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256_path(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


@dataclass
class _File:
    path: str
    size: int
    lfs: bool
    sha256: str  # of the content
    oid: str  # git blob id: of the content (regular) or of the pointer file (LFS)
    data: bytes | None = None
    source: Path | None = None

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the content."""
        if self.data is not None:
            return self.data[start:end]
        assert self.source is not None
        with open(self.source, "rb") as f:
            f.seek(start)
            return f.read(end - start)


@dataclass
class _Repo:
    repo_id: str
    commits: dict[str, dict[str, _File]] = field(default_factory=dict)  # commit -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # decoded, without the query
    query: str
    range: str | None
    authorized: bool
    status: int


class HubServer:
    """Start with `with HubServer() as hub:`; `hub.url` is the endpoint to give HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.log: list[RequestRecord] = []
        self.cut_at: dict[tuple[str, str], int] = {}
        self.corrupt: set[tuple[str, str]] = set()
        self.fake_size: dict[tuple[str, str], int] = {}
        self.tokens: dict[str, str] = {}
        self.slow: dict[tuple[str, str], float] = {}
        self.redirect = False
        self.bare_info = False
        self.down = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- repositories ----------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes | str | Path], *, revision: str = "main") -> str:
        """Publish a commit with these files on `revision`; returns the commit hash."""
        entries: dict[str, _File] = {}
        for name, content in files.items():
            if isinstance(content, str):
                content = content.encode()
            if isinstance(content, Path):
                size = content.stat().st_size
                sha = _sha256_path(content)
                data, source = None, content
            else:
                size = len(content)
                sha = hashlib.sha256(content).hexdigest()
                data, source = content, None
            lfs = name.endswith(LFS_SUFFIXES) or size > 10 * 1024 * 1024
            if lfs:
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()
                oid = git_blob_sha1(pointer)
            else:
                oid = git_blob_sha1(data if data is not None else content.read_bytes())  # type: ignore[union-attr]
            entries[name] = _File(name, size, lfs, sha, oid, data, source)
        listing = "\n".join(f"{n} {f.oid}" for n, f in sorted(entries.items()))
        commit = hashlib.sha1(f"{repo_id}\n{revision}\n{listing}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, _Repo(repo_id))
        repo.commits[commit] = entries
        repo.refs[revision] = commit
        return commit

    def requests(self, method: str | None = None, contains: str = "") -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lookups used by the handler ---------------------------------------------------------------
    def _resolve(self, repo_id: str, rev: str) -> tuple[_Repo | None, str | None]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, None
        if rev in repo.commits:
            return repo, rev
        return repo, repo.refs.get(rev)

    def _size(self, repo_id: str, f: _File) -> int:
        return self.fake_size.get((repo_id, f.path), f.size)


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def _record(self, status: int) -> None:
        hub = self.server_hub
        parts = urlsplit(self.path)
        with hub._lock:
            hub.log.append(
                RequestRecord(
                    self.command,
                    unquote(parts.path),
                    parts.query,
                    self.headers.get("Range"),
                    self.headers.get("Authorization") is not None,
                    status,
                )
            )

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self._record(status)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj: object, status: int = 200) -> None:
        self._send(status, {"Content-Type": "application/json"}, json.dumps(obj).encode())

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        headers.update(extra or {})
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _authorized(self, repo_id: str) -> bool:
        token = self.server_hub.tokens.get(repo_id)
        return token is None or self.headers.get("Authorization") == f"Bearer {token}"

    # -- routes ----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        parts = urlsplit(self.path)
        raw = parts.path
        query = parse_qs(parts.query)
        segs = raw.strip("/").split("/")
        if self.server_hub.down:
            return self._error(503, "ServiceUnavailable", "the Hub is down")
        try:
            if segs[:2] == ["api", "models"] and len(segs) >= 4:
                repo_id = unquote(segs[2]) + "/" + unquote(segs[3])
                rest = segs[4:]
                if not rest:
                    return self._model_info(repo_id, "main", query)
                if rest[0] == "revision" and len(rest) == 2:
                    return self._model_info(repo_id, unquote(rest[1]), query)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo_id, unquote(rest[1]), unquote("/".join(rest[2:])), query)
            if segs[0] == "_cdn" and len(segs) == 2:
                return self._cdn(segs[1])
            if len(segs) >= 5 and segs[2] == "resolve":
                repo_id = unquote(segs[0]) + "/" + unquote(segs[1])
                return self._resolve_file(repo_id, unquote(segs[3]), unquote("/".join(segs[4:])))
            self._error(404, "NotFound", "no such route")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _repo_or_error(self, repo_id: str, rev: str) -> tuple[_Repo, str] | None:
        hub = self.server_hub
        if repo_id not in hub.repos:
            self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
            return None
        if not self._authorized(repo_id):
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it.")
            return None
        repo, commit = hub._resolve(repo_id, rev)
        if repo is None or commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, commit

    def _model_info(self, repo_id: str, rev: str, query: dict[str, list[str]]) -> None:
        found = self._repo_or_error(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        hub = self.server_hub
        blobs = query.get("blobs", ["false"])[0].lower() == "true" and not hub.bare_info
        siblings = []
        for f in repo.commits[commit].values():
            s: dict[str, object] = {"rfilename": f.path}
            if blobs:
                s.update({"size": hub._size(repo_id, f), "blobId": f.oid})
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": hub._size(repo_id, f), "pointerSize": 134}
            siblings.append(s)
        self._json(
            {
                "_id": commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit,
                "private": False,
                "gated": "manual" if repo_id in hub.tokens else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
        )

    def _tree(self, repo_id: str, rev: str, sub: str, query: dict[str, list[str]]) -> None:
        found = self._repo_or_error(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        hub = self.server_hub
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        out: list[dict[str, object]] = []
        dirs: set[str] = set()
        for f in repo.commits[commit].values():
            if not f.path.startswith(prefix):
                continue
            rel = f.path[len(prefix) :]
            if "/" in rel and not recursive:
                dirs.add(prefix + rel.split("/")[0])
                continue
            entry: dict[str, object] = {"type": "file", "oid": f.oid, "size": hub._size(repo_id, f), "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": hub._size(repo_id, f), "pointerSize": 134}
            out.append(entry)
        out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        self._json(out)

    def _resolve_file(self, repo_id: str, rev: str, path: str) -> None:
        found = self._repo_or_error(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        hub = self.server_hub
        f = repo.commits[commit].get(path)
        if f is None:
            self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": commit})
            return
        size = hub._size(repo_id, f)
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            common.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(size)})
        if hub.redirect and f.lfs:
            # The Hub redirects LFS files to a CDN; same host here, so the client keeps following.
            self._send(302, {**common, "Location": f"/_cdn/{f.sha256}?repo={quote(repo_id)}&file={quote(path)}"})
            return
        self._body(repo_id, f, {**common, "ETag": f'"{f.etag}"'})

    def _cdn(self, seg: str) -> None:
        query = parse_qs(urlsplit(self.path).query)
        repo_id, path = query.get("repo", [""])[0], query.get("file", [""])[0]
        repo = self.server_hub.repos.get(repo_id)
        for files in (repo.commits.values() if repo else ()):
            f = files.get(path)
            if f is not None and f.sha256 == seg:
                return self._body(repo_id, f, {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"})
        self._error(404, "EntryNotFound", "no such blob")

    def _body(self, repo_id: str, f: _File, headers: dict[str, str]) -> None:
        hub = self.server_hub
        total = f.size
        start, end = 0, total  # [start, end)
        status = 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes=") :].partition("-")
            try:
                start = int(first)
                end = int(last) + 1 if last else total
            except ValueError:
                start, end = 0, total
            if start >= total:
                self._send(416, {"Content-Range": f"bytes */{total}"})
                return
            end = min(end, total)
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{total}"}
        headers = {**headers, "Content-Length": str(end - start), "Content-Type": "application/octet-stream"}
        self._record(status)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = hub.cut_at.get((repo_id, f.path))
        stop = min(end, cut) if cut is not None and cut < end else end
        flip = total // 2 if (repo_id, f.path) in hub.corrupt else -1
        pause = hub.slow.get((repo_id, f.path))
        piece = _CHUNK if pause is None else 64 * 1024
        pos = start
        while pos < stop:
            if pause is not None and pos > start:
                time.sleep(pause)
            n = min(piece, stop - pos)
            block = f.read(pos, pos + n)
            if pos <= flip < pos + n:
                b = bytearray(block)
                b[flip - pos] ^= 0xFF
                block = bytes(b)
            self.wfile.write(block)
            pos += n
        if stop < end:  # drop the connection mid-body, as a network failure would
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# -- helpers for the tests ---------------------------------------------------------------------------


def tiny_gguf(path: Path, quant: str, rows: int = 8, seed: int = 0) -> Path:
    """A small complete GGUF that llama.cpp loads: a one-layer llama (embedding 256, one 32-wide
    attention head, feed-forward 32) with a sentencepiece vocabulary of max(rows, 259) tokens (the
    259 are <unk>, <s>, </s> and the 256 byte tokens, so any text tokenizes). Its size grows with
    `rows` as before (rows x 1 KiB: the F32 embedding); general.file_type says `quant` (the
    weights are F32/F16 whatever it says: only the label matters to pulls)."""
    import gguf
    import numpy as np

    n_embd, head, n_ff = 256, 32, 32
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"▁t{i}" for i in range(len(tokens), max(rows, len(tokens)))]
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny-{quant}")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{quant.upper()}"))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", weight(len(tokens), n_embd).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", weight(head, n_embd))
    w.add_tensor("blk.0.attn_k.weight", weight(head, n_embd))
    w.add_tensor("blk.0.attn_v.weight", weight(head, n_embd))
    w.add_tensor("blk.0.attn_output.weight", weight(n_embd, head))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", weight(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_up.weight", weight(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def point_client_at(monkeypatch, url: str, cache: Path) -> None:
    """Point the already-imported huggingface_hub at `url` and a fresh cache, with no token, online.

    huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import; in-process tests
    patch the constants it read (the endpoint and the resolve-URL template built from it must agree,
    or hf_hub_url keeps pointing at huggingface.co). Subprocess tests set the variables instead.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache.parent / "no-token"))
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)


@contextmanager
def local_hub(monkeypatch, cache: Path) -> Iterator[HubServer]:
    """A running local Hub with huggingface_hub pointed at it and at `cache`; stopped on exit."""
    with HubServer() as server:
        point_client_at(monkeypatch, server.url, cache)
        yield server
