"""The GGUF metadata of an embedding model: llama.cpp's own pooling key and the few keys edgeinfer
adds for what llama.cpp has no key for. Written by the converter (`edgeinfer.convert.embedding`),
read by the engine (`edgeinfer.engine.embedding`). A bottom module: it imports nothing.
"""

from __future__ import annotations

__all__ = [
    "POOLING_CODES",
    "POOLING_NAMES",
    "POOLING_TYPES",
    "pooling_key",
    "NORMALIZE_KEY",
    "PROMPTS_KEY",
    "DEFAULT_PROMPT_KEY",
    "MIN_DIMENSIONS_KEY",
]

# llama_pooling_type (llama.h), by the names the API and the CLI use.
POOLING_CODES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
POOLING_NAMES: dict[int, str] = {v: k for k, v in POOLING_CODES.items()}
POOLING_TYPES: tuple[str, ...] = ("mean", "cls", "last")  # the ones that make one vector per text


def pooling_key(arch: str) -> str:
    """llama.cpp's `<arch>.pooling_type` (uint32, a llama_pooling_type)."""
    return f"{arch}.pooling_type"


NORMALIZE_KEY = "edgeinfer.embedding.normalize"  # bool: the model's card normalizes its vectors (L2)
PROMPTS_KEY = "edgeinfer.embedding.prompts"  # string: a JSON object, prompt name -> prefix
DEFAULT_PROMPT_KEY = "edgeinfer.embedding.default_prompt_name"  # string: the prompt used when none is named
MIN_DIMENSIONS_KEY = "edgeinfer.embedding.min_dimensions"  # uint32: Matryoshka-trained down to this size
