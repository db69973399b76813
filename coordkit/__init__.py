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

from typing import TYPE_CHECKING, Any

from ._implementation import Implementation, load_implementation, selected
from .client import Client, CoordinatorError
from .coordinator import Coordinator
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
    "FakeEngine",
]
__version__ = "0.1.0"

#: ``"c"`` or ``"py"``: the implementation chosen at import.
IMPLEMENTATION: str = selected().name

if TYPE_CHECKING:
    from .engine import Engine
    from .tools.fake_engine import FakeEngine


def __getattr__(name: str) -> Any:
    # Lazy: importing coordkit loads neither the engine side nor the tools.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "FakeEngine":
        from .tools.fake_engine import FakeEngine

        return FakeEngine
    raise AttributeError(f"module 'coordkit' has no attribute {name!r}")
