"""The Router, through both implementations, and a differential trace between them."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit import protocol
from tests.support.routing_reference import ScanningRouter

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
        {"prefix_prefill_weight": -0.5},
        {"prefix_prefill_weight": float("nan")},
        {"prefix_prefill_weight": float("inf")},
        {"prefix_prefill_weight": 65536.5},
        {"prefix_decode_tokens": -1},
        {"prefix_decode_tokens": (1 << 31) + 1},
        {"block_size": 0},
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
    charge = router.charged
    router.remove_rank(5)
    router.remove_rank(5)
    assert router.n_accepting == 0
    assert not router.accepting(5)
    assert router.pending(5) == 1  # kept: the coordinator releases it request by request
    assert router.work(5) == charge  # kept too
    assert router.choose() == -1
    assert router.charged == 0
    router.release(5, charge)
    router.release(5, charge)
    assert router.pending(5) == router.work(5) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_charges_work(impl, policy):
    # A request's blocks: its hashes, else ceil(prompt_tokens / block_size); plus
    # the decode share. Only prefix knows what a rank has cached.
    router = make(impl, policy, [0], block_size=16, prefix_decode_tokens=48)
    assert router.choose(None, 0.0, 33) == 0
    assert router.charged == 3 + 3
    assert router.choose(b"", 0.0, 32) == 0
    assert router.charged == 2 + 3
    assert router.choose(frame(1, 2, 3, 4, 5), 0.0, 10_000) == 0  # the hashes size it
    assert router.charged == 5 + 3
    assert router.work(0) == 6 + 5 + 8
    if policy == "prefix":
        assert router.choose(frame(1, 2, 3, 9), 0.0) == 0
        assert router.charged == 1 + 3  # three blocks already there
    router.release(0, 8)
    router.release(0, 100)  # more than is left: work stops at 0
    assert router.work(0) == 0


@pytest.mark.parametrize(
    ("decode_tokens", "block_size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (128, 16, 8), (129, 16, 9), (128, 512, 1)],
)
def test_the_decode_share_is_rounded_up_to_blocks(impl, decode_tokens, block_size, blocks):
    router = make(impl, "prefix", [0], prefix_decode_tokens=decode_tokens, block_size=block_size)
    router.choose()
    assert router.charged == blocks


def test_prompt_tokens_bounds(impl):
    router = make(impl, "least_loaded", [0], block_size=1, prefix_decode_tokens=0)
    router.choose(None, 0.0, -5)
    assert router.charged == 0
    router.choose(None, 0.0, (1 << 63) - 1)
    assert router.charged == 1 << 23  # MAX_BLOCKS


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


def once(router, hashes=None, now=0.0, tokens=0) -> int:
    """A request that comes and goes: chosen, then released with its charge."""
    rank = router.choose(hashes, now, tokens)
    router.release(rank, router.charged)
    return rank


def test_prefix_shared_prefix_lands_on_the_same_rank(impl):
    router = make(impl, "prefix", range(4))
    system = list(range(1000, 1064))  # four full blocks
    first = once(router, chain(impl, system + [1] * 20))
    for user in range(2, 8):
        assert once(router, chain(impl, system + [user] * 20)) == first
    unrelated = once(router, chain(impl, list(range(64))))
    assert unrelated != first  # no match, no load: the rotating start has moved on


def test_prefix_queued_work_outweighs_affinity(impl):
    # Weight 2, decode share 1, four-block requests, nothing released. Rank 0 has the
    # chain after the first: it costs 2*0 + work(0), an idle rank 2*4 + 0. Work(0) goes
    # 5, 6, 7, 8: at 8 they tie, and the tie goes to fewer pending.
    router = make(impl, "prefix", range(4), prefix_prefill_weight=2.0, prefix_decode_tokens=16)
    hashes = frame(1, 2, 3, 4)
    picks, charges = [], []
    for _ in range(5):
        picks.append(router.choose(hashes))
        charges.append(router.charged)
    assert picks == [0, 0, 0, 0, 1]
    assert charges == [5, 1, 1, 1, 5]
    assert router.prefix_ranks(1, 0.0) == [0, 1]
    assert [router.work(r) for r in range(4)] == [8, 5, 0, 0]


def test_prefix_weight_may_be_fractional(impl):
    # 1.5 blocks to prefill against work: a 2-block saving is worth 3 queued blocks.
    router = make(impl, "prefix", range(2), prefix_prefill_weight=1.5, prefix_decode_tokens=0)
    hashes = frame(1, 2)
    assert router.choose(hashes) == 0  # work(0) = 2
    assert router.choose(hashes) == 0  # 1.5*0 + 2 < 1.5*2 + 0: work(0) stays 2
    router.choose(None, 0.0, 16)  # least work: rank 1 gets one block
    assert [router.work(r) for r in range(2)] == [2, 1]
    router.choose(None, 0.0, 16)  # rank 1 again (1 < 2): now 2 and 2
    assert router.choose(hashes) == 0  # 0 + 2 < 3 + 2
    router.choose(None, 0.0, 16)  # rank 0 and rank 1 tie on work: fewer pending, rank 1
    assert [router.work(r) for r in range(2)] == [2, 3]


@pytest.mark.parametrize("weight", [0.0, 0.001])  # 0.001 * 256 rounds to 0
def test_prefix_weight_zero_is_least_work(impl, weight):
    router = make(impl, "prefix", range(2), prefix_prefill_weight=weight, prefix_decode_tokens=0)
    assert router.choose(frame(1, 2, 3)) == 0
    assert router.choose(frame(1, 2, 3)) == 1  # affinity is worth nothing: rank 1 has less work
    assert router.charged == 3


def test_prefix_deeper_match_wins(impl):
    router = make(impl, "prefix", range(2), prefix_prefill_weight=1.0, prefix_decode_tokens=0)
    assert router.choose(frame(1, 2, 3)) == 0  # held: work(0) = 3
    assert router.choose(frame(1)) == 1  # 1*1 + 0 < 1*0 + 3
    router.release(0, 3)
    router.release(1, 1)
    assert router.prefix_ranks(1, 0.0) == [0, 1]
    assert router.prefix_ranks(2, 0.0) == [0]
    assert once(router, frame(1, 2, 3)) == 0  # depth 3 against depth 1, both idle
    assert once(router, frame(1, 7)) == 1  # depth 1 on both: a tie, the rotating start decides
    assert once(router, frame(1, 7)) == 1  # now rank 1 alone has (1, 7)


def test_prefix_entries_expire(impl):
    router = make(impl, "prefix", range(4), prefix_ttl=10.0)
    hashes = frame(1, 2)
    assert once(router, hashes, now=0.0) == 0
    assert once(router, hashes, now=10.0) == 0  # now - last_used == ttl: still live
    assert router.prefix_ranks(1, 20.0) == [0]
    assert router.prefix_ranks(1, 20.5) == []
    assert router.prefix_len == 2  # expired, not yet purged
    assert once(router, hashes, now=21.0) == 2  # no live match: the rotating start
    assert router.prefix_ranks(1, 21.0) == [2]  # purged, then recorded afresh
    once(router, frame(7), now=40.0)
    assert router.prefix_len == 1  # recording purged the expired entries first


def test_prefix_expired_entry_is_reset(impl):
    # A step back in time leaves an expired entry behind a live one in LRU
    # order: the purge stops at the live one, and recording resets the other.
    router = make(impl, "prefix", range(4), prefix_ttl=10.0)
    assert once(router, frame(1), now=100.0) == 0
    assert once(router, frame(2), now=0.0) == 1
    assert once(router, frame(2), now=100.0) == 2  # expired: the rotating start
    assert router.prefix_ranks(1, 100.0) == [0]
    assert router.prefix_ranks(2, 100.0) == [2]  # reset, not {1, 2}


def test_prefix_table_size_bound_evicts_lru(impl):
    router = make(impl, "prefix", range(2), prefix_max_entries=4)
    once(router, frame(1, 2, 3))
    once(router, frame(4, 5))
    assert router.prefix_len == 4
    assert router.prefix_ranks(1, 0.0) == []
    assert all(router.prefix_ranks(h, 0.0) for h in (2, 3, 4, 5))
    once(router, frame(2))  # 2 becomes the most recent
    once(router, frame(6))  # evicts 3, the oldest now
    assert router.prefix_len == 4
    assert router.prefix_ranks(3, 0.0) == []
    assert all(router.prefix_ranks(h, 0.0) for h in (2, 4, 5, 6))


def test_prefix_removed_rank_leaves_the_table(impl):
    router = make(impl, "prefix", range(3), rank_cap=1, prefix_decode_tokens=32)
    a, b, e = frame(1, 2), frame(3), frame(4, 5)
    assert router.choose(a) == 0
    assert router.choose(a) == 1  # rank 0 is at its cap
    assert router.choose(b) == 2
    for rank, work in ((1, 4), (2, 3), (0, 4)):
        router.release(rank, work)
    assert router.choose(e) == 0
    assert router.prefix_ranks(1, 0.0) == [0, 1]
    router.remove_rank(0)
    assert router.prefix_len == 3
    assert router.prefix_ranks(1, 0.0) == router.prefix_ranks(2, 0.0) == [1]
    assert router.prefix_ranks(3, 0.0) == [2]
    assert router.prefix_ranks(4, 0.0) == router.prefix_ranks(5, 0.0) == []
    assert router.pending(0) == 1
    assert router.work(0) == router.charged  # kept, like pending
    assert router.choose(a) == 1


def test_prefix_without_hashes_is_least_loaded_for_equal_prompts(impl):
    prefix = make(impl, "prefix", range(5))
    least = make(impl, "least_loaded", range(5))
    rng = random.Random(3)
    held = []
    for step in range(100):
        empty = (None, b"", memoryview(b""))[step % 3]
        rank = prefix.choose(empty, 0.0, 40)
        assert rank == least.choose(None, 0.0, 40)
        held.append((rank, prefix.charged))
        if rng.random() < 0.5:
            rank, work = held.pop(rng.randrange(len(held)))
            prefix.release(rank, work)
            least.release(rank, work)
    assert prefix.prefix_len == 0


def test_prefix_balances_prompt_sizes_without_hashes(impl):
    # One long prompt weighs as much as many short ones: least_loaded counts requests.
    router = make(impl, "prefix", range(2), prefix_decode_tokens=0)
    assert router.choose(None, 0.0, 16 * 40) == 0
    assert [router.choose(None, 0.0, 16) for _ in range(40)] == [1] * 40
    assert router.choose(None, 0.0, 16) == 0  # equal work: fewer pending
    assert router.work(0) + router.work(1) == 81


def test_prefix_reads_any_buffer_unaligned(impl):
    hashes = frame(0x0123456789ABCDEF, U64, 1)
    views = [hashes, bytearray(hashes), memoryview(b"\0" + hashes)[1:]]
    for view in views:
        router = make(impl, "prefix", range(2), prefix_decode_tokens=32)
        router.choose(view)
        assert router.prefix_ranks(0x0123456789ABCDEF, 0.0) == [0]
        assert router.prefix_ranks(U64, 0.0) == [0]
        assert router.prefix_len == 3
        assert router.work(0) == router.charged == 3 + 2


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("size", [1, 7, 12])
def test_hash_frame_not_a_multiple_of_8(impl, policy, size):
    router = make(impl, policy, range(2))
    with pytest.raises(ValueError, match="multiple of 8"):
        router.choose(b"\0" * size)
    assert router.pending(0) == router.pending(1) == 0
    assert router.work(0) == router.work(1) == 0


def test_prefix_learns_an_engines_report(impl):
    """``learn``: an engine's report (HELD, after a coordinator's loss) records its
    hashes for that rank as a decision would: the next request that shares them
    goes there. Other policies take it and learn nothing."""
    router = make(impl, "prefix", range(4), max_ranks=4)
    router.learn(2, frame(5, 6, 7, 8), 1.0)
    assert router.prefix_ranks(6, 1.0) == [2] and router.prefix_len == 4
    assert once(router, frame(5, 6, 7, 9), 1.0) == 2
    router.learn(1, b"", 1.0)  # nothing cached: nothing learned
    assert router.prefix_len == 5
    with pytest.raises(ValueError, match="multiple of 8"):
        router.learn(1, b"\0" * 9, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        router.learn(4, frame(1), 1.0)
    plain = make(impl, "least_loaded", range(2))
    plain.learn(1, frame(5, 6), 1.0)
    assert plain.prefix_len == 0


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


# -- differential: the same trace through both routers and the scanning reference -----


def same_choice(routers, hashes, now: float, tokens: int, step: int) -> int:
    """``choose`` on every router: the same rank, charge and prefix counts; the rank."""
    reference, *others = routers
    rank = reference.choose(hashes, now, tokens)
    for router in others:
        where = f"step {step}, {type(router).__module__}"
        assert router.choose(hashes, now, tokens) == rank, where
        assert router.charged == reference.charged, where
        assert router.prefix_counts == reference.prefix_counts, where
    return rank


def same_state(routers, max_ranks: int, now: float, pool: list[int]) -> None:
    reference, *others = routers
    for method in ("pending", "work", "accepting"):
        expected = [getattr(reference, method)(r) for r in range(max_ranks)]
        for router in others:
            assert [getattr(router, method)(r) for r in range(max_ranks)] == expected, method
    for router in others:
        assert router.n_accepting == reference.n_accepting
        assert router.prefix_len == reference.prefix_len
        for h in pool:
            assert router.prefix_ranks(h, now) == reference.prefix_ranks(h, now)


def run_trace(routers, seed: int, max_ranks: int, steps: int) -> None:
    rng = random.Random(seed)
    shared = [[rng.getrandbits(64) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    tails = [rng.getrandbits(64) for _ in range(12)]
    pool = [h for prefix in shared for h in prefix] + tails
    outstanding: list[tuple[int, int]] = []  # (rank, charged)
    now = 0.0
    for rank in rng.sample(range(max_ranks), max(1, max_ranks // 2)):
        for router in routers:
            router.add_rank(rank)
    for step in range(steps):
        x = rng.random()
        if x < 0.04:
            rank = rng.randrange(max_ranks)
            for router in routers:
                router.add_rank(rank)
        elif x < 0.07:
            rank = rng.randrange(max_ranks)
            for router in routers:
                router.remove_rank(rank)
        elif x < 0.55:
            y = rng.random()
            if y < 0.2:
                hashes = None if y < 0.1 else b""
            else:
                hashes = frame(*rng.choice(shared), *rng.sample(tails, rng.randint(0, 3)))
            tokens = rng.choice((0, rng.randrange(1, 40), rng.randrange(1 << 20)))
            rank = same_choice(routers, hashes, now, tokens, step)
            if rank >= 0:
                outstanding.append((rank, routers[0].charged))
        elif x < 0.9:
            if outstanding:
                rank, work = outstanding.pop(rng.randrange(len(outstanding)))
                if rng.random() < 0.05:  # a wrong amount: work stops at 0
                    work = rng.randrange(1 << 30)
                for router in routers:
                    router.release(rank, work)
        else:
            # Mostly forward, sometimes far (expiry), sometimes a little back.
            now += rng.choice((rng.uniform(0, 5), rng.uniform(0, 60), -rng.uniform(0, 3)))
        if step % 50 == 0:
            reference, *others = routers
            for router in others:
                assert router.prefix_len == reference.prefix_len
                assert [router.work(r) for r in range(max_ranks)] == [
                    reference.work(r) for r in range(max_ranks)
                ]
    same_state(routers, max_ranks, now, pool)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("max_ranks", [8, 130])
@pytest.mark.parametrize("rank_cap", [0, 3])
@pytest.mark.parametrize(
    ("seed", "weight", "decode", "block_size"),
    [(1, 0.75, 16, 16), (2, 0.0, 0, 1), (3, 3.0, 33, 7), (4, 1.3, 100, 512), (5, 32.0, 512, 16)],
)
def test_differential_trace(
    c_impl, py_impl, policy, max_ranks, rank_cap, seed, weight, decode, block_size
):
    kwargs = dict(
        max_ranks=max_ranks,
        seed=seed * 1000,
        rank_cap=rank_cap,
        prefix_prefill_weight=weight,
        prefix_decode_tokens=decode,
        block_size=block_size,
        prefix_ttl=40.0,
        prefix_max_entries=24,
    )
    routers = [ScanningRouter(policy, **kwargs), py_impl.Router(policy, **kwargs)]
    run_trace([*routers, c_impl.Router(policy, **kwargs)], seed, max_ranks, steps=3000)


@pytest.mark.parametrize("seed", [1, 2])
def test_learned_reports_against_the_scan(c_impl, py_impl, seed):
    """Reports learned between decisions (a restarted coordinator's first seconds):
    the same choices and table in both routers and the reference."""
    kwargs = dict(max_ranks=16, seed=seed, prefix_ttl=40.0, prefix_max_entries=48)
    routers = [ScanningRouter("prefix", **kwargs), py_impl.Router("prefix", **kwargs)]
    routers.append(c_impl.Router("prefix", **kwargs))
    rng = random.Random(seed)
    shared = [[rng.getrandbits(64) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    pool = [h for prefix in shared for h in prefix]
    for rank in range(0, 16, 2):
        for router in routers:
            router.add_rank(rank)
    now = 0.0
    for step in range(600):
        hashes = frame(*rng.choice(shared), *rng.choice(shared)[: rng.randint(0, 3)])
        if rng.random() < 0.3:
            rank = rng.randrange(0, 16, 2)
            for router in routers:
                router.learn(rank, hashes, now)
        else:
            rank = same_choice(routers, hashes, now, 0, step)
            if rng.random() < 0.7:
                for router in routers:
                    router.release(rank, routers[0].charged)
        now += rng.uniform(0, 1)
    same_state(routers, 16, now, pool)


def run_fleet(routers, seed: int, max_ranks: int, steps: int, n_prefixes: int = 40) -> None:
    """A fleet of hundreds of ranks, growing from a few: joining and leaving in
    waves, draining (out of the pool, its requests still to release), dying (its
    requests released at once), under a load that keeps most ranks at few pending
    requests (ties everywhere). Few prefixes make entries that list many ranks."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randint(1, 8))] for _ in range(n_prefixes)]
    held: dict[int, list[int]] = {}  # rank -> the charges of its requests in flight
    accepting: set[int] = set()
    frontier = 16  # ranks join below it; it moves up as the fleet grows
    now = 0.0

    def join(rank: int) -> None:
        accepting.add(rank)
        for router in routers:
            router.add_rank(rank)

    def leave(rank: int, dies: bool) -> None:
        accepting.discard(rank)
        for router in routers:
            router.remove_rank(rank)
        if dies:  # the loop settles a dead rank's requests: each released
            for work in held.pop(rank, []):
                for router in routers:
                    router.release(rank, work)

    for rank in range(0, frontier, 2):
        join(rank)
    for step in range(steps):
        x = rng.random()
        if x < 0.01:  # a wave joins (a rank may come back)
            frontier = min(max_ranks, frontier + rng.randint(16, max_ranks // 4))
            for rank in rng.sample(range(frontier), rng.randint(1, min(frontier, 200))):
                join(rank)
        elif x < 0.02 and accepting:  # a wave leaves
            for rank in rng.sample(sorted(accepting), min(len(accepting), rng.randint(10, 80))):
                leave(rank, dies=rng.random() < 0.5)
        elif x < 0.05 and accepting:
            leave(rng.choice(sorted(accepting)), dies=rng.random() < 0.3)
        elif x < 0.07:
            join(rng.randrange(frontier))
        elif x < 0.6:
            y = rng.random()
            if y < 0.3:
                hashes = None
            else:
                chain = rng.choice(prefixes)
                hashes = frame(*chain[: rng.randint(1, len(chain))], rng.getrandbits(64))
            rank = same_choice(routers, hashes, now, rng.randrange(1, 4000), step)
            if rank >= 0:
                held.setdefault(rank, []).append(routers[0].charged)
        elif x < 0.98:
            ranks = [r for r, works in held.items() if works]
            if ranks:
                rank = rng.choice(ranks)
                works = held[rank]
                work = works.pop(rng.randrange(len(works)))
                for router in routers:
                    router.release(rank, work)
        else:
            now += rng.uniform(0, 30)
        if step % 500 == 0:
            same_state(routers, max_ranks, now, [])
    same_state(routers, max_ranks, now, [h for chain in prefixes for h in chain])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("max_ranks", "rank_cap"), [(300, 0), (700, 2), (4096, 0)])
@pytest.mark.parametrize("seed", [11, 12])
def test_fleet_structures_against_the_scan(c_impl, py_impl, policy, max_ranks, rank_cap, seed):
    # The ranking tree, the eligible masks and the prefix summaries of both routers
    # against the contract's scans, with hundreds of ranks coming and going.
    kwargs = dict(
        max_ranks=max_ranks,
        seed=seed,
        rank_cap=rank_cap,
        prefix_prefill_weight=2.0,
        prefix_decode_tokens=32,
        prefix_ttl=100.0,
        prefix_max_entries=200,
    )
    routers = [ScanningRouter(policy, **kwargs), py_impl.Router(policy, **kwargs)]
    steps = 1500 if max_ranks > 1000 else 3000
    run_fleet([*routers, c_impl.Router(policy, **kwargs)], seed, max_ranks, steps)


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0, 8.0])
@pytest.mark.parametrize("rank_cap", [0, 3])
def test_prefix_entries_of_many_ranks_against_the_scan(c_impl, py_impl, weight, rank_cap):
    # Three prefixes over hundreds of ranks: their entries list dozens of ranks or all
    # of them, so prefix decides by walking the ranking (and, when that cannot settle
    # it, by the scan) as often as from a sparse entry.
    kwargs = dict(
        max_ranks=500,
        seed=3,
        rank_cap=rank_cap,
        prefix_prefill_weight=weight,
        prefix_decode_tokens=16,
        prefix_ttl=100.0,
        prefix_max_entries=500,
    )
    routers = [ScanningRouter("prefix", **kwargs), py_impl.Router("prefix", **kwargs)]
    run_fleet([*routers, c_impl.Router("prefix", **kwargs)], 21, 500, 3000, n_prefixes=3)


def test_prefix_masks_widen_as_the_fleet_grows(c_impl, py_impl):
    # The C router's masks are as wide as the ranks added so far: each new highest
    # rank past a multiple of 64 moves every entry's mask (and past 4096 ranks,
    # regroups the summaries), and what the entries say must not change.
    kwargs = dict(max_ranks=9000, prefix_prefill_weight=4.0, prefix_decode_tokens=0)
    routers = [
        ScanningRouter("prefix", **kwargs),
        py_impl.Router("prefix", **kwargs),
        c_impl.Router("prefix", **kwargs),
    ]
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(4)] for _ in range(30)]
    held: list[tuple[int, int]] = []
    step = 0
    for ranks in ([0, 1, 2], [63, 64], [200], [1000, 1001], [4095, 4096], [8999], [5000]):
        for rank in ranks:
            for router in routers:
                router.add_rank(rank)
        for _ in range(150):
            step += 1
            chain = rng.choice(chains)
            rank = same_choice(routers, frame(*chain[: rng.randint(1, 4)]), 0.0, 64, step)
            held.append((rank, routers[0].charged))
            if rng.random() < 0.6:
                rank, work = held.pop(rng.randrange(len(held)))
                for router in routers:
                    router.release(rank, work)
        same_state(routers, 9000, 0.0, [h for chain in chains for h in chain])
    for rank in (64, 4096, 0):
        for router in routers:
            router.remove_rank(rank)
        same_state(routers, 9000, 0.0, [h for chain in chains for h in chain])


def test_prefix_chain_longer_than_the_c_scratch(c_impl, py_impl):
    # The C router holds up to 4096 live entries of a chain for its affine decision;
    # a longer match is decided by the scan, to the same rank.
    routers = [ScanningRouter("prefix"), py_impl.Router("prefix"), c_impl.Router("prefix")]
    for router in routers:
        for rank in range(3):
            router.add_rank(rank)
    long_chain = frame(*range(1, 4300))
    for step in range(6):
        rank = same_choice(routers, long_chain if step % 2 else frame(*range(1, 200)), 0.0, 0, step)
        assert rank >= 0
    same_state(routers, 3, 0.0, [1, 4000, 4299])


# -- generated traces: hypothesis shrinks a failing one to its few events ---------------

FLEET = 400
CHAINS = [[(7919 * c + 104729 * d) & U64 for d in range(1, 6)] for c in range(1, 13)]
EVENT = st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(0, FLEET - 1), min_size=1, max_size=120)),
    st.tuples(st.just("leave"), st.integers(0, 1 << 16), st.booleans()),  # dies, or drains
    st.tuples(
        st.just("choose"),
        st.integers(-1, len(CHAINS) - 1),  # -1: no hashes
        st.integers(1, 5),
        st.sampled_from((0, 1, 17, 4000, 1 << 20)),
    ),
    st.tuples(st.just("release"), st.integers(0, 1 << 16)),
    st.tuples(st.just("time"), st.floats(-3, 60)),
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, deadline=None)
@given(rank_cap=st.sampled_from((0, 1, 3)), events=st.lists(EVENT, max_size=150))
def test_generated_fleet_traces_against_the_scan(c_impl, py_impl, policy, rank_cap, events):
    # Ranks joining in waves, leaving to die (their requests settled at once) or to
    # drain (out of the pool, their requests released later), choices and releases
    # interleaved: the same decisions and state as the contract's scans, every event.
    kwargs = dict(
        max_ranks=FLEET,
        seed=3,
        rank_cap=rank_cap,
        prefix_prefill_weight=2.0,
        prefix_decode_tokens=16,
        prefix_ttl=50.0,
        prefix_max_entries=40,
    )
    routers = [
        ScanningRouter(policy, **kwargs),
        py_impl.Router(policy, **kwargs),
        c_impl.Router(policy, **kwargs),
    ]
    held: list[tuple[int, int]] = []  # (rank, charge) of the requests in flight
    accepting: list[int] = []
    now = 0.0
    for step, event in enumerate(events):
        kind = event[0]
        if kind == "join":
            for rank in event[1]:
                if rank not in accepting:
                    accepting.append(rank)
                for router in routers:
                    router.add_rank(rank)
        elif kind == "leave" and accepting:
            rank = accepting.pop(event[1] % len(accepting))
            for router in routers:
                router.remove_rank(rank)
            if event[2]:  # dies: the loop releases each of its requests now
                for r, work in [h for h in held if h[0] == rank]:
                    held.remove((r, work))
                    for router in routers:
                        router.release(r, work)
        elif kind == "choose":
            _, chain, depth, tokens = event
            hashes = None if chain < 0 else frame(*CHAINS[chain][:depth])
            rank = same_choice(routers, hashes, now, tokens, step)
            if rank >= 0:
                assert rank in accepting
                held.append((rank, routers[0].charged))
        elif kind == "release" and held:
            rank, work = held.pop(event[1] % len(held))
            for router in routers:
                router.release(rank, work)
        elif kind == "time":
            now += event[1]
    same_state(routers, FLEET, now, [h for chain in CHAINS for h in chain])
