"""What callers hold: Engine (one slot, stepped inline), BatchEngine (N slots, a scheduler thread), and the handles their requests return."""

__all__: list[str] = []
