"""Megatron-LM PR #6675's own coordinator (head b0a1727), run as a process: the oracle
the differential tests (tests/test_megatron_pr6675_differential.py) hold coordkit to.

The PR's files are not in this repository and are never copied into it: they are
read from ``$COORDKIT_MEGATRON_REFERENCE/megatron-pr6675-b0a1727/`` (each file's
original path with ``/`` written ``__``), and a test without that variable skips.
:func:`build_tree` places them at their real module paths in a temporary directory
(``megatron/core/inference/disaggregation/coordinator_runtime.py``, ...) next to a
few shims; :class:`ReferenceCoordinator` runs the PR's
``DataParallelInferenceCoordinator`` there (``disaggregated=True``, its zmq loop,
its ROUTER_MANDATORY socket on tcp) in a process of its own, so that the same real
peers (tests/support/megatron_pd.py) talk to it as they talk to coordkit.

Unmodified PR files: ``headers.py``, ``disaggregation/coordinator_runtime.py``,
``coordinator_flow_control.py``, ``coordinator_routing.py``,
``handoff_wire_protocol.py``, ``data_parallel_inference_coordinator/coordinator.py``,
``handlers.py``, ``state.py``.

Shims, each for an import the coordinator's P/D logic does not use:

* ``torch``: a ``Tensor`` class no prompt is an instance of (the handlers only ask
  ``isinstance(prompt, torch.Tensor)``; hashing, which would build tensors, is off:
  prefix caching is not enabled);
* ``megatron.core.inference.config``: the ``PrefixCachingCoordinatorPolicy`` enum;
* ``megatron.core.inference.inference_request``: ``compute_block_hashes_batched``
  (never called: prefix caching off);
* ``...text_generation_controller.TextGenerationController.detokenize``: returns
  ``None`` -- the coordinator has no tokenizer here, so a finished request keeps the
  engine's ``generated_text`` (None), as coordkit without a ``detokenizer`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENV = "COORDKIT_MEGATRON_REFERENCE"
RELEASE = "megatron-pr6675-b0a1727"

#: The PR's files this oracle runs: reference name -> module path under the tree.
FILES = {
    "headers.py": "megatron/core/inference/headers.py",
    "disaggregation__coordinator_runtime.py": (
        "megatron/core/inference/disaggregation/coordinator_runtime.py"
    ),
    "disaggregation__coordinator_flow_control.py": (
        "megatron/core/inference/disaggregation/coordinator_flow_control.py"
    ),
    "disaggregation__coordinator_routing.py": (
        "megatron/core/inference/disaggregation/coordinator_routing.py"
    ),
    "disaggregation__handoff_wire_protocol.py": (
        "megatron/core/inference/disaggregation/handoff_wire_protocol.py"
    ),
    "data_parallel_inference_coordinator__coordinator.py": (
        "megatron/core/inference/data_parallel_inference_coordinator/coordinator.py"
    ),
    "data_parallel_inference_coordinator__handlers.py": (
        "megatron/core/inference/data_parallel_inference_coordinator/handlers.py"
    ),
    "data_parallel_inference_coordinator__state.py": (
        "megatron/core/inference/data_parallel_inference_coordinator/state.py"
    ),
}

SHIMS = {
    "torch/__init__.py": (
        '"""A shim: the coordinator only asks whether a prompt is a tensor."""\n\n'
        "int64 = 'int64'\n\n\n"
        "class Tensor:\n    pass\n\n\n"
        "def tensor(*args, **kwargs):\n"
        "    raise RuntimeError('no torch in the P/D oracle: prefix caching is off')\n"
    ),
    "megatron/core/inference/config.py": (
        "from enum import Enum\n\n\n"
        "class PrefixCachingCoordinatorPolicy(str, Enum):\n"
        "    FIRST_PREFIX_BLOCK = 'first_prefix_block'\n"
        "    LONGEST_PREFIX = 'longest_prefix'\n"
        "    LOAD_BALANCED = 'load_balanced'\n"
    ),
    "megatron/core/inference/inference_request.py": (
        "def compute_block_hashes_batched(tokens, block_size):\n"
        "    raise RuntimeError('prefix caching is off in the P/D oracle')\n"
    ),
    "megatron/core/inference/text_generation_controllers/text_generation_controller.py": (
        "class TextGenerationController:\n"
        "    @staticmethod\n"
        "    def detokenize(tokenizer, tokens, remove_EOD=True):\n"
        "        return None\n"
    ),
}

# Runs the PR's coordinator as its entrypoint does, the address printed for the test.
RUNNER = """\
import logging
import sys

from megatron.core.inference.data_parallel_inference_coordinator.coordinator import (
    DataParallelInferenceCoordinator,
)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


class Pipe:
    def send(self, address):
        print(address, flush=True)

    def close(self):
        pass


coordinator = DataParallelInferenceCoordinator(
    Pipe(), 0, None, int(sys.argv[1]), hostname="127.0.0.1", disaggregated=True
)
coordinator.start()
"""


def reference_dir() -> Path | None:
    """The PR's files, or None when ``$COORDKIT_MEGATRON_REFERENCE`` is unset."""
    root = os.environ.get(ENV)
    if not root:
        return None
    return Path(root) / RELEASE


def require_reference() -> Path:
    """The PR's files; the test skips (one line) without them."""
    path = reference_dir()
    if path is None:
        pytest.skip(f"{ENV} is unset: no PR #6675 coordinator to compare with")
    if not (path / "disaggregation__coordinator_runtime.py").is_file():
        pytest.skip(f"{ENV} has no {RELEASE}/ with the PR's coordinator")
    return path


def build_tree(source: Path, root: Path) -> Path:
    """The PR's files at their module paths under ``root``, with the shims; ``root``."""
    for name, module in FILES.items():
        target = root / module
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target)
    for module, text in SHIMS.items():
        target = root / module
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    for package in [p for p in root.rglob("*") if p.is_dir()]:
        init = package / "__init__.py"
        if not init.exists():
            init.write_text("")
    (root / "run_pr6675_coordinator.py").write_text(RUNNER)
    return root


class ReferenceCoordinator:
    """The PR's coordinator process on a tree :func:`build_tree` made; ``address`` is
    its tcp endpoint. ``max_requests`` is main's per-rank bound (unused by P/D)."""

    def __init__(self, tree: Path, max_requests: int = 64):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.process = subprocess.Popen(
            [sys.executable, str(tree / "run_pr6675_coordinator.py"), str(max_requests)],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()
        if not self.address:
            self.process.wait(5)
            raise RuntimeError(f"the PR's coordinator did not start ({self.process.returncode})")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
