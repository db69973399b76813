"""The bench's fixed parameters: what is measured, with what traffic, for how long.

Shared by the bench and its child processes: the variants and prompt
lengths, the shape of the requests and replies every variant carries (built
here), and how long a point may go without progress.
"""

from __future__ import annotations

import argparse
import random

from ...protocol import Header, packb

VARIANTS = ("floor", "c", "c-metrics", "py", "mono")
#: The coordkit variants, and the implementation each runs on.
IMPLEMENTATIONS = {"c": "c", "c-metrics": "c", "py": "py"}
LENGTHS = (16, 256, 2000, 8000, 32000)
RANKS = 2  # engine sockets in the one engine process
BATCH = 8  # finished requests per ENGINE_REPLY, at most
VOCAB = 150_000  # token ids are drawn below this
OUTPUT_TOKENS = 32  # generated tokens (and logprobs) in every reply body
BLOCK_SIZE = 16  # tokens per block hash with --policy prefix
MEMORY_PROMPT_TOKENS = 16  # the memory test measures per-request state, not prompts
SAMPLING = {
    "temperature": 0.8,
    "top_k": 0,
    "top_p": 0.95,
    "num_tokens_to_generate": OUTPUT_TOKENS,
    "return_log_probs": True,
    "termination_id": 2,
}

TIMEOUT = 60.0  # seconds without progress before a point is declared failed
# Plain ints: the loops compare them per message.
CONNECT, CONNECT_ACK = int(Header.CONNECT), int(Header.CONNECT_ACK)
SUBMIT, REPLY = int(Header.SUBMIT_REQUEST), int(Header.ENGINE_REPLY)


def requests_at(args: argparse.Namespace, tokens: int) -> int:
    # Long prompts cost mostly copies: fewer requests keep the run short.
    return max(args.requests // 8, min(args.requests, args.requests * 2000 // tokens), 1)


def prompt_tokens(tokens: int) -> list[int]:
    """A prompt of ``tokens`` random token ids, the same one for every variant."""
    rng = random.Random(tokens)
    return [rng.randrange(VOCAB) for _ in range(tokens)]


def reply_body() -> bytes:
    """What a finished request's ENGINE_REPLY entry carries: a realistic msgpack map."""
    rng = random.Random(0)
    return packb(
        {
            "status": "COMPLETED",
            "generated_tokens": [rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)],
            "generated_log_probs": [-rng.expovariate(2.0) for _ in range(OUTPUT_TOKENS)],
            "generated_length": OUTPUT_TOKENS,
            "finish_reason": "length",
            "latency": 0.4821,
        }
    )
