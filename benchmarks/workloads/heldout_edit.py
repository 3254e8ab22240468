"""Booking rules for a small climbing gym: sessions, members, waiting lists and daily summaries."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, time


@dataclass
class Member:
    member_id: int
    name: str
    email: str
    plan: str = "basic"
    banned: bool = False


@dataclass
class Session:
    session_id: int
    day: date
    start: time
    capacity: int
    booked: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)


def free_places(session: Session) -> int:
    return max(0, session.capacity - len(session.booked))


def can_book(member: Member, session: Session) -> bool:
    if member.banned or member.member_id in session.booked:
        return False
    return free_places(session) > 0 or member.plan == "premium"


def book(member: Member, session: Session) -> str:
    if not can_book(member, session):
        if member.member_id not in session.waiting and not member.banned:
            session.waiting.append(member.member_id)
            return "waiting"
        return "refused"
    session.booked.append(member.member_id)
    return "booked"


def cancel(member_id: int, session: Session) -> bool:
    if member_id not in session.booked:
        return False
    session.booked.remove(member_id)
    if session.waiting and free_places(session) > 0:
        session.booked.append(session.waiting.pop(0))
    return True


def daily_summary(sessions: list[Session]) -> dict[date, dict[str, int]]:
    summary: dict[date, dict[str, int]] = defaultdict(lambda: {"sessions": 0, "booked": 0, "waiting": 0})
    for session in sessions:
        day = summary[session.day]
        day["sessions"] += 1
        day["booked"] += len(session.booked)
        day["waiting"] += len(session.waiting)
    return dict(summary)


def busiest_session(sessions: list[Session]) -> Session | None:
    if not sessions:
        return None
    return max(sessions, key=lambda s: len(s.booked) / s.capacity)
