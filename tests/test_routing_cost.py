"""The prefix policy's cost in work, on workloads: a hot prefix, mixed traffic, and the loop.

The hot-prefix workload is the one that made a prefix router pile a shared
system prompt onto one engine: 4 engines that hold every request, 2 000
submissions of 36 blocks, 70% of them sharing one 32-block prefix.
"""

from __future__ import annotations

import random
import struct

import pytest

from coordkit._policies import DEFAULT_PREFILL_WEIGHT
from tests.support.peers import DISCONNECT, REPLY, SUBMIT, m, um, wait_for

RANKS = 4
REQUESTS = 2000
SHARED, OWN = 32, 4  # blocks of the hot prefix, and of each request's own tail
BLOCK = 16  # tokens, the router's default block_size


def frame(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def hot_workload(seed: int = 0) -> list[tuple[bool, list[int]]]:
    """(hot, block hashes) of each request: 70% the shared prefix and 4 blocks of their own."""
    rng = random.Random(seed)
    prefix = [rng.getrandbits(64) for _ in range(SHARED)]
    requests = []
    for _ in range(REQUESTS):
        if rng.random() < 0.7:
            requests.append((True, prefix + [rng.getrandbits(64) for _ in range(OWN)]))
        else:
            requests.append((False, [rng.getrandbits(64) for _ in range(SHARED + OWN)]))
    return requests


def max_over_mean(counts: list[int]) -> float:
    return max(counts) / (sum(counts) / len(counts))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hot_prefix_spreads_only_when_its_ranks_are_loaded(impl, seed):
    router = impl.Router("prefix")  # the defaults
    for rank in range(RANKS):
        router.add_rank(rank)
    requests = hot_workload(seed)
    prefix_hash = requests[next(i for i, (hot, _) in enumerate(requests) if hot)][1][SHARED - 1]
    counts = [0] * RANKS
    for hot, hashes in requests:
        holders = router.prefix_ranks(prefix_hash, 0.0)  # the ranks that have the whole prefix
        work = [router.work(r) for r in range(RANKS)]
        rank = router.choose(frame(hashes), 0.0, (SHARED + OWN) * BLOCK)
        counts[rank] += 1
        if hot and holders and rank not in holders:
            # It left the ranks with its prefix only because each of them had more work
            # queued than the prefill it would have saved there (SHARED blocks, weighted).
            saved = DEFAULT_PREFILL_WEIGHT * SHARED
            assert all(work[h] - work[rank] >= saved for h in holders), (work, holders, rank)
    assert sum(counts) == REQUESTS
    assert max_over_mean(counts) <= 1.3, counts


def test_hot_prefix_stays_on_one_rank_while_requests_finish(impl):
    router = impl.Router("prefix")
    for rank in range(RANKS):
        router.add_rank(rank)
    ranks = set()
    for hot, hashes in hot_workload():
        if hot:
            ranks.add(rank := router.choose(frame(hashes), 0.0))
            router.release(rank, router.charged)
    assert len(ranks) == 1


def test_mixed_traffic_balances_work(impl):
    # Prompts with and without hashes, of every size, none released: the work queued on
    # each rank ends up even (least_loaded would even out the request counts instead).
    router = impl.Router("prefix")
    for rank in range(RANKS):
        router.add_rank(rank)
    rng = random.Random(5)
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randint(4, 64))] for _ in range(10)]
    held = []
    for _ in range(REQUESTS):
        x = rng.random()
        if x < 0.5:
            hashes = rng.choice(prefixes) + [rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
            rank = router.choose(frame(hashes), 0.0, len(hashes) * BLOCK)
        else:
            rank = router.choose(None, 0.0, rng.randint(1, 4000))
        held.append((rank, router.charged))
    work = [router.work(r) for r in range(RANKS)]
    assert work == [sum(w for r, w in held if r == rank) for rank in range(RANKS)]
    assert max_over_mean(work) <= 1.1, work
    for rank, charged in held:
        router.release(rank, charged)
    assert [router.work(r) for r in range(RANKS)] == [0] * RANKS
    assert [router.pending(r) for r in range(RANKS)] == [0] * RANKS


# -- through a coordinator ----------------------------------------------------------------


def test_hot_prefix_through_a_coordinator(impl, make_cluster):
    """The same workload through the loop: engines that never reply, the prompts' sizes
    read from their frames. The placement is the router's own, decision for decision."""
    requests = hot_workload()
    prompt = m([7] * (SHARED + OWN) * BLOCK)
    router = impl.Router("prefix", max_ranks=1024)
    for rank in range(RANKS):
        router.add_rank(rank)
    expected = [0] * RANKS
    for _, hashes in requests:
        expected[router.choose(frame(hashes), 0.0, (SHARED + OWN) * BLOCK)] += 1
    with make_cluster(n_engines=RANKS, policy="prefix") as c:
        client = c.client()
        for rid, (_, hashes) in enumerate(requests):
            client.send(m([SUBMIT, rid, {}]), prompt, frame(hashes))
        wait_for(lambda: c.coord.stats()["inflight"] == REQUESTS, timeout=30.0)
        counts = [engine["pending"] for engine in c.coord.stats()["engines"]]
    assert counts == expected
    assert max_over_mean(counts) <= 1.3, counts


def test_the_loop_releases_what_it_charged(make_cluster):
    # Two engines; prompts without hashes, sized by their tokens (blocks of 16).
    big, small = m([1] * 1600), m([1] * 16)  # 100 blocks, 1 block
    with make_cluster(n_engines=2, policy="prefix", drain_timeout=0.2) as c:
        seen: dict[int, tuple[int, int]] = {}  # client rid -> (rank, server rid)

        def wait_rank(rid: int) -> int:
            def arrived() -> bool:
                for rank, engine in enumerate(c.engines):
                    while engine.sock.poll(0):
                        meta = um(engine.recv()[0])
                        seen[meta[2]["rid"]] = (rank, meta[1])
                return rid in seen

            wait_for(arrived)
            return seen[rid][0]

        client = c.client()

        def send(rid: int, prompt: bytes) -> int:
            client.send(m([SUBMIT, rid, {"rid": rid}]), prompt)
            return wait_rank(rid)

        def finish(rid: int) -> None:
            rank, server_rid = seen[rid]
            c.engines[rank].send(m([REPLY, [[server_rid, False]]]), b"done")
            assert client.recv() == [m([REPLY, rid]), b"done"]

        assert send(0, big) == 0  # the rotating start
        assert send(1, small) == 1  # least work
        assert send(2, small) == 1  # 2 * (1 + 32) blocks against 100 + 32
        finish(0)
        assert send(3, small) == 0  # rank 0's work was released with the final
        # Rank 1 leaves, and its two requests go to rank 0 when its drain times out.
        c.engines[1].send(m([DISCONNECT]))
        del seen[1], seen[2]
        assert (wait_rank(1), wait_rank(2)) == (0, 0)
        c.engines[1].send(b"")  # back: with nothing charged any more
        wait_for(lambda: c.coord.stats()["engines"][1]["state"] == "alive")
        for rid in (1, 2, 3):
            finish(rid)
        # Both ranks idle: the rotating start, not the stale work of rank 1, decides.
        assert sorted([send(4, small), send(5, small)]) == [0, 1]
