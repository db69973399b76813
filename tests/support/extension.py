"""Build ``_zmqutil_c``, the test-only Cython user of coordkit's raw libzmq binding.

The helper is not part of the wheel: it is compiled once per test session,
against the ``_libzmq.pxd`` and ``_libzmq.h`` of the coordkit under test, into
a directory the session owns. The build runs in a child Python so that the
compiler's output can be quoted when it fails, and stays out of the test run's
output when it does not. Run as a script, this module is that child.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

NAME = "_zmqutil_c"
SOURCE = Path(__file__).with_name(f"{NAME}.pyx")


class BuildError(Exception):
    """The helper did not compile: the build's last line, and all of it in ``output``."""

    def __init__(self, output: str):
        last = output.strip().splitlines()[-1] if output.strip() else "no output"
        super().__init__(f"{NAME} did not build: {last}")
        self.output = output


def build(build_dir: Path) -> ModuleType:
    """Compile the helper into ``build_dir`` and import it.

    Raises BuildError when it does not compile, ImportError when it cannot bind
    to pyzmq's libzmq at import.
    """
    import coordkit  # the package under test: its binding is what gets compiled in

    package = Path(coordkit.__file__).parent
    # A copy outside any package: its module name is NAME, not tests.support.NAME.
    shutil.copy(SOURCE, build_dir / SOURCE.name)
    result = subprocess.run(
        [sys.executable, __file__, str(build_dir / SOURCE.name), str(package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise BuildError(result.stdout + result.stderr)
    path = result.stdout.strip().splitlines()[-1]
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(source: Path, package: Path) -> Path:
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    extension = Extension(
        NAME,
        [str(source)],
        include_dirs=[str(package)],  # _libzmq.h
        libraries=["dl"] if sys.platform.startswith("linux") else [],
        extra_compile_args=["-O0"],  # a test helper: compile fast
    )
    modules = cythonize(
        [extension],
        include_path=[str(package.parent)],  # cimport coordkit._libzmq
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
    distribution = Distribution({"name": NAME, "ext_modules": modules})
    distribution.verbose = 0
    command = distribution.get_command_obj("build_ext")
    command.build_lib = str(source.parent)
    command.build_temp = str(source.parent / "tmp")
    command.ensure_finalized()
    command.run()
    return Path(command.get_ext_fullpath(NAME))


if __name__ == "__main__":
    print(_compile(Path(sys.argv[1]), Path(sys.argv[2])))
