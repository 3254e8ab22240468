"""What the gate before llama.cpp costs (edgeinfer.validate), next to what loading costs.

For each model: our validation (structure + semantics: `validate_file`), the sha256 of the file
(how a never-seen file is looked up; a store registration computes it anyway), the child-process
first load (`probe_load`, once per file), their sum (what the gate adds to a file's first load),
the whole gate on a second load (`admit` with the store's memory of the first), and llama.cpp's
own load (model + context, in this process). Rows alternate between the steps, medians of
--rounds; the ratio is gate-on-a-second-load / load.

    .venv/bin/python benchmarks/bench_validate.py [MODEL.gguf ...] [--rounds 5]

Without arguments: the default model, and the real Qwen2.5-Coder 1.5B Q4_K_M (1.1 GB) when
tests/real_models.py has it cached.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _default_models() -> list[Path]:
    from edgeinfer.default_model import default_model_file

    models = [default_model_file()]
    cache = Path(os.environ.get("EDGEINFER_TEST_CACHE", Path.home() / ".cache" / "edgeinfer-test-models"))
    qwen = cache / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if qwen.is_file():
        models.append(qwen)
    return [m for m in models if m is not None]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as home:
        os.environ["EDGEINFER_HOME"] = home
        os.environ.pop("EDGEINFER_LOAD_PROBE", None)
        from edgeinfer import Store
        from edgeinfer.fsutil import sha256_file
        from edgeinfer.engine.llama.runtime import LlamaRuntime
        from edgeinfer.engine.core.options import LoadOptions
        from edgeinfer.validate import LoadChecks, admit, probe_load, validate_file

        store = Store()
        print(f"{'model':44} {'size':>8} {'validate':>9} {'sha256':>8} {'probe':>8} {'1st gate':>9} "
              f"{'gate 2nd':>9} {'load':>8} {'gate/load':>9}")
        for model in args.models or _default_models():
            model = Path(model)
            LoadChecks(store).ensure_loads(model, None)  # first load, as a user's first `run` pays it
            rows: dict[str, list[float]] = {"validate": [], "hash": [], "probe": [], "gate": [], "load": []}
            for _ in range(args.rounds):
                rows["validate"].append(_time(lambda: validate_file(model)))
                rows["hash"].append(_time(lambda: sha256_file(model)))
                rows["probe"].append(_time(lambda: probe_load(model)))
                rows["gate"].append(_time(lambda: admit(model, store)))

                def load() -> None:
                    rt = LlamaRuntime(model, LoadOptions(n_ctx=512, n_threads=2))
                    rt.close()

                rows["load"].append(_time(load))
            med = {k: statistics.median(v) for k, v in rows.items()}
            first = med["validate"] + med["hash"] + med["probe"]
            print(f"{model.name[:44]:44} {model.stat().st_size / 1e9:7.2f}G {med['validate']:8.3f}s {med['hash']:7.2f}s "
                  f"{med['probe']:7.2f}s {first:8.2f}s {med['gate']:8.3f}s {med['load']:7.3f}s "
                  f"{med['gate'] / med['load']:8.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
