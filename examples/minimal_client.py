"""Submit a few prompts to a running coordinator and print the replies.

python examples/minimal_client.py ipc:///tmp/coordkit.sock
"""

import asyncio
import sys

from coordkit import Client


async def main(address: str) -> None:
    async with await Client.connect(address, timeout=5.0) as client:
        await client.wait_for_engines(1)
        replies = await asyncio.gather(
            client.submit("Hello, world"),  # text: sent msgpack-packed
            client.submit([101, 2009, 2003], {"max_tokens": 8}),  # token ids
        )
        for reply in replies:
            print(reply)
        async for part in client.stream([7, 8, 9]):  # partial replies, then the final
            print("stream:", part)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "ipc:///tmp/coordkit.sock"))
