"""Megatron-LM's own coordinator, from reference copies of its files, as an oracle.

The copies are not in the repository: ``COORDKIT_MEGATRON_REFERENCE`` names a
directory of releases (``megatron-core-0.19/``, ``megatron-main-d98e8a6/``, ...),
each holding the files of ``megatron/core/inference/`` with their subdirectory
joined by ``__`` (``data_parallel_inference_coordinator__handlers.py``).
:func:`build_tree` lays a release out as the package it came from, beside small
shims for what the coordinator imports and its logic does not use (the prefix
policy enum, block hashing, the detokenizer, and ``torch`` where it is not
installed: the coordinator only asks whether a prompt is a tensor); the path it
returns goes on ``sys.path``. Run as a script, this module serves the release's
``DataParallelInferenceCoordinator`` on its own zmq loop and prints its address
(:func:`reference_coordinator` starts one).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ENV = "COORDKIT_MEGATRON_REFERENCE"

#: Modules the coordinators import for what none of the tests drive (prefix routing
#: hashes prompts only with prefix caching on; a detokenizer only with a tokenizer).
SHIMS = {
    "megatron/core/inference/config.py": """
from enum import Enum

class PrefixCachingCoordinatorPolicy(str, Enum):
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    LONGEST_PREFIX = "longest_prefix"
    LOAD_BALANCED = "load_balanced"
""",
    "megatron/core/inference/inference_request.py": """
def compute_block_hashes_batched(tokens, block_size):
    raise NotImplementedError("prefix caching is not shimmed")
""",
    "megatron/core/inference/text_generation_controllers/text_generation_controller.py": """
class TextGenerationController:
    @staticmethod
    def detokenize(tokenizer, tokens, remove_EOD=True):
        return None if tokenizer is None else tokenizer.detokenize(tokens)
""",
}

#: torch, where it is not installed: the coordinators test prompts against torch.Tensor.
TORCH_SHIM = """
class Tensor:
    pass

def tensor(*args, **kwargs):
    raise NotImplementedError("torch is not installed")
"""


def release_dir(name: str) -> Path | None:
    """The reference copies of release ``name``, or None when they are not given."""
    root = os.environ.get(ENV)
    return Path(root) / name if root else None


def build_tree(release: Path, into: Path, shims: dict[str, str] | None = None) -> str:
    """``release``'s files as ``megatron/core/inference/...`` under ``into``, with the
    shims (``SHIMS``, then ``shims``: path -> source); the sys.path entry to import it."""
    package = into / "megatron" / "core" / "inference"
    for source in release.glob("*.py"):
        if source.name.startswith("tests__"):
            continue
        target = package.joinpath(*source.name.split("__"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    for path, text in {**SHIMS, **(shims or {})}.items():
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_text(text)
    if importlib.util.find_spec("torch") is None:
        (into / "torch.py").write_text(TORCH_SHIM)
    for directory in [into / "megatron", *(into / "megatron").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return str(into)


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
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    module = importlib.import_module(
        "megatron.core.inference.data_parallel_inference_coordinator.coordinator"
    )
    module.DataParallelInferenceCoordinator.entrypoint(
        _Pipe(), _Ready(), args.engines, None, args.max_requests, hostname="127.0.0.1"
    )


@contextlib.contextmanager
def reference_coordinator(tree: str, engines: int) -> Iterator[tuple[subprocess.Popen, str]]:
    """The coordinator of the tree at ``tree`` in a process of its own, waiting for
    ``engines`` registrations (it sets ready once they came): the process and its
    address. Killed at exit."""
    command = [sys.executable, "-m", "tests.support.megatron_reference"]
    command += ["--tree", tree, "--engines", str(engines)]
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


if __name__ == "__main__":
    _main()
