"""What to pull: `owner/name[:QUANT]` specs, the GGUF file(s) of a quant, and checks of every name
the user or the server gives (repo ids, revisions, file names, hashes) before it touches the disk."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import HubError, InvalidOptionError, ModelNotFoundError

__all__ = [
    "SOURCE_FILES",
    "DEFAULT_QUANT",
    "COMMIT_RE",
    "ETAG_RE",
    "parse_spec",
    "select_gguf",
    "is_model_gguf",
    "check_repo_id",
    "check_repo_path",
    "check_revision",
]

# What conversion reads from a safetensors repo; weights are *.safetensors (+ their index).
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "quantize_config.json",  # AutoGPTQ checkpoints whose config.json has no quantization_config
)
DEFAULT_QUANT = "Q4_K_M"

COMMIT_RE = re.compile(r"[0-9a-f]{40}\Z")  # \Z, not $: no trailing newline
ETAG_RE = re.compile(r"(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")
_REPO_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Za-z0-9_]+)$")
_NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-")


# -- validation ------------------------------------------------------------------------------------


def check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART_RE.match(p) for p in parts) or ".." in repo_id or "--" in repo_id:
        raise InvalidOptionError(f"invalid Hugging Face repo id {repo_id!r}: expected owner/name")
    return repo_id


def check_repo_path(name: object) -> str:
    """A file name from the server, safe to join under a snapshot folder, or HubError."""
    bad = None
    if not isinstance(name, str) or not name:
        bad = "empty or not a string"
    elif len(name) > 1024:
        bad = "too long"
    elif "\\" in name or "\0" in name or any(ord(c) < 32 for c in name):
        bad = "backslash or control character"
    elif name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        bad = "absolute path"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        bad = "'..', '.' or empty path component"
    if bad:
        raise HubError(f"refusing file name {name!r} from the server: {bad}")
    return name  # type: ignore[return-value]


def check_revision(rev: str) -> str:
    if not rev or len(rev) > 256 or any(p in ("", ".", "..") for p in rev.split("/")) or "\\" in rev or "\0" in rev:
        raise InvalidOptionError(f"invalid revision {rev!r}")
    return rev


# -- spec and GGUF selection -----------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`owner/name[:QUANT]` (also with an `hf.co/` or `https://huggingface.co/` prefix) → (repo, tag)."""
    s = spec.strip()
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/", "hf://"):
        if s.lower().startswith(prefix):
            s = s[len(prefix) :]
    repo, _, tag = s.partition(":")
    repo = repo.rstrip("/")
    if tag and not re.match(r"[A-Za-z0-9_.-]{1,32}\Z", tag):
        raise InvalidOptionError(f"invalid quant tag {tag!r} in {spec!r}")
    return check_repo_id(repo), (tag or None)


def _split_info(path: str) -> tuple[str, str, int, int]:
    """(prefix without split suffix, QUANT tag upper or '', split index, split count)."""
    base = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    index = count = 1
    m = _SPLIT_RE.match(base)
    if m:
        base, index, count = m.group("prefix"), int(m.group("index")), int(m.group("count"))
    t = _TAG_RE.search(base.rsplit("/", 1)[-1])
    return base, (t.group(1).upper() if t else ""), index, count


def _quant_bits(tag: str) -> int:
    m = re.search(r"\d+", tag)
    return int(m.group()) if m else 0


def is_model_gguf(path: str) -> bool:
    """A GGUF that holds a model (not a projector, an imatrix or a draft head)."""
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not any(k in base for k in _NOT_A_MODEL)


def select_gguf(paths: Sequence[str], tag: str | None) -> tuple[list[str], str, str]:
    """Pick the model file(s) for `tag` among a repo's files → (files, quant tag, note).

    Like llama.cpp's `-hf`: a file whose name has `<TAG>.` or `<TAG>-` (case-insensitive); split
    GGUFs by their first part, then all parts. Without a tag: Q4_K_M, then Q8_0, then the quant
    closest to 4 bits (the larger one on a tie). An explicit tag that no file has is an error that
    lists what the repo offers, as in llama.cpp.
    """
    models = sorted(p for p in paths if is_model_gguf(p))
    firsts = [p for p in models if _split_info(p)[2] == 1]
    if not firsts:
        raise HubError("no GGUF model file in this repository")

    def find(t: str) -> str | None:
        exact = [p for p in firsts if _split_info(p)[1] == t.upper()]
        if exact:
            return exact[0]
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        loose = [p for p in firsts if pattern.search(p)]
        return loose[0] if loose else None

    note = ""
    if tag:
        chosen = find(tag)
        if chosen is None:
            have = ", ".join(sorted({_split_info(p)[1] or p for p in firsts}))
            raise ModelNotFoundError(f"no {tag} file in this repository; it has: {have}")
    else:
        chosen = find(DEFAULT_QUANT) or find("Q8_0")
        if chosen is None:
            chosen = min(firsts, key=lambda p: (abs(_quant_bits(_split_info(p)[1]) - 4), -_quant_bits(_split_info(p)[1]), p))
            note = f"no {DEFAULT_QUANT} file in the repository; picked {_split_info(chosen)[1] or chosen}"
        elif _split_info(chosen)[1] != DEFAULT_QUANT:
            note = f"no {DEFAULT_QUANT} file in the repository; picked {_split_info(chosen)[1]}"
    prefix, qtag, _, count = _split_info(chosen)
    files = [chosen]
    if count > 1:
        files = sorted(p for p in models if _split_info(p)[0] == prefix and _split_info(p)[3] == count)
        if len(files) != count:
            raise HubError(f"split GGUF {chosen} has {count} parts but the repository lists {len(files)}")
    return files, (qtag or (tag or "").upper()), note
