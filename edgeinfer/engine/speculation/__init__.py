"""Speculative decoding: a pure policy and the drafters it steers.

A drafter proposes tokens; the decode loop (engine/generation.py) verifies them in one
`llama_decode` and keeps those the target itself samples, so output never changes — only speed.

    policy.py       cost model, acceptance model, draft-length policy (pure Python)
    lookup.py       prompt lookup: n-gram index and its drafter (pure Python)
    draft_model.py  a second model drafting in its own context; vocabulary compatibility
    calibration.py  the target's measured decode cost by batch size
    drafter.py      SpeculationContext (what drafters get from the engine) and a request's drafter

Nothing here reads the engine's state or makes models: the engine passes a SpeculationContext
(target runtime, cost model, a draft-runtime factory) and prepares draft models itself.
"""

from __future__ import annotations

from .calibration import calibrate_costs, fit_costs, measure_costs
from .draft_model import ModelDrafter, check_draft_compatible, relative_draft_cost
from .drafter import AutoDrafter, RequestDrafter, SpeculationContext, make_drafter
from .lookup import LookupDrafter, NgramIndex
from .policy import AcceptanceModel, CostModel, LengthPolicy, break_even_draft_cost

__all__ = [
    "CostModel",
    "AcceptanceModel",
    "LengthPolicy",
    "NgramIndex",
    "LookupDrafter",
    "ModelDrafter",
    "AutoDrafter",
    "RequestDrafter",
    "SpeculationContext",
    "make_drafter",
    "check_draft_compatible",
    "relative_draft_cost",
    "calibrate_costs",
    "measure_costs",
    "fit_costs",
    "break_even_draft_cost",
]
