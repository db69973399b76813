"""The requests waiting at the coordinator (loop/queue.pyx)."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Any

from .._shared import (
    LATENCY_BUCKETS,
    N_PRIORITIES,
    OTHER_TENANTS,
    QUEUE_TENANTS,
    QueueOutcome,
    latency_bucket,
    tenant_stride,
)
from ..protocol import PRIORITY_MIN

#
# Requests that find no engine with room wait here, at the coordinator, until one has
# it (docs/queueing.md). Each waits in the *flow* of its (priority, tenant):
#
# * **Strict priority.** A lower priority is always dispatched first: nothing of
#   priority 5 leaves while anything of priority -1 waits. Nothing ages a waiting
#   request into a better priority, so a flood at a better priority starves the
#   worse ones: a request there leaves only once its deadline, when it has one, ends
#   its wait (TIMED_OUT), or its client gives up; the queue limit bounds what waits.
# * **Fair shares within a priority: virtual time, by requests.** Each flow has a
#   *pass*; the flow with the lowest pass is served next (the earlier set pass on a
#   tie), and each dispatch moves its pass on by its tenant's *stride*,
#   STRIDE_SCALE / weight (start-time fair queueing, or stride scheduling, with a
#   request as the unit). A flow that starts waiting starts at the priority's
#   virtual time, the pass of its last dispatch: a tenant gains no credit for the
#   time it had nothing waiting, and a newcomer, or an interactive tenant's lone
#   request, goes at the next dispatch. Requests, not tokens, because what the queue
#   hands out is an engine's room for one request (its capacity counts requests), held
#   for the request's whole life, whose length the coordinator cannot know (the
#   output's is unknown at dispatch).
# * **Within a flow, first come first served**, but for a request whose engine died
#   before it produced anything: it goes back at the head of its flow (``head``).
# * **Deadlines.** A request with one is also in a heap by deadline: ``expired`` ends
#   the due ones, O(log n) each.
#
# Every operation is O(log n) in the flows waiting (one heap of flows, ordered by
# priority, then pass, then the order the pass was set in) or in the requests with a
# deadline; keys are integers, so both twins order alike, bit for bit. The C twin's
# passes are uint64s compared by their difference (they wrap), this one's unbounded
# ints: the same order while passes stay within 2**63 of each other, which they do
# (every pass waiting is within one stride of the priority's virtual time).
#
# Tenants: a name (``tenant(name)``) is shared by every client naming it; ``tenant()``
# makes one of its own for a client that names none. A tenant is forgotten once no
# client refers to it and nothing of it waits, unless it was given a weight or holds
# one of the QUEUE_TENANTS labels its waits are kept under (the first named ones,
# those given a weight first); every other tenant's are kept as "other". Tenant 0
# takes the clients past the table (it cannot fill while each client holds one).
#
# Handles are the loop's request slots: ``handles`` of them, each waiting once at most.
# What a waiting request's frames are, this twin keeps as the caller's ``inbound``;
# the C twin keeps the messages (queue_keep, queue_inbound).

#: The stride of a tenant given no weight (weight 1).
DEFAULT_STRIDE = tenant_stride(1.0)
#: A lazy heap is rebuilt once it holds more than this many entries beyond twice the live.
_SLACK = 64


class _WaitTally:
    """One row of the stats: requests waiting now, and the waits by outcome."""

    __slots__ = ("depth", "buckets", "sums")

    def __init__(self) -> None:
        self.depth = 0
        self.buckets = [[0] * (len(LATENCY_BUCKETS) + 1) for _ in QueueOutcome]
        self.sums = [0.0] * len(QueueOutcome)

    def observe(self, outcome: int, seconds: float) -> None:
        self.buckets[outcome][latency_bucket(seconds)] += 1
        self.sums[outcome] += seconds

    def stats(self) -> dict[str, Any]:
        return {
            "depth": self.depth,
            "outcomes": {o.name.lower(): sum(self.buckets[o]) for o in QueueOutcome},
        }

    def metrics(self) -> dict[str, Any]:
        return {
            o.name.lower(): {"buckets": list(self.buckets[o]), "sum": self.sums[o]}
            for o in QueueOutcome
        }


class _Tenant:
    __slots__ = ("name", "stride", "refs", "depth", "label", "kept")

    def __init__(self, name: str | None, label: int):
        self.name = name
        self.stride = DEFAULT_STRIDE
        self.refs = 0  # the clients naming it
        self.depth = 0  # its requests waiting
        self.label = label  # its row of by_label (QUEUE_TENANTS: "other")
        self.kept = label < QUEUE_TENANTS  # given a weight, or labelled: never forgotten


class _Flow:
    """The requests of one tenant at one priority, oldest first."""

    __slots__ = ("priority", "tenant", "waiting", "pass_", "seq")

    def __init__(self, priority: int, tenant: int, pass_: int, seq: int):
        self.priority = priority
        self.tenant = tenant
        self.waiting: OrderedDict[int, None] = OrderedDict()  # handles, oldest first
        self.pass_ = pass_  # the virtual time its next dispatch starts at
        self.seq = seq  # when its pass was set: the earlier goes first on a tie


class _Waiting:
    __slots__ = ("flow", "since", "deadline", "order", "inbound")

    def __init__(self, flow: _Flow, since: float, deadline: float, order: int, inbound: Any):
        self.flow = flow
        self.since = since
        self.deadline = deadline
        self.order = order  # its arrival's number: deadlines tie by it
        self.inbound = inbound


class Queue:
    """The requests waiting at the coordinator (see the module's docstring)."""

    def __init__(
        self,
        limit: int,
        handles: int,
        tenants: int,
        weights: tuple[tuple[str, float], ...] = (),
    ):
        self.limit = limit
        self.handles = handles
        self.depth = 0
        self._capacity = tenants + 1  # tenant 0 takes the clients past the table
        self._waiting: dict[int, _Waiting] = {}
        self._flows: dict[tuple[int, int], _Flow] = {}
        self._heap: list[tuple[int, int, int, tuple[int, int]]] = []  # (priority, pass, seq, key)
        self._due: list[tuple[float, int, int]] = []  # (deadline, order, handle)
        self._vtime = [0] * N_PRIORITIES
        self._seq = 0
        self._arrivals = 0
        self._tenants: dict[int, _Tenant] = {0: _Tenant(None, QUEUE_TENANTS)}
        self._tenants[0].kept = True
        self._free: list[int] = []  # indices forgotten, reused last freed first
        self._used = 1  # indices ever used
        self._names: dict[str, int] = {}
        self._labels: list[str] = []
        self._by_priority = [_WaitTally() for _ in range(N_PRIORITIES)]
        self._by_label = [_WaitTally() for _ in range(QUEUE_TENANTS + 1)]
        for name, weight in weights:
            index = self.tenant(name)
            self._tenants[index].stride = tenant_stride(weight)
            self._tenants[index].kept = True

    # -- tenants -----------------------------------------------------------------------

    def tenant(self, name: str | None = None) -> int:
        """The tenant named ``name`` (found, or made), or a new one of its own for None;
        one more client refers to it (leave() when it goes)."""
        index = self._names.get(name, -1) if name is not None else -1
        if index < 0:
            index = self._new_tenant(name)
        self._tenants[index].refs += 1
        return index

    def _new_tenant(self, name: str | None) -> int:
        if self._free:
            index = self._free.pop()
        elif self._used < self._capacity:
            index = self._used
            self._used += 1
        else:
            return 0
        label = QUEUE_TENANTS
        if name is not None and len(self._labels) < QUEUE_TENANTS:
            label = len(self._labels)
            self._labels.append(name)
        self._tenants[index] = _Tenant(name, label)
        if name is not None:
            self._names[name] = index
        return index

    def leave(self, tenant: int) -> None:
        """A client that referred to ``tenant`` is gone."""
        self._tenants[tenant].refs -= 1
        self._forget_if_unused(tenant)

    def _forget_if_unused(self, index: int) -> None:
        tenant = self._tenants[index]
        if tenant.refs or tenant.depth or tenant.kept:
            return
        if tenant.name is not None:
            del self._names[tenant.name]
        del self._tenants[index]
        self._free.append(index)

    @property
    def tenants(self) -> int:
        """Tenants known now (not counting the one for the clients past the table)."""
        return len(self._tenants) - 1

    # -- requests ------------------------------------------------------------------------

    def holds(self, handle: int) -> bool:
        return handle in self._waiting

    def push(
        self,
        handle: int,
        tenant: int,
        priority: int,
        now: float,
        deadline: float = math.inf,
        head: bool = False,
        inbound: Any = None,
    ) -> bool:
        """``handle`` waits in its (priority, tenant) flow, last (first with ``head``: a
        request whose engine died before it produced anything), until ``deadline`` (a
        time.monotonic()); False when the queue is full: it is refused (counted so)."""
        level = priority - PRIORITY_MIN
        label = self._tenants[tenant].label
        if self.depth >= self.limit:
            self._by_priority[level].observe(QueueOutcome.REFUSED, 0.0)
            self._by_label[label].observe(QueueOutcome.REFUSED, 0.0)
            return False
        key = (priority, tenant)
        flow = self._flows.get(key)
        if flow is None:
            self._seq += 1
            flow = self._flows[key] = _Flow(priority, tenant, self._vtime[level], self._seq)
            self._push_flow(flow)
        flow.waiting[handle] = None
        if head:
            flow.waiting.move_to_end(handle, last=False)
        self._arrivals += 1
        self._waiting[handle] = _Waiting(flow, now, deadline, self._arrivals, inbound)
        if deadline < math.inf:
            heapq.heappush(self._due, (deadline, self._arrivals, handle))
        self._count(flow, 1)
        return True

    def peek(self) -> int:
        """The request dispatched next (-1: none waits): the oldest of the flow of the
        lowest priority, then the lowest pass."""
        flow = self._top()
        return -1 if flow is None else next(iter(flow.waiting))

    def pop(self, now: float) -> int:
        """Dispatch peek()'s request: it leaves the queue (its wait counted DISPATCHED)
        and its flow's pass moves on by its tenant's stride; -1 when none waits."""
        flow = self._top()
        if flow is None:
            return -1
        handle = next(iter(flow.waiting))
        self._vtime[flow.priority - PRIORITY_MIN] = flow.pass_
        self._take(handle, now, QueueOutcome.DISPATCHED)
        if flow.waiting:
            flow.pass_ += self._tenants[flow.tenant].stride
            self._seq += 1
            flow.seq = self._seq
            self._push_flow(flow)
        return handle

    def remove(self, handle: int, now: float, outcome: int) -> None:
        """A waiting request leaves without a dispatch (its wait counted as ``outcome``):
        aborted, its client gone, timed out, failed."""
        self._take(handle, now, outcome)

    def expired(self, now: float) -> int:
        """The waiting request whose deadline is the earliest, if it is past ``now``:
        taken out (TIMED_OUT); -1 when none is due."""
        due = self._due
        while due:
            deadline, order, handle = due[0]
            waiting = self._waiting.get(handle)
            if waiting is None or waiting.order != order:
                heapq.heappop(due)  # it left meanwhile
                continue
            if deadline > now:
                return -1
            heapq.heappop(due)
            self._take(handle, now, QueueOutcome.TIMED_OUT)
            return handle
        return -1

    def inbound(self, handle: int) -> Any:
        """What the request was pushed with (the C twin: queue_inbound)."""
        return self._waiting[handle].inbound

    # -- its steps -------------------------------------------------------------------------

    def _take(self, handle: int, now: float, outcome: int) -> None:
        waiting = self._waiting.pop(handle)
        flow = waiting.flow
        del flow.waiting[handle]
        if not flow.waiting:
            del self._flows[(flow.priority, flow.tenant)]  # its heap entry goes stale
        self._count(flow, -1)
        seconds = now - waiting.since
        self._by_priority[flow.priority - PRIORITY_MIN].observe(outcome, seconds)
        self._by_label[self._tenants[flow.tenant].label].observe(outcome, seconds)
        self._forget_if_unused(flow.tenant)
        self._compact()

    def _count(self, flow: _Flow, change: int) -> None:
        tenant = self._tenants[flow.tenant]
        self.depth += change
        tenant.depth += change
        self._by_priority[flow.priority - PRIORITY_MIN].depth += change
        self._by_label[tenant.label].depth += change

    def _push_flow(self, flow: _Flow) -> None:
        key = (flow.priority, flow.tenant)
        heapq.heappush(self._heap, (flow.priority, flow.pass_, flow.seq, key))

    def _top(self) -> _Flow | None:
        """The flow served next; the heap's stale entries (flows emptied, or whose pass
        moved on) are dropped on the way."""
        heap = self._heap
        while heap:
            _, pass_, seq, key = heap[0]
            flow = self._flows.get(key)
            if flow is not None and flow.seq == seq:
                return flow
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        """Rebuild a lazy heap that holds far more stale entries than live ones."""
        if len(self._heap) > 2 * len(self._flows) + _SLACK:
            self._heap = [
                (f.priority, f.pass_, f.seq, (f.priority, f.tenant)) for f in self._flows.values()
            ]
            heapq.heapify(self._heap)
        if len(self._due) > 2 * len(self._waiting) + _SLACK:
            self._due = [
                (w.deadline, w.order, h) for h, w in self._waiting.items() if w.deadline < math.inf
            ]
            heapq.heapify(self._due)

    # -- what stats() and metrics() give ---------------------------------------------------

    def _rows(self) -> tuple[dict[int, _WaitTally], dict[str, _WaitTally]]:
        """The rows with anything to say: priorities and labels waited in."""
        priorities = {
            level + PRIORITY_MIN: tally
            for level, tally in enumerate(self._by_priority)
            if tally.depth or any(any(b) for b in tally.buckets)
        }
        labels = dict(zip(self._labels, self._by_label, strict=False))
        other = self._by_label[QUEUE_TENANTS]
        if other.depth or any(any(b) for b in other.buckets):
            labels[OTHER_TENANTS] = other
        return priorities, labels

    def stats(self) -> dict[str, Any]:
        """Waiting now and ended so far, by priority and by tenant (its label)."""
        priorities, labels = self._rows()
        return {
            "depth": self.depth,
            "limit": self.limit,
            "tenants": self.tenants,
            "by_priority": {p: tally.stats() for p, tally in priorities.items()},
            "by_tenant": {name: tally.stats() for name, tally in labels.items()},
        }

    def metrics(self) -> dict[str, Any]:
        """The wait histograms (buckets of LATENCY_BUCKETS and one more), by outcome."""
        priorities, labels = self._rows()
        return {
            "by_priority": {p: tally.metrics() for p, tally in priorities.items()},
            "by_tenant": {name: tally.metrics() for name, tally in labels.items()},
        }
