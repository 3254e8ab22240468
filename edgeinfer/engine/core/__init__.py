"""The scheduler core both faces step: slots, requests, sequences, sampling, options and events."""

__all__: list[str] = []
