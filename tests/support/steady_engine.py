"""An engine process whose requests take 1.5-3 s, for the failover tests.

``python -m tests.support.steady_engine ADDRESS RANK IMPL LOG`` runs a
:class:`coordkit.Engine` that generates for every request (its prompt's first
token is its number ``n``) for 1.5 + (n % 7) / 4 seconds, as the bench's
failover engines do (:func:`coordkit.tools.bench.failover.generate_steadily`:
a streaming request gets a partial ``{"n": n, "i": i}`` every 0.25 s, and every
request ends with ``{"n": n, "partials": count}``). Each request it starts is
written to LOG (``n``, one a line, flushed at once), so that a test sees one
started twice.
"""

from __future__ import annotations

import sys

from coordkit.engine import Engine
from coordkit.tools.bench.failover import generate_steadily


def main(address: str, rank: int, implementation: str, log_path: str) -> None:
    with (
        open(log_path, "a", buffering=1) as log,
        Engine(
            address,
            rank=rank,
            implementation=implementation,
            heartbeat_interval=0.2,
            coordinator_timeout=1.0,
        ) as engine,
    ):
        generate_steadily(
            engine,
            lambda n: 1.5 + (n % 7) / 4,
            lambda numbers: log.write("".join(f"{n}\n" for n in numbers)),
            lambda: True,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
