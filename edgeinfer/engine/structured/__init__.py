"""Structured output: GBNF grammars and JSON schemas compiled to them, enforced while sampling."""

__all__: list[str] = []
