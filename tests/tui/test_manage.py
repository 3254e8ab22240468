"""Pilot tests of the manage screen: models table and delete, quality ladder, tasks with progress,
features this version lacks, and the real LibraryBackend's feature detection."""

from __future__ import annotations

from tui_helpers import run, wait_for


async def _open_manage(pilot, app):
    await wait_for(pilot, lambda: app.chat is not None)
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ManageScreen")
    screen = app.screen
    await wait_for(pilot, lambda: screen.query_one("#manage-models").row_count > 0, what="models table")
    return screen


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


def test_quantize_task_progress_and_error(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            screen.query_one("#manage-tabs").active = "tab-quantize"
            await pilot.pause()
            screen.query_one("#quantize-source").value = "smollm2-135m-instruct:q8_0"
            screen.query_one("#quantize-qtype").value = "Q4_K_M"
            await pilot.click("#start-quantize")
            result = screen.query_one("#quantize-result")
            await wait_for(pilot, lambda: "done" in str(result.render()), what="quantize result")
            assert backend.tasks[-1] == ("quantize", {"source": "smollm2-135m-instruct:q8_0", "qtype": "Q4_K_M"})
            bars = list(screen.query("#quantize-bars ProgressBar"))
            assert len(bars) == 1 and bars[0].progress == 5 and bars[0].total == 5
            await wait_for(pilot, lambda: screen.query_one("#manage-models").row_count == 4, what="new model listed")
            # a library error: one line on the screen and a notification, the app keeps running
            screen.query_one("#quantize-source").value = "bad"
            await pilot.click("#start-quantize")
            await wait_for(pilot, lambda: "error: no such model folder: bad" in str(result.render()))
            assert any("no such model folder" in n.message for n in app._notifications)

    run(main())


def test_pull_shows_one_bar_per_file(make_app, backend):
    backend.available["pull"] = True

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            screen.query_one("#manage-tabs").active = "tab-pull"
            await pilot.pause()
            screen.query_one("#pull-source").value = "org/repo:Q4_K_M"
            await pilot.click("#start-pull")
            await wait_for(pilot, lambda: "done → org-repo:q4_k_m" in str(screen.query_one("#pull-result").render()))
            bars = list(screen.query("#pull-bars ProgressBar"))
            assert [(b.progress, b.total) for b in bars] == [(1_000_000, 1_000_000)] * 2
            labels = [str(lbl.render()) for lbl in screen.query("#pull-bars .bar-label")]
            assert labels == ["model-00001.gguf downloading", "model-00002.gguf downloading"]

    run(main())


def test_progress_events_of_the_library_map_to_bars():
    """The real progress dataclasses of hub / quantize / convert / evaluate, where this version has them."""
    import importlib.util

    from edgeinfer_tui.backend import progress_from_event

    if importlib.util.find_spec("edgeinfer.hub"):
        from edgeinfer import DownloadProgress, PullStage

        p = progress_from_event(DownloadProgress(file="a.gguf", done=5, total=10, rate=1.0, index=2, count=3), "pull")
        assert (p.key, p.done, p.total, p.message) == ("a.gguf", 5, 10, None)
        assert progress_from_event(PullStage(stage="convert", message="converting"), "pull").message == "converting"
    if importlib.util.find_spec("edgeinfer.quantize"):
        from edgeinfer.quantize import QuantizeProgress

        p = progress_from_event(QuantizeProgress(tensor_index=3, n_tensors=30, tensor_name="blk.0.attn_q.weight", type_name="Q4_K"), "quantize")
        assert (p.done, p.total, p.label) == (3, 30, "blk.0.attn_q.weight → Q4_K")
    if importlib.util.find_spec("edgeinfer.convert"):
        from edgeinfer.convert import ConvertProgress

        p = progress_from_event(ConvertProgress(tensor="token_embd.weight", index=1, count=30, bytes_done=1, bytes_total=9), "convert")
        assert (p.done, p.total, p.label) == (1, 30, "token_embd.weight")
    if importlib.util.find_spec("edgeinfer.evaluate"):
        from edgeinfer.evaluate import EvalProgress

        p = progress_from_event(EvalProgress(model="m:q4", chunk=2, n_chunks=8), "evaluate")
        assert (p.done, p.total) == (2, 8)


def test_missing_features_say_so(make_app, backend):
    backend.available = {"pull": False, "convert": False, "quantize": True, "evaluate": False}

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _open_manage(pilot, app)
            for kind in ("pull", "convert", "evaluate"):
                text = str(screen.query_one(f"#{kind}-unavailable").render())
                assert "not available in this version" in text
                assert not screen.query(f"#start-{kind}")
            assert screen.query("#start-quantize")

    run(main())


def test_library_backend_features_and_models(default_model_path):
    """The real backend: the store lists the default model with its facts; features match modules."""
    import importlib.util

    from edgeinfer_tui.backend import FEATURES, LibraryBackend

    be = LibraryBackend()
    entries = be.list_models()
    default = next(e for e in entries if e.ref == be.default_ref())
    assert default.quant and default.size > 10_000_000 and 4.0 < default.bits_per_weight < 6.0
    assert default.fits in (True, False)
    feats = be.features()
    for kind, module in FEATURES.items():
        if importlib.util.find_spec(module) is None:
            assert feats[kind] is False
