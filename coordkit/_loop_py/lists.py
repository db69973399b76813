"""The request_timeout queue (loop/lists.pyx)."""

from __future__ import annotations

from collections import OrderedDict

from .tables import _Request


class Deadlines:
    """The requests in submission order, so in deadline order (every request has the
    same timeout): the timer ends the due ones from the head and touches nothing else."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: OrderedDict[int, _Request] = OrderedDict()

    @property
    def oldest(self) -> _Request | None:
        return next(iter(self._requests.values()), None)

    def push(self, request: _Request) -> None:
        """A new request, the newest."""
        self._requests[request.server_rid] = request

    def remove(self, request: _Request) -> None:
        del self._requests[request.server_rid]
