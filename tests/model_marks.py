"""A test that uses a model-loading fixture is `slow`, whether or not it says so.

`slow` means "uses a real model or takes more than a few seconds" (pyproject.toml): the quick loop
(-m "not slow") never loads a model through llama.cpp or waits for the run's requantized copies to
be made. A plugin of its own because tests/conftest.py takes file_order's collection hook.
"""

from __future__ import annotations

import pytest

__all__ = ["MODEL_FIXTURES", "pytest_collection_modifyitems"]

MODEL_FIXTURES = frozenset({"default_model_copy", "default_engine", "qwen_pair", "qwen_engine", "qwen_server"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
