"""Synthetic request traces in the schema of Mooncake's (``coordkit replay`` reads them).

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids``, one id per block of ``--block-size`` tokens (16 here: pass
``--block-size 16`` to ``coordkit replay``), equal ids at a position meaning
an equal prefix. Arrivals are Poisson; everything is drawn from ``--seed``.

* ``hot``: the workload of the issue that introduced the cost model. 70% of
  the requests share one 32-block prefix (a system prompt) followed by 4
  blocks of their own; the others are 36 blocks of their own.
* ``mixed``: 40 shared prefixes of 8 to 128 blocks, drawn with Zipf(1.1)
  popularity, followed by 1 to 32 blocks of their own (60% of requests);
  prompts of 8 to 200 blocks of their own (20%); and prompts of 8 to 200
  blocks sent without hash ids (20%), which the router sizes by their tokens.

    python bench/traces/generate.py hot --requests 2400 --rate 40 > hot.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections.abc import Iterator


def _outputs(rng: random.Random) -> int:
    """Output lengths with a long tail: median ~90, mean ~130 tokens."""
    return max(1, min(1024, int(rng.lognormvariate(4.5, 0.8))))


def hot(rng: random.Random, ids: itertools.count, block_size: int) -> dict:
    system = list(range(32))  # ids 0..31: the shared prefix
    if rng.random() < 0.7:
        hash_ids = system + [next(ids) for _ in range(4)]
    else:
        hash_ids = [next(ids) for _ in range(36)]
    return {"input_length": 36 * block_size, "hash_ids": hash_ids}


def mixed_factory(rng: random.Random, ids: itertools.count, block_size: int):
    prefixes = [[next(ids) for _ in range(rng.randint(8, 128))] for _ in range(40)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(prefixes))]

    def mixed(rng: random.Random, ids: itertools.count, block_size: int) -> dict:
        x = rng.random()
        if x < 0.6:
            prefix = rng.choices(prefixes, weights)[0]
            hash_ids = prefix + [next(ids) for _ in range(rng.randint(1, 32))]
            return {"input_length": len(hash_ids) * block_size, "hash_ids": hash_ids}
        blocks = rng.randint(8, 200)
        if x < 0.8:
            return {
                "input_length": blocks * block_size,
                "hash_ids": [next(ids) for _ in range(blocks)],
            }
        return {"input_length": blocks * block_size, "hash_ids": []}

    return mixed


def records(
    workload: str, requests: int, rate: float, block_size: int = 16, seed: int = 0
) -> Iterator[dict]:
    """The trace's records, in order."""
    rng = random.Random(seed)
    ids = itertools.count(1000)  # ids below 1000 are the hot workload's system prompt
    draw = hot if workload == "hot" else mixed_factory(rng, ids, block_size)
    now = 0.0
    for _ in range(requests):
        request = draw(rng, ids, block_size)
        yield {
            "timestamp": round(now * 1000),
            "input_length": request["input_length"],
            "output_length": _outputs(rng),
            "hash_ids": request["hash_ids"],
        }
        now += rng.expovariate(rate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=("hot", "mixed"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for record in records(args.workload, args.requests, args.rate, args.block_size, args.seed):
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
