"""A whole cluster in one script: a coordinator, two fake engines and a client.

Everything talks over ipc sockets in a temporary directory.

    python examples/cluster.py
"""

import asyncio
import tempfile
import threading

import coordkit
from coordkit import Client
from coordkit.tools.fake_engine import FakeEngine


async def use(address: str) -> None:
    async with await Client.connect(address) as client:
        await client.wait_for_engines(2)
        prompts = [[i, i + 1, i + 2] for i in range(8)]
        for reply in await asyncio.gather(*(client.submit(p) for p in prompts)):
            print(f"rank {reply['rank']}: {reply['generated_tokens']}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, coordkit.Coordinator(f"ipc://{tmp}/c.sock") as coord:
        stop = threading.Event()
        engines = [FakeEngine(coord.address, rank) for rank in range(2)]
        threads = [threading.Thread(target=engine.run, args=(stop,)) for engine in engines]
        for thread in threads:
            thread.start()
        try:
            asyncio.run(use(coord.address))
        finally:
            stop.set()
            for thread, engine in zip(threads, engines, strict=True):
                thread.join()
                engine.close()


if __name__ == "__main__":
    main()
