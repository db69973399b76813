"""The roles of the identities retired (loop/roles.pyx)."""

from __future__ import annotations

from collections import OrderedDict

from .._shared import PeerRole


def made_up(identity: bytes) -> bool:
    """A routing id libzmq made up for a peer that named none: 5 bytes, a zero first.
    Each is one connection's and never handed out again."""
    return len(identity) == 5 and identity[0] == 0


class Roles:
    """The routing ids that left the tables, with the PeerRole each had, so that one
    identity keeps one role for the coordinator's life: a client forgotten (gone, or
    evicted from a full table) is never taken for an engine's registration, nor an
    engine's id, once its rank is reused, for a client. Bounded: past ``capacity`` the
    oldest is forgotten. Ids libzmq made up are not kept (see made_up)."""

    __slots__ = ("capacity", "_roles")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._roles: OrderedDict[bytes, int] = OrderedDict()

    def remember(self, identity: bytes, role: int) -> None:
        if made_up(identity):
            return
        self._roles[identity] = role
        self._roles.move_to_end(identity)
        if len(self._roles) > self.capacity:
            self._roles.popitem(last=False)

    def of(self, identity: bytes) -> int:
        """The role ``identity`` had (PeerRole.NONE: none remembered)."""
        return self._roles.get(identity, PeerRole.NONE)
