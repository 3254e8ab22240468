"""One error base class; subclasses are also the built-in exception whose meaning fits."""

from __future__ import annotations

__all__ = [
    "EdgeInferError",
    "ModelNotFoundError",
    "InvalidModelError",
    "ChatTemplateError",
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


class EdgeInferError(Exception):
    """Base of every error edgeinfer raises on purpose; its str() is a one-line message."""


class ModelNotFoundError(EdgeInferError, FileNotFoundError):
    """A model name or path that resolves to nothing."""


class InvalidModelError(EdgeInferError, ValueError):
    """A file that is not a well-formed GGUF (never handed to llama.cpp) or that llama.cpp refused."""


class ChatTemplateError(InvalidModelError):
    """A model's chat template that fails to render (an error, or past its time or size limit)."""


class InvalidOptionError(EdgeInferError, ValueError):
    """A sampling, load or command option outside its valid range."""


class GrammarError(InvalidOptionError):
    """A grammar (GBNF, a JSON schema's, a tool call's) that this model can never satisfy."""


class ContextLengthError(EdgeInferError, ValueError):
    """A context size the model cannot take, or a prompt that does not fit in the context."""


class StoreError(EdgeInferError, OSError):
    """The model store could not be read or written."""


class HubError(EdgeInferError):
    """The Hugging Face Hub (or a mirror) answered with an error."""


class OfflineError(HubError, ConnectionError):
    """The Hub could not be reached, or offline mode forbids it, and nothing usable is cached."""


class AuthenticationError(HubError, PermissionError):
    """A gated or private repository and no (or a wrong) token."""


class IntegrityError(EdgeInferError, ValueError):
    """Downloaded or stored bytes whose hash is not the expected one."""


class DiskSpaceError(EdgeInferError, OSError):
    """Not enough free disk space for what is about to be written."""


class ConversionError(EdgeInferError, ValueError):
    """A Hugging Face model folder that cannot be converted to GGUF."""


class QuantizationError(EdgeInferError, RuntimeError):
    """llama.cpp's quantizer failed or was asked for something it cannot do."""


class SpeculationError(EdgeInferError, ValueError):
    """Speculative decoding cannot be used with this model or these options."""


class IncompatibleDraftError(SpeculationError):
    """A draft model whose vocabulary does not match the target's."""


class NoSetupError(InvalidOptionError):
    """`tune` found no setup within the quality bound and the memory budget (the message says the
    closest one, and what to change)."""


class EngineClosedError(EdgeInferError, RuntimeError):
    """A call on an engine (or a generation of it) after `Engine.close()`."""


class EngineBusyError(EdgeInferError, RuntimeError):
    """A request from the thread whose own earlier request is still unfinished (it would wait for
    itself for ever): finish, cancel or close the earlier generation first."""


class Cancelled(EdgeInferError):
    """A long operation (conversion, quantization, pull) was cancelled by the caller."""
