"""Client: a tenant in CONNECT, a request's priority and deadline on the wire, frame by
frame against a scripted coordinator, on both cores.

The QoS fields go right after the request id (``[20, rid, priority, deadline_ms,
params]``, a SUBMIT_BATCH entry ``[rid, priority, deadline_ms, params, hashed]``), only
when the coordinator granted ``"qos"`` and only when either is not its default; they
are checked whatever the coordinator, in one line. A differential test runs random
calls through both cores and compares every frame sent.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit import Client
from coordkit.protocol import unpackb
from tests.support.peers import CONNECT, CONNECT_ACK, RESEND, SUBMIT, SUBMIT_BATCH
from tests.support.scripted import TIMEOUT, Script, packb, run, same_frames, scripted


def test_priority_and_deadline_follow_the_rid(tmp_path, impl):
    """Not batched: each request its own SUBMIT, the QoS after its rid when either is not
    the default (the deadline in whole milliseconds, rounded up)."""

    async def body():
        async with scripted(tmp_path, impl, qos=True, batch=False) as (script, client):
            client.submit([1])
            client.submit([2], priority=-1)
            client.submit([3], {"t": 1}, deadline=0.2501)
            client.stream([4], priority=127, deadline=2)
            client.submit([5], priority=0, deadline=None)
            assert await script.recv() == [packb([SUBMIT, 0, {}]), packb([1])]
            assert await script.recv() == [packb([SUBMIT, 1, -1, 0, {}]), packb([2])]
            assert await script.recv() == [packb([SUBMIT, 2, 0, 251, {"t": 1}]), packb([3])]
            meta = packb([SUBMIT, 3, 127, 2000, {"stream": True}])
            assert await script.recv() == [meta, packb([4])]
            assert await script.recv() == [packb([SUBMIT, 4, {}]), packb([5])]

    run(body())


def test_batched_entries_carry_them_one_by_one(tmp_path, impl):
    """Batched: an entry with QoS has 5 fields, one without 3, in one SUBMIT_BATCH; a lone
    request with QoS goes as a SUBMIT of 5; submit_many gives them to every entry."""

    async def body():
        async with scripted(tmp_path, impl, grant=True, qos=True) as (script, client):
            client.submit([1], priority=-2)
            client.submit([2])
            client.submit([3], deadline=0.001, block_size=1)
            entries = [[0, -2, 0, {}, False], [1, {}, False], [2, 0, 1, {}, True]]
            frames = await script.recv()
            assert frames[:4] == [packb([SUBMIT_BATCH, entries]), packb([1]), packb([2])] + [
                packb([3])
            ]
            client.submit([4], priority=5)  # alone in its iteration
            assert await script.recv() == [packb([SUBMIT, 3, 5, 0, {}]), packb([4])]
            client.submit_many([[5], [6]], priority=1, deadline=3)
            entries = [[4, 1, 3000, {}, False], [5, 1, 3000, {}, False]]
            assert await script.recv() == [packb([SUBMIT_BATCH, entries])] + [
                packb([5]),
                packb([6]),
            ]

    run(body())


def test_not_sent_unless_granted_but_always_checked(tmp_path, impl):
    """A coordinator that does not queue is sent no QoS (nothing there waits); a bad
    priority or deadline is refused in one line whatever the coordinator, and nothing
    of the call is sent."""

    async def body():
        async with scripted(tmp_path, impl, batch=False) as (script, client):
            assert not client.qos
            client.submit([1], priority=3, deadline=1)
            assert await script.recv() == [packb([SUBMIT, 0, {}]), packb([1])]
            for kwargs, error, text in [
                ({"priority": 128}, ValueError, "priority must be an int in [-128, 127]"),
                ({"priority": 1.0}, TypeError, "not float"),
                ({"priority": True}, TypeError, "not bool"),
                ({"deadline": 0}, ValueError, "deadline must be seconds"),
                ({"deadline": float("nan")}, ValueError, "not nan"),
                ({"deadline": "1"}, TypeError, "not str"),
            ]:
                for call in (client.submit, client.stream):
                    with pytest.raises(error) as caught:
                        call([1], **kwargs)
                    assert text in str(caught.value)
                    assert "\n" not in str(caught.value)
                with pytest.raises(error):
                    client.submit_many([[1], [2]], **kwargs)
            await script.silent()
            assert client.pending == 1

    run(body())


def test_the_tenant_is_named_in_connect(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, qos=True, tenant="acme") as (_, client):
            assert client.tenant == "acme"

    run(body())


@pytest.mark.parametrize(
    ("tenant", "error"),
    [("", ValueError), ("x" * 129, ValueError), (b"acme", TypeError), (7, TypeError)],
)
def test_a_bad_tenant_is_refused_before_anything_opens(impl, tenant, error):
    with pytest.raises(error, match="tenant must be a str of 1 to 128 bytes"):
        run(Client.connect("ipc:///nonexistent", implementation=impl.name, tenant=tenant))


def test_resend_keeps_priority_and_deadline(tmp_path, impl):
    """A rebuild client asked to send a request again sends it with its QoS."""
    granted = packb([CONNECT_ACK, {"rebuild": 1, "epoch": 1, "qos": 1}])

    async def body():
        script = Script(tmp_path)
        connecting = asyncio.ensure_future(
            Client.connect(script.address, implementation=impl.name, timeout=TIMEOUT, batch=False)
        )
        assert unpackb((await script.recv())[0])[0] == CONNECT
        await script.send(granted)
        async with await connecting as client:
            client.submit([1], priority=-5, deadline=0.5)
            sent = [packb([SUBMIT, 0, -5, 500, {}]), packb([1])]
            assert await script.recv() == sent
            await script.send(packb([RESEND, [0]]))
            assert await script.recv() == sent
        script.close()

    run(body())


# -- both cores, the same frames --------------------------------------------------------

qos_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.integers(-128, 127),
        "deadline": st.none() | st.floats(0.0005, 1e6),
    },
)
calls = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["submit", "stream"]), st.lists(st.integers(0, 9)), qos_kwargs),
        st.tuples(st.just("many"), st.lists(st.lists(st.integers(0, 9)), max_size=3), qos_kwargs),
        st.tuples(st.just("yield")),
    ),
    max_size=10,
)


async def _play(client, script_calls) -> None:
    for name, *args in script_calls:
        if name == "many":
            client.submit_many(args[0], **args[1])
        elif name != "yield":
            getattr(client, name)(args[0], **args[1])
        else:
            await asyncio.sleep(0)


@pytest.mark.c_extension
@settings(max_examples=30, deadline=None)
@given(script_calls=calls, grant=st.booleans())
def test_differential_frames(c_impl, py_impl, tmp_path_factory, script_calls, grant):
    play = functools.partial(_play, script_calls=script_calls)
    same_frames(c_impl, py_impl, tmp_path_factory, play, grant=grant, qos=True)
