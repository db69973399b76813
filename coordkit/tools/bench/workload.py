"""The bench's fixed parameters: what is measured, with what traffic, for how long.

Shared by the bench and its child processes: the variants, the prompts (and
the size thresholds of the loop their packed bytes must cross), the shape of
the requests and replies every variant carries (built here), and how long a
point may go without progress.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from ..._shared import COPY_BELOW
from ...protocol import Header, packb

VARIANTS = (
    "floor",
    "c",
    "c-metrics",
    "py",
    "mono",
    "c-queued",
    "c-trace-1",
    "c-trace-100",
    "c-kv-events",
)
#: The variants run when none is named (the traced ones are asked for by name).
DEFAULT_VARIANTS = VARIANTS[:5]
#: ``c-queued``'s cap per engine rank: of the client's window (512) the rest waits in
#: the coordinator's queue, so that nearly every request is queued, then dispatched.
QUEUED_CAPACITY = 32
#: The traced variants: ``c`` tracing that share of its requests (``trace_sample``).
TRACE_SAMPLES = {"c-trace-1": 0.01, "c-trace-100": 1.0}
#: ``c-kv-events``: ``c`` subscribed to each engine rank's KV-cache events (vLLM's wire
#: format), which the engine process publishes as if every prompt missed its cache: a
#: BlockStored per full block of each prompt (under ids of its own, so each is new) and a
#: BlockRemoved per block its LRU of KV_CACHE_BLOCKS per rank evicts, a batch per reply.
KV_EVENTS = ("c-kv-events",)
KV_CACHE_BLOCKS = 4096
#: The variants that need an optional dependency: its module, and the extra installing it.
REQUIRES = {
    "c-metrics": ("prometheus_client", "metrics"),
    **dict.fromkeys(TRACE_SAMPLES, ("opentelemetry.sdk.trace", "otel")),
}
#: The coordkit variants, and the implementation each runs on.
IMPLEMENTATIONS = {
    "c": "c",
    "c-metrics": "c",
    "c-queued": "c",
    "py": "py",
    **dict.fromkeys(TRACE_SAMPLES, "c"),
    **dict.fromkeys(KV_EVENTS, "c"),
}
#: No coordinator: the clients on the engine itself (--latency's baselines; ``-sf``:
#: in single frames, mono's, whatever the dialect).
DIRECT = ("direct", "direct-sf")
LENGTHS = (16, 256, 2000, 8000, 32000)  # random-id prompts of the cost table
#: ``--workload``: the load the cost table measures. ``standard``: the engine waits for
#: full batches of BATCH, the bodies carry OUTPUT_TOKENS tokens and log probs, the prompts
#: cross every threshold. ``megatron``: the load as Megatron's peers make it -- the engine
#: answers what it reads at once, up to ECHO_BATCH per ENGINE_REPLY; MEGATRON_LENGTHS
#: prompts of random and of small (``range``) ids and the prompts either side of every
#: threshold, each with both of MEGATRON_BODIES.
WORKLOADS = ("standard", "megatron")
MEGATRON_LENGTHS = (16, 2000, 32000)
#: The megatron workload's reply bodies: ``small`` (about 200 bytes: 24 tokens, no log
#: probs) and ``realistic`` (about 1.3 KB: 64 tokens, their log probs and per-token times).
MEGATRON_BODIES = ("small", "realistic")
MEGATRON_OUTPUT_TOKENS = 24
REALISTIC_OUTPUT_TOKENS = 64
RANKS = 2  # engine ranks in the one engine process
BATCH = 8  # finished requests per ENGINE_REPLY, at most
ECHO_BATCH = 16  # the same for an engine answering at once (the endpoints' echo engine)
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

#: Sizes (bytes of the frame that carries a prompt to the loop) where the
#: loop's handling changes: below COPY_BELOW a kept prompt shares libzmq's
#: receive buffer (shared while fewer than SHARED_SMALL_MAX are, then copied),
#: from it a buffer of its own; from POOLED_FROM a forwarded prompt's
#: frame comes from the loop's buffer pool (``includes/framepool.h``: ``ck_buffer_msg``
#: pools sizes from half of ``1 << CK_BUFFER_MIN_SHIFT``), below it from malloc.
POOLED_FROM = 1 << 15
THRESHOLDS = {"copy": COPY_BELOW, "pool": POOLED_FROM}
#: How far from a threshold its edge prompts sit: more than the few bytes a
#: request id adds to a single frame as it grows.
EDGE_MARGIN = 16
RANGE_LENGTHS = (16, 2000)  # list(range(n)) prompts of the cost table: small ids pack smaller

#: Fields of a single-frame SUBMIT by the Megatron-Core release the load speaks
#: (--megatron-version): 0.19's ``[20, rid, prompt, sampling_params]``, and main's
#: with its ``multi_modal_data`` after them (nil: a text request).
SUBMIT_FIELDS = {"0.19": 4, "main": 5, "pr6675": 4}  # #6675's client has no multimodal field

TIMEOUT = 60.0  # seconds without progress before a point is declared failed
# Plain ints: the loops compare them per message.
CONNECT, CONNECT_ACK = int(Header.CONNECT), int(Header.CONNECT_ACK)
SUBMIT, REPLY = int(Header.SUBMIT_REQUEST), int(Header.ENGINE_REPLY)

_CHUNK = 1024  # random ids are drawn in chunks, chunk i from Random(i):
_random_ids: list[int] = []  # one sequence, the same in every process; prompts are its prefixes


@dataclass(frozen=True)
class Prompt:
    """``tokens`` token ids: random below VOCAB, or ``list(range(tokens))`` (``ids="range"``);
    answered with the workload's body, or one of MEGATRON_BODIES (``body``)."""

    tokens: int
    ids: str = "random"
    body: str = ""

    def token_ids(self) -> list[int]:
        if self.ids == "range":
            return list(range(self.tokens))
        while len(_random_ids) < self.tokens:
            rng = random.Random(len(_random_ids) // _CHUNK)
            _random_ids.extend(rng.randrange(VOCAB) for _ in range(_CHUNK))
        return _random_ids[: self.tokens]

    @property
    def key(self) -> str:
        """How the JSON and ``--lengths`` name it: ``2000``, ``2000:range``,
        ``2000:range/realistic``."""
        key = str(self.tokens) if self.ids == "random" else f"{self.tokens}:{self.ids}"
        return f"{key}/{self.body}" if self.body else key

    def packed_bytes(self) -> int:
        return len(packb(self.token_ids()))

    def frame_bytes(self, single_frame: bool, fields: int = 4) -> int:
        """The bytes of the frame that carries it: the prompt's own frame, or (Megatron-Core's
        single frame) the whole ``[20, rid, prompt, sampling_params]`` with a 1-byte rid,
        and main's nil multi_modal_data after them (``fields`` 5)."""
        if not single_frame:
            return self.packed_bytes()
        return 3 + self.packed_bytes() + len(packb(SAMPLING)) + fields - 4

    def describe(self, single_frame: bool = False, fields: int = 4) -> dict[str, int | str]:
        """What a JSON record says of it."""
        return {
            "prompt": self.key,
            "tokens": self.tokens,
            "ids": self.ids,
            "prompt_bytes": self.packed_bytes(),
            "frame_bytes": self.frame_bytes(single_frame, fields),
            "body": self.body,
        }


def parse_prompt(spec: str) -> Prompt:
    """``--lengths`` items: ``N`` (random ids) or ``N:range``, then ``/BODY`` or not."""
    prompt, _, body = spec.partition("/")
    tokens, _, ids = prompt.partition(":")
    if (
        not tokens.isdigit()
        or int(tokens) < 1
        or ids not in ("", "random", "range")
        or (body and body not in MEGATRON_BODIES)
    ):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected TOKENS or TOKENS:range, then /small or /realistic or not"
        )
    return Prompt(int(tokens), ids or "random", body)


def edge_prompts(single_frame: bool, fields: int = 4) -> list[Prompt]:
    """Random-id prompts whose frame sits just below and just above each of THRESHOLDS."""
    edges = []
    for threshold in THRESHOLDS.values():
        below = _fewest(single_frame, fields, threshold - EDGE_MARGIN + 1) - 1
        edges += [Prompt(below), Prompt(_fewest(single_frame, fields, threshold + EDGE_MARGIN))]
    return edges


def _fewest(single_frame: bool, fields: int, size: int) -> int:
    """The fewest random token ids whose frame has at least ``size`` bytes (a bisection:
    a prefix of more ids never packs smaller)."""
    low, high = 1, 1
    while Prompt(high).frame_bytes(single_frame, fields) < size:
        low, high = high, high * 2
    while low < high:
        middle = (low + high) // 2
        if Prompt(middle).frame_bytes(single_frame, fields) < size:
            low = middle + 1
        else:
            high = middle
    return high


def standard_prompts(single_frame: bool, fields: int = 4) -> list[Prompt]:
    """The cost table's prompts, by frame size: LENGTHS, RANGE_LENGTHS and every edge."""
    prompts = {Prompt(n) for n in LENGTHS} | {Prompt(n, "range") for n in RANGE_LENGTHS}
    prompts.update(edge_prompts(single_frame, fields))
    return sorted(prompts, key=lambda p: (p.frame_bytes(single_frame, fields), p.key))


def megatron_prompts(single_frame: bool, fields: int = 4) -> list[Prompt]:
    """The megatron workload's, by frame size: MEGATRON_LENGTHS of random and of small
    ids, and every edge, each answered with every one of MEGATRON_BODIES."""
    shapes = [Prompt(n, ids) for n in MEGATRON_LENGTHS for ids in ("random", "range")]
    shapes += edge_prompts(single_frame, fields)
    prompts = [Prompt(p.tokens, p.ids, body) for p in shapes for body in MEGATRON_BODIES]
    return sorted(prompts, key=lambda p: (p.frame_bytes(single_frame, fields), p.key))


def requests_at(args: argparse.Namespace, tokens: int) -> int:
    if args.workload == "megatron":  # as the black-box measure: every length alike
        return int(args.requests)
    # Long prompts cost mostly copies: fewer requests keep the run short.
    return max(args.requests // 8, min(args.requests, args.requests * 2000 // tokens), 1)


def warmup_at(args: argparse.Namespace, n: int) -> int:
    """The requests that warm a cost point of ``n`` up (megatron: a quarter of them)."""
    if args.workload == "megatron":
        return max(2 * args.window, n // 4)
    return min(n, max(2 * args.window, n // 20))


def reply_body(workload: str = "standard", body: str = "") -> bytes:
    """What a finished request's ENGINE_REPLY entry carries: a msgpack map of the
    workload's shape, or of ``body``'s (MEGATRON_BODIES; the megatron workload's default
    is ``small``)."""
    rng = random.Random(0)
    kind = body or ("small" if workload == "megatron" else "standard")
    tokens = {"small": MEGATRON_OUTPUT_TOKENS, "realistic": REALISTIC_OUTPUT_TOKENS}.get(
        kind, OUTPUT_TOKENS
    )
    out: dict[str, object] = {
        "status": "COMPLETED",
        "generated_tokens": [rng.randrange(VOCAB) for _ in range(tokens)],
    }
    if kind != "small":
        out["generated_log_probs"] = [-rng.expovariate(2.0) for _ in range(tokens)]
    if kind == "realistic":  # seconds per output token, as Megatron's engines time them
        out["tpot"] = [0.02 + rng.random() / 100 for _ in range(tokens)]
    out.update(generated_length=tokens, finish_reason="length", latency=0.4821)
    return packb(out)
