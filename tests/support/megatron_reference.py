"""Megatron-LM's own coordinator, from reference copies of its files, as an oracle.

The copies are not in the repository: ``COORDKIT_MEGATRON_REFERENCE`` names a
directory of releases (``RELEASES``), each holding files of ``megatron/core/inference/``
with their subdirectory joined by ``__`` (``data_parallel_inference_coordinator__handlers.py``);
:func:`release_dir` finds one, and the test skips without the variable.
:func:`build_tree` lays a release out, unmodified, as the package it came from,
beside shims for what the coordinators import and their logic does not use:

* ``torch``: a ``Tensor`` no prompt is an instance of (a prompt comes through
  msgpack; the handlers only ask ``isinstance(prompt, torch.Tensor)``) and a
  ``tensor`` that raises (only block hashing builds one);
* ``megatron.core.inference.config``: the ``PrefixCachingCoordinatorPolicy`` enum;
* ``megatron.core.inference.inference_request``: ``compute_block_hashes_batched``,
  which raises (prefix caching is off);
* ``...text_generation_controller.TextGenerationController.detokenize``: ``None``
  (the coordinator has no tokenizer), so a final keeps the engine's ``generated_text``.

Run as a script, this module serves the release's ``DataParallelInferenceCoordinator``
on its own zmq loop and prints its address, then ``ready`` once its engines registered;
:func:`reference_coordinator` starts one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ENV = "COORDKIT_MEGATRON_REFERENCE"

#: The releases the tests compare with: the version coordkit is told -> its directory.
RELEASES = {
    "0.19": "megatron-core-0.19",
    "main": "megatron-main-d98e8a6",
    "pr6675": "megatron-pr6675-b0a1727",
}

#: Module path -> source, laid over the release's files.
SHIMS = {
    "torch.py": """
class Tensor:
    pass

def tensor(*args, **kwargs):
    raise NotImplementedError("torch is shimmed: prefix caching is off")
""",
    "megatron/core/inference/config.py": """
from enum import Enum

class PrefixCachingCoordinatorPolicy(str, Enum):
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    LONGEST_PREFIX = "longest_prefix"
    LOAD_BALANCED = "load_balanced"
""",
    "megatron/core/inference/inference_request.py": """
def compute_block_hashes_batched(tokens, block_size):
    raise NotImplementedError("prefix caching is off")
""",
    "megatron/core/inference/text_generation_controllers/text_generation_controller.py": """
class TextGenerationController:
    @staticmethod
    def detokenize(tokenizer, tokens, remove_EOD=True):
        return None
""",
}


def release_dir(name: str) -> Path:
    """The reference copies of release ``name``; the test skips (one line) without them."""
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(f"{ENV} is unset: no Megatron coordinator to compare with")
    return Path(root) / name


def build_tree(release: Path, into: Path) -> Path:
    """``release``'s files as ``megatron/core/inference/...`` under ``into``, with the
    shims; ``into``, the sys.path entry to import them."""
    package = into / "megatron" / "core" / "inference"
    for source in release.glob("*.py"):
        if source.name.startswith("tests__"):
            continue
        target = package.joinpath(*source.name.split("__"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    for path, text in SHIMS.items():
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_text(text)
    for directory in [into / "megatron", *(into / "megatron").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return into


class _Pipe:
    """The pipe the coordinator sends its address through: our stdout."""

    def send(self, address: str) -> None:
        print(address, flush=True)

    def close(self) -> None:
        pass


class _Ready:
    def set(self) -> None:
        print("ready", flush=True)


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Megatron's own coordinator, from a reference")
    parser.add_argument("--tree", required=True, help="a path build_tree returned")
    parser.add_argument("--engines", type=int, required=True, help="data_parallel_size")
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--disaggregated", action="store_true", help="#6675's P/D runtime")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    module = importlib.import_module(
        "megatron.core.inference.data_parallel_inference_coordinator.coordinator"
    )
    # Only #6675's entrypoint takes disaggregated: the releases' is called as they call it.
    options = {"disaggregated": True} if args.disaggregated else {}
    module.DataParallelInferenceCoordinator.entrypoint(
        _Pipe(), _Ready(), args.engines, None, args.max_requests, hostname="127.0.0.1", **options
    )


@contextlib.contextmanager
def reference_coordinator(
    tree: Path, engines: int, disaggregated: bool = False
) -> Iterator[tuple[subprocess.Popen, str]]:
    """The coordinator of the tree at ``tree`` in a process of its own, waiting for
    ``engines`` registrations (it says ready once they came; with 0, at once): the
    process and its address. Killed at exit."""
    command = [sys.executable, "-m", "tests.support.megatron_reference"]
    command += ["--tree", str(tree), "--engines", str(engines)]
    command += ["--disaggregated"] if disaggregated else []
    root = Path(__file__).parent.parent.parent
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()
        assert address.startswith("tcp://"), f"the reference coordinator said {address!r}"
        yield process, address
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


if __name__ == "__main__":
    _main()
