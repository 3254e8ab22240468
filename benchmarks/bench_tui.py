"""Does the chat UI slow generation down, and does it stay responsive while generating?

    .venv/bin/python benchmarks/bench_tui.py [--rounds 3] [--max-tokens 160] [--json]

1. Decode tok/s of the same greedy request (the real default model), alternating, in one run:
   - library: `engine.chat(...)` drained in a plain loop;
   - TUI: the same request typed into EdgeInferApp (headless, real widgets, Markdown streaming)
     on the same engine, reading the rate the TUI shows in its stats line (the library's own
     measurement, taken while the UI renders).
   Target: TUI / library >= 0.95.
2. Responsiveness: while a reply streams, keys are pressed into the message box; latency is the
   time from the key press until the box shows it (median and max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a detailed, step by step explanation of how a bicycle works, with a Python example."


def _settings(max_tokens: int):
    from edgeinfer_tui.settings import ChatSettings

    return ChatSettings(temperature=0.0, max_tokens=max_tokens)


def library_rate(engine, max_tokens: int, in_thread: bool = True) -> tuple[float, int]:
    """The library alone. By default the request is drained in a worker thread, as the TUI does
    (on a loaded 2-core machine llama.cpp decodes markedly slower when driven from the main
    thread; measuring both sides the same way isolates what the UI costs)."""
    import threading

    settings = _settings(max_tokens)
    box = {}

    def drain() -> None:
        gen = engine.chat(settings.messages([("user", PROMPT)]), settings.to_options())
        for ev in gen:
            box["done"] = ev

    if in_thread:
        t = threading.Thread(target=drain)
        t.start()
        t.join()
    else:
        drain()
    done = box["done"]
    return done.stats.decode_tok_s, done.stats.generated_tokens


async def tui_run(app, max_tokens: int, probe_keys: bool) -> dict:
    from edgeinfer_tui.widgets import MessageView

    latencies: list[float] = []
    async with app.run_test(size=(120, 40)) as pilot:
        while app.chat_view.chat is None or app.models.loaded is None:
            await pilot.pause(0.01)
        n_views = len(app.chat_view.messages_view.query(MessageView))
        app.chat_view.last_done = None
        app.chat_view.chat_input.text = PROMPT
        await pilot.press("enter")
        # first token on screen
        while len(app.chat_view.messages_view.query(MessageView)) < n_views + 2 or not app.chat_view.messages_view.query(MessageView).last().content:
            await asyncio.sleep(0.01)
        if probe_keys:
            from textual import events

            while app.chat_view.generating and len(latencies) < 40:
                before = app.chat_view.chat_input.text
                t0 = time.perf_counter()
                app.chat_view.chat_input.post_message(events.Key("x", "x"))
                while app.chat_view.chat_input.text == before:
                    await asyncio.sleep(0.001)
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
        while app.chat_view.last_done is None:
            await asyncio.sleep(0.05)  # the bench itself stays out of the way of the UI
        shown = app.chat_view.last_stats
        # the rate the UI saw: tokens that reached the screen per second after the first
        out = {
            "shown_tok_s": shown.tok_s,
            "generated": shown.generated,
            "latencies": latencies,
            "stats_line": str(app.chat_screen.query_one("#stats").render()),
        }
        app.chat_view.chat_input.text = ""
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--flush", type=float, default=None, help="override the UI's token flush interval (s)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run")
    args = ap.parse_args()

    home = tempfile.mkdtemp(prefix="bench-tui-")
    os.environ.setdefault("EDGEINFER_HOME", home)
    import edgeinfer
    from edgeinfer.default_model import default_model_file
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.backend import LibraryBackend, LoadedModel
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.config import TuiConfig

    if args.flush is not None:
        import edgeinfer_tui.reply as reply_mod

        reply_mod.FLUSH_S = args.flush
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    model = default_model_file()
    if model is None:
        print("the default model is not installed (pip install 'edgeinfer[default-model]')", file=sys.stderr)
        return 1
    load = edgeinfer.LoadOptions(n_ctx=2048, n_threads=args.threads)
    engine = edgeinfer.load(model, options=load)
    library_rate(engine, 8)  # warm-up

    class SharedEngine:
        """The bench's engine, lent to the app (which closes its engine on exit), so both sides
        decode on the same llama.cpp context and only the caller differs."""

        def chat(self, messages, options=None):
            return engine.chat(messages, options)

        def close(self) -> None:
            pass

    class SharedBackend(LibraryBackend):
        def load(self, ref):
            return LoadedModel(ref=edgeinfer.DEFAULT_MODEL, engine=SharedEngine())

    def tui_once(tag: str, probe: bool) -> dict:
        db = Path(home) / f"chats-{tag}.sqlite3"
        store = ChatStore(db)
        store.create_chat(settings=_settings(args.max_tokens).to_dict())
        store.close()
        app = EdgeInferApp(SharedBackend(load), model=str(model), db_path=db, config=TuiConfig())
        return asyncio.run(tui_run(app, args.max_tokens, probe_keys=probe))

    lib_rates, tui_rates, main_rates, gens = [], [], [], []
    for r in range(args.rounds):  # alternating, so shared load affects both sides alike
        rate, n = library_rate(engine, args.max_tokens)
        lib_rates.append(rate)
        main_rates.append(library_rate(engine, args.max_tokens, in_thread=False)[0])
        out = tui_once(str(r), probe=False)
        tui_rates.append(out["shown_tok_s"])
        gens.append((n, out["generated"]))
        if not args.json:
            print(f"round {r + 1}: library {rate:6.1f} tok/s ({n} tokens; main thread {main_rates[-1]:.1f})   TUI shows {out['shown_tok_s']:6.1f} tok/s "
                  f"({out['generated']} tokens)   ratio {out['shown_tok_s'] / rate:.3f}")
    # responsiveness: a separate run (the key presses themselves cost UI time)
    lat_all = tui_once("keys", probe=True)["latencies"]
    engine.close()

    lib = statistics.median(lib_rates)
    tui = statistics.median(tui_rates)
    ratios = [t / l for t, l in zip(tui_rates, lib_rates)]
    result = {
        "library_tok_s_median": round(lib, 2),
        "tui_tok_s_median": round(tui, 2),
        "ratio_of_medians": round(tui / lib, 3),
        "ratio_per_round": [round(x, 3) for x in ratios],
        "library_main_thread_tok_s_median": round(statistics.median(main_rates), 2),
        "tokens_per_request": gens,
        "key_to_screen_ms_median": round(statistics.median(lat_all) * 1000, 1) if lat_all else None,
        "key_to_screen_ms_max": round(max(lat_all) * 1000, 1) if lat_all else None,
        "key_samples": len(lat_all),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"median: library {lib:.1f} tok/s, TUI {tui:.1f} tok/s, ratio {tui / lib:.3f} (target >= 0.95); "
              f"library from the main thread {result['library_main_thread_tok_s_median']:.1f} tok/s")
        if lat_all:
            print(f"key press -> screen while generating: median {result['key_to_screen_ms_median']} ms, "
                  f"max {result['key_to_screen_ms_max']} ms over {len(lat_all)} presses")
        print(f"load average during the run: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
