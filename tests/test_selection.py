"""The implementation is chosen once, at import, from the environment.

Each case imports coordkit afresh in a subprocess with the variables set; the
"broken build" is real: a copy of the package without its compiled modules.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

import coordkit

PACKAGE = Path(coordkit.__file__).parent
REPORT = (
    "import coordkit; impl = coordkit.load_implementation(coordkit.IMPLEMENTATION); "
    "print(coordkit.IMPLEMENTATION, impl.loop.__name__, impl.codec.__name__)"
)


def run(env: dict[str, str], copy: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Import coordkit in a new interpreter: the installed one, or a ``copy`` of it.

    For a copy, ``-S`` keeps site-packages' .pth files out: an editable install
    adds an import hook there that would find the real package's modules.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COORDKIT_")}
    if copy is None:
        flags, path = [], PACKAGE.parent
    else:
        dependencies = [Path(module.__file__).parent.parent for module in (zmq, msgpack)]
        flags, path = ["-S"], os.pathsep.join(map(str, [copy, *dependencies]))
    return subprocess.run(
        [sys.executable, *flags, "-W", "always", "-c", REPORT],
        env={**clean, "PYTHONPATH": str(path), **env},
        cwd=copy or PACKAGE.parent,  # `-c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def without_extensions(tmp_path) -> Path:
    """A copy of the package whose extensions were never built: its sources, nothing compiled."""
    compiled = shutil.ignore_patterns("*.so", "*.pyd", "*.c", "__pycache__")
    shutil.copytree(PACKAGE, tmp_path / "coordkit", ignore=compiled)
    return tmp_path


def test_purepython_selects_the_reference():
    result = run({"COORDKIT_PUREPYTHON": "1"})
    assert result.stdout.split() == ["py", "coordkit._loop_py", "coordkit._codec_py"]
    assert "RuntimeWarning" not in result.stderr


@pytest.mark.c_extension
@pytest.mark.parametrize("env", [{}, {"COORDKIT_PUREPYTHON": "0"}, {"COORDKIT_PUREPYTHON": ""}])
def test_the_extension_is_the_default(c_impl, env):
    # c_impl: skipped without the extension (failed under COORDKIT_REQUIRE_EXTENSION=1)
    result = run(env)
    assert result.stdout.split() == ["c", "coordkit._loop_c", "coordkit._codec_c"]


def test_a_missing_extension_falls_back_loudly(without_extensions):
    result = run({}, without_extensions)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "py"
    assert "RuntimeWarning" in result.stderr
    assert "coordkit._codec_c" in result.stderr  # the warning names the import error


def test_require_extension_turns_the_fallback_into_an_error(without_extensions):
    result = run({"COORDKIT_REQUIRE_EXTENSION": "1"}, without_extensions)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "COORDKIT_REQUIRE_EXTENSION" in result.stderr


def test_load_implementation_rejects_unknown_names():
    with pytest.raises(ValueError):
        coordkit.load_implementation("rust")
