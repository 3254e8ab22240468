"""A seeded GGUF mutation fuzzer against our validation (`edgeinfer.validate.validate_file`).

Mutants of the default model's header (the tensor data left as a sparse hole of the right size)
and of a small synthetic model: bit flips, lying string/array lengths, counts, value and tensor
types, dimensions, offsets, NaN/inf floats, duplicated tokens, truncation. For every mutant:
- the validator raises nothing but InvalidModelError;
- it allocates no more than a small multiple of the header size: the tracemalloc peak for the
  synthetic model's mutants; for the default model's (whose 1.6 MB header takes ~1.5 s to walk
  under tracemalloc instead of ~0.1 s) the growth of the process's peak RSS, reset to the current
  RSS before each mutant (Linux /proc/self/clear_refs: a peak left by an earlier test, e.g. a
  loaded model, would otherwise hide any allocation below it);
- (slow tier) every mutant it accepts loads in llama.cpp in a child process without a signal.

Two campaigns: the suite's (EDGEINFER_FUZZ_N mutants, default 510: 480 synthetic, 30 of the
default model) and, under a flag, a longer one (EDGEINFER_FUZZ_MORE=N mutants, another seed, same
proportion; e.g. 2040: about 45 s more on 2 cores, so not in the default run). EDGEINFER_FUZZ_SEED
sets the seed (the longer campaign uses the next one);
EDGEINFER_FUZZ_PROBES caps how many accepted mutants are loaded in llama.cpp (default: all).
"""

from __future__ import annotations

import mmap
import os
import random
import resource
import struct
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgeinfer import InvalidModelError
from edgeinfer.validate import probe_load, validate_file

from .gguf_samples import write_model

SEED = int(os.environ.get("EDGEINFER_FUZZ_SEED", "12"))
N_TOTAL = int(os.environ.get("EDGEINFER_FUZZ_N", "510"))
N_DEFAULT = max(1, N_TOTAL // 17)
N_SYNTHETIC = N_TOTAL - N_DEFAULT
MORE_SEED = SEED + 1
N_MORE = int(os.environ.get("EDGEINFER_FUZZ_MORE", "0"))
N_MORE_DEFAULT = max(1, N_MORE // 17)
N_MORE_SYNTHETIC = N_MORE - N_MORE_DEFAULT
# campaign -> (seed, synthetic mutants, default-model mutants)
CAMPAIGNS = {"suite": (SEED, N_SYNTHETIC, N_DEFAULT), "more": (MORE_SEED, N_MORE_SYNTHETIC, N_MORE_DEFAULT)}
N_PROBED = int(os.environ.get("EDGEINFER_FUZZ_PROBES", "0")) or None  # None: every accepted mutant
# What the validator may allocate: this multiple of the header, plus a fixed allowance.
MEMORY_FACTOR, MEMORY_SLACK = 4, 1 << 20

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _FLOAT32, _FLOAT64 = 8, 9, 6, 12


@dataclass(frozen=True)
class Field:
    """A field of the header that mutations aim at: where it is, how wide, and what it holds."""

    offset: int
    size: int
    kind: str  # count, key_len, vtype, value, float, str_len, array_type, array_len, elem_len, token,
    #            name_len, n_dims, dim, ttype, toffset


def header_fields(data: bytes) -> tuple[list[Field], int]:
    """Our own walk over a valid GGUF header: every field and the header's end (the data start).
    Independent of the validator under test."""
    fields: list[Field] = [Field(8, 8, "count"), Field(16, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(kind: str) -> int:
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        fields.append(Field(pos, 8, kind))
        pos += 8 + n
        return n

    for _ in range(n_kv):
        key_at = pos + 8
        n = string("key_len")
        key = data[key_at : key_at + n].decode()
        vtype = struct.unpack_from("<I", data, pos)[0]
        fields.append(Field(pos, 4, "vtype"))
        pos += 4
        if vtype == _STRING:
            string("str_len")
        elif vtype == _ARRAY:
            etype, length = struct.unpack_from("<IQ", data, pos)
            fields += [Field(pos, 4, "array_type"), Field(pos + 4, 8, "array_len")]
            pos += 12
            if etype == _STRING:
                for _ in range(length):
                    start = pos
                    string("elem_len")
                    if key == "tokenizer.ggml.tokens":
                        fields.append(Field(start, pos - start, "token"))
            else:
                size = _SCALAR_SIZES[etype]
                if etype in (_FLOAT32, _FLOAT64):
                    fields += [Field(pos + i * size, size, "float") for i in range(min(length, 64))]
                pos += size * length
        else:
            size = _SCALAR_SIZES[vtype]
            fields.append(Field(pos, size, "float" if vtype in (_FLOAT32, _FLOAT64) else "value"))
            pos += size
    for _ in range(n_tensors):
        string("name_len")
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append(Field(pos, 4, "n_dims"))
        pos += 4
        fields += [Field(pos + 8 * i, 8, "dim") for i in range(n_dims)]
        pos += 8 * n_dims
        fields += [Field(pos, 4, "ttype"), Field(pos + 4, 8, "toffset")]
        pos += 12
    return fields, pos


_LIES_64 = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
_LIES_32 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 30, 31, 35, 39, 40, 42, 43, 99, 2**31 - 1, 2**32 - 1]
_FLOATS_32 = [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e38, -0.0]


@dataclass(frozen=True)
class Targets:
    """The header's fields grouped by kind (a kind is picked first, so the vocabulary's hundred
    thousand lengths do not drown the few counts and types), and tokens grouped by size."""

    by_kind: dict[str, list[Field]]
    tokens_by_size: dict[int, list[Field]]

    @classmethod
    def of(cls, fields: list[Field]) -> Targets:
        by_kind: dict[str, list[Field]] = {}
        by_size: dict[int, list[Field]] = {}
        for f in fields:
            by_kind.setdefault(f.kind, []).append(f)
            if f.kind == "token":
                by_size.setdefault(f.size, []).append(f)
        return cls(by_kind, by_size)


def mutate(data: bytes, targets: Targets, header_end: int, rng: random.Random) -> bytes:
    """One mutant: one to three mutations of the header (or a truncation)."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.random()
        if op < 0.2:  # bit flips anywhere in the header
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(header_end)
                buf[at] ^= 1 << rng.randrange(8)
            continue
        if op < 0.25:  # truncation
            return bytes(buf[: rng.randrange(len(buf))])
        f = rng.choice(targets.by_kind[rng.choice(sorted(targets.by_kind))])
        if f.kind == "token":
            g = rng.choice(targets.tokens_by_size[f.size])
            if g.offset != f.offset:  # duplicate a token's text over another of the same length
                buf[g.offset : g.offset + g.size] = buf[f.offset : f.offset + f.size]
            continue
        if f.kind == "float":
            fmt = "<f" if f.size == 4 else "<d"
            struct.pack_into(fmt, buf, f.offset, rng.choice(_FLOATS_32))
            continue
        if f.size == 8:
            old = struct.unpack_from("<Q", buf, f.offset)[0]
            new = rng.choice(_LIES_64 + [old + 1, max(old - 1, 0), old * 2, old + len(buf), len(buf)])
            struct.pack_into("<Q", buf, f.offset, new % 2**64)
        elif f.size == 4:
            old = struct.unpack_from("<I", buf, f.offset)[0]
            struct.pack_into("<I", buf, f.offset, rng.choice(_LIES_32 + [old + 1, max(old - 1, 0)]) % 2**32)
        else:
            for i in range(f.size):
                buf[f.offset + i] = rng.randrange(256)
    return bytes(buf)


@dataclass
class Outcome:
    accepted: list[Path]
    refused: int
    wrong_errors: list[str]
    over_memory: list[str]


def run_fuzz(seed_file: Path, n: int, rng: random.Random, workdir: Path, *, sparse_from: int | None) -> Outcome:
    """Mutate `seed_file` (or only its first `sparse_from` bytes, its header: the rest of each
    mutant is then a hole of the original size) and validate every mutant."""
    data = seed_file.read_bytes() if sparse_from is None else _read_head(seed_file, sparse_from)
    fields, header_end = header_fields(data)
    targets = Targets.of(fields)
    full_size = seed_file.stat().st_size
    limit = MEMORY_FACTOR * header_end + MEMORY_SLACK
    traced = sparse_from is None
    validate_file(seed_file)  # warm: imports and caches are not the mutants' allocations
    rss_before = _peak_rss()
    out = Outcome([], 0, [], [])
    for i in range(n):
        mutant = mutate(data, targets, header_end, rng)
        path = workdir / f"mutant-{i:04d}.gguf"
        with open(path, "wb") as f:
            f.write(mutant)
            if sparse_from is not None and len(mutant) == len(data):
                f.truncate(full_size)  # the tensor data: a hole of the original size
        if traced:
            tracemalloc.start()
        else:
            rss_before = _reset_peak_rss() or rss_before
        try:
            validate_file(path)
        except InvalidModelError as e:
            out.refused += 1
            assert "\n" not in str(e), str(e)
            path.unlink()
        except Exception as e:  # noqa: BLE001 - exactly what this test is looking for
            out.wrong_errors.append(f"mutant {i}: {type(e).__name__}: {e}")
        else:
            out.accepted.append(path)
        finally:
            if traced:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            else:
                peak = _peak_rss() - rss_before
        if peak > limit:
            out.over_memory.append(f"mutant {i}: {peak} bytes for a {header_end}-byte header")
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak_rss() -> int | None:
    """Set this process's peak RSS back to its current RSS (Linux: "5" to /proc/self/clear_refs)
    and return it in bytes; None where that cannot be done (the peak is then the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _peak_rss()


def _read_head(path: Path, header_bytes: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(header_bytes)


def _header_size(path: Path) -> int:
    """Bytes up to the tensor data of a valid file (read generously, then cut at the walker's end)."""
    with open(path, "rb") as f:
        head = f.read(8 << 20)
    return -(-header_fields(head)[1] // 32) * 32


@pytest.fixture(scope="module")
def synthetic_seed(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("fuzz-seed") / "sample.gguf")


@pytest.fixture(scope="module", params=["suite", pytest.param("more", marks=[pytest.mark.slow, pytest.mark.skipif(
    N_MORE <= 0, reason="the longer fuzz campaign runs with EDGEINFER_FUZZ_MORE=N (e.g. 2040)")])])
def fuzz_results(request, tmp_path_factory, synthetic_seed, default_model_path) -> dict[str, Outcome]:
    """One campaign: the suite's 510 mutants (a few seconds), or EDGEINFER_FUZZ_MORE's."""
    seed, n_synthetic, n_default = CAMPAIGNS[request.param]
    rng = random.Random(seed)
    results = {}
    work = tmp_path_factory.mktemp(f"fuzz-{request.param}-synthetic")
    results["synthetic"] = run_fuzz(synthetic_seed, n_synthetic, rng, work, sparse_from=None)
    work = tmp_path_factory.mktemp(f"fuzz-{request.param}-default")
    results["default"] = run_fuzz(default_model_path, n_default, rng, work, sparse_from=_header_size(default_model_path))
    return results


def test_validator_raises_only_invalid_model_error(fuzz_results, request):
    wrong = [w for r in fuzz_results.values() for w in r.wrong_errors]
    assert not wrong, "\n".join(wrong[:20])
    tried = sum(len(r.accepted) + r.refused + len(r.wrong_errors) for r in fuzz_results.values())
    _, n_synthetic, n_default = CAMPAIGNS[request.node.callspec.params["fuzz_results"]]
    assert tried == n_synthetic + n_default
    # the mutations must reach past the first check: both outcomes occur
    assert sum(r.refused for r in fuzz_results.values()) > 0
    assert sum(len(r.accepted) for r in fuzz_results.values()) > 0


def test_validator_memory_is_bounded_by_the_header(fuzz_results):
    over = [w for r in fuzz_results.values() for w in r.over_memory]
    assert not over, "\n".join(over[:20])


def test_the_memory_measure_sees_an_allocation_below_an_earlier_peak(tmp_path, default_model_path, monkeypatch):
    """The default model's mutants are measured by peak RSS: a validator that copied a lying length
    must be caught even after the process once held far more (a model loaded by an earlier test)."""
    if _reset_peak_rss() is None:
        pytest.skip("the peak RSS cannot be reset here (not Linux)")
    _touch(64 << 20)  # the process's peak is now 64 MiB above what it holds
    real = validate_file

    def copying_validator(path):
        if Path(path).name.startswith("mutant-"):
            _touch(16 << 20)  # what a lying length made the old reader copy
        return real(path)

    monkeypatch.setattr(sys.modules[__name__], "validate_file", copying_validator)
    out = run_fuzz(default_model_path, 1, random.Random(SEED), tmp_path, sparse_from=_header_size(default_model_path))
    assert len(out.over_memory) == 1, out


def _touch(n: int) -> None:
    """Take n fresh bytes of memory (an anonymous mapping, every page written), then give them back."""
    with mmap.mmap(-1, n) as m:
        for at in range(0, n, mmap.PAGESIZE):
            m[at] = 1


@pytest.mark.slow
def test_accepted_mutants_load_in_llama_cpp_without_a_signal(fuzz_results):
    accepted = [p for r in fuzz_results.values() for p in r.accepted]
    sample = accepted if N_PROBED is None else random.Random(SEED).sample(accepted, min(N_PROBED, len(accepted)))
    crashed = []
    for path in sample:
        try:
            probe_load(path, timeout=120)
        except InvalidModelError as e:
            if "signal" in str(e) or "no answer" in str(e):
                crashed.append(f"{path.name}: {e}")
    assert not crashed, "\n".join(crashed)
