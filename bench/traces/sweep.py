"""Sweep the prefix policy's weights over a virtual-time model of ``coordkit replay``.

The model runs the real router (coordkit's C or Python ``Router``) against
engines that follow FakeEngine's scheduling and cost model step for step
(:data:`coordkit.tools.fake_engine.H100`: chunked first-come prefill of the
uncached tokens, decode steps that grow with the batch, an LRU prefix cache
of block ids), on a clock of its own: no processes, no sockets, no noise, a
whole trace in a fraction of a second. It is how the defaults of
``prefix_prefill_weight`` and ``prefix_decode_tokens`` were narrowed down;
``coordkit replay`` measures the real thing.

    python bench/traces/sweep.py                      # the defaults' neighbourhood
    python bench/traces/sweep.py --weights 1 4 8 16 --decode-tokens 0 512

Each workload prints least_loaded, then a row per weight with a column per
decode share: ``hit rate / TTFT p50 / TTFT p99`` (trace seconds). Then the
issue's held-requests workload (4 engines that never finish, 2 000 requests,
70% sharing a 32-block prefix): max/mean requests per engine.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import struct
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from coordkit import load_implementation
from coordkit.tools.fake_engine import H100

sys.path.insert(0, str(Path(__file__).parent))
from generate import records  # noqa: E402

HERE = Path(__file__).parent


class _Job:
    __slots__ = ("arrival", "ids", "tokens", "output", "charged", "cached", "left", "made", "first")


class _Engine:
    def __init__(self, cache_blocks: int):
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.waiting: list[_Job] = []
        self.active: list[_Job] = []
        self.stepping = False


def simulate(
    trace: list[dict],
    policy: str,
    *,
    engines: int,
    block_size: int,
    cache_blocks: int,
    implementation: str = "c",
    **router_options: Any,
) -> dict[str, float]:
    """Hit rate and TTFT percentiles of ``trace`` under ``policy``, in trace seconds."""
    router = load_implementation(implementation).Router(
        policy, block_size=block_size, **router_options
    )
    for rank in range(engines):
        router.add_rank(rank)
    cluster = [_Engine(cache_blocks) for _ in range(engines)]
    cost = H100
    events: list[tuple[float, int, int]] = []  # (time, 0: arrival i | 1: step end of rank, seq)
    t0 = trace[0]["timestamp"] / 1000
    for i, record in enumerate(trace):
        heapq.heappush(events, (record["timestamp"] / 1000 - t0, 0, i))
    ttft: list[float] = []
    hits = blocks = 0
    sequence = len(trace)

    def start_step(engine: _Engine, rank: int, now: float) -> None:
        nonlocal sequence
        while engine.waiting and len(engine.active) < cost.max_batch:
            job = engine.waiting.pop(0)
            engine.active.append(job)
            job.cached = 0
            for block in job.ids:
                if block not in engine.cache:
                    break
                job.cached += 1
            for block in job.ids:
                engine.cache[block] = None
                engine.cache.move_to_end(block)
            while len(engine.cache) > engine.cache_blocks:
                engine.cache.popitem(last=False)
            job.left = max(job.tokens - job.cached * block_size, 1)
        budget, decoding = cost.prefill_chunk, 0
        for job in engine.active:
            if job.left == 0:
                decoding += 1
            elif budget:
                chunk = min(job.left, budget)
                job.left -= chunk
                budget -= chunk
        duration = cost.step_time + cost.decode_per_seq * decoding
        duration += (cost.prefill_chunk - budget) / cost.prefill_rate
        engine.stepping = True
        sequence += 1
        heapq.heappush(events, (now + duration, 1, rank * (1 << 32) + sequence))

    while events:
        now, kind, data = heapq.heappop(events)
        if kind == 0:
            record = trace[data]
            job = _Job()
            job.arrival, job.ids, job.tokens = now, record["hash_ids"], record["input_length"]
            job.output, job.made, job.first = max(1, record["output_length"]), 0, None
            hashes = struct.pack(f"<{len(job.ids)}Q", *job.ids) if job.ids else None
            rank = router.choose(hashes, now, job.tokens)
            job.charged = router.charged
            engine = cluster[rank]
            engine.waiting.append(job)
            if not engine.stepping:
                start_step(engine, rank, now)
            continue
        rank = data >> 32
        engine = cluster[rank]
        running = []
        for job in engine.active:
            if job.left:
                running.append(job)
                continue
            job.made += 1
            if job.first is None:
                job.first = now
                ttft.append(now - job.arrival)
            if job.made < job.output:
                running.append(job)
                continue
            router.release(rank, job.charged)
            hits += job.cached
            blocks += len(job.ids)
        engine.active = running
        engine.stepping = False
        if engine.waiting or engine.active:
            start_step(engine, rank, now)
    ttft.sort()
    return {
        "hit_rate": hits / blocks if blocks else 0.0,
        "ttft_p50": ttft[max(math.ceil(0.5 * len(ttft)) - 1, 0)],
        "ttft_p99": ttft[max(math.ceil(0.99 * len(ttft)) - 1, 0)],
    }


def held_imbalance(weight: float, decode_tokens: int, seed: int = 0) -> float:
    """The issue's workload: max/mean requests per engine when none ever finishes."""
    router = load_implementation("c").Router(
        "prefix", prefix_prefill_weight=weight, prefix_decode_tokens=decode_tokens
    )
    for rank in range(4):
        router.add_rank(rank)
    rng = random.Random(seed)
    shared = [rng.getrandbits(64) for _ in range(32)]
    counts = [0] * 4
    for _ in range(2000):
        own = 4 if rng.random() < 0.7 else 36
        hashes = (shared if own == 4 else []) + [rng.getrandbits(64) for _ in range(own)]
        counts[router.choose(struct.pack(f"<{len(hashes)}Q", *hashes), 0.0)] += 1
    return max(counts) / 500


def workloads() -> dict[str, tuple[list[dict], dict[str, int]]]:
    mooncake = HERE / "mooncake_synthetic_last1000.jsonl"
    return {
        "mooncake (last 1000, 8 engines)": (
            [json.loads(line) for line in mooncake.read_text().splitlines()],
            {"engines": 8, "block_size": 512, "cache_blocks": 1024},
        ),
        "hot (3000 at 60/s, 4 engines)": (
            list(records("hot", 3000, 60.0)),
            {"engines": 4, "block_size": 16, "cache_blocks": 4096},
        ),
        "mixed (3000 at 30/s, 4 engines)": (
            list(records("mixed", 3000, 30.0)),
            {"engines": 4, "block_size": 16, "cache_blocks": 1024},
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=float, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--decode-tokens", type=int, nargs="+", default=[0, 256, 512, 1024])
    parser.add_argument("--implementation", choices=("c", "py"), default="c")
    args = parser.parse_args(argv)
    header = "".join(f"{f'D={d}':>20}" for d in args.decode_tokens)
    for name, (trace, options) in workloads().items():
        print(f"{name}: hit rate / TTFT p50 / TTFT p99")
        for policy in ("least_loaded", "power_of_two"):
            r = simulate(trace, policy, implementation=args.implementation, **options)
            print(f"  {policy:<14}{_cell(r):>20}")
        print(f"  {'prefix':<14}{header}")
        for weight in args.weights:
            cells = (
                _cell(
                    simulate(
                        trace,
                        "prefix",
                        implementation=args.implementation,
                        prefix_prefill_weight=weight,
                        prefix_decode_tokens=decode,
                        **options,
                    )
                )
                for decode in args.decode_tokens
            )
            print(f"  {f'W={weight:g}':<14}" + "".join(f"{c:>20}" for c in cells))
    print("held requests, 70% one 32-block prefix: max/mean requests per engine (seeds 0-2)")
    print(f"  {'prefix':<14}{header}")
    for weight in args.weights:
        cells = (
            "/".join(f"{held_imbalance(weight, d, seed):.2f}" for seed in range(3))
            for d in args.decode_tokens
        )
        print(f"  {f'W={weight:g}':<14}" + "".join(f"{c:>20}" for c in cells))
    return 0


def _cell(r: dict[str, float]) -> str:
    return f"{r['hit_rate']:.2f}/{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
