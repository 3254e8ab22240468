"""The suffix drafter's memory kept on disk (LoadOptions.suffix_memory, `--suffix-memory`,
speculation/suffix_file.py): what a file holds, that it is read only into its own scope for its own
model, that a damaged or hostile file is one warning and an empty memory, and the budget.

Pure tests of the file and the memory first; then on the default model's F16 copy: a restarted
engine drafts from the answers of the one before (greedy output still plain decoding's), per scope,
and an engine without the option writes nothing.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import pytest
from test_batch_engine import f16_path  # noqa: F401  (the session's F16 copy of the default model)

import edgeinfer
from edgeinfer import BatchEngine, BatchOptions, GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.engine.speculation.suffix import SuffixMemory, SuffixSource
from edgeinfer.engine.speculation.suffix_file import HEADER, MAGIC, SuffixKeeper, scope_digest

N_VOCAB = 1000
LOGGER = "edgeinfer.engine.speculation.suffix_file"


def keeper(tmp_path: Path, identity: str = "model-a|1|2", n_vocab: int = N_VOCAB, budget: int = 1 << 16) -> SuffixKeeper:
    return SuffixKeeper(tmp_path / "m", identity, n_vocab, budget)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- the file and the memory (pure) ------------------------------------------------------------------
def test_a_saved_memory_drafts_again_after_a_restart(tmp_path):
    scope = "digest-of-alice-s-key"
    first = SuffixMemory(keeper=keeper(tmp_path))
    first.remember(scope, [1, 2, 3], [10, 11, 12, 13, 14, 15])
    first.save(force=True)
    again = SuffixMemory(keeper=keeper(tmp_path))
    source = SuffixSource(again.corpus(scope), own=False)
    found = source.draft([1, 2, 3, 10, 11], 4)
    assert found.tokens == [12, 13, 14, 15] and source.remembered(found)
    # ids only: the header, the model's identity, lengths and tokens; the scope is never written
    path = keeper(tmp_path).path(scope)
    data = path.read_bytes()
    assert data[:8] == MAGIC and len(data) == HEADER.size + len(b"model-a|1|2") + 4 * (1 + 9)
    assert scope.encode() not in data and scope not in str(path) and path.name == scope_digest(scope).hex() + ".bin"


def test_saves_are_rate_limited_and_nothing_unchanged_is_written(tmp_path):
    k = keeper(tmp_path)
    memory = SuffixMemory(keeper=k)
    memory.save(force=True)
    assert not k.folder.exists()  # nothing remembered: nothing written
    memory.remember("k", [1], [5, 6])
    memory.save()  # the first save after a finished request is at once...
    assert SuffixMemory(keeper=k).corpus("k").size == 3
    memory.remember("k", [1], [7, 8])
    memory.save()  # ...the next waits for the interval...
    assert SuffixMemory(keeper=k).corpus("k").size == 3
    memory.save(force=True)  # ...or an unload
    assert SuffixMemory(keeper=k).corpus("k").size == 6


def test_a_scope_reads_only_its_own_file(tmp_path, caplog):
    k = keeper(tmp_path)
    alice = SuffixMemory(keeper=k)
    alice.remember("alice", [1, 2, 3], [10, 11, 12, 13])
    alice.save(force=True)
    memory = SuffixMemory(keeper=k)
    assert memory.corpus("bob").size == 0 and not warnings(caplog)  # bob has no file; alice's is not his
    # alice's file put where bob's would be: refused (its header names alice's scope)
    os.replace(k.path("alice"), k.path("bob"))
    assert SuffixMemory(keeper=k).corpus("bob").size == 0
    assert len(warnings(caplog)) == 1 and "another scope" in warnings(caplog)[0]


def _file(k: SuffixKeeper, scope: str, texts: list[list[int]], *, n_vocab: int | None = None,
          identity: bytes | None = None, declared: int | None = None, magic: bytes = MAGIC,
          lengths_of: list[int] | None = None) -> bytes:
    """A file as a writer would make it, with one field changed (its checksum made right again)."""
    ident = k.identity if identity is None else identity
    lengths = b"".join(struct.pack("<I", n) for n in (lengths_of or [len(t) for t in texts]))
    tokens = b"".join(struct.pack("<I", x) for t in texts for x in t)
    body = ident + lengths + tokens
    total = sum(map(len, texts)) if declared is None else declared
    return HEADER.pack(magic, 1, N_VOCAB if n_vocab is None else n_vocab, len(ident), len(texts), total,
                       zlib.crc32(body), scope_digest(scope)) + body


HOSTILE = {
    "truncated": (lambda k: _file(k, "s", [[1, 2, 3, 4]])[:-3], "size does not match"),
    "no header": (lambda k: MAGIC + b"\0\0", "truncated"),
    "wrong magic": (lambda k: _file(k, "s", [[1, 2, 3]], magic=b"GGUF\0\0\0\0"), "wrong magic"),
    "id past the vocabulary": (lambda k: _file(k, "s", [[1, 2, N_VOCAB]]), f"token id {N_VOCAB} is outside"),
    "huge declared length": (lambda k: _file(k, "s", [[1, 2]], declared=1 << 31), "more than the budget"),
    "another model": (lambda k: _file(k, "s", [[1, 2]], identity=b"model-b|1|2"), "another model file"),
    "another vocabulary": (lambda k: _file(k, "s", [[1, 2]], n_vocab=N_VOCAB + 1), "vocabulary has 1001"),
    "a flipped bit": (lambda k: bytearray(_file(k, "s", [[1, 2, 3]]))[:-1] + b"\x07", "checksum"),
    "lengths that do not add up": (lambda k: _file(k, "s", [[1, 2, 3]], lengths_of=[2]), "do not add up"),
    "larger than any memory": (lambda k: b"\0" * (k.max_bytes() + 10), "larger than"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_damaged_or_hostile_file_is_one_warning_and_an_empty_memory(tmp_path, caplog, name):
    k = keeper(tmp_path)
    make, why = HOSTILE[name]
    k.folder.mkdir(parents=True)
    k.path("s").write_bytes(bytes(make(k)))
    memory = SuffixMemory(keeper=k)
    assert memory.corpus("s").size == 0
    assert len(warnings(caplog)) == 1 and why in warnings(caplog)[0], warnings(caplog)
    memory.remember("s", [1], [2, 3])  # and it still remembers, and writes a good file over the bad one
    memory.save(force=True)
    assert SuffixMemory(keeper=k).corpus("s").size == 3


def test_a_link_or_a_fifo_in_place_of_the_file_is_not_followed(tmp_path, caplog):
    k = keeper(tmp_path)
    good = SuffixMemory(keeper=k)
    good.remember("s", [1], [2, 3])
    good.save(force=True)
    os.replace(k.path("s"), tmp_path / "elsewhere.bin")
    os.symlink(tmp_path / "elsewhere.bin", k.path("s"))
    assert SuffixMemory(keeper=k).corpus("s").size == 0
    os.unlink(k.path("s"))
    os.mkfifo(k.path("s"))  # a read would block for ever
    assert SuffixMemory(keeper=k).corpus("s").size == 0
    assert len(warnings(caplog)) == 2


def test_a_file_stays_within_the_token_budget(tmp_path):
    k = keeper(tmp_path, budget=100)
    memory = SuffixMemory(max_tokens=100, keeper=k)
    for i in range(40):
        memory.remember("s", [0] * 20, list(range(i * 10, i * 10 + 12)))
    memory.save(force=True)
    texts = k.load("s")
    assert sum(map(len, texts)) <= 100 and texts[-1][-1] == 39 * 10 + 11  # the newest answers
    assert k.path("s").stat().st_size <= HEADER.size + len(k.identity) + 8 * 100


def test_a_scope_that_leaves_memory_is_written_first(tmp_path):
    k = keeper(tmp_path)
    memory = SuffixMemory(max_scopes=2, keeper=k)
    memory.remember("a", [1], [2, 3])
    memory.save(force=True)
    memory.remember("a", [1], [4, 5])  # not saved yet...
    memory.remember("b", [1], [6])
    memory.remember("c", [1], [7])  # ...and "a" goes: its file gets both answers
    assert [t[-2:] for t in k.load("a")] == [[2, 3], [4, 5]]


def test_the_option_is_checked_and_says_where(tmp_path):
    opts = edgeinfer.LoadOptions(suffix_memory="store").validate()
    assert opts.suffix_folder(tmp_path) == tmp_path / "cache" / "suffix"
    assert edgeinfer.LoadOptions().suffix_folder(tmp_path) is None  # the default: off
    assert edgeinfer.LoadOptions(suffix_memory="off").validate().suffix_folder(tmp_path) is None
    assert edgeinfer.LoadOptions(suffix_memory=tmp_path / "mine").validate().suffix_folder("x") == tmp_path / "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(edgeinfer.InvalidOptionError, match="is not a folder"):
        edgeinfer.LoadOptions(suffix_memory=str(tmp_path / "file")).validate()
    with pytest.raises(edgeinfer.InvalidOptionError, match="suffix_memory"):
        edgeinfer.LoadOptions(suffix_memory=3).validate()  # type: ignore[arg-type]
    with pytest.raises(edgeinfer.InvalidOptionError, match="suffix_memory"):
        edgeinfer.LoadOptions(suffix_memory=" ").validate()


def test_serve_run_and_chat_take_the_flag_and_serve_toml_the_key(edgeinfer_home):
    from edgeinfer.cli import build_parser
    from edgeinfer.cli.serve import _service_options

    parser = build_parser()
    for cmd in (["run", "hi"], ["chat"], ["serve"]):
        assert parser.parse_args([*cmd, "--suffix-memory", "store"]).suffix_memory == "store"
        assert parser.parse_args(cmd).suffix_memory is None
    edgeinfer_home.mkdir(parents=True, exist_ok=True)
    (edgeinfer_home / "serve.toml").write_text('[defaults]\nsuffix_memory = "store"\n[models."x:y"]\nsuffix_memory = "off"\n')
    options = _service_options(parser.parse_args(["serve"]), edgeinfer.Store())
    assert options.defaults.load_options().suffix_memory == "store"
    assert options.models["x:y"].over(options.defaults).load_options().suffix_memory == "off"
    flagged = _service_options(parser.parse_args(["serve", "--suffix-memory", "off"]), edgeinfer.Store())
    assert flagged.defaults.suffix_memory == "off" and flagged.default_settings.suffix_memory == "off"
    (edgeinfer_home / "serve.toml").write_text('[defaults]\nsuffix_memory = "relative/dir"\n')
    with pytest.raises(edgeinfer.InvalidOptionError, match="absolute folder"):
        _service_options(parser.parse_args(["serve"]), edgeinfer.Store())


# -- on a real model -----------------------------------------------------------------------------------
def tool_call(city: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Reply with only a JSON object calling the tool get_weather with "
             f"fields city, unit (celsius), days (3) and include_hourly (false), for {city}."}]


def greedy(method: str = "off", scope: str = "", n: int = 40) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=SpeculationOptions(method=method, memory_scope=scope))


def suffix_files(home: Path) -> list[Path]:
    return sorted((home / "cache" / "suffix").glob("*/*.bin"))


@pytest.mark.slow
def test_a_restarted_engine_drafts_from_the_answers_before_it(f16_path, edgeinfer_home):  # noqa: F811
    messages = tool_call("Paris")
    with edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False) as plain_engine:
        plain = plain_engine.chat(messages, greedy()).result().tokens
        fresh = plain_engine.chat(messages, greedy("suffix")).result()
    assert fresh.tokens == plain and fresh.stats.speculation.remembered == 0
    assert suffix_files(edgeinfer_home) == []  # the option off: nothing written
    with edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False, suffix_memory="store") as first:
        assert first.chat(messages, greedy("suffix")).result().tokens == plain
    [kept] = suffix_files(edgeinfer_home)
    assert kept.stat().st_size < 4096  # one answer's ids (and the prompt's last 8), not the whole chat
    with edgeinfer.load(f16_path, n_ctx=2048, flash_attn=False, suffix_memory="store") as again:
        other = again.chat(messages, greedy("suffix", scope="someone-else")).result()
        done = again.chat(messages, greedy("suffix")).result()
    assert done.tokens == plain and other.tokens == plain
    spec = done.stats.speculation
    assert spec.remembered > 0 and spec.accepted > fresh.stats.speculation.accepted, (spec, fresh.stats.speculation)
    assert other.stats.speculation.remembered == 0  # another scope drafts nothing from it


@pytest.mark.slow
def test_a_server_s_memory_outlives_a_restart_per_key_and_a_bad_file_is_one_warning(f16_path, edgeinfer_home,  # noqa: F811
                                                                                 caplog):
    def engine() -> BatchEngine:
        return BatchEngine.load(f16_path, batch=BatchOptions(parallel=1, calibrate_when_idle=False), n_ctx=2048,
                                flash_attn=False, suffix_memory="store")

    prompt_messages = tool_call("Berlin")
    with engine() as first:
        prompt = first.chat_tokens(prompt_messages)
        plain = first.submit(prompt, greedy()).result().tokens
        first.submit(prompt, greedy("suffix", "alice")).result()
        keeper = first._core.memory.keeper
        assert keeper.path("alice").is_file()  # saved after the request, not only at the unload
        path = keeper.path("bob")  # where bob's file would be
    path.write_bytes(MAGIC + b"\xff" * 40)  # a damaged file for bob
    with engine() as second:
        alice = second.submit(prompt, greedy("suffix", "alice")).result()
        bob = second.submit(prompt, greedy("suffix", "bob")).result()
    assert alice.tokens == plain and bob.tokens == plain
    assert alice.stats.speculation.remembered > 0 and bob.stats.speculation.remembered == 0
    assert len(warnings(caplog)) == 1 and str(path) in warnings(caplog)[0]
    assert len(suffix_files(edgeinfer_home)) == 2  # bob's answer replaced the damaged file
