"""The pytest plugin of tests/ and bench/ (registered by the root conftest.py).

``impl`` is parametrised over the two implementations, ids ``[c]`` and ``[py]``:
a namespace with the ``codec``, ``Router`` and ``Coordinator`` of either. Where
the extension does not import the ``[c]`` cases skip, unless
``COORDKIT_REQUIRE_EXTENSION=1`` (CI), where they fail.

``make_cluster`` and ``make_coordinator`` build coordinators of ``impl`` on
fresh sockets in the test's tmp_path; ``cluster`` is one with a single engine.

``zmqutil`` (a host's own Cython code on coordkit's public ``__init__.pxd``),
the C ``codec_extras`` (the codec's test-only functions) and the C queue room
alone (``c_queue``) are compiled once per session (see extension.py);
``codec_extras`` and ``queue_type`` are the C or the Python one, by ``impl``.
``vendored`` is a copy of coordkit built under another package name (see
vendoring.py). Where one does not build or import, its tests skip, or fail under
``COORDKIT_REQUIRE_EXTENSION=1``.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from coordkit import Coordinator, coordinator
from coordkit._loop_py.queue import Queue as PyQueue
from coordkit.curve import keygen
from tests.support import codec_extras as py_codec_extras
from tests.support import extension, vendoring
from tests.support.cluster import Cluster, bind_address
from tests.support.etcd import etcd  # noqa: F401  (a fixture: registered by being here)
from tests.support.implementations import load, unavailable

IMPLEMENTATIONS = [
    pytest.param("c", marks=pytest.mark.c_extension, id="c"),
    pytest.param("py", id="py"),
]


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch) -> None:
    """A coordinator made in this process starts its server ids and its epoch at 0,
    not at the clock: its frames are then the same from run to run and from one
    implementation to the other. (A test of a restart in-process takes real_clock;
    the coordinator processes of the failover tests run on the clock.)"""
    monkeypatch.setattr(coordinator, "_clock_ns", lambda: 0)


@pytest.fixture
def real_clock(pinned_clock, monkeypatch) -> None:
    """Coordinators made in this test start their server ids and epoch at the clock."""
    monkeypatch.setattr(coordinator, "_clock_ns", time.time_ns)


# Session scope: an implementation is a set of imported modules, loaded once.
@pytest.fixture(scope="session", params=IMPLEMENTATIONS)
def impl(request) -> SimpleNamespace:
    return load(request.param)


@pytest.fixture(scope="session")
def c_impl() -> SimpleNamespace:
    return load("c")


@pytest.fixture(scope="session")
def py_impl() -> SimpleNamespace:
    return load("py")


@pytest.fixture
def make_coordinator(impl, tmp_path) -> Callable[..., Any]:
    """``make_coordinator(transport="ipc", **options)``: a coordinator, not yet started."""
    names = itertools.count()

    def make(transport: str = "ipc", **options: Any) -> Any:
        address = bind_address(transport, tmp_path, f"coord{next(names)}")
        return Coordinator(address, implementation=impl.name, **options)

    return make


@pytest.fixture
def start_coordinator(make_coordinator) -> Iterator[Callable[..., Any]]:
    """``start_coordinator(**options)``: a coordinator started on its thread, stopped at
    the test's end."""
    made = []

    def make(**options: Any) -> Any:
        coord = make_coordinator(**options)
        coord.start()
        made.append(coord)
        return coord

    yield make
    for coord in made:
        coord.stop()


@pytest.fixture
def kv_dir() -> Iterator[str]:
    """A directory for #6675 peers' KV files and ipc sockets, under /tmp: ipc paths
    are short."""
    path = tempfile.mkdtemp(prefix="pdkv", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_cluster(impl, tmp_path) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(n_engines=0, transport="ipc", **options)``: a running Cluster.

    Every one it made is closed at teardown, even one a test left open.
    """
    names = itertools.count()
    made: list[Cluster] = []

    def make(n_engines: int = 0, transport: str = "ipc", **options: Any) -> Cluster:
        address = bind_address(transport, tmp_path, f"coord{next(names)}")
        made.append(Cluster(impl, address, n_engines, **options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def cluster(make_cluster) -> Iterator[Cluster]:
    """A running coordinator with one raw engine."""
    with make_cluster(n_engines=1) as c:
        yield c


def _built(name: str, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    try:
        return extension.build(name, tmp_path_factory.mktemp(name))
    except extension.BuildError as exc:
        reason, details = str(exc), exc.output
    except ImportError as exc:  # built, but it could not bind to pyzmq's libzmq
        reason, details = f"{name} did not import: {exc}", ""
    unavailable(reason, details)  # outside the except: no "during handling" chain


@pytest.fixture(scope="session")
def zmqutil(tmp_path_factory) -> ModuleType:
    return _built("_zmqutil_c", tmp_path_factory)


@pytest.fixture(scope="session")
def c_codec_extras(tmp_path_factory) -> ModuleType:
    return _built("_codec_extras_c", tmp_path_factory)


@pytest.fixture(scope="session")
def c_queue(tmp_path_factory) -> ModuleType:
    """The loop's queue room in C, alone (_queue_c.pyx)."""
    return _built("_queue_c", tmp_path_factory)


@pytest.fixture(scope="session")
def queue_type(impl, request) -> type:
    """The queue room of ``impl``: the C one (under the twin's method names) or the
    Python one."""
    if impl.name == "c":
        return request.getfixturevalue("c_queue").Room
    return PyQueue


@pytest.fixture(scope="session")
def codec_extras(impl, request) -> ModuleType:
    """The codec's test-only functions (encode, decode, rewrite_submit, write_header,
    blake2b) of ``impl``: the C ones built on the C codec, or the Python ones."""
    if impl.name == "c":
        return request.getfixturevalue("c_codec_extras")
    return py_codec_extras


@pytest.fixture(scope="session")
def vendored(tmp_path_factory) -> vendoring.Vendored:
    try:
        return vendoring.build(tmp_path_factory.mktemp("vendored"))
    except extension.BuildError as exc:
        reason, details = str(exc), exc.output
    unavailable(reason, details)


@pytest.fixture
def keys(tmp_path) -> Path:
    """CURVE keys in tmp_path: the coordinator's pair (server/), two admitted
    peers (admitted/client, admitted/engine) and one stranger (strangers/mallory)."""
    keygen(tmp_path / "server", "coordinator")
    for name in ("client", "engine"):
        keygen(tmp_path / "admitted", name)
    keygen(tmp_path / "strangers", "mallory")
    return Path(tmp_path)
