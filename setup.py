"""Build the Cython extensions unless COORDKIT_PUREPYTHON=1: one call of coordkit/_build.py.

``COORDKIT_DEBUG=1`` builds for debugging (``make debug``): the DEBUG
counters compiled in, Cython's line tracing (``CYTHON_TRACE``, so coverage
and profilers see the .pyx lines), ``-O0 -g`` and the HTML annotation.
``COORDKIT_ANNOTATE=1`` writes the annotation of an optimized build.
``build_ext --force`` regenerates the C files too, so a switch between the
two builds leaves nothing of the other.
"""

import os
import runpy
import sys

from setuptools import setup


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def extensions():
    if _flag("COORDKIT_PUREPYTHON"):
        return []
    build = runpy.run_path("coordkit/_build.py")
    return build["extensions"](
        package="coordkit",
        path="coordkit",
        debug=_flag("COORDKIT_DEBUG"),
        annotate=_flag("COORDKIT_ANNOTATE"),
        force="--force" in sys.argv or "-f" in sys.argv,
    )


setup(ext_modules=extensions())
