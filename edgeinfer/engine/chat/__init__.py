"""Chat prompts: templates rendered in a sandbox, tools offered to the model, and its tool calls parsed."""

__all__: list[str] = []
