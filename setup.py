"""Build the Cython extensions unless COORDKIT_PUREPYTHON=1.

The extensions do not link libzmq: at import they bind to the copy pyzmq
already loaded (see coordkit/_libzmq.h), so no zmq.h is needed here.

``COORDKIT_DEBUG=1`` builds for debugging (``make debug``): the DEBUG
counters compiled in, Cython's line tracing (``CYTHON_TRACE``, so coverage
and profilers see the .pyx lines), ``-O0 -g`` and the HTML annotation.
``COORDKIT_ANNOTATE=1`` writes the annotation of an optimized build.
``build_ext --force`` regenerates the C files too, so a switch between the
two builds leaves nothing of the other.
"""

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

EXTENSIONS = sorted(p.stem for p in Path(__file__).parent.joinpath("coordkit").glob("*.pyx"))


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def extensions():
    if _flag("COORDKIT_PUREPYTHON"):
        return []
    from Cython.Build import cythonize

    debug = _flag("COORDKIT_DEBUG")
    directives = {"language_level": "3", "embedsignature": True}
    macros = []
    if debug:
        directives["linetrace"] = True
        macros = [("COORDKIT_DEBUG", "1"), ("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]
    modules = [
        Extension(
            f"coordkit.{name}",
            [f"coordkit/{name}.pyx"],
            include_dirs=["coordkit"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            define_macros=macros,
            extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
        )
        for name in EXTENSIONS
    ]
    return cythonize(
        modules,
        compiler_directives=directives,
        annotate=debug or _flag("COORDKIT_ANNOTATE"),
        force="--force" in sys.argv or "-f" in sys.argv,
    )


setup(ext_modules=extensions())
