"""coordkit: a data-parallel inference coordinator, in Cython and in pure Python.

The implementation is chosen once, here, at import, from the environment:

* ``COORDKIT_PUREPYTHON=1`` selects the pure-Python reference;
* otherwise the Cython extensions are imported, and if that fails the package
  falls back to pure Python with a ``RuntimeWarning`` naming the import error;
* ``COORDKIT_REQUIRE_EXTENSION=1`` turns that fallback into an ``ImportError``.

``coordkit.IMPLEMENTATION`` says which one is live (``"c"`` or ``"py"``);
:func:`load_implementation` gives either one explicitly, for tests and
benchmarks that compare them, and ``Coordinator(..., implementation="py")``
runs a coordinator on either.
"""

from __future__ import annotations

from ._implementation import Implementation, load_implementation, selected
from .client import Client, CoordinatorError
from .coordinator import Coordinator
from .engine import Engine
from .protocol import ErrorCode, Header, ProtocolError

__all__ = [
    "IMPLEMENTATION",
    "Coordinator",
    "Implementation",
    "load_implementation",
    "Header",
    "ErrorCode",
    "ProtocolError",
    "Client",
    "CoordinatorError",
    "Engine",
]
__version__ = "0.1.0"

#: ``"c"`` or ``"py"``: the implementation chosen at import.
IMPLEMENTATION: str = selected().name
