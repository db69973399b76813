"""An engine process whose requests take 1.5-3 s, for the failover tests.

``python -m tests.support.steady_engine ADDRESS RANK IMPL LOG`` runs a
:class:`coordkit.Engine` that generates for every request (its prompt's first
token is its number ``n``) for 1.5 + (n % 7) / 4 seconds; a streaming request
gets a partial ``{"n": n, "i": i}`` every 0.25 s, and every request ends with
``{"n": n, "partials": count}``, an aborted one at once. Each request it starts
is written to LOG (``n``, one a line, flushed at once), so that a test sees one
started twice, and each abort it gets for a request it runs (``abort n``).
"""

from __future__ import annotations

import sys
import time

from coordkit.engine import Abort, Engine, Request
from coordkit.protocol import STREAM_KEY

PARTIAL_EVERY = 0.25


def main(address: str, rank: int, implementation: str, log_path: str) -> None:
    active: dict[int, list] = {}  # server rid -> [n, end, streaming, partials, next partial]
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
        while True:
            now = time.monotonic()
            for event in engine.poll(0.02):
                if isinstance(event, Request):
                    n = event.prompt_tokens()[0]
                    log.write(f"{n}\n")
                    streaming = bool((event.sampling_params or {}).get(STREAM_KEY))
                    end = now + 1.5 + (n % 7) / 4
                    active[event.server_rid] = [n, end, streaming, 0, now + PARTIAL_EVERY]
                elif isinstance(event, Abort) and event.server_rid in active:
                    log.write(f"abort {active[event.server_rid][0]}\n")
                    active[event.server_rid][1] = now
            partials, finals = [], []
            for rid, state in list(active.items()):
                n, end, streaming, count, next_partial = state
                if now >= end:
                    finals.append((rid, {"n": n, "partials": count}))
                    del active[rid]
                elif streaming and now >= next_partial:
                    partials.append((rid, {"n": n, "i": count}))
                    state[3], state[4] = count + 1, next_partial + PARTIAL_EVERY
            engine.reply_partial(partials)
            engine.reply(finals)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
