"""The queue room, both twins: the C struct (``loop/queue.pyx``, compiled alone in a
test-only extension) and its Python twin, alone, without a loop around them.

Each test takes ``queue_type`` (``[c]``, ``[py]``): the order requests are dispatched
in across tenants, weights and priorities, head re-queues, deadlines, the limit, a
tenant's life and the stats' bounded labels. The differential test runs hypothesis'
traces (arrivals, dispatches, removals, expirations, tenants joining and leaving,
re-queues at the head) through both and compares every answer and the stats. The C
twin's held messages (what rebuilds a waiting request's Inbound) are C's alone.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit import Coordinator
from coordkit._loop_py.queue import Queue as PyQueue
from coordkit._shared import LATENCY_BUCKETS, QUEUE_TENANTS, QueueOutcome
from coordkit.metrics import scrape
from coordkit.protocol import PRIORITY_MAX, PRIORITY_MIN
from coordkit.tools.cli import queue_lines

DISPATCHED, TIMED_OUT = QueueOutcome.DISPATCHED, QueueOutcome.TIMED_OUT
REFUSED, ABANDONED = QueueOutcome.REFUSED, QueueOutcome.ABANDONED


def drain(queue, now: float = 1.0) -> list[int]:
    """Every request waiting, in the order it is dispatched (peek agreeing with pop)."""
    order = []
    while (handle := queue.peek()) >= 0:
        assert queue.pop(now) == handle
        order.append(handle)
    assert queue.pop(now) == -1 and queue.depth == 0
    return order


def flood(queue, tenant: int, handles: range, priority: int = 0) -> None:
    for handle in handles:
        assert queue.push(handle, tenant, priority, 0.0)


def test_first_come_first_served_within_a_tenant(queue_type):
    queue = queue_type(100, 100, 4)
    tenant = queue.tenant()
    flood(queue, tenant, range(10))
    assert queue.depth == 10 and all(queue.holds(h) for h in range(10))
    assert drain(queue) == list(range(10))
    assert not queue.holds(0)


def test_equal_tenants_take_turns(queue_type):
    """Two backlogged tenants of one priority share the dispatches one for one, the
    earlier to start waiting first on a tie."""
    queue = queue_type(100, 100, 4)
    a, b = queue.tenant("a"), queue.tenant()
    flood(queue, a, range(0, 6))
    flood(queue, b, range(10, 16))
    assert drain(queue) == [0, 10, 1, 11, 2, 12, 3, 13, 4, 14, 5, 15]


@pytest.mark.parametrize(("weights", "share"), [((3.0, 1.0), 0.75), ((1.0, 4.0), 0.2)])
def test_weights_share_the_dispatches(queue_type, weights, share):
    queue = queue_type(2000, 2000, 4, (("a", weights[0]), ("b", weights[1])))
    a, b = queue.tenant("a"), queue.tenant("b")
    flood(queue, a, range(0, 1000))
    flood(queue, b, range(1000, 2000))
    first = [queue.pop(1.0) for _ in range(800)]
    assert sum(h < 1000 for h in first) == pytest.approx(800 * share, abs=2)


def test_a_newcomer_goes_at_the_next_dispatch(queue_type):
    """A tenant that starts waiting starts at the virtual time of the last dispatch: an
    interactive request beside a flood waits for one dispatch at most, and the time
    the tenant had nothing waiting earns it no credit."""
    queue = queue_type(1000, 1000, 4)
    bulk, interactive = queue.tenant("bulk"), queue.tenant("interactive")
    flood(queue, bulk, range(100))
    for round_ in range(5):
        for _ in range(7):
            queue.pop(1.0)
        assert queue.push(500 + round_, interactive, 0, 1.0)
        assert queue.pop(1.0) == 500 + round_
    # two waiting at once take turns with the flood, not a burst of credit
    flood(queue, interactive, range(600, 603))
    assert [queue.pop(1.0) for _ in range(6)] == [600, 35, 601, 36, 602, 37]


def test_priorities_are_strict(queue_type):
    """Nothing of a worse priority leaves while anything of a better one waits, whatever
    the tenants' weights; within a priority, the tenants share."""
    queue = queue_type(100, 100, 4, (("bulk", 1000.0),))
    bulk, urgent, other = queue.tenant("bulk"), queue.tenant("urgent"), queue.tenant()
    flood(queue, bulk, range(0, 10), priority=5)
    flood(queue, urgent, range(10, 13), priority=-1)
    flood(queue, other, range(20, 22), priority=-1)
    assert queue.push(30, other, PRIORITY_MIN, 0.0)
    assert queue.push(31, bulk, PRIORITY_MAX, 0.0)
    assert drain(queue) == [30, 10, 20, 11, 21, 12, *range(10), 31]


def test_a_requeued_request_goes_first_in_its_tenant(queue_type):
    """At the head of its tenant's flow, not ahead of the other tenants' turns."""
    queue = queue_type(100, 100, 4)
    a, b = queue.tenant("a"), queue.tenant("b")
    flood(queue, a, range(0, 3))
    flood(queue, b, range(10, 13))
    assert queue.pop(1.0) == 0
    assert queue.push(99, a, 0, 1.0, head=True)
    assert queue.push(98, b, 3, 1.0, head=True)  # a flow of its own: the head of nothing
    assert drain(queue) == [10, 99, 11, 1, 12, 2, 98]


def test_deadlines_end_the_due_in_order(queue_type):
    queue = queue_type(100, 100, 4)
    tenant = queue.tenant()
    for handle, deadline in [(0, 5.0), (1, math.inf), (2, 3.0), (3, 5.0), (4, 9.0)]:
        assert queue.push(handle, tenant, 0, 0.0, deadline)
    assert queue.expired(2.9) == -1
    assert [queue.expired(5.0) for _ in range(4)] == [2, 0, 3, -1]
    queue.remove(4, 6.0, ABANDONED)  # out of the deadlines too
    assert queue.expired(100.0) == -1
    assert drain(queue) == [1]
    outcomes = queue.stats()["by_priority"][0]["outcomes"]
    assert outcomes == {"dispatched": 1, "timed_out": 3, "refused": 0, "abandoned": 1}
    waits = queue.metrics()["by_priority"][0]["timed_out"]
    assert waits["sum"] == pytest.approx(15.0)
    assert sum(waits["buckets"]) == 3 and len(waits["buckets"]) == len(LATENCY_BUCKETS) + 1


def test_the_limit_refuses_and_counts(queue_type):
    queue = queue_type(3, 100, 4)
    tenant = queue.tenant("t")
    flood(queue, tenant, range(3))
    assert not queue.push(3, tenant, 2, 0.0)
    assert not queue.holds(3) and queue.depth == 3
    queue.pop(1.0)
    assert queue.push(3, tenant, 2, 1.0)  # room again
    stats = queue.stats()
    assert stats["depth"] == 3 and stats["limit"] == 3
    assert stats["by_priority"][2] == {
        "depth": 1,
        "outcomes": {"dispatched": 0, "timed_out": 0, "refused": 1, "abandoned": 0},
    }
    nothing = queue_type(0, 10, 4)
    assert not nothing.push(0, nothing.tenant(), 0, 0.0)
    assert nothing.stats()["by_tenant"]["other"]["outcomes"]["refused"] == 1


def test_a_client_that_leaves_takes_its_tenant_along(queue_type):
    """A tenant is forgotten once no client refers to it and nothing of it waits (its
    index then reused); one given a weight, or holding a label, never is."""
    queue = queue_type(100, 100, 3, (("weighted", 2.0),))
    assert queue.tenants == 1  # "weighted" (the one for the clients past the table is not counted)
    mine = queue.tenant()
    flood(queue, mine, range(3))
    queue.leave(mine)
    assert queue.tenants == 2  # its requests still wait
    for handle in range(3):
        queue.remove(handle, 1.0, ABANDONED)
    assert queue.tenants == 1
    assert queue.tenant() == mine  # reused
    shared = queue.tenant("shared")
    assert queue.tenant("shared") == shared
    queue.leave(shared)
    queue.leave(shared)
    assert queue.tenants == 3  # labelled: kept
    assert queue.tenant() == 0  # the table is full: the tenant for the clients past it
    assert queue.stats()["by_tenant"]["other"]["outcomes"]["abandoned"] == 3


def test_labels_are_bounded(queue_type):
    """The first named tenants (those given a weight first) are stats' rows of their
    own; every other, and every tenant of its own, is "other"."""
    queue = queue_type(100, 100, 64, (("w", 1.0),))
    names = [f"t{i}" for i in range(QUEUE_TENANTS + 3)]
    for handle, name in enumerate(names):
        assert queue.push(handle, queue.tenant(name), 0, 0.0)
    assert queue.push(50, queue.tenant(), 0, 0.0)
    rows = queue.stats()["by_tenant"]
    assert list(rows) == ["w", *names[: QUEUE_TENANTS - 1], "other"]
    assert rows["other"]["depth"] == 5 and rows["w"]["depth"] == 0
    assert set(queue.metrics()["by_tenant"]) == set(rows)


def test_coordkit_stats_and_prometheus_show_them(queue_type, impl):
    """What a loop core's stats()["queue"] and metrics()["queue"] say, as `coordkit stats`
    and the Prometheus collector show it (the loop's own maps beside them)."""
    pytest.importorskip("prometheus_client")
    queue = queue_type(10, 10, 4, (("acme", 2.0),))
    acme, mine = queue.tenant("acme"), queue.tenant()
    assert queue.push(0, acme, -1, 0.0) and queue.push(1, mine, 0, 0.0, 0.5)
    assert queue.push(2, mine, 0, 0.0)
    queue.pop(0.2)
    assert queue.expired(1.0) == 1
    lines = queue_lines(queue.stats())
    assert lines[1] == "waiting 1 of 10, 2 tenants"
    assert lines[2].split() == ["waiting", "dispatched", "timed", "out", "refused", "abandoned"]
    assert [line.split() for line in lines[3:]] == [
        ["priority", "-1", "0", "1", "0", "0", "0"],
        ["priority", "0", "1", "0", "1", "0", "0"],
        ["tenant", "acme", "0", "1", "0", "0", "0"],
        ["tenant", "other", "1", "0", "1", "0", "0"],
    ]

    class WithQueue:  # a coordinator whose loop core reports a queue
        def __init__(self, coordinator):
            self.coordinator = coordinator

        def stats(self):
            return {**self.coordinator.stats(), "queue": queue.stats()}

        def metrics(self):
            return {**self.coordinator.metrics(), "queue": queue.metrics()}

    coordinator = Coordinator("tcp://127.0.0.1:0", implementation=impl.name)
    try:
        text = scrape(WithQueue(coordinator))
    finally:
        coordinator.stop()
    assert 'coordkit_queue_depth{priority="0"} 1.0' in text
    assert 'coordkit_queue_tenant_depth{tenant="other"} 1.0' in text
    assert 'coordkit_queue_wait_seconds_sum{outcome="dispatched",priority="-1"} 0.2' in text
    timed_out = 'le="+Inf",outcome="timed_out",tenant="other"} 1.0'
    assert f"coordkit_queue_tenant_wait_seconds_bucket{{{timed_out}" in text


# -- both twins, the same answers -----------------------------------------------------

HANDLES, NAMES = 24, ["a", "b", "c"]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("tenant"), st.sampled_from([*NAMES, None])),
        st.tuples(st.just("leave"), st.integers(0, 15)),
        st.tuples(
            st.just("push"),
            st.integers(0, HANDLES - 1),
            st.integers(0, 15),
            st.sampled_from([0, 0, 1, -3, PRIORITY_MIN, PRIORITY_MAX]),
            st.none() | st.floats(0.0, 5.0),
            st.booleans(),
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("pop")),
        st.tuples(st.just("peek")),
        st.tuples(st.just("remove"), st.integers(0, HANDLES - 1), st.sampled_from(QueueOutcome)),
        st.tuples(st.just("expired")),
        st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
    ),
    max_size=120,
)


def run_trace(queue, trace) -> list:
    """Apply a trace, with the loop's rules (a handle waits once; a tenant is left by
    the clients that took it): every answer, then the stats and the metrics."""
    now, answers = 0.0, []
    taken: list[int] = []  # a tenant per reference held
    for op, *args in trace:
        if op == "tenant":
            taken.append(queue.tenant(args[0]))
            answers.append(taken[-1])
        elif op == "leave" and taken:
            queue.leave(taken.pop(args[0] % len(taken)))
        elif op == "push" and taken:
            handle, which, priority, deadline, head = args
            if not queue.holds(handle):
                due = math.inf if deadline is None else now + deadline
                answers.append(
                    queue.push(handle, taken[which % len(taken)], priority, now, due, head)
                )
        elif op == "pop":
            answers.append(queue.pop(now))
        elif op == "peek":
            answers.append(queue.peek())
        elif op == "remove" and queue.holds(args[0]):
            queue.remove(args[0], now, args[1])
        elif op == "expired":
            while (handle := queue.expired(now)) >= 0:
                answers.append(("expired", handle))
        elif op == "tick":
            now += args[0]
        answers.append((queue.depth, queue.tenants))
    return [answers, queue.stats(), queue.metrics()]


@pytest.mark.c_extension
@settings(max_examples=400, deadline=None)
@given(trace=operations, limit=st.sampled_from([0, 3, 8, HANDLES]), weights=st.booleans())
def test_differential_dispatch_orders(c_queue, trace, limit, weights):
    weighed = (("a", 3.0), ("c", 0.25)) if weights else ()
    c = run_trace(c_queue.Room(limit, HANDLES, 6, weighed), trace)
    py = run_trace(PyQueue(limit, HANDLES, 6, weighed), trace)
    assert c == py


@pytest.mark.c_extension
def test_differential_long_floods(c_queue):
    """Thousands of dispatches among weighted tenants and priorities, with re-queues,
    in the same order in both."""
    queues = [
        c_queue.Room(5000, 5000, 8, (("x", 7.0), ("y", 0.5))),
        PyQueue(5000, 5000, 8, (("x", 7.0), ("y", 0.5))),
    ]
    orders = []
    for queue in queues:
        tenants = [queue.tenant(name) for name in ("x", "y", None, "z")]
        for handle in range(4000):
            tenant = tenants[handle * 7 % 4]
            assert queue.push(handle, tenant, handle % 3, 0.0, head=handle % 11 == 0)
        order = [queue.pop(1.0) for _ in range(2000)]
        for handle in order[:500]:
            assert queue.push(handle, tenants[handle % 4], handle % 2, 2.0, head=True)
        orders.append(order + drain(queue, 3.0))
    assert orders[0] == orders[1]
    assert Counter(orders[0]) == Counter(range(4000)) + Counter(orders[0][:500])


# -- C: what a waiting request holds ----------------------------------------------------


def multipart(c_queue, **kwargs):
    meta = b"\x93\x14\x07\x81\xa1t\x01"  # [20, 7, {"t": 1}]: the params from offset 3
    return c_queue.held_spans(
        meta, [b"\x92\x01\x02"], None, False, 0, 3, len(meta) - 3, 0, 0, False, **kwargs
    )


@pytest.mark.c_extension
@pytest.mark.parametrize("copied", [False, True], ids=["shared", "copied"])
def test_a_multipart_request_is_rebuilt_from_what_it_holds(c_queue, copied):
    """Its frames closed by the loop, what it holds rebuilds it, shared or copied."""
    spans = multipart(c_queue, copied=copied, rounds=2)
    assert spans == (b"\x92\x01\x02", b"\x81\xa1t\x01", None, None, False, [b"\x92\x01\x02"], True)


@pytest.mark.c_extension
def test_a_kv_submission_with_hashes_keeps_every_frame(c_queue):
    big = bytes(range(256)) * 64  # above COPY_BELOW: shared whatever
    hashes = bytes(range(16))
    meta = b"\x94\x18\x07\x80\x80"
    spans = c_queue.held_spans(
        meta, [big, b"src"], hashes, False, 0, 3, 2, 0, 0, False, copied=True
    )
    # a KV submission goes alone, never in a batch (a batch carries one payload frame)
    assert spans == (big, b"\x80\x80", None, hashes, True, [big, b"src"], False)


@pytest.mark.c_extension
@pytest.mark.parametrize("params", [True, False], ids=["read whole", "read to its rid"])
def test_a_single_frame_keeps_its_frame_and_its_computed_hashes(c_queue, params):
    frame = b"\x95\x14\x07\x92\x01\x02\x80\xc0"  # [20, 7, [1, 2], {}, nil]
    spans = c_queue.held_spans(
        frame, [], b"h" * 8, True, 3, 6 if params else 0, 1 if params else 0,
        7 if params else 0, 1 if params else 0, True,
    )  # fmt: skip
    prompt = b"\x92\x01\x02" if params else b"\x92\x01\x02\x80\xc0"
    if params:
        assert spans == (prompt, b"\x80", b"\xc0", b"h" * 8, False, [frame], False)
    else:
        assert spans == (prompt, None, None, b"h" * 8, False, [frame], False)
