"""Builds the tests need compiled, each once per test session, in a child Python.

* :func:`build` compiles one of the test-only Cython helpers next to this file
  (``_zmqutil_c``, ``_codec_extras_c``): modules outside any package that
  cimport the coordkit under test as a host's own code does (its public
  ``__init__.pxd``, its ``includes/``), built with that coordkit's
  ``_build.extension``. They are not part of the wheel.
* :func:`run` runs any build command (the vendored copy's ``setup.py``, see
  vendoring.py) the same way.

A build runs in a child Python so that the compiler's output can be quoted
when it fails, and stays out of the test run's output when it does not. Run
as a script, this module is the child that compiles a helper.
"""

from __future__ import annotations

import importlib.util
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
TIMEOUT = 600  # seconds: the vendored copy compiles every extension at -O3


class BuildError(Exception):
    """A build failed: its last line, and all of it in ``output``."""

    def __init__(self, what: str, output: str):
        last = output.strip().splitlines()[-1] if output.strip() else "no output"
        super().__init__(f"{what} did not build: {last}")
        self.output = output


def run(what: str, command: list[str], cwd: Path) -> str:
    """Run a build command in ``cwd``; its output, or BuildError naming ``what``."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    if result.returncode != 0:
        raise BuildError(what, result.stdout + result.stderr)
    return result.stdout


def package_dir() -> Path:
    """The directory of the coordkit under test: its sources are what get compiled in."""
    import coordkit

    return Path(coordkit.__file__).parent


def build(name: str, build_dir: Path) -> ModuleType:
    """Compile ``tests/support/<name>.pyx`` into ``build_dir`` and import it.

    Raises BuildError when it does not compile, ImportError when it cannot bind
    to pyzmq's libzmq at import.
    """
    source = build_dir / f"{name}.pyx"
    # A copy outside any package: its module name is `name`, not tests.support.<name>.
    shutil.copy(HERE / source.name, source)
    output = run(name, [sys.executable, __file__, str(source), str(package_dir())], build_dir)
    path = output.strip().splitlines()[-1]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(source: Path, package: Path) -> Path:
    from Cython.Build import cythonize
    from setuptools import Distribution

    helpers = runpy.run_path(str(package / "_build.py"))  # by path: no import of the package
    extension = helpers["extension"](source.stem, [str(source)], str(package))
    extension.extra_compile_args = ["-O0"]  # a test helper: compile fast
    modules = cythonize(
        [extension],
        include_path=[str(package.parent)],  # cimport coordkit
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
    distribution = Distribution({"name": source.stem, "ext_modules": modules})
    distribution.verbose = 0
    command = distribution.get_command_obj("build_ext")
    command.build_lib = str(source.parent)
    command.build_temp = str(source.parent / "tmp")
    command.ensure_finalized()
    command.run()
    return Path(command.get_ext_fullpath(source.stem))


if __name__ == "__main__":
    print(_compile(Path(sys.argv[1]), Path(sys.argv[2])))
