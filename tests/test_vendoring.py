"""coordkit vendored into a host stack under another package name, built and run.

The session builds the copy once (``vendored``, tests/support/vendoring.py):
the coordkit under test in ``src/hoststack/_vendor/coordkit``, the docs'
host ``setup.py``, ``python setup.py build_ext --inplace``. Then, in child
Pythons: the copy imports and serves round trips on both implementations with
no top-level ``coordkit`` anywhere on the path, its tools start engines of
their own copy, and it runs beside the installed coordkit in one process,
each serving the other's clients and engines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import coordkit
from tests.support import vendoring
from tests.support.processes import ROOT, python_env

SCRIPT = Path(vendoring.__file__)
CHILD_TIMEOUT = 240  # seconds: a dozen clusters, one after the other


def child(vendored: vendoring.Vendored, tmp_path: Path, *args: str, isolated: bool) -> dict:
    """vendoring.py run as a child: ``isolated``, with nothing on its path but the host's
    tree and pyzmq and msgpack (``-S``: no site-packages; ``-I``: no PYTHON* variables,
    no working directory); otherwise beside the coordkit under test."""
    if isolated:
        command = [sys.executable, "-S", "-I", str(SCRIPT), "--path", str(vendored.deps)]
    else:
        command = [sys.executable, str(SCRIPT)]
    command += ["--path", str(vendored.src), "--dir", str(tmp_path), *args]
    result = subprocess.run(
        command,
        env=python_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_the_docs_show_what_the_host_does():
    page = (ROOT / "docs" / "building.md").read_text()
    section = page[page.index("## Building and vendoring under another name") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", section, re.M | re.S)
    assert [textwrap.dedent(code) for _, code in blocks] == [vendoring.HOST_SETUP]
    assert f"`python {' '.join(vendoring.BUILD)}`" in section


@pytest.mark.timeout(900)  # the first test to use `vendored` waits for its build
def test_a_vendored_copy_runs_with_no_top_level_coordkit(vendored, tmp_path):
    report = child(vendored, tmp_path, "--tool-engine", vendoring.PACKAGE, isolated=True)
    assert report["coordkit_importable"] is False
    assert report["top_level"] == []
    copy = report["copies"][vendoring.PACKAGE]
    assert Path(copy["file"]).is_relative_to(vendored.src)
    assert copy["implementation"] == "c"
    for role, name in copy["cores"].items():
        assert name == f"{vendoring.PACKAGE}._{role}_c"
    assert all(Path(f).is_relative_to(vendored.src) for f in copy["core_files"])
    assert copy["logger"] == vendoring.PACKAGE
    assert copy["tool_engine_command"] == vendoring.PACKAGE  # python -m hoststack._vendor.coordkit
    assert report["requests"] == {
        f"{impl}: {vendoring.PACKAGE} serving {vendoring.PACKAGE}": 6 for impl in ("c", "py")
    } | {"tool engine": 6}


@pytest.mark.timeout(900)
def test_two_copies_in_one_process(vendored, tmp_path):
    report = child(vendored, tmp_path, "coordkit", vendoring.PACKAGE, isolated=False)
    assert report["coordkit_importable"] is True
    installed, copy = report["copies"]["coordkit"], report["copies"][vendoring.PACKAGE]
    assert Path(installed["file"]) == Path(coordkit.__file__)
    # each binds pyzmq's libzmq and loads its cores on its own, and logs under its own name
    assert set(installed["core_files"]).isdisjoint(copy["core_files"])
    assert installed["cores"]["loop"] == "coordkit._loop_c"
    assert copy["cores"]["loop"] == f"{vendoring.PACKAGE}._loop_c"
    assert (installed["logger"], copy["logger"]) == ("coordkit", vendoring.PACKAGE)
    pairs = [
        (a, b) for a in ("coordkit", vendoring.PACKAGE) for b in ("coordkit", vendoring.PACKAGE)
    ]
    assert report["requests"] == {
        f"{impl}: {a} serving {b}": 6 for impl in ("c", "py") for a, b in pairs
    } | {f"{impl}: at once": 12 for impl in ("c", "py")}
