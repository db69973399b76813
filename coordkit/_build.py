"""The Cython extensions of this package, under whatever name it lives by.

coordkit's own ``setup.py`` is one call of :func:`extensions`; a stack that
vendors coordkit (say as ``hoststack._vendor.coordkit``) makes the same call
with its package name and path::

    import runpy
    from setuptools import setup

    build = runpy.run_path("src/hoststack/_vendor/coordkit/_build.py")
    setup(
        package_dir={"": "src"},
        ext_modules=build["extensions"](
            package="hoststack._vendor.coordkit", path="src/hoststack/_vendor/coordkit"
        ),
    )

This file is run by path, not imported: importing the package would need
pyzmq, msgpack and the very extensions being built. It needs setuptools and
Cython only. The extensions do not link libzmq (they bind pyzmq's at import,
``includes/libzmq.h``), so no ``zmq.h`` is needed either.

A host's own Cython module that cimports coordkit's public ``__init__.pxd``
is built with :func:`extension` (the same include directory and libraries).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: ``debug=True``: the DEBUG counters compiled in (``includes/sysdep.h``) and
#: Cython's line tracing, so coverage and profilers see the .pyx lines.
DEBUG_MACROS = [("COORDKIT_DEBUG", "1"), ("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]


def extension(name: str, sources: list[str], path: str, *, debug: bool = False) -> Any:
    """A ``setuptools.Extension`` named ``name`` that cimports the coordkit at ``path``.

    Its headers are included as ``includes/<name>.h`` from ``path``; ``-ldl``
    on Linux, for the binding's ``dlopen``; ``-O3``, or ``-O0 -g`` with the
    DEBUG macros when ``debug``.
    """
    from setuptools import Extension

    return Extension(
        name,
        sources,
        include_dirs=[str(path)],
        libraries=["dl"] if sys.platform.startswith("linux") else [],
        define_macros=DEBUG_MACROS if debug else [],
        extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
    )


def extensions(
    package: str,
    path: str,
    debug: bool = False,
    annotate: bool = False,
    force: bool = False,
) -> list[Any]:
    """Every ``path/*.pyx`` as the extension ``package.<stem>``, cythonized.

    ``path`` is the package's directory, relative to the ``setup.py`` that
    calls this (setuptools wants relative sources), and ends with the parts of
    ``package``. ``annotate`` writes Cython's HTML annotation (always with
    ``debug``); ``force`` regenerates the C files, so that a switch between a
    debug and an optimized build leaves nothing of the other.
    """
    from Cython.Build import cythonize

    parts = package.split(".")
    directory = Path(path)
    if directory.resolve().parts[-len(parts) :] != tuple(parts):
        raise ValueError(f"the package {package!r} cannot live in {path!r}: its name ends the path")
    root = directory.resolve().parents[len(parts) - 1]
    directives: dict[str, Any] = {"language_level": "3", "embedsignature": True}
    if debug:
        directives["linetrace"] = True
    modules = [
        extension(f"{package}.{source.stem}", [str(source)], path, debug=debug)
        for source in sorted(directory.glob("*.pyx"))
    ]
    return cythonize(
        modules,
        include_path=[str(root)],  # the relative cimports resolve from the package's root
        compiler_directives=directives,
        annotate=debug or annotate,
        force=force,
    )
