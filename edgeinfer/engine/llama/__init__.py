"""The one layer over llama-cpp-python's ctypes bindings: runtime, drafting-head bindings, flash-attention choice."""

__all__: list[str] = []
