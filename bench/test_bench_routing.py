"""Microbenchmarks of one routing decision (choose, then release), C against Python.

Every request carries 32 block hashes, as a client's would; the prefix router
starts from a warmed table in which the request's first 24 blocks are shared
with earlier requests, and with work queued on every rank. A decision is
``choose`` then ``release`` of what it charged. Run with
``python -m pytest bench/ --benchmark-enable -q``.
"""

from __future__ import annotations

import random
import struct

import pytest

N_HASHES = 32
SHARED = 24  # leading blocks of a request that earlier requests also had


def hash_frame(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def warmed_router(impl, policy: str, n_ranks: int):
    """A router over ``n_ranks`` with a realistic mix of load and table entries."""
    rng = random.Random(0)
    router = impl.Router(policy, seed=1)
    for rank in range(n_ranks):
        router.add_rank(rank)
    prefixes = [[rng.getrandbits(64) for _ in range(SHARED)] for _ in range(64)]
    outstanding = []
    for _ in range(4 * n_ranks):
        tail = [rng.getrandbits(64) for _ in range(N_HASHES - SHARED)]
        rank = router.choose(hash_frame(rng.choice(prefixes) + tail), 0.0)
        outstanding.append((rank, router.charged))
        if rng.random() < 0.5:
            router.release(*outstanding.pop(rng.randrange(len(outstanding))))
    tail = [rng.getrandbits(64) for _ in range(N_HASHES - SHARED)]
    return router, hash_frame(prefixes[0] + tail)


@pytest.mark.parametrize("n_ranks", [2, 64, 1000, 4096])
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "prefix"])
def test_route(benchmark, impl, policy, n_ranks):
    router, frame = warmed_router(impl, policy, n_ranks)
    choose, release = router.choose, router.release

    def decide():
        release(choose(frame, 1.0), router.charged)

    benchmark.group = f"{policy} {n_ranks} ranks"
    # Fixed iterations per round: left to calibrate, pytest-benchmark may time
    # single sub-microsecond calls, i.e. mostly the timer.
    iterations = 1000 if impl.name == "c" else 10
    benchmark.pedantic(decide, rounds=100, iterations=iterations, warmup_rounds=5)
