"""Speculative decoding: a pure policy and the drafters it steers.

A drafter proposes tokens; the scheduler core (engine/core/scheduler.py) sizes every request's draft of
a step together, verifies them in one `llama_decode` and keeps those the target itself samples
(engine/core/request.py), so output never changes — only speed.

    policy.py       cost model, acceptance model, length policy, the batch's draft plan (pure Python)
    lookup.py       prompt lookup: the n-gram index (pure Python)
    draft_model.py  a second model drafting in its own context, one sequence per slot
    heads.py        drafting heads that read the target's hidden states (MTP layer, EAGLE-3)
    head_models.py  opening a head for a target, after the checks llama.cpp would abort on
    calibration.py  the target's decode cost by batch size, measured one way (bench, idle servers)
    request_speculation.py  one request's speculation: its proposals and what it learns
"""

from __future__ import annotations

from .calibration import CurveMeasurement, fit_costs, measure_costs
from .draft_model import DraftContext, ModelDrafter, check_draft_compatible, relative_draft_cost
from .request_speculation import Proposal, RequestSpeculation
from .heads import Eagle3Head, HeadContext, HeadDrafter, MtpHead
from .lookup import LookupMatch, NgramIndex
from .policy import AcceptanceModel, CostModel, LengthPolicy, break_even_draft_cost, plan_drafts

__all__ = [
    "CostModel",
    "AcceptanceModel",
    "LengthPolicy",
    "plan_drafts",
    "NgramIndex",
    "LookupMatch",
    "DraftContext",
    "ModelDrafter",
    "HeadContext",
    "MtpHead",
    "Eagle3Head",
    "HeadDrafter",
    "Proposal",
    "RequestSpeculation",
    "check_draft_compatible",
    "relative_draft_cost",
    "CurveMeasurement",
    "measure_costs",
    "fit_costs",
    "break_even_draft_cost",
]
