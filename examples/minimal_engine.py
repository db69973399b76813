"""A minimal engine rank: the step loop of an inference engine, on coordkit.Engine.

Each step takes in what arrived, "runs" the batch (here: echoes each prompt
reversed) and sends everything that finished as one batched reply.

    python examples/minimal_engine.py ipc:///tmp/coordkit.sock [RANK]
"""

import sys

from coordkit.engine import Abort, Control, Engine, Request
from coordkit.protocol import Header


def main(address: str, rank: int) -> None:
    with Engine(address, rank, heartbeat_interval=1.0) as engine:
        batch: dict[int, Request] = {}
        paused = False
        while True:
            for event in engine.poll(timeout=1.0 if paused or not batch else 0.0):
                if isinstance(event, Request):
                    batch[event.server_rid] = event
                elif isinstance(event, Abort) and batch.pop(event.server_rid, None):
                    engine.reply([(event.server_rid, {"status": "aborted"})])
                elif isinstance(event, Control):
                    if event.header == Header.STOP:
                        engine.disconnect()
                        return
                    if event.header in (Header.PAUSE, Header.UNPAUSE):
                        paused = event.header == Header.PAUSE
            if paused:
                continue
            engine.reply(
                (rid, {"request_id": rid, "status": "finished", "echo": r.prompt_tokens()[::-1]})
                for rid, r in batch.items()
            )
            batch.clear()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
