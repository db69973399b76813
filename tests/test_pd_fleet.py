"""coordkit's own P/D fleet, on both implementations: FakeEngine processes with roles
(``coordkit fake-engine --role``) beside an aggregated one, a coordkit client;
conditional disaggregation (a short prompt runs whole, a long one takes both hops),
"always", and a decode killed (SIGKILL) before its read: the request is handed off
again while its prefill still pins the blocks, and ends with one reply and no pin."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coordkit import Client
from tests.support.peers import wait_for
from tests.support.processes import fake_engine_command, python_env

pytestmark = pytest.mark.timeout(90)


@contextlib.contextmanager
def engines(address: str, *specs: tuple[int, list[str]]) -> Iterator[list[subprocess.Popen]]:
    """Fake engine processes, (rank, options) each, killed at exit."""
    processes = [
        subprocess.Popen(fake_engine_command(address, rank, "--quiet", *options), env=python_env())
        for rank, options in specs
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


@pytest.fixture
def coordinator(start_coordinator) -> Callable[..., Any]:
    return functools.partial(start_coordinator, policy="prefix")


def registered(coord: Any, count: int) -> None:
    wait_for(lambda: sum(e["state"] == "alive" for e in coord.stats()["engines"]) == count, 20)


def seats(coord: Any, role: str) -> list[dict[str, Any]]:
    """The P/D room's view of the engines of ``role`` (ranks are given in the order the
    engines registered, not by their process)."""
    return [seat for seat in coord.stats()["pd"]["engines"].values() if seat["role"] == role]


async def submit_all(address: str, prompts: list[list[int]], **params: Any) -> list[Any]:
    async with await Client.connect(address, timeout=10.0) as client:
        futures = [client.submit(prompt, dict(params)) for prompt in prompts]
        return await asyncio.wait_for(asyncio.gather(*futures), 30)


def test_conditional_runs_short_prompts_whole_beside_an_aggregated_engine(coordinator):
    coord = coordinator(pd_mode="conditional", pd_threshold=64)
    with engines(
        coord.address,
        (0, ["--role", "prefill", "--batch", "4"]),
        (1, ["--role", "decode", "--batch", "4"]),
        (2, ["--batch", "4"]),
    ):
        registered(coord, 3)
        wait_for(lambda: len(coord.stats().get("pd", {}).get("engines", {})) == 2, 20)
        short = [[i] * 16 for i in range(1, 5)]
        long = [list(range(i, i + 300)) for i in range(1, 5)]
        replies = asyncio.run(submit_all(coord.address, short + long, output_tokens=4))
        assert all(len(reply["generated_tokens"]) == 4 for reply in replies)
        assert all(reply["rank"] != 0 for reply in replies[:4])  # never the prefill's
        assert all(reply["rank"] == 1 for reply in replies[4:])  # decoded at the decode
        counts = coord.stats()["pd"]["counts"]
        assert counts["whole"] == 4 and counts["requests"] == 4 and counts["handoffs"] == 4
        assert [seat["pinned"] for seat in seats(coord, "prefill")] == [0]


def test_always_takes_both_hops_and_queues_by_role(coordinator):
    coord = coordinator(pd_mode="always")
    with engines(
        coord.address,
        (0, ["--role", "prefill", "--batch", "1"]),
        (1, ["--role", "decode", "--batch", "1"]),
    ):
        registered(coord, 2)
        prompts = [list(range(i, i + 40)) for i in range(8)]
        replies = asyncio.run(submit_all(coord.address, prompts, output_tokens=3))
        assert [len(reply["generated_tokens"]) for reply in replies] == [3] * 8
        stats = coord.stats()["pd"]
        assert stats["counts"]["requests"] == 8 and stats["counts"]["pins_released"] == 8
        assert stats["queued"] == {"prefill": 0, "decode": 0} and stats["orphans"] == 0
        # A seat may be freed by a message after the one whose final reached the client.
        wait_for(
            lambda: all(s["reserved"] == 0 for s in coord.stats()["pd"]["engines"].values()), 5
        )


def test_a_decode_killed_before_its_read_hands_off_again(coordinator):
    coord = coordinator(pd_mode="always")
    slow = ["--role", "decode", "--batch", "4", "--transfer-latency", "30"]
    with engines(coord.address, (0, ["--role", "prefill", "--batch", "4"]), (1, slow)) as processes:
        registered(coord, 2)

        async def run() -> Any:
            async with await Client.connect(coord.address, timeout=10.0) as client:
                future = client.submit(list(range(1, 60)), {"output_tokens": 3})
                await asyncio.to_thread(
                    wait_for, lambda: seats(coord, "decode")[0]["reserved"] == 1, 20
                )
                with engines(coord.address, (2, ["--role", "decode", "--batch", "4"])):
                    await asyncio.to_thread(registered, coord, 3)
                    processes[1].kill()  # SIGKILL: seen by its connection's end
                    return await asyncio.wait_for(future, 30)

        reply = asyncio.run(run())
        assert reply["rank"] == 2 and len(reply["generated_tokens"]) == 3
        stats = coord.stats()["pd"]
        assert stats["counts"]["rehanded"] == 1
        assert [seat["pinned"] for seat in seats(coord, "prefill")] == [0]
        assert stats["orphans"] == 0
