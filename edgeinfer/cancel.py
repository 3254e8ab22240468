"""One cancel protocol for every long operation (pull, convert, quantize, evaluate, preparing
speculation): the caller passes a `threading.Event` (or anything with `is_set()`) or a callable that
returns True once the work should stop; the operation polls it between units of work and raises
`Cancelled`, keeping what a later run can reuse.

A bottom module: it imports nothing from the package but the errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias

from .errors import Cancelled

__all__ = ["CancelLike", "CancelToken", "is_cancelled", "raise_if_cancelled"]


class CancelLike(Protocol):
    def is_set(self) -> bool: ...


CancelToken: TypeAlias = CancelLike | Callable[[], bool] | None


def is_cancelled(cancel: CancelToken) -> bool:
    """True once `cancel` (an Event-like object, a callable or None) asks the work to stop."""
    if cancel is None:
        return False
    is_set = getattr(cancel, "is_set", None)
    if callable(is_set):
        return bool(is_set())
    return bool(cancel())  # type: ignore[operator]


def raise_if_cancelled(cancel: CancelToken, what: str) -> None:
    """Raise `Cancelled(what)` once `cancel` is set."""
    if is_cancelled(cancel):
        raise Cancelled(what)
