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
    """Read and validate an imatrix GGUF; InvalidModelError (one line) on anything malformed."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no such imatrix file: {path}")

    def bad(problem: str) -> InvalidModelError:
        return InvalidModelError(f"{path.name}: not a valid imatrix file: {problem}")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise bad("not GGUF (the legacy .dat format is not supported; convert it with llama-imatrix)")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on damaged files
        raise bad(f"{type(e).__name__}: {e}") from None

    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.endswith(_SUMS):
            target, base = sums, t.name[: -len(_SUMS)]
        elif t.name.endswith(_COUNTS):
            target, base = counts, t.name[: -len(_COUNTS)]
        else:
            continue
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise bad(f"tensor {t.name!r} is {t.tensor_type.name}, must be F32")
        target[base] = np.asarray(t.data, dtype=np.float32).reshape(-1)

    if not sums:
        raise bad("no <tensor>.in_sum2 entries")
    entries: dict[str, np.ndarray] = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise bad(f"{name!r} has {'no counts' if name in sums else 'counts but no in_sum2'}")
        s, c = sums[name], counts[name]
        if len(c) == 0 or len(s) % len(c):
            raise bad(f"{name!r}: {len(s)} sums do not split into {len(c)} experts")
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(c))):
            raise bad(f"{name!r} holds non-finite values")
        if np.any(s < 0) or np.any(c < 0):
            raise bad(f"{name!r} holds negative sums or counts")
        per = s.reshape(len(c), -1)
        c_round = np.rint(c).astype(np.float64)  # llama.cpp rounds counts with lround
        importance = np.where(c_round[:, None] > 0, per / np.where(c_round > 0, c_round, 1.0)[:, None], 1.0)
        entries[name] = np.ascontiguousarray(importance.reshape(-1), dtype=np.float32)

    def field_value(key: str) -> object:
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:
            return None

    datasets = field_value("imatrix.datasets")
    chunk_count = field_value("imatrix.chunk_count")
    chunk_size = field_value("imatrix.chunk_size")
    return ImportanceMatrix(
        path=path,
        entries=entries,
        datasets=tuple(str(d) for d in datasets) if isinstance(datasets, list) else (),
        chunk_count=int(chunk_count) if isinstance(chunk_count, int) else 0,
        chunk_size=int(chunk_size) if isinstance(chunk_size, int) else 0,
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
