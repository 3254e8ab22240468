"""The chat's KV-cache types (issue 14): offered in the settings dialog and saved with the chat,
loaded by the model host (which reloads when they change and keeps the previous model when a load
fails), priced per type in the model picker from edgeinfer.fit, and set by `edgeinfer chat
--kv-type/--kv-type-k/--kv-type-v`.

Fast: the host and the settings through their state, the CLI's hand-over, the picker's line from
the library's estimate (the dialog's fields are checked in test_dialogs.py). Slow: the flows in
the app, and a real chat with a q8_0 cache.
"""

from __future__ import annotations

import threading

import pytest
from tui_helpers import open_screen, run, say, select_options, turns, wait_for

import edgeinfer

REF = "smollm2-135m-instruct:q4_1"
CONTEXT_FAILED = "model.gguf: llama.cpp could not create a context (n_ctx=4096, kv=f32/f32)"


# -- the host -------------------------------------------------------------------------------------
def test_the_host_reloads_when_the_cache_types_change(backend):
    from edgeinfer_tui.model_host import ModelHost, ModelKey

    backend.load_options = edgeinfer.LoadOptions(n_ctx=2048, n_threads=2)
    host = ModelHost(backend)
    first = host.ensure_loaded(REF)
    assert backend.load_requests[-1][1].kv_types == ("f16", "f16")
    assert host.ensure_loaded(REF, ("f16", "f16")) is first and len(backend.loads) == 1  # nothing changed

    second = host.ensure_loaded(REF, ("q8_0", "q4_0"))
    assert len(backend.loads) == 2 and first.engine.closed and not second.engine.closed
    ref, options = backend.load_requests[-1]
    assert ref == REF and options.kv_types == ("q8_0", "q4_0")
    # the rest is what `edgeinfer chat` asked for; flash attention stays the library's choice
    assert (options.n_ctx, options.n_threads, options.flash_attn) == (2048, 2, None)
    assert host.key == ModelKey(REF, ("q8_0", "q4_0"))
    assert host.ensure_loaded(REF, ("Q8_0", "q4_0")) is second  # the library's spelling: no reload

    host.ensure_loaded(REF, ("q8_0", "q8_0"))  # V alone changes: a reload too
    assert len(backend.loads) == 3 and second.engine.closed


def test_a_load_that_fails_brings_the_previous_model_back(backend):
    from edgeinfer_tui.model_host import ModelHost, ModelKey

    backend.fail_kv = {("f32", "f32"): CONTEXT_FAILED}
    host = ModelHost(backend)
    before = host.ensure_loaded(REF, ("q8_0", "q8_0"))
    with pytest.raises(edgeinfer.InvalidModelError, match="could not create a context"):
        host.ensure_loaded(REF, ("f32", "f32"))
    assert [o.kv_types for _, o in backend.load_requests] == [("q8_0", "q8_0"), ("f32", "f32"), ("q8_0", "q8_0")]
    assert host.key == ModelKey(REF, ("q8_0", "q8_0")) and not host.loaded.engine.closed
    assert host.ensure_loaded(REF, ("q8_0", "q8_0")) is host.loaded  # usable, no further load
    assert len(backend.loads) == 3

    # a type the library does not know is refused before anything is closed or loaded
    with pytest.raises(edgeinfer.InvalidOptionError, match="unknown KV-cache type 'q3'"):
        host.ensure_loaded(REF, ("q3", "f16"))
    assert len(backend.loads) == 3 and not host.loaded.engine.closed and before.engine.closed


def test_settings_saved_before_the_kv_types_load_as_f16():
    from edgeinfer_tui.settings import ChatSettings, kv_label, kv_load_options

    old = ChatSettings.from_dict({"temperature": 0.2, "speculation": {"method": "lookup"}})
    assert old.kv_types == ("f16", "f16") == edgeinfer.DEFAULT_LOAD.kv_types
    chosen = ChatSettings.from_dict(old.with_kv_types(("q8_0", "q4_0")).to_dict())
    assert chosen.kv_types == ("q8_0", "q4_0") and chosen.temperature == 0.2
    assert (kv_label(chosen.kv_types), kv_label(("q8_0", "q8_0"))) == ("q8_0/q4_0", "q8_0")
    options = kv_load_options(chosen.kv_types, edgeinfer.LoadOptions(n_ctx=1024))
    assert options.kv_types == ("q8_0", "q4_0") and options.n_ctx == 1024
    damaged = ChatSettings.from_dict({"kv_type_k": 8, "kv_type_v": None})  # a hand-edited database
    with pytest.raises(edgeinfer.InvalidOptionError, match="unknown KV-cache type '8'"):
        kv_load_options(damaged.kv_types)


def _stats(app) -> str:
    return str(app.chat_screen.query_one("#stats").render())


async def _first_load(pilot, app, backend) -> None:
    await wait_for(pilot, lambda: app.chat_view.chat is not None and backend.loads, what="the chat and its model")


# -- the settings dialog --------------------------------------------------------------------------
@pytest.mark.slow
def test_settings_dialog_offers_every_kv_type_and_the_change_reloads_the_model(make_app, backend):
    from textual.widgets import Select

    backend.load_options = edgeinfer.LoadOptions(n_ctx=2048)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 50)) as pilot:
            await _first_load(pilot, app, backend)
            assert backend.load_requests[-1][1].kv_types == ("f16", "f16")
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            k, v = screen.query_one("#set-kv_type_k", Select), screen.query_one("#set-kv_type_v", Select)
            for select in (k, v):
                assert select_options(select) == list(edgeinfer.KV_TYPE_NAMES)
                assert select.value == "f16"  # a new chat: the library's default
            k.value, v.value = "q8_0", "q4_0"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            await wait_for(pilot, lambda: len(backend.loads) == 2, what="the reload")
            ref, options = backend.load_requests[-1]
            assert ref == REF and options.kv_types == ("q8_0", "q4_0") and options.n_ctx == 2048
            saved = app.store.get_chat(app.chat_view.chat.id).settings
            assert (saved["kv_type_k"], saved["kv_type_v"]) == ("q8_0", "q4_0")
            await wait_for(pilot, lambda: f"{REF} · KV q8_0/q4_0 · speculation" in app.sub_title, what="the header")
            await wait_for(pilot, lambda: "KV q8_0/q4_0 · ready" in _stats(app), what="the stats line")
            # the dialog opens on what was saved
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            assert (screen.query_one("#set-kv_type_k", Select).value, screen.query_one("#set-kv_type_v", Select).value) == ("q8_0", "q4_0")

    run(main())


# -- `edgeinfer chat` -----------------------------------------------------------------------------
def test_the_chat_command_hands_its_kv_types_to_the_ui(monkeypatch, capsys):
    import edgeinfer_tui
    from edgeinfer.cli import main

    calls = []
    monkeypatch.setattr(edgeinfer_tui, "run", lambda model, **kw: calls.append((model, kw)) or 0)
    assert main(["chat", "--ctx", "2048", "--kv-type-k", "Q8_0", "--kv-type-v", "q4_0"]) == 0
    assert main(["chat", "--kv-type", "q5_1"]) == 0
    assert main(["chat", "--kv-type", "q8_0", "--kv-type-v", "f16"]) == 0
    assert main(["chat"]) == 0
    (_, a), (_, b), (_, c), (_, d) = calls
    assert a["kv_types"] == ("q8_0", "q4_0") and a["load_options"].n_ctx == 2048
    assert b["kv_types"] == ("q5_1", "q5_1") and c["kv_types"] == ("q8_0", "f16")
    assert d["kv_types"] is None  # no flag: the open chat keeps the types saved with it
    assert main(["chat", "--kv-type-v", "q9"]) == 1 and len(calls) == 4  # refused before the screen opens
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["edgeinfer: error: unknown KV-cache type 'q9': choose one of " + ", ".join(edgeinfer.KV_TYPE_NAMES)]


# -- the model picker's KV line -------------------------------------------------------------------
def test_the_picker_row_carries_fit_s_kv_bytes_per_type(default_model_path):
    from edgeinfer.fit import fit
    from edgeinfer_tui.backend import LibraryBackend
    from edgeinfer_tui.model_table import format_mib, kv_cost_line

    be = LibraryBackend(edgeinfer.LoadOptions(n_ctx=8192))
    entry = next(e for e in be.list_models(("q8_0", "q4_0")) if e.ref == be.default_ref())
    mixed = fit(entry.ref, 8192, kv_type_k="q8_0", kv_type_v="q4_0")
    assert (entry.n_ctx, entry.kv_types, entry.fits) == (8192, ("q8_0", "q4_0"), mixed.fits)
    assert entry.kv_cache == mixed.estimate.kv_cache and entry.kv_by_type == mixed.kv_by_type
    assert list(entry.kv_by_type) == list(edgeinfer.KV_TYPE_NAMES)
    line = kv_cost_line(entry)
    assert line.startswith(f"KV cache at 8192 tokens: this chat (q8_0/q4_0) {format_mib(mixed.estimate.kv_cache)}. By type: ")
    assert f"f16 {format_mib(mixed.kv_by_type['f16'])} · bf16" in line and line.endswith(f"iq4_nl {format_mib(mixed.kv_by_type['iq4_nl'])}")
    # the default context and cache when `edgeinfer chat` names none
    plain = next(e for e in LibraryBackend().list_models() if e.ref == be.default_ref())
    default = fit(plain.ref).estimate
    assert (plain.n_ctx, plain.kv_types, plain.kv_cache) == (default.n_ctx, ("f16", "f16"), default.kv_cache)


def test_mib_reads_like_llama_cpp_s_buffer_sizes():
    from edgeinfer_tui.model_table import format_mib

    assert [format_mib(n) for n in (5 * 2**20 + 2**19, 96 * 2**20, 1536 * 2**20)] == ["5.5 MiB", "96 MiB", "1.50 GiB"]


# -- flows in the app (slow tier, as the other Pilot app tests) -----------------------------------
async def _choose_kv(pilot, app, k: str, v: str) -> None:
    from textual.widgets import Select

    screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
    screen.query_one("#set-kv_type_k", Select).value = k
    screen.query_one("#set-kv_type_v", Select).value = v
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")


@pytest.mark.slow
def test_the_picker_shows_the_highlighted_model_s_kv_cost(make_app, backend):
    from dataclasses import replace

    mib = 2**20
    by_type = {"f32": 192 * mib, "f16": 96 * mib, "bf16": 96 * mib, "q8_0": 51 * mib, "q5_1": 36 * mib,
               "q5_0": 33 * mib, "q4_1": 30 * mib, "q4_0": 27 * mib, "iq4_nl": 27 * mib}
    backend.models[1] = replace(backend.models[1], n_ctx=4096, kv_types=("q8_0", "q8_0"), kv_cache=51 * mib, kv_by_type=by_type)

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await _first_load(pilot, app, backend)
            await _choose_kv(pilot, app, "q8_0", "q8_0")
            screen = await open_screen(pilot, "ctrl+o", "ModelPickerScreen")
            table = screen.query_one("#models")
            await wait_for(pilot, lambda: table.row_count == 3, what="model rows")
            assert backend.listed_with[-1] == ("q8_0", "q8_0")  # fits and sizes at the chat's cache types
            line = screen.query_one("#picker-kv")
            assert "KV cache size unknown" in str(line.render())  # the first row: the fake has no estimate
            await pilot.press("down")
            await wait_for(pilot, lambda: "KV cache at 4096" in str(line.render()), what="the KV line")
            assert str(line.render()).replace("\n", " ") == (
                "KV cache at 4096 tokens: this chat (q8_0) 51 MiB. By type: f32 192 MiB · f16 96 MiB · bf16 96 MiB · "
                "q8_0 51 MiB · q5_1 36 MiB · q5_0 33 MiB · q4_1 30 MiB · q4_0 27 MiB · iq4_nl 27 MiB"
            )

    run(main())


@pytest.mark.slow
def test_a_cache_type_that_fails_to_load_keeps_the_chat_working(make_app, backend):
    backend.fail_kv = {("f32", "f32"): CONTEXT_FAILED}

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            view = app.chat_view
            await _first_load(pilot, app, backend)
            await _choose_kv(pilot, app, "q8_0", "q8_0")
            await wait_for(pilot, lambda: app.models.key is not None and app.models.key.kv_types == ("q8_0", "q8_0"))
            await say(pilot, backend, "hi")
            kept = app.models.loaded
            await _choose_kv(pilot, app, "f32", "f32")
            await wait_for(pilot, lambda: any("could not create" in n.message for n in app._notifications), what="the error")
            note = next(n for n in app._notifications if "could not create" in n.message)
            assert note.message == f"KV cache f32: {CONTEXT_FAILED} (kept q8_0)" and "\n" not in note.message
            assert view.settings.kv_types == ("q8_0", "q8_0")  # the chat is back on the cache that loads
            assert app.store.get_chat(view.chat.id).settings["kv_type_k"] == "q8_0"
            assert "KV q8_0 · ready" in _stats(app)
            await wait_for(pilot, lambda: f"{REF} · KV q8_0 · speculation" in app.sub_title, what="the header")
            assert app.models.key.kv_types == ("q8_0", "q8_0") and not app.models.loaded.engine.closed
            assert kept.engine.closed  # it was closed for the attempt and loaded again
            n_loads = len(backend.loads)
            await say(pilot, backend, "still there?")  # the chat goes on, nothing lost, no further load
            assert len(backend.loads) == n_loads
            assert [m["content"] for m in turns(backend.calls[-1][1])] == ["hi", "Echo: hi", "still there?"]

    run(main())


@pytest.mark.slow
def test_a_cache_change_during_a_reply_applies_to_the_next_one(make_app, backend):
    """The reply holds the model: saving other cache types mid-reply does not close it under the
    reply; the next reply loads them, and when that load fails, the chat is back on the kept ones."""
    backend.gate = threading.Semaphore(0)
    backend.fail_kv = {("q4_0", "q4_0"): CONTEXT_FAILED}

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            view = app.chat_view
            await _first_load(pilot, app, backend)
            for text, kv, tokens in (("one two three", "q5_0", 4), ("next", "q4_0", 2)):
                n = len(backend.calls)
                view.chat_input.text = text
                await pilot.press("enter")
                await wait_for(pilot, lambda: view.generating and len(backend.calls) == n + 1, what=f"the reply to {text!r}")
                n_loads = len(backend.loads)
                await _choose_kv(pilot, app, kv, kv)
                assert len(backend.loads) == n_loads and view.generating  # not reloaded under the reply
                backend.gate.release(tokens)
                await wait_for(pilot, lambda: not view.generating, what="the reply's end")
                assert view.last_done.finish_reason == "eos"
            # the second reply loaded q5_0 chosen during the first
            assert backend.load_requests[-1][1].kv_types == ("q5_0", "q5_0") and backend.calls[-1][0] == REF
            view.chat_input.text = "again"  # loads q4_0, chosen during the second: it fails
            await pilot.press("enter")
            await wait_for(pilot, lambda: any("could not create" in n.message for n in app._notifications), what="the error")
            assert [n.message for n in app._notifications if "could not" in n.message] == [f"KV cache q4_0: {CONTEXT_FAILED} (kept q5_0)"]
            assert view.settings.kv_types == ("q5_0", "q5_0") and app.models.key.kv_types == ("q5_0", "q5_0")
            backend.gate = None
            n_loads = len(backend.loads)
            await say(pilot, backend, "once more")
            assert len(backend.loads) == n_loads and backend.calls[-1][1][-1]["content"] == "once more"

    run(main())


# -- the real model ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_edgeinfer_chat_with_a_q8_0_cache_loads_it_and_answers(default_model_path, monkeypatch):
    """`edgeinfer chat --kv-type q8_0` through the CLI, the app run headless: the engine the chat
    talks to has a q8_0 K and V cache, and it answers."""
    from edgeinfer.cli import main
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.chat_store import ChatStore, default_db_path
    from edgeinfer_tui.settings import ChatSettings

    store = ChatStore(default_db_path())  # the chat the command opens: greedy and short
    store.create_chat(settings=ChatSettings(temperature=0.0, max_tokens=12).to_dict())
    store.close()
    seen: dict[str, object] = {}

    async def chat(pilot) -> None:
        app = pilot.app
        try:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.chat_input.text = "What is the capital of France?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: view.last_done is not None, timeout=180, what="the real model's reply")
            seen["kv_types"] = app.models.loaded.engine.options.kv_types
            seen["reply"] = view.last_done.text
            seen["saved"] = ChatSettings.from_dict(app.store.get_chat(view.chat.id).settings).kv_types
        except Exception as e:  # noqa: BLE001 - reported by the assertions below
            seen["error"] = repr(e)
        finally:
            app.exit()

    def headless(self, **_kw):
        return super(EdgeInferApp, self).run(headless=True, size=(100, 30), auto_pilot=chat)

    monkeypatch.setattr(EdgeInferApp, "run", headless)
    assert main(["chat", "--kv-type", "q8_0", "--ctx", "1024", "--threads", "1"]) == 0
    assert "error" not in seen, seen.get("error")
    assert seen["kv_types"] == ("q8_0", "q8_0") and seen["saved"] == ("q8_0", "q8_0")
    assert str(seen["reply"]).strip()
