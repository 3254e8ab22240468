"""The engine: a loaded GGUF model and the requests run on it.

One scheduler core serves two faces. `core/` is the core itself: the scheduler that admits requests
into slots, reads prompts and drafts in one `llama_decode` a step, the request that verifies and
commits tokens, the sequence a slot's KV cache is, the sampler, the options and the events. `faces/`
holds what callers hold: `Engine` (one slot, stepped inline by its reader) and `BatchEngine` (N
slots, stepped by a thread), what both check before a request reaches the core (`common.py`) and the
handles their requests return. `llama/` is the only place that touches llama-cpp-python's ctypes
bindings: the one way a context is made (context.py: its parameters, the context and its batch),
the runtime (model, context, decode), the drafting-head bindings and the flash-attention choice.
`speculation/` is the policy (what a draft of k tokens costs and earns) and the drafters it steers: prompt lookup, a draft model, heads (the draft models and heads one engine
found, made and opened are `faces/speculation_setup.py`). `structured/` compiles grammars and JSON
schemas to constrained sampling; `chat/` renders chat templates in a sandbox and parses the model's
tool calls; `state/` is the KV-state file (its bytes, checked without llama.cpp, and
saving/restoring a sequence). `embedding.py` is the embedding context of a model.

    faces/       engine.py (Engine, load), batch.py (BatchEngine), common.py, speculation_setup.py, handles
    core/        scheduler.py, drafting.py, request.py, sequence.py, sampler.py, options.py, events.py, text.py
    llama/       context.py, runtime.py, heads_api.py, flash_choice.py
    speculation/ policy.py, lookup.py, draft_model.py, heads.py, calibration.py, request_speculation.py
    structured/  grammar.py, json_schema.py
    chat/        template.py, sandbox.py, tools.py, tool_parser.py, json_scan.py
    state/       file_format.py, session.py
"""

from __future__ import annotations

from .faces.engine import Engine, load
from .faces.generation import Generation

__all__ = ["Engine", "Generation", "load"]
