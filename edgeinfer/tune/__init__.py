"""`edgeinfer tune`: the fastest setup for this machine, this model and this work, within a quality
bound, and the trade-off as a picture.

    result = edgeinfer.tune("qwen2.5-coder-1.5b-instruct", max_kld=0.05, budget=600)
    result.choice.setup.label(), result.choice.measurement.tok_s, result.table()

    space.py     a setup, and the registry of speculation methods that proposes them
    workload.py  the prompts measured on (JSONL; the built-in mix)
    quality.py   a setup's KLD against the model's reference (known, or measured)
    measure.py   timing setups on the workload, one model load per load key
    search.py    successive halving within the budget
    pareto.py    the table and its frontier
    plot.py      the picture: SVG, and characters for terminals
    profile.py   the tuned profile kept with the model; identity.py what it holds for
    tuner.py     `tune()`, which puts them together

The package's function `tune` is also `edgeinfer.tune` (the package itself is
`edgeinfer.tune` only for `from edgeinfer.tune import ...`).
"""

from __future__ import annotations

from .pareto import Row
from .plot import svg, text_plot
from .quality import QUALITY_CHUNKS
from .profile import ProfileStatus, TunedProfile, read_profile, tuned_status
from .space import KV_PAIRS, Setup, SpeculationMethod, register_method, untuned_setup
from .tuner import DEFAULT_BUDGET_S, DEFAULT_MAKE_TYPES, DEFAULT_MAX_KLD, TuneProgress, TuneResult, tune
from .workload import Workload, default_workload, load_workload

__all__ = [
    "tune",
    "TuneResult",
    "TuneProgress",
    "Row",
    "Setup",
    "SpeculationMethod",
    "register_method",
    "untuned_setup",
    "KV_PAIRS",
    "TunedProfile",
    "ProfileStatus",
    "read_profile",
    "tuned_status",
    "Workload",
    "default_workload",
    "load_workload",
    "svg",
    "text_plot",
    "DEFAULT_MAX_KLD",
    "DEFAULT_BUDGET_S",
    "DEFAULT_MAKE_TYPES",
    "QUALITY_CHUNKS",
]
