"""Pilot tests of the manage screen: models table and delete, quality ladder, tasks with progress
and the keys that start them; the real LibraryBackend's rows and the library's progress events."""

from __future__ import annotations

import pytest
from tui_helpers import run, wait_for

# slow tier: Pilot-driven app tests, about a second of CPU each; the fast tier keeps the widget,
# dialog and snapshot tests
pytestmark = pytest.mark.slow


async def _open_manage(pilot, app):
    await wait_for(pilot, lambda: app.chat_view.chat is not None)
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ManageScreen")
    screen = app.screen
    await wait_for(pilot, lambda: screen.query_one("#manage-models").row_count > 0, what="models table")
    return screen


async def _start(pilot, screen, kind: str, **fields: str) -> None:
    """Show the task's tab, fill in its fields, press its start button."""
    screen.query_one("#manage-tabs").active = f"tab-{kind}"
    await pilot.pause()
    for arg, value in fields.items():
        screen.query_one(f"#{kind}-{arg}").value = value
    await pilot.click(f"#start-{kind}")


def test_models_table_delete_and_ladder(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            table = screen.query_one("#manage-models")
            assert table.row_count == 3
            # the ladder of the model name: rows by bits/weight, bars for KLD and size
            ladder = screen.query_one("#ladder-table")
            await wait_for(pilot, lambda: ladder.row_count == 3, what="ladder rows")
            assert [str(ladder.get_row_at(i)[0]) for i in range(3)] == ["Q8_0", "Q4_K_M", "Q4_1"]
            assert [str(c) for c in ladder.get_row_at(1)][3:6] == ["10.900", "0.0600", "87.7 %"]
            chart = screen.query_one("#ladder-chart").render().plain
            assert "KLD vs reference" in chart and "0.0600" in chart and "█" in chart and "145.0 MB" in chart
            # delete the selected (second) model after confirming
            table.focus()
            table.move_cursor(row=1)
            await pilot.click("#delete-model")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
            await pilot.press("y")
            await wait_for(pilot, lambda: table.row_count == 2, what="row removed")
            assert [m.ref for m in backend.models] == ["smollm2-135m-instruct:q4_1", "smollm2-135m-instruct:q4_k_m"]
            assert "Deleted smollm2-135m-instruct:q8_0" in str(screen.query_one("#models-result").render())
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")

    run(main())


def test_the_ladder_tab_shows_the_tuned_profile_as_characters(make_app, backend):
    from dataclasses import replace

    plot = "tuned: smollm2-135m-instruct:q4_1 kv q8_0 fa on auto-t lookup: 61.0 tok/s\n12.0 |  *   |"
    backend.models = [replace(backend.models[0], tuned=plot)] + backend.models[1:] + [
        replace(backend.models[1], ref="other:q8_0", name="other")]

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            tuned = screen.query_one("#tuned-plot")
            screen.query_one("#ladder-name").value = "smollm2-135m-instruct"
            await wait_for(pilot, lambda: "61.0 tok/s" in tuned.render().plain, what="the tuned profile")
            assert "12.0 |  *   |" in tuned.render().plain
            screen.query_one("#ladder-name").value = "other"
            await wait_for(pilot, lambda: "not tuned yet: `edgeinfer tune other`" in tuned.render().plain,
                           what="no profile")

    run(main())


def test_quantize_task_progress_and_error(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            await _start(pilot, screen, "quantize", source="smollm2-135m-instruct:q8_0", qtype="Q4_K_M")
            result = screen.query_one("#quantize-result")
            await wait_for(pilot, lambda: "done" in str(result.render()), what="quantize result")
            assert backend.tasks[-1] == ("quantize", {"source": "smollm2-135m-instruct:q8_0", "qtype": "Q4_K_M"})
            bars = list(screen.query("#quantize-bars ProgressBar"))
            assert len(bars) == 1 and bars[0].progress == 5 and bars[0].total == 5
            await wait_for(pilot, lambda: screen.query_one("#manage-models").row_count == 4, what="new model listed")
            # a library error: one line on the screen and a notification, the app keeps running
            await _start(pilot, screen, "quantize", source="bad")
            await wait_for(pilot, lambda: "error: no such model folder: bad" in str(result.render()))
            assert any("no such model folder" in n.message for n in app._notifications)
            # the importance matrix the i-quants use: a task of its own, with a bar
            await _start(pilot, screen, "imatrix", source="smollm2-135m-instruct:q8_0")
            await wait_for(pilot, lambda: "done" in str(screen.query_one("#imatrix-result").render()))
            assert backend.tasks[-1] == ("imatrix", {"source": "smollm2-135m-instruct:q8_0"})
            assert [b.progress for b in screen.query("#imatrix-bars ProgressBar")] == [5]

    run(main())


def test_pull_shows_one_bar_per_file(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            await _start(pilot, screen, "pull", source="org/repo:Q4_K_M")
            await wait_for(pilot, lambda: "done → org-repo:q4_k_m" in str(screen.query_one("#pull-result").render()))
            bars = list(screen.query("#pull-bars ProgressBar"))
            assert [(b.progress, b.total) for b in bars] == [(1_000_000, 1_000_000)] * 2
            labels = [str(lbl.render()) for lbl in screen.query("#pull-bars .bar-label")]
            assert labels == ["model-00001.gguf downloading", "model-00002.gguf downloading"]

    run(main())


def test_task_tab_focuses_its_first_field_and_enter_starts_it(make_app, backend):
    """Ctrl+L, then the Pull tab: typing goes into the repository field at once; Enter pulls."""

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            assert app.focused is screen.query_one("#manage-tabs Tabs")
            await pilot.press("right", "right")  # Models → Quality ladder → Pull
            await wait_for(pilot, lambda: app.focused is screen.query_one("#pull-source"), what="the pull field focused")
            await pilot.press(*"org/repo:Q4_K_M")
            assert screen.query_one("#pull-source").value == "org/repo:Q4_K_M"
            await pilot.press("enter")
            await wait_for(pilot, lambda: "done → org-repo:q4_k_m" in str(screen.query_one("#pull-result").render()))
            assert backend.tasks == [("pull", {"source": "org/repo:Q4_K_M"})]
            # the second field of a task also starts it with Enter
            screen.query_one("#manage-tabs").active = "tab-quantize"
            await wait_for(pilot, lambda: app.focused is screen.query_one("#quantize-source"))
            await pilot.press(*"m:f16", "tab", *"Q8_0", "enter")
            await wait_for(pilot, lambda: len(backend.tasks) == 2 and "done" in str(screen.query_one("#quantize-result").render()))
            assert backend.tasks[-1] == ("quantize", {"source": "m:f16", "qtype": "Q8_0"})

    run(main())


def test_text_typed_right_after_the_arrow_that_opens_a_task_tab_reaches_its_field(make_app, backend):
    """A terminal delivers a fast typist's keys together: the arrow that opens the Pull tab and the
    letters after it reach the tab bar before the field takes the focus. They used to be dropped
    (the user had to press Tab twice and type again); they go into the field, in order."""
    from textual import events

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            assert app.focused is screen.query_one("#manage-tabs Tabs")
            for key in ("right", "right", *"org/repo"):  # all queued at once, as one read of the terminal
                app.post_message(events.Key(key, key if len(key) == 1 else None))
            field = screen.query_one("#pull-source")
            await wait_for(pilot, lambda: field.value == "org/repo", what=f"the typed text (got {field.value!r})")
            assert app.focused is field
            await pilot.press("enter")
            await wait_for(pilot, lambda: backend.tasks == [("pull", {"source": "org/repo"})], what="the pull")

    run(main())


def test_the_models_table_fits_100_columns(make_app, backend):
    """A long store name (qwen2.5-coder-1.5b-instruct:q4_k_m beside a longer one) made the table
    wider than the screen: "Fits RAM" was cut at 100 columns. The names give way instead, and a
    name that does not fit ends in "…"."""
    from edgeinfer_tui.backend import ModelEntry

    long_names = ("qwen2.5-coder-1.5b-instruct:q4_k_m", "deepseek-r1-distill-qwen-1.5b-instruct:q4_k_m")
    for ref in long_names:
        backend.models.append(ModelEntry(ref=ref, name=ref.split(":")[0], quant="Q4_K_M", size=1_117_320_800,
                                         bits_per_weight=5.06, kld=0.0123, same_top=95.5, tok_s=18.2, fits=False))

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            screen = await _open_manage(pilot, app)
            table = screen.query_one("#manage-models")
            await pilot.pause()
            widths = [c.get_render_width(table) for c in table.ordered_columns]
            assert [str(c.label) for c in table.ordered_columns][-1] == "Fits RAM"
            assert sum(widths) <= table.scrollable_content_region.width, widths  # nothing scrolls sideways
            assert table.max_scroll_x == 0
            names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
            assert long_names[0] in names  # shown whole where it fits
            assert widths[0] - 2 < len(long_names[1])  # the longest is cut (with "…", rendered by rich)
            await pilot.resize_terminal(140, 30)  # a wider screen: the whole name again
            await wait_for(pilot, lambda: table.ordered_columns[0].get_render_width(table) - 2 >= len(long_names[1]))

    run(main())


def test_the_import_tab_imports_a_file_under_a_name(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            await _start(pilot, screen, "import", source="/home/me/model.gguf", name="mine")
            await wait_for(pilot, lambda: "done" in str(screen.query_one("#import-result").render()))
            assert backend.tasks == [("import", {"source": "/home/me/model.gguf", "name": "mine"})]
            await wait_for(pilot, lambda: screen.query_one("#manage-models").row_count == 4, what="the model listed")

    run(main())


def test_progress_events_of_the_library_map_to_bars():
    """The library's own progress events, as the manage screen shows them."""
    from pathlib import Path

    from edgeinfer import DownloadProgress, PullPlan, PullStage
    from edgeinfer.convert import ConvertProgress
    from edgeinfer.evaluate import EvalProgress
    from edgeinfer.imatrix_compute import ImatrixProgress
    from edgeinfer.quantize import QuantizeProgress
    from edgeinfer_tui.backend import progress_from_event

    p = progress_from_event(DownloadProgress(file="a.gguf", done=5, total=10, rate=0.0, index=2, count=3), "pull")
    assert (p.key, p.label, p.done, p.total, p.message) == ("a.gguf", "a.gguf downloading", 5, 10, None)  # no rate yet
    p = progress_from_event(DownloadProgress(file="a.gguf", done=5, total=10, rate=2_500_000.0), "pull")
    assert p.label == "a.gguf downloading 2.5 MB/s"
    p = progress_from_event(DownloadProgress(file="a.gguf", done=10, total=10, rate=2_500_000.0, status="verifying"), "pull")
    assert p.label == "a.gguf verifying"
    assert progress_from_event(PullStage(stage="convert", message="converting"), "pull").message == "converting"
    plan = PullPlan(repo="org/repo", revision="main", commit="0123456789abcdef" * 2 + "01234567", kind="gguf",
                    quant="Q4_K_M", files=(), total_bytes=2_000_000, cached_bytes=0, partial_bytes=0, output_bytes=0,
                    weights_bytes=2_000_000, cache_dir=Path("c"), store_dir=Path("s"), free_cache_bytes=1 << 40,
                    free_store_bytes=1 << 40, ram_available_bytes=None, ram_needed_bytes=0, endpoint="http://x")
    assert progress_from_event(plan, "pull").message == "org/repo @ 0123456789: gguf Q4_K_M, 2.0 MB to fetch"
    p = progress_from_event(QuantizeProgress(tensor_index=3, n_tensors=30, tensor_name="blk.0.attn_q.weight", type_name="Q4_K"), "quantize")
    assert (p.key, p.done, p.total, p.label) == ("quantize", 3, 30, "blk.0.attn_q.weight → Q4_K")
    p = progress_from_event(ConvertProgress(tensor="token_embd.weight", index=1, count=30, bytes_done=1, bytes_total=9), "convert")
    assert (p.done, p.total, p.label) == (1, 30, "token_embd.weight")
    p = progress_from_event(ImatrixProgress(chunk=3, n_chunks=13), "imatrix")
    assert (p.key, p.label, p.done, p.total) == ("imatrix", "chunk 3/13", 3, 13)
    p = progress_from_event(EvalProgress(model="m:q4", chunk=2, n_chunks=8), "evaluate")
    assert (p.key, p.done, p.total, p.label) == ("evaluate-m:q4", 2, 8, "m:q4 chunk 2/8")


def test_library_backend_rows_come_from_the_manifest_and_fit(default_model_path, edgeinfer_home):
    """The real backend: a row holds the manifest's facts, the metrics evaluate and bench saved
    (same-top as a percentage) and edgeinfer.fit's verdict for the RAM available."""
    import edgeinfer
    from edgeinfer.fit import fit
    from edgeinfer_tui.backend import LibraryBackend, entry_from_manifest

    be = LibraryBackend()
    store = edgeinfer.Store()
    default = next(e for e in be.list_models() if e.ref == be.default_ref())
    manifest = next(m for m in store.list() if m.ref == be.default_ref())
    assert (default.quant, default.size, default.bits_per_weight) == (manifest.quant, manifest.size, manifest.bits_per_weight)
    assert default.fits is fit(default.ref).fits
    need = fit(default.ref, available=0).estimate.total
    assert entry_from_manifest(manifest, available=need - 1).fits is False
    assert entry_from_manifest(manifest, available=need).fits is True
    store.update_metrics(manifest.ref, "eval", {"ppl": 10.9, "kld": 0.06, "same_top": 0.877})
    store.update_metrics(manifest.ref, "bench", {"decode_tok_s": 118.0})
    row = next(e for e in be.list_models() if e.ref == be.default_ref())
    assert (row.ppl, row.kld, row.tok_s) == (10.9, 0.06, 118.0)
    assert abs(row.same_top - 87.7) < 1e-9


def test_a_running_quantization_can_be_cancelled(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            await _start(pilot, screen, "quantize", source="endless")
            cancel = screen.query_one("#cancel-quantize")
            await wait_for(pilot, lambda: not cancel.disabled and screen.query("#quantize-bars ProgressBar"), what="running")
            assert screen.query_one("#start-quantize").disabled
            await pilot.click("#cancel-quantize")
            result = screen.query_one("#quantize-result")
            await wait_for(pilot, lambda: str(result.render()) == "quantize: cancelled", what="the cancel")
            assert cancel.disabled and not screen.query_one("#start-quantize").disabled
            assert not any(n.severity == "error" for n in app._notifications)  # asked for, not an error

    run(main())
