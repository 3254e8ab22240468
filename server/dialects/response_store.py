"""Stored Responses conversations, for `previous_response_id`: in memory, bounded, per API key.

Each stored response keeps the whole conversation it ended (input and output as chat messages),
so a follow-up needs one lookup. At most `max_entries` responses and `max_bytes` of their JSON are
kept; the oldest go first. A lookup must present the same owner (a digest of the API key the
request carried) as the request that stored it: one key never reads another's conversations.
Used from the event loop only (no lock).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

__all__ = ["ResponseStore", "MAX_STORED", "MAX_STORED_BYTES"]

MAX_STORED = 1024
MAX_STORED_BYTES = 64 << 20  # 64 MiB of conversation JSON


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[str, list[dict[str, Any]], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str, messages: list[dict[str, Any]]) -> bool:
        """Keep a conversation; False when it alone is larger than the store may hold."""
        size = len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_bytes:
            return False
        self._entries[response_id] = (owner, messages, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
        return True

    def get(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """A copy of the conversation, or None (unknown, evicted, or another key's)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != owner:
            return None
        return [dict(m) for m in entry[1]]
