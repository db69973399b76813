"""The queue's options, and an engine's capacity: each refused in one line.

``Coordinator(queue_limit=, tenant_weights=)`` and ``coordkit serve --queue-limit
--tenant-weight NAME=W``; ``Engine(capacity=N)``, declared in ENGINE_HELLO (the frames
themselves are test_engine.py's).
"""

from __future__ import annotations

import pytest

from coordkit import Coordinator, Engine
from coordkit._shared import DEFAULT_QUEUE_LIMIT, MAX_QUEUE_LIMIT
from tests.test_errors import command


def test_the_options_reach_the_loop_core(impl):
    coordinator = Coordinator(
        "tcp://127.0.0.1:0",
        implementation=impl.name,
        queue_limit=5,
        tenant_weights={"interactive": 3, "batch": 0.5},
    )
    try:
        assert coordinator.options.queue_limit == 5
        assert coordinator.options.tenant_weights == (("interactive", 3.0), ("batch", 0.5))
    finally:
        coordinator.stop()
    coordinator = Coordinator("tcp://127.0.0.1:0", implementation=impl.name)
    try:
        assert coordinator.options.queue_limit == DEFAULT_QUEUE_LIMIT
        assert coordinator.options.tenant_weights == ()
    finally:
        coordinator.stop()


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"queue_limit": -1}, ValueError, "queue_limit must be between 0 (none wait)"),
        ({"queue_limit": MAX_QUEUE_LIMIT + 1}, ValueError, f"and {MAX_QUEUE_LIMIT}"),
        ({"tenant_weights": [("a", 1)]}, TypeError, "must be a map of tenant names"),
        ({"tenant_weights": {"a": 0}}, ValueError, "tenant 'a': its weight must be a number"),
        ({"tenant_weights": {"a": 1001}}, ValueError, "in [0.001, 1000], not 1001"),
        ({"tenant_weights": {"a": "2"}}, TypeError, "not str"),
        ({"tenant_weights": {"a": True}}, TypeError, "not bool"),
        ({"tenant_weights": {"": 1}}, ValueError, "tenant must be a str of 1 to 128 bytes"),
        ({"tenant_weights": {7: 1}}, TypeError, "tenant must be a str"),
    ],
)
def test_bad_queue_options_are_one_line(impl, options, error, text):
    with pytest.raises(error) as caught:
        Coordinator("tcp://127.0.0.1:0", implementation=impl.name, **options)
    assert text in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--tenant-weight", "a"], "argument --tenant-weight: expected NAME=W, not 'a'"),
        (["--tenant-weight", "a=x"], "argument --tenant-weight: the weight of 'a' is not a number"),
        (["--tenant-weight", "a=1", "--tenant-weight", "a=2"], "a tenant is given --tenant-weight"),
        (["--tenant-weight", "a=0"], "tenant 'a': its weight must be a number in [0.001, 1000]"),
        (["--queue-limit", "-1"], "queue_limit must be between 0 (none wait)"),
    ],
)
def test_serve_refuses_bad_queue_options_in_one_line(args, line):
    result = command("serve", "--bind", "tcp://127.0.0.1:0", "--implementation", "py", *args)
    assert result.returncode == 2
    [text] = result.stderr.splitlines()
    assert text.startswith("coordkit serve: ") and line in text


@pytest.mark.parametrize(
    ("capacity", "error"), [(-1, ValueError), (1 << 31, ValueError), (2.0, TypeError)]
)
def test_a_bad_capacity_is_refused_before_anything_opens(impl, capacity, error):
    with pytest.raises(error, match=r"capacity must be an int in \[0, 2147483647\]"):
        Engine("ipc:///nonexistent", implementation=impl.name, capacity=capacity)
