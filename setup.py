"""Build the Cython extensions unless COORDKIT_PUREPYTHON=1.

The extensions do not link libzmq: at import they bind to the copy pyzmq
already loaded (see coordkit/_libzmq.h), so no zmq.h is needed here.
"""

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

EXTENSIONS = sorted(p.stem for p in Path(__file__).parent.joinpath("coordkit").glob("*.pyx"))


def extensions():
    if os.environ.get("COORDKIT_PUREPYTHON", "") not in ("", "0"):
        return []
    from Cython.Build import cythonize

    libraries = ["dl"] if sys.platform.startswith("linux") else []
    macros = [("COORDKIT_DEBUG", "1")] if os.environ.get("COORDKIT_DEBUG") else []
    modules = [
        Extension(
            f"coordkit.{name}",
            [f"coordkit/{name}.pyx"],
            include_dirs=["coordkit"],
            libraries=libraries,
            define_macros=macros,
            extra_compile_args=["-O3"],
        )
        for name in EXTENSIONS
    ]
    return cythonize(
        modules,
        compiler_directives={"language_level": "3", "embedsignature": True},
        annotate=bool(os.environ.get("COORDKIT_ANNOTATE")),
    )


setup(ext_modules=extensions())
