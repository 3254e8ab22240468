"""edgeinfer: a local/edge LLM runtime on llama.cpp.

    import edgeinfer
    with edgeinfer.load() as engine:                      # the default model
        for event in engine.chat([{"role": "user", "content": "Hi"}]):
            if isinstance(event, edgeinfer.TokenEvent):
                print(event.text, end="", flush=True)

This package never imports textual or rich; front ends render its events.
"""

from __future__ import annotations

from .engine import Engine, Generation, load
from .engine.faces.batch import BatchEngine, BatchGeneration, BatchMetrics, BatchOptions, ScoredTokenEvent, SlotMetrics
from .engine.embedding import EmbeddingResult, EmbedOptions
from .engine.llama.flash_choice import FlashAttnChoice
from .engine.core.events import (
    DoneEvent,
    Event,
    GenerationStats,
    PrefillProgress,
    SpeculationProgress,
    SpeculationStats,
    TokenEvent,
    ToolCall,
    ToolCallEvent,
)
from .engine.structured.grammar import Grammar
from .engine.structured.json_schema import json_schema_to_grammar
from .engine.state.session import RestoreResult, SessionInfo
from .engine.core.options import (
    DEFAULT_GENERATE,
    DEFAULT_LOAD,
    DEFAULT_SAMPLING,
    DEFAULT_SPECULATION,
    GenerateOptions,
    LoadOptions,
    SamplingOptions,
    SpeculationOptions,
)
from .default_model import DEFAULT_SYSTEM_PROMPT, RECOMMENDED_MODEL, default_system_prompt
from .errors import (
    AuthenticationError,
    Cancelled,
    ContextLengthError,
    ConversionError,
    DiskSpaceError,
    EdgeInferError,
    EngineBusyError,
    EngineClosedError,
    GrammarError,
    HubError,
    IncompatibleDraftError,
    IntegrityError,
    NoSetupError,
    InvalidModelError,
    InvalidOptionError,
    ModelNotFoundError,
    OfflineError,
    QuantizationError,
    SpeculationError,
    StoreError,
)
from .gguf_file import GGUFInfo, TensorInfo, read_gguf
from .kv_types import KV_CACHE_TYPES, KV_TYPE_NAMES, KVCacheType
from .hub import DiskUsage, DiskUsageRow, DownloadProgress, disk_usage, purge_cache
from .gguf_import import ImportProgress, ImportResult, import_gguf
from .pull import PullEvent, PullPlan, PullResult, PullStage, plan, pull, pull_source
from .store import DEFAULT_MODEL, ModelManifest, Store
# the package edgeinfer/tune/; its function is edgeinfer.tune (bound after the package is imported)
from .tune import DEFAULT_MAX_KLD, TunedProfile, TuneProgress, TuneResult, tune, tuned_status
from .service import (
    Lease,
    ModelNotLoadedError,
    ModelService,
    ModelSettings,
    ModelStatus,
    ModelTooLargeError,
    NoRoomError,
    ServiceOptions,
)

__version__ = "0.1.0"

__all__ = [
    # running models
    "load",
    "Engine",
    "Generation",
    # parallel requests (servers)
    "BatchEngine",
    "BatchOptions",
    "BatchGeneration",  # the same class as Generation
    "BatchMetrics",
    "SlotMetrics",
    "ScoredTokenEvent",
    "LoadOptions",
    "GenerateOptions",
    "SamplingOptions",
    "Grammar",
    "json_schema_to_grammar",
    "SpeculationOptions",
    "DEFAULT_LOAD",
    "DEFAULT_SAMPLING",
    "DEFAULT_SPECULATION",
    "DEFAULT_GENERATE",
    "KV_TYPE_NAMES",
    "KV_CACHE_TYPES",
    "KVCacheType",
    "Event",
    "TokenEvent",
    "ToolCallEvent",
    "ToolCall",
    "DoneEvent",
    "GenerationStats",
    "SpeculationStats",
    "SpeculationProgress",
    "PrefillProgress",
    # a slot's saved KV state (save_slot / restore_slot / erase_slot, on both faces)
    "SessionInfo",
    "FlashAttnChoice",
    "RestoreResult",
    # many models by name (servers): loaded on demand, kept warm, evicted by memory
    "ModelService",
    "ServiceOptions",
    "ModelSettings",
    "ModelStatus",
    "Lease",
    "NoRoomError",
    "ModelTooLargeError",
    "ModelNotLoadedError",
    # embeddings (engine.embed)
    "EmbedOptions",
    "EmbeddingResult",
    # the store and files
    "Store",
    "ModelManifest",
    "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT",
    "default_system_prompt",
    "RECOMMENDED_MODEL",
    "read_gguf",
    "GGUFInfo",
    "TensorInfo",
    # pulling from the Hugging Face Hub
    "pull",
    "plan",
    "pull_source",
    "PullPlan",
    "PullResult",
    "PullStage",
    "PullEvent",
    "DownloadProgress",
    # a GGUF file the user has, into the store
    "import_gguf",
    "ImportResult",
    "ImportProgress",
    "disk_usage",
    "purge_cache",
    "DiskUsage",
    "DiskUsageRow",
    # the fastest setup for this machine, model and work (edgeinfer tune)
    "tune",
    "TuneResult",
    "TuneProgress",
    "TunedProfile",
    "tuned_status",
    "DEFAULT_MAX_KLD",
    # errors
    "EdgeInferError",
    "ModelNotFoundError",
    "InvalidModelError",
    "InvalidOptionError",
    "GrammarError",
    "ContextLengthError",
    "StoreError",
    "HubError",
    "OfflineError",
    "AuthenticationError",
    "IntegrityError",
    "DiskSpaceError",
    "ConversionError",
    "QuantizationError",
    "SpeculationError",
    "IncompatibleDraftError",
    "NoSetupError",
    "EngineClosedError",
    "EngineBusyError",
    "Cancelled",
]
