"""Importance matrices in llama.cpp's imatrix GGUF format (what `llama-imatrix` writes).

The file holds, for every weight tensor that saw activations, two F32 tensors:
`<name>.in_sum2` (shape [n_cols, n_mat]: the sum of squared input activations per column, per
expert) and `<name>.counts` (shape [1, n_mat]: how many tokens were summed). The importance that
llama.cpp's quantizer takes is in_sum2 / counts per expert (1.0 where a count is 0), exactly as
tools/quantize/quantize.cpp normalizes it. Metadata: `imatrix.datasets`, `imatrix.chunk_count`,
`imatrix.chunk_size`. The legacy binary `.dat` format is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InvalidModelError, ModelNotFoundError

__all__ = ["ImportanceMatrix", "read_imatrix", "write_imatrix"]

_SUMS = ".in_sum2"
_COUNTS = ".counts"


@dataclass(frozen=True)
class ImportanceMatrix:
    path: Path
    entries: dict[str, np.ndarray] = field(repr=False)  # tensor name -> float32 importance, n_cols * n_mat
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0

    def __len__(self) -> int:
        return len(self.entries)


def read_imatrix(path: str | Path) -> ImportanceMatrix:
    """Read and validate an imatrix GGUF; InvalidModelError (one line) on anything malformed.

    The file is parsed by edgeinfer's own bounds-checked GGUF reader (the one models go through),
    and tensor data is read only inside the file, after every header field has been checked."""
    from .gguf_file import read_gguf

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no such imatrix file: {path}")

    def bad(problem: str) -> InvalidModelError:
        return InvalidModelError(f"{path.name}: not a valid imatrix file: {problem}")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise bad("not GGUF (the legacy .dat format is not supported; convert it with llama-imatrix)")
    try:
        info = read_gguf(path, keep_arrays=True, model=False)
    except InvalidModelError as e:
        raise bad(str(e).removeprefix(f"{path.name}: ")) from None

    raw = np.memmap(path, dtype=np.uint8, mode="r") if info.tensors else None
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in info.tensors:
        if t.name.endswith(_SUMS):
            target, base = sums, t.name[: -len(_SUMS)]
        elif t.name.endswith(_COUNTS):
            target, base = counts, t.name[: -len(_COUNTS)]
        else:
            continue
        if t.type_name != "F32":
            raise bad(f"tensor {t.name!r} is {t.type_name}, must be F32")
        # [n_cols, n_mat] and [1, n_mat] (GGUF order); llama.cpp drops a trailing 1: [n_cols], [1]
        if len(t.shape) > 2 or (target is counts and t.shape[0] != 1):
            raise bad(f"tensor {t.name!r} has shape {list(t.shape)}")
        assert raw is not None
        values = np.frombuffer(raw[t.offset : t.offset + t.n_bytes], dtype="<f4").astype(np.float32)
        target[base] = values.reshape(t.shape[1] if len(t.shape) == 2 else 1, t.shape[0])  # [n_mat, n_cols]

    if not sums:
        raise bad("no <tensor>.in_sum2 entries")
    entries: dict[str, np.ndarray] = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise bad(f"{name!r} has {'no counts' if name in sums else 'counts but no in_sum2'}")
        per, c = sums[name], counts[name].reshape(-1)
        if per.shape[0] != len(c):
            raise bad(f"{name!r}: {per.shape[0]} matrices of sums but {len(c)} counts")
        if not (np.all(np.isfinite(per)) and np.all(np.isfinite(c))):
            raise bad(f"{name!r} holds non-finite values")
        if np.any(per < 0) or np.any(c < 0):
            raise bad(f"{name!r} holds negative sums or counts")
        c_round = np.rint(c).astype(np.float64)  # llama.cpp rounds counts with lround
        importance = np.where(c_round[:, None] > 0, per / np.where(c_round > 0, c_round, 1.0)[:, None], 1.0)
        entries[name] = np.ascontiguousarray(importance.reshape(-1), dtype=np.float32)

    meta = info.metadata
    datasets = meta.get("imatrix.datasets")
    chunk_count, chunk_size = meta.get("imatrix.chunk_count"), meta.get("imatrix.chunk_size")
    return ImportanceMatrix(
        path=path,
        entries=entries,
        datasets=tuple(str(d) for d in datasets) if isinstance(datasets, list) else (),
        chunk_count=int(chunk_count) if isinstance(chunk_count, int) and not isinstance(chunk_count, bool) else 0,
        chunk_size=int(chunk_size) if isinstance(chunk_size, int) and not isinstance(chunk_size, bool) else 0,
    )


def write_imatrix(
    path: str | Path,
    sums: dict[str, np.ndarray],
    counts: dict[str, np.ndarray],
    *,
    datasets: tuple[str, ...] = (),
    chunk_count: int = 1,
    chunk_size: int = 512,
) -> None:
    """Write an imatrix GGUF the way llama-imatrix does (tests and tools make their own with it).

    `sums[name]` has shape [n_mat, n_cols] (numpy order), `counts[name]` shape [n_mat].
    """
    import gguf

    w = gguf.GGUFWriter(str(path), arch="imatrix")
    # llama-imatrix writes no architecture; GGUFWriter always adds one, which llama.cpp ignores here.
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", list(datasets) or ["unknown"])
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(sums):
        s = np.asarray(sums[name], dtype=np.float32)
        s = s.reshape(1, -1) if s.ndim == 1 else s
        c = np.asarray(counts[name], dtype=np.float32).reshape(-1, 1)
        w.add_tensor(f"{name}{_SUMS}", s)
        w.add_tensor(f"{name}{_COUNTS}", c)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
