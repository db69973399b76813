"""Microbenchmarks of the queue room: one request through it (push, then the dispatch
of the request at the front), C against Python, with requests of many tenants waiting.

The backlog (``waiting`` requests over ``tenants`` tenants of three priorities, some
with a deadline) stays the same size: each round pushes one and dispatches one, so
what is timed is a queued request's cost at that depth, O(log n) in the flows waiting
and the deadlines. The C queue is driven through its test wrapper (a Python call per
operation, as the routers' microbenchmarks are). Run with
``python -m pytest bench/ --benchmark-enable -q``.
"""

from __future__ import annotations

import math

import pytest


@pytest.mark.parametrize("tenants", [1, 100, 10_000])
@pytest.mark.parametrize("waiting", [100, 10_000])
def test_queued_request(benchmark, queue_type, impl, waiting, tenants):
    queue = queue_type(waiting + 1, waiting + 1, tenants, (("t0", 3.0),))
    ids = [queue.tenant(f"t{i}") for i in range(tenants)]
    for handle in range(waiting):
        deadline = 1e9 if handle % 4 == 0 else math.inf
        assert queue.push(handle, ids[handle % tenants], handle % 3, 0.0, deadline)
    push, pop = queue.push, queue.pop
    turn = [0]

    def through():
        handle = pop(1.0)
        turn[0] += 1
        push(
            handle, ids[turn[0] % tenants], turn[0] % 3, 1.0, 1e9 if turn[0] % 4 == 0 else math.inf
        )

    benchmark.group = f"queue: {waiting} waiting, {tenants} tenants"
    iterations = 1000 if impl.name == "c" else 100
    benchmark.pedantic(through, rounds=50, iterations=iterations, warmup_rounds=2)
