"""A sequence's KV state as a file: its bytes checked without llama.cpp, and saving / restoring it."""

__all__: list[str] = []
