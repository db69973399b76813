"""coordkit vendored into a host package under another name, as docs/building.md says to do it.

:func:`build` copies the coordkit under test into a host tree,
``src/hoststack/_vendor/coordkit``, writes the host's ``setup.py`` (``HOST_SETUP``,
the snippet of docs/building.md, word for word) and builds it
with ``python setup.py build_ext --inplace`` in a child Python (extension.run),
once per test session.

Run as a script, this module is a child Python that imports one or two copies
by their package names and runs round trips through them: a coordinator, an
engine and a client, on both implementations; with two copies, each one's
coordinator serving the other's engine and client, and both clusters at once.
It imports nothing but the standard library until it is told where to look
(``--path``), so that it can run with no top-level coordkit anywhere on its
path, and prints what it found as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

#: The vendored copy's package, and where the host keeps it.
PACKAGE = "hoststack._vendor.coordkit"
PATH = "src/hoststack/_vendor/coordkit"

#: The host's setup.py: docs/building.md's, word for word (test_vendoring holds them together).
HOST_SETUP = """\
import runpy

from setuptools import setup

build = runpy.run_path("src/hoststack/_vendor/coordkit/_build.py")
setup(
    package_dir={"": "src"},
    ext_modules=build["extensions"](
        package="hoststack._vendor.coordkit", path="src/hoststack/_vendor/coordkit"
    ),
)
"""
#: The command that builds it, in the host's directory.
BUILD = ["setup.py", "build_ext", "--inplace"]

#: What a copy of the package leaves behind: the products of a build.
BUILD_PRODUCTS = ("*.so", "*.c", "*.html", "__pycache__", "build")

#: The third-party packages coordkit imports (pyzmq's bundled libzmq beside it, if any).
DEPENDENCIES = ("zmq", "pyzmq.libs", "msgpack")

TIMEOUT = 10.0  # seconds for a connection, an engine to register, a reply


@dataclass(frozen=True)
class Vendored:
    """A host tree with coordkit vendored and built in it."""

    root: Path  # the host's directory: its setup.py
    src: Path  # what goes on sys.path: hoststack/ is in it
    deps: Path  # pyzmq and msgpack alone, for a path with no top-level coordkit


def build(directory: Path) -> Vendored:
    """Vendor the coordkit under test into a host tree in ``directory`` and build it."""
    from tests.support import extension

    root = directory / "host"
    package = root / PATH
    shutil.copytree(
        extension.package_dir(), package, ignore=shutil.ignore_patterns(*BUILD_PRODUCTS)
    )
    for parent in (package.parent, package.parent.parent):  # _vendor/, hoststack/
        (parent / "__init__.py").touch()
    (root / "setup.py").write_text(HOST_SETUP)
    extension.run(PACKAGE, [sys.executable, *BUILD], root)
    return Vendored(root, root / "src", _dependencies(directory / "deps"))


def _dependencies(directory: Path) -> Path:
    """A directory that holds links to pyzmq and msgpack, and nothing else."""
    import msgpack
    import zmq

    directory.mkdir()
    site = Path(zmq.__file__).parent.parent
    for name in DEPENDENCIES:
        found = Path(msgpack.__file__).parent if name == "msgpack" else site / name
        if found.exists():
            (directory / name).symlink_to(found, target_is_directory=True)
    return directory


# -- the child ------------------------------------------------------------------------------


@contextlib.contextmanager
def _engine(ck: ModuleType, address: str, implementation: str) -> Iterator[None]:
    """One FakeEngine of ``ck`` on a thread, serving the coordinator at ``address``."""
    fake_engine = importlib.import_module(f"{ck.__name__}.tools.fake_engine")
    engine = fake_engine.FakeEngine(
        address, 0, heartbeat_interval=None, implementation=implementation, output_tokens=4
    )
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(TIMEOUT)
        engine.close()


async def _requests(ck: ModuleType, address: str, implementation: str) -> int:
    """Prompts through ``ck``'s Client, each answered as a FakeEngine answers it."""
    fake_engine = importlib.import_module(f"{ck.__name__}.tools.fake_engine")
    prompts: list[Any] = [[1, 2, 3], "text", list(range(5000))]  # the last is pinned, not copied
    async with await ck.Client.connect(
        address, timeout=TIMEOUT, implementation=implementation
    ) as client:
        await client.wait_for_engines(1, timeout=TIMEOUT)
        replies = await asyncio.gather(*(client.submit(p) for p in prompts))
        replies += await asyncio.gather(*client.submit_many(prompts))
    for prompt, reply in zip(prompts + prompts, replies, strict=True):
        expected = fake_engine.FakeEngine.generate(prompt, 4)
        if reply["generated_tokens"] != expected:
            raise AssertionError(f"{prompt!r:.40}: {reply!r:.200}")
    return len(replies)


def _through(coordinator: ModuleType, peers: ModuleType, address: str, implementation: str) -> int:
    """``coordinator``'s Coordinator serving ``peers``' engine and client."""
    with (
        coordinator.Coordinator(address, implementation=implementation),
        _engine(peers, address, implementation),
    ):
        return asyncio.run(_requests(peers, address, implementation))


async def _at_once(copies: list[ModuleType], addresses: list[str], implementation: str) -> int:
    counts = await asyncio.gather(
        *(_requests(ck, a, implementation) for ck, a in zip(copies, addresses, strict=True))
    )
    return sum(counts)


def _clusters_at_once(copies: list[ModuleType], directory: str, implementation: str) -> int:
    """Every copy's own cluster running at the same time, in this one process."""
    addresses = [f"ipc://{directory}/{implementation}-{ck.__name__}" for ck in copies]
    with contextlib.ExitStack() as stack:
        for ck, address in zip(copies, addresses, strict=True):
            stack.enter_context(ck.Coordinator(address, implementation=implementation))
            stack.enter_context(_engine(ck, address, implementation))
        return asyncio.run(_at_once(copies, addresses, implementation))


async def _through_tool_engine(ck: ModuleType, directory: str) -> int:
    """``ck``'s coordinator and a fake engine process started by ``ck``'s own tools."""
    engines = importlib.import_module(f"{ck.__name__}.tools.engines")
    address = f"ipc://{directory}/tool-engine"
    with (
        ck.Coordinator(address),
        engines.fake_engine_processes(address, 1, ["--output-tokens", "4"]),
    ):
        return await _requests(ck, address, ck.IMPLEMENTATION)


def _describe(ck: ModuleType) -> dict[str, Any]:
    c = ck.load_implementation("c")
    return {
        "file": ck.__file__,
        "implementation": ck.IMPLEMENTATION,
        "cores": {role: getattr(c, role).__name__ for role in ("codec", "loop", "client")},
        "core_files": [getattr(c, role).__file__ for role in ("codec", "loop", "client")],
        "logger": importlib.import_module(f"{ck.__name__}._shared").logger.name,
        "tool_engine_command": importlib.import_module(f"{ck.__name__}.tools.engines").PACKAGE,
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", action="append", default=[], help="put first on sys.path")
    parser.add_argument("--dir", required=True, help="for the ipc endpoints")
    parser.add_argument("--tool-engine", action="store_true", help="also run a tool's engine")
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args(argv)
    sys.path[:0] = args.path
    report: dict[str, Any] = {"coordkit_importable": True}
    try:
        importlib.import_module("coordkit")
    except ImportError:
        report["coordkit_importable"] = False
    copies = [importlib.import_module(name) for name in args.packages]
    report["copies"] = {ck.__name__: _describe(ck) for ck in copies}
    requests: dict[str, int] = {}
    for implementation in ("c", "py"):
        for coordinator in copies:
            for peers in copies:
                name = f"{implementation}: {coordinator.__name__} serving {peers.__name__}"
                address = f"ipc://{args.dir}/{implementation}-{len(requests)}"
                requests[name] = _through(coordinator, peers, address, implementation)
        if len(copies) > 1:
            requests[f"{implementation}: at once"] = _clusters_at_once(
                copies, args.dir, implementation
            )
    if args.tool_engine:
        requests["tool engine"] = asyncio.run(_through_tool_engine(copies[0], args.dir))
    report["requests"] = requests
    report["top_level"] = sorted({name.split(".")[0] for name in sys.modules} & {"coordkit"})
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
