"""The Router, through both implementations, and a differential trace between them."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from coordkit import protocol

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix")
U64 = (1 << 64) - 1


def frame(*hashes: int) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def make(impl, policy: str, ranks=range(4), **kwargs):
    router = impl.Router(policy, **kwargs)
    for rank in ranks:
        router.add_rank(rank)
    return router


def splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & U64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return state, z ^ (z >> 31)


# -- construction and rank bookkeeping --------------------------------------


def test_unknown_policy_names_the_valid_ones(impl):
    with pytest.raises(ValueError, match="round_robin.*least_loaded.*power_of_two.*prefix"):
        impl.Router("random")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_ranks": 0},
        {"seed": -1},
        {"seed": 1 << 64},
        {"rank_cap": -1},
        {"prefix_alpha": -0.5},
        {"prefix_alpha": float("nan")},
        {"prefix_max_entries": 0},
    ],
)
def test_invalid_arguments(impl, kwargs):
    with pytest.raises(ValueError):
        impl.Router("prefix", **kwargs)


def test_policy_property(impl):
    for policy in POLICIES:
        assert impl.Router(policy).policy == policy


@pytest.mark.parametrize("rank", [-1, 4])
def test_rank_out_of_range(impl, rank):
    router = impl.Router("round_robin", max_ranks=4)
    for method in (
        router.add_rank,
        router.remove_rank,
        router.accepting,
        router.pending,
        router.release,
    ):
        with pytest.raises(ValueError, match="out of range"):
            method(rank)


def test_add_and_remove_rank(impl):
    router = impl.Router("least_loaded", max_ranks=8)
    assert router.n_accepting == 0
    assert router.choose() == -1
    router.add_rank(5)
    router.add_rank(5)
    assert router.n_accepting == 1
    assert router.accepting(5) and not router.accepting(4)
    assert router.choose() == 5
    router.remove_rank(5)
    router.remove_rank(5)
    assert router.n_accepting == 0
    assert not router.accepting(5)
    assert router.pending(5) == 1  # kept: the coordinator releases it request by request
    assert router.choose() == -1
    router.release(5)
    router.release(5)
    assert router.pending(5) == 0


# -- round_robin, least_loaded, rank_cap --------------------------------------


def test_round_robin_order(impl):
    router = make(impl, "round_robin", range(3))
    assert [router.choose() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_ranks_not_accepting(impl):
    router = make(impl, "round_robin", [0, 1, 3, 5])
    router.remove_rank(1)
    assert [router.choose() for _ in range(6)] == [0, 3, 5, 0, 3, 5]
    router.add_rank(1)
    assert [router.choose() for _ in range(4)] == [0, 1, 3, 5]


def test_least_loaded_rotating_start_spreads_a_burst(impl):
    # Released at once, every request sees equal loads: a fixed start would
    # send them all to rank 0.
    router = make(impl, "least_loaded", range(4))
    picks = []
    for _ in range(8):
        rank = router.choose()
        router.release(rank)
        picks.append(rank)
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_least_loaded_prefers_fewest_pending(impl):
    router = make(impl, "least_loaded", range(3))
    assert [router.choose() for _ in range(3)] == [0, 1, 2]
    router.release(1)
    assert router.choose() == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_rank_cap_returns_minus_one_only_when_all_are_at_the_cap(impl, policy):
    router = make(impl, policy, range(3), rank_cap=2)
    hashes = frame(11, 12, 13)
    picks = [router.choose(hashes) for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    assert router.choose(hashes) == -1
    assert router.choose() == -1
    router.release(1)
    assert router.choose(hashes) == 1
    assert router.choose(hashes) == -1


# -- power_of_two --------------------------------------------------------------


def test_power_of_two_is_reproducible(impl):
    def run(seed: int) -> list[int]:
        router = make(impl, "power_of_two", range(16), seed=seed)
        rng = random.Random(0)
        picks = []
        for _ in range(300):
            picks.append(router.choose())
            if rng.random() < 0.6:
                router.release(rng.choice(picks))
        return picks

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_power_of_two_picks_the_less_loaded_of_its_pair(impl):
    seed = 7
    router = make(impl, "power_of_two", range(8), seed=seed)
    members = list(range(8))  # the router's order: append, swap-with-last removal
    rng = random.Random(1)
    outstanding: list[int] = []
    state = seed
    for step in range(600):
        if step == 300:
            router.remove_rank(2)
            members[members.index(2)] = members[-1]
            members.pop()
        n = len(members)
        state, x = splitmix64(state)
        state, y = splitmix64(state)
        i, j = x % n, y % (n - 1)
        if j >= i:
            j += 1
        a, b = members[i], members[j]
        expected = b if router.pending(b) < router.pending(a) else a
        assert router.choose() == expected
        outstanding.append(expected)
        while outstanding and rng.random() < 0.45:
            router.release(outstanding.pop(rng.randrange(len(outstanding))))


def test_power_of_two_with_one_rank(impl):
    router = make(impl, "power_of_two", [3], rank_cap=2)
    assert [router.choose() for _ in range(3)] == [3, 3, -1]


# -- prefix --------------------------------------------------------------------


def chain(impl, tokens: list[int]) -> bytes:
    return protocol.block_hashes(tokens, 16)


def test_prefix_shared_prefix_lands_on_the_same_rank(impl):
    router = make(impl, "prefix", range(4))
    system = list(range(1000, 1064))  # four full blocks
    first = router.choose(chain(impl, system + [1] * 20))
    router.release(first)
    for user in range(2, 8):
        rank = router.choose(chain(impl, system + [user] * 20))
        router.release(rank)
        assert rank == first
    unrelated = router.choose(chain(impl, list(range(64))))
    assert unrelated != first  # no match: least_loaded, whose start has moved on


def test_prefix_overloaded_rank_loses_affinity(impl):
    # Four ranks, a four-block match on rank 0, alpha 1, nothing released: with
    # p0 = k and the others idle, score(0) = 4 - (3k/4) / max(1, k/4) and
    # score(other) = (k/4) / max(1, k/4); they meet at k = 4, where the tie
    # goes to the rank with fewer pending.
    router = make(impl, "prefix", range(4))
    hashes = frame(1, 2, 3, 4)
    assert [router.choose(hashes) for _ in range(5)] == [0, 0, 0, 0, 1]
    assert router.prefix_ranks(1, 0.0) == [0, 1]


def test_prefix_alpha_zero_is_pure_affinity(impl):
    router = make(impl, "prefix", range(4), prefix_alpha=0.0)
    assert {router.choose(frame(1, 2)) for _ in range(20)} == {0}


def test_prefix_deeper_match_wins(impl):
    router = make(impl, "prefix", range(4))
    assert router.choose(frame(1, 2, 3)) == 0  # no match: least_loaded
    assert router.choose(frame(1)) == 1  # a one-block match does not outweigh one pending
    router.release(1)
    assert router.prefix_ranks(1, 0.0) == [0, 1]
    # Rank 0 (depth 3, one pending) against rank 1 (depth 1, idle).
    assert router.choose(frame(1, 2, 3)) == 0


def test_prefix_entries_expire(impl):
    router = make(impl, "prefix", range(4), prefix_ttl=10.0)
    hashes = frame(1, 2)
    assert router.choose(hashes, now=0.0) == 0
    router.release(0)
    assert router.choose(hashes, now=10.0) == 0  # now - last_used == ttl: still live
    router.release(0)
    assert router.prefix_ranks(1, 20.0) == [0]
    assert router.prefix_ranks(1, 20.5) == []
    assert router.prefix_len == 2  # expired, not yet purged
    assert router.choose(hashes, now=21.0) == 1  # no live match: least_loaded
    assert router.prefix_ranks(1, 21.0) == [1]  # purged, then recorded afresh
    router.release(1)
    router.release(router.choose(frame(7), now=40.0))
    assert router.prefix_len == 1  # recording purged the expired entries first


def test_prefix_expired_entry_is_reset(impl):
    # A step back in time leaves an expired entry behind a live one in LRU
    # order: the purge stops at the live one, and recording resets the other.
    router = make(impl, "prefix", range(4), prefix_ttl=10.0)
    router.release(router.choose(frame(1), now=100.0))  # rank 0
    router.release(router.choose(frame(2), now=0.0))  # rank 1
    assert router.choose(frame(2), now=100.0) == 2  # expired: least_loaded
    assert router.prefix_ranks(1, 100.0) == [0]
    assert router.prefix_ranks(2, 100.0) == [2]  # reset, not {1, 2}


def test_prefix_table_size_bound_evicts_lru(impl):
    router = make(impl, "prefix", range(2), prefix_max_entries=4)
    router.release(router.choose(frame(1, 2, 3)))
    router.release(router.choose(frame(4, 5)))
    assert router.prefix_len == 4
    assert router.prefix_ranks(1, 0.0) == []
    assert all(router.prefix_ranks(h, 0.0) for h in (2, 3, 4, 5))
    router.release(router.choose(frame(2)))  # 2 becomes the most recent
    router.release(router.choose(frame(6)))  # evicts 3, the oldest now
    assert router.prefix_len == 4
    assert router.prefix_ranks(3, 0.0) == []
    assert all(router.prefix_ranks(h, 0.0) for h in (2, 4, 5, 6))


def test_prefix_removed_rank_leaves_the_table(impl):
    router = make(impl, "prefix", range(3), rank_cap=1)
    a, b, e = frame(1, 2), frame(3), frame(4, 5)
    assert router.choose(a) == 0
    assert router.choose(a) == 1  # rank 0 is at its cap: least_loaded
    assert router.choose(b) == 2
    router.release(1)
    router.release(2)
    router.release(0)
    assert router.choose(e) == 0
    assert router.prefix_ranks(1, 0.0) == [0, 1]
    router.remove_rank(0)
    assert router.prefix_len == 3
    assert router.prefix_ranks(1, 0.0) == router.prefix_ranks(2, 0.0) == [1]
    assert router.prefix_ranks(3, 0.0) == [2]
    assert router.prefix_ranks(4, 0.0) == router.prefix_ranks(5, 0.0) == []
    assert router.pending(0) == 1
    assert router.choose(a) == 1


def test_prefix_without_hashes_is_least_loaded(impl):
    prefix = make(impl, "prefix", range(5))
    least = make(impl, "least_loaded", range(5))
    rng = random.Random(3)
    for step in range(100):
        empty = (None, b"", memoryview(b""))[step % 3]
        rank = prefix.choose(empty)
        assert rank == least.choose()
        if rng.random() < 0.5:
            prefix.release(rank)
            least.release(rank)
    assert prefix.prefix_len == 0


def test_prefix_reads_any_buffer_unaligned(impl):
    hashes = frame(0x0123456789ABCDEF, U64, 1)
    views = [hashes, bytearray(hashes), memoryview(b"\0" + hashes)[1:]]
    for view in views:
        router = make(impl, "prefix", range(2))
        router.choose(view)
        assert router.prefix_ranks(0x0123456789ABCDEF, 0.0) == [0]
        assert router.prefix_ranks(U64, 0.0) == [0]
        assert router.prefix_len == 3


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("size", [1, 7, 12])
def test_hash_frame_not_a_multiple_of_8(impl, policy, size):
    router = make(impl, policy, range(2))
    with pytest.raises(ValueError, match="multiple of 8"):
        router.choose(b"\0" * size)
    assert router.pending(0) == router.pending(1) == 0


# -- block hashes ----------------------------------------------------------------


def test_block_hashes_definition():
    tokens = list(range(40))  # two full blocks of 16, and 8 tokens that have no hash
    expected, prev = b"", bytes(8)
    for start in (0, 16):
        data = prev + b"".join(t.to_bytes(4, "little") for t in tokens[start : start + 16])
        prev = hashlib.blake2b(data, digest_size=8).digest()
        expected += prev
    assert protocol.block_hashes(tokens, 16) == expected
    assert protocol.block_hashes(tokens[:15], 16) == b""


def test_block_hashes_are_chained():
    base = list(range(64))
    assert protocol.block_hashes(base + [7] * 32, 16)[:32] == protocol.block_hashes(base, 16)
    other = protocol.block_hashes([1] + base[1:], 16)
    mine = protocol.block_hashes(base, 16)
    assert all(other[i : i + 8] != mine[i : i + 8] for i in range(0, 32, 8))
    with pytest.raises(ValueError):
        protocol.block_hashes(base, 0)


# -- differential: the same trace through both routers ---------------------------


def run_trace(c_router, py_router, seed: int, max_ranks: int, steps: int) -> None:
    rng = random.Random(seed)
    shared = [[rng.getrandbits(64) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    tails = [rng.getrandbits(64) for _ in range(12)]
    pool = [h for prefix in shared for h in prefix] + tails
    outstanding: list[int] = []
    now = 0.0
    for rank in rng.sample(range(max_ranks), max(1, max_ranks // 2)):
        c_router.add_rank(rank)
        py_router.add_rank(rank)
    for step in range(steps):
        x = rng.random()
        if x < 0.04:
            rank = rng.randrange(max_ranks)
            c_router.add_rank(rank)
            py_router.add_rank(rank)
        elif x < 0.07:
            rank = rng.randrange(max_ranks)
            c_router.remove_rank(rank)
            py_router.remove_rank(rank)
        elif x < 0.55:
            y = rng.random()
            if y < 0.1:
                hashes = None if y < 0.05 else b""
            else:
                hashes = frame(*rng.choice(shared), *rng.sample(tails, rng.randint(0, 3)))
            rank = py_router.choose(hashes, now)
            assert c_router.choose(hashes, now) == rank, f"step {step}"
            if rank >= 0:
                outstanding.append(rank)
        elif x < 0.9:
            if outstanding:
                rank = outstanding.pop(rng.randrange(len(outstanding)))
                c_router.release(rank)
                py_router.release(rank)
        else:
            # Mostly forward, sometimes far (expiry), sometimes a little back.
            now += rng.choice((rng.uniform(0, 5), rng.uniform(0, 60), -rng.uniform(0, 3)))
        if step % 50 == 0:
            assert c_router.prefix_len == py_router.prefix_len
    assert [c_router.pending(r) for r in range(max_ranks)] == [
        py_router.pending(r) for r in range(max_ranks)
    ]
    assert c_router.n_accepting == py_router.n_accepting
    assert c_router.prefix_len == py_router.prefix_len
    for h in pool:
        assert c_router.prefix_ranks(h, now) == py_router.prefix_ranks(h, now)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("max_ranks", [8, 130])
@pytest.mark.parametrize("rank_cap", [0, 3])
@pytest.mark.parametrize(("seed", "alpha"), [(1, 0.75), (2, 0.0), (3, 3.0)])
def test_differential_trace(c_impl, py_impl, policy, max_ranks, rank_cap, seed, alpha):
    kwargs = dict(
        max_ranks=max_ranks,
        seed=seed * 1000,
        rank_cap=rank_cap,
        prefix_alpha=alpha,
        prefix_ttl=40.0,
        prefix_max_entries=24,
    )
    c_router = c_impl.Router(policy, **kwargs)
    py_router = py_impl.Router(policy, **kwargs)
    run_trace(c_router, py_router, seed, max_ranks, steps=3000)
