"""The traffic counters (loop/traffic.pyx)."""

from __future__ import annotations

from .._shared import HEADER_SLOTS, header_slot

RECEIVED, SENT = 0, 1


class Traffic:
    """Messages and bytes by direction and header slot (the last: unreadable)."""

    __slots__ = ("messages", "bytes")

    def __init__(self) -> None:
        self.messages = [[0] * HEADER_SLOTS for _ in range(2)]
        self.bytes = [[0] * HEADER_SLOTS for _ in range(2)]

    def count(self, direction: int, header: int, size: int) -> None:
        """A message of ``size`` bytes (after the routing id), RECEIVED or SENT."""
        slot = header_slot(header)
        self.messages[direction][slot] += 1
        self.bytes[direction][slot] += size

    def metrics(self) -> list[tuple[int, int, int, int]]:
        """(direction, header slot, messages, bytes) for every slot, as metrics() gives it."""
        return [
            (direction, slot, self.messages[direction][slot], self.bytes[direction][slot])
            for direction in range(2)
            for slot in range(HEADER_SLOTS)
        ]
